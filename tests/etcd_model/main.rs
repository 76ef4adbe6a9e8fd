//! A model checker over the etcd store's own code (issue 33, part 1): Envoys drive the
//! product's `EtcdConversation`s against a model etcd (`etcd.rs`: revisions, leases,
//! transactions, answering in etcd 3.4's JSON), and every interleaving of
//! their callouts, delayed, reordered, lost after etcd applied them, or timed out, with lease
//! expiry, skewed clocks, an Envoy crash, completion retries, takeovers, refusals and
//! reconciliation lookups (`fleet.rs`), each state once (`explore.rs`, which says why it is its
//! own explorer and not `stateright`'s). In every state:
//! - at most one execution per key, except a takeover the rule allows (its owner crashed, or
//!   its completion failed for its whole retry window, on a `takeover` rule);
//! - a stored outcome is never replaced;
//! - every replay is the stored outcome;
//! - no request of another scope reads a record;
//! - no record stays in flight past its lease plus the bound (the claim lease's reuse window,
//!   its 1 s slack and the largest skew);
//! - an outcome a live owner's client was answered with is kept (its completion is never lost
//!   to a takeover or a refusal).
//!
//! `cargo test` (and so `make check`) checks the sizes below in seconds; `make model-deep`
//! (`ETCD_MODEL=deep`) checks larger ones (docs/ETCD.md, "Model checking", has their state
//! counts). A broken invariant fails the test with its shortest counterexample, narrated;
//! `make model-holes` re-introduces two past holes and expects exactly that.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// A model's states and steps carry the product's values as they are (a conversation is large,
// a begin's answer has many parts): clarity over size here.
#![allow(clippy::large_enum_variant, clippy::result_large_err, clippy::too_many_arguments)]

mod etcd;
mod explore;
mod fleet;

use fleet::{Action, Fleet, FleetState, List, EXECUTIONS, REACHED};
use idempotency_filter::config::UnknownOutcome;
use std::time::Instant;

/// The sizes `cargo test` checks, or with `ETCD_MODEL=deep` the larger ones.
fn deep() -> bool {
    match std::env::var("ETCD_MODEL").as_deref() {
        Ok("deep") => true,
        Ok("") | Err(_) => false,
        Ok(other) => panic!("ETCD_MODEL={other}: only \"deep\" (or nothing) is known"),
    }
}

/// Two Envoys, B's clock 1.5 s ahead of A's (more than the lease), one key each sends once,
/// with `faults` timed-out callouts and `crashes` crashes; deep: both, and longer.
fn pair(rule: UnknownOutcome, faults: u8, crashes: u8) -> Fleet {
    let (faults, crashes) = if deep() { (faults.max(1), crashes.max(1)) } else { (faults, crashes) };
    Fleet {
        skews_ms: vec![0, 1_500],
        requests: vec![vec![(0, 1)], vec![(0, 1)]],
        rule,
        faults,
        begin_faults: true,
        crashes,
        tick_ms: 1_000,
        horizon_ms: if deep() { 5_000 } else { 4_000 },
        lease_ms: 1_000,
        ttl_ms: 10_000,
        lists: Vec::new(),
        upstream_ticks: 0,
        tombstone_ms: 0,
    }
}

/// Checks `fleet` exhaustively; panics with the narrated counterexample of a broken invariant,
/// and when a behaviour the model should reach was never reached (it would check nothing there).
fn check(label: &str, fleet: Fleet, must_reach: &[usize]) {
    // Expiry by ttl is each Envoy's own clock's (docs/ETCD.md, "Clocks"), and not modelled: a
    // record must outlive the horizon by every clock, or a skewed clock's reuse of an expired
    // record would read as a replaced outcome.
    // A rule that keeps tombstones may let its record expire within the horizon: its tombstone
    // must outlive it instead (and stands for the record from its completion on).
    let max_skew = fleet.skews_ms.iter().max().copied().unwrap_or(0);
    let kept = fleet.ttl_ms.max(fleet.tombstone_ms);
    assert!(
        kept > fleet.horizon_ms + max_skew,
        "{label}: the ttl (or the tombstone) must outlive the horizon"
    );
    let started = Instant::now();
    let explored = explore::explore(&fleet);
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{label}: {} states, {} transitions, depth {}, {seconds:.1} s; reached: {:?}",
        explored.states,
        explored.transitions,
        explored.depth,
        fleet::reached(explored.seen)
    );
    if let Some((path, last)) = explored.counterexample {
        panic!("{label}: counterexample\n{}", narrate(&fleet, &path, &last));
    }
    for i in must_reach {
        assert!(explored.seen & (1 << i) != 0, "{label}: never {}", REACHED[*i]);
    }
}

