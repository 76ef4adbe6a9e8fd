use super::*;
use crate::store::{Claim, Kept, ShardClaim};

const LEASE: u64 = 4_000;
const TTL: u64 = 60_000;

fn claim(owner: u64) -> Claim {
    Claim {
        scope: ScopeId([u8::try_from(owner % 251).unwrap(); 32]),
        owner,
        locator: owner * 10,
        written: None,
        shard: 0,
        old_home: None,
        tombstone_s: 0,
    }
}

/// A claim made at `at_ms` with the suite's lease and ttl.
fn hold_at(c: Claim, at_ms: u64) -> Hold {
    Hold { claim: c, lease_ms: LEASE, lease_end_ms: at_ms + LEASE, expires_at_ms: at_ms + TTL }
}

fn owners(batches: &[Renew]) -> Vec<Vec<u64>> {
    batches.iter().map(|b| b.claims.iter().map(|r| r.owner).collect()).collect()
}

#[test]
fn a_claim_is_renewed_only_in_the_last_quarter_of_its_lease() {
    let mut r = Renewals::default();
    assert!(r.hold(hold_at(claim(1), 0)));
    // A request that ends within three quarters of its lease is never renewed.
    assert!(r.due(LEASE * 3 / 4 - 1).is_empty());
    let due = r.due(LEASE * 3 / 4);
    assert_eq!(owners(&due), vec![vec![1]]);
    // Under way: not asked twice.
    assert!(r.due(LEASE * 3 / 4 + 100).is_empty());
    assert_eq!(r.answered(&due[0], Ok(&[Kept::Renewed])), Renewed { kept: 1, lost: Vec::new() });
    // Its lease now runs a whole lease from when the renewal was asked.
    assert_eq!(r.lease_end(1), Some(LEASE * 3 / 4 + LEASE));
    assert!(r.due(LEASE * 3 / 2 - 1).is_empty());
    assert_eq!(owners(&r.due(LEASE * 3 / 2)), vec![vec![1]]);
}

#[test]
fn letting_go_ends_the_renewals_and_says_where_the_lease_ends() {
    let mut r = Renewals::default();
    r.hold(hold_at(claim(1), 0));
    let due = r.due(LEASE);
    r.answered(&due[0], Ok(&[Kept::Renewed]));
    assert_eq!(r.let_go(1), Some(2 * LEASE));
    assert_eq!(r.let_go(1), None);
    assert!(r.due(2 * LEASE).is_empty());
    assert!(r.is_empty());
    // An answer for a claim let go meanwhile changes nothing.
    assert_eq!(r.answered(&due[0], Ok(&[Kept::Renewed])), Renewed::default());
    assert!(r.is_empty());
}

#[test]
fn claims_of_one_shard_and_lease_are_renewed_together() {
    let mut r = Renewals::default();
    r.hold(hold_at(claim(1), 0));
    // Due a little later: taken along with the first.
    r.hold(hold_at(claim(2), 500));
    // Due much later: not yet.
    r.hold(hold_at(claim(3), LEASE / 2 + 100));
    // Another lease length: a batch of its own, when it is due.
    r.hold(Hold { lease_ms: 2 * LEASE, lease_end_ms: 2 * LEASE, ..hold_at(claim(4), 0) });
    let mut due = owners(&r.due(LEASE * 3 / 4));
    due[0].sort_unstable();
    assert_eq!(due, vec![vec![1, 2]]);
}

