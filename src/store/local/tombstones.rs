//! The local store's tombstones (`store::tombstone`, `routes[].tombstone_ttl`): a room of their
//! own, never a live record's, so a store full of tombstones still takes every new key.
//!
//! Layout (namespace `idem:t1:<room>:`, registered by its room in `idem:t1:layouts`, a registry of
//! its own in the format of `idem:layouts`, and retired as a record namespace is once no root
//! beats it):
//! - `b:<i>`  tombstone bucket i: up to TOMBSTONES_PER_BUCKET tombstones (`encode_bucket`);
//! - `ready`  set once every bucket exists.
//!
//! A scope has one bucket, a keyed hash of it (the placement secret: clients cannot aim keys at
//! one bucket to push out someone else's tombstones faster than their volume alone does). A
//! tombstone replaces the scope's earlier one, else takes a free or ended place, else the place
//! of the oldest (completed first): the oldest tombstones go first. It is written after its
//! record's outcome is committed, and read by a begin that found no live record before it
//! claims: a record completes long before its ttl ends, so every begin that could claim after
//! it finds its tombstone. A tombstone is best effort: pushed out, it is a retry after the ttl
//! that executes again, as without tombstones.

use super::{host, LocalStore, CAS_ATTEMPTS};
use crate::identity::scope::ScopeId;
use crate::store::shared_data::{Read, SharedData};
use crate::store::tombstone::{Tombstone, TOMBSTONE_LEN};
use crate::store::{Begin, ClaimAttempt, StoreError};
use sha2::{Digest, Sha256};

/// Tombstones per bucket: a bucket (about 670 bytes) is copied by every begin of a rule that
/// keeps tombstones and finds no live record.
pub const TOMBSTONES_PER_BUCKET: usize = 8;

/// The registry of tombstone rooms, by room.
pub const LAYOUTS_KEY: &str = "idem:t1:layouts";

/// The format byte of a tombstone bucket.
const BUCKET_V1: u8 = 1;

const PLACEMENT_TAG: &[u8] = b"idem tombstone bucket";

pub(super) fn prefix_of(room: u32) -> String {
    format!("idem:t1:{room}:")
}

pub(super) fn buckets_for(room: u32) -> u32 {
    room.div_ceil(TOMBSTONES_PER_BUCKET as u32).max(1)
}

pub(super) fn bucket_key_in(prefix: &str, bucket: u32) -> super::layout::KeyName {
    super::layout::key_in(prefix, "b:", bucket, None)
}

/// The tombstone room of a store: where it is and how many buckets it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Room {
    pub(super) room: u32,
    pub(super) prefix: String,
    pub(super) buckets: u32,
}

impl Room {
    pub(super) fn new(room: u32) -> Room {
        Room { room, prefix: prefix_of(room), buckets: buckets_for(room) }
    }
}

pub(super) fn encode_bucket(stones: &[Tombstone]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + stones.len() * TOMBSTONE_LEN);
    out.push(BUCKET_V1);
    out.push(u8::try_from(stones.len()).unwrap_or(u8::MAX));
    for t in stones {
        t.encode_into(&mut out);
    }
    out
}

/// An empty value is an empty bucket (as `open` creates it).
pub(super) fn decode_bucket(bytes: &[u8]) -> Result<Vec<Tombstone>, String> {
    let Some((&version, rest)) = bytes.split_first() else { return Ok(Vec::new()) };
    if version != BUCKET_V1 {
        return Err(format!("unknown tombstone bucket format {version}"));
    }
    let Some((&n, rest)) = rest.split_first() else { return Err("truncated tombstone bucket".into()) };
    let n = usize::from(n);
    if n > TOMBSTONES_PER_BUCKET || rest.len() != n * TOMBSTONE_LEN {
        return Err(format!("tombstone bucket of {n} holds {} bytes", rest.len()));
    }
    rest.chunks_exact(TOMBSTONE_LEN).map(|c| Tombstone::decode(c).map_err(|e| format!("{e:?}"))).collect()
}

impl<S: SharedData> LocalStore<S> {
    /// Creates the room's keys that do not exist yet (keys that exist keep their tombstones).
    pub(super) fn create_tombstone_keys(&self, room: &Room) -> Result<u32, StoreError> {
        let mut created = 0;
        if !self.data.get(LAYOUTS_KEY).map_err(host)?.exists() {
            self.data.set(LAYOUTS_KEY, &[], None).map_err(host)?;
            created += 1;
        }
        let ready = format!("{}ready", room.prefix);
        if self.data.get(&ready).map_err(host)?.exists() {
            return Ok(created);
        }
        for b in 0..room.buckets {
            let data_key = bucket_key_in(&room.prefix, b);
            if !self.data.get(&data_key).map_err(host)?.exists() {
                // Created empty: a creation race writes the same empty value twice.
                self.data.set(&data_key, &[], None).map_err(host)?;
                created += 1;
            }
        }
        self.data.set(&ready, b"1", None).map_err(host)?;
        Ok(created + 1)
    }

    fn tombstone_bucket(&self, room: &Room, scope: &ScopeId) -> super::layout::KeyName {
        let mut h = Sha256::new();
        h.update(PLACEMENT_TAG);
        h.update(self.secret);
        h.update(scope.0);
        let d = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        let bucket = u32::try_from(u64::from_be_bytes(b) % u64::from(room.buckets)).unwrap_or(0);
        bucket_key_in(&room.prefix, bucket)
    }

    fn read_tombstones(&self, data_key: &str) -> Result<(Vec<Tombstone>, Read), StoreError> {
        let read = self.data.get(data_key).map_err(host)?;
        if !read.exists() {
            return Err(StoreError::Unavailable(format!("{data_key} was never created")));
        }
        let stones =
            decode_bucket(read.bytes()).map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
        Ok((stones, read))
    }

