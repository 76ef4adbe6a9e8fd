//! The embedded store: records in Envoy's shared data, shared by every worker of one Envoy.
//!
//! Layout (namespace `idem:v3:<capacity>:`, so a capacity change starts a fresh namespace instead
//! of misreading the old placement; the old one is retired, see below):
//! - `b:<i>`     bucket i: up to ENTRIES_PER_BUCKET compact record entries (record.rs);
//! - `s:<i>:<p>` the snapshot slot of position p in bucket i: the record's committed outcome;
//! - `q:<j>`     quota key j: up to COUNTERS_PER_QUOTA_KEY live-record counters;
//! - `f:<k>`     fill shard k: how many entries buckets 64k..64k+63 hold (record.rs, Fill v3);
//! - `sweep`     the sweep cursor (a fill shard), so workers share the sweeping;
//! - `ready`     set once every key above exists.
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

use crate::identity::scope::ScopeId;
use crate::store::record::{
    self, Counter, Entry, Layout, SlotValue, State, FLAG_BODY_NOT_STORED, FLAG_PRINCIPAL_CHARGED,
    FLAG_TENANT_CHARGED, LAYOUT_V3,
};
use crate::store::shared_data::{Read, SharedData, SharedDataError};
use crate::store::{
    completed_answer, Begin, Claim, ClaimAttempt, Completion, QuotaCharge, RecordStore, Settled, StoreError,
};
use sha2::{Digest, Sha256};

/// Entries per bucket: small enough that a bucket (about 950 bytes) is cheap to copy under the
/// host's global shared-data lock on every request, large enough that uneven hashing rarely fills
/// one bucket while others have room.
pub const ENTRIES_PER_BUCKET: u8 = 8;

/// Counters per quota key. There is one quota key per bucket, so the store holds two counters
/// per record it can hold: room for a distinct tenant and principal for every live record, up
/// to uneven hashing (a quota key with no room answers `Full`, as a full bucket does).
pub const COUNTERS_PER_QUOTA_KEY: u8 = 16;

/// CAS attempts on a bucket, quota key or registry before giving up with `Contention`
/// (bounded: a retry storm must not spin a worker).
const CAS_ATTEMPTS: usize = 16;

/// Safety net for CAS loops on one slot. A slot CAS only loses to another write to the same slot
/// between our read and our write, and the only writers of a slot are its record's owner and
/// whoever just replaced or dropped the entry at that position. After such a write, our next
/// ownership check fails (we return `Lost`) or our next CAS succeeds; so the loop ends within a
/// few passes and this bound is never reached unless the host misbehaves.
const SLOT_ATTEMPTS: usize = 1000;

/// Buckets of a retired namespace emptied per sweep call (each bucket has 10 keys).
const RETIRE_BATCH: u32 = 16;

/// A namespace whose heartbeat is older than this is retired. Every live root sweeps (and so
/// beats) about once a second; after a config update the old roots are gone within seconds.
pub const RETIRE_AFTER_MS: u64 = 30_000;

/// Longest `retry-after` suggested when the store is full or a quota is reached.
const RETRY_CAP_MS: u64 = 60_000;

/// `retry-after` for a reached quota whose earliest record should have expired already: it still
/// counts until a sweep drops it, and sweeps run every second.
const QUOTA_RETRY_FALLBACK_MS: u64 = 1_000;

pub const NAMESPACE: &str = "idem:v3:";
/// Namespace of the previous placement (one bucket per key), retired like any other layout.
const NAMESPACE_V2: &str = "idem:v2:";
/// Global: one secret per Envoy, whatever placement reads it.
pub const SECRET_KEY: &str = "idem:v2:secret";
pub const LAYOUTS_KEY: &str = "idem:layouts";

/// Entry positions per record of capacity, as a fraction: 3/2. Two-choice placement over 1.5
/// positions per record refuses almost nothing below 90% fill (simulated with churn: 0.002% at
/// 90%, 0.04% at 95%); over exactly one position per record it refuses 9.5% at 90%.
const POSITIONS_NUM: u64 = 3;
const POSITIONS_DEN: u64 = 2;

/// Buckets per fill shard. Live records are capped at `capacity` by counting a shard's entries
/// in one key (`f:<k>`), with the shard's share of the capacity as its bound. Big shards even
/// out (64 buckets hold about 341 records: refusals at 90% fill 0.002%, as with one global
/// count; with 16 buckets, 0.07%) and a claim writes one shard key, so no key is hot.
const FILL_SHARD_BUCKETS: u32 = 64;

/// Buckets a claim sweeps at most when its fill shard counts no room (`reclaim_in_shard`): enough
/// to find ended records in a shard full of them, few enough to keep that claim cheap.
const RECLAIM_BUCKETS: usize = 4;

const PLACEMENT_TAG: &[u8] = b"idempotency-filter/placement/v3\0";
const TENANT_QUOTA_TAG: &[u8] = b"idempotency-filter/quota/tenant/v2\0";
const PRINCIPAL_QUOTA_TAG: &[u8] = b"idempotency-filter/quota/principal/v2\0";

pub struct LocalStore<S: SharedData> {
    data: S,
    /// Live records at most (the configured capacity).
    records: u32,
    buckets: u32,
    prefix: String,
    /// Keys placement and quota tags (see `keyed`).
    secret: [u8; 32],
    created: u32,
}

fn host(e: SharedDataError) -> StoreError {
    match e {
        SharedDataError::CasMismatch => StoreError::Contention,
        SharedDataError::Host(code) => StoreError::Unavailable(format!("shared data status {code}")),
    }
}

fn prefix_of(capacity: u32) -> String {
    format!("{NAMESPACE}{capacity}:")
}

/// Buckets for `capacity` records: 1.5 positions per record, in buckets of ENTRIES_PER_BUCKET. A
/// store that fits in one bucket stays one bucket: every key shares it, there is no placement
/// to balance, and its positions are the bound.
fn buckets_for(capacity: u32) -> u32 {
    let per = u64::from(ENTRIES_PER_BUCKET);
    if u64::from(capacity) <= per {
        return 1;
    }
    let positions = (u64::from(capacity) * POSITIONS_NUM).div_ceil(POSITIONS_DEN);
    u32::try_from(positions.div_ceil(per)).unwrap_or(u32::MAX)
}

fn shards_for(buckets: u32) -> u32 {
    buckets.div_ceil(FILL_SHARD_BUCKETS).max(1)
}

fn fill_key_in(prefix: &str, shard: u32) -> String {
    format!("{prefix}f:{shard}")
}

/// A retired or live namespace, from its registry id.
struct Namespace {
    prefix: String,
    buckets: u32,
    /// v3 namespaces have fill keys; v2 ones do not.
    fill: bool,
}

fn namespace_of(id: u32) -> Namespace {
    if id & LAYOUT_V3 != 0 {
        let capacity = id & !LAYOUT_V3;
        Namespace { prefix: prefix_of(capacity), buckets: buckets_for(capacity), fill: true }
    } else {
        Namespace { prefix: format!("{NAMESPACE_V2}{id}:"), buckets: id, fill: false }
    }
}

fn bucket_key_in(prefix: &str, bucket: u32) -> String {
    format!("{prefix}b:{bucket}")
}

fn slot_key_in(prefix: &str, bucket: u32, position: u8) -> String {
    format!("{prefix}s:{bucket}:{position}")
}

fn quota_key_in(prefix: &str, index: u32) -> String {
    format!("{prefix}q:{index}")
}

fn retry_hint(until_ms: u64, now_ms: u64) -> u64 {
    until_ms.saturating_sub(now_ms).clamp(1, RETRY_CAP_MS)
}

/// The entry flags that say a record counts against a quota.
const CHARGE_FLAGS: u8 = FLAG_TENANT_CHARGED | FLAG_PRINCIPAL_CHARGED;

/// What a new record was charged to: entry flags and tags.
#[derive(Debug, Clone, Copy, Default)]
struct Charged {
    flags: u8,
    tenant_tag: u64,
    principal_tag: u64,
}

enum Refusal {
    Exceeded { retry_after_ms: u64 },
    NoRoom { retry_after_ms: u64 },
}

