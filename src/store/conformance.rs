//! The store contract (`store/mod.rs`), written once and run against every backend, like Envoy's
//! HTTP cache conformance suite. A backend provides a fresh store and two "workers" that share
//! it; `conformance_suite!` instantiates every test for it.

// A failing assertion is the suite's job; it never runs inside Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::store::record::{Label, LabelScope, Snapshot, State};
use crate::store::{
    Amendment, Begin, Claim, ClaimAttempt, Completion, Kept, OnLeaseEnd, QuotaCharge, RecordPage,
    RecordQuery, RecordStore, RecordView, Refusal, Renew, Settled, StoreError, StoreOp,
};

mod admin;
mod quota;
mod tombstones;
pub use admin::*;
pub use quota::*;
pub use tombstones::*;

pub const LEASE: u64 = 1_000;
pub const TTL: u64 = 10_000;

/// A store under test: `worker(0)` and `worker(1)` are two independent handles on one backing
/// store, as two Envoy worker threads would hold.
pub trait Backend {
    /// Whether the store has a capacity bound (the local store's fixed key space). A bounded
    /// store answers `Full` rather than evict a live record; an unbounded one (etcd) never
    /// refuses a new record for room. The cases about room state both.
    const BOUNDED: bool = true;
    /// Whether `sweep` is what reclaims expired records (and reports them). A store whose
    /// records are collected otherwise (etcd's leases) sweeps nothing; for every store, an
    /// expired record reads as absent, swept or not.
    const RECLAIMS_BY_SWEEP: bool = true;
    fn with_capacity(capacity: u32) -> Self;
    fn worker(&self, n: u8) -> Box<dyn RecordStore + '_>;
    /// Called before a case takes over a claim whose lease (`LEASE`) has ended in the
    /// attempts' clock. A store that also keeps the lease by a clock of its own (etcd's lease
    /// keys, so that Envoys with skewed clocks never take over early) lets that clock pass it.
    fn let_claim_leases_end(&self) {}
    /// Called where a case's clock passes most of a claim's lease (`LEASE`) and the renewal
    /// must be what keeps the claim: a store that keeps its leases by a clock of its own (etcd)
    /// lets that much of it pass, so that twice this outlives a claim's first lease there.
    fn let_part_of_a_claim_lease_pass(&self) {}
}

/// A worker that talks to its store only through `StoreOp`s and `StoreAnswer`s, the way the
/// engine does: every case checks the contract through the same conversation the filter has.
pub struct ThroughOps<'a>(Box<dyn RecordStore + 'a>);

pub fn through_ops<B: Backend>(b: &B, n: u8) -> ThroughOps<'_> {
    ThroughOps(b.worker(n))
}

impl RecordStore for ThroughOps<'_> {
    fn begin(&self, attempt: &ClaimAttempt) -> Result<Begin, StoreError> {
        StoreOp::Begin(attempt.clone()).perform(&*self.0).into_begun()
    }
    fn complete(&self, claim: &Claim, completion: &Completion) -> Result<Settled, StoreError> {
        (StoreOp::Complete { claim: *claim, completion: completion.clone() }).perform(&*self.0).into_settled()
    }
    fn release(&self, claim: &Claim) -> Result<Settled, StoreError> {
        StoreOp::Release(*claim).perform(&*self.0).into_settled()
    }
    fn sweep(&self, now_ms: u64) -> Result<u32, StoreError> {
        self.0.sweep(now_ms)
    }
    fn renew(&self, renew: &Renew) -> Result<Vec<Kept>, StoreError> {
        StoreOp::Renew(renew.clone()).perform(&*self.0).into_renewed()
    }
    fn records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        StoreOp::Records(query.clone()).perform(&*self.0).into_records()
    }
    fn amend(
        &self,
        view: &RecordView,
        change: &Amendment,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError> {
        let op = StoreOp::Amend { view: Box::new(view.clone()), change: change.clone(), now_ms };
        op.perform(&*self.0).into_amended()
    }
}

pub fn scope(n: u64) -> ScopeId {
    use sha2::{Digest, Sha256};
    ScopeId(Sha256::digest(n.to_be_bytes()).into())
}

pub fn attempt(scope_n: u64, fp: u8, owner: u64, now_ms: u64) -> ClaimAttempt {
    ClaimAttempt {
        scope: scope(scope_n),
        fingerprint: Fingerprint([fp; 32]),
        owner,
        now_ms,
        lease_ms: LEASE,
        ttl_ms: TTL,
        quota: None,
        on_lease_end: OnLeaseEnd::TakeOver,
        // Every conformance record carries its label, as the filter's do.
        label: Some(label_in(None, &format!("key-{scope_n}"))),
        tombstone_ms: 0,
    }
}

