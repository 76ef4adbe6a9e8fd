//! The key space of one namespace and the keys all namespaces share: which data keys exist
//! (`b:`, `s:`, `q:`, `f:`, `sweep`, `ready`), created once by `open` because Envoy ignores CAS
//! on a missing key; the namespace registry (`idem:layouts`) a root beats so that a namespace no
//! longer used can be retired; the placement secret that keys placement and quota tags. Also
//! the checked reads and CAS writes every other file goes through, so that none of them can
//! create a key by accident.

use super::format::{self, Layout, LAYOUT_V3};
use super::{host, LocalStore, CAS_ATTEMPTS, ENTRIES_PER_BUCKET};
use crate::store::record::Entry;
use crate::store::shared_data::{Read, SharedData, SharedDataError};
use crate::store::{Claim, StoreError};
use sha2::{Digest, Sha256};

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
pub(super) const FILL_SHARD_BUCKETS: u32 = 64;

/// `key` made `prefix` then `rest`, reusing its allocation (a large store's start names millions).
fn fill(key: &mut String, prefix: &str, rest: std::fmt::Arguments) {
    use std::fmt::Write;
    key.clear();
    key.push_str(prefix);
    let _ = key.write_fmt(rest);
}

pub(super) fn prefix_of(capacity: u32) -> String {
    format!("{NAMESPACE}{capacity}:")
}

