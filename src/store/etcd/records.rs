//! The admin API's side of the etcd store (`StoreOp::Records`, `StoreOp::Amend`). A look at
//! records is a scan of `r/` in key (scope) order, a page at a time, each page's records decoded
//! and filtered by state, then their labels (`n/<scope hex>`, written by the claim beside the
//! record) read in one transaction and filtered by route and key. A change to a record is the
//! settlement its owner would have made (a release deletes it, a resolve completes it), guarded
//! by the revision the operator's look saw: whatever wrote it since wins, and the change is
//! refused as settled meanwhile.

use super::stage::{Move, Stage};
use super::wire::{self, Guard, TxnOp};
use super::{decode, EtcdConversation, EtcdStore};
use crate::codec::{hex, unhex};
use crate::identity::scope::ScopeId;
use crate::store::record;
use crate::store::{Amendment, Claim, RecordId, RecordPage, RecordQuery, RecordView, StoreError, StoreOp};

/// Records read per call: their values hold their stored responses, which the list does not show
/// but etcd cannot leave out, so a page stays small.
const PAGE: i64 = 16;
/// Records one list reads at most before it answers with what it found and a cursor, so that an
/// operator's filter over a large store is many short requests, not one that holds the listener.
pub const MAX_SCAN: usize = 4_096;

/// The owner a resolved record carries: no claim's (owner tokens are random, never 0 in practice,
/// and a record settled by an operator has no owner left to complete it).
const RESOLVED_OWNER: u64 = 0;

/// A list (or lookup) in progress.
#[derive(Debug)]
pub struct Scan {
    query: RecordQuery,
    page: RecordPage,
    /// The records of the last page that passed the state filter, waiting for their labels.
    candidates: Vec<RecordView>,
    /// Where the next page starts, and where the range ends.
    start: Vec<u8>,
    end: Vec<u8>,
    /// The scope of the last record read, and whether the range holds more after it.
    last_read: Option<ScopeId>,
    more: bool,
    scanned: usize,
}

impl EtcdStore {
    /// `<prefix>n/<scope hex>`: a record's label (route, key, claim time).
    pub(super) fn label_key(&self, scope: &ScopeId) -> Vec<u8> {
        let mut key = self.settings.prefix.clone().into_bytes();
        key.extend_from_slice(b"n/");
        key.extend_from_slice(hex(&scope.0).as_bytes());
        key
    }

    fn records_prefix(&self) -> Vec<u8> {
        let mut key = self.settings.prefix.clone().into_bytes();
        key.extend_from_slice(b"r/");
        key
    }
}

/// The first key after every key that starts with `prefix` (none ends in 0xff: hex and '/').
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    if let Some(last) = end.last_mut() {
        *last = last.saturating_add(1);
    }
    end
}

fn range(key: Vec<u8>, end: Vec<u8>, limit: i64) -> TxnOp {
    TxnOp::Range { key, range_end: Some(end), limit, keys_only: false }
}

impl EtcdConversation {
    /// The first call of a look at records.
    pub(super) fn start_scan(&mut self, store: &EtcdStore, query: RecordQuery) -> Result<Move, StoreError> {
        let prefix = store.records_prefix();
        let (start, end) = match (&query.id, &query.cursor) {
            (Some(RecordId::Scope(scope)), _) => {
                let key = store.record_key(scope);
                let end = [key.as_slice(), b"\0"].concat();
                (key, end)
            }
            (Some(RecordId::Tag(tag)), _) => {
                let key = [prefix.as_slice(), hex(tag).as_bytes()].concat();
                let end = prefix_end(&key);
                (key, end)
            }
            (None, Some(cursor)) => {
                let scope = unhex(cursor)
                    .filter(|b| b.len() == 32)
                    .ok_or_else(|| StoreError::Corrupt(format!("cursor {cursor:?}")))?;
                // Just after the cursor's record.
                ([prefix.as_slice(), hex(&scope).as_bytes(), b"\0"].concat(), prefix_end(&prefix))
            }
            (None, None) => (prefix.clone(), prefix_end(&prefix)),
        };
        self.scan = Some(Box::new(Scan {
            query,
            page: RecordPage::default(),
            candidates: Vec::new(),
            start,
            end,
            last_read: None,
            more: false,
            scanned: 0,
        }));
        Ok(self.next_page(store))
    }

    fn next_page(&self, store: &EtcdStore) -> Move {
        let (start, end) =
            self.scan.as_ref().map_or((Vec::new(), Vec::new()), |s| (s.start.clone(), s.end.clone()));
        Move::Call(wire::txn(store.protocol(), None, &[range(start, end, PAGE)], &[]), Stage::Scan)
    }