/// A path as the steps it took, one a line, and the invariant it broke.
fn narrate(fleet: &Fleet, path: &[(FleetState, Action)], last: &FleetState) -> String {
    let mut out = String::new();
    for (n, (state, action)) in path.iter().enumerate() {
        out.push_str(&format!("  {:>2}. {}\n", n + 1, fleet.apply(state, action).1));
    }
    for (property, what) in &last.violations {
        out.push_str(&format!("  broken: {property}: {what}\n"));
    }
    out
}

#[test]
fn takeover_after_a_crash() {
    check("takeover, a crash", pair(UnknownOutcome::Takeover, 0, 1), &[0, 1]);
}

#[test]
fn takeover_with_a_lost_callout() {
    check("takeover, a lost callout", pair(UnknownOutcome::Takeover, 1, 0), &[0, 2, 5, 6]);
}

/// A 3 s lease (longer than the claim lease's reuse window and slack): the upstream may answer
/// late in it, and the completion fail up to three times, so it is still being tried well past
/// the lease's end. Its lease key must outlive the tries (before 8a92efc it did not: B took
/// over and executed again while A was still writing the outcome its client had).
#[test]
fn a_late_answer_whose_completion_is_tried_again() {
    let mut fleet = pair(UnknownOutcome::Takeover, 3, 0);
    fleet.lease_ms = 3_000;
    fleet.ttl_ms = 30_000;
    fleet.begin_faults = false;
    fleet.horizon_ms = if deep() { 9_000 } else { 5_000 };
    check("a late answer, tried again", fleet, &[0, 2]);
}

#[test]
fn refuse_rule() {
    check("refuse", pair(UnknownOutcome::Refuse, 1, 1), &[0, 2, 4, 6]);
}

#[test]
fn reconcile_rule() {
    check("reconcile", pair(UnknownOutcome::Reconcile, 0, 1), &[0, 3]);
}

/// Tombstones (C29): the record's ttl (2 s) ends within the horizon, its tombstone (30 s) does
/// not. B, its clock 300 ms ahead, retries at any time: before the ttl it gets A's replay (or
/// 409), after it the tombstone's 410, never a second execution; a completion may be tried
/// again meanwhile (its tombstone is in its transaction).
#[test]
fn a_retry_after_the_ttl_meets_the_tombstone() {
    let mut fleet = pair(UnknownOutcome::Takeover, 1, 0);
    fleet.skews_ms = vec![0, 300];
    fleet.begin_faults = false;
    fleet.ttl_ms = 2_000;
    fleet.tombstone_ms = 30_000;
    fleet.horizon_ms = if deep() { 6_000 } else { 4_000 };
    check("tombstones, a retry after the ttl", fleet, &[0, 8]);
}

#[test]
fn another_scope() {
    // The same key under another tenant on B, then A's key: neither reads the other's record.
    let mut fleet = pair(UnknownOutcome::Takeover, 0, 0);
    fleet.requests = vec![vec![(0, 1)], vec![(1, 1), (0, 1)]];
    fleet.horizon_ms = if deep() { 3_000 } else { 1_000 };
    check("another scope", fleet, &[0]);
}

#[test]
fn three_envoys() {
    let mut fleet = pair(UnknownOutcome::Takeover, 0, 0);
    fleet.skews_ms = vec![0, 1_500, 700];
    fleet.requests = vec![vec![(0, 1)], vec![(0, 1)], vec![(0, 1)]];
    fleet.horizon_ms = if deep() { 3_000 } else { 1_000 };
    check("three envoys", fleet, &[0]);
}

/// A rolling change of shards (`store.previous_shards`, docs/ETCD.md "Shards"): the key's home
/// moves from etcd 0 to etcd 1. A runs the old list, B the new one with the old as
/// `previous_shards` (the product's `Moving` plan, claiming both homes), B's clock ahead; a lost
/// callout, and a crash. Either may store first; the other replays it.
#[test]
fn shards_changing_an_old_list_envoy_and_a_moving_one() {
    let mut fleet = pair(UnknownOutcome::Takeover, 1, 1);
    fleet.lists = vec![List::Old, List::Moving];
    check("shards changing: old list and moving", fleet, &[0, 1]);
}

/// The second half of the change: B has dropped `previous_shards` (the new list alone) while A
/// still moves.
#[test]
fn shards_changing_a_moving_envoy_and_a_new_list_one() {
    let mut fleet = pair(UnknownOutcome::Takeover, 1, 1);
    fleet.lists = vec![List::Moving, List::New];
    check("shards changing: moving and new list", fleet, &[0, 1]);
}

