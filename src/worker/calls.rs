//! What a worker's root carries for its streams: the store conversations, detached calls and
//! lookups handed to it (`RootCall`), and the queue they wait in (`RootCalls`). Apart from the
//! plugin's state so that the stream's adapter, the root and the admin API's root part all name them without
//! importing one another.

use super::flows::RootHold;
use crate::config::Rule;
use crate::identity::scope::ScopeId;
use crate::store::remote::Conversation;
use crate::store::{Claim, Renew, StoreOp};
use crate::worker::admin::AdminTask;
use crate::worker::flow::{Retry, Settlement};
use std::rc::Rc;

/// A `complete`/`release` the root carries out for a stream that may already be gone.
pub struct RootSettlement {
    pub conversation: Box<dyn Conversation>,
    pub settlement: Settlement,
    /// The stream's response is held until the store has answered (then resumed, if the
    /// stream is still there), so that a client has the whole response only once its record
    /// is written: a retry sent after it is replayed, as with the local store.
    pub holds_response: bool,
    /// Set when the store could not be used for it: it is started again, with backoff.
    pub retry: Option<Retry>,
    /// A detached request's flow: its client's reply (`RequestFlow::written`) goes out once the
    /// record is written, or at the store's first failure.
    pub then_answer: Option<RootHold>,
}

/// A claimed request the worker's root carries upstream itself (`execution: "detached"`): the
/// callout, made from the root so that it does not end with the client's stream.
pub struct DetachedCall {
    pub context_id: u32,
    pub claim: Claim,
    pub rule: Rc<Rule>,
    pub cluster: String,
    pub headers: Vec<(String, Vec<u8>)>,
    /// Let go once Envoy has it (the call copies it).
    pub body: Vec<u8>,
    pub timeout_ms: u32,
    /// The request's flow, the root's until the call is answered (`Event::DetachedAnswered`).
    pub flow: RootHold,
}

/// A `begin` the root carries out for a paused request (its first, or a waiter's recheck): the
/// root holds the request's flow meanwhile, and answers, resumes or parks the request (or, if
/// its stream is gone by then, gives back the claim it got).
pub struct RootBegin {
    pub conversation: Box<dyn Conversation>,
    pub flow: RootHold,
}

/// A paused request's lookup (`routes[].reconcile`), or a lease-end lookup, made by the root,
/// which holds the request's flow until it has carried out what the answer means.
pub struct RootLookup {
    pub flow: RootHold,
    pub lookup: Lookup,
}

/// How long after a lease ends the root looks its record up itself.
pub const LEASE_END_MARGIN_MS: u64 = 2_000;

/// Lease-end lookups one worker keeps at most (each holds a request head and its rule).
pub const MAX_LEASE_END_LOOKUPS: usize = 1_024;

/// A record whose lease ends after an unknown outcome this worker saw: the root looks it up
/// itself at `due_ms` (and again, backing off, while the lookup settles nothing).
pub struct DueLookup {
    pub due_ms: u64,
    /// Its flow, whose one phase is the `LeaseEndLookup` (`RequestFlow::lease_end`).
    pub flow: RootHold,
}

/// A lookup: the record, and the call (`started_ms`: when the gate let it start).
pub struct Lookup {
    pub scope: ScopeId,
    /// When its gate entry was taken (`LookupGate::finished`).
    pub started_ms: u64,
    pub rule: Rc<Rule>,
    pub cluster: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub timeout_ms: u32,
}

/// An admin request's store operation, carried out by the root (a remote store's answers come
/// to the context that made the call); the reply goes to the stream, if still there.
pub struct RootAdmin {
    pub context_id: u32,
    pub conversation: Box<dyn Conversation>,
    pub ask: AdminAsk,
}

/// A renewal of claims whose owners are still at work (`renewal`), carried as a conversation
/// (a remote store); its answer goes back to the worker's `Renewals`.
pub struct RootRenewal {
    pub conversation: Box<dyn Conversation>,
    pub renew: Renew,
}

/// A noted unsettled record looked up again (`unsettled`), carried as a conversation (a remote
/// store); its answer goes back to the registry.
pub struct RootRecheck {
    pub conversation: Box<dyn Conversation>,
    pub scope: ScopeId,
}

/// One store operation the root carries out on behalf of a stream.
pub enum RootCall {
    /// Boxed: it carries the request's task.
    Admin(Box<RootAdmin>),
    /// Boxed: it carries the conversation.
    Begin(Box<RootBegin>),
    /// Boxed: it carries the outcome and the claim (with the record the claim wrote).
    Settle(Box<RootSettlement>),
    /// Boxed: it carries the request.
    Detached(Box<DetachedCall>),
    /// Boxed: it carries the lookup's call.
    Lookup(Box<RootLookup>),
    /// Boxed: it carries its claims.
    Renew(Box<RootRenewal>),
    /// Boxed: it carries the conversation.
    Recheck(Box<RootRecheck>),
}

