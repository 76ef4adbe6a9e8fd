//! Auth: the token is fetched first and cached; a refused one (invalid, or older than an auth
//! change) is replaced once and the call sent again. One fetch per worker: the conversations that
//! need a token meanwhile wait for it, and its failure or timeout ends them all. Neither the
//! password nor the token is ever formatted.

use super::*;

fn with_auth() -> EtcdStore {
    EtcdStore::new(settings(Some(EtcdAuth { username: "idem".into(), password: "p\"w".into() })))
}

fn authenticated(token: &str) -> Canned {
    ok(format!(r#"{{{},"token":"{token}"}}"#, header(6)))
}

fn invalid_token() -> Canned {
    (Some(401), error_body("etcdserver: invalid auth token", 16).into_bytes())
}

#[test]
fn auth_authenticates_first_and_caches_the_token() {
    let store = with_auth();
    let (answer, made) = run(
        &store,
        StoreOp::Begin(attempt(0)),
        0,
        vec![
            authenticated(TOKEN),
            ok(read_answer(1, None, &[])),
            ok(granted()),
            ok(granted()),
            ok(written(2)),
        ],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(
        paths(&made),
        vec!["/v3/auth/authenticate", "/v3/kv/txn", "/v3/lease/grant", "/v3/lease/grant", "/v3/kv/txn"]
    );
    assert_eq!(made[0].body, r#"{"name":"idem","password":"p\"w"}"#);
    assert_eq!(made[0].token, None);
    assert!(made[1..].iter().all(|m| m.token.as_deref() == Some(TOKEN)));
    // The next conversation goes straight to etcd with the cached token.
    let (_, made) =
        run(&store, StoreOp::Begin(ClaimAttempt { scope: scope(2), ..attempt(1) }), 1, vec![ok(written(3))]);
    assert_eq!(made[0].token.as_deref(), Some(TOKEN));
}

#[test]
fn an_invalid_token_is_replaced_once_and_the_call_sent_again() {
    let store = with_auth();
    *store.token.borrow_mut() = Some("expired.1".into());
    let claim = claim_at_4();
    let (answer, made) = run(
        &store,
        StoreOp::Release(claim),
        0,
        vec![
            invalid_token(),
            authenticated("fresh.2"),
            ok(range_answer(5, Some((&record_key(), &value(processing(11, 0), None), 4)))),
            ok(written(6)),
        ],
    );
    assert_eq!(settled(answer), Ok(Settled::Done));
    assert_eq!(paths(&made), vec!["/v3/kv/range", "/v3/auth/authenticate", "/v3/kv/range", "/v3/kv/txn"]);
    assert_eq!(made[0].body, made[2].body, "the same call, sent again");
    assert_eq!(made[0].token.as_deref(), Some("expired.1"));
    assert_eq!(made[2].token.as_deref(), Some("fresh.2"));
    assert_eq!(store.token().as_deref(), Some("fresh.2"));

    // EtcdRefusal again with the fresh token: unavailable, no loop.
    let (answer, made) = run(
        &with_auth(),
        StoreOp::Release(claim),
        0,
        vec![authenticated("a.1"), invalid_token(), authenticated("b.2"), invalid_token()],
    );
    assert!(matches!(settled(answer), Err(StoreError::Unavailable(_))));
    assert_eq!(made.len(), 4);
    // Wrong credentials: unavailable, naming authentication.
    let wrong = (
        Some(400),
        error_body("etcdserver: authentication failed, invalid user ID or password", 3).into_bytes(),
    );
    let (answer, _) = run(&with_auth(), StoreOp::Begin(attempt(0)), 0, vec![wrong]);
    assert!(matches!(begun(answer), Err(StoreError::Unavailable(m)) if m.starts_with("authenticate:")));
    // Without auth configured an invalid-token answer is just unavailable.
    let (answer, made) = run(&plain_store(), StoreOp::Begin(attempt(0)), 0, vec![invalid_token()]);
    assert!(matches!(begun(answer), Err(StoreError::Unavailable(_))));
    assert_eq!(made.len(), 1);
}

/// etcd 3.4.23's gateway, captured: a JWT token issued before an auth change (here
/// `etcdctl user add other`) is refused on every range and txn with InvalidArgument; a call
/// without a token once auth is on, likewise. etcd's own client authenticates again on both.
fn old_revision() -> Canned {
    (Some(400), error_body("etcdserver: revision of auth store is old", 3).into_bytes())
}

fn user_empty() -> Canned {
    (Some(400), error_body("etcdserver: user name is empty", 3).into_bytes())
}

#[test]
fn a_token_older_than_an_auth_change_is_replaced_once_and_the_call_sent_again() {
    for (name, refusal) in [("old revision", old_revision()), ("user empty", user_empty())] {
        let store = with_auth();
        warm(&store, 0);
        *store.token.borrow_mut() = Some("before-the-change.1".into());
        let (answer, made) = run(
            &store,
            StoreOp::Begin(attempt(0)),
            0,
            vec![refusal.clone(), authenticated("after.2"), ok(written(2))],
        );
        assert!(matches!(begun(answer), Ok(Begin::Claimed(_))), "{name}");
        assert_eq!(paths(&made), vec!["/v3/kv/txn", "/v3/auth/authenticate", "/v3/kv/txn"], "{name}");
        assert_eq!(made[0].body, made[2].body, "{name}: the same call, sent again");
        assert_eq!(made[2].token.as_deref(), Some("after.2"), "{name}");
        // Once per conversation: refused again with the fresh token, unavailable, no loop.
        let fresh = with_auth();
        warm(&fresh, 0);
        let (answer, made) = run(
            &fresh,
            StoreOp::Begin(attempt(0)),
            0,
            vec![authenticated("a.1"), refusal.clone(), authenticated("b.2"), refusal.clone()],
        );
        assert!(
            matches!(begun(answer), Err(StoreError::Unavailable(m)) if m.contains("etcdserver:")),
            "{name}"
        );
        assert_eq!(made.len(), 4, "{name}");
        // Without credentials configured the answer says what etcd said, nothing is retried.
        let (answer, made) = run(&warm_store(0), StoreOp::Begin(attempt(0)), 0, vec![refusal.clone()]);
        assert!(
            matches!(begun(answer), Err(StoreError::Unavailable(m)) if m.contains("etcdserver:")),
            "{name}"
        );
        assert_eq!(made.len(), 1, "{name}");
    }
}

#[test]
fn the_password_and_the_token_are_never_formatted() {
    let auth = EtcdAuth { username: "idem".into(), password: "hunter2".into() };
    let shown = format!("{:?}", settings(Some(auth.clone())));
    assert!(shown.contains("idem") && !shown.contains("hunter2"), "{shown}");
    let store = EtcdStore::new(settings(Some(auth)));
    *store.token.borrow_mut() = Some(TOKEN.into());
    let shown = format!("{store:?}");
    assert!(!shown.contains("hunter2") && !shown.contains(TOKEN), "{shown}");
}

/// Starts a begin of scope `n` per entry and takes each one step.
fn started(
    store: &EtcdStore,
    scopes: std::ops::RangeInclusive<u8>,
    now_ms: u64,
) -> Vec<(EtcdConversation, Next)> {
    warm(store, now_ms);
    scopes
        .map(|n| {
            let mut e = store.start(StoreOp::Begin(ClaimAttempt { scope: scope(n), ..attempt(now_ms) }));
            let step = e.step(store, None, now_ms);
            (e, step)
        })
        .collect()
}

fn answer(canned: Canned) -> Option<Answer> {
    Some(Answer { status: canned.0, body: canned.1, grpc: None, from_envoy: false })
}

fn is_fetch(step: &Next) -> bool {
    matches!(
        step,
        Next::Call(Request { path: "/v3/auth/authenticate", token: None, timeout_ms: Some(2_000), .. })
    )
}

#[test]
fn conversations_started_before_any_token_share_one_fetch() {
    let store = with_auth();
    let mut conversations = started(&store, 1..=4, 0);
    let fetches = conversations.iter().filter(|(_, s)| is_fetch(s)).count();
    assert_eq!(fetches, 1, "{:?}", conversations.iter().map(|(_, s)| s).collect::<Vec<_>>());
    assert!(conversations[1..].iter().all(|(_, s)| *s == Next::Wait));
    // Stepped again before the token: still waiting.
    assert_eq!(conversations[1].0.step(&store, None, 100), Next::Wait);
    assert!(!store.take_fetch_ended());
    // The token arrives: the fetching conversation goes on with it, with the store's timeout...
    let (first, _) = &mut conversations[0];
    let step = first.step(&store, answer(authenticated(TOKEN)), 100);
    assert!(
        matches!(&step, Next::Call(Request { path: "/v3/kv/txn", token: Some(t), timeout_ms: Some(250), .. }) if t == TOKEN),
        "{step:?}"
    );
    // ...and the driver learns, once, that the waiting ones can go on: each with the token.
    assert!(store.take_fetch_ended());
    assert!(!store.take_fetch_ended());
    for (e, _) in &mut conversations[1..] {
        let step = e.step(&store, None, 100);
        assert!(
            matches!(&step, Next::Call(Request { path: "/v3/kv/txn", token: Some(t), .. }) if t == TOKEN),
            "{step:?}"
        );
        // And they finish as usual.
        assert!(matches!(e.step(&store, answer(ok(written(2))), 100), Next::Done(_)));
    }
}

#[test]
fn a_failed_fetch_ends_every_conversation_waiting_for_it_with_its_error() {
    let store = with_auth();
    let mut conversations = started(&store, 1..=3, 0);
    let wrong = (
        Some(400),
        error_body("etcdserver: authentication failed, invalid user ID or password", 3).into_bytes(),
    );
    let Next::Done(StoreAnswer::Begun(Err(error))) = conversations[0].0.step(&store, answer(wrong), 50)
    else {
        panic!("the fetching conversation fails")
    };
    assert!(matches!(&error, StoreError::Unavailable(m) if m.starts_with("authenticate:")), "{error:?}");
    assert!(store.take_fetch_ended());
    for (e, _) in &mut conversations[1..] {
        assert_eq!(e.step(&store, None, 50), Next::Done(StoreAnswer::Begun(Err(error.clone()))));
    }
    // The next conversation tries again: a failure is not kept as an answer.
    let (_, step) = started(&store, 4..=4, 60).pop().unwrap();
    assert!(is_fetch(&step), "{step:?}");
}

#[test]
fn a_fetch_whose_answer_never_comes_times_out_every_conversation_waiting_at_its_deadline() {
    let store = with_auth();
    // The driver gives up on the fetch's callout (Envoy's 504 after 2 s) and never steps its
    // conversation again: the others end at the fetch's deadline, when the driver steps them.
    let mut conversations = started(&store, 1..=3, 1_000);
    assert_eq!(conversations[1].0.step(&store, None, 2_999), Next::Wait);
    assert_eq!(
        conversations[1].0.step(&store, None, 3_000),
        Next::Done(StoreAnswer::Begun(Err(StoreError::TimedOut)))
    );
    assert!(store.take_fetch_ended());
    assert_eq!(
        conversations[2].0.step(&store, None, 3_050),
        Next::Done(StoreAnswer::Begun(Err(StoreError::TimedOut)))
    );
    // A new conversation fetches anew; one that arrives while a stale fetch is still marked in
    // flight (nobody stepped a waiter since its deadline) fetches anew as well.
    let (_, step) = started(&store, 4..=4, 3_100).pop().unwrap();
    assert!(is_fetch(&step), "{step:?}");
    let (_, step) = started(&store, 5..=5, 9_000).pop().unwrap();
    assert!(is_fetch(&step), "{step:?}");
}

#[test]
fn one_token_refused_to_several_conversations_is_fetched_again_once() {
    let store = with_auth();
    *store.token.borrow_mut() = Some("stale.1".into());
    let mut conversations = started(&store, 1..=3, 0);
    assert!(conversations
        .iter()
        .all(|(_, s)| matches!(s, Next::Call(Request { token: Some(t), .. }) if t == "stale.1")));
    // All three are refused; the first to hear it fetches, the others wait for that fetch.
    let steps: Vec<Next> =
        conversations.iter_mut().map(|(e, _)| e.step(&store, answer(old_revision()), 5)).collect();
    assert_eq!(steps.iter().filter(|s| is_fetch(s)).count(), 1, "{steps:?}");
    assert!(steps[1..].iter().all(|s| *s == Next::Wait), "{steps:?}");
    let step = conversations[0].0.step(&store, answer(authenticated("fresh.2")), 10);
    assert!(matches!(&step, Next::Call(Request { token: Some(t), .. }) if t == "fresh.2"), "{step:?}");
    assert!(store.take_fetch_ended());
    for (e, _) in &mut conversations[1..] {
        let step = e.step(&store, None, 10);
        assert!(
            matches!(&step, Next::Call(Request { path: "/v3/kv/txn", token: Some(t), .. }) if t == "fresh.2"),
            "{step:?}"
        );
    }
    // A refusal that arrives after the token was already replaced just sends again with the
    // new one, no fetch.
    let mut late = store.start(StoreOp::Begin(attempt(0)));
    *store.token.borrow_mut() = Some("stale.1".into());
    assert!(matches!(late.step(&store, None, 20), Next::Call(Request { .. })));
    *store.token.borrow_mut() = Some("fresh.2".into());
    let step = late.step(&store, answer(invalid_token()), 20);
    assert!(
        matches!(&step, Next::Call(Request { path: "/v3/kv/txn", token: Some(t), .. }) if t == "fresh.2"),
        "{step:?}"
    );
}
