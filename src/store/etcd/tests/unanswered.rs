//! Claims in doubt: a claim whose transaction went out without an answer, or whose call is given
//! up on, is given back by its owner token (its index keys too); a read, a grant, an answered
//! claim, a mark as outcome unknown or a settlement is never in doubt.

use super::*;

/// Steps `op` through `answers` (the last may fail it) and returns the conversation, finished.
fn conversation_after(
    store: &EtcdStore,
    op: StoreOp,
    now_ms: u64,
    answers: Vec<Canned>,
) -> (EtcdConversation, StoreAnswer) {
    let mut conversation = store.start(op);
    let mut answer = None;
    let mut answers = answers.into_iter();
    loop {
        match conversation.step(store, answer.take(), now_ms) {
            Next::Done(done) => return (conversation, done),
            Next::Call(_) => {
                let (status, body) = answers.next().expect("an answer for every call");
                answer = Some(Answer { status, body, grpc: None, from_envoy: false });
            }
            Next::Wait => panic!("no token fetch here"),
        }
    }
}

fn timed_out() -> Canned {
    (Some(504), b"upstream request timeout".to_vec())
}

#[test]
fn a_claim_whose_answer_never_came_is_given_back_by_its_owner() {
    // Envoy's timeout after the claim's transaction went out: etcd may hold the claim, and
    // nobody will forward the request.
    let store = warm_store(0);
    let (conversation, done) = conversation_after(&store, StoreOp::Begin(attempt(0)), 0, vec![timed_out()]);
    assert!(matches!(begun(done), Err(StoreError::Unavailable(_))));
    let claim = conversation.unanswered_claim().expect("the claim went out unanswered");
    assert_eq!(
        claim,
        Claim {
            scope: scope(1),
            owner: 11,
            locator: UNANSWERED,
            written: Some(processing(11, 0)),
            shard: 0,
            old_home: None,
            tombstone_s: 0
        }
    );

    // Its release is one transaction guarded by its lease key still holding its owner token,
    // and deletes the record and its lease key.
    let (answer, made) = run(&store, StoreOp::Release(claim), 300, vec![ok(written(6))]);
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
    let owner_guard = format!(
        r#""compare":[{{"key":"{}","target":"VALUE","result":"EQUAL","value":"{}"}}]"#,
        base64::encode(&lease_key()),
        base64::encode(&11u64.to_be_bytes())
    );
    assert!(made[0].body.contains(&owner_guard), "{}", made[0].body);
    for key in [record_key(), lease_key()] {
        let delete = format!(r#"{{"request_delete_range":{{"key":"{}"}}}}"#, base64::encode(&key));
        assert!(made[0].body.contains(&delete), "{}", made[0].body);
    }
    assert!(!made[0].body.contains("request_put"), "{}", made[0].body);

    // The claim never landed, or is another owner's now: nothing of this owner is left.
    let (answer, made) = run(&store, StoreOp::Release(claim), 300, vec![ok(refused(6))]);
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/txn"]);
}

#[test]
fn a_charged_unanswered_claim_gives_back_its_index_keys_too() {
    let store = warm_store(0);
    let a = charged_attempt(0, true);
    let (conversation, _) = conversation_after(&store, StoreOp::Begin(a), 0, vec![(None, Vec::new())]);
    let claim = conversation.unanswered_claim().expect("the claim went out unanswered");
    let index = store.index_keys(&claim.written.expect("the record the claim wrote"));
    assert!(!index.is_empty());
    let (_, made) = run(&store, StoreOp::Release(claim), 0, vec![ok(written(6))]);
    for key in index {
        let delete = format!(r#"{{"request_delete_range":{{"key":"{}"}}}}"#, base64::encode(&key));
        assert!(made[0].body.contains(&delete), "{}", made[0].body);
    }
}

#[test]
fn only_a_sent_claim_without_an_answer_is_in_doubt() {
    let key = record_key();
    // A read that failed claimed nothing (a worker without leases reads first).
    let (conversation, _) = conversation_after(&store(), StoreOp::Begin(attempt(0)), 0, vec![timed_out()]);
    assert_eq!(conversation.unanswered_claim(), None);
    // A lease grant that failed: the claim was never sent.
    let (conversation, _) = conversation_after(
        &store(),
        StoreOp::Begin(attempt(0)),
        0,
        vec![ok(read_answer(1, None, &[])), timed_out()],
    );
    assert_eq!(conversation.unanswered_claim(), None);
    // An answered claim is the caller's to settle.
    let (conversation, done) =
        conversation_after(&warm_store(0), StoreOp::Begin(attempt(0)), 0, vec![ok(written(2))]);
    assert!(matches!(begun(done), Ok(Begin::Claimed(_))));
    assert_eq!(conversation.unanswered_claim(), None);
    // A takeover's transaction that timed out is in doubt like a new claim's.
    let abandoned = value(processing(9, 0), None);
    let (conversation, _) = conversation_after(
        &warm_store(1_000),
        StoreOp::Begin(attempt(1_000)),
        1_000,
        vec![ok(read_answer(5, Some((&key, &abandoned, 4)), &[])), timed_out()],
    );
    let claim = conversation.unanswered_claim().expect("the takeover went out unanswered");
    assert_eq!((claim.owner, claim.locator), (11, UNANSWERED));
    // Marking a lease-ended record as outcome unknown claims nothing: a retry marks it again.
    let refusing = ClaimAttempt { on_lease_end: OnLeaseEnd::MarkUnknown, ..attempt(1_000) };
    let (conversation, _) = conversation_after(
        &warm_store(1_000),
        StoreOp::Begin(refusing),
        1_000,
        vec![ok(read_answer(5, Some((&key, &abandoned, 4)), &[])), timed_out()],
    );
    assert_eq!(conversation.unanswered_claim(), None);
    // Settlements are their claim's owner's, who retries them.
    let claim = Claim {
        scope: scope(1),
        owner: 11,
        locator: 4,
        written: Some(processing(11, 0)),
        shard: 0,
        old_home: None,
        tombstone_s: 0,
    };
    let (conversation, _) = conversation_after(&store(), StoreOp::Release(claim), 0, vec![timed_out()]);
    assert_eq!(conversation.unanswered_claim(), None);
}

#[test]
fn a_claim_whose_call_is_given_up_on_is_in_doubt() {
    // The worker never hands Envoy's timeout to the conversation: it gives up on it with the claim's
    // call out.
    let store = warm_store(0);
    let mut conversation = store.start(StoreOp::Begin(attempt(0)));
    assert!(matches!(conversation.step(&store, None, 0), Next::Call(_)));
    let claim = conversation.unanswered_claim().expect("the claim's call is out");
    assert_eq!((claim.owner, claim.locator, claim.written), (11, UNANSWERED, Some(processing(11, 0))));
    // A read's call out claims nothing (a worker without leases reads first).
    let cold = plain_store();
    let mut conversation = cold.start(StoreOp::Begin(attempt(0)));
    assert!(matches!(conversation.step(&cold, None, 0), Next::Call(_)));
    assert_eq!(conversation.unanswered_claim(), None);
}
