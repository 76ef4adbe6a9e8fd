//! The replay cache (`replay_cache`): a completed record this worker read or wrote answers its
//! replays (and mismatches) without a call until it expires; claims never come from it.

use super::*;

fn cached_store() -> EtcdStore {
    let replay_cache = Some(ReplayCacheSettings { entries: 8, max_bytes: 1 << 20 });
    EtcdStore::new(EtcdSettings { replay_cache, ..settings(None) })
}

#[test]
fn a_hot_replay_comes_from_the_replay_cache_until_the_record_expires() {
    let key = record_key();
    let store = cached_store();
    warm(&store, 10);
    let stored = value(completed(0, Some(snapshot())), Some(snapshot()));
    // The first replay reads etcd and keeps the record.
    let (answer, made) =
        run(&store, StoreOp::Begin(attempt(10)), 10, vec![ok(read_answer(5, Some((&key, &stored, 4)), &[]))]);
    assert_eq!(begun(answer), Ok(Begin::Replay(snapshot())));
    assert_eq!(made.len(), 1);
    assert_eq!(store.replay_cache_usage().map(|(n, _)| n), Some(1));
    // The next ones make no call, up to the last instant before the record's expiry.
    for now in [20, 9_999] {
        let (answer, made) = run(&store, StoreOp::Begin(attempt(now)), now, vec![]);
        assert_eq!(begun(answer), Ok(Begin::Replay(snapshot())), "at {now}");
        assert!(made.is_empty(), "{made:?}");
    }
    // Another payload under the key is refused from the cache as etcd would refuse it.
    let other = ClaimAttempt { fingerprint: Fingerprint([8; 32]), ..attempt(30) };
    let (answer, made) = run(&store, StoreOp::Begin(other), 30, vec![]);
    assert_eq!(begun(answer), Ok(Begin::Mismatch));
    assert!(made.is_empty());
    // At its expiry the record is absent: the begin goes to etcd, which lets it claim (the
    // claim's transaction finds it, then a write guarded by its revision replaces it).
    warm(&store, 10_000);
    let (answer, made) = run(
        &store,
        StoreOp::Begin(attempt(10_000)),
        10_000,
        vec![ok(read_answer(5, Some((&key, &stored, 4)), &[])), ok(written(6))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(paths(&made), vec!["/v3/kv/txn", "/v3/kv/txn"]);
    assert_eq!(store.replay_cache_usage().map(|(n, _)| n), Some(0));
}

#[test]
fn claims_are_never_answered_from_the_replay_cache() {
    let key = record_key();
    let store = cached_store();
    warm(&store, 100);
    let claim = value(processing(9, 0), None);
    for now in [100, 200] {
        let (answer, made) = run(
            &store,
            StoreOp::Begin(attempt(now)),
            now,
            vec![ok(read_answer(5, Some((&key, &claim, 4)), &[]))],
        );
        assert!(matches!(begun(answer), Ok(Begin::InFlight { .. })));
        assert_eq!(made.len(), 1, "a processing record is read from etcd every time");
    }
    // A record read as absent is claimed in etcd, and the claim is not kept either.
    let (answer, _) = run(
        &store,
        StoreOp::Begin(ClaimAttempt { scope: scope(1), ..attempt(300) }),
        300,
        vec![ok(written(6))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(store.replay_cache_usage(), Some((0, 0)));
}

#[test]
fn a_completion_this_worker_wrote_replays_without_a_call() {
    let key = record_key();
    let store = cached_store();
    let claim = claim_at_4();
    let completion = Completion {
        state: State::Succeeded,
        status: 201,
        snapshot: Some(snapshot()),
        now_ms: 500,
        ttl_ms: 10_000,
    };
    let (answer, _) = run(
        &store,
        StoreOp::Complete { claim, completion },
        500,
        vec![
            ok(range_answer(5, Some((&key, &value(processing(11, 0), None), 4)))),
            ok(granted()),
            ok(written(6)),
        ],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    let (answer, made) = run(&store, StoreOp::Begin(attempt(600)), 600, vec![]);
    assert_eq!(begun(answer), Ok(Begin::Replay(snapshot())));
    assert!(made.is_empty());
    // A completion etcd refused (the claim was lost) keeps nothing.
    let store = cached_store();
    let lost =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 500, ttl_ms: 10_000 };
    let (answer, _) = run(
        &store,
        StoreOp::Complete { claim, completion: lost },
        500,
        vec![
            ok(range_answer(5, Some((&key, &value(processing(11, 0), None), 4)))),
            ok(granted()),
            ok(refused(6)),
        ],
    );
    assert_eq!(settled(answer), Ok(Settled::Lost));
    assert_eq!(store.replay_cache_usage(), Some((0, 0)));
}
