//! The contract's quotas (`store.quota`): a caller's and a tenant's bounds on new records, what
//! a takeover, an abandoned claim and a record made without a quota count; run against every
//! backend by `conformance_suite!` like the rest of the suite.

// A failing assertion is the suite's job; it never runs inside Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

pub fn the_principal_quota_bounds_new_records<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    let bounds = (100, 2);
    let a = claimed(w0.begin(&charged(1, 11, 0, 1, None, bounds)).unwrap());
    claimed(w1.begin(&charged(2, 12, 1, 1, None, bounds)).unwrap());
    let refused = w0.begin(&charged(3, 13, 2, 1, None, bounds)).unwrap();
    assert!(
        matches!(refused, Begin::QuotaExceeded { tenant: false, retry_after_ms } if (1..=60_000).contains(&retry_after_ms)),
        "{refused:?}"
    );
    // Another principal is not affected.
    claimed(w0.begin(&charged(3, 14, 3, 2, None, bounds)).unwrap());
    // Answers about existing records are not charged.
    assert_eq!(
        w1.begin(&charged(1, 15, 4, 1, None, bounds)).unwrap(),
        Begin::InFlight { retry_after_ms: LEASE - 4 }
    );
    w0.complete(&a, &done("a", 5)).unwrap();
    assert_eq!(w1.begin(&charged(1, 16, 6, 1, None, bounds)).unwrap(), Begin::Replay(snapshot("a")));
    assert_eq!(
        w1.begin(&ClaimAttempt {
            fingerprint: crate::identity::fingerprint::Fingerprint([9; 32]),
            ..charged(1, 17, 7, 1, None, bounds)
        })
        .unwrap(),
        Begin::Mismatch
    );
    // A completed record still counts; a released one stops counting.
    assert!(matches!(w0.begin(&charged(4, 18, 8, 1, None, bounds)).unwrap(), Begin::QuotaExceeded { .. }));
    let c = claimed(w0.begin(&charged(5, 19, 9, 3, None, bounds)).unwrap());
    w0.release(&c).unwrap();
    claimed(w0.begin(&charged(6, 20, 10, 3, None, bounds)).unwrap());
    claimed(w0.begin(&charged(7, 21, 11, 3, None, bounds)).unwrap());
}

pub fn the_tenant_quota_bounds_all_its_principals<B: Backend>() {
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let bounds = (2, 10);
    claimed(w.begin(&charged(1, 11, 0, 1, Some(7), bounds)).unwrap());
    claimed(w.begin(&charged(2, 12, 0, 2, Some(7), bounds)).unwrap());
    let refused = w.begin(&charged(3, 13, 0, 3, Some(7), bounds)).unwrap();
    assert!(matches!(refused, Begin::QuotaExceeded { tenant: true, .. }), "{refused:?}");
    // The refused principal was not charged: with another tenant it still has all its room.
    claimed(w.begin(&charged(4, 14, 0, 3, Some(8), (100, 1))).unwrap());
}

