//! Tombstones on etcd (`store::tombstone`): one small key per scope, `t/<scope hex>`, on a lease
//! of its own for the window of its end. It is written in the transaction that writes its
//! record's outcome (a completion, a begin that marks an unknown outcome), so that no record
//! completes without it; a rule that keeps tombstones guards its claim by "the record and its
//! tombstone are absent", and the failure branch reads all three keys (record, lease key,
//! tombstone) in the same round trip. An operator's release deletes it in the release's
//! transaction; a resolve reads it first and rewrites its status in the resolve's, guarded by
//! its revision.

use super::stage::Move;
use super::wire::{self, Guard};
use super::{unusable, EtcdConversation, EtcdStore};
use crate::identity::scope::ScopeId;
use crate::store::tombstone::Tombstone;
use crate::store::StoreError;

/// What a read found of a scope's tombstone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Buried {
    /// The read did not ask for it (a rule that keeps none).
    NotRead,
    Absent,
    /// There, at this revision (standing or not by the reader's clock: `Tombstone::is_expired`).
    Standing(Tombstone, i64),
    /// There, but its bytes are not a tombstone this build reads: treated as one that ended, so
    /// it never refuses a request; a claim replaces it.
    Ended(i64),
}

impl Buried {
    /// The guard a write that follows this read needs on the tombstone's key.
    pub(super) fn guard(&self) -> Option<Guard> {
        match self {
            Buried::NotRead => None,
            Buried::Absent => Some(Guard::Absent),
            Buried::Standing(_, revision) | Buried::Ended(revision) => Some(Guard::ModRevision(*revision)),
        }
    }

    /// The tombstone standing at `now_ms`, if any.
    pub(super) fn standing(&self, now_ms: u64) -> Option<&Tombstone> {
        match self {
            Buried::Standing(t, _) if !t.is_expired(now_ms) => Some(t),
            _ => None,
        }
    }

    /// Whether there is a key to delete.
    pub(super) fn exists(&self) -> bool {
        matches!(self, Buried::Standing(..) | Buried::Ended(_))
    }
}

/// A range answer for `scope`'s tombstone key.
pub(super) fn buried(found: Option<&wire::RangeAnswer>, scope: &ScopeId) -> Result<Buried, StoreError> {
    let Some(found) = found else { return Err(unusable("etcd's answer lacks the tombstone read")) };
    let Some(kv) = found.kvs.first() else { return Ok(Buried::Absent) };
    Ok(match Tombstone::decode(&kv.value) {
        Ok(t) if t.scope == *scope => Buried::Standing(t, kv.mod_revision),
        Ok(_) => return Err(StoreError::Corrupt("a tombstone under another scope's key".into())),
        Err(e) => {
            log::debug!("tombstone of {} unreadable ({e:?}): replaced by a claim", scope.log_tag());
            Buried::Ended(kv.mod_revision)
        }
    })
}

impl EtcdConversation {
    /// An operator's resolve read the record's tombstone: settle, rewriting it (`settle`).
    pub(super) fn tombstone_read(
        &mut self,
        store: &EtcdStore,
        found: &wire::RangeAnswer,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let Some((written, revision)) = self.resolving.take() else {
            return Err(unusable("a tombstone read without its resolve"));
        };
        self.resolved_tombstone = Some(buried(Some(found), &written.scope)?);
        self.settle(store, written, Guard::ModRevision(revision), now_ms)
    }
}
