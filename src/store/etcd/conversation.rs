//! One `StoreOp` carried out against etcd: the `EtcdConversation`, a state machine that asks for HTTP
//! calls (`Next::Call`) and is fed their answers until it is `Done` (`EtcdStore::start` makes
//! one). Its steps for a begin, a completion and a release are here; the token fetch, the
//! leases, the quota and the records scan add theirs from `auth.rs`, `leases.rs`, `quota.rs`
//! and `records.rs`. What each operation costs in round trips: docs/ETCD.md#data-model.

use crate::config::etcd::ETCD_MAX_REQUEST_BYTES;
use crate::store::record::{self, Entry, SlotValue, State};
use crate::store::remote::{Answer, Next};
use crate::store::{
    completed_answer, Begin, Claim, ClaimAttempt, Completion, OnLeaseEnd, Refusal, Settled, StoreAnswer,
    StoreError, StoreOp,
};

use super::keys::owner_of;
use super::leases::{window_end, LIVE_CLAIM_RETRY_MS};
use super::quota::{charged_entry, quota_reads, quota_refusal};
use super::stage::{Move, Stage, TXN_ATTEMPTS};
use super::tombstones::{buried, Buried};
use super::wire::{self, EtcdRefusal, Guard, TxnOp};
use super::{decode, records, unusable, EtcdStore, UNANSWERED};
use crate::store::tombstone::Tombstone;

/// Room kept for keys and framing when checking an encoded record against etcd's limit.
const TXN_FRAMING_BYTES: u64 = 4 * 1024;

/// A guarded write waiting for its lease (or sent).
#[derive(Debug, Clone)]
pub(super) struct Write {
    guard: Guard,
    /// The record to put and its encoded value (None: delete it, a release).
    pub(super) record: Option<(Entry, Vec<u8>)>,
    /// Index keys to delete (the replaced record's).
    stale_index: Vec<Vec<u8>>,
    pub(super) lease: i64,
    pub(super) window_end_ms: u64,
    /// A claim: its processing lease length, for its lease key's claim lease (0: not yet
    /// known), asked for at `grant_sent_ms`.
    pub(super) claim_lease_ms: Option<u64>,
    pub(super) claim_lease: i64,
    pub(super) grant_sent_ms: u64,
    /// The tombstone the write leaves (`t/<scope>`): a completion of a claim that keeps one, a
    /// begin that marks an unknown outcome, an operator's resolve. On a lease of its own, for
    /// the window of its end (`tomb_lease`, asked for after the record's).
    pub(super) tombstone: Option<Tombstone>,
    pub(super) tomb_lease: i64,
    pub(super) tomb_window_end_ms: u64,
    /// The scope's tombstone as the read the write follows found it (absent, or at a revision):
    /// the write holds only while it is so. None: not guarded.
    tomb_guard: Option<Guard>,
    /// The write deletes the scope's tombstone: an operator's release (the next request
    /// executes), or a claim made over one that ended.
    drop_tombstone: bool,
    /// What a successful write means.
    won: Won,
}

impl Write {
    fn new(guard: Guard, record: Option<(Entry, Vec<u8>)>, stale_index: Vec<Vec<u8>>, won: Won) -> Write {
        Write {
            guard,
            record,
            stale_index,
            lease: 0,
            window_end_ms: 0,
            claim_lease_ms: None,
            claim_lease: 0,
            grant_sent_ms: 0,
            tombstone: None,
            tomb_lease: 0,
            tomb_window_end_ms: 0,
            tomb_guard: None,
            drop_tombstone: false,
            won,
        }
    }
}

