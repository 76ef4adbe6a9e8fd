//! The embedded store: records in Envoy's shared data, shared by every worker of one Envoy.
//!
//! Layout (namespace `idem:v1:<buckets>:`, so a capacity change starts a fresh namespace instead
//! of misreading the old placement):
//! - `b:<i>`     bucket i: up to ENTRIES_PER_BUCKET compact record entries (record.rs);
//! - `s:<i>:<p>` the snapshot slot of position p in bucket i;
//! - `sweep`     the sweep cursor, so workers share the sweeping instead of repeating it.
//!
//! Every key is created once, empty, by `create_keys` when the plugin is configured (the main
//! thread configures before any worker serves), and never again. That is what makes claims safe:
//! Envoy ignores the CAS on a write to a missing key, but every write here goes to a key that
//! already exists, so each CAS really is compare-and-swap. It also bounds memory: keys are never
//! deleted by Envoy, and this layout has a fixed number of them whatever keys clients send.

use crate::record::{self, Entry, SlotValue, State, FLAG_BODY_NOT_STORED};
use crate::shared_data::{Read, SharedData, SharedDataError};
use crate::store::{Begin, Claim, ClaimAttempt, Completion, RecordStore, Settled, StoreError};

/// Entries per bucket: small enough that a bucket (about 750 bytes) is cheap to copy under the
/// host's global shared-data lock on every request, large enough that uneven hashing rarely fills
/// one bucket while others have room.
pub const ENTRIES_PER_BUCKET: u8 = 8;

/// CAS attempts before giving up with `Contention` (bounded: a retry storm must not spin a
/// worker).
const CAS_ATTEMPTS: usize = 16;

/// Buckets examined per sweep call.
const SWEEP_BATCH: u32 = 64;

/// Longest `retry-after` suggested when the store is full.
const FULL_RETRY_CAP_MS: u64 = 60_000;

pub struct LocalStore<S: SharedData> {
    data: S,
    buckets: u32,
    prefix: String,
}

fn host(e: SharedDataError) -> StoreError {
    match e {
        SharedDataError::CasMismatch => StoreError::Contention,
        SharedDataError::Host(code) => StoreError::Unavailable(format!("shared data status {code}")),
    }
}

