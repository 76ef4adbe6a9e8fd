//! The etcd backend: one store shared by a fleet of Envoys, reached through etcd's v3 API (its
//! JSON gateway or its gRPC API, `store.protocol`: `wire/`) by HTTP callouts. This module is pure (no host calls, no sockets): `EtcdStore::start`
//! turns a `StoreOp` into an `Exchange`, a state machine that asks for HTTP calls
//! (`Next::Call`, in the `store::remote` vocabulary) and is fed their answers until it is `Done`. The glue performs the
//! calls as Envoy callouts; `blocking` (tests only) performs them over std::net. It answers
//! exactly as the local store does (the conformance suite runs against a real etcd), except
//! that it has no capacity bound (never `Full`) and `sweep` has nothing to do.
//!
//! Data model (all keys under `prefix`, default `/idempotency/`; docs/ETCD.md has the sizing):
//! - `r/<scope hex>`: the record, its value the v2 record bytes (`record::encode_slot`; a claim
//!   is a processing entry without snapshot, read with `record::decode_record`). The entry's
//!   `expires_at_ms` decides whether the record exists: an expired record reads as absent even
//!   while etcd still holds it, so time is the caller's (virtual in tests) and etcd's lease only
//!   collects garbage. `Claim.locator` is the mod_revision of the claim's put: the record's last
//!   write while the claim holds it, so every ownership check is a compare on it.
//! - `q/t/<tenant tag>/<until>/<scope hex>` and `q/p/<principal tag>/<until>/<scope hex>`: one
//!   empty index key per charged record and identity (tag: first 8 bytes of the digest, 16 hex;
//!   `until`: 16 hex digits of when the record stops counting: a claim at the end of its lease,
//!   a completed record at its expiry). Keys sort by `until`, so an identity's live records are
//!   the range from `<until = now + 1>` to the end of its prefix; one range with `limit 1,
//!   keys_only` gives their count (etcd counts the whole range whatever the limit) and the one
//!   that stops counting first (the retry-after hint). Index keys carry the record's lease and
//!   are rewritten in the same transaction as the record.
//! - `l/<scope hex>`: a claim's lease key, its value the owner token, on a claim lease (below):
//!   it exists while the claim's processing lease runs by etcd's clock. A takeover needs it gone
//!   (or holding another owner) as well as the deadline passed by the caller's clock, so an
//!   Envoy whose clock runs ahead never takes over a running claim. A release deletes it; a
//!   completion leaves it to expire. A claim without one (an older build's) is judged by its
//!   deadline alone.
//! - Leases: records whose expiry falls in the same `LEASE_WINDOW_MS` window share one lease,
//!   granted by a worker the first time it writes into that window and cached (`EtcdStore`);
//!   its TTL runs to the window's end plus `LEASE_SLACK_S`, so a record's lease never ends before
//!   its `expires_at_ms`. A claim's record already expires at now + ttl (an abandoned claim must
//!   keep refusing another payload until then, as in the local store), so its lease covers the
//!   processing timeout and the ttl; a completion moves the record to the lease of its new
//!   expiry. A lease etcd no longer knows is granted again once per exchange. Claim leases: a
//!   worker puts the lease keys of the claims it makes within `claim_lease_reuse_ms` (max(1 s,
//!   lease / 10)) on one lease, whose TTL is the processing lease plus that window plus
//!   `CLAIM_LEASE_SLACK_S`, so each lease key outlives its claim's lease by etcd's clock.
//!
//! Operations (round trips; "+1" is a lease grant, once per worker and window):
//! - begin: 1 (the claim's puts name the record's lease and the lease key's claim lease, so
//!   they are known before the call; a worker lacking one first reads the record with the
//!   failure branch's ranges alone (`Stage::Probe`): a record answers there, an absent one costs
//!   that read +1 per lease to grant, once per worker and window): one txn guarded by
//!   create_revision(r/<scope>) == 0. Success (a new record): it puts the record, its index keys
//!   and its lease key, then ranges a charged attempt's live indexes (the reads of a txn see its
//!   earlier writes: the count includes the claim's own key, which `quota_refusal` leaves out;
//!   limit 2 so the retry-after hint skips it); over a bound, a third call deletes what the
//!   claim wrote, guarded by its revision (`undo`), and the begin answers `QuotaExceeded`.
//!   Failure (the record exists): it ranges the record and its lease key, never the quota, and
//!   the begin decides replay, not stored, mismatch or in flight from them; a takeover or a
//!   reuse of an expired record is a second txn guarded by mod_revision == observed that puts
//!   the record, its index keys and its lease key and deletes the replaced record's index keys
//!   (with a quota, the quota is read first in a txn guarded by the observed revision: +1). A
//!   lost guard starts again with the claim's txn, up to `TXN_ATTEMPTS` times (then
//!   `Contention`). An attempt with `UnknownOutcome::Refuse` never takes over: the same guarded txn
//!   rewrites the lease-ended record as outcome unknown (moving its index keys to the new
//!   expiry, as a completion does) and the begin answers `OutcomeUnknown`.
//! - complete: 1 (+1): `Claim::written` is the record the claim put, so a txn guarded by
//!   mod_revision == locator (while it holds, the record is exactly that put) rewrites the
//!   record with its outcome and moves its index keys without reading it; on a failed guard its
//!   failure branch reads the record: `Lost`, unless it holds this claim's owner with this
//!   outcome (an earlier try of the same completion landed: `Done`). The glue tries a failed
//!   settlement again. A claim without `written` (not made by this store) is read first (+1:
//!   ownership, mod_revision == locator, same owner, processing).
//! - release: 1: the same guarded txn deleting the record, its index keys and its lease key (a
//!   failed guard is `Lost`). A claim whose begin failed after its txn went out
//!   (`Exchange::unanswered_claim`, locator `UNANSWERED`) is released by a txn guarded by its
//!   lease key holding its owner token (`Guard::Owner`); a failed guard is `Done`: nothing of
//!   that owner is left.
//! - With auth, +1 (`/v3/auth/authenticate`) on a worker's first call and whenever etcd refuses
//!   the token (invalid, or older than an auth change: `wire::EtcdRefusal::InvalidToken`; then the
//!   call is sent again, once). One fetch per worker at a time (`TokenFetch`): an exchange that
//!   needs a token while another fetches it answers `Next::Wait` and is stepped
//!   again (with `None`) when `take_fetch_ended` says the fetch ended, or at the driver's next
//!   tick; it then sends its call with the token, or fails with the fetch's error (`TimedOut`
//!   once the fetch is past its deadline, `auth_timeout_ms`, without an answer).
//! - With `replay_cache` on, a begin of a scope whose completed, unexpired record this worker
//!   has read or written: 0, answered from `cache` (never a claim).
//!
//! Lease grants per second are independent of the request rate: at most one per worker per
//! window in use, i.e. about (workers x distinct ttls) / 10 s across the fleet's workers, plus
//! one claim lease per worker per claim-lease window while it makes claims; at any request
//! rate with one ttl, the default 30 s lease and 2 workers per Envoy, 10 Envoys grant about
//! 2 + 7 leases a second.
//!
//! etcd cannot compare a count in a guard, so a new claim counts in its own txn, after its
//! puts: etcd applies txns one at a time, so new claims never pass the bound, though one being
//! undone still counts for the others until its undo lands. A takeover or reuse with a quota
//! reads then writes: racing ones can overshoot the bound by their number.