/// How a begin will claim an existing or absent record, once its quota is known.
#[derive(Debug, Clone, Copy)]
pub(super) struct PendingClaim {
    guard: Guard,
    /// The record the claim replaces (its index keys are deleted).
    replaced: Option<Entry>,
    won: Won,
    /// The scope's tombstone as read (`Write::tomb_guard`), and whether the claim deletes it
    /// (one that ended).
    tomb_guard: Option<Guard>,
    drop_tombstone: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Won {
    Claimed,
    TookOver,
    Settled,
    /// A begin completed a lease-ended record as outcome unknown (`OnLeaseEnd::MarkUnknown`).
    MarkedUnknown,
}

/// The record `current` with the outcome `c` (expiring `c.ttl_ms` after it), and its bytes.
fn outcome_record(current: Entry, c: &Completion) -> (Entry, Vec<u8>) {
    let mut done = current;
    done.state = c.state;
    done.status = c.status;
    done.expires_at_ms = c.now_ms.saturating_add(c.ttl_ms);
    // encode_slot sets FLAG_BODY_NOT_STORED from the snapshot's presence.
    let value = record::encode_slot(&SlotValue { entry: done, snapshot: c.snapshot.clone(), label: None });
    if value.len() as u64 + TXN_FRAMING_BYTES <= ETCD_MAX_REQUEST_BYTES {
        return (done, value);
    }
    // Headers beyond what the configuration's sizing assumed: etcd would refuse the whole write
    // and the outcome would be lost (a retry would execute again). Keep the outcome without its
    // body instead, as for any response too large to keep.
    log::debug!("completion of {} too large for etcd: kept without its body", current.scope.log_tag());
    let value = record::encode_slot(&SlotValue { entry: done, snapshot: None, label: None });
    (done, value)
}

/// One `StoreOp` carried out as a sequence of HTTP calls to etcd (JSON or gRPC). Pure state
/// machine: the caller performs each `Call` and feeds its answer back.
#[derive(Debug)]
pub struct EtcdConversation {
    pub(super) op: StoreOp,
    stage: Stage,
    /// The last call made for the operation itself, sent again after a re-authentication.
    pub(super) pending: Option<wire::Call>,
    /// The number of the worker's token fetch this conversation is making (its answer is due).
    pub(super) fetching: Option<u64>,
    /// The number of the token fetch this conversation waits for (another conversation makes it).
    pub(super) awaiting: Option<u64>,
    /// The token the pending call was sent with: a refusal replaces the worker's token only
    /// when it is still this one (several conversations refused at once fetch one token).
    pub(super) sent_token: Option<String>,
    reauthenticated: bool,
    lease_regranted: bool,
    attempts: u8,
    pub(super) write: Option<Write>,
    pub(super) pending_claim: Option<PendingClaim>,
    /// The quota's answer to a new claim that turned out over its bound, given once the claim
    /// is undone.
    pub(super) refusal: Option<Begin>,
    /// The record was found absent by a `Probe`: grant the leases and claim.
    probed: bool,
    /// A begin that failed after sending its claim's transaction (or an undo of it): the claim
    /// etcd may hold, which nobody will forward (`unanswered_claim`).
    unanswered: Option<Claim>,
    /// A look at records in progress (`records.rs`).
    pub(super) scan: Option<Box<records::Scan>>,
    /// An operator's change, carried out as the release or completion now in `op`.
    pub(super) amending: Option<StoreOp>,
    /// A renewal in progress (`renew.rs`).
    pub(super) renewing: Option<Box<super::renew::Renewing>>,
    /// An operator's change to a record whose request may still be at work: made only while
    /// the claim's lease key is gone (the rule a takeover follows), else refused as live.
    pub(super) amend_after_lease_key: Option<u64>,
    /// An operator's resolve of a completed record: the record as it writes it and the
    /// revision it is guarded by, while its tombstone is read; then the tombstone as read
    /// (`tombstones.rs`).
    pub(super) resolving: Option<(Entry, i64)>,
    pub(super) resolved_tombstone: Option<Buried>,
}

impl EtcdConversation {
    /// A new conversation for `op`, not yet stepped (`EtcdStore::start`).
    pub(super) fn new(op: StoreOp) -> EtcdConversation {
        EtcdConversation {
            op,
            stage: Stage::Start,
            pending: None,
            fetching: None,
            awaiting: None,
            sent_token: None,
            reauthenticated: false,
            lease_regranted: false,
            attempts: 0,
            write: None,
            pending_claim: None,
            refusal: None,
            probed: false,
            unanswered: None,
            scan: None,
            amending: None,
            renewing: None,
            amend_after_lease_key: None,
            resolving: None,
            resolved_tombstone: None,
        }
    }

    /// The operation this conversation carries out (to start it again).
    pub fn into_op(self) -> StoreOp {
        self.amending.unwrap_or(self.op)
    }

    fn claim_in_doubt(&self) -> Option<Claim> {
        let StoreOp::Begin(a) = &self.op else { return None };
        let w = self.write.as_ref()?;
        let claims = matches!(w.won, Won::Claimed | Won::TookOver) && w.claim_lease != 0;
        match (self.stage, &w.record) {
            (Stage::Write | Stage::Undo, Some((entry, _))) if claims => Some(Claim {
                scope: a.scope,
                owner: entry.owner,
                locator: UNANSWERED,
                written: Some(*entry),
                shard: 0,
                old_home: None,
                tombstone_s: a.tombstone_s(),
            }),
            _ => None,
        }
    }

    /// First call with `answer: None`; afterwards with the answer to the last `Call`.
    pub fn step(&mut self, store: &EtcdStore, answer: Option<Answer>, now_ms: u64) -> Next {
        match self.advance(store, answer, now_ms) {
            Ok(step) => step,
            Err(error) => self.finish(Err(error)),
        }
    }

    /// For a begin that failed, or that the caller gives up on while a call is out (Envoy's
    /// timeout is never handed to the conversation): the claim that may be in etcd without anyone
    /// knowing it, because its transaction (or the undo of one over its quota) was sent and no
    /// usable answer came. Nobody forwards the request, so the caller gives it back
    /// (`StoreOp::Release`, locator `UNANSWERED`) instead of letting it block the key until its
    /// lease ends, and then, on a rule that refuses unknown outcomes, read as one for the ttl.
    pub fn unanswered_claim(&self) -> Option<Claim> {
        match self.stage {
            Stage::Finished => self.unanswered,
            _ => self.claim_in_doubt(),
        }
    }

