//! Wake-ups for a worker's waiters from etcd's Watch service (`store.protocol: "grpc"`): one
//! gRPC stream per worker, kept open by its root, with one watch per record key some waiter of
//! this worker waits on. Any change of that record (the original's completion or release, a
//! takeover) wakes its waiters, who then look at the record as a poll would: one round trip.
//! Polling stays, slower, as the fallback: a watch is a hint, never an answer, so a lost or
//! late event costs latency, never a wrong reply.
//!
//! Pure: the root opens the stream, sends what this asks, and hands back what etcd answers.
//! etcd answers a stream's creates in the order they were sent, each with the id it gave the
//! watch; events name that id.

use std::cell::RefCell;
use std::rc::Rc;

use super::wire::{self, WatchAnswer};
use super::EtcdStore;
use crate::identity::scope::ScopeId;
use crate::store::seam::{Watch, WatchNews};

/// After a stream ended, how long until it is opened again (doubling up to `REOPEN_MAX_MS`):
/// meanwhile waiters poll as they did before watches.
const REOPEN_FIRST_MS: u64 = 1_000;
const REOPEN_MAX_MS: u64 = 30_000;
/// Most watches one worker keeps (its waiters' records): past it, waiters poll.
pub const MAX_WATCHES: usize = 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    /// None open; may be opened from `at_ms`. If that one fails too, the next wait is
    /// `backoff_ms`.
    Closed { at_ms: u64, backoff_ms: u64 },
    /// Asked of Envoy, with this token.
    Open { token: u32 },
}

/// Plain vectors, searched in order: a worker watches what its waiters wait on (bounded by
/// `max_waiters`, usually a handful), and hash maps cost the module more than the searches cost
/// the worker.
#[derive(Debug)]
pub struct Watches {
    stream: Stream,
    /// Every record a waiter wants watched, its key, and the watch's id once etcd created it.
    watched: Vec<Watched>,
    /// Creates sent and not yet answered, in order.
    creating: Vec<ScopeId>,
    /// Watches etcd created for records nobody waits on any more: ended at the next tidy.
    orphans: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Watched {
    scope: ScopeId,
    key: Vec<u8>,
    id: Option<i64>,
}

impl Default for Watches {
    fn default() -> Self {
        Watches {
            stream: Stream::Closed { at_ms: 0, backoff_ms: REOPEN_FIRST_MS },
            watched: Vec::new(),
            creating: Vec::new(),
            orphans: Vec::new(),
        }
    }
}

impl Watches {
    fn find(&self, scope: &ScopeId) -> Option<usize> {
        self.watched.iter().position(|w| w.scope == *scope)
    }

    /// A waiter waits on `scope`, whose record is `key()` (formatted only for a new watch: every
    /// park asks): the create to send now (None when it is watched already, the stream is not
    /// open, or the bound is reached).
    pub fn want(&mut self, scope: ScopeId, key: impl FnOnce() -> Vec<u8>) -> Option<Vec<u8>> {
        if self.find(&scope).is_some() || self.watched.len() >= MAX_WATCHES {
            return None;
        }
        let key = key();
        let message = wire::watch_create(&key);
        self.watched.push(Watched { scope, key, id: None });
        match self.stream {
            Stream::Open { .. } => {
                self.creating.push(scope);
                Some(message)
            }
            // Sent when the stream opens.
            Stream::Closed { .. } => None,
        }
    }

    /// True when a stream should be opened now: something is to be watched, and none is open
    /// or it is past its reopening time.
    pub fn should_open(&self, now_ms: u64) -> bool {
        matches!(self.stream, Stream::Closed { at_ms, .. } if now_ms >= at_ms) && !self.watched.is_empty()
    }

    /// Envoy opened the stream (`token`): the creates for everything wanted.
    pub fn opened(&mut self, token: u32) -> Vec<Vec<u8>> {
        self.stream = Stream::Open { token };
        self.orphans.clear();
        self.creating = self.watched.iter().map(|w| w.scope).collect();
        self.watched
            .iter_mut()
            .map(|w| {
                w.id = None;
                wire::watch_create(&w.key)
            })
            .collect()
    }

    /// Envoy refused to open one: try again later.
    pub fn refused(&mut self, now_ms: u64) {
        self.closed(now_ms);
    }

    pub fn token(&self) -> Option<u32> {
        match self.stream {
            Stream::Open { token } => Some(token),
            Stream::Closed { .. } => None,
        }
    }

    /// True while etcd confirmed a watch on `scope` on an open stream: its waiters may poll
    /// slowly.
    pub fn is_live(&self, scope: &ScopeId) -> bool {
        matches!(self.stream, Stream::Open { .. })
            && self.find(scope).is_some_and(|i| self.watched.get(i).is_some_and(|w| w.id.is_some()))
    }