    /// A page of records: those of the wanted state wait for their labels.
    pub(super) fn scanned(&mut self, store: &EtcdStore, txn: &wire::TxnAnswer) -> Result<Move, StoreError> {
        let Some(scan) = self.scan.as_mut() else { return Err(super::unusable("a page without its scan")) };
        let found = txn.ranges.first().ok_or_else(|| super::unusable("etcd's answer lacks the range"))?;
        let q = &scan.query;
        for kv in &found.kvs {
            let value = decode(&kv.value)?;
            let e = value.entry;
            scan.last_read = Some(e.scope);
            scan.scanned += 1;
            // Time is the caller's, as for every read of this store: an expired record is absent.
            if e.is_expired(q.now_ms) || (q.id.is_none() && !q.state.admits(&e)) {
                continue;
            }
            let locator =
                u64::try_from(kv.mod_revision).map_err(|_| super::unusable("a negative revision"))?;
            scan.candidates.push(RecordView {
                scope: e.scope,
                locator,
                entry: e,
                label: None,
                snapshot: value.snapshot.filter(|_| q.detail),
                shard: 0,
            });
        }
        scan.more = found.count > found.kvs.len() as i64;
        if let Some(last) = found.kvs.last() {
            scan.start = [last.key.as_slice(), b"\0"].concat();
        }
        if scan.candidates.is_empty() {
            return Ok(self.page_done(store));
        }
        let reads: Vec<TxnOp> = scan
            .candidates
            .iter()
            .map(|v| TxnOp::Range {
                key: store.label_key(&v.scope),
                range_end: None,
                limit: 1,
                keys_only: false,
            })
            .collect();
        Ok(Move::Call(wire::txn(store.protocol(), None, &reads, &[]), Stage::Labels))
    }

    /// The labels of a page's candidates, in their order: those that pass the route and key
    /// filters join the page.
    pub(super) fn labelled(&mut self, store: &EtcdStore, txn: &wire::TxnAnswer) -> Result<Move, StoreError> {
        let Some(scan) = self.scan.as_mut() else { return Err(super::unusable("labels without their scan")) };
        let candidates = std::mem::take(&mut scan.candidates);
        for (i, mut view) in candidates.into_iter().enumerate() {
            // A label this build cannot read is shown as none, never a reason to hide the record.
            view.label = txn
                .ranges
                .get(i)
                .and_then(|r| r.kvs.first())
                .and_then(|kv| record::decode_label(&kv.value).ok());
            if scan.query.id.is_none() && !scan.query.admits_label(view.label.as_ref()) {
                continue;
            }
            if scan.query.id.is_none() && scan.page.views.len() == scan.query.limit {
                // One more matches: the page ends at the last one shown.
                scan.page.next = scan.page.views.last().map(|v| hex(&v.scope.0));
                return Ok(Move::Records(std::mem::take(&mut scan.page)));
            }
            scan.page.views.push(view);
        }
        Ok(self.page_done(store))
    }

    /// After a page: the next one, or the answer (with a cursor when the scan stopped early).
    fn page_done(&mut self, store: &EtcdStore) -> Move {
        let Some(scan) = self.scan.as_mut() else { return Move::Records(RecordPage::default()) };
        if scan.more && scan.scanned < MAX_SCAN {
            return self.next_page(store);
        }
        if scan.more && scan.query.id.is_none() {
            scan.page.next = scan.last_read.map(|s| hex(&s.0));
        }
        Move::Records(std::mem::take(&mut scan.page))
    }

    /// An operator's change: refused as the look saw the record, or else the settlement its
    /// owner would make, guarded by that look's revision. The conversation then carries it out as
    /// that release or completion (`amending` keeps what was asked).
    pub(super) fn start_amend(
        &mut self,
        store: &EtcdStore,
        view: &RecordView,
        change: &Amendment,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        if let Some(refusal) = change.refusal(&view.entry, now_ms) {
            return Ok(Move::Amended(Err(refusal)));
        }
        let revision = i64::try_from(view.locator).map_err(|_| super::unusable("a revision out of range"))?;
        // A resolve writes the record as no claim's: its owner's late completion, which may carry
        // the same status, must find it lost (as the local store's does), not its own.
        let mut written = view.entry;
        if matches!(change, Amendment::Resolve(_)) {
            written.owner = RESOLVED_OWNER;
        }
        let claim = Claim {
            scope: view.scope,
            owner: view.entry.owner,
            locator: view.locator,
            written: Some(written),
            shard: 0,
            old_home: None,
            tombstone_s: 0,
        };
        let settlement = match change {
            Amendment::Release { .. } => StoreOp::Release(claim),
            Amendment::Resolve(outcome) => StoreOp::Complete {
                claim,
                completion: Amendment::completion(outcome.clone(), &view.entry, now_ms),
            },
        };
        self.amending = Some(std::mem::replace(&mut self.op, settlement));
        if change.needs_claim_ended(&view.entry) {
            self.amend_after_lease_key = Some(view.entry.lease_deadline_ms);
        }
        if matches!(change, Amendment::Resolve(_)) && view.entry.is_completed() {
            // The unknown outcome's tombstone, if its rule keeps one, is rewritten with it:
            // read first (`tombstone_read`), then settled.
            self.resolving = Some((written, revision));
            return Ok(Move::Call(
                wire::range(store.protocol(), &store.tombstone_key(&view.scope)),
                Stage::TombstoneRead,
            ));
        }
        self.settle(store, written, Guard::ModRevision(revision), now_ms)
    }
}

// Cloned only by the model checker (tests/etcd_model), which copies a worker's store and its
// conversations into each state it explores. Written out at the end of the file, so that no
// line of the code above moves: the module's panic locations, and so its bytes, stay the same.
#[cfg(feature = "testing")]
impl Clone for Scan {
    fn clone(&self) -> Self {
        Scan {
            query: self.query.clone(),
            page: self.page.clone(),
            candidates: self.candidates.clone(),
            start: self.start.clone(),
            end: self.end.clone(),
            last_read: self.last_read,
            more: self.more,
            scanned: self.scanned,
        }
    }
}
