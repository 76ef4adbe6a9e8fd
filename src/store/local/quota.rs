//! Per-tenant and per-principal quotas: the live-record counters in the fixed quota keys, how a
//! record is charged, discharged and charged again, and how the counters heal (notes on the
//! impl below). Apart from placement because a charge outlives any one bucket write.

use super::format::{self, QuotaCounter};
use super::{host, retry_hint, LocalStore, CAS_ATTEMPTS, RETRY_CAP_MS};
use crate::store::record::{Entry, FLAG_PRINCIPAL_CHARGED, FLAG_TENANT_CHARGED};
use crate::store::shared_data::SharedData;
use crate::store::{Begin, ClaimAttempt, QuotaCharge, StoreError};

/// Counters per quota key. There is one quota key per bucket, so the store holds two counters
/// per record it can hold: room for a distinct tenant and principal for every live record, up
/// to uneven hashing (a quota key with no room answers `Full`, as a full bucket does).
pub const COUNTERS_PER_QUOTA_KEY: u8 = 16;

/// `retry-after` for a reached quota whose earliest record should have expired already: it still
/// counts until a sweep drops it, and sweeps run every second.
pub(super) const QUOTA_RETRY_FALLBACK_MS: u64 = 1_000;

const TENANT_QUOTA_TAG: &[u8] = b"idempotency-filter/quota/tenant/v2\0";
const PRINCIPAL_QUOTA_TAG: &[u8] = b"idempotency-filter/quota/principal/v2\0";

/// The entry flags that say a record counts against a quota.
pub(super) const CHARGE_FLAGS: u8 = FLAG_TENANT_CHARGED | FLAG_PRINCIPAL_CHARGED;

/// What a new record was charged to: entry flags and tags.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Charged {
    pub(super) flags: u8,
    pub(super) tenant_tag: u64,
    pub(super) principal_tag: u64,
}

enum QuotaRefusal {
    Exceeded { retry_after_ms: u64 },
    NoRoom { retry_after_ms: u64 },
}

