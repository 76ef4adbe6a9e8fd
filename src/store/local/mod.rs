//! The embedded store: records in Envoy's shared data, shared by every worker of one Envoy.
//!
//! Layout (namespace `idem:v3:<capacity>:`, so a capacity change starts a fresh namespace instead
//! of misreading the old placement; the old one is retired, see below):
//! - `b:<i>`     bucket i: up to ENTRIES_PER_BUCKET compact record entries (format.rs, Bucket v2);
//! - `s:<i>:<p>` the snapshot slot of position p in bucket i: the record's committed outcome;
//! - `q:<j>`     quota key j: up to COUNTERS_PER_QUOTA_KEY live-record counters;
//! - `f:<k>`     fill shard k: how many entries buckets 64k..64k+63 hold (format.rs, Fill v3);
//! - `sweep`     the sweep cursor (a fill shard), so workers share the sweeping;
//! - `ready`     set once every key above exists; `ready:records` instead, once every key but
//!   the quota keys exists (a namespace made for a configuration without quotas). A build
//!   before `ready:records` sees no `ready` there and creates what is missing, as for a
//!   namespace it made itself.
//!
//! Two keys are global: `idem:v2:secret` (the 32-byte placement secret every worker shares) and
//! `idem:layouts` (the registry of namespaces in use, with heartbeats).
//!
//! Placement (v3). A scope has two buckets, both keyed hashes of it: its primary and its
//! secondary. A new record goes to the less loaded one, in a free position, and lookups read the
//! primary, then the secondary if the scope is not there. There are 1.5 positions per record of
//! capacity (buckets = ceil(1.5 C / 8)), so the buckets are never the limit below 90% fill; the
//! limit is the live-record count, capped at C by the fill shards: each holds its buckets' share
//! of C, a new record in a free position takes one unit of it (a CAS on `f:<k>`) and a dropped
//! record gives it back. Reusing an expired or abandoned entry's position takes nothing. v2 put a
//! scope in one bucket of C/8: 5% of new keys were refused at half fill.
//!
//! Every key is created once, empty, by `open` when the plugin is configured (the main thread
//! configures before any worker serves), and never again. That is what makes claims safe: Envoy
//! ignores the CAS on a write to a missing key, but every write here goes to a key that already
//! exists, so each CAS really is compare-and-swap. It also bounds memory: keys are never deleted
//! by Envoy, and this layout has a fixed number of them whatever keys, tenants or principals
//! clients send: `buckets * (ENTRIES_PER_BUCKET + 2) + ceil(buckets / 64) + 2` per namespace,
//! plus the 2 global keys. Bytes per live record: one entry in a bucket (ENTRY_LEN = 117 B), its
//! slot once completed (1 + 117 B plus the snapshot: status, headers, body), and at most two
//! quota counters (COUNTER_LEN = 36 B each) shared by the identity's records.
//!
//! Commit point. A record's slot, not its bucket, is where a completion becomes true: `complete`
//! CAS-writes the outcome into the slot and only then promotes the bucket entry, best effort. A
//! slot is written only by its record's owner and by whoever just changed the entry at that
//! position, so a busy bucket cannot starve a completion. Whenever a reader meets a processing
//! entry it reads the slot first: an outcome there tagged with the entry's scope and owner means
//! the record is completed. Whoever replaces or drops an entry (takeover, eviction, sweep) writes
//! the slot afterwards as a CAS against a read taken before its bucket write ("fence"): an owner
//! that checked its ownership before that bucket write and writes its outcome after it fails its
//! CAS and sees it lost; an owner whose outcome landed first wins, and the fencer puts the
//! completed record back (`restore`).
//!
//! Files, one idea each: this one has the handle and the operations the seam starts (`Store::start`); `format` the
//! byte formats only this store writes (buckets, quota counters, the layout registry, fill
//! counts; the entry and the slot are `store/record.rs`'s); `layout` the data keys, the
//! namespace registry and the placement secret; `placement` where a new record goes and the fill
//! shards; `commit` the slots (fence, restore, promote); `quota` the counters; `sweep` the sweep
//! and namespace retirement. The unit tests are in `tests`.

