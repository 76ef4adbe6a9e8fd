//! The etcd backend: one store shared by a fleet of Envoys, reached through etcd's v3 API (its
//! JSON gateway or its gRPC API, `store.protocol`: `wire/`) by HTTP callouts. This module is pure (no host calls, no sockets): `EtcdStore::start`
//! turns a `StoreOp` into an `EtcdConversation`, a state machine that asks for HTTP calls
//! (`Next::Call`, in the `store::remote` vocabulary) and is fed their answers until it is `Done`. The worker performs the
//! calls as Envoy callouts; `blocking` (tests only) performs them over std::net. It answers
//! exactly as the local store does (the conformance suite runs against a real etcd), except
//! that it has no capacity bound (never `Full`) and `sweep` has nothing to do.
//!
//! The keys, values and leases it keeps in etcd, and what each operation costs in round trips
//! (every call, guard and failure branch): docs/ETCD.md#data-model.

mod auth;
#[cfg(feature = "testing")]
pub mod blocking;
pub mod cache;
mod conversation;
mod keys;
mod leases;
mod quota;
mod records;
pub mod remote;
mod renew;
pub mod shards;
mod stage;
mod tombstones;
pub mod watch;
mod wire;

use std::cell::RefCell;

use crate::store::record::{self, Entry, SlotValue};
use crate::store::remote::{Next, Request};
use crate::store::{Begin, ClaimAttempt, StoreError, StoreOp};
use auth::TokenFetch;
use cache::ReplayCache;
use leases::{CachedLease, ClaimLease};

pub use conversation::EtcdConversation;
pub use leases::LEASE_WINDOW_MS;

/// The store's settings are the configuration's `store` section, defined (with their defaults
/// and the size limits that follow from etcd's) in `config::etcd`, where `parse` builds them.
pub use crate::config::etcd::{EtcdAuth, EtcdSettings, OnStoreError, Protocol};

/// A call to etcd in the remote-store vocabulary, with the token when there is one, given up
/// after `timeout_ms` (Envoy reads 0 as no timeout: at least 1 ms).
pub(super) fn etcd_call(call: wire::Call, token: Option<String>, timeout_ms: u64) -> Next {
    let timeout_ms = Some(u32::try_from(timeout_ms).unwrap_or(u32::MAX).max(1));
    Next::Call(Request { path: call.path, body: call.body, token, timeout_ms, shard: 0 })
}

/// Per worker (one per root context): the leases granted per expiry window and the auth token.
/// Workers never share them (each has its own), so the cells are only touched by one thread.
pub struct EtcdStore {
    settings: EtcdSettings,
    leases: RefCell<Vec<CachedLease>>,
    claim_leases: RefCell<Vec<ClaimLease>>,
    token: RefCell<Option<String>>,
    fetch: RefCell<TokenFetch>,
    replay: Option<RefCell<ReplayCache>>,
}

/// The token is a credential: formatted as present or absent only.
impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("settings", &self.settings)
            .field("leases", &self.leases.borrow().len())
            .field("token", &self.token.borrow().as_ref().map(|_| "<redacted>"))
            .field("replay_cache", &self.replay.as_ref().map(|c| c.borrow().len()))
            .finish()
    }
}

impl EtcdStore {
    pub fn new(settings: EtcdSettings) -> EtcdStore {
        let replay = settings.replay_cache.map(|s| RefCell::new(ReplayCache::new(s)));
        EtcdStore {
            settings,
            leases: RefCell::new(Vec::new()),
            claim_leases: RefCell::new(Vec::new()),
            token: RefCell::new(None),
            fetch: RefCell::new(TokenFetch::default()),
            replay,
        }
    }

    pub fn settings(&self) -> &EtcdSettings {
        &self.settings
    }

    fn protocol(&self) -> wire::Protocol {
        self.settings.protocol
    }

    /// Starts one store operation; drive it with `EtcdConversation::step`.
    pub fn start(&self, op: StoreOp) -> EtcdConversation {
        EtcdConversation::new(op)
    }

    /// (records, bytes) in this worker's replay cache; None when it is off.
    pub fn replay_cache_usage(&self) -> Option<(usize, u64)> {
        self.replay.as_ref().map(|c| {
            let c = c.borrow();
            (c.len(), c.bytes())
        })
    }

    fn cached_answer(&self, a: &ClaimAttempt) -> Option<Begin> {
        self.replay.as_ref()?.borrow_mut().answer(&a.scope, &a.fingerprint, a.now_ms)
    }

    fn keep_completed(&self, entry: Entry, snapshot: Option<&record::Snapshot>, now_ms: u64) {
        if let Some(cache) = &self.replay {
            cache.borrow_mut().keep(entry, snapshot, now_ms);
        }
    }
}

/// `Claim::locator` of a claim whose transaction went out but whose answer never came (Envoy's
/// timeout, a reset, an error after sending): etcd may have applied it, and its revision is
/// unknown (etcd's revisions start at 1). Only a release carries it, guarded by the claim's
/// lease key still holding its owner token: while it does, nobody has completed, marked or taken
/// over the record (each needs that key gone or another owner's), so the record is that claim.
pub const UNANSWERED: u64 = 0;

fn unusable(why: &str) -> StoreError {
    StoreError::Unavailable(why.into())
}

fn decode(bytes: &[u8]) -> Result<SlotValue, StoreError> {
    // Bytes this build cannot read are reported, never overwritten: a newer build's record is
    // still somebody's guarantee.
    record::decode_record(bytes).map_err(|e| StoreError::Corrupt(format!("etcd record: {e}")))
}

#[cfg(test)]
pub(crate) mod tests;

// Cloned only by the model checker (tests/etcd_model), which copies a worker's store and its
// conversations into each state it explores. Written out at the end of the file, so that no
// line of the code above moves: the module's panic locations, and so its bytes, stay the same.
#[cfg(feature = "testing")]
impl Clone for EtcdStore {
    fn clone(&self) -> Self {
        EtcdStore {
            settings: self.settings.clone(),
            leases: self.leases.clone(),
            claim_leases: self.claim_leases.clone(),
            token: self.token.clone(),
            fetch: self.fetch.clone(),
            replay: self.replay.clone(),
        }
    }
}

#[cfg(feature = "testing")]
impl EtcdStore {
    /// What this worker keeps between conversations (its leases in full; the token and the
    /// replay cache summed up): the model checker tells two states apart by it.
    pub fn cached_state(&self) -> String {
        format!(
            "{:?} {:?} token:{} replay cache:{:?}",
            self.leases.borrow(),
            self.claim_leases.borrow(),
            self.token.borrow().is_some(),
            // Its size only: its map's order is not stable (the model runs without it).
            self.replay_cache_usage(),
        )
    }
}