mod auth;
pub mod base64;
#[cfg(feature = "testing")]
pub mod blocking;
pub mod cache;
mod exchange;
mod keys;
mod leases;
mod quota;
mod records;
pub mod remote;
pub mod watch;
mod wire;

use std::cell::RefCell;

use crate::store::record::{self, Entry, SlotValue};
use crate::store::remote::{Next, Request};
use crate::store::{Begin, ClaimAttempt, StoreError, StoreOp};
use auth::TokenFetch;
use cache::ReplayCache;
use leases::{CachedLease, ClaimLease};

pub use exchange::Exchange;
pub use leases::LEASE_WINDOW_MS;

/// The store's settings are the configuration's `store` section, defined (with their defaults
/// and the size limits that follow from etcd's) in `config::etcd`, where `parse` builds them.
pub use crate::config::etcd::{EtcdAuth, EtcdSettings, OnStoreError, Protocol};

/// A call to etcd in the remote-store vocabulary, with the token when there is one, given up
/// after `timeout_ms` (Envoy reads 0 as no timeout: at least 1 ms).
pub(super) fn etcd_call(call: wire::Call, token: Option<String>, timeout_ms: u64) -> Next {
    let timeout_ms = Some(u32::try_from(timeout_ms).unwrap_or(u32::MAX).max(1));
    Next::Call(Request { path: call.path, body: call.body, token, timeout_ms })
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

    /// Starts one store operation; drive it with `Exchange::step`.
    pub fn start(&self, op: StoreOp) -> Exchange {
        Exchange::new(op)
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
    record::decode_record(bytes).map_err(|e| StoreError::Corrupt(format!("etcd record: {e:?}")))
}

#[cfg(test)]
pub(crate) mod tests;
