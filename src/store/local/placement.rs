//! Where a record goes (two-choice placement, see the module docs): a begin's look-up in the
//! scope's two buckets, a new record's placement in a free position or in place of an evictable
//! entry, its confirmation when it went to the secondary, and the fill shards that cap live
//! records at the capacity. Kept together because the order of their reads and writes is what
//! makes a scope land in one bucket only.

use super::commit::{Fenced, Restored};
use super::format;
use super::layout::FILL_SHARD_BUCKETS;
use super::quota::{Charged, CHARGE_FLAGS, QUOTA_RETRY_FALLBACK_MS};
use super::{host, retry_hint, LocalStore, CAS_ATTEMPTS, ENTRIES_PER_BUCKET, RETRY_CAP_MS};
use crate::identity::scope::ScopeId;
use crate::store::record::Entry;
use crate::store::shared_data::{Read, SharedData};
use crate::store::{completed_answer, Begin, Claim, ClaimAttempt, OnLeaseEnd, StoreError};
use sha2::{Digest, Sha256};

/// How long a worker leaves a fill shard alone after sweeping all its buckets found nothing to
/// reclaim (`reclaim_in_shard`): that shard really holds its share of live records, and a claim
/// that sweeps it again at once would cost 63 bucket reads for the same 503. The sweep's own pace
/// (one shard a second), so a full shard costs one such pass a second per worker.
pub(super) const RECLAIM_PAUSE_MS: u64 = 1_000;

const PLACEMENT_TAG: &[u8] = b"idempotency-filter/placement/v3\0";

impl<S: SharedData> LocalStore<S> {
    /// The two buckets a scope may live in: its primary and its secondary (the same bucket now
    /// and then, and always in a one-bucket store).
    pub(super) fn buckets_of(&self, scope: &ScopeId) -> (u32, u32) {
        let mut h = Sha256::new();
        h.update(PLACEMENT_TAG);
        h.update(self.secret);
        h.update(scope.0);
        let d = h.finalize();
        let pick = |bytes: &[u8]| {
            let mut b = [0u8; 8];
            b.copy_from_slice(bytes);
            // buckets >= 1, and the remainder is < buckets <= u32::MAX.
            u32::try_from(u64::from_be_bytes(b) % u64::from(self.buckets)).unwrap_or(0)
        };
        (pick(&d[..8]), pick(&d[8..16]))
    }

    #[cfg(test)]
    pub(super) fn bucket_of(&self, scope: &ScopeId) -> u32 {
        self.buckets_of(scope).0
    }

    pub(super) fn begin_once(&self, a: &ClaimAttempt) -> Result<Option<Begin>, StoreError> {
        let (primary, secondary) = self.buckets_of(&a.scope);
        let first = self.read_bucket(primary)?;
        if let Some(existing) = first.0.iter().find(|e| e.scope == a.scope).copied() {
            return self.begin_existing(a, primary, first, existing, primary);
        }
        // The primary is read before the secondary: see `confirm` for why the order matters.
        let second = if secondary == primary { None } else { Some(self.read_bucket(secondary)?) };
        let candidates = match second {
            Some(second) => {
                if let Some(existing) = second.0.iter().find(|e| e.scope == a.scope).copied() {
                    return self.begin_existing(a, secondary, second, existing, primary);
                }
                vec![(primary, first), (secondary, second)]
            }
            None => vec![(primary, first)],
        };
        // No record: a tombstone of one that ended answers instead of a claim.
        if let Some(answer) = self.buried_answer(a)? {
            return Ok(Some(answer));
        }
        self.begin_new(a, primary, candidates)
    }

