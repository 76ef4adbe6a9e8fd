//! A begin: a new record's claim is one transaction guarded by "absent" (after a read and the
//! grants when the worker lacks its leases), an existing record answers in that same round trip
//! (its lease key living says in flight, whatever this clock says), a takeover or a reuse is
//! guarded by the revision read, and a lost race reads again until it gives up as contention.

use super::*;

#[test]
fn a_new_record_is_one_guarded_transaction_once_its_leases_are_granted() {
    let store = store();
    let (answer, made) = run(
        &store,
        StoreOp::Begin(attempt(0)),
        0,
        vec![ok(read_answer(1, None, &[])), ok(granted()), ok(granted()), ok(written(2))],
    );
    let wrote = Some(processing(11, 0));
    assert_eq!(
        begun(answer),
        Ok(Begin::Claimed(Claim {
            scope: scope(1),
            owner: 11,
            locator: 2,
            written: wrote,
            shard: 0,
            old_home: None,
            tombstone_s: 0
        }))
    );
    assert_eq!(paths(&made), vec!["/v3/kv/txn", "/v3/lease/grant", "/v3/lease/grant", "/v3/kv/txn"]);
    let key = base64::encode(&record_key());
    let lease_key = base64::encode(&lease_key());
    let absent = format!(r#"{{"key":"{key}","target":"CREATE","result":"EQUAL","create_revision":"0"}}"#);
    let read_existing =
        format!(r#"[{{"request_range":{{"key":"{key}"}}}},{{"request_range":{{"key":"{lease_key}"}}}}]"#);
    // Grants are due: it reads first (a begin answered by a record never waits for them).
    assert_eq!(made[0].body, format!(r#"{{"compare":[{absent}],"success":[],"failure":{read_existing}}}"#));
    // The record expires at 10 s: its lease covers the window ending at 20 s, plus slack.
    assert_eq!(made[1].body, r#"{"TTL":"22","ID":"0"}"#);
    // The lease key's: the 1 s processing lease, then its completion's 1 s retry window (no
    // takeover while the owner may still write its outcome), the 1 s reuse window and 1 s of
    // slack.
    assert_eq!(made[2].body, r#"{"TTL":"4","ID":"0"}"#);
    let put = format!(
        r#"{{"request_put":{{"key":"{key}","value":"{}","lease":"{LEASE_ID}"}}}}"#,
        base64::encode(&value(processing(11, 0), None))
    );
    let put_lease_key = format!(
        r#"{{"request_put":{{"key":"{lease_key}","value":"{}","lease":"{LEASE_ID}"}}}}"#,
        base64::encode(&11u64.to_be_bytes())
    );
    // Absent: the puts (no quota to read); present: the record and its lease key.
    assert_eq!(
        made[3].body,
        format!(r#"{{"compare":[{absent}],"success":[{put},{put_lease_key}],"failure":{read_existing}}}"#)
    );
    assert!(made.iter().all(|m| m.token.is_none()));

    // The next claim in the same expiry window, within the claim lease's reuse window, reuses
    // both leases: one round trip.
    let (answer, made) = run(
        &store,
        StoreOp::Begin(ClaimAttempt { scope: scope(2), ..attempt(900) }),
        900,
        vec![ok(written(3))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(c)) if c.locator == 3));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
    assert!(made[0].body.contains(LEASE_ID));
    // Past the reuse window the lease key's lease is granted anew (its end must stay at least a
    // processing lease after every claim on it); the record's lease is still the window's.
    let (_, made) = run(
        &store,
        StoreOp::Begin(ClaimAttempt { scope: scope(3), ..attempt(1_000) }),
        1_000,
        vec![ok(read_answer(3, None, &[])), ok(granted()), ok(written(4))],
    );
    assert_eq!(paths(&made), vec!["/v3/kv/txn", "/v3/lease/grant", "/v3/kv/txn"]);
    assert_eq!(made[1].body, r#"{"TTL":"4","ID":"0"}"#);
}

#[test]
fn a_new_key_is_one_transaction_to_claim_and_one_to_complete_with_leases_cached() {
    let store = warm_store(0);
    let (answer, made) = run(&store, StoreOp::Begin(attempt(0)), 0, vec![ok(written(2))]);
    let Ok(Begin::Claimed(claim)) = begun(answer) else { panic!("not claimed") };
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
    // The completion's record lease (expiry at 10 s + 10 s) is cached too, as after any
    // completion in that window.
    store.remember_lease(window_end(20_000), LEASE_ID.parse().unwrap());
    let completion =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 10_000, ttl_ms: 10_000 };
    let (answer, made) = run(&store, StoreOp::Complete { claim, completion }, 10_000, vec![ok(written(3))]);
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
    // Guarded by the claim's revision, the record rewritten from what the claim wrote.
    assert!(
        made[0].body.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"2""#),
        "{}",
        made[0].body
    );
    let done = Entry { state: State::Succeeded, status: 201, expires_at_ms: 20_000, ..processing(11, 0) };
    assert!(made[0].body.contains(&base64::encode(&value(done, None))), "{}", made[0].body);
    // A release is one transaction too.
    let (answer, made) =
        run(&store, StoreOp::Begin(ClaimAttempt { scope: scope(2), ..attempt(0) }), 0, vec![ok(written(4))]);
    let Ok(Begin::Claimed(claim)) = begun(answer) else { panic!("not claimed") };
    assert_eq!(made.len(), 1);
    let (answer, made) = run(&store, StoreOp::Release(claim), 10, vec![ok(written(5))]);
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
    assert!(made[0].body.contains(r#""mod_revision":"4""#), "{}", made[0].body);
    // A release whose guard fails is lost.
    let (answer, _) = run(&store, StoreOp::Release(claim), 10, vec![ok(refused(6))]);
    assert_eq!(settled(answer), Ok(Settled::Lost));
}

#[test]
fn a_claim_whose_lease_key_lives_is_in_flight_whatever_this_clock_says() {
    // Written by an Envoy whose clock is behind this one's: by this clock the deadline (1 s) has
    // long passed, but etcd still holds the claim's lease key. Not taken over.
    let key = record_key();
    let running = value(processing(9, 0), None);
    let (answer, made) = run(
        &warm_store(27_000),
        StoreOp::Begin(attempt(27_000)),
        27_000,
        vec![ok(existing_answer(5, (&key, &running, 4), Some(9)))],
    );
    assert_eq!(begun(answer), Ok(Begin::InFlight { retry_after_ms: LIVE_CLAIM_RETRY_MS }));
    assert_eq!(made.len(), 1);
    // A lease key of another claim (an older one's, not yet collected) is no sign of life.
    let (answer, _) = run(
        &warm_store(1_000),
        StoreOp::Begin(attempt(1_000)),
        1_000,
        vec![ok(existing_answer(5, (&key, &running, 4), Some(8))), ok(written(6))],
    );
    assert!(matches!(begun(answer), Ok(Begin::TookOver(_))));
    // Before the deadline by this clock it is in flight with or without its lease key (a clock
    // behind the owner's never takes over early either).
    let (answer, _) = run(
        &warm_store(400),
        StoreOp::Begin(attempt(400)),
        400,
        vec![ok(existing_answer(5, (&key, &running, 4), None))],
    );
    assert_eq!(begun(answer), Ok(Begin::InFlight { retry_after_ms: 600 }));
}

#[test]
fn answers_about_an_existing_record_take_one_round_trip() {
    let key = record_key();
    let cases: Vec<(Vec<u8>, u64, Begin)> = vec![
        (value(processing(9, 0), None), 400, Begin::InFlight { retry_after_ms: 600 }),
        (value(completed(0, Some(snapshot())), Some(snapshot())), 10, Begin::Replay(snapshot())),
        (value(completed(0, None), None), 10, Begin::NotStored { status: 201 }),
        (
            value(Entry { fingerprint: Fingerprint([8; 32]), ..processing(9, 0) }, None),
            5_000,
            Begin::Mismatch,
        ),
    ];
    for (stored, now, expected) in cases {
        let (answer, made) = run(
            &warm_store(now),
            StoreOp::Begin(attempt(now)),
            now,
            vec![ok(read_answer(5, Some((&key, &stored, 4)), &[]))],
        );
        assert_eq!(begun(answer), Ok(expected.clone()), "{expected:?}");
        assert_eq!(made.len(), 1);
    }
}

#[test]
fn a_replay_on_a_worker_without_leases_is_one_read_and_no_grant() {
    // A worker that has not written into this window yet (another Envoy wrote the record):
    // it reads before granting, and the record answers.
    let key = record_key();
    let stored = value(completed(0, Some(snapshot())), Some(snapshot()));
    let (answer, made) = run(
        &store(),
        StoreOp::Begin(attempt(10)),
        10,
        vec![ok(read_answer(5, Some((&key, &stored, 4)), &[]))],
    );
    assert_eq!(begun(answer), Ok(Begin::Replay(snapshot())));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
    assert!(!made[0].body.contains("request_put"), "{}", made[0].body);
}

#[test]
fn a_takeover_and_a_reuse_are_guarded_by_the_observed_revision() {
    let key = record_key();
    // Lease ended, record live: taken over.
    let abandoned = value(processing(9, 0), None);
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(attempt(1_000)),
        1_000,
        vec![ok(read_answer(5, Some((&key, &abandoned, 4)), &[])), ok(written(6))],
    );
    let wrote = Some(processing(11, 1_000));
    assert_eq!(
        begun(answer),
        Ok(Begin::TookOver(Claim {
            scope: scope(1),
            owner: 11,
            locator: 6,
            written: wrote,
            shard: 0,
            old_home: None,
            tombstone_s: 0
        }))
    );
    assert!(
        made[1].body.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"4""#),
        "{}",
        made[1].body
    );
    // Expired (by its own expires_at, whatever etcd's lease says): a new record in its place.
    let old = value(completed(0, None), None);
    let (answer, made) = run(
        &warm_store(10_000),
        StoreOp::Begin(attempt(10_000)),
        10_000,
        vec![ok(read_answer(5, Some((&key, &old, 4)), &[])), ok(written(6))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert!(made[1].body.contains(r#""mod_revision":"4""#));
}

#[test]
fn a_lost_race_reads_again_and_gives_up_as_contention() {
    let key = record_key();
    // Lost once, then the winner's claim is there: in flight.
    let theirs = value(processing(12, 1_000), None);
    // Lost once (an abandoned claim taken over, raced by another taker), then the winner's
    // claim is there: in flight.
    let abandoned = value(processing(9, 0), None);
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(attempt(1_000)),
        1_000,
        vec![
            ok(read_answer(1, Some((&key, &abandoned, 1)), &[])),
            ok(refused(2)),
            ok(read_answer(2, Some((&key, &theirs, 2)), &[])),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::InFlight { retry_after_ms: 1_000 }));
    assert_eq!(made.len(), 3);
    // Lost every time.
    let mut answers = Vec::new();
    for _ in 0..TXN_ATTEMPTS {
        answers.extend([ok(read_answer(1, Some((&key, &abandoned, 1)), &[])), ok(refused(2))]);
    }
    let (answer, _) = run(&warm_store(1_000), StoreOp::Begin(attempt(1_000)), 1_000, answers);
    assert_eq!(begun(answer), Err(StoreError::Contention));
}