use crate::store::record::{self, Entry, State, FLAG_BODY_NOT_STORED};
use crate::store::seam::{Started, Store};
use crate::store::shared_data::{SharedData, SharedDataError};
use crate::store::{
    Begin, Claim, ClaimAttempt, Completion, Kept, OnLeaseEnd, Renew, Renewal, Settled, StoreAnswer,
    StoreError, StoreOp,
};
use commit::SLOT_ATTEMPTS;
use format::LAYOUT_V3;
use layout::{buckets_for, prefix_of, FILL_SHARD_BUCKETS};
use quota::CHARGE_FLAGS;
use std::cell::Cell;

pub mod admin;
mod commit;
pub mod format;
mod layout;
mod placement;
mod quota;
mod sweep;
#[cfg(test)]
mod tests;
mod tombstones;

pub use layout::{LAYOUTS_KEY, NAMESPACE, SECRET_KEY};
pub use quota::COUNTERS_PER_QUOTA_KEY;
pub use sweep::RETIRE_AFTER_MS;

/// Entries per bucket: small enough that a bucket (about 950 bytes) is cheap to copy under the
/// host's global shared-data lock on every request, large enough that uneven hashing rarely fills
/// one bucket while others have room.
pub const ENTRIES_PER_BUCKET: u8 = 8;

/// CAS attempts on a bucket, quota key or registry before giving up with `Contention`
/// (bounded: a retry storm must not spin a worker).
const CAS_ATTEMPTS: usize = 16;

/// Longest `retry-after` suggested when the store is full or a quota is reached.
const RETRY_CAP_MS: u64 = 60_000;

pub struct LocalStore<S: SharedData> {
    data: S,
    /// Live records at most (the configured capacity).
    records: u32,
    buckets: u32,
    prefix: String,
    /// Keys placement and quota tags (see `keyed`).
    secret: [u8; 32],
    created: u32,
    /// Whether a new record may take the place of an abandoned claim (processing past its
    /// lease, no outcome) when nothing else has room. Not while any attempt may say anything but
    /// take it over (`OnLeaseEnd::may_evict`): an evicted claim's retry would find no record and
    /// execute again, which is what marking it unknown (or looking it up) prevents.
    evict_abandoned: bool,
    /// Per fill shard, until when this worker does not try to reclaim room in it: a pass over
    /// all its buckets found only live records (`reclaim_in_shard`). Worker memory, not shared
    /// data: a pause only spares this worker's reads.
    reclaim_paused_until: Vec<Cell<u64>>,
    /// The room kept for tombstones (`tombstones.rs`), when a rule keeps them.
    tombstones: Option<tombstones::Room>,
}

fn host(e: SharedDataError) -> StoreError {
    match e {
        SharedDataError::CasMismatch => StoreError::Contention,
        SharedDataError::Host(code) => StoreError::Unavailable(format!("shared data status {code}")),
    }
}

fn retry_hint(until_ms: u64, now_ms: u64) -> u64 {
    until_ms.saturating_sub(now_ms).clamp(1, RETRY_CAP_MS)
}

impl<S: SharedData> LocalStore<S> {
    /// Prepares the store for traffic: creates every key of the layout that does not exist yet
    /// (keys that exist keep their records: shared data survives VM reloads), loads the shared
    /// placement secret (installing `fresh_secret` if no worker did yet), and registers this
    /// namespace in the layout registry. Call it where the main thread configures, before any
    /// worker serves; `fresh_secret` must be unpredictable to clients.
    pub fn open(data: S, capacity: u32, fresh_secret: [u8; 32], now_ms: u64) -> Result<Self, StoreError> {
        Self::open_for(data, capacity, fresh_secret, now_ms, true)
    }

    /// `open`, for a configuration that counts quotas (`quota`) or not: without quotas a new
    /// namespace is made without its quota keys (a tenth of its keys, and of its start), which
    /// a later configuration with quotas adds (`create_keys`).
    pub fn open_for(
        data: S,
        capacity: u32,
        fresh_secret: [u8; 32],
        now_ms: u64,
        quota: bool,
    ) -> Result<Self, StoreError> {
        let mut store = Self::unopened(data, capacity);
        store.created = store.create_keys(quota)?;
        store.secret = store.load_secret(fresh_secret)?;
        store.beat(now_ms)?;
        Ok(store)
    }

    /// A handle for in-crate tests that manage the layout themselves (`create_keys`), or want a
    /// layout that was never created. Its placement secret is fixed (all zeros), so only pair
    /// it with other `new` handles, never with `open`ed ones.
    #[cfg(feature = "testing")]
    pub fn new(data: S, capacity: u32) -> Self {
        Self::unopened(data, capacity)
    }

