//! The etcd leases a worker grants and reuses: records share one lease per expiry window
//! (`LEASE_WINDOW_MS`), claims' lease keys one claim lease per processing lease length and
//! reuse window, so grants follow the number of windows in use, never the request rate
//! (docs/ETCD.md#data-model says why each lease is as long as it is). Apart from the
//! conversation's steps because it is its own bookkeeping: which lease a write names, and when one
//! must be granted first (`EtcdConversation::lease_or_write`).

use super::stage::{Move, Stage};
use super::{unusable, wire, EtcdConversation, EtcdStore, StoreError};

/// Records whose expiry falls in the same window share one etcd lease, which ends after the
/// window: a worker grants one lease per window in use, never one per request.
pub const LEASE_WINDOW_MS: u64 = 10_000;
/// Added to every lease's TTL: covers the time between the grant and the puts that use it.
const LEASE_SLACK_S: u64 = 2;
/// Leases a worker keeps: one per window in use (claims and completions of each ttl in use).
pub(super) const CACHED_LEASES: usize = 16;

#[derive(Debug, Clone, Copy)]
pub(super) struct CachedLease {
    window_end_ms: u64,
    id: i64,
}

/// A lease for the lease keys of claims with one processing lease length, granted when this
/// worker asked at `granted_at_ms` (its clock), used for claims made within
/// `claim_lease_reuse_ms` of that.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClaimLease {
    lease_ms: u64,
    granted_at_ms: u64,
    id: i64,
}

/// How long a worker puts new claims' lease keys on one claim lease: a lease key outlives its
/// claim's processing lease by up to this (and `CLAIM_LEASE_SLACK_S`), so a takeover of an
/// abandoned claim comes at most that much later; a longer reuse means fewer grants.
fn claim_lease_reuse_ms(lease_ms: u64) -> u64 {
    (lease_ms / 10).max(1_000)
}

/// How long past its lease a claim stays its owner's: its completion's retry window, one
/// processing lease (`flow::retry_window_end`). The lease key covers it (`claim_lease_ttl_s`),
/// and the worker waits it out before its own lookup (`Store::held_past_lease_ms`).
pub(super) fn held_past_lease_ms(lease_ms: u64) -> u64 {
    lease_ms
}

/// The TTL of a claim lease: every claim put on it within the reuse window keeps its lease key
/// for at least its processing lease and then its completion's retry window, one processing
/// lease more (`flow::retry_window_end`), by etcd's clock. A request answered within its lease
/// whose completion could not be written at once is still being tried, and nobody may take its
/// record over meanwhile: the takeover would execute it again although its client has its
/// answer. The price: an abandoned claim (its Envoy died) is taken over, refused or looked up
/// one processing lease later.
pub(super) fn claim_lease_ttl_s(lease_ms: u64) -> u64 {
    lease_ms
        .saturating_add(held_past_lease_ms(lease_ms))
        .saturating_add(claim_lease_reuse_ms(lease_ms))
        .div_ceil(1_000)
        .saturating_add(CLAIM_LEASE_SLACK_S)
}

/// Covers the grant's round trip: the reuse window counts from before the lease was granted.
const CLAIM_LEASE_SLACK_S: u64 = 1;
/// The retry-after hint for a claim whose lease key lives on past its deadline by this
/// worker's clock (a clock ahead of the owner's).
pub(super) const LIVE_CLAIM_RETRY_MS: u64 = 1_000;

/// The end of the lease window a record expiring at `expires_at_ms` belongs to: strictly after
/// its expiry, so the record's lease never ends before the record does.
pub(super) fn window_end(expires_at_ms: u64) -> u64 {
    (expires_at_ms / LEASE_WINDOW_MS).saturating_add(1).saturating_mul(LEASE_WINDOW_MS)
}

impl EtcdStore {
    pub(super) fn lease_for(&self, window_end_ms: u64, now_ms: u64) -> Option<i64> {
        let mut leases = self.leases.borrow_mut();
        leases.retain(|l| l.window_end_ms > now_ms);
        leases.iter().find(|l| l.window_end_ms == window_end_ms).map(|l| l.id)
    }

