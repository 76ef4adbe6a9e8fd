//! Completions and releases: one transaction guarded by the claim's revision that moves the
//! record's index keys (or deletes them with it), read first when the claim does not carry its
//! record; an outcome too large for etcd kept without its body; a completion sent again after
//! its write landed is done, not lost.

use super::*;

#[test]
fn complete_moves_the_record_and_its_index_to_the_ttl_lease() {
    let key = record_key();
    let charged = Entry {
        flags: FLAG_BODY_NOT_STORED | FLAG_PRINCIPAL_CHARGED,
        principal_tag: 0xAB,
        ..processing(11, 0)
    };
    let claim = claim_at_4();
    let completion = Completion {
        state: State::Succeeded,
        status: 201,
        snapshot: Some(snapshot()),
        now_ms: 500,
        ttl_ms: 10_000,
    };
    let (answer, made) = run(
        &store(),
        StoreOp::Complete { claim, completion: completion.clone() },
        500,
        vec![ok(range_answer(5, Some((&key, &value(charged, None), 4)))), ok(granted()), ok(written(6))],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/range", "/v3/lease/grant", "/v3/kv/txn"]);
    let stale = format!("/idem/q/p/{:016x}/{:016x}/{}", 0xAB, 1_000, hex(&[1; 32]));
    let moved = format!("/idem/q/p/{:016x}/{:016x}/{}", 0xAB, 10_500, hex(&[1; 32]));
    let done =
        Entry { state: State::Succeeded, status: 201, expires_at_ms: 10_500, ..charged }.with_body_flag(true);
    let txn = &made[2].body;
    assert!(txn.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"4""#), "{txn}");
    assert!(txn.contains(&format!(
        r#"{{"request_delete_range":{{"key":"{}"}}}}"#,
        base64::encode(stale.as_bytes())
    )));
    assert!(txn.contains(&base64::encode(moved.as_bytes())));
    assert!(txn.contains(&base64::encode(&value(done, Some(snapshot())))));

    // Not ours any more (another revision, or gone): Lost after one read, nothing written.
    for found in [Some((&key[..], &value(charged, None)[..], 9)), None] {
        let (answer, made) = run(
            &store(),
            StoreOp::Complete { claim, completion: completion.clone() },
            500,
            vec![ok(range_answer(9, found))],
        );
        assert_eq!(settled(answer), Ok(Settled::Lost));
        assert_eq!(made.len(), 1);
    }
    // Taken between the read and the write: the guard refuses it.
    let (answer, _) = run(
        &store(),
        StoreOp::Complete { claim, completion },
        500,
        vec![ok(range_answer(5, Some((&key, &value(charged, None), 4)))), ok(granted()), ok(refused(7))],
    );
    assert_eq!(settled(answer), Ok(Settled::Lost));
}

#[test]
fn an_outcome_too_large_for_etcd_is_kept_without_its_body() {
    let key = record_key();
    let claim = claim_at_4();
    let huge = Snapshot { body: vec![b'x'; ETCD_MAX_REQUEST_BYTES as usize], ..snapshot() };
    let completion = Completion {
        state: State::Succeeded,
        status: 201,
        snapshot: Some(huge),
        now_ms: 500,
        ttl_ms: 10_000,
    };
    let (answer, made) = run(
        &store(),
        StoreOp::Complete { claim, completion },
        500,
        vec![
            ok(range_answer(5, Some((&key, &value(processing(11, 0), None), 4)))),
            ok(granted()),
            ok(written(6)),
        ],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    let done = Entry { state: State::Succeeded, status: 201, expires_at_ms: 10_500, ..processing(11, 0) };
    assert!(made[2].body.contains(&base64::encode(&value(done, None))));
}

#[test]
fn release_deletes_the_record_and_its_index_without_a_lease() {
    let key = record_key();
    let claim = claim_at_4();
    let (answer, made) = run(
        &store(),
        StoreOp::Release(claim),
        0,
        vec![ok(range_answer(5, Some((&key, &value(processing(11, 0), None), 4)))), ok(written(6))],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/range", "/v3/kv/txn"]);
    assert!(made[1]
        .body
        .contains(&format!(r#"{{"request_delete_range":{{"key":"{}"}}}}"#, base64::encode(&key))));
    // A completed record cannot be released.
    let done = value(completed(0, None), None);
    let (answer, _) =
        run(&store(), StoreOp::Release(claim), 0, vec![ok(range_answer(5, Some((&key, &done, 4))))]);
    assert_eq!(settled(answer), Ok(Settled::Lost));
}

#[test]
fn a_completion_without_an_outcome_is_refused_before_any_call() {
    let claim = claim_at_4();
    let completion = Completion { state: State::Processing, status: 0, snapshot: None, now_ms: 0, ttl_ms: 1 };
    let (answer, made) = run(&store(), StoreOp::Complete { claim, completion }, 0, vec![]);
    assert!(matches!(settled(answer), Err(StoreError::Corrupt(_))));
    assert!(made.is_empty());
}

#[test]
fn a_stale_index_key_that_is_also_fresh_is_named_once() {
    // A completion whose expiry equals the claim's lease deadline (ttl shorter than the time
    // since the claim's lease was computed): etcd refuses a key named twice in one txn.
    let key = record_key();
    let charged = Entry {
        flags: FLAG_BODY_NOT_STORED | FLAG_PRINCIPAL_CHARGED,
        principal_tag: 0xAB,
        ..processing(11, 0)
    };
    let claim = claim_at_4();
    let completion =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 500, ttl_ms: 500 };
    let (answer, made) = run(
        &store(),
        StoreOp::Complete { claim, completion },
        500,
        vec![ok(range_answer(5, Some((&key, &value(charged, None), 4)))), ok(granted()), ok(written(6))],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    let index =
        base64::encode(format!("/idem/q/p/{:016x}/{:016x}/{}", 0xAB, 1_000, hex(&[1; 32])).as_bytes());
    assert_eq!(made[2].body.matches(&index).count(), 1, "{}", made[2].body);
}

#[test]
fn a_completion_sent_again_after_its_write_landed_is_done_not_lost() {
    // The first try's guarded write landed but its answer never came (Envoy timed the callout
    // out): the worker starts the completion again. The record now holds this claim's outcome
    // under a newer revision; that is this completion done, not a lost claim.
    let key = record_key();
    let claim = claim_at_4();
    let completion =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 500, ttl_ms: 10_000 };
    let ours = value(completed(500, None), None);
    let (answer, made) = run(
        &store(),
        StoreOp::Complete { claim, completion: completion.clone() },
        700,
        vec![ok(range_answer(6, Some((&key, &ours, 6))))],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(made.len(), 1, "nothing written again");

    // Another owner's outcome (a takeover that completed), or a claim still processing under
    // another revision: not ours, Lost.
    let theirs = value(Entry { owner: 12, ..completed(500, None) }, None);
    let taken = value(processing(12, 400), None);
    for found in [theirs, taken] {
        let (answer, _) = run(
            &store(),
            StoreOp::Complete { claim, completion: completion.clone() },
            700,
            vec![ok(range_answer(8, Some((&key, &found, 8))))],
        );
        assert_eq!(settled(answer), Ok(Settled::Lost));
    }
}

#[test]
fn a_completion_in_one_transaction_whose_guard_fails_after_its_write_landed_is_done() {
    // The claim carries its record: the completion is one transaction guarded by the claim's
    // revision. An earlier try's write landed (its answer never came): the guard fails, and the
    // failure branch's read of the record shows this claim's outcome: Done, nothing written.
    let key = record_key();
    let claim = Claim {
        scope: scope(1),
        owner: 11,
        locator: 4,
        written: Some(processing(11, 0)),
        shard: 0,
        old_home: None,
        tombstone_s: 0,
    };
    let completion =
        Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 500, ttl_ms: 10_000 };
    let store = store();
    store.remember_lease(window_end(10_500), LEASE_ID.parse().unwrap());
    let failed_with = |found: &[u8], rev: i64| {
        format!(
            r#"{{{},"responses":[{{"response_range":{{"header":{{"revision":"{rev}"}},"kvs":[{}],"count":"1"}}}}]}}"#,
            header(rev),
            kv_json(&key, found, rev)
        )
    };
    let ours = value(completed(500, None), None);
    let (answer, made) = run(
        &store,
        StoreOp::Complete { claim, completion: completion.clone() },
        700,
        vec![ok(failed_with(&ours, 6))],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"], "one call, nothing written again");
    assert!(made[0].body.contains(r#""mod_revision":"4""#), "{}", made[0].body);
    // Another owner's outcome, or a claim processing under another revision: Lost.
    let theirs = value(Entry { owner: 12, ..completed(500, None) }, None);
    let taken = value(processing(12, 400), None);
    for found in [theirs, taken] {
        let (answer, _) = run(
            &store,
            StoreOp::Complete { claim, completion: completion.clone() },
            700,
            vec![ok(failed_with(&found, 8))],
        );
        assert_eq!(settled(answer), Ok(Settled::Lost));
    }
}