/// What a worker's root is doing with the remote store on behalf of its streams. The root
/// dispatches every callout: the SDK delivers an answer to the context that dispatched it and
/// drops it once that context is gone, and a stream's context may go at any time.
#[derive(Default)]
pub struct RootCalls {
    /// Handed over, not yet started (the root starts them in its next callback).
    pub queued: Vec<RootCall>,
    /// Waiting for the answer to the callout with this token.
    pub in_flight: InFlight,
    /// The shard each store call in flight went to when not shard 0 (`Request::shard`), to
    /// count its failure: (token, shard).
    pub shard_of: Vec<(u32, u8)>,
    /// Settlements the store failed, each started again at its `retry.due_ms`.
    pub retrying: Vec<RootSettlement>,
    /// Waiting for what another conversation fetches (`remote::Next::Wait`: the etcd token).
    pub parked: Vec<RootCall>,
    /// Admin requests whose store paused a long scan, asked again at the root's next tick
    /// (counted as the rest; a root is retired once its streams have ended, so these are of
    /// clients that left).
    pub admin_later: Vec<AdminLater>,
}

impl RootCalls {
    /// Nothing handed over, under way, waiting for a token or to be tried again.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
            && self.in_flight.is_empty()
            && self.retrying.is_empty()
            && self.parked.is_empty()
            && self.admin_later.is_empty()
    }

    /// How many are handed over, under way, waiting for a token or to be tried again.
    pub fn len(&self) -> usize {
        self.queued.len()
            + self.in_flight.len()
            + self.retrying.len()
            + self.parked.len()
            + self.admin_later.len()
    }

    /// Takes the settlements due to be tried again at `now_ms`.
    pub fn due(&mut self, now_ms: u64) -> Vec<RootSettlement> {
        let (due, later) = std::mem::take(&mut self.retrying)
            .into_iter()
            .partition(|s| s.retry.is_some_and(|r| r.due_ms <= now_ms));
        self.retrying = later;
        due
    }

    /// Everything left, for a root that stops waiting for it.
    pub fn drain_all(&mut self) -> Vec<RootCall> {
        let mut all = std::mem::take(&mut self.queued);
        all.extend(std::mem::take(&mut self.in_flight).0.into_iter().map(|(_, call)| call));
        all.extend(std::mem::take(&mut self.retrying).into_iter().map(|s| RootCall::Settle(Box::new(s))));
        all.extend(std::mem::take(&mut self.parked));
        // An operator's look changes nothing: left unanswered (its client gives up).
        self.admin_later.clear();
        all
    }
}

/// The root's callouts waiting for their answers, by token: a few per worker at a time (each
/// paused request's store call, each settlement's, each detached call and lookup, every one
/// answered within its timeout). A list searched from the newest costs a lookup little more than
/// a hash table would, and the module none of a hash table's own code.
#[derive(Default)]
pub struct InFlight(Vec<(u32, RootCall)>);

impl InFlight {
    pub fn insert(&mut self, token: u32, call: RootCall) {
        self.0.push((token, call));
    }

    /// The call whose callout has this token, no longer in flight.
    pub fn remove(&mut self, token: &u32) -> Option<RootCall> {
        let at = self.0.iter().rposition(|(t, _)| t == token)?;
        Some(self.0.swap_remove(at).1)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// The message a stream leaves on its own worker's wake queue so that the root runs at once
/// (a wake-up is a 32-byte scope id, so the two never mix).
pub const SETTLE_NOW: &[u8] = b"settle";

/// An admin request the root takes on at its next tick: the store paused a long scan at its
/// bound of work for one call (`admin::Progress::Later`), and the worker serves its requests
/// until then.
pub struct AdminLater {
    pub context_id: u32,
    pub ask: AdminAsk,
}

/// What the log line says of the request.
pub struct AdminLine {
    pub method: String,
    pub path: String,
}

/// An admin request whose store operation goes on as a conversation: the root carries out `op`,
/// then gives its answer to `task` (`root::converse_admin`).
pub struct AdminAsk {
    pub task: AdminTask,
    pub op: StoreOp,
    pub line: AdminLine,
}

/// A store operation the root carries as a conversation: one of `RootCall`'s, which
/// `settle::step` takes one step at a time.
pub trait Conversing {
    fn conversation(&mut self) -> &mut dyn Conversation;
    /// The call, kept by the root while its callout is in flight or it waits.
    fn into_call(self: Box<Self>) -> RootCall;
}

/// Each conversation's call, and the `RootCall` that keeps it.
macro_rules! conversing {
    ($($call:ty => $kept:ident),*) => {$(
        impl Conversing for $call {
            fn conversation(&mut self) -> &mut dyn Conversation {
                self.conversation.as_mut()
            }
            fn into_call(self: Box<Self>) -> RootCall {
                RootCall::$kept(self)
            }
        }
    )*};
}

conversing!(
    RootAdmin => Admin,
    RootBegin => Begin,
    RootSettlement => Settle,
    RootRenewal => Renew,
    RootRecheck => Recheck
);