    fn unopened(data: S, capacity: u32) -> Self {
        let records = capacity.clamp(1, !LAYOUT_V3);
        let buckets = buckets_for(records);
        LocalStore {
            data,
            records,
            buckets,
            prefix: prefix_of(records),
            secret: [0; 32],
            created: 0,
            evict_abandoned: true,
            reclaim_paused_until: (0..buckets.div_ceil(FILL_SHARD_BUCKETS)).map(|_| Cell::new(0)).collect(),
            tombstones: None,
        }
    }

    /// Keeps a room of `room` tombstones (`store.tombstones`; 0: none), its keys created now
    /// and beaten in the layout registry beside the records'.
    pub fn keeping_tombstones(mut self, room: u32, now_ms: u64) -> Result<Self, StoreError> {
        if room == 0 {
            return Ok(self);
        }
        let kept = tombstones::Room::new(room);
        self.created = self.created.saturating_add(self.create_tombstone_keys(&kept)?);
        self.beat_in(tombstones::LAYOUTS_KEY, kept.room, now_ms)?;
        self.tombstones = Some(kept);
        Ok(self)
    }

    /// Tombstones the store keeps at most (0: none).
    pub fn tombstone_room(&self) -> u32 {
        self.tombstones.as_ref().map_or(0, |t| t.room)
    }

    /// Keeps abandoned claims until they expire instead of evicting them for room (see
    /// `evict_abandoned`): set when an attempt may end a lease otherwise than by a takeover.
    pub fn keeping_abandoned_claims(mut self, keep: bool) -> Self {
        self.evict_abandoned = !keep;
        self
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// Records the store can hold at most.
    pub fn capacity(&self) -> u64 {
        u64::from(self.records)
    }

    /// Keys `open` had to create (0 when the layout survived a reload).
    pub fn keys_created(&self) -> u32 {
        self.created
    }

    pub fn shared_data(&self) -> &S {
        &self.data
    }
}

impl<S: SharedData> LocalStore<S> {
    /// `complete`; `lease_over`: the completion of a claim nobody executes under (a
    /// lease end refused as outcome unknown), whose record says its lease ended at once.
    fn complete_as(&self, claim: &Claim, c: &Completion, lease_over: bool) -> Result<Settled, StoreError> {
        if c.state == State::Processing {
            return Err(StoreError::Corrupt("a completion must carry an outcome state".into()));
        }
        let Some((bucket, position)) = self.locate(claim) else { return Ok(Settled::Lost) };
        let data_key = self.slot_key(bucket, position);
        let mut commit: Option<(Entry, Vec<u8>)> = None;
        // A late completion of a claim whose charge the sweep dropped (abandoned) makes a live
        // record again: it counts again, past any bound, since its upstream already executed.
        let mut recharged: Option<Entry> = None;
        let refund = |recharged: &Option<Entry>| {
            if let Some(e) = recharged {
                self.uncharge(e);
            }
        };
        for _ in 0..SLOT_ATTEMPTS {
            // Slot first, then the ownership check, then the slot write as a CAS against that
            // first read: an owner that lost its record in between fails the CAS (whoever took
            // the position fenced the slot after its bucket write) instead of overwriting the
            // new owner's outcome. The bucket is only read here, so its contention cannot
            // starve the completion.
            // Read as a replay reads it (the label stepped over, not decoded): the label moves
            // into the outcome as its bytes.
            let (value, slot) = self.read_slot_as(bucket, position, record::decode_slot_outcome)?;
            let (entries, bucket_read) = self.read_bucket(bucket)?;
            let Some(i) = self.owned(&entries, claim, position) else {
                refund(&recharged);
                return Ok(Settled::Lost);
            };
            // The outcome keeps the label its claim left in the slot.
            let (label, committed) = match value {
                Some(v) if v.is_claim_label() => {
                    let own = v.belongs_to(&entries[i]);
                    let label = record::slot_label(slot.bytes()).ok().flatten().filter(|_| own);
                    (label, None)
                }
                other => (None, other),
            };
            if committed.is_some_and(|v| v.belongs_to(&entries[i])) {
                // Already completed (its promotion lost): an outcome is final.
                refund(&recharged);
                return Ok(Settled::Lost);
            }
            let (entry, bytes) = commit.get_or_insert_with(|| {
                let mut e = entries[i];
                if e.flags & CHARGE_FLAGS == 0 && (e.tenant_tag != 0 || e.principal_tag != 0) {
                    self.recharge(&mut e, c.now_ms, c.now_ms.saturating_add(c.ttl_ms));
                    recharged = Some(e);
                }
                e.state = c.state;
                e.status = c.status;
                e.flags = if c.snapshot.is_some() {
                    e.flags & !FLAG_BODY_NOT_STORED
                } else {
                    e.flags | FLAG_BODY_NOT_STORED
                };
                e.expires_at_ms = c.now_ms.saturating_add(c.ttl_ms);
                if lease_over {
                    e.lease_deadline_ms = e.lease_deadline_ms.min(c.now_ms);
                }
                let bytes = record::encode_slot_parts(&e, c.snapshot.as_ref(), label);
                (e, bytes)
            });
            if self.cas(&data_key, bytes, &slot)? {
                self.bury_completed(entry, c.now_ms, claim.tombstone_ms());
                let late = c.now_ms > entries[i].lease_deadline_ms;
                if let Err(e) = self.promote(bucket, entry, (entries, bucket_read)) {
                    log::debug!(
                        "completion of {} committed, bucket not promoted: {e}",
                        claim.scope.log_tag()
                    );
                }
                if late {
                    // Completed after its lease: it lives past what its counters assumed.
                    self.extend_charge(entry, entry.expires_at_ms);
                }
                return Ok(Settled::Done);
            }
        }
        refund(&recharged);
        Err(StoreError::Contention)
    }