impl<S: SharedData> LocalStore<S> {
    pub fn new(data: S, capacity: u32) -> Self {
        let buckets = capacity.div_ceil(u32::from(ENTRIES_PER_BUCKET)).max(1);
        LocalStore { data, buckets, prefix: format!("idem:v1:{buckets}:") }
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// Records the store can hold at most.
    pub fn capacity(&self) -> u64 {
        u64::from(self.buckets) * u64::from(ENTRIES_PER_BUCKET)
    }

    pub fn shared_data(&self) -> &S {
        &self.data
    }

    fn bucket_key(&self, bucket: u32) -> String {
        format!("{}b:{bucket}", self.prefix)
    }

    fn slot_key(&self, bucket: u32, position: u8) -> String {
        format!("{}s:{bucket}:{position}", self.prefix)
    }

    fn cursor_key(&self) -> String {
        format!("{}sweep", self.prefix)
    }

    fn ready_key(&self) -> String {
        format!("{}ready", self.prefix)
    }

    /// Creates every key of the layout that does not exist yet, empty. Keys that exist (shared
    /// data survives VM reloads) keep their records. Returns how many keys were created.
    pub fn create_keys(&self) -> Result<u32, StoreError> {
        if self.data.get(&self.ready_key()).map_err(host)?.exists() {
            return Ok(0);
        }
        let mut created = 0;
        let mut ensure = |key: String| -> Result<(), StoreError> {
            if !self.data.get(&key).map_err(host)?.exists() {
                self.data.set(&key, &[], None).map_err(host)?;
                created += 1;
            }
            Ok(())
        };
        for b in 0..self.buckets {
            ensure(self.bucket_key(b))?;
            for p in 0..ENTRIES_PER_BUCKET {
                ensure(self.slot_key(b, p))?;
            }
        }
        ensure(self.cursor_key())?;
        self.data.set(&self.ready_key(), b"1", None).map_err(host)?;
        Ok(created)
    }

    fn locate(&self, claim: &Claim) -> Option<(u32, u8)> {
        let bucket = u32::try_from(claim.locator >> 8).ok()?;
        let position = u8::try_from(claim.locator & 0xff).ok()?;
        (bucket < self.buckets && position < ENTRIES_PER_BUCKET).then_some((bucket, position))
    }

    fn bucket_of(&self, scope: &crate::scope::ScopeId) -> u32 {
        // buckets >= 1, and the remainder is < buckets <= u32::MAX.
        u32::try_from(scope.placement() % u64::from(self.buckets)).unwrap_or(0)
    }

    /// Reads a bucket that must exist; a missing key means the layout was never created.
    fn read_bucket(&self, bucket: u32) -> Result<(Vec<Entry>, Read), StoreError> {
        let key = self.bucket_key(bucket);
        let read = self.data.get(&key).map_err(host)?;
        if !read.exists() {
            return Err(StoreError::Unavailable(format!("{key} was never created")));
        }
        let entries = record::decode_bucket(read.bytes(), ENTRIES_PER_BUCKET)
            .map_err(|e| StoreError::Corrupt(format!("{key}: {e:?}")))?;
        Ok((entries, read))
    }

    /// CAS-writes a bucket. Ok(false): another writer got there first; re-read and retry.
    fn write_bucket(&self, bucket: u32, entries: &[Entry], read: &Read) -> Result<bool, StoreError> {
        match self.data.set(&self.bucket_key(bucket), &record::encode_bucket(entries), read.cas) {
            Ok(()) => Ok(true),
            Err(SharedDataError::CasMismatch) => Ok(false),
            Err(e) => Err(host(e)),
        }
    }

    fn read_snapshot(&self, bucket: u32, entry: &Entry) -> Result<Option<SlotValue>, StoreError> {
        let key = self.slot_key(bucket, entry.position);
        let read = self.data.get(&key).map_err(host)?;
        let Some(bytes) = read.value else { return Ok(None) };
        let slot = record::decode_slot(&bytes).map_err(|e| StoreError::Corrupt(format!("{key}: {e:?}")))?;
        // A slot may still hold the snapshot of an earlier record at this position, or already
        // a newer one: only the snapshot tagged with this entry's scope and owner is its own.
        Ok((slot.scope == entry.scope && slot.owner == entry.owner).then_some(slot))
    }

    fn begin_once(&self, a: &ClaimAttempt) -> Result<Option<Begin>, StoreError> {
        let bucket = self.bucket_of(&a.scope);
        let (mut entries, read) = self.read_bucket(bucket)?;
        entries.retain(|e| !e.is_expired(a.now_ms));

        if let Some(i) = entries.iter().position(|e| e.scope == a.scope) {
            let existing = entries[i];
            if existing.fingerprint != a.fingerprint {
                return Ok(Some(Begin::Mismatch));
            }
            match existing.state {
                State::Succeeded | State::FailedFinal => {
                    if !existing.body_stored() {
                        return Ok(Some(Begin::NotStored { status: existing.status }));
                    }
                    return Ok(self
                        .read_snapshot(bucket, &existing)?
                        .map(|slot| Begin::Replay(slot.snapshot)));
                }
                State::Processing if a.now_ms < existing.lease_deadline_ms => {
                    return Ok(Some(Begin::InFlight {
                        retry_after_ms: existing.lease_deadline_ms - a.now_ms,
                    }));
                }
                State::Processing => {
                    entries[i] = new_entry(existing.position, a);
                    let claim = claim_for(bucket, existing.position, a);
                    return Ok(self.write_bucket(bucket, &entries, &read)?.then_some(Begin::TookOver(claim)));
                }
            }
        }

        let Some(position) = (0..ENTRIES_PER_BUCKET).find(|p| entries.iter().all(|e| e.position != *p))
        else {
            let soonest = entries.iter().map(|e| e.expires_at_ms).min().unwrap_or(a.now_ms);
            let wait = soonest.saturating_sub(a.now_ms).clamp(1, FULL_RETRY_CAP_MS);
            return Ok(Some(Begin::Full { retry_after_ms: wait }));
        };
        entries.push(new_entry(position, a));
        let claim = claim_for(bucket, position, a);
        Ok(self.write_bucket(bucket, &entries, &read)?.then_some(Begin::Claimed(claim)))
    }

    /// Index of the processing entry this claim owns, if it still owns one.
    fn owned(&self, entries: &[Entry], claim: &Claim, position: u8) -> Option<usize> {
        entries.iter().position(|e| {
            e.position == position
                && e.scope == claim.scope
                && e.owner == claim.owner
                && e.state == State::Processing
        })
    }

    fn write_slot(&self, key: &str, bytes: &[u8], read: &Read) -> Result<bool, StoreError> {
        match self.data.set(key, bytes, read.cas) {
            Ok(()) => Ok(true),
            Err(SharedDataError::CasMismatch) => Ok(false),
            Err(e) => Err(host(e)),
        }
    }
}

fn new_entry(position: u8, a: &ClaimAttempt) -> Entry {
    Entry {
        position,
        state: State::Processing,
        flags: 0,
        status: 0,
        scope: a.scope,
        fingerprint: a.fingerprint,
        owner: a.owner,
        lease_deadline_ms: a.now_ms.saturating_add(a.lease_ms),
        expires_at_ms: a.now_ms.saturating_add(a.ttl_ms),
    }
}

fn claim_for(bucket: u32, position: u8, a: &ClaimAttempt) -> Claim {
    Claim { scope: a.scope, owner: a.owner, locator: (u64::from(bucket) << 8) | u64::from(position) }
}

impl<S: SharedData> RecordStore for LocalStore<S> {
    fn begin(&self, attempt: &ClaimAttempt) -> Result<Begin, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            if let Some(outcome) = self.begin_once(attempt)? {
                return Ok(outcome);
            }
        }
        Err(StoreError::Contention)
    }

    fn complete(&self, claim: &Claim, c: &Completion) -> Result<Settled, StoreError> {
        let Some((bucket, position)) = self.locate(claim) else { return Ok(Settled::Lost) };
        let slot_key = self.slot_key(bucket, position);
        let encoded = c.snapshot.as_ref().map(|s| {
            record::encode_slot(&SlotValue { scope: claim.scope, owner: claim.owner, snapshot: s.clone() })
        });
        for _ in 0..CAS_ATTEMPTS {
            // Slot first, then the ownership check, then the slot write as a CAS against that
            // first read: an owner that lost its lease in between fails the CAS instead of
            // overwriting the new owner's snapshot.
            let slot = match encoded {
                Some(_) => Some(self.data.get(&slot_key).map_err(host)?),
                None => None,
            };
            let (mut entries, read) = self.read_bucket(bucket)?;
            let Some(i) = self.owned(&entries, claim, position) else { return Ok(Settled::Lost) };
            if let (Some(bytes), Some(slot)) = (encoded.as_deref(), slot.as_ref()) {
                if !slot.exists() {
                    return Err(StoreError::Unavailable(format!("{slot_key} was never created")));
                }
                if !self.write_slot(&slot_key, bytes, slot)? {
                    continue;
                }
            }
            let e = &mut entries[i];
            e.state = c.state;
            e.status = c.status;
            e.flags = if encoded.is_some() { 0 } else { FLAG_BODY_NOT_STORED };
            e.expires_at_ms = c.now_ms.saturating_add(c.ttl_ms);
            entries.retain(|e| !e.is_expired(c.now_ms));
            if self.write_bucket(bucket, &entries, &read)? {
                return Ok(Settled::Done);
            }
        }
        Err(StoreError::Contention)
    }

    fn release(&self, claim: &Claim) -> Result<Settled, StoreError> {
        let Some((bucket, position)) = self.locate(claim) else { return Ok(Settled::Lost) };
        for _ in 0..CAS_ATTEMPTS {
            let (mut entries, read) = self.read_bucket(bucket)?;
            let Some(i) = self.owned(&entries, claim, position) else { return Ok(Settled::Lost) };
            entries.remove(i);
            if self.write_bucket(bucket, &entries, &read)? {
                return Ok(Settled::Done);
            }
        }
        Err(StoreError::Contention)
    }

    fn sweep(&self, now_ms: u64) -> Result<u32, StoreError> {
        let cursor_key = self.cursor_key();
        let cursor = self.data.get(&cursor_key).map_err(host)?;
        if !cursor.exists() {
            return Err(StoreError::Unavailable(format!("{cursor_key} was never created")));
        }
        let start = cursor
            .value
            .as_deref()
            .and_then(|v| <[u8; 4]>::try_from(v).ok())
            .map(u32::from_be_bytes)
            .unwrap_or(0)
            % self.buckets;
        let batch = SWEEP_BATCH.min(self.buckets);
        let next = ((u64::from(start) + u64::from(batch)) % u64::from(self.buckets)) as u32;
        // Taking the range by CAS spreads sweeping over the workers; a worker that loses the race
        // simply skips this tick.
        match self.data.set(&cursor_key, &next.to_be_bytes(), cursor.cas) {
            Ok(()) => {}
            Err(SharedDataError::CasMismatch) => return Ok(0),
            Err(e) => return Err(host(e)),
        }
        let mut swept = 0;
        for k in 0..batch {
            let bucket = ((u64::from(start) + u64::from(k)) % u64::from(self.buckets)) as u32;
            swept += self.sweep_bucket(bucket, now_ms)?;
        }
        Ok(swept)
    }
}

