//! The one storage interface the worker speaks, whatever the backend: an operation is started,
//! and either answered at once or carried on as a conversation of callouts. Shaped after
//! Envoy's HTTP cache filter, whose one asynchronous lookup interface has an in-memory backend
//! that simply answers at once: here the local store (Envoy's shared data) always answers at
//! once, and the etcd store answers at once only from its replay cache. So the worker has one
//! path for both, and hands a request to its worker's root only when the first step is a call.
//!
//! A store that waiters can watch (etcd over gRPC) offers a `Watch`; the worker sees only this
//! trait, never the backend's type.

use crate::identity::scope::ScopeId;
use crate::store::remote::{Answer, Conversation, Next, RemoteSettings, Request};
use crate::store::{Claim, StoreAnswer, StoreError, StoreOp};

/// What starting an operation gave.
pub enum Started {
    /// The store answered at once (the local store always; a remote store from its cache).
    Answered(StoreAnswer),
    /// The operation goes on as callouts (or waits for one another conversation is making):
    /// whoever makes the calls steps it, first with `None`.
    Conversation(Box<dyn Conversation>),
}

impl Started {
    /// A conversation's first step, taken now: its answer if it needs no call, else the
    /// conversation, primed with that step for whoever carries it on.
    pub fn first_step(mut conversation: Box<dyn Conversation>, now_ms: u64) -> Started {
        match conversation.step(None, now_ms) {
            Next::Done(answer) => Started::Answered(answer),
            Next::Call(request) => {
                Started::Conversation(Box::new(Primed { first: Some(request), conversation }))
            }
            // Asked again with `None` when what it waits for arrives (or at the next tick).
            Next::Wait => Started::Conversation(conversation),
        }
    }
}

/// A conversation whose first step was taken where it started: its first call, handed to
/// whoever makes it at their first step.
struct Primed {
    first: Option<Request>,
    conversation: Box<dyn Conversation>,
}

impl Conversation for Primed {
    fn step(&mut self, answer: Option<Answer>, now_ms: u64) -> Next {
        match self.first.take() {
            Some(request) => Next::Call(request),
            None => self.conversation.step(answer, now_ms),
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.conversation.into_op()
    }
    fn unanswered_claim(&self) -> Option<Claim> {
        self.conversation.unanswered_claim()
    }
}

pub trait Store {
    /// Starts `op`. `now` reads the clock (a host call), for a store that needs the time to
    /// take its first step: the local store never reads it.
    fn start(&self, op: StoreOp, now: &dyn Fn() -> u64) -> Started;
    /// How to reach a store across the network; None: it answers in place, and never starts a
    /// conversation.
    fn remote(&self) -> Option<&RemoteSettings> {
        self.remote_for(0)
    }
    /// How to reach one shard of a store kept in several (`Request::shard`); shard 0 of a store
    /// of one is the store. What the shards share (protocol, timeout, fail mode) is the same in
    /// each.
    fn remote_for(&self, _shard: u8) -> Option<&RemoteSettings> {
        None
    }
    /// How long past a claim's lease its record stays its owner's: nobody else settles it
    /// (takes it over, refuses it, looks it up) before then. Nothing for a store whose
    /// settlements answer at once; a store whose settlements are tried again keeps the claim
    /// through their retry window (`flow::Retry`).
    fn held_past_lease_ms(&self, _lease_ms: u64) -> u64 {
        0
    }
    /// Reclaims expired records in the next part of the store (about once a second per live
    /// root); returns how many were removed. A store that expires its own (etcd's leases) has
    /// nothing to do.
    fn sweep(&self, _now_ms: u64) -> Result<u32, StoreError> {
        Ok(0)
    }
    /// True once after whatever waiting conversations wait for has arrived or failed.
    fn take_woken(&self) -> bool {
        false
    }
    /// The watch on `scope`'s record, when the store offers one: a change of it wakes its
    /// waiters, who otherwise poll.
    fn watch(&self, _scope: &ScopeId) -> Option<&dyn Watch> {
        None
    }
    /// Every watch stream of the store (one per shard at most), for the root to keep open.
    fn watches(&self) -> Vec<&dyn Watch> {
        Vec::new()
    }
}

/// What a message of the watch stream means for this worker's waiters.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WatchNews {
    /// Records that changed: wake their waiters.
    pub wake: Vec<ScopeId>,
    /// The store ended a watch on its own (a compaction, a refused token): look again, and the
    /// watch is asked for again when a waiter parks.
    pub dropped: Vec<ScopeId>,
    /// The store refused to create a watch (a token that went stale, a permission): the stream
    /// is of no more use as it is; the caller ends it, and it is opened again (with the
    /// worker's current credentials) after the usual backoff.
    pub refused: bool,
}

/// One gRPC stream per worker, kept open by its root, watching the records its waiters wait
/// on. Pure: the root opens the stream, sends what this asks, and hands back what comes.
pub trait Watch {
    /// `proxy_grpc_stream`'s arguments: the serialized GrpcService, the service and method.
    fn target(&self) -> (&[u8], &'static str, &'static str);
    /// The stream's initial metadata; None while the worker has no credentials yet (its
    /// waiters poll).
    fn metadata(&self) -> Option<Vec<(String, Vec<u8>)>>;
    /// A waiter waits on `scope`: the message to send now, if any (none when it is watched
    /// already, the stream is not open, or the bound is reached).
    fn want(&self, scope: &ScopeId) -> Option<Vec<u8>>;
    /// Whether the stream is to be opened now (something to watch, none open, past backoff).
    fn should_open(&self, now_ms: u64) -> bool;
    /// Envoy opened the stream: the messages it is to carry first.
    fn opened(&self, token: u32) -> Vec<Vec<u8>>;
    /// Envoy refused to open it: opened again after a backoff.
    fn refused(&self, now_ms: u64);
    /// The open stream's token.
    fn token(&self) -> Option<u32>;
    /// Whether a change of `scope`'s record would wake its waiters now.
    fn is_live(&self, scope: &ScopeId) -> bool;
    /// A message of the stream; an unreadable one is reported as text (the caller closes the
    /// stream and the waiters poll).
    fn received(&self, message: &[u8]) -> Result<WatchNews, String>;
    /// The stream ended: the records it watched, whose waiters poll again.
    fn closed(&self, now_ms: u64) -> Vec<ScopeId>;
    /// Ends the watches no waiter needs (`waited_on` says which are): the messages to send.
    fn tidy(&self, waited_on: &dyn Fn(&ScopeId) -> bool) -> Vec<Vec<u8>>;
}