/// Buckets for `capacity` records: 1.5 positions per record, in buckets of ENTRIES_PER_BUCKET. A
/// store that fits in one bucket stays one bucket: every key shares it, there is no placement
/// to balance, and its positions are the bound.
pub(super) fn buckets_for(capacity: u32) -> u32 {
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

pub(super) fn fill_key_in(prefix: &str, shard: u32) -> KeyName {
    key_in(prefix, "f:", shard, None)
}

/// A shared-data key's name, `<prefix><kind><number>[:<position>]` as `format!` spelled it: a
/// claim and its completion name about fifteen keys, and format's machinery and an allocation
/// each cost a new key more Wasm instructions than the names themselves (`make bench-fuel`).
/// Built on the stack: every name the layout makes fits (a prefix is `idem:...:<number>:`).
pub(super) struct KeyName {
    bytes: [u8; KEY_NAME_MAX],
    len: usize,
    /// A name that did not fit, should a prefix ever be that long.
    spilled: Option<String>,
}

const KEY_NAME_MAX: usize = 64;

impl KeyName {
    fn push(&mut self, part: &[u8]) {
        if let Some(spilled) = &mut self.spilled {
            spilled.push_str(&String::from_utf8_lossy(part));
            return;
        }
        match self.bytes.get_mut(self.len..self.len + part.len()) {
            Some(room) => {
                room.copy_from_slice(part);
                self.len += part.len();
            }
            None => {
                let mut spilled = self.as_str().to_string();
                spilled.push_str(&String::from_utf8_lossy(part));
                self.spilled = Some(spilled);
            }
        }
    }

    fn push_decimal(&mut self, n: u32) {
        let mut digits = [0u8; 10];
        let mut at = digits.len();
        let mut rest = n;
        loop {
            at -= 1;
            // The remainder is below 10, so the digit is ASCII.
            digits[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        self.push(digits.get(at..).unwrap_or_default());
    }

    pub(super) fn as_str(&self) -> &str {
        match &self.spilled {
            Some(name) => name,
            // Whole `str`s and ASCII digits only: always UTF-8.
            None => std::str::from_utf8(self.bytes.get(..self.len).unwrap_or_default()).unwrap_or_default(),
        }
    }
}

impl std::ops::Deref for KeyName {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for KeyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for KeyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq<String> for KeyName {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

pub(super) fn key_in(prefix: &str, kind: &str, number: u32, position: Option<u8>) -> KeyName {
    let mut key = KeyName { bytes: [0; KEY_NAME_MAX], len: 0, spilled: None };
    key.push(prefix.as_bytes());
    key.push(kind.as_bytes());
    key.push_decimal(number);
    if let Some(position) = position {
        key.push(b":");
        key.push_decimal(u32::from(position));
    }
    key
}

/// A retired or live namespace, from its registry id.
pub(super) struct Namespace {
    pub(super) prefix: String,
    pub(super) buckets: u32,
    /// v3 namespaces have fill keys; v2 ones do not.
    pub(super) fill: bool,
}

pub(super) fn namespace_of(id: u32) -> Namespace {
    if id & LAYOUT_V3 != 0 {
        let capacity = id & !LAYOUT_V3;
        Namespace { prefix: prefix_of(capacity), buckets: buckets_for(capacity), fill: true }
    } else {
        Namespace { prefix: format!("{NAMESPACE_V2}{id}:"), buckets: id, fill: false }
    }
}

pub(super) fn bucket_key_in(prefix: &str, bucket: u32) -> KeyName {
    key_in(prefix, "b:", bucket, None)
}

pub(super) fn slot_key_in(prefix: &str, bucket: u32, position: u8) -> KeyName {
    key_in(prefix, "s:", bucket, Some(position))
}

pub(super) fn quota_key_in(prefix: &str, index: u32) -> KeyName {
    key_in(prefix, "q:", index, None)
}

impl<S: SharedData> LocalStore<S> {
    /// This namespace's id in the layout registry.
    pub(super) fn layout_id(&self) -> u32 {
        LAYOUT_V3 | self.records
    }

    pub(super) fn shards(&self) -> u32 {
        shards_for(self.buckets)
    }

    pub(super) fn shard_of(&self, bucket: u32) -> u32 {
        bucket / FILL_SHARD_BUCKETS
    }

    pub(super) fn fill_key(&self, shard: u32) -> KeyName {
        fill_key_in(&self.prefix, shard)
    }

    pub(super) fn bucket_key(&self, bucket: u32) -> KeyName {
        bucket_key_in(&self.prefix, bucket)
    }

    pub(super) fn slot_key(&self, bucket: u32, position: u8) -> KeyName {
        slot_key_in(&self.prefix, bucket, position)
    }

    pub(super) fn cursor_key(&self) -> String {
        format!("{}sweep", self.prefix)
    }

    fn ready_key(&self) -> String {
        format!("{}ready", self.prefix)
    }

    /// Set instead of `ready` once every key but the quota keys exists.
    fn records_ready_key(&self) -> String {
        format!("{}ready:records", self.prefix)
    }

    /// Creates the namespace's keys that a configuration counting quotas or not (`quota`)
    /// needs, unless they exist: every key but the quota keys, then `ready:records`; and with
    /// quotas the quota keys too, then `ready`.
    pub(crate) fn create_keys(&self, quota: bool) -> Result<u32, StoreError> {
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
        let mut key = String::with_capacity(self.prefix.len() + 24);
        if self.data.get(&self.records_ready_key()).map_err(host)?.exists() {
            if !quota {
                return Ok(created);
            }
            // A namespace made without quotas, now used with them: its quota keys, each created
            // only if missing (it is in use), then `ready`.
            for b in 0..self.buckets {
                fill(&mut key, &self.prefix, format_args!("q:{b}"));
                ensure(&key)?;
            }
            self.data.set(&self.ready_key(), b"1", None).map_err(host)?;
            return Ok(created);
        }
        // Neither: no root ever served this namespace (a root serves only once one is set, and
        // retirement empties values, never a `ready`'s key), so none of its keys holds anything
        // but the empty value a creation writes. Each is set empty without reading it first:
        // one host call a key instead of two, which is most of a large store's start (Envoy's
        // canary root on the main thread creates them before any worker configures).
        let mut create = |key: &str| -> Result<(), StoreError> {
            self.data.set(key, &[], None).map_err(host)?;
            created += 1;
            Ok(())
        };
        for b in 0..self.buckets {
            fill(&mut key, &self.prefix, format_args!("b:{b}"));
            create(&key)?;
            for p in 0..ENTRIES_PER_BUCKET {
                fill(&mut key, &self.prefix, format_args!("s:{b}:{p}"));
                create(&key)?;
            }
            if quota {
                fill(&mut key, &self.prefix, format_args!("q:{b}"));
                create(&key)?;
            }
        }
        for k in 0..self.shards() {
            create(&self.fill_key(k))?;
        }
        create(&self.cursor_key())?;
        let ready = if quota { self.ready_key() } else { self.records_ready_key() };
        self.data.set(&ready, b"1", None).map_err(host)?;
        Ok(created)
    }

    /// The first secret installed wins: install ours only while the key is still empty (a CAS
    /// on an existing key), then read back whichever is there.
    pub(super) fn load_secret(&self, fresh: [u8; 32]) -> Result<[u8; 32], StoreError> {
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
    pub(super) fn keyed(&self, domain: &[u8], data: &[u8]) -> u64 {
        let mut h = Sha256::new();
        h.update(domain);
        h.update(self.secret);
        h.update(data);
        let d = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        u64::from_be_bytes(b)
    }

    pub(super) fn quota_key(&self, tag: u64) -> KeyName {
        quota_key_in(&self.prefix, u32::try_from(tag % u64::from(self.buckets)).unwrap_or(0))
    }

    pub(super) fn locate(&self, claim: &Claim) -> Option<(u32, u8)> {
        let bucket = u32::try_from(claim.locator >> 8).ok()?;
        let position = u8::try_from(claim.locator & 0xff).ok()?;
        (bucket < self.buckets && position < ENTRIES_PER_BUCKET).then_some((bucket, position))
    }

    /// Reads a bucket that must exist; a missing key means the layout was never created.
    pub(super) fn read_bucket(&self, bucket: u32) -> Result<(Vec<Entry>, Read), StoreError> {
        let data_key = self.bucket_key(bucket);
        let read = self.data.get(&data_key).map_err(host)?;
        if !read.exists() {
            return Err(StoreError::Unavailable(format!("{data_key} was never created")));
        }
        let entries = format::decode_bucket(read.bytes(), ENTRIES_PER_BUCKET)
            .map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
        Ok((entries, read))
    }

    /// CAS-writes a bucket. Ok(false): another writer got there first; re-read and retry.
    pub(super) fn write_bucket(
        &self,
        bucket: u32,
        entries: &[Entry],
        read: &Read,
    ) -> Result<bool, StoreError> {
        self.cas(&self.bucket_key(bucket), &format::encode_bucket(entries), read)
    }

    pub(super) fn cas(&self, data_key: &str, bytes: &[u8], read: &Read) -> Result<bool, StoreError> {
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

    pub(super) fn shard_buckets(&self, shard: u32) -> std::ops::Range<u32> {
        let start = shard.saturating_mul(FILL_SHARD_BUCKETS).min(self.buckets);
        start..start.saturating_add(FILL_SHARD_BUCKETS).min(self.buckets)
    }

    pub(super) fn beat(&self, now_ms: u64) -> Result<Vec<Layout>, StoreError> {
        self.beat_in(LAYOUTS_KEY, self.layout_id(), now_ms)
    }

    /// Beats namespace `id` in the registry at `registry` (the records' `idem:layouts`, or the
    /// tombstones' own), and answers what the registry holds.
    pub(super) fn beat_in(&self, registry: &str, id: u32, now_ms: u64) -> Result<Vec<Layout>, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(registry).map_err(host)?;
            let mut layouts = format::decode_layouts(read.bytes())
                .map_err(|e| StoreError::Corrupt(format!("{registry}: {e}")))?;
            match layouts.iter_mut().find(|l| l.buckets == id) {
                Some(l) if l.beat_ms >= now_ms && l.cursor == 0 => return Ok(layouts),
                Some(l) => {
                    l.beat_ms = l.beat_ms.max(now_ms);
                    l.cursor = 0;
                }
                None => layouts.push(Layout { buckets: id, beat_ms: now_ms, cursor: 0 }),
            }
            if self.cas(registry, &format::encode_layouts(&layouts), &read)? {
                return Ok(layouts);
            }
        }
        Err(StoreError::Contention)
    }
}