    fn release_claim(&self, claim: &Claim) -> Result<Settled, StoreError> {
        let Some((bucket, position)) = self.locate(claim) else { return Ok(Settled::Lost) };
        for _ in 0..CAS_ATTEMPTS {
            let (committed, _) = self.read_slot(bucket, position)?;
            let (mut entries, read) = self.read_bucket(bucket)?;
            let Some(i) = self.owned(&entries, claim, position) else { return Ok(Settled::Lost) };
            if committed.is_some_and(|v| v.belongs_to(&entries[i])) {
                // Completed (its promotion lost): an outcome is final, it cannot be released.
                return Ok(Settled::Lost);
            }
            let gone = entries.remove(i);
            if self.write_bucket(bucket, &entries, &read)? {
                // Its slot is already empty: the claim fenced it and the owner never completed.
                self.uncharge(&gone);
                self.fill_adjust(self.shard_of(bucket), -1);
                return Ok(Settled::Done);
            }
        }
        Err(StoreError::Contention)
    }

    /// Moves a claim's lease end to `until_ms` (never past its record's expiry, never back) while
    /// it is still its owner's and without an outcome. The bucket entry's deadline is what every
    /// begin, eviction and sweep reads, and the CAS on the bucket orders the renewal with any of
    /// them: a takeover that wrote first makes the claim another's (false), one that comes after
    /// finds the lease running.
    fn renew_one(&self, r: &Renewal, until_ms: u64) -> Result<Kept, StoreError> {
        let claim = Claim {
            scope: r.scope,
            owner: r.owner,
            locator: r.locator,
            written: None,
            shard: 0,
            old_home: None,
            tombstone_s: 0,
        };
        let Some((bucket, position)) = self.locate(&claim) else { return Ok(Kept::Settled) };
        for _ in 0..CAS_ATTEMPTS {
            let (committed, _) = self.read_slot(bucket, position)?;
            let (mut entries, read) = self.read_bucket(bucket)?;
            let Some(i) = self.owned(&entries, &claim, position) else {
                // Another owner's entry of this scope where the claim was: taken over. Its own,
                // completed, or none: settled by its owner, or gone.
                let theirs = entries
                    .iter()
                    .any(|e| e.position == position && e.scope == r.scope && e.owner != r.owner);
                return Ok(if theirs { Kept::TakenOver } else { Kept::Settled });
            };
            if committed.is_some_and(|v| v.belongs_to(&entries[i])) {
                // Completed (its promotion lost): nothing left to keep.
                return Ok(Kept::Settled);
            }
            let until = until_ms.min(entries[i].expires_at_ms);
            if entries[i].lease_deadline_ms >= until {
                return Ok(Kept::Renewed);
            }
            entries[i].lease_deadline_ms = until;
            // Its quota counters already count it until past its expiry (`charge`): a renewal,
            // which never outlives the record, leaves them as they are.
            if self.write_bucket(bucket, &entries, &read)? {
                return Ok(Kept::Renewed);
            }
        }
        Err(StoreError::Contention)
    }
}

/// The local store on the one storage interface: shared data answers in place, so every
/// operation is answered as it starts.
impl<S: SharedData> Store for LocalStore<S> {
    fn start(&self, op: StoreOp, _now: &dyn Fn() -> u64) -> Started {
        Started::Answered(match op {
            StoreOp::Begin(attempt) => StoreAnswer::Begun(self.begin(&attempt)),
            StoreOp::Complete { claim, completion } => {
                StoreAnswer::Settled(self.complete(&claim, &completion))
            }
            StoreOp::Release(claim) => StoreAnswer::Settled(self.release_claim(&claim)),
            StoreOp::Renew(renew) => StoreAnswer::Renewed(self.renew(&renew)),
            StoreOp::Records(query) => StoreAnswer::Records(self.query_records(&query)),
            StoreOp::Amend { view, change, now_ms } => {
                StoreAnswer::Amended(self.amend_record(&view, &change, now_ms))
            }
        })
    }
    fn sweep(&self, now_ms: u64) -> Result<u32, StoreError> {
        self.sweep_shard(now_ms)
    }
}

/// The operations the seam starts (`start`, above), each answered in place.
impl<S: SharedData> LocalStore<S> {
    /// Claims the record, or says what holds it (`Begin`); a lease that ended is dealt with as
    /// the attempt's `on_lease_end` says.
    pub fn begin(&self, attempt: &ClaimAttempt) -> Result<Begin, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            match self.begin_once(attempt)? {
                Some(Begin::TookOver(claim)) => match attempt.on_lease_end {
                    // A lease end marked unknown: the record is taken over (so nobody else can)
                    // and at once completed as outcome unknown, through the same commit as any
                    // completion.
                    OnLeaseEnd::MarkUnknown => {
                        let unknown = Completion::outcome_unknown(attempt.now_ms, attempt.ttl_ms);
                        // Nobody executes under this claim: the record says its lease is over, so
                        // that an operator may release it at once (`Amendment::refusal`).
                        return Ok(match self.complete_as(&claim, &unknown, true)? {
                            Settled::Done => Begin::OutcomeUnknown,
                            // Taken from this claim in between (cannot happen while its fresh
                            // lease runs): whoever holds the record decides; ask again after a
                            // moment.
                            Settled::Lost => Begin::InFlight { retry_after_ms: 1_000 },
                        });
                    }
                    // (`Report` never takes over: `begin_once` answers `Unsettled` instead.)
                    OnLeaseEnd::TakeOver | OnLeaseEnd::Report => return Ok(Begin::TookOver(claim)),
                },
                Some(outcome) => return Ok(outcome),
                None => {}
            }
        }
        Err(StoreError::Contention)
    }

    /// Writes the outcome of a claim its owner executed.
    pub fn complete(&self, claim: &Claim, c: &Completion) -> Result<Settled, StoreError> {
        self.complete_as(claim, c, false)
    }

    /// Keeps each claim of `renew` for another lease, in order.
    pub fn renew(&self, renew: &Renew) -> Result<Vec<Kept>, StoreError> {
        let until_ms = renew.now_ms.saturating_add(renew.lease_ms);
        renew.claims.iter().map(|r| self.renew_one(r, until_ms)).collect()
    }
}

#[cfg(feature = "testing")]
impl<S: SharedData> crate::store::RecordStore for LocalStore<S> {
    fn begin(&self, attempt: &ClaimAttempt) -> Result<Begin, StoreError> {
        LocalStore::begin(self, attempt)
    }
    fn complete(&self, claim: &Claim, c: &Completion) -> Result<Settled, StoreError> {
        LocalStore::complete(self, claim, c)
    }
    fn release(&self, claim: &Claim) -> Result<Settled, StoreError> {
        self.release_claim(claim)
    }
    fn renew(&self, renew: &Renew) -> Result<Vec<Kept>, StoreError> {
        LocalStore::renew(self, renew)
    }

    fn records(&self, query: &crate::store::RecordQuery) -> Result<crate::store::RecordPage, StoreError> {
        self.query_records(query)
    }

    fn amend(
        &self,
        view: &crate::store::RecordView,
        change: &crate::store::Amendment,
        now_ms: u64,
    ) -> Result<Result<(), crate::store::Refusal>, StoreError> {
        self.amend_record(view, change, now_ms)
    }

    fn sweep(&self, now_ms: u64) -> Result<u32, StoreError> {
        self.sweep_shard(now_ms)
    }
}