#[test]
fn claims_on_other_shards_are_renewed_each_on_its_own_and_a_moving_claim_on_both_homes() {
    let mut r = Renewals::default();
    r.hold(hold_at(Claim { shard: 1, ..claim(1) }, 0));
    let moving = Claim { shard: 2, old_home: Some(ShardClaim { shard: 1, locator: 99 }), ..claim(2) };
    r.hold(hold_at(moving, 0));
    let due = r.due(LEASE);
    assert_eq!(due.len(), 2);
    for b in &due {
        let shard = b.claims[0].shard;
        assert!(b.claims.iter().all(|c| c.shard == shard), "{b:?}");
    }
    let on_old: Vec<u64> =
        due.iter().flat_map(|b| &b.claims).filter(|c| c.owner == 2).map(|c| c.locator).collect();
    assert_eq!(on_old.len(), 2);
    assert!(on_old.contains(&99) && on_old.contains(&20), "{on_old:?}");
    // The moving claim lost on one home is lost: let go.
    let (old_batch, new_batch) =
        if due[0].claims[0].shard == 1 { (&due[0], &due[1]) } else { (&due[1], &due[0]) };
    let kept: Vec<Kept> =
        old_batch.claims.iter().map(|c| if c.owner == 1 { Kept::Renewed } else { Kept::TakenOver }).collect();
    let out = r.answered(old_batch, Ok(&kept));
    assert_eq!(out.lost, vec![moving.scope]);
    assert_eq!(r.lease_end(2), None);
    r.answered(new_batch, Ok(&[Kept::Renewed]));
    assert_eq!(r.lease_end(2), None);
    assert_eq!(r.lease_end(1), Some(2 * LEASE));
}

#[test]
fn a_renewal_never_outlives_the_record() {
    let mut r = Renewals::default();
    let h = Hold { expires_at_ms: LEASE + LEASE / 2, ..hold_at(claim(1), 0) };
    r.hold(h);
    let due = r.due(LEASE);
    r.answered(&due[0], Ok(&[Kept::Renewed]));
    assert_eq!(r.lease_end(1), Some(LEASE + LEASE / 2));
    // Nothing left to extend.
    assert!(r.due(LEASE + LEASE / 4).is_empty());
    // Expired: let go.
    assert!(r.due(LEASE + LEASE / 2).is_empty());
    assert!(r.is_empty());
}

#[test]
fn a_lost_claim_is_let_go_and_a_failed_renewal_is_asked_again_after_a_pause() {
    let mut r = Renewals::default();
    r.hold(hold_at(claim(1), 0));
    r.hold(hold_at(claim(2), 0));
    let due = r.due(LEASE * 3 / 4);
    let out = r.answered(&due[0], Err(()));
    assert_eq!(out, Renewed::default());
    assert_eq!(r.len(), 2);
    assert!(r.due(LEASE * 3 / 4 + RETRY_AFTER_FAILURE_MS - 1).is_empty());
    let again = r.due(LEASE * 3 / 4 + RETRY_AFTER_FAILURE_MS);
    let kept: Vec<Kept> =
        again[0].claims.iter().map(|c| if c.owner == 1 { Kept::Renewed } else { Kept::TakenOver }).collect();
    let out = r.answered(&again[0], Ok(&kept));
    assert_eq!(out, Renewed { kept: 1, lost: vec![claim(2).scope] });
    assert_eq!(r.len(), 1);
    // A claim its owner settled while the renewal was out is let go without a word.
    r.hold(hold_at(claim(3), 0));
    let due = r.due(LEASE * 3 / 4 + RETRY_AFTER_FAILURE_MS);
    assert_eq!(due[0].claims.iter().map(|c| c.owner).collect::<Vec<_>>(), vec![3]);
    assert_eq!(r.answered(&due[0], Ok(&[Kept::Settled])), Renewed::default());
    assert_eq!((r.lease_end(3), r.len()), (None, 1));
}

#[test]
fn a_batch_carries_no_more_claims_than_one_transaction_may() {
    let mut r = Renewals::default();
    let n = MAX_RENEWALS as u64 * 2 + 1;
    for owner in 1..=n {
        r.hold(hold_at(claim(owner), 0));
    }
    let due = r.due(LEASE);
    assert_eq!(due.len(), 3);
    assert!(due.iter().all(|b| b.claims.len() <= MAX_RENEWALS));
    assert_eq!(due.iter().map(|b| b.claims.len()).sum::<usize>(), n as usize);
}

#[test]
fn a_worker_holds_a_bounded_number_of_claims() {
    let mut r = Renewals::default();
    for owner in 0..MAX_HELD as u64 {
        assert!(r.hold(hold_at(claim(owner), 0)));
    }
    assert!(!r.hold(hold_at(claim(MAX_HELD as u64), 0)));
    // The same owner again (a waiter that became owner holds anew) is not a new one.
    assert!(r.hold(hold_at(claim(0), 10)));
    assert_eq!(r.len(), MAX_HELD);
}
