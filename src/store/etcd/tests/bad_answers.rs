//! What etcd or the driver gets wrong: every kind of bad answer makes the store unavailable, a
//! value that is not a v2 record (or under another scope's key) is corrupt and never written
//! over, and a driver out of step gets an error, not a panic.

use super::*;

#[test]
fn bad_answers_make_the_store_unavailable() {
    let cases: Vec<(&str, Canned)> = vec![
        ("callout failed", (None, Vec::new())),
        ("Envoy's timeout", (Some(504), b"upstream request timeout".to_vec())),
        ("Envoy's reset", (Some(503), b"upstream connect error or disconnect/reset before headers".to_vec())),
        (
            "etcd error body",
            (Some(400), error_body("invalid character 'g' looking for beginning of value", 3).into_bytes()),
        ),
        ("error body with 200", ok(error_body("etcdserver: too many requests", 14))),
        ("permission denied", (Some(403), error_body("etcdserver: permission denied", 7).into_bytes())),
        ("garbage", ok("<html>".into())),
        ("empty body", ok(String::new())),
        ("not UTF-8", (Some(200), vec![0xFF, 0xFE])),
        ("no header", ok(r#"{"succeeded":true,"responses":[]}"#.into())),
        ("revision not a number", ok(r#"{"header":{"revision":"x"}}"#.into())),
        ("responses not an array", ok(format!(r#"{{{},"responses":{{}}}}"#, header(1)))),
        // Present (the guard failed), yet no record in the answer.
        ("no record read", ok(format!("{{{}}}", header(1)))),
        (
            "key not base64",
            ok(format!(
                r#"{{{},"responses":[{{"response_range":{{"kvs":[{{"key":"*","mod_revision":"1"}}]}}}}]}}"#,
                header(1)
            )),
        ),
        ("too deep", ok(format!("{}1{}", "[".repeat(64), "]".repeat(64)))),
    ];
    for (name, answer) in cases {
        let (done, _) = run(&store(), StoreOp::Begin(attempt(0)), 0, vec![answer]);
        assert!(matches!(begun(done), Err(StoreError::Unavailable(_))), "{name}");
    }
    // A failed write's answer is as unusable as a failed read's.
    let claim = claim_at_4();
    let (done, _) = run(
        &store(),
        StoreOp::Release(claim),
        0,
        vec![
            ok(range_answer(5, Some((&record_key(), &value(processing(11, 0), None), 4)))),
            (Some(500), Vec::new()),
        ],
    );
    assert!(matches!(settled(done), Err(StoreError::Unavailable(_))));
}

#[test]
fn a_value_that_is_not_a_v2_record_is_corrupt_and_never_overwritten() {
    let key = record_key();
    let newer = {
        let mut v = value(processing(9, 0), None);
        v[0] = 3;
        v
    };
    let other_scope = value(Entry { scope: scope(2), ..processing(9, 0) }, None);
    for stored in [b"not a record".to_vec(), newer, other_scope, vec![2]] {
        let (answer, made) = run(
            &warm_store(20_000),
            StoreOp::Begin(attempt(20_000)),
            20_000,
            vec![ok(read_answer(5, Some((&key, &stored, 4)), &[]))],
        );
        assert!(matches!(begun(answer), Err(StoreError::Corrupt(_))), "{stored:?}");
        assert_eq!(made.len(), 1, "nothing is written over it");
        let claim = claim_at_4();
        let (answer, made) =
            run(&store(), StoreOp::Release(claim), 0, vec![ok(range_answer(5, Some((&key, &stored, 4))))]);
        assert!(matches!(settled(answer), Err(StoreError::Corrupt(_)) | Ok(Settled::Lost)), "{stored:?}");
        assert_eq!(made.len(), 1);
    }
}

/// A record a newer build wrote (a rollback on a shared etcd) is said to be one.
#[test]
fn a_newer_builds_record_is_said_to_be_one() {
    let key = record_key();
    let mut newer = value(processing(9, 0), None);
    newer[0] = 6;
    let (answer, _) = run(
        &warm_store(20_000),
        StoreOp::Begin(attempt(20_000)),
        20_000,
        vec![ok(read_answer(5, Some((&key, &newer, 4)), &[]))],
    );
    let Err(StoreError::Corrupt(said)) = begun(answer) else { panic!("refused") };
    assert_eq!(
        said,
        "etcd record: format version 6, written by a newer build of the filter (this one reads versions up to \
         5); left as it is"
    );
}

#[test]
fn a_driver_out_of_step_gets_an_error_not_a_panic() {
    let store = store();
    // An answer before any call.
    let mut conversation = store.start(StoreOp::Begin(attempt(0)));
    let early = conversation.step(
        &store,
        Some(Answer { status: Some(200), body: b"{}".to_vec(), grpc: None, from_envoy: false }),
        0,
    );
    assert!(matches!(early, Next::Done(StoreAnswer::Begun(Err(StoreError::Unavailable(_))))));
    // No answer to a call that was made.
    let claim = claim_at_4();
    let mut conversation = store.start(StoreOp::Release(claim));
    assert!(matches!(conversation.step(&store, None, 0), Next::Call(Request { .. })));
    let missing = conversation.step(&store, None, 0);
    assert!(matches!(missing, Next::Done(StoreAnswer::Settled(Err(StoreError::Unavailable(_))))));
}
