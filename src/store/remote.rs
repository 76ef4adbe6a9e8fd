//! A store across the network, as the store layer speaks it: every operation is a
//! conversation of HTTP calls that the store's own state machine drives, pure, from the answers
//! it is handed. The worker (`worker/remote.rs`) makes the calls as Envoy callouts; the etcd store
//! starts its conversations through the one storage interface (`store::seam`); a blocking
//! client drives the same conversations in the conformance tests.

use crate::config::etcd::{OnStoreError, Protocol};
use crate::store::{Claim, StoreAnswer, StoreOp};

/// Where and how to reach the store, and what its failure means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSettings {
    /// The Envoy cluster of the store's endpoints.
    pub cluster: String,
    /// The callouts' `:authority`: Envoy requires one and the store's HTTP server checks it is
    /// a valid host (an Istio cluster name such as `outbound|2379||etcd...` is not).
    pub authority: String,
    /// Per callout; Envoy answers a callout that takes longer with a synthesized 504.
    pub timeout_ms: u32,
    pub on_error: OnStoreError,
    /// JSON over HTTP/1.1, or gRPC (the calls' headers, and where their status is).
    pub protocol: Protocol,
}

/// One HTTP answer (or Envoy's report that the callout failed: `status: None`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Answer {
    pub status: Option<u16>,
    pub body: Vec<u8>,
    /// A gRPC call's `grpc-status` and `grpc-message` (None for JSON, or when absent).
    pub grpc: Option<GrpcStatus>,
    /// Envoy made this answer itself: the store's own never reached it (no connection, a reset
    /// before its headers, no healthy host). Only told for an answer that did not succeed
    /// (`worker::remote::read_answer`).
    pub from_envoy: bool,
}

impl Answer {
    /// Whether the store answered the call as it answers one it carried out: an HTTP 200, and
    /// over gRPC a `grpc-status` of 0 (a compare that failed is such an answer).
    pub fn succeeded(&self) -> bool {
        self.status == Some(200) && self.grpc.as_ref().is_none_or(|g| g.code == 0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcStatus {
    pub code: u32,
    pub message: String,
}

/// A POST the store wants made (its body JSON, or one gRPC message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub path: &'static str,
    pub body: Vec<u8>,
    /// Sent as `authorization` (JSON) or `token` (gRPC metadata) when present.
    pub token: Option<String>,
    /// This call's timeout, when not the store's `timeout_ms` (the etcd token fetch has its own).
    pub timeout_ms: Option<u32>,
    /// The shard it goes to (`Store::remote_for`): 0 for a store of one.
    pub shard: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Call(Request),
    /// Waiting for something another conversation of this store is fetching (the etcd token):
    /// step again with `None` once `RemoteStore::take_woken` is true, and on every tick (a wait
    /// ends by itself at its deadline).
    Wait,
    Done(StoreAnswer),
}

/// One store operation in progress.
pub trait Conversation {
    /// First with `None`, then with the answer to the last `Call` (`None` again after `Wait`).
    fn step(&mut self, answer: Option<Answer>, now_ms: u64) -> Next;
    /// The operation, to start it again in a new conversation.
    fn into_op(self: Box<Self>) -> StoreOp;
    /// A begin that failed or is given up on: the claim the store may hold for it although
    /// nobody will forward the request (its write went out and the answer was lost), for the
    /// caller to release.
    fn unanswered_claim(&self) -> Option<Claim> {
        None
    }
}