/// A label as the filter writes it: route `orders`, `key`, a POST to api.example/orders by one
/// caller, of `tenant` if any.
pub fn label_in(tenant: Option<&str>, key: &str) -> Label {
    let values: Vec<&[u8]> = tenant.iter().map(|t| t.as_bytes()).collect();
    let scope = LabelScope {
        method: "POST",
        host: b"api.example",
        path: "/orders",
        tenant: tenant.map(|_| values.as_slice()),
        principal: &[7; 32],
    };
    Label::scoped("orders", key, &scope)
}

/// An attempt charged to principal `principal` (and tenant `tenant`, if any) with these bounds.
pub fn charged(
    scope_n: u64,
    owner: u64,
    now_ms: u64,
    principal: u8,
    tenant: Option<u8>,
    bounds: (u32, u32),
) -> ClaimAttempt {
    ClaimAttempt {
        quota: Some(QuotaCharge {
            tenant: tenant.map(|t| [t; 32]),
            principal: Some([principal; 32]),
            per_tenant: bounds.0,
            per_principal: bounds.1,
        }),
        ..attempt(scope_n, 1, owner, now_ms)
    }
}

pub fn snapshot(tag: &str) -> Snapshot {
    Snapshot {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("x-tag".into(), tag.as_bytes().to_vec()),
        ],
        body: format!("{{\"order\":\"{tag}\"}}").into_bytes(),
    }
}

pub fn done(tag: &str, now_ms: u64) -> Completion {
    Completion { state: State::Succeeded, status: 201, snapshot: Some(snapshot(tag)), now_ms, ttl_ms: TTL }
}

/// Renews `claims` for another `LEASE` from `now_ms` as the worker does: each shard's parts in a
/// renewal of their own. Per claim: renewed on every part, or what a part found instead.
pub fn renew_all(w: &dyn RecordStore, claims: &[&Claim], now_ms: u64) -> Vec<Kept> {
    let parts: Vec<(usize, crate::store::Renewal)> =
        claims.iter().enumerate().flat_map(|(i, c)| c.renewals().map(move |r| (i, r))).collect();
    let mut kept = vec![Kept::Renewed; claims.len()];
    let mut shards: Vec<u8> = parts.iter().map(|(_, r)| r.shard).collect();
    shards.sort_unstable();
    shards.dedup();
    for shard in shards {
        let here: Vec<&(usize, crate::store::Renewal)> =
            parts.iter().filter(|(_, r)| r.shard == shard).collect();
        let renew = Renew { claims: here.iter().map(|(_, r)| *r).collect(), lease_ms: LEASE, now_ms };
        for ((i, _), k) in here.iter().zip(w.renew(&renew).unwrap()) {
            if kept[*i] == Kept::Renewed {
                kept[*i] = k;
            }
        }
    }
    kept
}

/// A claim whose owner is still at work, renewed before its lease ends, is still in flight past
/// that lease, by the store's own clock too (etcd's lease keys): nobody takes it over, refuses
/// it or looks it up, whatever the rule, and its owner's completion lands.
pub fn a_renewed_claim_stays_its_owners_past_its_first_lease<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    b.let_part_of_a_claim_lease_pass();
    // A handle of its own, as an owner's worker whose leases were granted long before (etcd).
    let owner = through_ops(&b, 0);
    assert_eq!(renew_all(&owner, &[&c], LEASE * 3 / 4), vec![Kept::Renewed]);
    b.let_part_of_a_claim_lease_pass();
    for on_lease_end in [OnLeaseEnd::TakeOver, OnLeaseEnd::MarkUnknown, OnLeaseEnd::Report] {
        let retry = ClaimAttempt { on_lease_end, ..attempt(1, 1, 12, LEASE + LEASE / 2) };
        let answer = w1.begin(&retry).unwrap();
        assert!(matches!(answer, Begin::InFlight { .. }), "{on_lease_end:?}: {answer:?}");
    }
    assert_eq!(w0.complete(&c, &done("long", LEASE + LEASE / 2 + 1)).unwrap(), Settled::Done);
    assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE * 2)).unwrap(), Begin::Replay(snapshot("long")));
}

/// A renewal answers per claim: kept while the claim is its owner's, not once it is completed,
/// released or taken over; and what is no longer the claim's it leaves as it is.
pub fn a_renewal_keeps_only_the_claims_still_their_owners<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let live = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    let completed = claimed(w0.begin(&attempt(2, 1, 12, 0)).unwrap());
    let released = claimed(w0.begin(&attempt(3, 1, 13, 0)).unwrap());
    assert_eq!(w0.complete(&completed, &done("done", 1)).unwrap(), Settled::Done);
    assert_eq!(w0.release(&released).unwrap(), Settled::Done);
    assert_eq!(
        renew_all(&w0, &[&live, &completed, &released], LEASE / 2),
        vec![Kept::Renewed, Kept::Settled, Kept::Settled]
    );
    assert_eq!(w1.begin(&attempt(2, 1, 14, LEASE / 2)).unwrap(), Begin::Replay(snapshot("done")));
    assert!(matches!(w1.begin(&attempt(3, 1, 15, LEASE / 2)).unwrap(), Begin::Claimed(_)));
    assert!(matches!(w1.begin(&attempt(1, 1, 16, LEASE + LEASE / 4)).unwrap(), Begin::InFlight { .. }));
    // Taken over once nobody renewed it: the old owner's renewal changes nothing, and says so.
    let abandoned = claimed(w0.begin(&attempt(4, 1, 17, 0)).unwrap());
    b.let_claim_leases_end();
    let taken = claimed(w1.begin(&attempt(4, 1, 18, LEASE)).unwrap());
    assert_eq!(renew_all(&w0, &[&abandoned], LEASE + 1), vec![Kept::TakenOver]);
    assert_eq!(w1.complete(&taken, &done("new", LEASE + 2)).unwrap(), Settled::Done);
    assert_eq!(w0.begin(&attempt(4, 1, 19, LEASE + 3)).unwrap(), Begin::Replay(snapshot("new")));
}