impl QuotaRefusal {
    fn answer(self, tenant: bool) -> Begin {
        match self {
            QuotaRefusal::Exceeded { retry_after_ms } => Begin::QuotaExceeded { retry_after_ms, tenant },
            // A quota key without room for a new identity is a full store, as a full bucket is.
            QuotaRefusal::NoRoom { retry_after_ms } => Begin::Full { retry_after_ms },
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Apply {
    DryRun,
    Write,
}

/// Quota. Each identity (tenant, principal) has a counter of its live records, found by a keyed
/// tag in one of the fixed quota keys (the tag, not the identity, picks the key and names the
/// counter, so an attacker can neither aim at one key nor make a key per identity).
///
/// A new record is charged before its bucket write (refunded if that write or its fence loses);
/// a record is discharged when it is released, evicted or swept. A charge or discharge lost to a
/// crash between two writes must not lock an identity out for good, so counters heal:
/// - a counter reads as 0 once `until_ms` has passed. `until_ms` is the latest instant any
///   record it counts can still be live: claim + lease + ttl when charged, pushed later by a
///   takeover and by a completion after the lease;
/// - the first charge after that starts a new epoch (`since_ms`); a discharge of a record
///   charged before the epoch is ignored, so stale records cannot eat into the new count.
///
/// Approximations, all bounded by a record's ttl: a record counts from its charge until it is
/// dropped, so an expired record still counts until a sweep or an eviction drops it (at most one
/// sweep cycle); a lost refund or discharge counts until `until_ms`; an extension of `until_ms`
/// that loses its CAS races lets a record outlive its counter (under-counting until it expires).
impl<S: SharedData> LocalStore<S> {
    fn identities(&self, q: &QuotaCharge) -> Vec<(bool, u64, u32)> {
        let mut ids = Vec::with_capacity(2);
        if let Some(t) = q.tenant {
            ids.push((true, self.keyed(TENANT_QUOTA_TAG, &t), q.per_tenant));
        }
        if let Some(p) = q.principal {
            ids.push((false, self.keyed(PRINCIPAL_QUOTA_TAG, &p), q.per_principal));
        }
        ids
    }

    pub(super) fn charge(
        &self,
        q: &QuotaCharge,
        a: &ClaimAttempt,
    ) -> Result<Result<Charged, Begin>, StoreError> {
        let now = a.now_ms;
        let expires = now.saturating_add(a.ttl_ms);
        let until = expires.saturating_add(a.lease_ms);
        let ids = self.identities(q);
        // Look at every identity before charging any: a charge refunded after a later refusal
        // would still have pushed its counter's `until_ms`, delaying its healing.
        for (tenant, tag, limit) in ids.iter().skip(1) {
            match self.increment(*tag, *limit, now, expires, until, Apply::DryRun)? {
                Ok(()) => {}
                Err(refusal) => return Ok(Err(refusal.answer(*tenant))),
            }
        }
        let mut charged = Charged::default();
        for (tenant, tag, limit) in ids {
            let refusal = match self.increment(tag, limit, now, expires, until, Apply::Write) {
                Ok(Ok(())) => {
                    if tenant {
                        charged.flags |= FLAG_TENANT_CHARGED;
                        charged.tenant_tag = tag;
                    } else {
                        charged.flags |= FLAG_PRINCIPAL_CHARGED;
                        charged.principal_tag = tag;
                    }
                    continue;
                }
                Ok(Err(r)) => Ok(r),
                Err(e) => Err(e),
            };
            self.discharge(charged.flags, charged.tenant_tag, charged.principal_tag, now);
            return Ok(Err(refusal?.answer(tenant)));
        }
        Ok(Ok(charged))
    }

    fn increment(
        &self,
        tag: u64,
        limit: u32,
        now: u64,
        expires: u64,
        until: u64,
        apply: Apply,
    ) -> Result<Result<(), QuotaRefusal>, StoreError> {
        let data_key = self.quota_key(tag);
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(&data_key).map_err(host)?;
            let mut counters = format::decode_counters(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
            // Counters that read as 0 give their room to other identities.
            counters.retain(|c| c.tag == tag || (c.count > 0 && now < c.until_ms));
            let found = counters.iter().position(|c| c.tag == tag);
            match found.and_then(|i| counters.get_mut(i)) {
                Some(c) if c.count > 0 && now < c.until_ms => {
                    if c.count >= limit {
                        // When the earliest record counted may have stopped counting; if that
                        // is past, it awaits a sweep, which runs every second.
                        let wait =
                            if c.soonest_ms > now { c.soonest_ms - now } else { QUOTA_RETRY_FALLBACK_MS };
                        return Ok(Err(QuotaRefusal::Exceeded {
                            retry_after_ms: wait.clamp(1, RETRY_CAP_MS),
                        }));
                    }
                    c.count += 1;
                    c.soonest_ms = if c.soonest_ms > now { c.soonest_ms.min(expires) } else { expires };
                    c.until_ms = c.until_ms.max(until);
                }
                _ => {
                    if limit == 0 {
                        return Ok(Err(QuotaRefusal::Exceeded { retry_after_ms: RETRY_CAP_MS }));
                    }
                    // A new identity, or one whose counter healed: a new epoch.
                    let fresh =
                        QuotaCounter { tag, count: 1, since_ms: now, soonest_ms: expires, until_ms: until };
                    match found {
                        Some(i) => counters[i] = fresh,
                        None if counters.len() >= usize::from(COUNTERS_PER_QUOTA_KEY) => {
                            let soonest = counters.iter().map(|c| c.until_ms).min().unwrap_or(now);
                            return Ok(Err(QuotaRefusal::NoRoom {
                                retry_after_ms: retry_hint(soonest, now),
                            }));
                        }
                        None => counters.push(fresh),
                    }
                }
            }
            if apply == Apply::DryRun || self.cas(&data_key, &format::encode_counters(&counters), &read)? {
                return Ok(Ok(()));
            }
        }
        Err(StoreError::Contention)
    }

    /// Best effort (see the quota notes): a lost discharge heals when its counter's `until_ms`
    /// passes.
    fn discharge(&self, flags: u8, tenant_tag: u64, principal_tag: u64, charged_at_ms: u64) {
        for (flag, tag) in [(FLAG_TENANT_CHARGED, tenant_tag), (FLAG_PRINCIPAL_CHARGED, principal_tag)] {
            if flags & flag != 0 {
                if let Err(e) = self.adjust(tag, charged_at_ms, None) {
                    log::debug!("quota discharge lost: {e}");
                }
            }
        }
    }

    /// Counts a record again whose charge was dropped (see `discharge_abandoned`), without a
    /// bound: only for records that are live whatever the quota says. A lost increment leaves
    /// it uncounted (an under-count bounded by its ttl).
    pub(super) fn recharge(&self, e: &mut Entry, now: u64, expires: u64) {
        for (flag, tag) in [(FLAG_TENANT_CHARGED, e.tenant_tag), (FLAG_PRINCIPAL_CHARGED, e.principal_tag)] {
            if tag == 0 {
                continue;
            }
            match self.increment(tag, u32::MAX, now, expires, expires, Apply::Write) {
                Ok(Ok(())) => e.flags |= flag,
                Ok(Err(_)) | Err(_) => log::debug!("quota recharge lost"),
            }
        }
        e.charged_at_ms = now;
    }

    pub(super) fn uncharge(&self, e: &Entry) {
        self.discharge(e.flags, e.tenant_tag, e.principal_tag, e.charged_at_ms);
    }

    /// Best effort: pushes the counters' `until_ms` so they cover the record until `until_ms`.
    pub(super) fn extend_charge(&self, e: &Entry, until_ms: u64) {
        for (flag, tag) in [(FLAG_TENANT_CHARGED, e.tenant_tag), (FLAG_PRINCIPAL_CHARGED, e.principal_tag)] {
            if e.flags & flag != 0 {
                if let Err(err) = self.adjust(tag, e.charged_at_ms, Some(until_ms)) {
                    log::debug!("quota extension lost: {err}");
                }
            }
        }
    }

    /// Decrements the counter of `tag` (extend: None) or pushes its `until_ms`, for a record
    /// charged at `charged_at_ms`; records of an earlier epoch are no longer counted.
    fn adjust(&self, tag: u64, charged_at_ms: u64, extend: Option<u64>) -> Result<(), StoreError> {
        let data_key = self.quota_key(tag);
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(&data_key).map_err(host)?;
            let mut counters = format::decode_counters(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
            let Some(i) =
                counters.iter().position(|c| c.tag == tag && c.since_ms <= charged_at_ms && c.count > 0)
            else {
                return Ok(());
            };
            match extend {
                Some(until) if counters[i].until_ms >= until => return Ok(()),
                Some(until) => counters[i].until_ms = until,
                None if counters[i].count == 1 => {
                    counters.remove(i);
                }
                None => counters[i].count -= 1,
            }
            if self.cas(&data_key, &format::encode_counters(&counters), &read)? {
                return Ok(());
            }
        }
        Err(StoreError::Contention)
    }
}
