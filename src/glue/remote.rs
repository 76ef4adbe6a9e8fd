//! A store across the network, as the glue sees it: every operation is a conversation of HTTP
//! callouts (`dispatch_http_call`) that the store's own state machine drives, pure, from the
//! answers the glue hands back. The etcd store (`store::etcd`) is adapted to these two traits in
//! `glue/etcd.rs`; the native tests script a conversation of their own.
//!
//! What the glue decides here, and the store does not: a callout Envoy refused or that failed
//! (no `:status`) and a timeout (Envoy's synthesized 504) are failures of the store, handled by
//! the fail mode; the conversation is only fed real answers and Envoy's reports of a failure.

use super::{Host, HostError, BUFFER_HTTP_CALL_RESPONSE_BODY, MAP_HTTP_CALL_RESPONSE_HEADERS};
use crate::config::etcd::OnStoreError;
use crate::store::{StoreAnswer, StoreOp};

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
}

/// One HTTP answer (or Envoy's report that the callout failed: `status: None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: Option<u16>,
    pub body: Vec<u8>,
}

/// A POST the store wants made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub path: &'static str,
    pub body: Vec<u8>,
    /// Sent as `authorization` when present.
    pub token: Option<String>,
    /// This call's timeout, when not the store's `timeout_ms` (the etcd token fetch has its own).
    pub timeout_ms: Option<u32>,
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
}

pub trait RemoteStore {
    fn settings(&self) -> &RemoteSettings;
    fn start(&self, op: StoreOp) -> Box<dyn Conversation>;
    /// True once after whatever waiting conversations wait for has arrived or failed.
    fn take_woken(&self) -> bool {
        false
    }
}

/// Envoy answers a callout that outlived its timeout with this synthesized status.
const TIMEOUT_STATUS: u16 = 504;

/// What became of a callout, read in `on_http_call_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Answered(Answer),
    /// Envoy's synthesized 504: no answer within `timeout_ms`. Whether the store acted is
    /// unknown.
    TimedOut,
}

/// Reads the callout's answer. A missing `:status` (Envoy's report of a reset or an answer over
/// its buffer limit) or an unreadable one is handed on as a failed callout, never guessed at.
pub fn read_answer<H: Host>(host: &H, body_size: usize) -> Outcome {
    let status = match host.header_value(MAP_HTTP_CALL_RESPONSE_HEADERS, ":status") {
        Ok(Some(v)) => std::str::from_utf8(&v).ok().and_then(|s| s.parse::<u16>().ok()),
        Ok(None) | Err(_) => None,
    };
    if status == Some(TIMEOUT_STATUS) {
        return Outcome::TimedOut;
    }
    let body = if body_size == 0 {
        Vec::new()
    } else {
        match host.buffer(BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size) {
            Ok(body) => body,
            Err(HostError(s)) => {
                log::warn!("cannot read the store's answer (host status {s})");
                return Outcome::Answered(Answer { status: None, body: Vec::new() });
            }
        }
    };
    Outcome::Answered(Answer { status, body })
}

/// Makes the call on the store's cluster; the token identifies its answer. Envoy refuses
/// (BadArgument) a cluster it does not know.
pub fn dispatch<H: Host>(host: &H, settings: &RemoteSettings, request: &Request) -> Result<u32, HostError> {
    let mut headers: Vec<(&str, &[u8])> = vec![
        (":method", b"POST"),
        (":path", request.path.as_bytes()),
        (":authority", settings.authority.as_bytes()),
        ("content-type", b"application/json"),
    ];
    if let Some(token) = &request.token {
        headers.push(("authorization", token.as_bytes()));
    }
    let timeout_ms = request.timeout_ms.unwrap_or(settings.timeout_ms);
    host.dispatch_http_call(&settings.cluster, &headers, &request.body, timeout_ms)
}