/// A claim whose owner stopped renewing it (its client left, its Envoy died) ends one lease
/// after its last renewal, as any claim ends one lease after it was made.
pub fn a_claim_no_longer_renewed_ends_a_lease_after_its_last_renewal<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(renew_all(&w0, &[&c], LEASE / 2), vec![Kept::Renewed]);
    assert!(matches!(w1.begin(&attempt(1, 1, 12, LEASE / 2 + LEASE - 1)).unwrap(), Begin::InFlight { .. }));
    b.let_claim_leases_end();
    assert!(matches!(w1.begin(&attempt(1, 1, 13, LEASE / 2 + LEASE)).unwrap(), Begin::TookOver(_)));
    assert_eq!(w0.complete(&c, &done("old", LEASE * 2)).unwrap(), Settled::Lost);
}

/// A renewal never keeps a claim past its record's expiry (`ttl`): a request Envoy forgot cannot
/// hold its key longer than any record lives.
pub fn a_renewal_never_outlives_the_record<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(renew_all(&w0, &[&c], TTL - LEASE / 2), vec![Kept::Renewed]);
    b.let_claim_leases_end();
    assert!(matches!(w1.begin(&attempt(1, 1, 12, TTL)).unwrap(), Begin::Claimed(_)));
}

/// C24, C25: an operator's release waits for the request that may still be at work, by the rule a
/// takeover follows: a claim its owner renews, and an unknown outcome recorded the moment its
/// route timed out (a `refuse` rule) while its claim's lease still ran, are refused as live until
/// that lease ends (on etcd, until its lease key does); then they are released.
pub fn an_operator_waits_for_a_request_that_may_still_be_at_work<B: Backend>() {
    let b = B::with_capacity(64);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    let look = |n: u64, now_ms: u64| only(&admin, n, now_ms);
    let release = Amendment::Release { force: false };
    let unknown = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w.complete(&unknown, &Completion::outcome_unknown(LEASE / 5, TTL)).unwrap(), Settled::Done);
    let renewed = claimed(w.begin(&attempt(2, 1, 12, 0)).unwrap());
    assert_eq!(renew_all(&w, &[&renewed], LEASE / 2), vec![Kept::Renewed]);
    // Its upstream may be at work: not released, forced or not (a resolve, which executes
    // nothing, is the operator's to make: the suite's resolve cases).
    let now = LEASE / 5 + 1;
    for change in [release.clone(), Amendment::Release { force: true }] {
        let refused = admin.amend(&look(1, now), &change, now).unwrap();
        assert!(matches!(refused, Err(Refusal::Live { .. })), "{change:?}: {refused:?}");
    }
    let past_first_lease = LEASE + 1;
    let refused = admin.amend(&look(2, past_first_lease), &release, past_first_lease).unwrap();
    assert!(matches!(refused, Err(Refusal::Live { .. })), "{refused:?}");
    // Once the leases ended: released, and the next request executes.
    b.let_claim_leases_end();
    let later = LEASE * 2;
    assert_eq!(admin.amend(&look(1, later), &release, later).unwrap(), Ok(()));
    assert_eq!(admin.amend(&look(2, later), &release, later).unwrap(), Ok(()));
    assert!(matches!(w.begin(&attempt(1, 1, 13, later + 1)).unwrap(), Begin::Claimed(_)));
    assert!(matches!(w.begin(&attempt(2, 1, 14, later + 1)).unwrap(), Begin::Claimed(_)));
}

pub fn claimed(b: Begin) -> Claim {
    match b {
        Begin::Claimed(c) | Begin::TookOver(c) => c,
        other => panic!("expected a claim, got {other:?}"),
    }
}

pub fn first_claim_then_in_flight<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w1.begin(&attempt(1, 1, 12, 400)).unwrap(), Begin::InFlight { retry_after_ms: 600 });
}

pub fn completed_record_replays_byte_for_byte<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w0.complete(&c, &done("a", 10)).unwrap(), Settled::Done);
    assert_eq!(w1.begin(&attempt(1, 1, 12, 20)).unwrap(), Begin::Replay(snapshot("a")));
    assert_eq!(w0.begin(&attempt(1, 1, 13, 30)).unwrap(), Begin::Replay(snapshot("a")));
}

