//! Tombstones (`ClaimAttempt::tombstone_ms`, C29): what a record leaves once its ttl ends, run
//! against every backend by `conformance_suite!` like the rest of the suite.

// A failing assertion is the suite's job; it never runs inside Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use crate::store::{Amendment, Begin, ClaimAttempt, OnLeaseEnd};

/// How long the suite's tombstones stand after their completion: three ttls.
pub const TOMBSTONE: u64 = 3 * TTL;

/// An attempt of a rule that keeps tombstones.
pub fn keeping(scope_n: u64, fp: u8, owner: u64, now_ms: u64) -> ClaimAttempt {
    ClaimAttempt { tombstone_ms: TOMBSTONE, ..attempt(scope_n, fp, owner, now_ms) }
}

/// After its ttl a completed record's retry gets its tombstone (the original status, on every
/// worker), another payload a mismatch, until the tombstone's end counted from the completion;
/// then the key is new.
pub fn a_retry_after_the_ttl_meets_the_tombstone_until_it_ends<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w0.begin(&keeping(1, 1, 11, 0)).unwrap());
    w0.complete(&c, &done("one", 5)).unwrap();
    // Within the ttl the record answers, as without tombstones.
    assert_eq!(w1.begin(&keeping(1, 1, 12, 5 + TTL - 1)).unwrap(), Begin::Replay(snapshot("one")));
    for (w, now) in [(&w0, 5 + TTL), (&w1, 5 + TTL + 1), (&w1, 5 + TOMBSTONE - 1)] {
        assert_eq!(w.begin(&keeping(1, 1, now, now)).unwrap(), Begin::Expired { status: 201 }, "at {now}");
        assert_eq!(w.begin(&keeping(1, 2, now, now)).unwrap(), Begin::Mismatch, "at {now}");
    }
    assert!(matches!(w1.begin(&keeping(1, 1, 13, 5 + TOMBSTONE)).unwrap(), Begin::Claimed(_)));
}

/// The tombstone of an unknown outcome answers as its record did: never executed, 502; one a
/// begin marked unknown at its lease's end too.
pub fn an_unknown_outcome_s_tombstone_answers_as_its_record_did<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&keeping(1, 1, 11, 0)).unwrap());
    w.complete(&c, &Completion::outcome_unknown(3, TTL)).unwrap();
    let marking =
        |n, owner, now| ClaimAttempt { on_lease_end: OnLeaseEnd::MarkUnknown, ..keeping(n, 1, owner, now) };
    claimed(w.begin(&marking(2, 21, 0)).unwrap());
    b.let_claim_leases_end();
    assert_eq!(w.begin(&marking(2, 22, LEASE)).unwrap(), Begin::OutcomeUnknown);
    let after = LEASE + TTL + 1;
    assert_eq!(w.begin(&keeping(1, 1, 12, after)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(w.begin(&marking(2, 23, after)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(w.begin(&keeping(2, 2, 24, after)).unwrap(), Begin::Mismatch);
}

/// Only an outcome leaves a tombstone: a released claim, or a claim never completed, leaves
/// none; and a rule that keeps no tombstones never reads one (a configuration that drops
/// `tombstone_ttl` forgets them).
pub fn only_an_outcome_leaves_a_tombstone_and_only_a_keeping_rule_reads_it<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let released = claimed(w.begin(&keeping(1, 1, 11, 0)).unwrap());
    assert_eq!(w.release(&released).unwrap(), Settled::Done);
    assert!(matches!(w.begin(&keeping(1, 1, 12, 1)).unwrap(), Begin::Claimed(_)));
    claimed(w.begin(&keeping(2, 1, 21, 0)).unwrap());
    b.let_claim_leases_end();
    assert!(matches!(w.begin(&keeping(2, 1, 22, TTL + 1)).unwrap(), Begin::Claimed(_)));
    let c = claimed(w.begin(&keeping(3, 1, 31, 0)).unwrap());
    w.complete(&c, &done("three", 1)).unwrap();
    assert!(matches!(w.begin(&attempt(3, 1, 32, 1 + TTL)).unwrap(), Begin::Claimed(_)));
}

/// An operator's release of a record also drops its tombstone: the next request executes, as a
/// release promises. A resolve gives the tombstone the status the record now replays.
pub fn an_operator_s_change_reaches_the_tombstone<B: Backend>() {
    let b = B::with_capacity(64);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    for n in [1, 2] {
        let c = claimed(w.begin(&keeping(n, 1, 10 * n, 0)).unwrap());
        w.complete(&c, &Completion::outcome_unknown(1, TTL)).unwrap();
    }
    b.let_claim_leases_end();
    let now = LEASE + 1;
    assert_eq!(
        admin.amend(&only(&admin, 1, now), &Amendment::Release { force: false }, now).unwrap(),
        Ok(())
    );
    let answer = snapshot("settled by hand");
    assert_eq!(admin.amend(&only(&admin, 2, now), &Amendment::Resolve(answer.clone()), now).unwrap(), Ok(()));
    assert_eq!(w.begin(&keeping(2, 1, 21, now + 1)).unwrap(), Begin::Replay(answer));
    let after = 1 + TTL;
    assert!(matches!(w.begin(&keeping(1, 1, 12, after)).unwrap(), Begin::Claimed(_)));
    assert_eq!(w.begin(&keeping(2, 1, 22, after)).unwrap(), Begin::Expired { status: 201 });
}