impl<S: SharedData> LocalStore<S> {
    fn sweep_bucket(&self, bucket: u32, now_ms: u64) -> Result<u32, StoreError> {
        let (entries, _) = self.read_bucket(bucket)?;
        let expired: Vec<Entry> = entries.iter().filter(|e| e.is_expired(now_ms)).copied().collect();
        if expired.is_empty() {
            return Ok(0);
        }
        // Read the slots first: clearing one is a CAS against this read, so a snapshot written
        // by a newer record after the bucket check below is never wiped.
        let mut slots = Vec::with_capacity(expired.len());
        for e in &expired {
            let key = self.slot_key(bucket, e.position);
            let read = self.data.get(&key).map_err(host)?;
            slots.push((e.position, key, read));
        }
        let (mut entries, read) = self.read_bucket(bucket)?;
        let before = entries.len();
        entries.retain(|e| !e.is_expired(now_ms));
        let removed = before - entries.len();
        if removed == 0 || !self.write_bucket(bucket, &entries, &read)? {
            return Ok(0);
        }
        for (position, key, slot) in slots {
            let reused = entries.iter().any(|e| e.position == position);
            if slot.value.is_some() && !reused {
                match self.data.set(&key, &[], slot.cas) {
                    Ok(()) | Err(SharedDataError::CasMismatch) => {}
                    Err(e) => return Err(host(e)),
                }
            }
        }
        Ok(u32::try_from(removed).unwrap_or(u32::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_data::{FakeSharedData, Interleave};
    use crate::store_conformance::{attempt, claimed, done, snapshot, Backend, LEASE};

    struct Local {
        data: FakeSharedData,
        capacity: u32,
    }

    impl Backend for Local {
        fn with_capacity(capacity: u32) -> Self {
            let local = Local { data: FakeSharedData::new(), capacity };
            LocalStore::new(&local.data, capacity).create_keys().unwrap();
            local
        }
        fn worker(&self, _n: u8) -> Box<dyn RecordStore + '_> {
            Box::new(LocalStore::new(&self.data, self.capacity))
        }
    }

    mod conformance {
        crate::conformance_suite!(super::Local);
    }

    #[test]
    fn key_space_is_fixed_whatever_keys_clients_send() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        let keys_after_setup = b.data.key_count();
        assert_eq!(keys_after_setup, 8 + 8 * 8 + 2);
        let mut now = 0;
        for n in 0..5_000u64 {
            now += 7;
            match w.begin(&crate::store::ClaimAttempt { ttl_ms: 50, ..attempt(n, 1, n + 1, now) }).unwrap() {
                Begin::Claimed(c) => {
                    w.complete(&c, &crate::store::Completion { ttl_ms: 50, ..done("x", now) }).unwrap();
                }
                Begin::Full { .. } => {}
                other => panic!("{other:?}"),
            }
            w.sweep(now).unwrap();
        }
        assert_eq!(b.data.key_count(), keys_after_setup, "Envoy never frees a key: none may be added");
    }

    #[test]
    fn setup_keeps_records_that_survived_a_reload() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
        w.complete(&c, &done("kept", 1)).unwrap();
        // A reloaded VM (FAIL_RELOAD, config update) configures again against the same data.
        assert_eq!(LocalStore::new(&b.data, 64).create_keys().unwrap(), 0);
        assert_eq!(w.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::Replay(snapshot("kept")));
    }