pub fn different_fingerprint_is_a_mismatch_and_changes_nothing<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w.begin(&attempt(1, 2, 12, 1)).unwrap(), Begin::Mismatch);
    w.complete(&c, &done("a", 10)).unwrap();
    assert_eq!(w.begin(&attempt(1, 2, 13, 20)).unwrap(), Begin::Mismatch);
    assert_eq!(w.begin(&attempt(1, 1, 14, 30)).unwrap(), Begin::Replay(snapshot("a")));
}

pub fn failed_final_replays_too<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    let s = Snapshot { status: 400, headers: vec![], body: b"bad".to_vec() };
    let completion = Completion {
        state: State::FailedFinal,
        status: 400,
        snapshot: Some(s.clone()),
        now_ms: 5,
        ttl_ms: TTL,
    };
    w.complete(&c, &completion).unwrap();
    assert_eq!(w.begin(&attempt(1, 1, 12, 6)).unwrap(), Begin::Replay(s));
}

pub fn release_lets_the_next_request_execute<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w0.release(&c).unwrap(), Settled::Done);
    assert!(matches!(w1.begin(&attempt(1, 1, 12, 1)).unwrap(), Begin::Claimed(_)));
    // Releasing again is a no-op for a claim that is gone.
    assert_eq!(w0.release(&c).unwrap(), Settled::Lost);
}

pub fn expired_lease_is_taken_over_and_the_old_owner_cannot_write<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let old = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    b.let_claim_leases_end();
    let taken = w1.begin(&attempt(1, 1, 12, LEASE)).unwrap();
    assert!(matches!(taken, Begin::TookOver(_)), "{taken:?}");
    let new = claimed(taken);
    assert_eq!(w0.complete(&old, &done("old", LEASE + 1)).unwrap(), Settled::Lost);
    assert_eq!(w0.release(&old).unwrap(), Settled::Lost);
    assert_eq!(
        w1.begin(&attempt(1, 1, 13, LEASE + 2)).unwrap(),
        Begin::InFlight { retry_after_ms: LEASE - 2 }
    );
    assert_eq!(w1.complete(&new, &done("new", LEASE + 3)).unwrap(), Settled::Done);
    assert_eq!(w0.begin(&attempt(1, 1, 14, LEASE + 4)).unwrap(), Begin::Replay(snapshot("new")));
    assert_eq!(w0.complete(&old, &done("old", LEASE + 5)).unwrap(), Settled::Lost);
    assert_eq!(w0.begin(&attempt(1, 1, 15, LEASE + 6)).unwrap(), Begin::Replay(snapshot("new")));
}

