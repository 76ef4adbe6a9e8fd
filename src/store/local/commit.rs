//! The commit point: a record's slot. Reading a slot to learn what an entry really is
//! (`resolve`), the fence a replacing or dropping writer puts on the slot after its bucket write,
//! the restore of an outcome that committed first, and the best-effort promotion of the bucket
//! entry. Apart from the rest because every writer of a bucket must follow these rules, or a
//! late owner overwrites a takeover.

use super::{host, LocalStore, CAS_ATTEMPTS};
use crate::store::record::{self, Entry, Label, SlotValue, State};
use crate::store::shared_data::{Read, SharedData};
use crate::store::{Claim, StoreError};

/// Safety net for CAS loops on one slot. A slot CAS only loses to another write to the same slot
/// between our read and our write, and the only writers of a slot are its record's owner and
/// whoever just replaced or dropped the entry at that position. After such a write, our next
/// ownership check fails (we return `Lost`) or our next CAS succeeds; so the loop ends within a
/// few passes and this bound is never reached unless the host misbehaves.
pub(super) const SLOT_ATTEMPTS: usize = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Restored {
    Placed,
    Occupied,
    Superseded,
}

/// The slot write a replacing or dropping writer makes after its bucket write, and what it found.
pub(super) enum Fenced {
    Done,
    /// An outcome committed before the fence: the completed record was put back instead.
    RolledBack,
}

impl<S: SharedData> LocalStore<S> {
    /// Reads a slot that must exist, and the outcome it holds, whoever it belongs to. A claim's
    /// label there is no outcome: it reads as an empty slot (`read_slot_value` shows it).
    pub(super) fn read_slot(
        &self,
        bucket: u32,
        position: u8,
    ) -> Result<(Option<SlotValue>, Read), StoreError> {
        let (value, read) = self.read_slot_value(bucket, position)?;
        Ok((value.filter(|v| !v.is_claim_label()), read))
    }

    /// Reads a slot that must exist: an outcome, or the label of the claim that fenced it.
    pub(super) fn read_slot_value(
        &self,
        bucket: u32,
        position: u8,
    ) -> Result<(Option<SlotValue>, Read), StoreError> {
        self.read_slot_as(bucket, position, record::decode_slot)
    }

    pub(super) fn read_slot_as(
        &self,
        bucket: u32,
        position: u8,
        decode: fn(&[u8]) -> Result<SlotValue, record::DecodeError>,
    ) -> Result<(Option<SlotValue>, Read), StoreError> {
        let data_key = self.slot_key(bucket, position);
        let read = self.data.get(&data_key).map_err(host)?;
        if !read.exists() {
            return Err(StoreError::Unavailable(format!("{data_key} was never created")));
        }
        let Some(bytes) = read.value.as_deref() else { return Ok((None, read)) };
        let slot = decode(bytes).map_err(|e| StoreError::Corrupt(format!("{data_key}: {e}")))?;
        Ok((Some(slot), read))
    }

    /// The entry as it really stands: a processing entry whose slot holds its committed outcome
    /// is completed (its bucket promotion may have lost). Returns the slot read too, for a fence.
    pub(super) fn resolve(
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

    /// The snapshot of a completed entry, if its slot holds this record's outcome.
    pub(super) fn read_snapshot(
        &self,
        bucket: u32,
        entry: &Entry,
    ) -> Result<Option<crate::store::record::Snapshot>, StoreError> {
        // Read for a replay, which never shows the label: its bytes are stepped over.
        let (slot, _) = self.read_slot_as(bucket, entry.position, record::decode_slot_outcome)?;
        let slot = slot.filter(|v| !v.is_claim_label());
        // A slot may still hold the outcome of an earlier record at this position, or already a
        // newer one: only the outcome tagged with this entry's scope and owner is its own.
        Ok(slot.filter(|v| v.belongs_to(entry)).and_then(|v| v.snapshot))
    }

    /// After putting `ours` at its position, writes the slot as a CAS against `pre` (read before
    /// the bucket write): empty, or with the claim's label (no outcome: `read_slot` reads it as
    /// empty). Any owner of the replaced record that checked ownership before our bucket write
    /// and writes its outcome after this fails its CAS; an outcome that landed first wins, and
    /// the bucket is rolled back to it.
    pub(super) fn fence(
        &self,
        bucket: u32,
        ours: &Entry,
        label: Option<&Label>,
        pre: Read,
        now: u64,
    ) -> Result<Fenced, StoreError> {
        let data_key = self.slot_key(bucket, ours.position);
        let value = label.map_or_else(Vec::new, |label| {
            record::encode_slot(&SlotValue {
                entry: *ours,
                snapshot: None,
                label: Some(label.clone().created_at(now)),
            })
        });
        let mut read = pre;
        for _ in 0..SLOT_ATTEMPTS {
            // Written even when the slot is already empty: the write bumps the slot's CAS, which
            // is what makes a late owner holding an older read fail.
            if self.cas(&data_key, &value, &read)? {
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
    pub(super) fn restore(
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

    /// Index of the processing entry this claim owns, if it still owns one.
    pub(super) fn owned(&self, entries: &[Entry], claim: &Claim, position: u8) -> Option<usize> {
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
    pub(super) fn promote(
        &self,
        bucket: u32,
        committed: &Entry,
        first: (Vec<Entry>, Read),
    ) -> Result<(), StoreError> {
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