impl Refusal {
    fn answer(self, tenant: bool) -> Begin {
        match self {
            Refusal::Exceeded { retry_after_ms } => Begin::QuotaExceeded { retry_after_ms, tenant },
            // A quota key without room for a new identity is a full store, as a full bucket is.
            Refusal::NoRoom { retry_after_ms } => Begin::Full { retry_after_ms },
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Apply {
    DryRun,
    Write,
}

impl<S: SharedData> LocalStore<S> {
    /// Prepares the store for traffic: creates every key of the layout that does not exist yet
    /// (keys that exist keep their records: shared data survives VM reloads), loads the shared
    /// placement secret (installing `fresh_secret` if no worker did yet), and registers this
    /// namespace in the layout registry. Call it where the main thread configures, before any
    /// worker serves; `fresh_secret` must be unpredictable to clients.
    pub fn open(data: S, capacity: u32, fresh_secret: [u8; 32], now_ms: u64) -> Result<Self, StoreError> {
        let mut store = Self::unopened(data, capacity);
        store.created = store.create_keys()?;
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
        LocalStore { data, records, buckets, prefix: prefix_of(records), secret: [0; 32], created: 0 }
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// Records the store can hold at most.
    pub fn capacity(&self) -> u64 {
        u64::from(self.records)
    }

    /// This namespace's id in the layout registry.
    fn layout_id(&self) -> u32 {
        LAYOUT_V3 | self.records
    }

    fn shards(&self) -> u32 {
        shards_for(self.buckets)
    }

    fn shard_of(&self, bucket: u32) -> u32 {
        bucket / FILL_SHARD_BUCKETS
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

    fn fill_key(&self, shard: u32) -> String {
        fill_key_in(&self.prefix, shard)
    }

    /// Keys `open` had to create (0 when the layout survived a reload).
    pub fn keys_created(&self) -> u32 {
        self.created
    }

    pub fn shared_data(&self) -> &S {
        &self.data
    }

    fn bucket_key(&self, bucket: u32) -> String {
        bucket_key_in(&self.prefix, bucket)
    }

    fn slot_key(&self, bucket: u32, position: u8) -> String {
        slot_key_in(&self.prefix, bucket, position)
    }

    fn cursor_key(&self) -> String {
        format!("{}sweep", self.prefix)
    }

    fn ready_key(&self) -> String {
        format!("{}ready", self.prefix)
    }

    pub(crate) fn create_keys(&self) -> Result<u32, StoreError> {
        let mut created = 0;
        let mut ensure = |data_key: &str| -> Result<(), StoreError> {
            if !self.data.get(data_key).map_err(host)?.exists() {
                self.data.set(data_key, &[], None).map_err(host)?;
                created += 1;
            }
            Ok(())
        };
        // Created empty, so a creation race (set on a missing key ignores CAS) can only write
        // the same empty value twice; the contents are then installed by CAS.
        ensure(SECRET_KEY)?;
        ensure(LAYOUTS_KEY)?;
        if self.data.get(&self.ready_key()).map_err(host)?.exists() {
            return Ok(created);
        }
        for b in 0..self.buckets {
            ensure(&self.bucket_key(b))?;
            for p in 0..ENTRIES_PER_BUCKET {
                ensure(&self.slot_key(b, p))?;
            }
            ensure(&quota_key_in(&self.prefix, b))?;
        }
        for k in 0..self.shards() {
            ensure(&self.fill_key(k))?;
        }
        ensure(&self.cursor_key())?;
        self.data.set(&self.ready_key(), b"1", None).map_err(host)?;
        Ok(created)
    }

    /// The first secret installed wins: install ours only while the key is still empty (a CAS
    /// on an existing key), then read back whichever is there.
    fn load_secret(&self, fresh: [u8; 32]) -> Result<[u8; 32], StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(SECRET_KEY).map_err(host)?;
            if !read.exists() {
                return Err(StoreError::Unavailable(format!("{SECRET_KEY} was never created")));
            }
            if let Some(v) = read.value {
                return <[u8; 32]>::try_from(v.as_slice())
                    .map_err(|_| StoreError::Corrupt(format!("{SECRET_KEY}: {} bytes", v.len())));
            }
            match self.data.set(SECRET_KEY, &fresh, read.cas) {
                Ok(()) | Err(SharedDataError::CasMismatch) => {}
                Err(e) => return Err(host(e)),
            }
        }
        Err(StoreError::Contention)
    }

    /// Keyed hash. Placement and quota tags are keyed with the shared secret because the scope
    /// id and the identity digests are public functions of what a client sends: unkeyed, an
    /// attacker could compute offline which keys land in one bucket (or quota key) and fill it
    /// for everybody placed there.
    fn keyed(&self, domain: &[u8], data: &[u8]) -> u64 {
        let mut h = Sha256::new();
        h.update(domain);
        h.update(self.secret);
        h.update(data);
        let d = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        u64::from_be_bytes(b)
    }

    /// The two buckets a scope may live in: its primary and its secondary (the same bucket now
    /// and then, and always in a one-bucket store).
    fn buckets_of(&self, scope: &ScopeId) -> (u32, u32) {
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
    fn bucket_of(&self, scope: &ScopeId) -> u32 {
        self.buckets_of(scope).0
    }

    fn quota_key(&self, tag: u64) -> String {
        quota_key_in(&self.prefix, u32::try_from(tag % u64::from(self.buckets)).unwrap_or(0))
    }

    fn locate(&self, claim: &Claim) -> Option<(u32, u8)> {
        let bucket = u32::try_from(claim.locator >> 8).ok()?;
        let position = u8::try_from(claim.locator & 0xff).ok()?;
        (bucket < self.buckets && position < ENTRIES_PER_BUCKET).then_some((bucket, position))
    }

    /// Reads a bucket that must exist; a missing key means the layout was never created.
    fn read_bucket(&self, bucket: u32) -> Result<(Vec<Entry>, Read), StoreError> {
        let data_key = self.bucket_key(bucket);
        let read = self.data.get(&data_key).map_err(host)?;
        if !read.exists() {
            return Err(StoreError::Unavailable(format!("{data_key} was never created")));
        }
        let entries = record::decode_bucket(read.bytes(), ENTRIES_PER_BUCKET)
            .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e:?}")))?;
        Ok((entries, read))
    }

    /// CAS-writes a bucket. Ok(false): another writer got there first; re-read and retry.
    fn write_bucket(&self, bucket: u32, entries: &[Entry], read: &Read) -> Result<bool, StoreError> {
        self.cas(&self.bucket_key(bucket), &record::encode_bucket(entries), read)
    }

    fn cas(&self, data_key: &str, bytes: &[u8], read: &Read) -> Result<bool, StoreError> {
        if !read.exists() {
            // Never create a key here: creation ignores CAS.
            return Err(StoreError::Unavailable(format!("{data_key} was never created")));
        }
        match self.data.set(data_key, bytes, read.cas) {
            Ok(()) => Ok(true),
            Err(SharedDataError::CasMismatch) => Ok(false),
            Err(e) => Err(host(e)),
        }
    }

    /// Reads a slot that must exist, and the outcome it holds, whoever it belongs to.
    fn read_slot(&self, bucket: u32, position: u8) -> Result<(Option<SlotValue>, Read), StoreError> {
        let data_key = self.slot_key(bucket, position);
        let read = self.data.get(&data_key).map_err(host)?;
        if !read.exists() {
            return Err(StoreError::Unavailable(format!("{data_key} was never created")));
        }
        let Some(bytes) = read.value.as_deref() else { return Ok((None, read)) };
        let slot =
            record::decode_slot(bytes).map_err(|e| StoreError::Corrupt(format!("{data_key}: {e:?}")))?;
        Ok((Some(slot), read))
    }

    /// The entry as it really stands: a processing entry whose slot holds its committed outcome
    /// is completed (its bucket promotion may have lost). Returns the slot read too, for a fence.
    fn resolve(
        &self,
        bucket: u32,
        e: &Entry,
    ) -> Result<(Entry, Option<SlotValue>, Option<Read>), StoreError> {
        if e.is_completed() {
            return Ok((*e, None, None));
        }
        let (slot, read) = self.read_slot(bucket, e.position)?;
        match slot.filter(|v| v.belongs_to(e)) {
            Some(v) => Ok((Entry { position: e.position, ..v.entry }, Some(v), Some(read))),
            None => Ok((*e, None, Some(read))),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Restored {
    Placed,
    Occupied,
    Superseded,
}

/// The slot write a replacing or dropping writer makes after its bucket write, and what it found.
enum Fenced {
    Done,
    /// An outcome committed before the fence: the completed record was put back instead.
    RolledBack,
}

impl<S: SharedData> LocalStore<S> {
    fn begin_once(&self, a: &ClaimAttempt) -> Result<Option<Begin>, StoreError> {
        let (primary, secondary) = self.buckets_of(&a.scope);
        let first = self.read_bucket(primary)?;
        if let Some(existing) = first.0.iter().find(|e| e.scope == a.scope).copied() {
            return self.begin_existing(a, primary, first, existing, primary);
        }
        // The primary is read before the secondary: see `confirm` for why the order matters.
        let second = if secondary == primary { None } else { Some(self.read_bucket(secondary)?) };
        if let Some(second) = second {
            if let Some(existing) = second.0.iter().find(|e| e.scope == a.scope).copied() {
                return self.begin_existing(a, secondary, second, existing, primary);
            }
            return self.begin_new(a, primary, vec![(primary, first), (secondary, second)]);
        }
        self.begin_new(a, primary, vec![(primary, first)])
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
            return match self.fence(bucket, &next, slot_read, now)? {
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
        // Expired (per its committed outcome, if any): absent, and its place is reused. It is
        // replaced where it is, so a scope never has entries in both of its buckets.
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
                // are few. Reclaim them from a few of its other buckets, then charge once more.
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
        match self.fence(bucket, &new, slot_read, now)? {
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
    /// outcome in its slot (abandoned: exactly as safe to replace as a takeover is). Prefers the
    /// one that ended first. Err: nothing evictable, and when something may become so.
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
            if current.is_expired(now) || !current.is_completed() {
                return Ok(Ok(*e));
            }
            soonest = soonest.min(current.expires_at_ms);
        }
        Ok(Err(retry_hint(soonest, now)))
    }

    /// The snapshot of a completed entry, if its slot holds this record's outcome.
    fn read_snapshot(
        &self,
        bucket: u32,
        entry: &Entry,
    ) -> Result<Option<crate::store::record::Snapshot>, StoreError> {
        let (slot, _) = self.read_slot(bucket, entry.position)?;
        // A slot may still hold the outcome of an earlier record at this position, or already a
        // newer one: only the outcome tagged with this entry's scope and owner is its own.
        Ok(slot.filter(|v| v.belongs_to(entry)).and_then(|v| v.snapshot))
    }

    /// After putting `ours` at its position, empties the slot as a CAS against `pre` (read
    /// before the bucket write). Any owner of the replaced record that checked ownership before
    /// our bucket write and writes its outcome after this fails its CAS; an outcome that landed
    /// first wins, and the bucket is rolled back to it.
    fn fence(&self, bucket: u32, ours: &Entry, pre: Read, now: u64) -> Result<Fenced, StoreError> {
        let data_key = self.slot_key(bucket, ours.position);
        let mut read = pre;
        for _ in 0..SLOT_ATTEMPTS {
            // Written even when the slot is already empty: the write bumps the slot's CAS, which
            // is what makes a late owner holding an older read fail.
            if self.cas(&data_key, &[], &read)? {
                return Ok(Fenced::Done);
            }
            let (slot, again) = self.read_slot(bucket, ours.position)?;
            if let Some(v) = slot.filter(|v| !v.belongs_to(ours) && !v.entry.is_expired(now)) {
                if self.restore(bucket, ours.position, &v, Some(ours))? != Restored::Superseded {
                    return Ok(Fenced::RolledBack);
                }
                // Superseded by a newer record of its scope: nothing to give way to.
            }
            read = again;
        }
        Err(StoreError::Contention)
    }

    /// Puts a committed outcome back at its position in the bucket: in place of its own
    /// processing entry, of `ours` (the entry whose fence found it), or in a free position.
    fn restore(
        &self,
        bucket: u32,
        position: u8,
        v: &SlotValue,
        ours: Option<&Entry>,
    ) -> Result<Restored, StoreError> {
        let restored = Entry { position, ..v.entry };
        let is = |e: &Entry, o: &Entry| e.scope == o.scope && e.owner == o.owner;
        for _ in 0..CAS_ATTEMPTS {
            let (mut entries, read) = self.read_bucket(bucket)?;
            let mut pushed = false;
            match entries.iter().position(|e| e.position == position) {
                Some(i) if entries[i] == restored => return Ok(Restored::Placed),
                Some(i) if is(&entries[i], &restored) || ours.is_some_and(|o| is(&entries[i], o)) => {
                    entries[i] = restored;
                }
                // A newer writer holds the position: its own fence settles the outcome.
                Some(_) => return Ok(Restored::Occupied),
                // The scope already has a newer record: this outcome was superseded.
                None if entries.iter().any(|e| e.scope == restored.scope) => return Ok(Restored::Superseded),
                None if self.elsewhere(bucket, &restored.scope)? => return Ok(Restored::Superseded),
                None => {
                    entries.push(restored);
                    pushed = true;
                }
            }
            if self.write_bucket(bucket, &entries, &read)? {
                if pushed {
                    // Its drop was discharged; back in the bucket, it counts again.
                    self.fill_adjust(self.shard_of(bucket), 1);
                }
                return Ok(Restored::Placed);
            }
        }
        Err(StoreError::Contention)
    }

    /// Whether the scope has an entry in its other bucket than `bucket`.
    fn elsewhere(&self, bucket: u32, scope: &ScopeId) -> Result<bool, StoreError> {
        let (primary, secondary) = self.buckets_of(scope);
        let other = if bucket == primary { secondary } else { primary };
        if other == bucket {
            return Ok(false);
        }
        let (entries, _) = self.read_bucket(other)?;
        Ok(entries.iter().any(|e| e.scope == *scope))
    }

    /// Takes one unit of a fill shard's bound for a new entry. Ok(false): the shard holds its
    /// share of the capacity already.
    fn fill_charge(&self, shard: u32) -> Result<bool, StoreError> {
        let data_key = self.fill_key(shard);
        let bound = self.shard_bound(shard);
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(&data_key).map_err(host)?;
            let count = record::decode_fill(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e:?}")))?;
            if count >= bound {
                return Ok(false);
            }
            if self.cas(&data_key, &record::encode_fill(count + 1), &read)? {
                return Ok(true);
            }
        }
        Err(StoreError::Contention)
    }

    /// Best effort, without a bound: a lost adjustment is corrected when the sweep recounts the
    /// shard (`recount`).
    fn fill_adjust(&self, shard: u32, delta: i64) {
        let data_key = self.fill_key(shard);
        for _ in 0..CAS_ATTEMPTS {
            let Ok(read) = self.data.get(&data_key) else { break };
            let Ok(count) = record::decode_fill(read.bytes()) else { break };
            let next = u32::try_from((i64::from(count) + delta).max(0)).unwrap_or(u32::MAX);
            match self.cas(&data_key, &record::encode_fill(next), &read) {
                Ok(true) => return,
                Ok(false) => {}
                Err(_) => break,
            }
        }
        log::debug!("fill count of shard {shard} not adjusted by {delta}");
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

    /// Best effort: the committed outcome is already true; this only saves readers a slot read.
    /// `first` is the bucket as read for the ownership check: usually still current, so the
    /// common case costs no second read.
    fn promote(&self, bucket: u32, committed: &Entry, first: (Vec<Entry>, Read)) -> Result<(), StoreError> {
        let mut current = Some(first);
        for _ in 0..CAS_ATTEMPTS {
            let (mut entries, read) = match current.take() {
                Some(first) => first,
                None => self.read_bucket(bucket)?,
            };
            let Some(i) = entries.iter().position(|e| {
                e.position == committed.position
                    && e.scope == committed.scope
                    && e.owner == committed.owner
                    && !e.is_completed()
            }) else {
                return Ok(());
            };
            entries[i] = *committed;
            if self.write_bucket(bucket, &entries, &read)? {
                return Ok(());
            }
        }
        Ok(())
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
    }
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
            let (committed, slot) = self.read_slot(bucket, position)?;
            let (entries, bucket_read) = self.read_bucket(bucket)?;
            let Some(i) = self.owned(&entries, claim, position) else {
                refund(&recharged);
                return Ok(Settled::Lost);
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
                let bytes = record::encode_slot(&SlotValue { entry: e, snapshot: c.snapshot.clone() });
                (e, bytes)
            });
            if self.cas(&data_key, bytes, &slot)? {
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

    fn release(&self, claim: &Claim) -> Result<Settled, StoreError> {
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

    fn sweep(&self, now_ms: u64) -> Result<u32, StoreError> {
        let housekeeping = self.housekeep(now_ms);
        let cursor_key = self.cursor_key();
        let cursor = self.data.get(&cursor_key).map_err(host)?;
        if !cursor.exists() {
            return Err(StoreError::Unavailable(format!("{cursor_key} was never created")));
        }
        // The cursor names the next fill shard: a sweep call covers one shard's buckets, then
        // recounts the shard, so a fill count that lost an adjustment (a crash between two
        // writes) is corrected within one pass over the store.
        let shard = cursor
            .value
            .as_deref()
            .and_then(|v| <[u8; 4]>::try_from(v).ok())
            .map(u32::from_be_bytes)
            .unwrap_or(0)
            % self.shards();
        let next = (shard + 1) % self.shards();
        // Taking the shard by CAS spreads sweeping over the workers; a worker that loses the race
        // simply skips this tick.
        if !self.cas(&cursor_key, &next.to_be_bytes(), &cursor)? {
            return housekeeping.map(|()| 0);
        }
        let mut swept = 0;
        for bucket in self.shard_buckets(shard) {
            swept += self.sweep_bucket(bucket, now_ms)?;
            self.discharge_abandoned(bucket, now_ms)?;
        }
        self.recount(shard)?;
        housekeeping.map(|()| swept)
    }
}

impl<S: SharedData> LocalStore<S> {
    fn shard_buckets(&self, shard: u32) -> std::ops::Range<u32> {
        let start = shard.saturating_mul(FILL_SHARD_BUCKETS).min(self.buckets);
        start..start.saturating_add(FILL_SHARD_BUCKETS).min(self.buckets)
    }

    /// Sets the shard's fill count to the entries its buckets hold, as a CAS against a read
    /// taken before them: a charge or discharge that lands meanwhile fails the write (the next
    /// pass tries again). A claim that was charged before that read and writes its bucket after
    /// the bucket was read goes uncounted until the next pass: the bound may be passed by the
    /// claims in flight at that instant.
    fn recount(&self, shard: u32) -> Result<(), StoreError> {
        let data_key = self.fill_key(shard);
        let read = self.data.get(&data_key).map_err(host)?;
        let counted = record::decode_fill(read.bytes())
            .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e:?}")))?;
        let mut held: u32 = 0;
        for bucket in self.shard_buckets(shard) {
            let (entries, _) = self.read_bucket(bucket)?;
            held = held.saturating_add(u32::try_from(entries.len()).unwrap_or(u32::MAX));
        }
        if held != counted {
            log::debug!("fill count of shard {shard} corrected from {counted} to {held}");
            self.cas(&data_key, &record::encode_fill(held), &read)?;
        }
        Ok(())
    }

    /// Claims whose lease ended without an outcome stop counting against their quota: a client
    /// whose requests keep being cut off (mobile networks, impatient clients) must not lock
    /// itself out until the ttl. The entry stays, for takeover and for refusing a different
    /// payload; a takeover charges it again. An owner that commits between the check and the
    /// bucket write leaves its completed record uncounted (a bounded under-count).
    fn discharge_abandoned(&self, bucket: u32, now_ms: u64) -> Result<(), StoreError> {
        let (entries, read) = self.read_bucket(bucket)?;
        let mut abandoned = Vec::new();
        for e in entries.iter().filter(|e| {
            !e.is_completed()
                && e.lease_deadline_ms <= now_ms
                && !e.is_expired(now_ms)
                && e.flags & CHARGE_FLAGS != 0
        }) {
            let (current, _, _) = self.resolve(bucket, e)?;
            if !current.is_completed() {
                abandoned.push(*e);
            }
        }
        if abandoned.is_empty() {
            return Ok(());
        }
        let next: Vec<Entry> = entries
            .iter()
            .map(|e| if abandoned.contains(e) { Entry { flags: e.flags & !CHARGE_FLAGS, ..*e } } else { *e })
            .collect();
        // Losing the race is fine: the next sweep pass looks again.
        if self.write_bucket(bucket, &next, &read)? {
            for e in &abandoned {
                self.uncharge(e);
            }
        }
        Ok(())
    }

    /// Sweeps the buckets of `shard` that follow `from` (wrapping within the shard, `skip`ped
    /// ones left alone: a claim holds reads of them) until one gives back room, at most
    /// `RECLAIM_BUCKETS` of them. The records dropped.
    fn reclaim_in_shard(&self, shard: u32, from: u32, skip: &[u32], now_ms: u64) -> Result<u32, StoreError> {
        let buckets = self.shard_buckets(shard);
        let len = buckets.end.saturating_sub(buckets.start);
        let after_from = (1..len)
            .map(|step| buckets.start + (from.saturating_sub(buckets.start) + step) % len)
            .filter(|bucket| !skip.contains(bucket))
            .take(RECLAIM_BUCKETS);
        for bucket in after_from {
            let swept = self.sweep_bucket(bucket, now_ms)?;
            if swept > 0 {
                return Ok(swept);
            }
        }
        Ok(0)
    }

    fn sweep_bucket(&self, bucket: u32, now_ms: u64) -> Result<u32, StoreError> {
        let (entries, _) = self.read_bucket(bucket)?;
        // Read the slots first: emptying one is a CAS against this read, so an outcome committed
        // after it (or a newer record's fence) is never wiped.
        let mut dropped = Vec::new();
        for e in entries.iter().filter(|e| e.is_expired(now_ms)) {
            let (current, committed, _) = self.resolve(bucket, e)?;
            if let Some(v) = committed.filter(|_| !current.is_expired(now_ms)) {
                // Completed after all; only its promotion was lost.
                let _ = self.restore(bucket, e.position, &v, None)?;
                continue;
            }
            let (_, read) = self.read_slot(bucket, e.position)?;
            dropped.push((*e, read));
        }
        if dropped.is_empty() {
            return Ok(0);
        }
        let (mut entries, read) = self.read_bucket(bucket)?;
        entries.retain(|e| !dropped.iter().any(|(d, _)| d == e));
        if !self.write_bucket(bucket, &entries, &read)? {
            return Ok(0);
        }
        let mut swept = 0;
        for (e, slot) in dropped {
            let data_key = self.slot_key(bucket, e.position);
            if slot.value.is_some() && !self.cas(&data_key, &[], &slot)? {
                let (now_there, _) = self.read_slot(bucket, e.position)?;
                if let Some(v) = now_there.filter(|v| v.belongs_to(&e) && !v.entry.is_expired(now_ms)) {
                    // Its owner committed between our checks: the record lives on.
                    let _ = self.restore(bucket, e.position, &v, None)?;
                    continue;
                }
            }
            self.uncharge(&e);
            swept += 1;
        }
        if swept > 0 {
            self.fill_adjust(self.shard_of(bucket), -i64::from(swept));
        }
        Ok(swept)
    }
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

    fn charge(&self, q: &QuotaCharge, a: &ClaimAttempt) -> Result<Result<Charged, Begin>, StoreError> {
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
    ) -> Result<Result<(), Refusal>, StoreError> {
        let data_key = self.quota_key(tag);
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(&data_key).map_err(host)?;
            let mut counters = record::decode_counters(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e:?}")))?;
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
                        return Ok(Err(Refusal::Exceeded { retry_after_ms: wait.clamp(1, RETRY_CAP_MS) }));
                    }
                    c.count += 1;
                    c.soonest_ms = if c.soonest_ms > now { c.soonest_ms.min(expires) } else { expires };
                    c.until_ms = c.until_ms.max(until);
                }
                _ => {
                    if limit == 0 {
                        return Ok(Err(Refusal::Exceeded { retry_after_ms: RETRY_CAP_MS }));
                    }
                    // A new identity, or one whose counter healed: a new epoch.
                    let fresh =
                        Counter { tag, count: 1, since_ms: now, soonest_ms: expires, until_ms: until };
                    match found {
                        Some(i) => counters[i] = fresh,
                        None if counters.len() >= usize::from(COUNTERS_PER_QUOTA_KEY) => {
                            let soonest = counters.iter().map(|c| c.until_ms).min().unwrap_or(now);
                            return Ok(Err(Refusal::NoRoom { retry_after_ms: retry_hint(soonest, now) }));
                        }
                        None => counters.push(fresh),
                    }
                }
            }
            if apply == Apply::DryRun || self.cas(&data_key, &record::encode_counters(&counters), &read)? {
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
    fn recharge(&self, e: &mut Entry, now: u64, expires: u64) {
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

    fn uncharge(&self, e: &Entry) {
        self.discharge(e.flags, e.tenant_tag, e.principal_tag, e.charged_at_ms);
    }

    /// Best effort: pushes the counters' `until_ms` so they cover the record until `until_ms`.
    fn extend_charge(&self, e: &Entry, until_ms: u64) {
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
            let mut counters = record::decode_counters(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e:?}")))?;
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
            if self.cas(&data_key, &record::encode_counters(&counters), &read)? {
                return Ok(());
            }
        }
        Err(StoreError::Contention)
    }
}

/// Retirement of namespaces left behind by a capacity change. Envoy never frees keys, but their
/// values can be emptied: every live root beats its namespace in `idem:layouts` on each sweep,
/// and a namespace not beaten for RETIRE_AFTER_MS has no root left (two configs alive at once
/// both beat, so neither retires the other). Sweeps then empty its keys a batch per call and
/// drop it from the registry. A namespace revived during retirement (a config rolled back within
/// seconds) beats again and stops it, but can lose the records of the batch being emptied at that
/// moment.
impl<S: SharedData> LocalStore<S> {
    fn housekeep(&self, now_ms: u64) -> Result<(), StoreError> {
        let layouts = self.beat(now_ms)?;
        let stale = layouts
            .iter()
            .find(|l| l.buckets != self.layout_id() && now_ms >= l.beat_ms.saturating_add(RETIRE_AFTER_MS));
        match stale {
            Some(old) => self.retire_step(*old),
            None => Ok(()),
        }
    }

    fn beat(&self, now_ms: u64) -> Result<Vec<Layout>, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(LAYOUTS_KEY).map_err(host)?;
            let mut layouts = record::decode_layouts(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{LAYOUTS_KEY}: {e:?}")))?;
            match layouts.iter_mut().find(|l| l.buckets == self.layout_id()) {
                Some(l) if l.beat_ms >= now_ms && l.cursor == 0 => return Ok(layouts),
                Some(l) => {
                    l.beat_ms = l.beat_ms.max(now_ms);
                    l.cursor = 0;
                }
                None => layouts.push(Layout { buckets: self.layout_id(), beat_ms: now_ms, cursor: 0 }),
            }
            if self.cas(LAYOUTS_KEY, &record::encode_layouts(&layouts), &read)? {
                return Ok(layouts);
            }
        }
        Err(StoreError::Contention)
    }

    fn retire_step(&self, old: Layout) -> Result<(), StoreError> {
        let ns = namespace_of(old.buckets);
        let start = old.cursor.min(ns.buckets);
        let end = start.saturating_add(RETIRE_BATCH).min(ns.buckets);
        let finished = end >= ns.buckets;
        // Take the batch by CAS on the registry, as the sweep cursor does: roots share the work,
        // and a namespace that beat again in the meantime is left alone.
        let read = self.data.get(LAYOUTS_KEY).map_err(host)?;
        let mut layouts = record::decode_layouts(read.bytes())
            .map_err(|e| StoreError::Corrupt(format!("{LAYOUTS_KEY}: {e:?}")))?;
        let Some(i) = layouts.iter().position(|l| *l == old) else { return Ok(()) };
        if finished {
            layouts.remove(i);
        } else {
            layouts[i].cursor = end;
        }
        if !self.cas(LAYOUTS_KEY, &record::encode_layouts(&layouts), &read)? {
            return Ok(());
        }
        let prefix = ns.prefix;
        for b in start..end {
            self.empty(&bucket_key_in(&prefix, b))?;
            for p in 0..ENTRIES_PER_BUCKET {
                self.empty(&slot_key_in(&prefix, b, p))?;
            }
            self.empty(&quota_key_in(&prefix, b))?;
            if ns.fill && (b + 1 == ns.buckets || (b + 1) % FILL_SHARD_BUCKETS == 0) {
                self.empty(&fill_key_in(&prefix, b / FILL_SHARD_BUCKETS))?;
            }
        }
        if finished {
            self.empty(&format!("{prefix}sweep"))?;
            self.empty(&format!("{prefix}ready"))?;
        }
        Ok(())
    }

    /// Empties a key's value if it holds one; never creates a key.
    fn empty(&self, data_key: &str) -> Result<(), StoreError> {
        let read = self.data.get(data_key).map_err(host)?;
        if read.value.is_some() {
            match self.data.set(data_key, &[], read.cas) {
                Ok(()) | Err(SharedDataError::CasMismatch) => {}
                Err(e) => return Err(host(e)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{attempt, charged, claimed, done, snapshot, Backend, LEASE, TTL};
    use crate::store::fake::{FakeSharedData, Interleave};
    use crate::store::record::Snapshot;

    struct Local {
        data: FakeSharedData,
        capacity: u32,
    }

    fn open<S: SharedData>(data: S, capacity: u32, seed: u8) -> LocalStore<S> {
        LocalStore::open(data, capacity, [seed; 32], 0).unwrap()
    }

    impl Backend for Local {
        fn with_capacity(capacity: u32) -> Self {
            let local = Local { data: FakeSharedData::new(), capacity };
            open(&local.data, capacity, 1);
            local
        }
        fn worker(&self, n: u8) -> Box<dyn RecordStore + '_> {
            // Each worker brings its own fresh secret; the first one installed is shared.
            Box::new(open(&self.data, self.capacity, n.wrapping_add(2)))
        }
    }

    mod conformance {
        crate::conformance_suite!(super::Local);
    }

    fn only_bucket(data: &FakeSharedData) -> Vec<Entry> {
        record::decode_bucket(data.get("idem:v3:8:b:0").unwrap().bytes(), ENTRIES_PER_BUCKET).unwrap()
    }

    /// Seeded splitmix64: the placement tests draw the same keys and churn on every run.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn below_ninety_percent_of_capacity_almost_no_new_key_is_refused() {
        // Issue 11: with one bucket of 8 per key, about 10% of new keys were refused at 90% fill
        // (Poisson(7.2) >= 8). Fill to 90% with random keys, then churn at 90% (a random record
        // goes, a new key comes) as many times as the store holds records.
        const CAPACITY: u32 = 4_000;
        let b = Local::with_capacity(CAPACITY);
        let workers = [b.worker(0), b.worker(1)];
        let mut rng = Rng(11);
        let mut live: Vec<Claim> = Vec::new();
        let (mut tried, mut refused) = (0u32, 0u32);
        let target = (CAPACITY as usize) * 9 / 10;
        let attempt_one = |live: &mut Vec<Claim>, rng: &mut Rng, tried: &mut u32, refused: &mut u32| {
            *tried += 1;
            let w = &workers[rng.below(2)];
            match w.begin(&attempt(rng.next(), 1, u64::from(*tried), 0)).unwrap() {
                Begin::Claimed(c) => live.push(c),
                Begin::Full { .. } => *refused += 1,
                other => panic!("{other:?}"),
            }
        };
        while live.len() < target && tried < 2 * CAPACITY {
            attempt_one(&mut live, &mut rng, &mut tried, &mut refused);
        }
        assert_eq!(live.len(), target, "{refused} of {tried} refused while filling");
        for _ in 0..CAPACITY {
            let gone = live.swap_remove(rng.below(live.len()));
            assert_eq!(workers[rng.below(2)].release(&gone).unwrap(), Settled::Done);
            attempt_one(&mut live, &mut rng, &mut tried, &mut refused);
        }
        assert!(
            u64::from(refused) * 1_000 < u64::from(tried),
            "{refused} of {tried} new keys refused at or below 90% of capacity"
        );
    }

    #[test]
    fn records_expired_but_not_yet_swept_do_not_refuse_new_keys() {
        // A short ttl at a high rate: live records are a fifth of the capacity, but the sweep
        // (one shard of 64 buckets a second) takes 24 s per pass, thirty ttls, so most records in
        // the store have expired and still count in their shard's fill. Found by the bench's
        // memory phase (ttl 5 s, 4,300 new keys/s: 0.3% refused at 21% live). The claims of such a
        // shard find their own two buckets swept clean and only live, so only reclaiming
        // elsewhere in the shard makes room.
        let capacity: u32 = 8_000; // 1,500 buckets, 24 fill shards: a sweep pass takes 24 s
        let ttl_ms: u64 = 800;
        const STEP_US: u64 = 500; // 2,000 new keys a second: 1,600 live, 20% of capacity
        let b = Local::with_capacity(capacity);
        let w = b.worker(0);
        let mut rng = Rng(5);
        let (mut tried, mut refused, mut next_sweep_ms) = (0u64, 0u64, 1_000u64);
        // 30 s: the store saturates with ended records after 4 s; before the fix, 0.2% refused.
        for n in 0..60_000u64 {
            let now_ms = n * STEP_US / 1_000;
            if now_ms >= next_sweep_ms {
                w.sweep(now_ms).unwrap();
                next_sweep_ms += 1_000;
            }
            tried += 1;
            // As the bench: one caller, quotas as large as the store, lease as long as the ttl.
            let a = ClaimAttempt {
                ttl_ms,
                lease_ms: ttl_ms,
                ..charged(rng.next(), n + 1, now_ms, 0, Some(0), (capacity, capacity))
            };
            match w.begin(&a).unwrap() {
                Begin::Claimed(c) => {
                    let c2 = Completion { ttl_ms, ..done("r", now_ms) };
                    assert_eq!(w.complete(&c, &c2).unwrap(), Settled::Done);
                }
                Begin::Full { .. } => refused += 1,
                other => panic!("{other:?}"),
            }
        }
        assert!(refused * 1_000 < tried, "{refused} of {tried} new keys refused at 20% of capacity live");
    }

    #[test]
    fn at_capacity_new_keys_are_refused_and_no_live_record_is_dropped() {
        // The store fills to exactly its capacity (not a bucket's worth less, not more: positions
        // are overprovisioned, live records are not), then only refuses.
        const CAPACITY: u32 = 2_000;
        let b = Local::with_capacity(CAPACITY);
        let w = b.worker(0);
        let mut rng = Rng(7);
        let mut live = Vec::new();
        let mut tried = 0u64;
        while live.len() < CAPACITY as usize && tried < u64::from(CAPACITY) * 11 / 10 {
            tried += 1;
            let n = rng.next();
            match w.begin(&attempt(n, 1, tried, 0)).unwrap() {
                Begin::Claimed(c) => {
                    // Half completed, half still processing: both are live.
                    if live.len() % 2 == 0 {
                        assert_eq!(w.complete(&c, &done(&format!("r{n}"), 0)).unwrap(), Settled::Done);
                    }
                    live.push(n);
                }
                Begin::Full { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(live.len(), CAPACITY as usize, "filled to {} in {tried} attempts", live.len());
        for k in 0..1_000u64 {
            let r = w.begin(&attempt(rng.next(), 1, 1_000_000 + k, 1)).unwrap();
            assert!(matches!(r, Begin::Full { retry_after_ms } if retry_after_ms >= 1), "{k}: {r:?}");
        }
        for (i, n) in live.iter().enumerate() {
            let r = w.begin(&attempt(*n, 1, 2_000_000 + i as u64, 2)).unwrap();
            if i % 2 == 0 {
                assert_eq!(r, Begin::Replay(snapshot(&format!("r{n}"))), "{i}");
            } else {
                assert!(matches!(r, Begin::InFlight { .. }), "{i}: {r:?}");
            }
        }
    }

    #[test]
    fn key_space_is_fixed_whatever_keys_clients_send() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        let keys_after_setup = b.data.key_count();
        // 1.5 positions per record: 12 buckets, 96 slots, 12 quota keys, one fill shard, sweep
        // cursor, ready marker; secret and registry.
        assert_eq!(keys_after_setup, 12 + 12 * 8 + 12 + 1 + 2 + 2);
        let mut now = 0;
        for n in 0..5_000u64 {
            now += 7;
            let a = ClaimAttempt {
                ttl_ms: 50,
                ..charged(n, n + 1, now, (n % 251) as u8, Some((n % 7) as u8), (3, 2))
            };
            match w.begin(&a).unwrap() {
                Begin::Claimed(c) => {
                    w.complete(&c, &Completion { ttl_ms: 50, ..done("x", now) }).unwrap();
                }
                Begin::Full { .. } | Begin::QuotaExceeded { .. } => {}
                other => panic!("{other:?}"),
            }
            w.sweep(now).unwrap();
        }
        assert_eq!(b.data.key_count(), keys_after_setup, "Envoy never frees a data_key: none may be added");
    }

    #[test]
    fn setup_keeps_records_that_survived_a_reload() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
        w.complete(&c, &done("kept", 1)).unwrap();
        // A reloaded VM (FAIL_RELOAD, config update) configures again against the same data,
        // with a fresh secret of its own: the installed one stays, so placement does too.
        let reloaded = LocalStore::open(&b.data, 64, [0xee; 32], 2).unwrap();
        assert_eq!(reloaded.keys_created(), 0);
        assert_eq!(reloaded.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::Replay(snapshot("kept")));
    }

    #[test]
    fn claims_fail_closed_when_the_layout_was_never_created() {
        let data = FakeSharedData::new();
        let store = LocalStore::unopened(&data, 64);
        assert!(matches!(store.begin(&attempt(1, 1, 1, 0)), Err(StoreError::Unavailable(_))));
        assert_eq!(data.key_count(), 0, "a claim must never create a data_key: creation ignores CAS");
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
        let store = open(&b.data, 8, 3);
        let data_key = store.bucket_key(0);
        b.data.poke(&data_key, b"\x09garbage");
        assert!(matches!(store.begin(&attempt(1, 1, 1, 0)), Err(StoreError::Corrupt(_))));
        assert_eq!(b.data.get(&data_key).unwrap().bytes(), b"\x09garbage");
    }

    #[test]
    fn a_completion_survives_a_bucket_that_loses_every_write() {
        // Item 3: today's store gave up after 16 lost bucket CASes (Contention) and the answer
        // was lost. The slot is the commit point now; the bucket only catches up.
        let b = Local::with_capacity(64);
        let (w0, w1) = (b.worker(0), b.worker(1));
        let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
        b.data.force_cas_mismatches_on(":b:", 1000);
        assert_eq!(w0.complete(&c, &done("kept", 10)).unwrap(), Settled::Done);
        // Readers see the outcome even while the bucket still says processing, and even after
        // the lease: never in flight, never taken over.
        assert_eq!(w1.begin(&attempt(1, 1, 12, 20)).unwrap(), Begin::Replay(snapshot("kept")));
        assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE * 2)).unwrap(), Begin::Replay(snapshot("kept")));
        assert_eq!(w0.release(&c).unwrap(), Settled::Lost, "an outcome is final");
        b.data.force_cas_mismatches(0);
        assert_eq!(w1.begin(&attempt(1, 1, 14, LEASE * 3)).unwrap(), Begin::Replay(snapshot("kept")));
        assert_eq!(w0.complete(&c, &done("again", LEASE * 3)).unwrap(), Settled::Lost);
    }

    #[test]
    fn a_cut_response_is_never_executed_again_even_when_the_bucket_is_busy() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
        b.data.force_cas_mismatches_on(":b:", 1000);
        let cut = Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 5, ttl_ms: TTL };
        assert_eq!(w.complete(&c, &cut).unwrap(), Settled::Done);
        assert_eq!(w.begin(&attempt(1, 1, 12, LEASE + 1)).unwrap(), Begin::NotStored { status: 201 });
    }

    #[test]
    fn an_outcome_whose_promotion_was_lost_is_never_evicted() {
        let b = Local::with_capacity(8);
        let w = b.worker(0);
        let mut claims = Vec::new();
        for n in 1..=8 {
            claims.push(claimed(w.begin(&attempt(n, 1, n, 0)).unwrap()));
        }
        b.data.force_cas_mismatches_on(":b:", 1000);
        assert_eq!(w.complete(&claims[0], &done("one", 1)).unwrap(), Settled::Done);
        b.data.force_cas_mismatches(0);
        assert_eq!(only_bucket(&b.data).iter().filter(|e| e.is_completed()).count(), 0, "promotion lost");
        // Past every lease: seven abandoned claims give their place, the completed one does not.
        for k in 0..7 {
            assert!(matches!(w.begin(&attempt(100 + k, 1, 100 + k, LEASE)).unwrap(), Begin::Claimed(_)));
        }
        assert!(matches!(w.begin(&attempt(200, 1, 200, LEASE)).unwrap(), Begin::Full { .. }));
        assert_eq!(w.begin(&attempt(1, 1, 201, LEASE)).unwrap(), Begin::Replay(snapshot("one")));
    }

    #[test]
    fn an_unclaimed_slot_write_is_refused_after_a_takeover() {
        // Worker 0 owns the record and is completing; exactly between its slot read and its
        // slot write, its lease expires, worker 1 takes over AND completes. Worker 0's write
        // must fail (CAS) and its completion report Lost; worker 1's snapshot survives.
        let data = FakeSharedData::new();
        let w1 = open(&data, 8, 1);
        let old = claimed(open(&data, 8, 2).begin(&attempt(1, 1, 11, 0)).unwrap());
        let racing = Interleave::new(&data, ":s:", 2, || {
            let new = claimed(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap());
            assert_eq!(w1.complete(&new, &done("new", LEASE + 1)).unwrap(), Settled::Done);
        });
        let w0 = open(&racing, 8, 3);
        // 1st slot op: the read; the other worker runs before the 2nd (the write).
        let result = w0.complete(&old, &done("old", LEASE + 2)).unwrap();
        assert_eq!(result, Settled::Lost);
        assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE + 3)).unwrap(), Begin::Replay(snapshot("new")));
    }