pub fn a_takeover_is_not_charged<B: Backend>() {
    let b = B::with_capacity(64);
    let (w0, w1) = (through_ops(&b, 0), through_ops(&b, 1));
    claimed(w0.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
    b.let_claim_leases_end();
    let taken = w1.begin(&charged(1, 12, LEASE, 1, None, (10, 1))).unwrap();
    assert!(matches!(taken, Begin::TookOver(_)), "{taken:?}");
    assert!(matches!(
        w1.begin(&charged(2, 13, LEASE + 1, 1, None, (10, 1))).unwrap(),
        Begin::QuotaExceeded { .. }
    ));
}

pub fn an_abandoned_claim_stops_counting_once_swept<B: Backend>() {
    // A claim whose lease ended without an outcome is no longer live for the quota: a client
    // whose requests keep being cut off must not lock itself out for the ttl. The record itself
    // stays (a different payload is still refused), and taking it over charges it again.
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    claimed(w.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
    assert!(matches!(w.begin(&charged(2, 12, 1, 1, None, (10, 1))).unwrap(), Begin::QuotaExceeded { .. }));
    for _ in 0..2 {
        w.sweep(LEASE).unwrap();
    }
    claimed(w.begin(&charged(2, 13, LEASE + 1, 1, None, (10, 1))).unwrap());
    let other_payload = ClaimAttempt {
        fingerprint: crate::identity::fingerprint::Fingerprint([9; 32]),
        ..charged(1, 14, LEASE + 2, 1, None, (10, 1))
    };
    assert_eq!(w.begin(&other_payload).unwrap(), Begin::Mismatch);
    b.let_claim_leases_end();
    let takeover = w.begin(&charged(1, 15, LEASE + 3, 1, None, (10, 1))).unwrap();
    assert!(matches!(takeover, Begin::QuotaExceeded { tenant: false, .. }), "{takeover:?}");
    // With room in the quota, the takeover goes ahead and counts.
    let taken = w.begin(&charged(1, 16, LEASE + 4, 1, None, (10, 2))).unwrap();
    assert!(matches!(taken, Begin::TookOver(_)), "{taken:?}");
    assert!(matches!(
        w.begin(&charged(3, 17, LEASE + 5, 1, None, (10, 2))).unwrap(),
        Begin::QuotaExceeded { .. }
    ));
}

pub fn a_quota_never_locks_an_identity_out_for_good<B: Backend>() {
    // Records that expire stop counting once swept, and a counter whose records have all
    // expired reads as empty even before any sweep.
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let c = claimed(w.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
    w.complete(&c, &done("a", 0)).unwrap();
    assert!(matches!(
        w.begin(&charged(2, 12, TTL - 1, 1, None, (10, 1))).unwrap(),
        Begin::QuotaExceeded { .. }
    ));
    for _ in 0..64 {
        w.sweep(TTL).unwrap();
    }
    let c = claimed(w.begin(&charged(2, 13, TTL, 1, None, (10, 1))).unwrap());
    let _ = c;
    // Abandoned and never swept: free again once the record cannot be live any more.
    let late = 2 * TTL + 2 * LEASE;
    claimed(w.begin(&charged(3, 14, late, 1, None, (10, 1))).unwrap());
}

pub fn records_made_without_a_quota_never_count_for_one<B: Backend>() {
    // Quotas are opt-in, and a configuration update may add one while records made without it
    // are live. Those were never charged: their release, sweep or completion must not discharge
    // a counter (which would let an identity past its bound), and they do not count; a takeover
    // under a quota charges the record from then on.
    let b = B::with_capacity(64);
    let w = through_ops(&b, 0);
    let bounds = (10, 2);
    let free = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    claimed(w.begin(&attempt(2, 1, 12, 0)).unwrap()); // abandoned below
    for (scope, owner) in [(3, 13), (4, 14)] {
        let c = claimed(w.begin(&charged(scope, owner, 1, 1, Some(7), bounds)).unwrap());
        w.complete(&c, &done("q", 1)).unwrap();
    }
    let at_bound = |now, bounds| w.begin(&charged(5, 15, now, 1, Some(7), bounds)).unwrap();
    assert!(matches!(at_bound(2, bounds), Begin::QuotaExceeded { .. }));
    w.release(&free).unwrap();
    assert!(matches!(at_bound(3, bounds), Begin::QuotaExceeded { .. }));
    for _ in 0..2 {
        w.sweep(LEASE).unwrap();
    }
    assert!(matches!(at_bound(LEASE + 1, bounds), Begin::QuotaExceeded { .. }));
    // Taking the uncharged record over charges it: at the bound, refused; with room, counted.
    b.let_claim_leases_end();
    let refused = w.begin(&charged(2, 16, LEASE + 2, 1, Some(7), bounds)).unwrap();
    assert!(matches!(refused, Begin::QuotaExceeded { .. }), "{refused:?}");
    let taken = w.begin(&charged(2, 17, LEASE + 3, 1, Some(7), (10, 3))).unwrap();
    assert!(matches!(taken, Begin::TookOver(_)), "{taken:?}");
    assert!(matches!(at_bound(LEASE + 4, (10, 3)), Begin::QuotaExceeded { .. }));
    w.release(&claimed(taken)).unwrap();
    claimed(at_bound(LEASE + 5, (10, 3)));
}