    #[test]
    fn claims_fail_closed_when_the_layout_was_never_created() {
        let data = FakeSharedData::new();
        let store = LocalStore::new(&data, 64);
        assert!(matches!(store.begin(&attempt(1, 1, 1, 0)), Err(StoreError::Unavailable(_))));
        assert_eq!(data.key_count(), 0, "a claim must never create a key: creation ignores CAS");
    }

    #[test]
    fn cas_conflicts_are_retried_then_reported() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        b.data.force_cas_mismatches(3);
        assert!(matches!(w.begin(&attempt(1, 1, 1, 0)).unwrap(), Begin::Claimed(_)));
        b.data.force_cas_mismatches(1000);
        assert_eq!(w.begin(&attempt(2, 1, 2, 0)), Err(StoreError::Contention));
    }

    #[test]
    fn unreadable_bucket_is_reported_and_left_alone() {
        let b = Local::with_capacity(8);
        let store = LocalStore::new(&b.data, 8);
        let key = store.bucket_key(0);
        b.data.poke(&key, b"\x09garbage");
        assert!(matches!(store.begin(&attempt(1, 1, 1, 0)), Err(StoreError::Corrupt(_))));
        assert_eq!(b.data.get(&key).unwrap().bytes(), b"\x09garbage");
    }

    #[test]
    fn an_unclaimed_slot_write_is_refused_after_a_takeover() {
        // Worker 0 owns the record and is completing; exactly between its slot read and its
        // slot write, its lease expires, worker 1 takes over AND completes. Worker 0's write
        // must fail (CAS) and its completion report Lost; worker 1's snapshot survives.
        let data = FakeSharedData::new();
        LocalStore::new(&data, 8).create_keys().unwrap();
        let w1 = LocalStore::new(&data, 8);
        let old = claimed(LocalStore::new(&data, 8).begin(&attempt(1, 1, 11, 0)).unwrap());
        let racing = Interleave::new(&data, ":s:", 2, || {
            let new = claimed(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap());
            assert_eq!(w1.complete(&new, &done("new", LEASE + 1)).unwrap(), Settled::Done);
        });
        let w0 = LocalStore::new(&racing, 8);
        // 1st slot op: the read; the other worker runs before the 2nd (the write).
        let result = w0.complete(&old, &done("old", LEASE + 2)).unwrap();
        assert_eq!(result, Settled::Lost);
        assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE + 3)).unwrap(), Begin::Replay(snapshot("new")));
    }

    #[test]
    fn takeover_between_ownership_check_and_bucket_write_loses_cleanly() {
        let data = FakeSharedData::new();
        LocalStore::new(&data, 8).create_keys().unwrap();
        let w1 = LocalStore::new(&data, 8);
        let old = claimed(LocalStore::new(&data, 8).begin(&attempt(1, 1, 11, 0)).unwrap());
        // Fire right before worker 0's bucket write (its 2nd bucket op: read, then write).
        let racing = Interleave::new(&data, ":b:", 2, || {
            claimed(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap());
        });
        let w0 = LocalStore::new(&racing, 8);
        assert_eq!(w0.complete(&old, &done("old", LEASE + 2)).unwrap(), Settled::Lost);
        assert_eq!(
            w1.begin(&attempt(1, 1, 13, LEASE + 3)).unwrap(),
            Begin::InFlight { retry_after_ms: LEASE - 3 }
        );
    }

    #[test]
    fn sweep_frees_the_snapshot_memory_of_expired_records() {
        let b = Local::with_capacity(8);
        let w = b.worker(0);
        let c = claimed(w.begin(&attempt(1, 1, 1, 0)).unwrap());
        w.complete(&c, &done("big", 0)).unwrap();
        assert!(b.data.value_bytes() > 0);
        let swept = w.sweep(crate::store_conformance::TTL).unwrap();
        assert_eq!(swept, 1);
        // Only the sweep cursor and the ready marker hold bytes now.
        assert!(b.data.value_bytes() <= 8, "{}", b.data.value_bytes());
    }

    #[test]
    fn workers_share_sweeping_through_the_cursor() {
        let b = Local::with_capacity(8 * 200);
        let (w0, w1) = (b.worker(0), b.worker(1));
        for n in 0..100 {
            let c = claimed(w0.begin(&attempt(n, 1, n + 1, 0)).unwrap());
            w0.complete(&c, &done("x", 0)).unwrap();
        }
        let mut swept = 0;
        for _ in 0..4 {
            swept += w0.sweep(crate::store_conformance::TTL).unwrap();
            swept += w1.sweep(crate::store_conformance::TTL).unwrap();
        }
        assert_eq!(swept, 100, "200 buckets, 64 per call, 8 calls cover all exactly once or more");
    }
}
