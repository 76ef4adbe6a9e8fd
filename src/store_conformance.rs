//! The store contract (store.rs), written once and run against every backend, like Envoy's
//! HTTP cache conformance suite. A backend provides a fresh store and two "workers" that share
//! it; `conformance_suite!` instantiates every test for it.

use crate::fingerprint::Fingerprint;
use crate::record::{Snapshot, State};
use crate::scope::ScopeId;
use crate::store::{Begin, Claim, ClaimAttempt, Completion, RecordStore, Settled};

pub const LEASE: u64 = 1_000;
pub const TTL: u64 = 10_000;

/// A store under test: `worker(0)` and `worker(1)` are two independent handles on one backing
/// store, as two Envoy worker threads would hold.
pub trait Backend {
    fn with_capacity(capacity: u32) -> Self;
    fn worker(&self, n: u8) -> Box<dyn RecordStore + '_>;
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
        quota: crate::store::QuotaCharge {
            tenant: None,
            principal: [0; 32],
            per_tenant: u32::MAX,
            per_principal: u32::MAX,
        },
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

pub fn claimed(b: Begin) -> Claim {
    match b {
        Begin::Claimed(c) | Begin::TookOver(c) => c,
        other => panic!("expected a claim, got {other:?}"),
    }
}

pub fn first_claim_then_in_flight<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (b.worker(0), b.worker(1));
    claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w1.begin(&attempt(1, 1, 12, 400)).unwrap(), Begin::InFlight { retry_after_ms: 600 });
}

pub fn completed_record_replays_byte_for_byte<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (b.worker(0), b.worker(1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w0.complete(&c, &done("a", 10)).unwrap(), Settled::Done);
    assert_eq!(w1.begin(&attempt(1, 1, 12, 20)).unwrap(), Begin::Replay(snapshot("a")));
    assert_eq!(w0.begin(&attempt(1, 1, 13, 30)).unwrap(), Begin::Replay(snapshot("a")));
}

pub fn different_fingerprint_is_a_mismatch_and_changes_nothing<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w.begin(&attempt(1, 2, 12, 1)).unwrap(), Begin::Mismatch);
    w.complete(&c, &done("a", 10)).unwrap();
    assert_eq!(w.begin(&attempt(1, 2, 13, 20)).unwrap(), Begin::Mismatch);
    assert_eq!(w.begin(&attempt(1, 1, 14, 30)).unwrap(), Begin::Replay(snapshot("a")));
}

pub fn failed_final_replays_too<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
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
    let (w0, w1) = (b.worker(0), b.worker(1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w0.release(&c).unwrap(), Settled::Done);
    assert!(matches!(w1.begin(&attempt(1, 1, 12, 1)).unwrap(), Begin::Claimed(_)));
    // Releasing again is a no-op for a claim that is gone.
    assert_eq!(w0.release(&c).unwrap(), Settled::Lost);
}

pub fn expired_lease_is_taken_over_and_the_old_owner_cannot_write<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (b.worker(0), b.worker(1));
    let old = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
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

pub fn expired_lease_with_another_payload_is_still_a_mismatch<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
    claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    assert_eq!(w.begin(&attempt(1, 2, 12, LEASE * 2)).unwrap(), Begin::Mismatch);
}

pub fn records_expire_after_their_ttl<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    w.complete(&c, &done("a", 100)).unwrap();
    assert_eq!(w.begin(&attempt(1, 1, 12, 100 + TTL - 1)).unwrap(), Begin::Replay(snapshot("a")));
    assert!(matches!(w.begin(&attempt(1, 2, 13, 100 + TTL)).unwrap(), Begin::Claimed(_)));
}

pub fn outcome_without_body_is_never_executed_again<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    let completion =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 1, ttl_ms: TTL };
    w.complete(&c, &completion).unwrap();
    assert_eq!(w.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::NotStored { status: 201 });
}

pub fn scopes_are_independent<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    w.complete(&c, &done("one", 1)).unwrap();
    assert!(matches!(w.begin(&attempt(2, 1, 12, 2)).unwrap(), Begin::Claimed(_)));
}

pub fn a_full_store_refuses_and_never_evicts_live_records<B: Backend>() {
    let b = B::with_capacity(8);
    let w = b.worker(0);
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
    assert!(matches!(refused, Begin::Full { retry_after_ms } if retry_after_ms >= 1), "{refused:?}");
    for (scope_n, _) in &live {
        assert!(matches!(w.begin(&attempt(*scope_n, 1, 7, 2)).unwrap(), Begin::InFlight { .. }));
    }
    // Once they expire, room comes back.
    assert!(matches!(w.begin(&attempt(n + 1, 1, 100_000, TTL)).unwrap(), Begin::Claimed(_)));
}

pub fn sweep_reclaims_expired_records<B: Backend>() {
    let b = B::with_capacity(64);
    let w = b.worker(0);
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
    assert_eq!(swept, 5);
}

pub fn racing_workers_make_exactly_one_claim<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (b.worker(0), b.worker(1));
    let a = w0.begin(&attempt(1, 1, 11, 0)).unwrap();
    let c = w1.begin(&attempt(1, 1, 12, 0)).unwrap();
    let claims = [&a, &c].iter().filter(|b| matches!(b, Begin::Claimed(_))).count();
    assert_eq!(claims, 1, "{a:?} {c:?}");
}

#[macro_export]
macro_rules! conformance_suite {
    ($backend:ty) => {
        #[test]
        fn first_claim_then_in_flight() {
            $crate::store_conformance::first_claim_then_in_flight::<$backend>();
        }
        #[test]
        fn completed_record_replays_byte_for_byte() {
            $crate::store_conformance::completed_record_replays_byte_for_byte::<$backend>();
        }
        #[test]
        fn different_fingerprint_is_a_mismatch_and_changes_nothing() {
            $crate::store_conformance::different_fingerprint_is_a_mismatch_and_changes_nothing::<$backend>();
        }
        #[test]
        fn failed_final_replays_too() {
            $crate::store_conformance::failed_final_replays_too::<$backend>();
        }
        #[test]
        fn release_lets_the_next_request_execute() {
            $crate::store_conformance::release_lets_the_next_request_execute::<$backend>();
        }
        #[test]
        fn expired_lease_is_taken_over_and_the_old_owner_cannot_write() {
            $crate::store_conformance::expired_lease_is_taken_over_and_the_old_owner_cannot_write::<$backend>(
            );
        }
        #[test]
        fn expired_lease_with_another_payload_is_still_a_mismatch() {
            $crate::store_conformance::expired_lease_with_another_payload_is_still_a_mismatch::<$backend>();
        }
        #[test]
        fn records_expire_after_their_ttl() {
            $crate::store_conformance::records_expire_after_their_ttl::<$backend>();
        }
        #[test]
        fn outcome_without_body_is_never_executed_again() {
            $crate::store_conformance::outcome_without_body_is_never_executed_again::<$backend>();
        }
        #[test]
        fn scopes_are_independent() {
            $crate::store_conformance::scopes_are_independent::<$backend>();
        }
        #[test]
        fn a_full_store_refuses_and_never_evicts_live_records() {
            $crate::store_conformance::a_full_store_refuses_and_never_evicts_live_records::<$backend>();
        }
        #[test]
        fn sweep_reclaims_expired_records() {
            $crate::store_conformance::sweep_reclaims_expired_records::<$backend>();
        }
        #[test]
        fn racing_workers_make_exactly_one_claim() {
            $crate::store_conformance::racing_workers_make_exactly_one_claim::<$backend>();
        }
    };
}
