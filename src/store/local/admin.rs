//! What an operator does to records (the admin API, `crate::admin`): list them, look one up,
//! release it, or settle it with the upstream's real answer. Apart from the request path because
//! none of it runs there: it scans buckets, and it changes records no claim of its own owns, by
//! the same commit rules (slot first, by CAS; then the bucket) that every writer follows.

use super::commit::Restored;
use super::{LocalStore, CAS_ATTEMPTS};
use crate::store::record::{self, Entry, SlotValue, State, FLAG_BODY_NOT_STORED};
use crate::store::shared_data::SharedData;
use crate::store::{Claim, Completion, RecordStore, Settled, StoreError};
use crate::store::{RecordId, RecordView, Refusal};

impl<S: SharedData> LocalStore<S> {
    /// Every record not expired at `now_ms`, bucket by bucket, each as it really stands (its
    /// slot read when its bucket entry may lag), until `visit` returns false. `wanted` sees the
    /// bucket entry first, so a filter that needs no slot (state) reads no slot for the others.
    /// Reads every bucket: an operator's scan, never on a request's path.
    pub fn visit_records(
        &self,
        now_ms: u64,
        wanted: &dyn Fn(&Entry) -> bool,
        visit: &mut dyn FnMut(RecordView) -> bool,
    ) -> Result<(), StoreError> {
        for bucket in 0..self.buckets {
            let (entries, _) = self.read_bucket(bucket)?;
            for e in entries {
                if e.is_expired(now_ms) || (!wanted(&e) && e.is_completed()) {
                    continue;
                }
                let view = self.view(bucket, &e, false)?;
                if view.entry.is_expired(now_ms) || !wanted(&view.entry) {
                    continue;
                }
                if !visit(view) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The records `id` names (a full scope: at most one; a tag: every record whose scope
    /// starts with it), with their stored responses.
    pub fn find_records(&self, id: &RecordId, now_ms: u64) -> Result<Vec<RecordView>, StoreError> {
        let buckets: Vec<u32> = match id {
            RecordId::Scope(scope) => {
                let (a, b) = self.buckets_of(scope);
                if a == b {
                    vec![a]
                } else {
                    vec![a, b]
                }
            }
            RecordId::Tag(_) => (0..self.buckets).collect(),
        };
        let mut found = Vec::new();
        for bucket in buckets {
            let (entries, _) = self.read_bucket(bucket)?;
            for e in entries.iter().filter(|e| id.names(&e.scope) && !e.is_expired(now_ms)) {
                let view = self.view(bucket, e, true)?;
                if !view.entry.is_expired(now_ms) {
                    found.push(view);
                }
            }
        }
        Ok(found)
    }

    /// The record as it stands: its slot's outcome if it has one, and its label.
    fn view(&self, bucket: u32, e: &Entry, with_snapshot: bool) -> Result<RecordView, StoreError> {
        let (value, _) = self.read_slot_value(bucket, e.position)?;
        let own = value.filter(|v| v.belongs_to(e));
        let label = own.as_ref().and_then(|v| v.label.clone());
        let (entry, snapshot) = match own {
            Some(v) if !v.is_claim_label() => (Entry { position: e.position, ..v.entry }, v.snapshot),
            _ => (*e, None),
        };
        Ok(RecordView {
            scope: e.scope,
            locator: (u64::from(bucket) << 8) | u64::from(e.position),
            entry,
            label,
            snapshot: snapshot.filter(|_| with_snapshot),
        })
    }

    /// Deletes a record so that the next request with its key executes: one whose outcome is
    /// unknown, or a claim whose lease ended (its Envoy died, or nobody retried); a completed one
    /// only with `force`. A claim within its lease is refused: its request may be executing.
    pub fn release_record(
        &self,
        view: &RecordView,
        force: bool,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError> {
        if let Some(refusal) = refusal_to_release(&view.entry, force, now_ms) {
            return Ok(Err(refusal));
        }
        let (bucket, position) = split(view.locator);
        for _ in 0..CAS_ATTEMPTS {
            // Slot first, then the bucket write, then the slot emptied by CAS against the first
            // read: an owner that commits in between wins, and the record is put back.
            let (value, slot_read) = self.read_slot_value(bucket, position)?;
            let (mut entries, read) = self.read_bucket(bucket)?;
            let Some(i) = entries.iter().position(|e| same_record(e, &view.entry)) else {
                return Ok(Err(Refusal::Gone));
            };
            let standing = match value.as_ref().filter(|v| v.belongs_to(&entries[i]) && !v.is_claim_label()) {
                Some(v) => Entry { position, ..v.entry },
                None => entries[i],
            };
            if let Some(refusal) = refusal_to_release(&standing, force, now_ms) {
                return Ok(Err(refusal));
            }
            let gone = entries.remove(i);
            if !self.write_bucket(bucket, &entries, &read)? {
                continue;
            }
            if slot_read.value.is_some() && !self.cas(&self.slot_key(bucket, position), &[], &slot_read)? {
                let (now_there, _) = self.read_slot(bucket, position)?;
                if let Some(v) = now_there.filter(|v| v.belongs_to(&gone)) {
                    // Its owner committed between our reads: that outcome stands.
                    if self.restore(bucket, position, &v, None)? != Restored::Superseded {
                        return Ok(Err(Refusal::SettledMeanwhile));
                    }
                }
            }
            self.uncharge(&gone);
            self.fill_adjust(self.shard_of(bucket), -1);
            return Ok(Ok(()));
        }
        Err(StoreError::Contention)
    }

    /// Settles a record whose outcome is unknown, or a claim whose lease ended, with the
    /// upstream's real answer: every retry replays it until the record's own expiry. A
    /// completed record with a known outcome is refused, and so is a claim within its lease.
    pub fn resolve_record(
        &self,
        view: &RecordView,
        outcome: record::Snapshot,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError> {
        if let Some(refusal) = refusal_to_resolve(&view.entry, now_ms) {
            return Ok(Err(refusal));
        }
        let (bucket, position) = split(view.locator);
        let state = if outcome.status < 400 { State::Succeeded } else { State::FailedFinal };
        if !view.entry.is_completed() {
            // A lease-ended claim: completed as its owner would, through the same commit.
            let claim =
                Claim { scope: view.scope, owner: view.entry.owner, locator: view.locator, written: None };
            let done = Completion {
                state,
                status: outcome.status,
                snapshot: Some(outcome),
                now_ms,
                ttl_ms: view.entry.expires_at_ms.saturating_sub(now_ms),
            };
            return Ok(match self.complete(&claim, &done)? {
                Settled::Done => Ok(()),
                Settled::Lost => Err(Refusal::SettledMeanwhile),
            });
        }
        // An outcome-unknown record: its slot is rewritten by CAS, then its bucket entry.
        let settled = Entry {
            state,
            status: outcome.status,
            flags: view.entry.flags & !FLAG_BODY_NOT_STORED,
            ..view.entry
        };
        for _ in 0..CAS_ATTEMPTS {
            let (value, slot_read) = self.read_slot(bucket, position)?;
            let Some(v) = value.filter(|v| v.belongs_to(&view.entry)) else { return Ok(Err(Refusal::Gone)) };
            if !v.entry.outcome_unknown() {
                return Ok(Err(Refusal::Completed));
            }
            let bytes = record::encode_slot(&SlotValue {
                entry: settled,
                snapshot: Some(outcome.clone()),
                label: v.label,
            });
            if !self.cas(&self.slot_key(bucket, position), &bytes, &slot_read)? {
                continue;
            }
            self.replace_completed(bucket, &settled)?;
            return Ok(Ok(()));
        }
        Err(StoreError::Contention)
    }

    /// Puts a resolved outcome in place of the outcome-unknown entry in its bucket, so readers
    /// that trust a completed bucket entry (and read no slot) see it.
    fn replace_completed(&self, bucket: u32, settled: &Entry) -> Result<(), StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let (mut entries, read) = self.read_bucket(bucket)?;
            let Some(i) = entries.iter().position(|e| same_record(e, settled)) else { return Ok(()) };
            entries[i] = *settled;
            if self.write_bucket(bucket, &entries, &read)? {
                return Ok(());
            }
        }
        Err(StoreError::Contention)
    }
}

fn split(locator: u64) -> (u32, u8) {
    (u32::try_from(locator >> 8).unwrap_or(u32::MAX), (locator & 0xff) as u8)
}

fn same_record(e: &Entry, other: &Entry) -> bool {
    e.position == other.position && e.scope == other.scope && e.owner == other.owner
}

fn refusal_to_release(e: &Entry, force: bool, now_ms: u64) -> Option<Refusal> {
    if !e.is_completed() && now_ms < e.lease_deadline_ms {
        return Some(Refusal::Live { lease_ends_at_ms: e.lease_deadline_ms });
    }
    (e.is_completed() && !e.outcome_unknown() && !force).then_some(Refusal::Completed)
}

fn refusal_to_resolve(e: &Entry, now_ms: u64) -> Option<Refusal> {
    if !e.is_completed() && now_ms < e.lease_deadline_ms {
        return Some(Refusal::Live { lease_ends_at_ms: e.lease_deadline_ms });
    }
    (e.is_completed() && !e.outcome_unknown()).then_some(Refusal::Completed)
}