    fn finish(&mut self, outcome: Result<Move, StoreError>) -> Next {
        if outcome.is_err() {
            self.unanswered = self.claim_in_doubt();
        }
        self.stage = Stage::Finished;
        let error = match (outcome, self.amending.is_some()) {
            (Ok(Move::Begun(b)), _) => return Next::Done(StoreAnswer::Begun(Ok(b))),
            // An operator's change, done as its owner's settlement: lost means another write
            // came first (its owner's, a takeover, a release).
            (Ok(Move::Settled(s)), true) => {
                let done = if s == Settled::Done { Ok(()) } else { Err(Refusal::SettledMeanwhile) };
                return Next::Done(StoreAnswer::Amended(Ok(done)));
            }
            (Ok(Move::Settled(s)), false) => return Next::Done(StoreAnswer::Settled(Ok(s))),
            (Ok(Move::Renewed(kept)), _) => return Next::Done(StoreAnswer::Renewed(Ok(kept))),
            (Ok(Move::Records(page)), _) => return Next::Done(StoreAnswer::Records(Ok(page))),
            (Ok(Move::Amended(done)), _) => return Next::Done(StoreAnswer::Amended(Ok(done))),
            (Ok(Move::Call(..)), _) => unusable("a call where an answer was due"),
            (Err(e), _) => e,
        };
        Next::Done(StoreAnswer::failed(self.amending.as_ref().unwrap_or(&self.op), error))
    }

    fn advance(
        &mut self,
        store: &EtcdStore,
        answer: Option<Answer>,
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        if self.awaiting.is_some() {
            if answer.is_some() {
                return Err(unusable("an answer while waiting for a token"));
            }
            return self.token_awaited(store, now_ms);
        }
        let next = match (self.stage, answer) {
            (Stage::Start, None) => self.first(store, now_ms)?,
            (Stage::Start, Some(_)) => return Err(unusable("an answer before any call")),
            (Stage::Finished, _) => return Err(unusable("the conversation had already finished")),
            (_, None) => return Err(unusable("no answer to the last call")),
            (stage, Some(answer)) => {
                if let Some(number) = self.fetching {
                    return self.authenticated(store, number, &answer);
                }
                match wire::body(store.protocol(), &store.settings.cluster, &answer) {
                    Err(EtcdRefusal::InvalidToken(_))
                        if store.settings.auth.is_some() && !self.reauthenticated =>
                    {
                        // Tokens expire, die with an etcd restart and go stale with any auth
                        // change (wire::EtcdRefusal::InvalidToken): one fresh token, once. Only the
                        // first conversation refused with this token drops it; the others take the
                        // new one or wait for its fetch.
                        self.reauthenticated = true;
                        {
                            let mut token = store.token.borrow_mut();
                            if *token == self.sent_token {
                                *token = None;
                            }
                        }
                        return self.send(store, now_ms);
                    }
                    Err(EtcdRefusal::LeaseNotFound) if stage == Stage::Renew && !self.lease_regranted => {
                        self.lease_regranted = true;
                        self.renew_lease_lost(store, now_ms)?
                    }
                    Err(EtcdRefusal::LeaseNotFound) if stage == Stage::Write && !self.lease_regranted => {
                        self.lease_regranted = true;
                        match self.write.as_mut() {
                            Some(w) => {
                                // Either lease may be the one etcd no longer knows.
                                store.forget_lease(w.lease);
                                store.forget_lease(w.claim_lease);
                                store.forget_lease(w.tomb_lease);
                                (w.lease, w.claim_lease, w.tomb_lease) = (0, 0, 0);
                                self.lease_or_write(store, now_ms)?
                            }
                            None => return Err(unusable("a write without its plan")),
                        }
                    }
                    Err(refused) => return Err(refused.into_error()),
                    Ok(body) => match stage {
                        Stage::Probe => {
                            let txn = body.txn().map_err(EtcdRefusal::into_error)?;
                            if txn.succeeded {
                                // Absent: the leases, then the claim's transaction (which may
                                // still find a record written meanwhile).
                                self.probed = true;
                                let StoreOp::Begin(a) = &self.op else { return Err(unusable("not a begin")) };
                                let a = a.clone();
                                self.new_claim(store, &a, now_ms)?
                            } else {
                                self.existing(store, &txn, now_ms)?
                            }
                        }
                        Stage::Undo => {
                            // Whether the guard held or not (a claim over its quota is nobody's
                            // to keep), the begin answers with the quota's refusal.
                            body.txn().map_err(EtcdRefusal::into_error)?;
                            let refusal =
                                self.refusal.take().ok_or_else(|| unusable("an undo without its refusal"))?;
                            Move::Begun(refusal)
                        }
                        Stage::SettleRead => {
                            let range = body.range().map_err(EtcdRefusal::into_error)?;
                            self.settle_read(store, &range, now_ms)?
                        }
                        Stage::QuotaRead => {
                            let txn = body.txn().map_err(EtcdRefusal::into_error)?;
                            self.quota_read(store, &txn, now_ms)?
                        }
                        Stage::LeaseGrant => {
                            let id = body.lease_id().map_err(EtcdRefusal::into_error)?;
                            let Some(w) = self.write.as_mut() else {
                                return Err(unusable("a lease without a write"));
                            };
                            // `lease_or_write` asks for the record's lease first.
                            if w.record.is_some() && w.lease == 0 {
                                store.remember_lease(w.window_end_ms, id);
                                w.lease = id;
                            } else if w.tombstone.is_some() && w.tomb_lease == 0 {
                                store.remember_lease(w.tomb_window_end_ms, id);
                                w.tomb_lease = id;
                            } else if let Some(lease_ms) = w.claim_lease_ms {
                                store.remember_claim_lease(lease_ms, w.grant_sent_ms, id);
                                w.claim_lease = id;
                            }
                            self.lease_or_write(store, now_ms)?
                        }
                        Stage::Write => {
                            let txn = body.txn().map_err(EtcdRefusal::into_error)?;
                            self.written(store, &txn, now_ms)?
                        }
                        Stage::Scan => {
                            let txn = body.txn().map_err(EtcdRefusal::into_error)?;
                            self.scanned(store, &txn)?
                        }
                        Stage::Labels => {
                            let txn = body.txn().map_err(EtcdRefusal::into_error)?;
                            self.labelled(store, &txn)?
                        }
                        Stage::RenewLease => {
                            let id = body.lease_id().map_err(EtcdRefusal::into_error)?;
                            self.renew_lease_granted(store, id, now_ms)?
                        }
                        Stage::Renew => {
                            let txn = body.txn().map_err(EtcdRefusal::into_error)?;
                            self.renewed(store, &txn, now_ms)?
                        }
                        Stage::TombstoneRead => {
                            let range = body.range().map_err(EtcdRefusal::into_error)?;
                            self.tombstone_read(store, &range, now_ms)?
                        }
                        Stage::Start | Stage::Finished => return Err(unusable("no call was made")),
                    },
                }
            }
        };
        match next {
            Move::Call(call, stage) => self.call(store, call, stage, now_ms),
            done => Ok(self.finish(Ok(done))),
        }
    }