    /// The scope's tombstone standing at `now_ms`, if the store keeps tombstones and it has one.
    pub(super) fn tombstone(&self, scope: &ScopeId, now_ms: u64) -> Result<Option<Tombstone>, StoreError> {
        let Some(room) = &self.tombstones else { return Ok(None) };
        let (stones, _) = self.read_tombstones(&self.tombstone_bucket(room, scope))?;
        Ok(stones.into_iter().find(|t| t.scope == *scope && !t.is_expired(now_ms)))
    }

    /// What a begin answers instead of claiming: its scope's tombstone's answer, when its rule
    /// keeps tombstones and one stands.
    pub(super) fn buried_answer(&self, a: &ClaimAttempt) -> Result<Option<Begin>, StoreError> {
        if a.tombstone_ms == 0 {
            return Ok(None);
        }
        Ok(self.tombstone(&a.scope, a.now_ms)?.map(|t| t.answer(&a.fingerprint)))
    }

    /// The tombstone of `e`, completed at `now_ms` by a claim that keeps one (`Claim::
    /// tombstone_ms`), once its outcome is committed. Best effort: a tombstone that cannot be
    /// written is a retry after the ttl that executes again, as without tombstones; the outcome
    /// stands either way.
    pub(super) fn bury_completed(&self, e: &crate::store::record::Entry, now_ms: u64, tombstone_ms: u64) {
        if tombstone_ms == 0 {
            return;
        }
        if let Err(error) = self.bury(&Tombstone::of(e, now_ms, tombstone_ms)) {
            log::warn!("tombstone of {} not kept: {error}", e.scope.log_tag());
        }
    }

    /// Keeps `t` (its scope's earlier tombstone replaced; the oldest pushed out of a full bucket).
    pub(super) fn bury(&self, t: &Tombstone) -> Result<(), StoreError> {
        let now = t.completed_at_ms;
        self.change_tombstones(&t.scope, |stones| {
            stones.retain(|s| s.scope != t.scope && !s.is_expired(now));
            if stones.len() >= TOMBSTONES_PER_BUCKET {
                if let Some(i) = (0..stones.len()).min_by_key(|&i| stones[i].completed_at_ms) {
                    stones.swap_remove(i);
                }
            }
            stones.push(*t);
            true
        })
    }

    /// Drops the scope's tombstone (an operator's release: the next request executes).
    pub(super) fn unbury(&self, scope: &ScopeId) -> Result<(), StoreError> {
        self.change_tombstones(scope, |stones| {
            let before = stones.len();
            stones.retain(|s| s.scope != *scope);
            stones.len() != before
        })
    }

    /// Gives the scope's tombstone, if any, the status an operator resolved its record with.
    pub(super) fn rebury(&self, scope: &ScopeId, status: u16) -> Result<(), StoreError> {
        self.change_tombstones(scope, |stones| match stones.iter_mut().find(|s| s.scope == *scope) {
            Some(s) => {
                s.status = status;
                true
            }
            None => false,
        })
    }

    /// One CAS-guarded change of the scope's bucket (`change` says whether it changed it).
    fn change_tombstones(
        &self,
        scope: &ScopeId,
        change: impl Fn(&mut Vec<Tombstone>) -> bool,
    ) -> Result<(), StoreError> {
        let Some(room) = &self.tombstones else { return Ok(()) };
        let data_key = self.tombstone_bucket(room, scope);
        for _ in 0..CAS_ATTEMPTS {
            let (mut stones, read) = self.read_tombstones(&data_key)?;
            if !change(&mut stones) {
                return Ok(());
            }
            if self.cas(&data_key, &encode_bucket(&stones), &read)? {
                return Ok(());
            }
        }
        Err(StoreError::Contention)
    }

    /// The tombstone room's id in its registry (`LAYOUTS_KEY`), when the store keeps one.
    pub(super) fn tombstone_layout(&self) -> Option<u32> {
        self.tombstones.as_ref().map(|t| t.room)
    }

    /// Empties a retired tombstone namespace's keys from `start` to `end`, and its `ready` key
    /// once `finished`.
    pub(super) fn retire_tombstones(
        &self,
        prefix: &str,
        start: u32,
        end: u32,
        finished: bool,
    ) -> Result<(), StoreError> {
        for b in start..end {
            self.empty(&bucket_key_in(prefix, b))?;
        }
        if finished {
            self.empty(&format!("{prefix}ready"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::fingerprint::Fingerprint;

    fn stone(n: u8, completed: u64) -> Tombstone {
        Tombstone {
            scope: ScopeId([n; 32]),
            fingerprint: Fingerprint([n; 32]),
            status: 201,
            completed_at_ms: completed,
            until_ms: completed + 1_000,
        }
    }

    #[test]
    fn a_bucket_reads_back_and_refuses_what_it_cannot_be() {
        let stones: Vec<Tombstone> = (0..3).map(|n| stone(n, 10)).collect();
        let bytes = encode_bucket(&stones);
        assert_eq!(bytes.len(), 2 + 3 * TOMBSTONE_LEN);
        assert_eq!(decode_bucket(&bytes), Ok(stones));
        assert_eq!(decode_bucket(&[]), Ok(Vec::new()));
        assert!(decode_bucket(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_bucket(&[9, 0]).is_err());
        assert!(decode_bucket(&[BUCKET_V1, 9]).is_err());
    }

    #[test]
    fn a_room_has_a_bucket_per_eight_tombstones() {
        assert_eq!(buckets_for(1), 1);
        assert_eq!(buckets_for(17), 3);
    }
}