/// A rule with `unknown_outcome: "refuse"` (`OnLeaseEnd::MarkUnknown`): a claim whose lease ends
/// without an outcome (its Envoy died, its completion was never written) becomes an unknown
/// outcome at the first begin after the lease, on every worker, and is never taken over.
pub fn a_refused_lease_end_is_an_unknown_outcome_never_executed_again<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let refusing = |fp: u8, owner: u64, now: u64| ClaimAttempt {
        on_lease_end: OnLeaseEnd::MarkUnknown,
        ..attempt(1, fp, owner, now)
    };
    let old = claimed(w0.begin(&refusing(1, 11, 0)).unwrap());
    // Within the lease: in flight, as on any rule.
    assert!(matches!(w1.begin(&refusing(1, 12, LEASE - 1)).unwrap(), Begin::InFlight { .. }));
    b.let_claim_leases_end();
    // After it: an unknown outcome, never a takeover, on every worker, and whatever the rule
    // of a later request (the record is completed now).
    assert_eq!(w1.begin(&refusing(1, 13, LEASE)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(w0.begin(&refusing(1, 14, LEASE + 1)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(w0.begin(&attempt(1, 1, 15, LEASE + 2)).unwrap(), Begin::OutcomeUnknown);
    // Another payload is a mismatch; the old owner's late outcome is lost.
    assert_eq!(w1.begin(&refusing(2, 16, LEASE + 3)).unwrap(), Begin::Mismatch);
    assert_eq!(w0.complete(&old, &done("late", LEASE + 4)).unwrap(), Settled::Lost);
    assert_eq!(w0.release(&old).unwrap(), Settled::Lost);
    // Kept for the ttl from when the lease end was refused.
    assert_eq!(w1.begin(&refusing(1, 17, LEASE + TTL - 1)).unwrap(), Begin::OutcomeUnknown);
    assert!(matches!(w1.begin(&refusing(1, 18, LEASE + TTL)).unwrap(), Begin::Claimed(_)));
}

/// A rule with `reconcile` (`OnLeaseEnd::Report`): a claim whose lease ends without an
/// outcome is answered `Unsettled` and left exactly as it is, on every worker, until a request
/// that asked the upstream takes it over (`ClaimAttempt::after_lookup`) to write the lookup's
/// answer or to execute; from then on it is a record like any other.
pub fn a_reconciled_lease_end_is_unsettled_until_a_lookup_takes_it_over<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let reconciling = |fp: u8, owner: u64, now: u64| ClaimAttempt {
        on_lease_end: OnLeaseEnd::Report,
        ..attempt(1, fp, owner, now)
    };
    let old = claimed(w0.begin(&reconciling(1, 11, 0)).unwrap());
    assert!(matches!(w1.begin(&reconciling(1, 12, LEASE - 1)).unwrap(), Begin::InFlight { .. }));
    b.let_claim_leases_end();
    // Unsettled, as often as asked, and nothing written: another payload is still a mismatch.
    assert_eq!(w1.begin(&reconciling(1, 13, LEASE)).unwrap(), Begin::Unsettled);
    assert_eq!(w0.begin(&reconciling(1, 14, LEASE + 1)).unwrap(), Begin::Unsettled);
    assert_eq!(w1.begin(&reconciling(2, 15, LEASE + 2)).unwrap(), Begin::Mismatch);
    // Two lookups answered at once: one takes the record over, the other finds it in flight.
    let adopted = match w1.begin(&reconciling(1, 16, LEASE + 3).after_lookup(LEASE + 3)).unwrap() {
        Begin::TookOver(claim) => claim,
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert!(matches!(
        w0.begin(&reconciling(1, 17, LEASE + 3).after_lookup(LEASE + 4)).unwrap(),
        Begin::InFlight { .. }
    ));
    // The lookup's answer becomes the outcome; the old owner's late one is lost.
    assert_eq!(w1.complete(&adopted, &done("found", LEASE + 5)).unwrap(), Settled::Done);
    assert_eq!(w0.complete(&old, &done("late", LEASE + 6)).unwrap(), Settled::Lost);
    assert_eq!(w0.begin(&reconciling(1, 18, LEASE + 7)).unwrap(), Begin::Replay(snapshot("found")));
}

pub fn expired_lease_with_another_payload_is_still_a_mismatch<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w.begin(&attempt(1, 2, 12, LEASE * 2)).unwrap(), Begin::Mismatch);
}

pub fn records_expire_after_their_ttl<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    w.complete(&c, &done("a", 100)).unwrap();
    assert_eq!(w.begin(&attempt(1, 1, 12, 100 + TTL - 1)).unwrap(), Begin::Replay(snapshot("a")));
    assert!(matches!(w.begin(&attempt(1, 2, 13, 100 + TTL)).unwrap(), Begin::Claimed(_)));
}

pub fn outcome_without_body_is_never_executed_again<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    let completion =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 1, ttl_ms: TTL };
    w.complete(&c, &completion).unwrap();
    assert_eq!(w.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::NotStored { status: 201 });
}

pub fn an_unknown_outcome_is_never_executed_again<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w0.complete(&c, &Completion::outcome_unknown(1, TTL)).unwrap(), Settled::Done);
    // On every worker, at once and after the lease: refused, never a claim or a takeover.
    for w in [&w0, &w1] {
        assert_eq!(w.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::OutcomeUnknown);
    }
    b.let_claim_leases_end();
    assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE + 2)).unwrap(), Begin::OutcomeUnknown);
    // Another payload is a mismatch; the owner cannot change it any more.
    assert_eq!(w1.begin(&attempt(1, 2, 14, LEASE + 3)).unwrap(), Begin::Mismatch);
    assert_eq!(w0.complete(&c, &done("late", LEASE + 4)).unwrap(), Settled::Lost);
    assert_eq!(w0.release(&c).unwrap(), Settled::Lost);
    assert_eq!(w0.begin(&attempt(1, 1, 15, TTL)).unwrap(), Begin::OutcomeUnknown);
    // Until its ttl ends.
    assert!(matches!(w1.begin(&attempt(1, 1, 16, 1 + TTL)).unwrap(), Begin::Claimed(_)));
}

pub fn scopes_are_independent<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    w.complete(&c, &done("one", 1)).unwrap();
    assert!(matches!(w.begin(&attempt(2, 1, 12, 2)).unwrap(), Begin::Claimed(_)));
}