    pub(super) fn remember_lease(&self, window_end_ms: u64, id: i64) {
        let mut leases = self.leases.borrow_mut();
        leases.retain(|l| l.window_end_ms != window_end_ms);
        if leases.len() >= CACHED_LEASES {
            // The soonest window is the one least likely to be asked for again.
            if let Some(i) = leases.iter().enumerate().min_by_key(|(_, l)| l.window_end_ms).map(|(i, _)| i) {
                leases.swap_remove(i);
            }
        }
        leases.push(CachedLease { window_end_ms, id });
    }

    pub(super) fn forget_lease(&self, id: i64) {
        self.leases.borrow_mut().retain(|l| l.id != id);
        self.claim_leases.borrow_mut().retain(|l| l.id != id);
    }

    pub(super) fn claim_lease_for(&self, lease_ms: u64, now_ms: u64) -> Option<i64> {
        let mut leases = self.claim_leases.borrow_mut();
        // A clock that went back is no reason to keep using a lease: it may be near its end.
        leases.retain(|l| {
            now_ms >= l.granted_at_ms
                && now_ms < l.granted_at_ms.saturating_add(claim_lease_reuse_ms(l.lease_ms))
        });
        leases.iter().find(|l| l.lease_ms == lease_ms).map(|l| l.id)
    }

    pub(super) fn remember_claim_lease(&self, lease_ms: u64, granted_at_ms: u64, id: i64) {
        let mut leases = self.claim_leases.borrow_mut();
        leases.retain(|l| l.lease_ms != lease_ms);
        if leases.len() >= CACHED_LEASES {
            leases.remove(0);
        }
        leases.push(ClaimLease { lease_ms, granted_at_ms, id });
    }
}

/// The grant of a lease for the window ending at `window_end_ms`: its TTL runs to the window's
/// end plus `LEASE_SLACK_S`.
fn grant_window(store: &EtcdStore, window_end_ms: u64, now_ms: u64) -> Move {
    let ttl_s = window_end_ms.saturating_sub(now_ms).div_ceil(1_000).saturating_add(LEASE_SLACK_S);
    Move::Call(wire::lease_grant(store.protocol(), ttl_s), Stage::LeaseGrant)
}

impl EtcdConversation {
    /// Finds the leases the write needs (its record's, for its expiry window; its tombstone's,
    /// for the window of its end; a claim's lease key's, for its processing lease), granting one
    /// this worker does not have yet, in that order, then makes the write.
    pub(super) fn lease_or_write(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Move, StoreError> {
        let Some(w) = self.write.as_mut() else { return Err(unusable("no write planned")) };
        if let Some((entry, _)) = &w.record {
            if w.lease == 0 {
                w.window_end_ms = window_end(entry.expires_at_ms);
                match store.lease_for(w.window_end_ms, now_ms) {
                    Some(id) => w.lease = id,
                    None => return Ok(grant_window(store, w.window_end_ms, now_ms)),
                }
            }
        }
        if let (Some(t), 0) = (&w.tombstone, w.tomb_lease) {
            // A tombstone has a lease of its own, for the window of its end.
            w.tomb_window_end_ms = window_end(t.until_ms);
            match store.lease_for(w.tomb_window_end_ms, now_ms) {
                Some(id) => w.tomb_lease = id,
                None => return Ok(grant_window(store, w.tomb_window_end_ms, now_ms)),
            }
        }
        if let (Some(lease_ms), 0) = (w.claim_lease_ms, w.claim_lease) {
            match store.claim_lease_for(lease_ms, now_ms) {
                Some(id) => w.claim_lease = id,
                None => {
                    w.grant_sent_ms = now_ms;
                    let ttl_s = claim_lease_ttl_s(lease_ms);
                    return Ok(Move::Call(wire::lease_grant(store.protocol(), ttl_s), Stage::LeaseGrant));
                }
            }
        }
        self.write_call(store)
    }
}