    #[test]
    fn a_takeover_between_ownership_check_and_commit_wins() {
        // The takeover's fence (a slot write after its bucket write) fails the old owner's
        // commit, which then sees the record is no longer its own.
        let data = FakeSharedData::new();
        let w1 = open(&data, 8, 1);
        let old = claimed(open(&data, 8, 2).begin(&attempt(1, 1, 11, 0)).unwrap());
        let racing = Interleave::new(&data, ":s:", 2, || {
            claimed(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap());
        });
        let w0 = open(&racing, 8, 3);
        assert_eq!(w0.complete(&old, &done("old", LEASE + 2)).unwrap(), Settled::Lost);
        assert_eq!(
            w1.begin(&attempt(1, 1, 13, LEASE + 3)).unwrap(),
            Begin::InFlight { retry_after_ms: LEASE - 3 }
        );
    }

    #[test]
    fn a_takeover_after_the_commit_replays_instead() {
        // The old owner committed; before it promotes the bucket entry, a retry arrives after
        // the lease. It must see the outcome in the slot: a replay, not a second execution.
        let data = FakeSharedData::new();
        let w1 = open(&data, 8, 1);
        let old = claimed(open(&data, 8, 2).begin(&attempt(1, 1, 11, 0)).unwrap());
        let seen = std::cell::RefCell::new(None);
        // Bucket ops of complete: the ownership read, then the promotion read.
        let racing = Interleave::new(&data, ":b:", 2, || {
            *seen.borrow_mut() = Some(w1.begin(&attempt(1, 1, 12, LEASE + 1)).unwrap());
        });
        let w0 = open(&racing, 8, 3);
        assert_eq!(w0.complete(&old, &done("old", LEASE)).unwrap(), Settled::Done);
        assert_eq!(seen.borrow_mut().take(), Some(Begin::Replay(snapshot("old"))));
    }