    /// The scope has an entry in `bucket`: answer from it, take it over, or (expired) put the
    /// new record in its place.
    fn begin_existing(
        &self,
        a: &ClaimAttempt,
        bucket: u32,
        (entries, read): (Vec<Entry>, Read),
        existing: Entry,
        primary: u32,
    ) -> Result<Option<Begin>, StoreError> {
        let now = a.now_ms;
        let (current, committed, slot_read) = self.resolve(bucket, &existing)?;
        if !current.is_expired(now) {
            if current.fingerprint != a.fingerprint {
                return Ok(Some(Begin::Mismatch));
            }
            if current.is_completed() {
                if !current.body_stored() {
                    return Ok(completed_answer(&current, None));
                }
                let snapshot = match committed {
                    Some(v) => v.snapshot,
                    None => self.read_snapshot(bucket, &existing)?,
                };
                return Ok(completed_answer(&current, snapshot));
            }
            if now < existing.lease_deadline_ms {
                return Ok(Some(Begin::InFlight { retry_after_ms: existing.lease_deadline_ms - now }));
            }
            match a.on_lease_end {
                OnLeaseEnd::Report => return Ok(Some(Begin::Unsettled)),
                // (`MarkUnknown` completes the record once it is taken over: `begin`.)
                OnLeaseEnd::TakeOver | OnLeaseEnd::MarkUnknown => {}
            }
            // The lease ended without an outcome: take the record over. It keeps its quota
            // charge (same scope, so same tenant and principal): a takeover is not charged,
            // unless the sweep already dropped the charge of this abandoned claim; then it is
            // live again and counts again (or a cycle of takeovers would hold records
            // beyond any quota).
            let mut next = Entry {
                owner: a.owner,
                lease_deadline_ms: now.saturating_add(a.lease_ms),
                expires_at_ms: now.saturating_add(a.ttl_ms),
                ..existing
            };
            let recharged = match &a.quota {
                Some(q) if existing.flags & CHARGE_FLAGS == 0 => match self.charge(q, a)? {
                    Ok(c) => {
                        next.flags |= c.flags;
                        next.tenant_tag = c.tenant_tag;
                        next.principal_tag = c.principal_tag;
                        next.charged_at_ms = now;
                        true
                    }
                    Err(refusal) => return Ok(Some(refusal)),
                },
                _ => false,
            };
            let refund = |next: &Entry| {
                if recharged {
                    self.uncharge(next);
                }
            };
            let replaced: Vec<Entry> =
                entries.iter().map(|e| if e.position == existing.position { next } else { *e }).collect();
            if !self.write_bucket(bucket, &replaced, &read)? {
                refund(&next);
                return Ok(None);
            }
            let Some(slot_read) = slot_read else {
                refund(&next);
                return Ok(None);
            };
            return match self.fence(bucket, &next, a.label.as_ref(), slot_read, now)? {
                Fenced::RolledBack => {
                    refund(&next);
                    Ok(None)
                }
                Fenced::Done => {
                    // The record lives past what its counters assumed when it was charged.
                    self.extend_charge(&next, now.saturating_add(a.lease_ms).saturating_add(a.ttl_ms));
                    Ok(Some(Begin::TookOver(claim_for(bucket, existing.position, a))))
                }
            };
        }
        // Expired (per its committed outcome, if any): absent, and its place is reused, unless
        // its tombstone still stands. It is replaced where it is, so a scope never has entries
        // in both of its buckets.
        if let Some(answer) = self.buried_answer(a)? {
            return Ok(Some(answer));
        }
        self.place(a, bucket, &entries, &read, existing.position, Some(existing), false, primary)
    }

    /// A new record. Two-choice placement: the less loaded of the scope's buckets (the primary
    /// on a tie) takes it in a free position, if the bucket's fill shard is under its bound; else
    /// the other one. Only with no such room is an entry evicted (expired, or abandoned past its
    /// lease), from either bucket; else the store is full for this key.
    fn begin_new(
        &self,
        a: &ClaimAttempt,
        primary: u32,
        mut candidates: Vec<(u32, (Vec<Entry>, Read))>,
    ) -> Result<Option<Begin>, StoreError> {
        crate::sort::small_by_key(&mut candidates, |(_, (entries, _))| entries.len());
        let mut full_shards = Vec::new();
        for (bucket, (entries, read)) in &candidates {
            let Some(position) = free_position(entries) else { continue };
            let shard = self.shard_of(*bucket);
            if full_shards.contains(&shard) {
                continue;
            }
            if !self.fill_charge(shard)? {
                // The shard's count still holds records that ended and that the sweep (one shard
                // a second) has not reached: with a short ttl they fill a shard whose live records
                // are few. Reclaim them from its other buckets, then charge once more.
                let skip: Vec<u32> = candidates.iter().map(|(b, _)| *b).collect();
                if self.reclaim_in_shard(shard, *bucket, &skip, a.now_ms)? == 0 || !self.fill_charge(shard)? {
                    full_shards.push(shard);
                    continue;
                }
            }
            return self.place(a, *bucket, entries, read, position, None, true, primary);
        }
        let mut retry_after_ms = RETRY_CAP_MS;
        for (bucket, (entries, read)) in &candidates {
            match self.evictable(*bucket, entries, a.now_ms)? {
                Ok(v) => return self.place(a, *bucket, entries, read, v.position, Some(v), false, primary),
                Err(hint) => retry_after_ms = retry_after_ms.min(hint),
            }
        }
        if !full_shards.is_empty() {
            // Records elsewhere in the shard may have ended: the sweep drops them within its pass.
            retry_after_ms = retry_after_ms.min(QUOTA_RETRY_FALLBACK_MS);
        }
        Ok(Some(Begin::Full { retry_after_ms }))
    }