/// Why the procedure waits before dropping `previous_shards`: an Envoy on the old list and one
/// on the new list alone share no home, and the checker finds the second execution.
#[test]
fn an_old_list_envoy_beside_a_new_list_one_executes_twice() {
    let mut fleet = pair(UnknownOutcome::Takeover, 0, 0);
    fleet.lists = vec![List::Old, List::New];
    fleet.horizon_ms = 1_000;
    let explored = explore::explore(&fleet);
    let (path, last) = explored.counterexample.expect("two lists without a common home execute twice");
    assert!(last.violations.iter().any(|(p, _)| *p == EXECUTIONS), "{}", narrate(&fleet, &path, &last));
}

/// Three Envoys during the first half of a change: one on the old list, two moving (one of
/// them with the clock 1.5 s ahead).
#[test]
fn shards_changing_three_envoys() {
    let mut fleet = pair(UnknownOutcome::Takeover, 0, 0);
    fleet.skews_ms = vec![0, 1_500, 700];
    fleet.requests = vec![vec![(0, 1)], vec![(0, 1)], vec![(0, 1)]];
    fleet.lists = vec![List::Old, List::Moving, List::Moving];
    fleet.horizon_ms = if deep() { 3_000 } else { 1_000 };
    check("shards changing: three envoys", fleet, &[0]);
}

/// A claim lives as long as its owner (C25): A's upstream takes 5 s against a 2 s lease, and A's
/// root renews its claim at its ticks (the product's `Renewals`, its `StoreOp::Renew`
/// conversations) while B, its clock 1.5 s ahead, retries. B never executes, is never refused
/// as outcome unknown, never looks the record up: it gets 409, then A's replay.
fn a_long_upstream(rule: UnknownOutcome, crashes: u8) -> Fleet {
    let mut fleet = pair(rule, 0, 0);
    fleet.crashes = crashes;
    fleet.lease_ms = 2_000;
    fleet.tick_ms = 500;
    fleet.upstream_ticks = 10;
    fleet.ttl_ms = 60_000;
    fleet.requests = vec![vec![(0, 1)], vec![(0, if crashes > 0 && !deep() { 2 } else { 3 })]];
    // A crash's claim ends only with its lease key, 6 s after its last renewal by etcd's clock:
    // the deep run goes on until then; the quick one checks that nothing ends it before.
    fleet.horizon_ms = match (crashes > 0, deep()) {
        (true, true) => 10_000,
        (true, false) => 6_000,
        (false, _) => 7_000,
    };
    fleet
}

#[test]
fn an_owner_at_work_past_several_leases_keeps_its_claim() {
    for rule in [UnknownOutcome::Takeover, UnknownOutcome::Refuse, UnknownOutcome::Reconcile] {
        // Reached: a replay, a renewal.
        check(&format!("{rule:?}, an owner at work past two leases"), a_long_upstream(rule, 0), &[0, 7]);
    }
}

/// The owner dies between two renewals: its claim ends a lease (and, on etcd, its completion's
/// retry window) after its last renewal, and the rule decides then: a takeover executes again,
/// a refusal answers outcome unknown. Never before.
#[test]
fn an_owner_that_dies_between_two_renewals() {
    // Deep: reached a takeover executed again, an outcome-unknown answer (and a renewal).
    let (takeover, refuse): (&[usize], &[usize]) = if deep() { (&[1, 7], &[4, 7]) } else { (&[7], &[7]) };
    check(
        "takeover, the owner dies between renewals",
        a_long_upstream(UnknownOutcome::Takeover, 1),
        takeover,
    );
    check("refuse, the owner dies between renewals", a_long_upstream(UnknownOutcome::Refuse, 1), refuse);
}

/// One owner, one retry, clocks in step: A renews, then dies, and B's one begin may come at any
/// time. A's claim must end (its lease key, 6 s after its last renewal by etcd's clock, plus the
/// checker's bound) and B then takes it over: a renewed claim never outlives its owner for good.
#[test]
fn a_dead_owners_renewed_claim_ends_with_its_lease_key() {
    let mut fleet = a_long_upstream(UnknownOutcome::Takeover, 1);
    fleet.skews_ms = vec![0, 0];
    fleet.requests = vec![vec![(0, 1)], vec![(0, 1)]];
    fleet.horizon_ms = 9_000;
    check("takeover, a dead owner's renewed claim ends", fleet, &[1, 7]);
}