    #[test]
    fn an_outcome_committed_before_the_takeover_fence_wins() {
        // The old owner checked ownership before the takeover's bucket write and committed
        // right after it, before the fence: the fence fails, the taker puts the completed
        // record back and answers with its replay.
        let data = FakeSharedData::new();
        let w0 = open(&data, 8, 1);
        claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
        let entry = only_bucket(&data)[0];
        let slot_key = w0.slot_key(0, entry.position);
        let outcome = SlotValue {
            entry: Entry { state: State::Succeeded, status: 201, expires_at_ms: LEASE + TTL, ..entry },
            snapshot: Some(snapshot("old")),
        };
        // Slot ops of a takeover: the read (resolve), the slot pre-read... then the fence.
        let racing = Interleave::new(&data, ":s:", 2, || {
            let r = data.get(&slot_key).unwrap();
            data.set(&slot_key, &record::encode_slot(&outcome), r.cas).unwrap();
        });
        let w1 = open(&racing, 8, 2);
        assert_eq!(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap(), Begin::Replay(snapshot("old")));
        let restored = only_bucket(&data)[0];
        assert_eq!((restored.owner, restored.state), (11, State::Succeeded));
    }

    #[test]
    fn a_key_claimed_in_both_of_its_buckets_at_once_is_claimed_once() {
        // Worker 0 sees the primary busier and places the new key in its secondary; before its
        // write, the primary empties and worker 1 places the same key there. Without the
        // confirmation both would own the key and the request would execute twice.
        let data = FakeSharedData::new();
        let w1 = open(&data, 64, 1);
        let n = (0..1_000).find(|n| {
            let (p, s) = w1.buckets_of(&crate::store::conformance::scope(*n));
            p != s
        });
        let n = n.unwrap();
        let (primary, secondary) = w1.buckets_of(&crate::store::conformance::scope(n));
        let other = Entry {
            position: 0,
            state: State::Processing,
            flags: 0,
            status: 0,
            scope: crate::store::conformance::scope(u64::MAX),
            fingerprint: crate::identity::fingerprint::Fingerprint([9; 32]),
            owner: 77,
            lease_deadline_ms: LEASE,
            expires_at_ms: TTL,
            charged_at_ms: 0,
            tenant_tag: 0,
            principal_tag: 0,
        };
        let primary_key = w1.bucket_key(primary);
        data.poke(&primary_key, &record::encode_bucket(&[other]));
        let seen = std::cell::RefCell::new(None);
        // Bucket ops of worker 0's claim: primary read, secondary read, then its write.
        let racing = Interleave::new(&data, ":b:", 3, || {
            data.poke(&primary_key, &[]);
            *seen.borrow_mut() = Some(w1.begin(&attempt(n, 1, 12, 0)).unwrap());
        });
        let w0 = open(&racing, 64, 2);
        let first = w0.begin(&attempt(n, 1, 11, 0)).unwrap();
        let second = seen.borrow_mut().take().unwrap();
        let claims = [&first, &second].iter().filter(|b| matches!(b, Begin::Claimed(_))).count();
        assert_eq!(claims, 1, "{first:?} {second:?}");
        assert!(matches!(first, Begin::InFlight { .. }), "{first:?}");
        // The withdrawn entry is gone and the fill count holds the one record.
        let left = record::decode_bucket(data.get(&w1.bucket_key(secondary)).unwrap().bytes(), 8).unwrap();
        assert!(left.iter().all(|e| e.scope != crate::store::conformance::scope(n)));
        assert_eq!(record::decode_fill(data.get(&w1.fill_key(0)).unwrap().bytes()), Ok(1));
    }