    /// One message of the stream. Bytes that are not a WatchResponse end the stream's use: the
    /// caller closes it.
    pub fn received(&mut self, message: &[u8]) -> Result<WatchNews, wire::EtcdRefusal> {
        let answer: WatchAnswer = wire::read_watch(message)?;
        let mut out = WatchNews::default();
        if answer.created {
            if self.creating.is_empty() {
                return Err(wire::EtcdRefusal::Unusable(
                    "a watch etcd created that was not asked for".into(),
                ));
            }
            let scope = self.creating.remove(0);
            let at = self.find(&scope);
            if answer.canceled {
                // Refused at creation (a permission, a token): polling it is, until the
                // stream is opened again.
                log::debug!("etcd refused a watch: {}", answer.cancel_reason);
                if let Some(i) = at {
                    self.watched.swap_remove(i);
                }
                out.dropped.push(scope);
                out.refused = true;
                return Ok(out);
            }
            match at.and_then(|i| self.watched.get_mut(i)) {
                Some(w) => {
                    if let Some(old) = w.id.replace(answer.id) {
                        self.orphans.push(old);
                    }
                    // A change between the waiter's last look and now made no event: one
                    // more look closes that gap, and from here on every change is an event.
                    out.wake.push(scope);
                }
                // Nobody waits any more (tidied while the create was under way): end it.
                None => self.orphans.push(answer.id),
            }
        } else if answer.canceled {
            if let Some(i) = self.watched.iter().position(|w| w.id == Some(answer.id)) {
                out.dropped.push(self.watched.swap_remove(i).scope);
            }
            self.orphans.retain(|id| *id != answer.id);
        }
        if answer.events > 0 {
            if let Some(w) = self.watched.iter().find(|w| w.id == Some(answer.id)) {
                out.wake.push(w.scope);
            }
        }
        Ok(out)
    }

    /// The stream ended (or failed): every watched record may have changed unseen, so their
    /// waiters look again; the watches are asked for again when the stream reopens.
    pub fn closed(&mut self, now_ms: u64) -> Vec<ScopeId> {
        let wait_ms = match self.stream {
            Stream::Closed { backoff_ms, .. } => backoff_ms,
            // A stream that was open: start the backoff over.
            Stream::Open { .. } => REOPEN_FIRST_MS,
        };
        self.stream = Stream::Closed {
            at_ms: now_ms.saturating_add(wait_ms),
            backoff_ms: wait_ms.saturating_mul(2).min(REOPEN_MAX_MS),
        };
        self.creating.clear();
        self.orphans.clear();
        self.watched
            .iter_mut()
            .map(|w| {
                w.id = None;
                w.scope
            })
            .collect()
    }

    /// Ends the watches nobody of this worker waits on any more: the cancels to send.
    pub fn tidy(&mut self, waited_on: impl Fn(&ScopeId) -> bool) -> Vec<Vec<u8>> {
        let mut ended = std::mem::take(&mut self.orphans);
        self.watched.retain(|w| {
            let keep = waited_on(&w.scope);
            if !keep {
                ended.extend(w.id);
            }
            keep
        });
        match self.stream {
            Stream::Open { .. } => ended.into_iter().map(wire::watch_cancel).collect(),
            Stream::Closed { .. } => Vec::new(),
        }
    }

    /// How many records are watched (or asked for).
    pub fn len(&self) -> usize {
        self.watched.len()
    }

    pub fn is_empty(&self) -> bool {
        self.watched.is_empty()
    }
}

/// A worker's watches bound to its etcd store: the keys of its scopes, and how Envoy opens
/// the stream (the cluster, the `:authority`, the worker's auth token as metadata).
pub struct RecordWatch {
    store: Rc<EtcdStore>,
    service: Vec<u8>,
    state: RefCell<Watches>,
}

impl RecordWatch {
    pub fn new(store: Rc<EtcdStore>, authority: &str) -> RecordWatch {
        let service = wire::envoy_grpc_service(&store.settings().cluster, authority);
        RecordWatch { store, service, state: RefCell::new(Watches::default()) }
    }
}

impl Watch for RecordWatch {
    fn target(&self) -> (&[u8], &'static str, &'static str) {
        (&self.service, wire::WATCH_SERVICE, wire::WATCH_METHOD)
    }

    /// None while auth is on and this worker has no token yet (its next call fetches one).
    fn metadata(&self) -> Option<Vec<(String, Vec<u8>)>> {
        match (&self.store.settings().auth, self.store.token.borrow().as_ref()) {
            (None, _) => Some(Vec::new()),
            (Some(_), Some(token)) => Some(vec![("token".into(), token.clone().into_bytes())]),
            (Some(_), None) => None,
        }
    }

    fn want(&self, scope: &ScopeId) -> Option<Vec<u8>> {
        self.state.borrow_mut().want(*scope, || self.store.record_key(scope))
    }

    fn should_open(&self, now_ms: u64) -> bool {
        self.state.borrow().should_open(now_ms)
    }

    fn opened(&self, token: u32) -> Vec<Vec<u8>> {
        self.state.borrow_mut().opened(token)
    }

    fn refused(&self, now_ms: u64) {
        self.state.borrow_mut().refused(now_ms)
    }

    fn token(&self) -> Option<u32> {
        self.state.borrow().token()
    }

    fn is_live(&self, scope: &ScopeId) -> bool {
        self.state.borrow().is_live(scope)
    }

    fn received(&self, message: &[u8]) -> Result<WatchNews, String> {
        self.state.borrow_mut().received(message).map_err(|e| e.into_error().to_string())
    }

    fn closed(&self, now_ms: u64) -> Vec<ScopeId> {
        self.state.borrow_mut().closed(now_ms)
    }

    fn tidy(&self, waited_on: &dyn Fn(&ScopeId) -> bool) -> Vec<Vec<u8>> {
        self.state.borrow_mut().tidy(waited_on)
    }
}

#[cfg(test)]
#[path = "watch_tests.rs"]
mod tests;