    /// Sends a call for the operation, authenticating first when there is no token yet.
    fn call(
        &mut self,
        store: &EtcdStore,
        call: wire::Call,
        stage: Stage,
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        self.stage = stage;
        self.pending = Some(call);
        self.send(store, now_ms)
    }

    fn first(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Move, StoreError> {
        match &self.op {
            StoreOp::Begin(a) => match store.cached_answer(a) {
                // A completed record this worker saw and that has not expired: it cannot have
                // changed (cache.rs), so etcd would answer the same.
                Some(answer) => Ok(Move::Begun(answer)),
                None => {
                    let a = a.clone();
                    self.new_claim(store, &a, now_ms)
                }
            },
            StoreOp::Complete { claim, completion } => {
                if completion.state == State::Processing {
                    return Err(StoreError::Corrupt("a completion must carry an outcome state".into()));
                }
                self.settle_or_read(store, *claim, now_ms)
            }
            StoreOp::Release(claim) => self.settle_or_read(store, *claim, now_ms),
            StoreOp::Renew(_) => self.start_renew(store, now_ms),
            StoreOp::Records(query) => {
                let query = query.clone();
                self.start_scan(store, query)
            }
            StoreOp::Amend { view, change, now_ms: at } => {
                let (view, change, at) = (view.clone(), change.clone(), *at);
                self.start_amend(store, &view, &change, at)
            }
        }
    }

    /// A settlement of a claim whose record is known (`Claim::written`, as this store's begin
    /// wrote it) is one transaction guarded by the claim's revision: while it holds, the record
    /// is exactly that write. Otherwise the record is read first.
    fn settle_or_read(&mut self, store: &EtcdStore, claim: Claim, now_ms: u64) -> Result<Move, StoreError> {
        if let (StoreOp::Release(_), UNANSWERED, Some(e)) = (&self.op, claim.locator, claim.written) {
            if e.owner == claim.owner && e.scope == claim.scope {
                let write = Write::new(Guard::Owner(claim.owner), None, store.index_keys(&e), Won::Settled);
                return self.plan(write, store, now_ms);
            }
        }
        match (claim.written, i64::try_from(claim.locator)) {
            (Some(e), Ok(revision))
                if e.owner == claim.owner && e.scope == claim.scope && !e.is_completed() =>
            {
                self.settle(store, e, Guard::ModRevision(revision), now_ms)
            }
            _ => Ok(Move::Call(
                wire::range(store.protocol(), &store.record_key(&claim.scope)),
                Stage::SettleRead,
            )),
        }
    }

    /// The claim of a new record, in one transaction guarded by "the record is absent": if it
    /// is, it puts the record, its index keys and its lease key (and reads a charged attempt's
    /// live indexes, the new keys included: `claimed_new`); if not, it reads the record and
    /// its lease key (`existing`), so that a replay, a mismatch or a 409 is one round trip and
    /// never reads the quota. The leases the puts name are granted first when this worker has
    /// none for them yet.
    fn new_claim(&mut self, store: &EtcdStore, a: &ClaimAttempt, now_ms: u64) -> Result<Move, StoreError> {
        let entry = charged_entry(a);
        let leases_known = store.lease_for(window_end(entry.expires_at_ms), now_ms).is_some()
            && store.claim_lease_for(a.lease_ms, now_ms).is_some();
        if !leases_known && !self.probed {
            // A grant is due (once per worker and window): read first, so that a begin
            // answered by an existing record (a replay) never waits for grants. The claim's
            // transaction follows the grants only for an absent record.
            let record = store.record_key(&a.scope);
            let mut existing = vec![
                TxnOp::Range { key: record.clone(), range_end: None, limit: 0, keys_only: false },
                TxnOp::Range { key: store.lease_key(&a.scope), range_end: None, limit: 0, keys_only: false },
            ];
            // A rule that keeps tombstones: absent means the record and its tombstone.
            let tomb = store.tombstone_key(&a.scope);
            let mut guards = vec![(record.as_slice(), Guard::Absent)];
            if a.tombstone_ms > 0 {
                guards.push((tomb.as_slice(), Guard::Absent));
                existing.push(TxnOp::Range {
                    key: tomb.clone(),
                    range_end: None,
                    limit: 0,
                    keys_only: false,
                });
            }
            let body = wire::txn_all(store.protocol(), &guards, &[], &existing);
            return Ok(Move::Call(body, Stage::Probe));
        }
        let value = record::encode_slot(&SlotValue { entry, snapshot: None, label: None });
        let mut write = Write::new(Guard::Absent, Some((entry, value)), Vec::new(), Won::Claimed);
        write.claim_lease_ms = Some(a.lease_ms);
        write.tomb_guard = (a.tombstone_ms > 0).then_some(Guard::Absent);
        self.plan(write, store, now_ms)
    }

    /// A new claim's transaction found the record (its failure branch: the record, then its
    /// lease key): decide as a read of it.
    fn existing(
        &mut self,
        store: &EtcdStore,
        txn: &wire::TxnAnswer,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let StoreOp::Begin(a) = self.op.clone() else { return Err(unusable("not a begin")) };
        let mut ranges = txn.ranges.iter();
        let record_kv = ranges.next().and_then(|found| found.kvs.first());
        let lease_key_owner =
            ranges.next().and_then(|found| found.kvs.first()).and_then(|kv| owner_of(&kv.value));
        // A rule that keeps tombstones read the scope's third: what stands of an ended record.
        let tomb = if a.tombstone_ms > 0 { buried(ranges.next(), &a.scope)? } else { Buried::NotRead };
        let Some(kv) = record_kv else {
            // No record: the guard failed on the tombstone.
            if let Some(t) = tomb.standing(a.now_ms) {
                return Ok(Move::Begun(t.answer(&a.fingerprint)));
            }
            if !tomb.exists() {
                return Err(unusable("etcd's answer lacks the record read"));
            }
            // One that ended by this clock, before its lease collected it: replaced.
            let pending = PendingClaim {
                guard: Guard::Absent,
                replaced: None,
                won: Won::Claimed,
                tomb_guard: tomb.guard(),
                drop_tombstone: true,
            };
            return self.claim_or_count(store, &a, pending, now_ms);
        };
        let existing = decode(&kv.value)?;
        let e = existing.entry;
        if e.scope != a.scope {
            return Err(StoreError::Corrupt("a record under another scope's key".into()));
        }
        let now = a.now_ms;
        // Kept for the next begins of this scope (completed and live only; any fingerprint:
        // the cache answers a mismatch as etcd would).
        store.keep_completed(e, existing.snapshot.as_ref(), now);
        // The claim's lease key lives while its processing lease runs by etcd's clock: an Envoy
        // whose clock runs ahead of the owner's must not take it over early. (A claim written
        // without one, by an older build, is judged by its deadline alone.)
        let lease_running = !e.is_completed() && lease_key_owner == Some(e.owner);
        let guard = Guard::ModRevision(kv.mod_revision);
        let pending = if e.is_expired(now) && !lease_running {
            // Expired: absent, whatever etcd still holds until the lease collects it, unless its
            // tombstone still stands.
            if let Some(t) = tomb.standing(now) {
                return Ok(Move::Begun(t.answer(&a.fingerprint)));
            }
            let drop_tombstone = tomb.exists();
            PendingClaim {
                guard,
                replaced: Some(e),
                won: Won::Claimed,
                tomb_guard: tomb.guard(),
                drop_tombstone,
            }
        } else if e.fingerprint != a.fingerprint {
            return Ok(Move::Begun(Begin::Mismatch));
        } else if e.is_completed() {
            let answer = completed_answer(&e, existing.snapshot);
            return Ok(Move::Begun(answer.unwrap_or(Begin::NotStored { status: e.status })));
        } else if now < e.lease_deadline_ms {
            return Ok(Move::Begun(Begin::InFlight { retry_after_ms: e.lease_deadline_ms - now }));
        } else if lease_running {
            return Ok(Move::Begun(Begin::InFlight { retry_after_ms: LIVE_CLAIM_RETRY_MS }));
        } else {
            match a.on_lease_end {
                // The lease ended without an outcome, and the caller's lookup decides: nothing
                // is written until the upstream has said what happened.
                OnLeaseEnd::Report => return Ok(Move::Begun(Begin::Unsettled)),
                // The lease ended without an outcome, and such a request never executes twice:
                // the record is completed as outcome unknown where it is, guarded by the
                // revision just read (lost to another writer: read again).
                OnLeaseEnd::MarkUnknown => {
                    let unknown = Completion::outcome_unknown(a.now_ms, a.ttl_ms);
                    let (done, value) = outcome_record(e, &unknown);
                    let mut write =
                        Write::new(guard, Some((done, value)), store.index_keys(&e), Won::MarkedUnknown);
                    write.tombstone =
                        (a.tombstone_ms > 0).then(|| Tombstone::of(&done, a.now_ms, a.tombstone_ms));
                    return self.plan(write, store, now_ms);
                }
                // The lease ended without an outcome: take the record over.
                OnLeaseEnd::TakeOver => PendingClaim {
                    guard,
                    replaced: Some(e),
                    won: Won::TookOver,
                    tomb_guard: None,
                    drop_tombstone: false,
                },
            }
        };
        self.claim_or_count(store, &a, pending, now_ms)
    }

    /// Claims as `pending` plans, reading the quota first when the attempt is charged.
    fn claim_or_count(
        &mut self,
        store: &EtcdStore,
        a: &ClaimAttempt,
        pending: PendingClaim,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let guard = pending.guard;
        if a.quota.is_none() {
            return self.claim(store, a, pending, &[], now_ms);
        }
        // The quota is read only now that a claim is to be made, guarded by the revision just
        // read (the rare path: a third round trip).
        self.pending_claim = Some(pending);
        let body = wire::txn(
            store.protocol(),
            Some((&store.record_key(&a.scope), guard)),
            &quota_reads(store, a),
            &[],
        );
        Ok(Move::Call(body, Stage::QuotaRead))
    }

    pub(super) fn read_again(
        &mut self,
        store: &EtcdStore,
        a: &ClaimAttempt,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        self.attempts += 1;
        if self.attempts >= TXN_ATTEMPTS {
            return Err(StoreError::Contention);
        }
        self.write = None;
        self.new_claim(store, a, now_ms)
    }

    /// Plans the guarded write that claims the record, unless a quota (its live index ranges,
    /// in `quota_reads` order) refuses it.
    pub(super) fn claim(
        &mut self,
        store: &EtcdStore,
        a: &ClaimAttempt,
        pending: PendingClaim,
        quota: &[wire::RangeAnswer],
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let entry = charged_entry(a);
        // A takeover (whose claim stopped counting when its lease ended, exactly when a
        // takeover becomes possible) or a reuse: charged, within the bounds.
        if let Some(refusal) = quota_refusal(a, quota, None)? {
            return Ok(Move::Begun(refusal));
        }
        let stale_index = pending.replaced.map(|old| store.index_keys(&old)).unwrap_or_default();
        let value = record::encode_slot(&SlotValue { entry, snapshot: None, label: None });
        let mut write = Write::new(pending.guard, Some((entry, value)), stale_index, pending.won);
        write.claim_lease_ms = Some(a.lease_ms);
        write.tomb_guard = pending.tomb_guard;
        write.drop_tombstone = pending.drop_tombstone;
        self.plan(write, store, now_ms)
    }

    fn settle_read(
        &mut self,
        store: &EtcdStore,
        found: &wire::RangeAnswer,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let claim: Claim = match &self.op {
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => *claim,
            _ => return Err(unusable("not a settlement")),
        };
        // The claim's put is the record's last write while the claim holds it: any other
        // revision means it was taken over, completed, released or replaced.
        let Some(kv) = found.kvs.first() else { return Ok(Move::Settled(Settled::Lost)) };
        if u64::try_from(kv.mod_revision).ok() != Some(claim.locator) {
            // A completion sent again (the worker retries one whose answer never came) may find
            // its own earlier write.
            let landed = holds_own_outcome(&self.op, &kv.value);
            return Ok(Move::Settled(if landed { Settled::Done } else { Settled::Lost }));
        }
        let current = decode(&kv.value)?.entry;
        if current.owner != claim.owner || current.scope != claim.scope || current.is_completed() {
            return Ok(Move::Settled(Settled::Lost));
        }
        self.settle(store, current, Guard::ModRevision(kv.mod_revision), now_ms)
    }

    /// The guarded write that settles the claim whose record is `current` (while `guard`
    /// holds): its outcome and the index keys moved to its expiry, or its deletion.
    pub(super) fn settle(
        &mut self,
        store: &EtcdStore,
        current: Entry,
        guard: Guard,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let stale_index = store.index_keys(&current);
        let write = match &self.op {
            StoreOp::Complete { claim, completion } => {
                let (done, value) = outcome_record(current, completion);
                let mut write = Write::new(guard, Some((done, value)), stale_index, Won::Settled);
                write.tombstone = (claim.tombstone_s > 0)
                    .then(|| Tombstone::of(&done, completion.now_ms, claim.tombstone_ms()));
                // An operator's resolve: the tombstone the record left, if any, says the status
                // it now replays (its end kept), as it stood when read.
                if let Some(read) = self.resolved_tombstone.take() {
                    write.tomb_guard = read.guard();
                    if let Buried::Standing(t, _) = read {
                        write.tombstone = Some(Tombstone { status: done.status, ..t });
                    }
                }
                write
            }
            _ => {
                let mut write = Write::new(guard, None, stale_index, Won::Settled);
                // An operator's release: the next request executes, which a tombstone would refuse.
                write.drop_tombstone = self.amending.is_some();
                write
            }
        };
        self.plan(write, store, now_ms)
    }

    fn plan(&mut self, write: Write, store: &EtcdStore, now_ms: u64) -> Result<Move, StoreError> {
        self.write = Some(write);
        self.lease_or_write(store, now_ms)
    }

    pub(super) fn write_call(&self, store: &EtcdStore) -> Result<Move, StoreError> {
        let Some(w) = &self.write else { return Err(unusable("no write planned")) };
        let scope = match &self.op {
            StoreOp::Begin(a) => a.scope,
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => claim.scope,
            StoreOp::Records(_) | StoreOp::Amend { .. } | StoreOp::Renew(_) => {
                return Err(unusable("not a write"))
            }
        };
        let key = store.record_key(&scope);
        let fresh_index = w.record.as_ref().map(|(entry, _)| store.index_keys(entry)).unwrap_or_default();
        // etcd refuses a transaction that names one key twice; a stale key that is also fresh
        // (same `until`) is simply put again.
        let mut ops: Vec<TxnOp> = w
            .stale_index
            .iter()
            .filter(|k| !fresh_index.contains(k))
            .map(|k| TxnOp::Delete { key: k.clone() })
            .collect();
        match &w.record {
            Some((entry, value)) => {
                ops.push(TxnOp::Put { key: key.clone(), value: value.clone(), lease: w.lease });
                for index in fresh_index {
                    // Index keys carry the record's lease: they disappear with it.
                    ops.push(TxnOp::Put { key: index, value: Vec::new(), lease: w.lease });
                }
                if w.claim_lease != 0 {
                    let value = entry.owner.to_be_bytes().to_vec();
                    ops.push(TxnOp::Put { key: store.lease_key(&scope), value, lease: w.claim_lease });
                    // A claim's label, for operators: a key of its own (record::encode_label),
                    // on the record's lease. A completion leaves it; a completion that moves the
                    // record to a later window's lease may outlive it by that window, and then
                    // shows without route and key for its last seconds.
                    if let StoreOp::Begin(ClaimAttempt { label: Some(label), now_ms, .. }) = &self.op {
                        let value = record::encode_label(&label.clone().created_at(*now_ms));
                        ops.push(TxnOp::Put { key: store.label_key(&scope), value, lease: w.lease });
                    }
                }
            }
            None => {
                ops.push(TxnOp::Delete { key: key.clone() });
                ops.push(TxnOp::Delete { key: store.lease_key(&scope) });
                ops.push(TxnOp::Delete { key: store.label_key(&scope) });
            }
        }
        let tomb_key = store.tombstone_key(&scope);
        if let Some(t) = &w.tombstone {
            ops.push(TxnOp::Put { key: tomb_key.clone(), value: t.encode(), lease: w.tomb_lease });
        } else if w.drop_tombstone {
            ops.push(TxnOp::Delete { key: tomb_key.clone() });
        }
        // A completion whose guard fails reads the record in the same call: an earlier try's
        // write may have landed after this try's read (`holds_own_outcome`).
        let on_failure = match (&self.op, w.guard) {
            (StoreOp::Complete { .. }, _) => {
                vec![TxnOp::Range { key: key.clone(), range_end: None, limit: 0, keys_only: false }]
            }
            // A new claim that finds the record reads it and its lease key instead (and its
            // tombstone, on a rule that keeps one).
            (StoreOp::Begin(a), Guard::Absent) => {
                let mut read = vec![
                    TxnOp::Range { key: key.clone(), range_end: None, limit: 0, keys_only: false },
                    TxnOp::Range {
                        key: store.lease_key(&scope),
                        range_end: None,
                        limit: 0,
                        keys_only: false,
                    },
                ];
                if a.tombstone_ms > 0 {
                    read.push(TxnOp::Range {
                        key: tomb_key.clone(),
                        range_end: None,
                        limit: 0,
                        keys_only: false,
                    });
                }
                read
            }
            _ => Vec::new(),
        };
        if let (StoreOp::Begin(a), Guard::Absent) = (&self.op, w.guard) {
            // After the puts: the count includes the new index keys (a transaction's reads see
            // its earlier writes), the first two keys hold the soonest other one.
            ops.extend(quota_reads(store, a));
        }
        // An unanswered claim's release compares its lease key, the one key that says whose it is.
        let guarded = if let Guard::Owner(_) = w.guard { store.lease_key(&scope) } else { key };
        let mut guards = vec![(guarded.as_slice(), w.guard)];
        if let Some(guard) = w.tomb_guard {
            guards.push((tomb_key.as_slice(), guard));
        }
        let lease_key = store.lease_key(&scope);
        if self.amend_after_lease_key.is_some() {
            // An operator's change waits for the claim's lease key as a takeover does: made
            // only once it is gone; else its failure branch reads it (`written`: live).
            guards.push((lease_key.as_slice(), Guard::Absent));
            let read = [
                TxnOp::Range { key: guarded.clone(), range_end: None, limit: 0, keys_only: false },
                TxnOp::Range { key: lease_key.clone(), range_end: None, limit: 0, keys_only: true },
            ];
            return Ok(Move::Call(wire::txn_all(store.protocol(), &guards, &ops, &read), Stage::Write));
        }
        Ok(Move::Call(wire::txn_all(store.protocol(), &guards, &ops, &on_failure), Stage::Write))
    }

    fn written(&mut self, store: &EtcdStore, txn: &wire::TxnAnswer, now_ms: u64) -> Result<Move, StoreError> {
        let Some(w) = self.write.clone() else { return Err(unusable("no write planned")) };
        match (&self.op, txn.succeeded, w.won) {
            (StoreOp::Begin(_), true, Won::MarkedUnknown) => Ok(Move::Begun(Begin::OutcomeUnknown)),
            (StoreOp::Begin(a), true, won) => {
                let locator = u64::try_from(txn.revision).map_err(|_| unusable("a negative revision"))?;
                let written = w.record.as_ref().map(|(entry, _)| *entry);
                if let (Guard::Absent, Some(entry)) = (w.guard, written) {
                    let own = store.index_keys(&entry);
                    if let Some(refusal) = quota_refusal(a, &txn.ranges, Some((&entry, &own)))? {
                        // Over the bound: the claim is undone while it is still this write
                        // (the rare path: a third round trip).
                        return Ok(self.undo(store, entry, txn.revision, refusal));
                    }
                }
                let claim = Claim {
                    scope: a.scope,
                    owner: a.owner,
                    locator,
                    written,
                    shard: 0,
                    old_home: None,
                    tombstone_s: a.tombstone_s(),
                };
                Ok(Move::Begun(if won == Won::TookOver {
                    Begin::TookOver(claim)
                } else {
                    Begin::Claimed(claim)
                }))
            }
            (StoreOp::Begin(_), false, _) if w.guard == Guard::Absent => {
                // The record exists: the failure branch read it.
                self.existing(store, txn, now_ms)
            }
            // An operator's change found the record as the operator saw it, and the claim's lease
            // key still there: its request may be at work (its owner renews it), so nothing was
            // changed. (A record changed since is settled meanwhile, below.)
            (_, false, _)
                if self.amend_after_lease_key.is_some()
                    && unchanged(&w.guard, txn)
                    && lease_key_held(txn) =>
            {
                let deadline = self.amend_after_lease_key.unwrap_or(0);
                let at_the_earliest = deadline.max(now_ms.saturating_add(LIVE_CLAIM_RETRY_MS));
                Ok(Move::Amended(Err(Refusal::Live { lease_ends_at_ms: at_the_earliest })))
            }
            (StoreOp::Begin(a), false, _) => {
                // Another worker wrote the record between our read and our write: look again.
                let a = a.clone();
                self.read_again(store, &a, now_ms)
            }
            (StoreOp::Complete { completion, .. }, true, _) => {
                // The record as this write left it in etcd, read back from the bytes written
                // (the body may have been dropped to fit), so a replay here needs no round trip.
                if let Some((_, value)) = &w.record {
                    if store.replay.is_some() {
                        if let Ok(written) = record::decode_record(value) {
                            store.keep_completed(written.entry, written.snapshot.as_ref(), completion.now_ms);
                        }
                    }
                }
                Ok(Move::Settled(Settled::Done))
            }
            (_, true, _) => Ok(Move::Settled(Settled::Done)),
            // An unanswered claim that never landed, or is no longer its owner's: nothing of its
            // owner is left to give back.
            (StoreOp::Release(_), false, _) if matches!(w.guard, Guard::Owner(_)) => {
                Ok(Move::Settled(Settled::Done))
            }
            // The claim's revision moved between our read and our write: no longer ours,
            // unless what moved it was an earlier try of this same completion.
            (op, false, _) => {
                let landed = txn
                    .ranges
                    .first()
                    .and_then(|r| r.kvs.first())
                    .is_some_and(|kv| holds_own_outcome(op, &kv.value));
                Ok(Move::Settled(if landed { Settled::Done } else { Settled::Lost }))
            }
        }
    }
}

/// An operator's guarded change that failed: whether the record read back is still the revision
/// it was guarded by (its first read), and whether the claim's lease key exists (its second).
fn unchanged(guard: &Guard, txn: &wire::TxnAnswer) -> bool {
    let revision = txn.ranges.first().and_then(|r| r.kvs.first()).map(|kv| kv.mod_revision);
    matches!((guard, revision), (Guard::ModRevision(g), Some(r)) if *g == r)
}

fn lease_key_held(txn: &wire::TxnAnswer) -> bool {
    txn.ranges.get(1).is_some_and(|r| !r.kvs.is_empty())
}

/// True when `value` is the record as `op`, a completion, writes it: this claim's owner token
/// with this outcome. Owner tokens are unique per claim, so nobody else wrote it: the write of
/// an earlier try of the same completion landed.
fn holds_own_outcome(op: &StoreOp, value: &[u8]) -> bool {
    let StoreOp::Complete { claim, completion } = op else { return false };
    let Ok(current) = record::decode_record(value) else { return false };
    let e = current.entry;
    e.owner == claim.owner
        && e.scope == claim.scope
        && e.state == completion.state
        && e.status == completion.status
}

// Cloned only by the model checker (tests/etcd_model), which copies a worker's store and its
// conversations into each state it explores. Written out at the end of the file, so that no
// line of the code above moves: the module's panic locations, and so its bytes, stay the same.
#[cfg(feature = "testing")]
impl Clone for EtcdConversation {
    fn clone(&self) -> Self {
        EtcdConversation {
            op: self.op.clone(),
            stage: self.stage,
            pending: self.pending.clone(),
            fetching: self.fetching,
            awaiting: self.awaiting,
            sent_token: self.sent_token.clone(),
            reauthenticated: self.reauthenticated,
            lease_regranted: self.lease_regranted,
            attempts: self.attempts,
            write: self.write.clone(),
            pending_claim: self.pending_claim,
            refusal: self.refusal.clone(),
            probed: self.probed,
            unanswered: self.unanswered,
            scan: self.scan.clone(),
            amending: self.amending.clone(),
            renewing: self.renewing.clone(),
            amend_after_lease_key: self.amend_after_lease_key,
            resolving: self.resolving,
            resolved_tombstone: self.resolved_tombstone,
        }
    }
}