    #[test]
    fn a_fill_count_that_lost_its_discharges_is_recounted_by_the_sweep() {
        // Crashes between bucket writes and discharges left the count at the bound while the
        // buckets hold one record: new keys are refused until the sweep recounts the shard.
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
        let fill = w_fill_key(&b);
        b.data.poke(&fill, &record::encode_fill(64));
        assert!(matches!(w.begin(&attempt(2, 1, 12, 1)).unwrap(), Begin::Full { .. }));
        w.sweep(2).unwrap();
        assert_eq!(record::decode_fill(b.data.get(&fill).unwrap().bytes()), Ok(1));
        claimed(w.begin(&attempt(2, 1, 13, 3)).unwrap());
    }

    fn w_fill_key(b: &Local) -> String {
        fill_key_in(&prefix_of(b.capacity), 0)
    }

    #[test]
    fn placement_is_keyed_by_the_shared_secret() {
        let (d1, d2) = (FakeSharedData::new(), FakeSharedData::new());
        let (a, b) = (open(&d1, 8 * 64, 1), open(&d2, 8 * 64, 2));
        let differ = (0..64)
            .filter(|n| {
                a.bucket_of(&crate::store::conformance::scope(*n))
                    != b.bucket_of(&crate::store::conformance::scope(*n))
            })
            .count();
        assert!(differ > 32, "placement must depend on the secret ({differ} of 64 differ)");
        let public = (0..64)
            .filter(|n| {
                let s = crate::store::conformance::scope(*n);
                u64::from(a.bucket_of(&s)) == s.placement() % 64
            })
            .count();
        assert!(public < 16, "placement must not be the public function of the scope ({public})");
        // Every worker shares the first secret installed, whatever fresh secret it brought.
        let c = open(&d1, 8 * 64, 9);
        assert_eq!(c.secret, a.secret);
        assert_eq!(a.secret, [1; 32]);
    }