pub fn a_full_store_refuses_and_never_evicts_live_records<B: Backend>() {
    let b = B::with_capacity(8);
    let w = through_ops(&b, 0);
    let mut live = Vec::new();
    let mut n = 0;
    while live.len() < 8 && n < 10_000 {
        n += 1;
        match w.begin(&attempt(n, 1, n, 0)).unwrap() {
            Begin::Claimed(c) => live.push((n, c)),
            Begin::Full { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    let refused = w.begin(&attempt(n + 1, 1, 99_999, 1)).unwrap();
    if B::BOUNDED {
        assert!(matches!(refused, Begin::Full { retry_after_ms } if retry_after_ms >= 1), "{refused:?}");
    } else {
        assert!(
            matches!(refused, Begin::Claimed(_)),
            "an unbounded store never runs out of room: {refused:?}"
        );
    }
    // Whatever the store's room, no live record was evicted for a new one.
    for (scope_n, _) in &live {
        assert!(matches!(w.begin(&attempt(*scope_n, 1, 7, 2)).unwrap(), Begin::InFlight { .. }));
    }
    // Once they expire, room comes back (a scope never used, so it is a new record everywhere).
    assert!(matches!(w.begin(&attempt(n + 2, 1, 100_000, TTL)).unwrap(), Begin::Claimed(_)));
}

pub fn sweep_reclaims_expired_records<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    for n in 1..=5 {
        let c = claimed(w.begin(&attempt(n, 1, n, 0)).unwrap());
        w.complete(&c, &done("x", 0)).unwrap();
    }
    let mut swept = 0;
    for _ in 0..64 {
        swept += w.sweep(TTL - 1).unwrap();
    }
    assert_eq!(swept, 0, "nothing is expired yet");
    for _ in 0..64 {
        swept += w.sweep(TTL).unwrap();
    }
    assert_eq!(swept, if B::RECLAIMS_BY_SWEEP { 5 } else { 0 });
    // Swept or not, every expired record reads as absent: another payload makes a new record.
    for n in 1..=5 {
        assert!(matches!(w.begin(&attempt(n, 2, 100 + n, TTL)).unwrap(), Begin::Claimed(_)), "{n}");
    }
}

pub fn racing_workers_make_exactly_one_claim<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let a = w0.begin(&attempt(1, 1, 11, 0)).unwrap();
    let c = w1.begin(&attempt(1, 1, 12, 0)).unwrap();
    let claims = [&a, &c].iter().filter(|b| matches!(b, Begin::Claimed(_))).count();
    assert_eq!(claims, 1, "{a:?} {c:?}");
}

pub fn a_late_completion_by_the_owner_is_kept<B: Backend>() {
    // The lease ended but nobody took the record over: the owner still owns it, and its
    // outcome is final: no later request may take the record over and execute again.
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w0.complete(&c, &done("late", LEASE * 3)).unwrap(), Settled::Done);
    assert_eq!(w1.begin(&attempt(1, 1, 12, LEASE * 3 + 1)).unwrap(), Begin::Replay(snapshot("late")));
    let c2 = claimed(w0.begin(&attempt(2, 1, 13, 0)).unwrap());
    let cut =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: LEASE * 2, ttl_ms: TTL };
    assert_eq!(w0.complete(&c2, &cut).unwrap(), Settled::Done);
    assert_eq!(w1.begin(&attempt(2, 1, 14, LEASE * 4)).unwrap(), Begin::NotStored { status: 201 });
}

