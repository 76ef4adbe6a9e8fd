//! Housekeeping, run by the root's tick through `Store::sweep`: one fill shard's buckets
//! per call (expired records dropped, abandoned claims discharged, the fill count recounted) and
//! the retirement of namespaces left behind by a capacity change. Apart because it is the only
//! code that walks many buckets, and none of it answers a request.

use super::format::{self, Layout};
use super::layout::{
    bucket_key_in, fill_key_in, namespace_of, quota_key_in, slot_key_in, Namespace, FILL_SHARD_BUCKETS,
    LAYOUTS_KEY,
};
use super::quota::CHARGE_FLAGS;
use super::{host, tombstones, LocalStore, ENTRIES_PER_BUCKET};
use crate::store::record::Entry;
use crate::store::shared_data::{SharedData, SharedDataError};
use crate::store::StoreError;

/// Buckets of a retired namespace emptied per sweep call (each bucket has 10 keys).
const RETIRE_BATCH: u32 = 16;

/// A namespace whose heartbeat is older than this is retired. Every live root sweeps (and so
/// beats) about once a second; after a config update the old roots are gone within seconds.
pub const RETIRE_AFTER_MS: u64 = 30_000;

impl<S: SharedData> LocalStore<S> {
    /// `Store::sweep` (mod.rs): the next fill shard by the shared cursor, and housekeeping.
    pub(super) fn sweep_shard(&self, now_ms: u64) -> Result<u32, StoreError> {
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

    /// Sets the shard's fill count to the entries its buckets hold, as a CAS against a read
    /// taken before them: a charge or discharge that lands meanwhile fails the write (the next
    /// pass tries again). A claim that was charged before that read and writes its bucket after
    /// the bucket was read goes uncounted until the next pass: the bound may be passed by the
    /// claims in flight at that instant.
    fn recount(&self, shard: u32) -> Result<(), StoreError> {
        let data_key = self.fill_key(shard);
        let read = self.data.get(&data_key).map_err(host)?;
        let counted =
            format::decode_fill(read.bytes()).map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
        let mut held: u32 = 0;
        for bucket in self.shard_buckets(shard) {
            let (entries, _) = self.read_bucket(bucket)?;
            held = held.saturating_add(u32::try_from(entries.len()).unwrap_or(u32::MAX));
        }
        if held != counted {
            log::debug!("fill count of shard {shard} corrected from {counted} to {held}");
            self.cas(&data_key, &format::encode_fill(held), &read)?;
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

    pub(super) fn sweep_bucket(&self, bucket: u32, now_ms: u64) -> Result<u32, StoreError> {
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
        let stale = |layouts: &[Layout], own: u32| {
            layouts
                .iter()
                .find(|l| l.buckets != own && now_ms >= l.beat_ms.saturating_add(RETIRE_AFTER_MS))
                .copied()
        };
        if let Some(old) = stale(&layouts, self.layout_id()) {
            return self.retire_step(old, LAYOUTS_KEY);
        }
        // The tombstone rooms have a registry of their own, which builds before them never
        // read: to them its ids would be record namespaces of another size.
        if let Some(room) = self.tombstone_layout() {
            let rooms = self.beat_in(tombstones::LAYOUTS_KEY, room, now_ms)?;
            if let Some(old) = stale(&rooms, room) {
                return self.retire_step(old, tombstones::LAYOUTS_KEY);
            }
        }
        Ok(())
    }

    fn retire_step(&self, old: Layout, registry: &str) -> Result<(), StoreError> {
        let tombstones = registry == tombstones::LAYOUTS_KEY;
        let ns = if tombstones {
            Namespace {
                prefix: tombstones::prefix_of(old.buckets),
                buckets: tombstones::buckets_for(old.buckets),
                fill: false,
            }
        } else {
            namespace_of(old.buckets)
        };
        let start = old.cursor.min(ns.buckets);
        let end = start.saturating_add(RETIRE_BATCH).min(ns.buckets);
        let finished = end >= ns.buckets;
        // Take the batch by CAS on the registry, as the sweep cursor does: roots share the work,
        // and a namespace that beat again in the meantime is left alone.
        let read = self.data.get(registry).map_err(host)?;
        let mut layouts = format::decode_layouts(read.bytes())
            .map_err(|e| StoreError::Corrupt(format!("{registry}: {e}")))?;
        let Some(i) = layouts.iter().position(|l| *l == old) else { return Ok(()) };
        if finished {
            layouts.remove(i);
        } else {
            layouts[i].cursor = end;
        }
        if !self.cas(registry, &format::encode_layouts(&layouts), &read)? {
            return Ok(());
        }
        if tombstones {
            return self.retire_tombstones(&ns.prefix, start, end, finished);
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
            self.empty(&format!("{prefix}ready:records"))?;
        }
        Ok(())
    }

    /// Empties a key's value if it holds one; never creates a key.
    pub(super) fn empty(&self, data_key: &str) -> Result<(), StoreError> {
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