    /// Writes a new record at `position` of `bucket` (replacing `victim`, if any). `filled`: a
    /// fill charge was taken for it (a free position), refunded if the record is not placed.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        a: &ClaimAttempt,
        bucket: u32,
        entries: &[Entry],
        read: &Read,
        position: u8,
        victim: Option<Entry>,
        filled: bool,
        primary: u32,
    ) -> Result<Option<Begin>, StoreError> {
        let now = a.now_ms;
        let unfill = || {
            if filled {
                self.fill_adjust(self.shard_of(bucket), -1);
            }
        };
        // Read the slot before the bucket write: the fence below is a CAS against this read.
        let (slot, slot_read) = self.read_slot(bucket, position)?;
        if let Some(v) = slot.filter(|v| !v.entry.is_expired(now)) {
            // A live outcome here means its record completed while being dropped or replaced:
            // that completion stands. Put it back (if nobody did) and look again.
            if self.restore(bucket, position, &v, None)? != Restored::Superseded {
                unfill();
                return Ok(None);
            }
            // Superseded outcomes are garbage: the fence below empties the slot.
        }

        let charged = match &a.quota {
            None => Charged::default(),
            Some(q) => match self.charge(q, a) {
                Ok(Ok(c)) => c,
                Ok(Err(refusal)) => {
                    unfill();
                    return Ok(Some(refusal));
                }
                Err(e) => {
                    unfill();
                    return Err(e);
                }
            },
        };
        let new = a.processing_entry(position, charged.flags, charged.tenant_tag, charged.principal_tag);
        let mut next: Vec<Entry> = entries.iter().filter(|e| e.position != position).copied().collect();
        next.push(new);
        if !self.write_bucket(bucket, &next, read)? {
            self.uncharge(&new);
            unfill();
            return Ok(None);
        }
        match self.fence(bucket, &new, a.label.as_ref(), slot_read, now)? {
            Fenced::RolledBack => {
                self.uncharge(&new);
                unfill();
                Ok(None)
            }
            Fenced::Done => {
                if let Some(v) = victim {
                    self.uncharge(&v);
                }
                if bucket != primary && !self.confirm(primary, &a.scope)? {
                    self.withdraw(bucket, &new);
                    return Ok(None);
                }
                Ok(Some(Begin::Claimed(claim_for(bucket, position, a))))
            }
        }
    }

    /// A new record placed in its secondary bucket is confirmed by rewriting the primary,
    /// unchanged, by CAS against a read that shows the scope absent there. Any racing claim of
    /// the same scope either wrote the secondary (one of the two CASes there fails), or wrote the
    /// primary: before our read (we see it and withdraw), between our read and rewrite (our
    /// rewrite fails, the re-read sees it), or after our rewrite (its primary read came after our
    /// secondary write, and every claim reads the secondary after the primary, so it sees us).
    /// Placements in the primary need no confirmation: a racing secondary placement confirms.
    fn confirm(&self, primary: u32, scope: &ScopeId) -> Result<bool, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let (entries, read) = self.read_bucket(primary)?;
            if entries.iter().any(|e| e.scope == *scope) {
                return Ok(false);
            }
            let bytes = read.value.clone().unwrap_or_default();
            if self.cas(&self.bucket_key(primary), &bytes, &read)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Takes back a new record that lost its confirmation (nobody was told it was claimed). Best
    /// effort: an entry left behind is a claim without an owner, abandoned after its lease.
    fn withdraw(&self, bucket: u32, new: &Entry) {
        for _ in 0..CAS_ATTEMPTS {
            let Ok((mut entries, read)) = self.read_bucket(bucket) else { return };
            let Some(i) = entries.iter().position(|e| e == new) else { return };
            entries.remove(i);
            match self.write_bucket(bucket, &entries, &read) {
                Ok(true) => {
                    self.uncharge(new);
                    self.fill_adjust(self.shard_of(bucket), -1);
                    return;
                }
                Ok(false) => {}
                Err(_) => return,
            }
        }
    }

    /// An entry whose place a new record may take: expired, or processing past its lease with no
    /// outcome in its slot (abandoned: exactly as safe to replace as a takeover is, so not while
    /// an attempt may end a lease otherwise: `evict_abandoned`). Prefers the one that ended
    /// first. Err: nothing evictable, and when something may become so.
    fn evictable(&self, bucket: u32, entries: &[Entry], now: u64) -> Result<Result<Entry, u64>, StoreError> {
        let ends = |e: &Entry| {
            if e.is_completed() {
                e.expires_at_ms
            } else {
                e.lease_deadline_ms.min(e.expires_at_ms)
            }
        };
        let mut by_end: Vec<&Entry> = entries.iter().collect();
        crate::sort::small_by_key(&mut by_end, |e| ends(e));
        let mut soonest = u64::MAX;
        for e in by_end {
            if ends(e) > now {
                soonest = soonest.min(ends(e));
                continue;
            }
            let (current, _, _) = self.resolve(bucket, e)?;
            if current.is_expired(now) || (!current.is_completed() && self.evict_abandoned) {
                return Ok(Ok(*e));
            }
            soonest = soonest.min(current.expires_at_ms);
        }
        Ok(Err(retry_hint(soonest, now)))
    }

    /// Whether the scope has an entry in its other bucket than `bucket`.
    pub(super) fn elsewhere(&self, bucket: u32, scope: &ScopeId) -> Result<bool, StoreError> {
        let (primary, secondary) = self.buckets_of(scope);
        let other = if bucket == primary { secondary } else { primary };
        if other == bucket {
            return Ok(false);
        }
        let (entries, _) = self.read_bucket(other)?;
        Ok(entries.iter().any(|e| e.scope == *scope))
    }

    /// The shard's share of the capacity, in proportion to its buckets (the last shard may have
    /// fewer): the shares add up to the capacity exactly.
    fn shard_bound(&self, shard: u32) -> u32 {
        let (buckets, records) = (u64::from(self.buckets), u64::from(self.records));
        let start = u64::from(shard) * u64::from(FILL_SHARD_BUCKETS);
        let end = (start + u64::from(FILL_SHARD_BUCKETS)).min(buckets);
        let share = records * end / buckets - records * start.min(end) / buckets;
        u32::try_from(share).unwrap_or(u32::MAX)
    }

    /// Takes one unit of a fill shard's bound for a new entry. Ok(false): the shard holds its
    /// share of the capacity already.
    fn fill_charge(&self, shard: u32) -> Result<bool, StoreError> {
        let data_key = self.fill_key(shard);
        let bound = self.shard_bound(shard);
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(&data_key).map_err(host)?;
            let count = format::decode_fill(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
            if count >= bound {
                return Ok(false);
            }
            if self.cas(&data_key, &format::encode_fill(count + 1), &read)? {
                return Ok(true);
            }
        }
        Err(StoreError::Contention)
    }

    /// Best effort, without a bound: a lost adjustment is corrected when the sweep recounts the
    /// shard (`recount`).
    pub(super) fn fill_adjust(&self, shard: u32, delta: i64) {
        let data_key = self.fill_key(shard);
        for _ in 0..CAS_ATTEMPTS {
            let Ok(read) = self.data.get(&data_key) else { break };
            let Ok(count) = format::decode_fill(read.bytes()) else { break };
            let next = u32::try_from((i64::from(count) + delta).max(0)).unwrap_or(u32::MAX);
            match self.cas(&data_key, &format::encode_fill(next), &read) {
                Ok(true) => return,
                Ok(false) => {}
                Err(_) => break,
            }
        }
        log::debug!("fill count of shard {shard} not adjusted by {delta}");
    }

    /// Sweeps the buckets of `shard` that follow `from` (wrapping within the shard, `skip`ped
    /// ones left alone: a claim holds reads of them) until one gives back room. The records
    /// dropped. All of them, not a few: ended records gather unevenly (each reclaim empties the
    /// buckets after a claim's), and a bounded look refused 1 in 17,000 new keys at 31% live.
    /// A pass that finds nothing pauses the shard's reclaims on this worker (`RECLAIM_PAUSE_MS`).
    fn reclaim_in_shard(&self, shard: u32, from: u32, skip: &[u32], now_ms: u64) -> Result<u32, StoreError> {
        let paused = self.reclaim_paused_until.get(shard as usize);
        if paused.is_some_and(|until| now_ms < until.get()) {
            return Ok(0);
        }
        let buckets = self.shard_buckets(shard);
        let len = buckets.end.saturating_sub(buckets.start);
        let after_from = (1..len)
            .map(|step| buckets.start + (from.saturating_sub(buckets.start) + step) % len)
            .filter(|bucket| !skip.contains(bucket));
        for bucket in after_from {
            let swept = self.sweep_bucket(bucket, now_ms)?;
            if swept > 0 {
                return Ok(swept);
            }
        }
        if let Some(until) = paused {
            until.set(now_ms.saturating_add(RECLAIM_PAUSE_MS));
        }
        Ok(0)
    }
}

fn free_position(entries: &[Entry]) -> Option<u8> {
    (0..ENTRIES_PER_BUCKET).find(|p| entries.iter().all(|e| e.position != *p))
}

fn claim_for(bucket: u32, position: u8, a: &ClaimAttempt) -> Claim {
    Claim {
        scope: a.scope,
        owner: a.owner,
        locator: (u64::from(bucket) << 8) | u64::from(position),
        written: None,
        shard: 0,
        old_home: None,
        tombstone_s: a.tombstone_s(),
    }
}