/// Fills a capacity-8 store: `completed` records completed at 0, the rest left processing.
/// Returns the completed scope numbers and the processing ones with their claims.
fn fill<B: Backend>(b: &B, completed: usize) -> (Vec<u64>, Vec<(u64, Claim)>) {
    let w = through_ops(b, 0);
    let (mut done_scopes, mut open) = (Vec::new(), Vec::new());
    let mut n = 0;
    while done_scopes.len() + open.len() < 8 && n < 10_000 {
        n += 1;
        match w.begin(&attempt(n, 1, n, 0)).unwrap() {
            Begin::Claimed(c) if done_scopes.len() < completed => {
                w.complete(&c, &done(&format!("r{n}"), 0)).unwrap();
                done_scopes.push(n);
            }
            Begin::Claimed(c) => open.push((n, c)),
            Begin::Full { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    (done_scopes, open)
}

pub fn an_abandoned_claim_gives_its_place_after_its_lease<B: Backend>() {
    let b = B::with_capacity(8);
    let w = through_ops(&b, 1);
    let (done_scopes, open) = fill(&b, 7);
    assert_eq!(open.len(), 1);
    if !B::BOUNDED {
        // Nothing is ever evicted: new records are claimed beside every live one, the completed
        // records replay, and the abandoned claim stays its owner's to complete late.
        for (k, now) in [(0, LEASE - 1), (1, LEASE), (2, LEASE + 1)] {
            let r = w.begin(&attempt(20_000 + k, 1, 90_001 + k, now)).unwrap();
            assert!(matches!(r, Begin::Claimed(_)), "{k}: {r:?}");
        }
        for n in done_scopes {
            assert_eq!(
                w.begin(&attempt(n, 1, 7, LEASE + 2)).unwrap(),
                Begin::Replay(snapshot(&format!("r{n}")))
            );
        }
        assert_eq!(through_ops(&b, 0).complete(&open[0].1, &done("late", LEASE + 3)).unwrap(), Settled::Done);
        assert_eq!(w.begin(&attempt(open[0].0, 1, 8, LEASE + 4)).unwrap(), Begin::Replay(snapshot("late")));
        return;
    }
    // Within the lease the abandoned claim is live: the store is full.
    assert!(matches!(w.begin(&attempt(20_000, 1, 90_001, LEASE - 1)).unwrap(), Begin::Full { .. }));
    // After it, its place goes to a new record.
    assert!(matches!(w.begin(&attempt(20_000, 1, 90_002, LEASE)).unwrap(), Begin::Claimed(_)));
    // Completed records within their ttl are never evicted: the next new record is refused.
    let refused = w.begin(&attempt(20_001, 1, 90_003, LEASE + 1)).unwrap();
    assert!(
        matches!(refused, Begin::Full { retry_after_ms } if (1..=60_000).contains(&retry_after_ms)),
        "{refused:?}"
    );
    for n in done_scopes {
        assert_eq!(w.begin(&attempt(n, 1, 7, LEASE + 2)).unwrap(), Begin::Replay(snapshot(&format!("r{n}"))));
    }
    // The evicted claim's owner finds it gone.
    assert_eq!(through_ops(&b, 0).complete(&open[0].1, &done("gone", LEASE + 3)).unwrap(), Settled::Lost);
}

pub fn a_late_completion_of_an_abandoned_claim_keeps_its_place<B: Backend>() {
    let b = B::with_capacity(8);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let (_, open) = fill(&b, 0);
    // Every claim is past its lease; one of them completes late (its owner still owns it).
    let (kept, claim) = open[3];
    assert_eq!(w0.complete(&claim, &done("kept", LEASE + 5)).unwrap(), Settled::Done);
    // Seven new records evict the seven abandoned claims, never the completed one.
    for k in 0..7 {
        let r = w1.begin(&attempt(30_000 + k, 1, 95_000 + k, LEASE + 6)).unwrap();
        assert!(matches!(r, Begin::Claimed(_)), "{k}: {r:?}");
    }
    // Then a bounded store is full; an unbounded one claims it too.
    let next = w1.begin(&attempt(30_100, 1, 96_000, LEASE + 7)).unwrap();
    if B::BOUNDED {
        assert!(matches!(next, Begin::Full { .. }), "{next:?}");
    } else {
        assert!(matches!(next, Begin::Claimed(_)), "{next:?}");
    }
    assert_eq!(w1.begin(&attempt(kept, 1, 96_001, LEASE + 8)).unwrap(), Begin::Replay(snapshot("kept")));
}

#[macro_export]
macro_rules! conformance_suite {
    ($backend:ty) => {
        $crate::conformance_suite!($backend, quotas per shard);
        #[test]
        fn records_made_without_a_quota_never_count_for_one() {
            $crate::store::conformance::records_made_without_a_quota_never_count_for_one::<$backend>();
        }
        #[test]
        fn the_principal_quota_bounds_new_records() {
            $crate::store::conformance::the_principal_quota_bounds_new_records::<$backend>();
        }
        #[test]
        fn the_tenant_quota_bounds_all_its_principals() {
            $crate::store::conformance::the_tenant_quota_bounds_all_its_principals::<$backend>();
        }
        #[test]
        fn a_takeover_is_not_charged() {
            $crate::store::conformance::a_takeover_is_not_charged::<$backend>();
        }
        #[test]
        fn an_abandoned_claim_stops_counting_once_swept() {
            $crate::store::conformance::an_abandoned_claim_stops_counting_once_swept::<$backend>();
        }
        #[test]
        fn a_quota_never_locks_an_identity_out_for_good() {
            $crate::store::conformance::a_quota_never_locks_an_identity_out_for_good::<$backend>();
        }
    };
    // A store in shards keeps each quota per shard (docs/ETCD.md, Shards): every case but the
    // quotas', which its own tests state per shard.
    ($backend:ty, quotas per shard) => {
        #[test]
        fn a_retry_after_the_ttl_meets_the_tombstone_until_it_ends() {
            $crate::store::conformance::a_retry_after_the_ttl_meets_the_tombstone_until_it_ends::<$backend>();
        }
        #[test]
        fn an_unknown_outcome_s_tombstone_answers_as_its_record_did() {
            $crate::store::conformance::an_unknown_outcome_s_tombstone_answers_as_its_record_did::<$backend>();
        }
        #[test]
        fn only_an_outcome_leaves_a_tombstone_and_only_a_keeping_rule_reads_it() {
            $crate::store::conformance::only_an_outcome_leaves_a_tombstone_and_only_a_keeping_rule_reads_it::<$backend>();
        }
        #[test]
        fn an_operator_s_change_reaches_the_tombstone() {
            $crate::store::conformance::an_operator_s_change_reaches_the_tombstone::<$backend>();
        }
        #[test]
        fn records_are_listed_with_their_route_key_and_claim_time() {
            $crate::store::conformance::records_are_listed_with_their_route_key_and_claim_time::<$backend>();
        }
        #[test]
        fn two_tenants_records_of_one_key_are_listed_each_with_its_scope() {
            $crate::store::conformance::two_tenants_records_of_one_key_are_listed_each_with_its_scope::<$backend>();
        }
        #[test]
        fn a_long_list_comes_in_pages_that_hold_every_record_once() {
            $crate::store::conformance::a_long_list_comes_in_pages_that_hold_every_record_once::<$backend>();
        }
        #[test]
        fn release_frees_a_key_whose_outcome_is_unknown_or_whose_lease_ended() {
            $crate::store::conformance::release_frees_a_key_whose_outcome_is_unknown_or_whose_lease_ended::<$backend>();
        }
        #[test]
        fn resolve_settles_an_unknown_outcome_and_every_retry_replays_it() {
            $crate::store::conformance::resolve_settles_an_unknown_outcome_and_every_retry_replays_it::<$backend>();
        }
        #[test]
        fn a_renewed_claim_stays_its_owners_past_its_first_lease() {
            $crate::store::conformance::a_renewed_claim_stays_its_owners_past_its_first_lease::<$backend>();
        }
        #[test]
        fn a_renewal_keeps_only_the_claims_still_their_owners() {
            $crate::store::conformance::a_renewal_keeps_only_the_claims_still_their_owners::<$backend>();
        }
        #[test]
        fn a_claim_no_longer_renewed_ends_a_lease_after_its_last_renewal() {
            $crate::store::conformance::a_claim_no_longer_renewed_ends_a_lease_after_its_last_renewal::<$backend>();
        }
        #[test]
        fn an_operator_waits_for_a_request_that_may_still_be_at_work() {
            $crate::store::conformance::an_operator_waits_for_a_request_that_may_still_be_at_work::<$backend>();
        }
        #[test]
        fn a_renewal_never_outlives_the_record() {
            $crate::store::conformance::a_renewal_never_outlives_the_record::<$backend>();
        }
        #[test]
        fn first_claim_then_in_flight() {
            $crate::store::conformance::first_claim_then_in_flight::<$backend>();
        }
        #[test]
        fn completed_record_replays_byte_for_byte() {
            $crate::store::conformance::completed_record_replays_byte_for_byte::<$backend>();
        }
        #[test]
        fn different_fingerprint_is_a_mismatch_and_changes_nothing() {
            $crate::store::conformance::different_fingerprint_is_a_mismatch_and_changes_nothing::<$backend>();
        }
        #[test]
        fn failed_final_replays_too() {
            $crate::store::conformance::failed_final_replays_too::<$backend>();
        }
        #[test]
        fn release_lets_the_next_request_execute() {
            $crate::store::conformance::release_lets_the_next_request_execute::<$backend>();
        }
        #[test]
        fn expired_lease_is_taken_over_and_the_old_owner_cannot_write() {
            $crate::store::conformance::expired_lease_is_taken_over_and_the_old_owner_cannot_write::<$backend>(
            );
        }
        #[test]
        fn a_refused_lease_end_is_an_unknown_outcome_never_executed_again() {
            $crate::store::conformance::a_refused_lease_end_is_an_unknown_outcome_never_executed_again::<$backend>();
        }
        #[test]
        fn a_reconciled_lease_end_is_unsettled_until_a_lookup_takes_it_over() {
            $crate::store::conformance::a_reconciled_lease_end_is_unsettled_until_a_lookup_takes_it_over::<$backend>();
        }
        #[test]
        fn expired_lease_with_another_payload_is_still_a_mismatch() {
            $crate::store::conformance::expired_lease_with_another_payload_is_still_a_mismatch::<$backend>();
        }
        #[test]
        fn records_expire_after_their_ttl() {
            $crate::store::conformance::records_expire_after_their_ttl::<$backend>();
        }
        #[test]
        fn outcome_without_body_is_never_executed_again() {
            $crate::store::conformance::outcome_without_body_is_never_executed_again::<$backend>();
        }
        #[test]
        fn an_unknown_outcome_is_never_executed_again() {
            $crate::store::conformance::an_unknown_outcome_is_never_executed_again::<$backend>();
        }
        #[test]
        fn scopes_are_independent() {
            $crate::store::conformance::scopes_are_independent::<$backend>();
        }
        #[test]
        fn a_full_store_refuses_and_never_evicts_live_records() {
            $crate::store::conformance::a_full_store_refuses_and_never_evicts_live_records::<$backend>();
        }
        #[test]
        fn sweep_reclaims_expired_records() {
            $crate::store::conformance::sweep_reclaims_expired_records::<$backend>();
        }
        #[test]
        fn a_late_completion_by_the_owner_is_kept() {
            $crate::store::conformance::a_late_completion_by_the_owner_is_kept::<$backend>();
        }
        #[test]
        fn an_abandoned_claim_gives_its_place_after_its_lease() {
            $crate::store::conformance::an_abandoned_claim_gives_its_place_after_its_lease::<$backend>();
        }
        #[test]
        fn a_late_completion_of_an_abandoned_claim_keeps_its_place() {
            $crate::store::conformance::a_late_completion_of_an_abandoned_claim_keeps_its_place::<$backend>();
        }
        #[test]
        fn racing_workers_make_exactly_one_claim() {
            $crate::store::conformance::racing_workers_make_exactly_one_claim::<$backend>();
        }
    };
}
