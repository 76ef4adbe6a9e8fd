//! What an operator does to records (the admin API, `worker/admin/`): list them, look one up,
//! release it, or settle it with the upstream's real answer. Apart from the request path because
//! none of it runs there: it scans buckets, and it changes records no claim of its own owns, by
//! the same commit rules (slot first, by CAS; then the bucket) that every writer follows.

use super::commit::Restored;
use super::{LocalStore, CAS_ATTEMPTS};
use crate::identity::scope::ScopeId;
use crate::store::record::{self, Entry, SlotValue, FLAG_BODY_NOT_STORED};
use crate::store::shared_data::SharedData;
use crate::store::{Amendment, Claim, RecordId, RecordPage, RecordQuery, RecordView, Refusal};
use crate::store::{Settled, StoreError};

/// Host reads (a bucket's or a slot's) one look at records makes at most in one call, give or
/// take a bucket's entries. A list, or a look-up by tag, over a large store reads every bucket
/// and many slots: on the worker that serves it, that is time no request gets. So such a scan
/// goes in parts: a call stops at this bound with `RecordPage::paused` and where it stopped, and
/// the admin API asks again for the rest in a later callback (`worker/admin/`), so the worker
/// serves its requests in between. Measured (docs/OPERATIONS.md, "An outcome_unknown alert
/// fired"): about 1 ms of one worker per call.
pub const SCAN_READS: usize = 256;

impl<S: SharedData> LocalStore<S> {
    /// `StoreOp::Records`: one record's id (a scope: its two buckets; a tag: every record
    /// whose scope starts with it, in bucket order), or a list in bucket order, each record as
    /// it really stands (its slot read when its bucket entry may lag). The cursor is the locator
    /// of the last record a page showed (or the last bucket a paused call read whole: position
    /// 0xff), so a scan resumes after it. At most about `SCAN_READS` reads a call.
    pub(super) fn query_records(&self, q: &RecordQuery) -> Result<RecordPage, StoreError> {
        if let Some(RecordId::Scope(scope)) = &q.id {
            return Ok(RecordPage { views: self.find_scope(scope, q)?, next: None, paused: false });
        }
        let after: Option<u64> = match &q.cursor {
            None => None,
            Some(c) => Some(c.parse().map_err(|_| StoreError::Corrupt(format!("cursor {c:?}")))?),
        };
        let first_bucket = after.map_or(0, |l| match split(l) {
            (bucket, u8::MAX) => bucket.saturating_add(1),
            (bucket, _) => bucket,
        });
        let mut page = RecordPage::default();
        let mut reads = 0;
        for bucket in first_bucket..self.buckets {
            if reads >= SCAN_READS {
                if q.id.is_none() && page.views.len() == q.limit {
                    // Full: the next page starts after its last record (and may be empty).
                    page.next = page.views.last().map(|v| v.locator.to_string());
                } else {
                    // Every bucket before this one was read whole.
                    page.next = Some(((u64::from(bucket) << 8).saturating_sub(1)).to_string());
                    page.paused = true;
                }
                return Ok(page);
            }
            let (mut entries, _) = self.read_bucket(bucket)?;
            reads += 1;
            entries.sort_by_key(|e| e.position);
            for e in entries {
                let locator = (u64::from(bucket) << 8) | u64::from(e.position);
                let wanted = match &q.id {
                    Some(id) => id.names(&e.scope),
                    None => q.state.admits(&e) || !e.is_completed(),
                };
                if after.is_some_and(|a| locator <= a) || e.is_expired(q.now_ms) || !wanted {
                    continue;
                }
                let view = self.view(bucket, &e, q.detail)?;
                reads += 1;
                let listed =
                    q.id.is_some() || (q.state.admits(&view.entry) && q.admits_label(view.label.as_ref()));
                if view.entry.is_expired(q.now_ms) || !listed {
                    continue;
                }
                if q.id.is_none() && page.views.len() == q.limit {
                    // One more matches: the page ends at the last one shown.
                    page.next = page.views.last().map(|v| v.locator.to_string());
                    return Ok(page);
                }
                page.views.push(view);
            }
        }
        Ok(page)
    }

    /// The record a scope id names (at most one), in its two buckets.
    fn find_scope(&self, scope: &ScopeId, q: &RecordQuery) -> Result<Vec<RecordView>, StoreError> {
        let (a, b) = self.buckets_of(scope);
        let mut found = Vec::new();
        for bucket in if a == b { vec![a] } else { vec![a, b] } {
            let (entries, _) = self.read_bucket(bucket)?;
            for e in entries.iter().filter(|e| e.scope == *scope && !e.is_expired(q.now_ms)) {
                let view = self.view(bucket, e, q.detail)?;
                if !view.entry.is_expired(q.now_ms) {
                    found.push(view);
                }
            }
        }
        Ok(found)
    }

    /// `StoreOp::Amend`.
    pub(super) fn amend_record(
        &self,
        view: &RecordView,
        change: &Amendment,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError> {
        if let Some(refusal) = change.refusal(&view.entry, now_ms) {
            return Ok(Err(refusal));
        }
        match change {
            Amendment::Release { .. } => self.release_record(view, change, now_ms),
            Amendment::Resolve(outcome) => self.resolve_record(view, outcome.clone(), now_ms),
        }
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
            shard: 0,
        })
    }

    /// Deletes a record so that the next request with its key executes: one whose outcome is
    /// unknown, or a claim whose lease ended (its Envoy died, or nobody retried); a completed one
    /// only with `force`. A claim within its lease is refused: its request may be executing.
    fn release_record(
        &self,
        view: &RecordView,
        change: &Amendment,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError> {
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
            if let Some(refusal) = change.refusal(&standing, now_ms) {
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
            // Released so that the next request executes: its tombstone would refuse it.
            self.unbury(&view.scope)?;
            return Ok(Ok(()));
        }
        Err(StoreError::Contention)
    }

    /// Settles a record whose outcome is unknown, or a claim whose lease ended (`amend_record`
    /// refused the others), with the upstream's real answer: every retry replays it until the
    /// record's own expiry.
    fn resolve_record(
        &self,
        view: &RecordView,
        outcome: record::Snapshot,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError> {
        let (bucket, position) = split(view.locator);
        let done = Amendment::completion(outcome.clone(), &view.entry, now_ms);
        let state = done.state;
        if !view.entry.is_completed() {
            // A lease-ended claim: completed as its owner would, through the same commit.
            let claim = Claim {
                scope: view.scope,
                owner: view.entry.owner,
                locator: view.locator,
                written: None,
                shard: 0,
                old_home: None,
                tombstone_s: 0,
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
            // Its tombstone, if its rule keeps one, says the status the record now replays.
            self.rebury(&view.scope, outcome.status)?;
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