    #[test]
    fn a_secret_installed_by_a_racing_worker_is_the_one_used() {
        let data = FakeSharedData::new();
        let first = LocalStore::unopened(&data, 8);
        first.create_keys().unwrap();
        // Another worker installs its secret between our read and our CAS.
        let racing = Interleave::new(&data, "secret", 2, || {
            let r = data.get(SECRET_KEY).unwrap();
            data.set(SECRET_KEY, &[5; 32], r.cas).unwrap();
        });
        let late = LocalStore::open(&racing, 8, [6; 32], 0).unwrap();
        assert_eq!(late.secret, [5; 32]);
    }

    #[test]
    fn eviction_empties_the_snapshot_slots_it_frees() {
        let b = Local::with_capacity(8);
        let w = b.worker(0);
        let big = Snapshot { status: 201, headers: vec![], body: vec![b'x'; 10_000] };
        for n in 1..=8 {
            let c = claimed(w.begin(&attempt(n, 1, n, 0)).unwrap());
            let completion = Completion { snapshot: Some(big.clone()), ..done("x", 0) };
            w.complete(&c, &completion).unwrap();
        }
        assert!(b.data.value_bytes() > 80_000);
        // Expired records are not dropped by a completion any more, only where room is needed.
        for n in 100..108 {
            assert!(matches!(w.begin(&attempt(n, 1, n, TTL)).unwrap(), Begin::Claimed(_)));
        }
        assert!(b.data.value_bytes() < 2_000, "{}", b.data.value_bytes());
    }

