//! Leases: shared per expiry window and never ending before their records; a lease etcd lost is
//! granted again, once per conversation.

use super::*;

#[test]
fn a_lost_lease_is_granted_again_once() {
    let lost = (Some(404), error_body("etcdserver: requested lease not found", 5).into_bytes());
    let store = store();
    let (answer, made) = run(
        &store,
        StoreOp::Begin(attempt(0)),
        0,
        vec![
            ok(read_answer(1, None, &[])),
            ok(granted()),
            ok(granted()),
            lost.clone(),
            ok(granted()),
            ok(granted()),
            ok(written(3)),
        ],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    // etcd does not say which lease it lacks: both are granted again.
    let grant = "/v3/lease/grant";
    assert_eq!(paths(&made), vec!["/v3/kv/txn", grant, grant, "/v3/kv/txn", grant, grant, "/v3/kv/txn"]);
    // Lost twice in one conversation: etcd is not keeping leases; the store is unusable.
    let (answer, _) = run(
        &EtcdStore::new(settings(None)),
        StoreOp::Begin(attempt(0)),
        0,
        vec![
            ok(read_answer(1, None, &[])),
            ok(granted()),
            ok(granted()),
            lost.clone(),
            ok(granted()),
            ok(granted()),
            lost,
        ],
    );
    assert!(matches!(begun(answer), Err(StoreError::Unavailable(_))));
}

#[test]
fn leases_are_shared_per_window_and_never_end_before_their_records() {
    for expires_at in [0, 1, 9_999, 10_000, 86_400_000, u64::MAX - 1] {
        let end = window_end(expires_at);
        assert!(end > expires_at || expires_at >= u64::MAX - LEASE_WINDOW_MS, "{expires_at}");
        assert!(end - expires_at <= LEASE_WINDOW_MS || end == u64::MAX, "{expires_at}");
    }
    let store = store();
    store.remember_lease(20_000, 1);
    assert_eq!(store.lease_for(20_000, 5_000), Some(1));
    assert_eq!(store.lease_for(30_000, 5_000), None);
    // A window that has ended is dropped.
    assert_eq!(store.lease_for(20_000, 20_000), None);
    for w in 0..(CACHED_LEASES as u64 + 4) {
        store.remember_lease(100_000 + w * LEASE_WINDOW_MS, w as i64 + 10);
    }
    assert_eq!(store.leases.borrow().len(), CACHED_LEASES);
}