    #[test]
    fn sweep_frees_the_snapshot_memory_of_expired_records() {
        let b = Local::with_capacity(8);
        let w = b.worker(0);
        let c = claimed(w.begin(&attempt(1, 1, 1, 0)).unwrap());
        w.complete(&c, &done("big", 0)).unwrap();
        let before = b.data.value_bytes();
        let swept = w.sweep(TTL).unwrap();
        assert_eq!(swept, 1);
        // What stays: the cursor, the ready marker, the secret and the layout registry.
        let after = b.data.value_bytes();
        assert!(after <= 4 + 1 + 32 + 2 + 16, "{before} -> {after}");
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
            swept += w0.sweep(TTL).unwrap();
            swept += w1.sweep(TTL).unwrap();
        }
        assert_eq!(swept, 100, "200 buckets, 64 per call, 8 calls cover all exactly once or more");
    }

    #[test]
    fn a_lost_discharge_heals_when_its_records_cannot_be_live() {
        let b = Local::with_capacity(8);
        let w = b.worker(0);
        claimed(w.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
        // A crash between the bucket write and the discharge: the record is gone, the count
        // stays.
        b.data.poke("idem:v3:8:b:0", &[]);
        assert!(matches!(
            w.begin(&charged(2, 12, 1, 1, None, (10, 1))).unwrap(),
            Begin::QuotaExceeded { .. }
        ));
        assert!(matches!(
            w.begin(&charged(2, 13, TTL + LEASE - 1, 1, None, (10, 1))).unwrap(),
            Begin::QuotaExceeded { .. }
        ));
        claimed(w.begin(&charged(2, 14, TTL + LEASE, 1, None, (10, 1))).unwrap());
    }

    #[test]
    fn a_stale_discharge_does_not_eat_into_a_new_epoch() {
        let b = Local::with_capacity(64);
        let w = b.worker(0);
        // Charged at 0, abandoned, never swept: the counter heals at TTL + LEASE.
        claimed(w.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
        let t = TTL + LEASE;
        claimed(w.begin(&charged(2, 12, t, 1, None, (10, 1))).unwrap());
        // Now the old record is swept: its discharge belongs to the old epoch and is ignored.
        for _ in 0..8 {
            w.sweep(t).unwrap();
        }
        assert!(matches!(
            w.begin(&charged(3, 13, t + 1, 1, None, (10, 1))).unwrap(),
            Begin::QuotaExceeded { .. }
        ));
    }

    #[test]
    fn a_quota_key_without_room_answers_full() {
        let b = Local::with_capacity(8);
        let w = b.worker(0);
        let foreign: Vec<Counter> = (0..u64::from(COUNTERS_PER_QUOTA_KEY))
            .map(|tag| Counter {
                tag: tag + 1_000,
                count: 1,
                since_ms: 0,
                soonest_ms: TTL,
                until_ms: TTL + LEASE,
            })
            .collect();
        b.data.poke("idem:v3:8:q:0", &record::encode_counters(&foreign));
        let r = w.begin(&charged(1, 11, 0, 1, None, (10, 10))).unwrap();
        assert_eq!(r, Begin::Full { retry_after_ms: TTL + LEASE });
        // Unquoted attempts are not affected, and counters that read as 0 give their room.
        assert!(matches!(w.begin(&attempt(1, 1, 12, 1)).unwrap(), Begin::Claimed(_)));
        claimed(w.begin(&charged(2, 13, TTL + LEASE, 1, None, (10, 10))).unwrap());
    }

    #[test]
    fn a_namespace_of_the_previous_placement_is_retired_too() {
        // A v2 store (one bucket per key, `idem:v2:<buckets>:`) left records behind before the
        // upgrade; its roots are gone. The v3 sweeps empty it and drop it from the registry.
        let data = FakeSharedData::new();
        let old = "idem:v2:2:";
        let mut keys = Vec::new();
        for b in 0..2 {
            keys.push(format!("{old}b:{b}"));
            keys.push(format!("{old}q:{b}"));
            for p in 0..ENTRIES_PER_BUCKET {
                keys.push(format!("{old}s:{b}:{p}"));
            }
        }
        keys.push(format!("{old}sweep"));
        keys.push(format!("{old}ready"));
        for k in &keys {
            data.poke(k, b"old bytes");
        }
        data.poke(LAYOUTS_KEY, &record::encode_layouts(&[Layout { buckets: 2, beat_ms: 0, cursor: 0 }]));
        let store = LocalStore::open(&data, 64, [1; 32], 0).unwrap();
        let mut now = 0;
        for _ in 0..(RETIRE_AFTER_MS / 1_000 + 4) {
            now += 1_000;
            store.sweep(now).unwrap();
        }
        for k in &keys {
            assert_eq!(data.get(k).unwrap().value, None, "{k}");
        }
        let layouts = record::decode_layouts(data.get(LAYOUTS_KEY).unwrap().bytes()).unwrap();
        assert_eq!(layouts.iter().map(|l| l.buckets).collect::<Vec<_>>(), vec![store.layout_id()]);
    }

    #[test]
    fn a_retired_namespace_is_emptied_while_a_live_one_is_left_alone() {
        let data = FakeSharedData::new();
        let a = LocalStore::open(&data, 64, [1; 32], 0).unwrap();
        for n in 0..40 {
            let long = ClaimAttempt { ttl_ms: 1 << 40, ..charged(n, n + 1, 0, 1, Some(2), (100, 100)) };
            if let Begin::Claimed(c) = a.begin(&long).unwrap() {
                a.complete(&c, &Completion { ttl_ms: 1 << 40, ..done("a", 0) }).unwrap();
            }
        }
        let a_bytes = data.value_bytes();
        // A new config with another capacity; the old roots still run for a while.
        let b = LocalStore::open(&data, 8 * 100, [2; 32], 1_000).unwrap();
        let mut now = 1_000;
        for _ in 0..60 {
            now += 1_000;
            a.sweep(now).unwrap();
            b.sweep(now).unwrap();
        }
        assert!(data.value_bytes() >= a_bytes, "a beating namespace is never touched");
        assert_eq!(a.begin(&attempt(0, 1, 99, now)).unwrap(), Begin::Replay(snapshot("a")));
        // The old roots are gone: after RETIRE_AFTER_MS, B's sweeps empty A progressively.
        let keys = data.key_count();
        for _ in 0..(RETIRE_AFTER_MS / 1_000 + 8) {
            now += 1_000;
            b.sweep(now).unwrap();
        }
        let prefix = prefix_of(64);
        assert_eq!(data.get(&fill_key_in(&prefix, 0)).unwrap().value, None);
        for bucket in 0..a.buckets() {
            assert_eq!(data.get(&bucket_key_in(&prefix, bucket)).unwrap().value, None);
            assert_eq!(data.get(&quota_key_in(&prefix, bucket)).unwrap().value, None);
            for p in 0..ENTRIES_PER_BUCKET {
                assert_eq!(data.get(&slot_key_in(&prefix, bucket, p)).unwrap().value, None);
            }
        }
        assert_eq!(data.key_count(), keys, "retiring empties values and creates nothing");
        let layouts = record::decode_layouts(data.get(LAYOUTS_KEY).unwrap().bytes()).unwrap();
        assert_eq!(layouts.iter().map(|l| l.buckets).collect::<Vec<_>>(), vec![b.layout_id()]);
        assert!(data.value_bytes() < 200, "{} bytes left", data.value_bytes());
    }
}
