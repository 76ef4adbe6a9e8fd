//! The exchanges against canned etcd answers, in the exact JSON etcd 3.4.23's gateway emits
//! (captured from a real etcd): call sequences, decisions, and every kind of bad answer.

// Test code: a failed expectation is the test's failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::keys::hex;
use super::leases::CACHED_LEASES;
use super::*;
use crate::identity::fingerprint::Fingerprint;
use crate::store::record::{Snapshot, FLAG_BODY_NOT_STORED, FLAG_PRINCIPAL_CHARGED};
use crate::store::{QuotaCharge, StoreAnswer, UnknownOutcome};

const HEADER: &str = r#""header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"REV","raft_term":"2"}"#;
const LEASE_ID: &str = "4111120396376355078";
const TOKEN: &str = "UEZGznJjALBlLYZq.24";

fn header(rev: i64) -> String {
    HEADER.replace("REV", &rev.to_string())
}

fn kv_json(key: &[u8], value: &[u8], mod_revision: i64) -> String {
    let value =
        if value.is_empty() { String::new() } else { format!(r#","value":"{}""#, base64::encode(value)) };
    format!(
        r#"{{"key":"{}","create_revision":"{mod_revision}","mod_revision":"{mod_revision}","version":"1"{value}}}"#,
        base64::encode(key)
    )
}

/// The answer to a begin's read: absent (the guard held: the quota ranges, if any), or the
/// record and no lease key (the failure branch: no `succeeded`).
fn read_answer(rev: i64, record: Option<(&[u8], &[u8], i64)>, quota: &[String]) -> String {
    match record {
        None => format!(r#"{{{},"succeeded":true,"responses":[{}]}}"#, header(rev), quota.join(",")),
        Some(found) => existing_answer(rev, found, None),
    }
}

/// A begin's read of an existing record, with its lease key holding `lease_key_owner`.
fn existing_answer(rev: i64, (k, v, m): (&[u8], &[u8], i64), lease_key_owner: Option<u64>) -> String {
    let range = |kv: Option<String>| match kv {
        None => format!(r#"{{"response_range":{{"header":{{"revision":"{rev}"}}}}}}"#),
        Some(kv) => {
            format!(r#"{{"response_range":{{"header":{{"revision":"{rev}"}},"kvs":[{kv}],"count":"1"}}}}"#)
        }
    };
    let lease_key = lease_key_owner.map(|owner| kv_json(&lease_key(), &owner.to_be_bytes(), m));
    format!(r#"{{{},"responses":[{},{}]}}"#, header(rev), range(Some(kv_json(k, v, m))), range(lease_key))
}

/// A quota index range (keys_only, limit 1): `count` live keys, the first of them `first`.
fn index_answer(rev: i64, count: i64, first: Option<&[u8]>) -> String {
    match first {
        None => format!(r#"{{"response_range":{{"header":{{"revision":"{rev}"}}}}}}"#),
        Some(k) => {
            let more = if count > 1 { r#","more":true"# } else { "" };
            format!(
                r#"{{"response_range":{{"header":{{"revision":"{rev}"}},"kvs":[{}]{more},"count":"{count}"}}}}"#,
                kv_json(k, b"", 4)
            )
        }
    }
}

fn range_answer(rev: i64, record: Option<(&[u8], &[u8], i64)>) -> String {
    match record {
        None => format!("{{{}}}", header(rev)),
        Some((k, v, m)) => format!(r#"{{{},"kvs":[{}],"count":"1"}}"#, header(rev), kv_json(k, v, m)),
    }
}

fn written(rev: i64) -> String {
    format!(
        r#"{{{},"succeeded":true,"responses":[{{"response_put":{{"header":{{"revision":"{rev}"}}}}}}]}}"#,
        header(rev)
    )
}

/// A guarded txn whose compare failed (empty failure branch): no `succeeded`, no `responses`.
fn refused(rev: i64) -> String {
    format!("{{{}}}", header(rev))
}

fn granted() -> String {
    format!(r#"{{{},"ID":"{LEASE_ID}","TTL":"22"}}"#, header(1))
}

fn error_body(message: &str, code: i64) -> String {
    format!(r#"{{"error":"{message}","message":"{message}","code":{code}}}"#)
}

/// An answer as the glue hands it over: status (None: the callout failed) and body.
type Canned = (Option<u16>, Vec<u8>);

fn ok(body: String) -> Canned {
    (Some(200), body.into_bytes())
}

/// A store's settings as these tests use them (cluster `etcd`, keys under `/idem/`); also the
/// watch tests' and the glue's remote wait tests'.
pub(crate) fn settings(auth: Option<EtcdAuth>) -> EtcdSettings {
    EtcdSettings {
        cluster: "etcd".into(),
        prefix: "/idem/".into(),
        timeout_ms: 250,
        on_error: OnStoreError::FailClosed,
        auth,
        auth_timeout_ms: 2_000,
        replay_cache: None,
        protocol: Default::default(),
    }
}

fn store() -> EtcdStore {
    EtcdStore::new(settings(None))
}

fn plain_store() -> EtcdStore {
    store()
}

/// Caches the leases a claim of `attempt(now_ms)` puts on, as a worker that made a claim
/// moments ago has them: the claim is then one transaction.
fn warm(store: &EtcdStore, now_ms: u64) {
    let id: i64 = LEASE_ID.parse().unwrap();
    store.remember_lease(window_end(now_ms + 10_000), id);
    store.remember_claim_lease(1_000, now_ms, id);
}

fn warm_store(now_ms: u64) -> EtcdStore {
    let store = store();
    warm(&store, now_ms);
    store
}

/// A new claim's transaction whose guard held: the puts, then the quota ranges if any.
fn claimed_answer(rev: i64, quota: &[String]) -> String {
    let mut responses = vec![format!(r#"{{"response_put":{{"header":{{"revision":"{rev}"}}}}}}"#)];
    responses.extend(quota.iter().cloned());
    format!(r#"{{{},"succeeded":true,"responses":[{}]}}"#, header(rev), responses.join(","))
}

/// A call the exchange made.
#[derive(Debug)]
struct Made {
    path: &'static str,
    body: String,
    token: Option<String>,
}

/// Runs `op` feeding `answers` in order; every answer must be asked for, and nothing more.
fn run(store: &EtcdStore, op: StoreOp, now_ms: u64, answers: Vec<Canned>) -> (StoreAnswer, Vec<Made>) {
    let mut exchange = store.start(op);
    let mut made = Vec::new();
    let mut answers = answers.into_iter();
    let mut answer = None;
    loop {
        match exchange.step(store, answer.take(), now_ms) {
            Next::Done(done) => {
                assert!(answers.next().is_none(), "answers left over after {made:?}");
                // A finished exchange stays finished.
                assert!(matches!(exchange.step(store, None, now_ms), Next::Done(_)));
                return (done, made);
            }
            Next::Wait => panic!("no other exchange fetches a token: {made:?}"),
            Next::Call(Request { path, body, token, .. }) => {
                made.push(Made { path, body: String::from_utf8(body).unwrap(), token });
                let (status, body) = answers.next().unwrap_or_else(|| panic!("no answer left for {made:?}"));
                answer = Some(Answer { status, body, grpc: None });
            }
        }
    }
}

fn paths(made: &[Made]) -> Vec<&'static str> {
    made.iter().map(|m| m.path).collect()
}

fn scope(n: u8) -> ScopeId {
    ScopeId([n; 32])
}

use crate::identity::scope::ScopeId;

fn attempt(now_ms: u64) -> ClaimAttempt {
    ClaimAttempt {
        scope: scope(1),
        fingerprint: Fingerprint([7; 32]),
        owner: 11,
        now_ms,
        lease_ms: 1_000,
        ttl_ms: 10_000,
        quota: None,
        unknown_outcome: UnknownOutcome::Takeover,
        label: None,
    }
}

fn record_key() -> Vec<u8> {
    let mut key = b"/idem/r/".to_vec();
    key.extend_from_slice(hex(&[1; 32]).as_bytes());
    key
}

fn lease_key() -> Vec<u8> {
    let mut key = b"/idem/l/".to_vec();
    key.extend_from_slice(hex(&[1; 32]).as_bytes());
    key
}

fn processing(owner: u64, at: u64) -> Entry {
    Entry {
        position: 0,
        state: State::Processing,
        flags: FLAG_BODY_NOT_STORED,
        status: 0,
        scope: scope(1),
        fingerprint: Fingerprint([7; 32]),
        owner,
        lease_deadline_ms: at + 1_000,
        expires_at_ms: at + 10_000,
        charged_at_ms: at,
        tenant_tag: 0,
        principal_tag: 0,
    }
}

fn value(entry: Entry, snapshot: Option<Snapshot>) -> Vec<u8> {
    record::encode_slot(&SlotValue { entry, snapshot, label: None })
}

fn snapshot() -> Snapshot {
    Snapshot {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: b"{}".to_vec(),
    }
}

fn completed(at: u64, snapshot: Option<Snapshot>) -> Entry {
    Entry { state: State::Succeeded, status: 201, expires_at_ms: at + 10_000, ..processing(11, 0) }
        .with_body_flag(snapshot.is_some())
}

trait BodyFlag {
    fn with_body_flag(self, stored: bool) -> Self;
}
impl BodyFlag for Entry {
    fn with_body_flag(mut self, stored: bool) -> Entry {
        if stored {
            self.flags &= !FLAG_BODY_NOT_STORED;
        } else {
            self.flags |= FLAG_BODY_NOT_STORED;
        }
        self
    }
}

fn begun(answer: StoreAnswer) -> Result<Begin, StoreError> {
    match answer {
        StoreAnswer::Begun(b) => b,
        other => panic!("{other:?}"),
    }
}

fn settled(answer: StoreAnswer) -> Result<Settled, StoreError> {
    match answer {
        StoreAnswer::Settled(s) => s,
        other => panic!("{other:?}"),
    }
}

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
        Ok(Begin::Claimed(Claim { scope: scope(1), owner: 11, locator: 2, written: wrote }))
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
    // The lease key's: the 1 s processing lease, the 1 s reuse window and 1 s of slack.
    assert_eq!(made[2].body, r#"{"TTL":"3","ID":"0"}"#);
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
    assert_eq!(made[1].body, r#"{"TTL":"3","ID":"0"}"#);
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
        Ok(Begin::TookOver(Claim { scope: scope(1), owner: 11, locator: 6, written: wrote }))
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

fn charged_attempt(now_ms: u64, tenant: bool) -> ClaimAttempt {
    ClaimAttempt {
        quota: Some(QuotaCharge {
            tenant: tenant.then_some([3; 32]),
            principal: Some([4; 32]),
            per_tenant: 5,
            per_principal: 2,
        }),
        ..attempt(now_ms)
    }
}

/// A quota index range as read after the claim's puts (keys_only, limit 2): `count` live
/// keys, the first of them `first` (the claim's own key among them).
fn index_after_put(rev: i64, count: i64, first: &[&[u8]]) -> String {
    let kvs: Vec<String> = first.iter().map(|k| kv_json(k, b"", 4)).collect();
    let more = if count > first.len() as i64 { r#","more":true"# } else { "" };
    format!(
        r#"{{"response_range":{{"header":{{"revision":"{rev}"}},"kvs":[{}]{more},"count":"{count}"}}}}"#,
        kvs.join(",")
    )
}

#[test]
fn quotas_are_counted_by_live_index_ranges_and_charged_with_the_record() {
    let principal_prefix = format!("/idem/q/p/{:016x}/", u64::from_be_bytes([4; 8]));
    let tenant_prefix = format!("/idem/q/t/{:016x}/", u64::from_be_bytes([3; 8]));
    // The claim's own index keys count until its lease ends (2 s).
    let own_principal = format!("{principal_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    let own_tenant = format!("{tenant_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    // Room (one other live record, bound 2): claimed in one transaction that puts one index
    // key per identity and reads the live ranges after the puts.
    let other = format!("{principal_prefix}{:016x}/{}", 2_500, hex(&[9; 32]));
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, true)),
        1_000,
        vec![ok(claimed_answer(
            6,
            &[
                index_after_put(6, 1, &[own_tenant.as_bytes()]),
                index_after_put(6, 2, &[own_principal.as_bytes(), other.as_bytes()]),
            ],
        ))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(made.len(), 1);
    let body = &made[0].body;
    let success = &body[..body.find(r#""failure""#).unwrap()];
    for index in [&own_tenant, &own_principal] {
        assert!(success.contains(&base64::encode(index.as_bytes())), "{index}");
    }
    // The live range starts just after now and ends after the identity's last key; it comes
    // after the puts.
    let from = format!("{principal_prefix}{:016x}", 1_001);
    let to = format!("/idem/q/p/{:016x}0", u64::from_be_bytes([4; 8]));
    let range = format!(
        r#"{{"request_range":{{"key":"{}","range_end":"{}","limit":"2","keys_only":true}}}}"#,
        base64::encode(from.as_bytes()),
        base64::encode(to.as_bytes())
    );
    let at = success.find(&range).unwrap_or_else(|| panic!("{body}"));
    assert!(success.find(&base64::encode(own_principal.as_bytes())).unwrap() < at);
}

#[test]
fn a_new_claim_over_its_quota_is_undone() {
    let principal_prefix = format!("/idem/q/p/{:016x}/", u64::from_be_bytes([4; 8]));
    let tenant_prefix = format!("/idem/q/t/{:016x}/", u64::from_be_bytes([3; 8]));
    let own_principal = format!("{principal_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    let own_tenant = format!("{tenant_prefix}{:016x}/{}", 2_000, hex(&[1; 32]));
    // Two other live records (bound 2), one stopping at 1.5 s, one at 2.5 s: the claim's own
    // key (2 s) sorts between them. EtcdRefusal, retry when the first other stops counting.
    let first = format!("{principal_prefix}{:016x}/{}", 1_500, hex(&[9; 32]));
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(claimed_answer(6, &[index_after_put(6, 3, &[first.as_bytes(), own_principal.as_bytes()])])),
            ok(written(7)),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::QuotaExceeded { retry_after_ms: 500, tenant: false }));
    assert_eq!(paths(&made), vec!["/v3/kv/txn", "/v3/kv/txn"]);
    // The undo deletes what the claim wrote, guarded by the claim's revision.
    let undo = &made[1].body;
    assert!(undo.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"6""#), "{undo}");
    for key in [own_principal.clone().into_bytes(), record_key(), lease_key()] {
        let delete = format!(r#"{{"request_delete_range":{{"key":"{}"}}}}"#, base64::encode(&key));
        assert!(undo.contains(&delete), "{undo}");
    }
    assert!(!undo.contains("request_put"), "{undo}");
    // The own key first: the hint is the next key's.
    let later = format!("{principal_prefix}{:016x}/{}", 2_500, hex(&[9; 32]));
    let (answer, _) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(claimed_answer(6, &[index_after_put(6, 3, &[own_principal.as_bytes(), later.as_bytes()])])),
            ok(refused(8)),
        ],
    );
    // (A guard lost meanwhile changes nothing: the claim was over its quota.)
    assert_eq!(begun(answer), Ok(Begin::QuotaExceeded { retry_after_ms: 1_500, tenant: false }));
    // The tenant is checked first.
    let tenant_first = format!("{tenant_prefix}{:016x}/{}", 3_000, hex(&[9; 32]));
    let (answer, _) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, true)),
        1_000,
        vec![
            ok(claimed_answer(
                6,
                &[
                    index_after_put(6, 6, &[own_tenant.as_bytes(), tenant_first.as_bytes()]),
                    index_after_put(6, 1, &[own_principal.as_bytes()]),
                ],
            )),
            ok(written(7)),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::QuotaExceeded { retry_after_ms: 2_000, tenant: true }));
    // At the bound exactly, with the claim's own key: room.
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![ok(claimed_answer(6, &[index_after_put(6, 2, &[own_principal.as_bytes(), later.as_bytes()])]))],
    );
    assert!(matches!(begun(answer), Ok(Begin::Claimed(_))));
    assert_eq!(made.len(), 1);
}

#[test]
fn answers_about_an_existing_record_never_read_the_quota() {
    // Issue 18 item 8: a replay, a 409 or a mismatch costs the same whatever the caller's
    // live records: the quota indexes are read only when a claim is about to be made.
    let key = record_key();
    let done = value(completed(0, Some(snapshot())), Some(snapshot()));
    let (answer, made) = run(
        &warm_store(10),
        StoreOp::Begin(charged_attempt(10, true)),
        10,
        vec![ok(read_answer(5, Some((&key, &done, 4)), &[]))],
    );
    assert_eq!(begun(answer), Ok(Begin::Replay(snapshot())));
    assert_eq!(made.len(), 1);
    // The quota ranges are in the branch etcd runs only when the record is absent.
    let read = &made[0].body;
    let failure = &read[read.find(r#""failure""#).unwrap()..];
    assert!(!failure.contains("range_end"), "the quota is read only if the record is absent: {read}");
    // A takeover of an abandoned claim reads the quota in a second call, guarded by the
    // revision it saw (a record changed meanwhile is read again).
    let abandoned = value(processing(9, 0), None);
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(read_answer(5, Some((&key, &abandoned, 4)), &[])),
            ok(format!(r#"{{{},"succeeded":true,"responses":[{}]}}"#, header(5), index_answer(5, 0, None))),
            ok(written(6)),
        ],
    );
    assert!(matches!(begun(answer), Ok(Begin::TookOver(_))), "{made:?}");
    assert!(made[1].body.contains(r#""target":"MOD","result":"EQUAL","mod_revision":"4""#));
    assert!(made[1].body.contains("range_end"));
    let (answer, made) = run(
        &warm_store(1_000),
        StoreOp::Begin(charged_attempt(1_000, false)),
        1_000,
        vec![
            ok(read_answer(5, Some((&key, &abandoned, 4)), &[])),
            ok(refused(6)),
            ok(read_answer(6, Some((&key, &value(completed(0, None), None), 6)), &[])),
        ],
    );
    assert_eq!(begun(answer), Ok(Begin::NotStored { status: 201 }));
    assert_eq!(made.len(), 3);
}

#[test]
fn complete_moves_the_record_and_its_index_to_the_ttl_lease() {
    let key = record_key();
    let charged = Entry {
        flags: FLAG_BODY_NOT_STORED | FLAG_PRINCIPAL_CHARGED,
        principal_tag: 0xAB,
        ..processing(11, 0)
    };
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
    // Lost twice in one exchange: etcd is not keeping leases; the store is unusable.
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
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
        let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
        let (answer, made) =
            run(&store(), StoreOp::Release(claim), 0, vec![ok(range_answer(5, Some((&key, &stored, 4))))]);
        assert!(matches!(settled(answer), Err(StoreError::Corrupt(_)) | Ok(Settled::Lost)), "{stored:?}");
        assert_eq!(made.len(), 1);
    }
}

#[test]
fn a_completion_without_an_outcome_is_refused_before_any_call() {
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
    let completion = Completion { state: State::Processing, status: 0, snapshot: None, now_ms: 0, ttl_ms: 1 };
    let (answer, made) = run(&store(), StoreOp::Complete { claim, completion }, 0, vec![]);
    assert!(matches!(settled(answer), Err(StoreError::Corrupt(_))));
    assert!(made.is_empty());
}

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
    // The next exchange goes straight to etcd with the cached token.
    let (_, made) =
        run(&store, StoreOp::Begin(ClaimAttempt { scope: scope(2), ..attempt(1) }), 1, vec![ok(written(3))]);
    assert_eq!(made[0].token.as_deref(), Some(TOKEN));
}

#[test]
fn an_invalid_token_is_replaced_once_and_the_call_sent_again() {
    let store = with_auth();
    *store.token.borrow_mut() = Some("expired.1".into());
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
        // Once per exchange: refused again with the fresh token, unavailable, no loop.
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
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
fn a_driver_out_of_step_gets_an_error_not_a_panic() {
    let store = store();
    // An answer before any call.
    let mut exchange = store.start(StoreOp::Begin(attempt(0)));
    let early =
        exchange.step(&store, Some(Answer { status: Some(200), body: b"{}".to_vec(), grpc: None }), 0);
    assert!(matches!(early, Next::Done(StoreAnswer::Begun(Err(StoreError::Unavailable(_))))));
    // No answer to a call that was made.
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
    let mut exchange = store.start(StoreOp::Release(claim));
    assert!(matches!(exchange.step(&store, None, 0), Next::Call(Request { .. })));
    let missing = exchange.step(&store, None, 0);
    assert!(matches!(missing, Next::Done(StoreAnswer::Settled(Err(StoreError::Unavailable(_))))));
}

fn cached_store() -> EtcdStore {
    let replay_cache = Some(cache::ReplayCacheSettings { entries: 8, max_bytes: 1 << 20 });
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
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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

#[test]
fn a_completion_sent_again_after_its_write_landed_is_done_not_lost() {
    // The first try's guarded write landed but its answer never came (Envoy timed the callout
    // out): the glue starts the completion again. The record now holds this claim's outcome
    // under a newer revision; that is this completion done, not a lost claim.
    let key = record_key();
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: None };
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
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: Some(processing(11, 0)) };
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

/// Starts a begin of scope `n` per entry and takes each one step.
fn started(store: &EtcdStore, scopes: std::ops::RangeInclusive<u8>, now_ms: u64) -> Vec<(Exchange, Next)> {
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
    Some(Answer { status: canned.0, body: canned.1, grpc: None })
}

fn is_fetch(step: &Next) -> bool {
    matches!(
        step,
        Next::Call(Request { path: "/v3/auth/authenticate", token: None, timeout_ms: Some(2_000), .. })
    )
}

#[test]
fn exchanges_started_before_any_token_share_one_fetch() {
    let store = with_auth();
    let mut exchanges = started(&store, 1..=4, 0);
    let fetches = exchanges.iter().filter(|(_, s)| is_fetch(s)).count();
    assert_eq!(fetches, 1, "{:?}", exchanges.iter().map(|(_, s)| s).collect::<Vec<_>>());
    assert!(exchanges[1..].iter().all(|(_, s)| *s == Next::Wait));
    // Stepped again before the token: still waiting.
    assert_eq!(exchanges[1].0.step(&store, None, 100), Next::Wait);
    assert!(!store.take_fetch_ended());
    // The token arrives: the fetching exchange goes on with it, with the store's timeout...
    let (first, _) = &mut exchanges[0];
    let step = first.step(&store, answer(authenticated(TOKEN)), 100);
    assert!(
        matches!(&step, Next::Call(Request { path: "/v3/kv/txn", token: Some(t), timeout_ms: Some(250), .. }) if t == TOKEN),
        "{step:?}"
    );
    // ...and the driver learns, once, that the waiting ones can go on: each with the token.
    assert!(store.take_fetch_ended());
    assert!(!store.take_fetch_ended());
    for (e, _) in &mut exchanges[1..] {
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
fn a_failed_fetch_ends_every_exchange_waiting_for_it_with_its_error() {
    let store = with_auth();
    let mut exchanges = started(&store, 1..=3, 0);
    let wrong = (
        Some(400),
        error_body("etcdserver: authentication failed, invalid user ID or password", 3).into_bytes(),
    );
    let Next::Done(StoreAnswer::Begun(Err(error))) = exchanges[0].0.step(&store, answer(wrong), 50) else {
        panic!("the fetching exchange fails")
    };
    assert!(matches!(&error, StoreError::Unavailable(m) if m.starts_with("authenticate:")), "{error:?}");
    assert!(store.take_fetch_ended());
    for (e, _) in &mut exchanges[1..] {
        assert_eq!(e.step(&store, None, 50), Next::Done(StoreAnswer::Begun(Err(error.clone()))));
    }
    // The next exchange tries again: a failure is not kept as an answer.
    let (_, step) = started(&store, 4..=4, 60).pop().unwrap();
    assert!(is_fetch(&step), "{step:?}");
}

#[test]
fn a_fetch_whose_answer_never_comes_times_out_every_exchange_waiting_at_its_deadline() {
    let store = with_auth();
    // The driver gives up on the fetch's callout (Envoy's 504 after 2 s) and never steps its
    // exchange again: the others end at the fetch's deadline, when the driver steps them.
    let mut exchanges = started(&store, 1..=3, 1_000);
    assert_eq!(exchanges[1].0.step(&store, None, 2_999), Next::Wait);
    assert_eq!(
        exchanges[1].0.step(&store, None, 3_000),
        Next::Done(StoreAnswer::Begun(Err(StoreError::TimedOut)))
    );
    assert!(store.take_fetch_ended());
    assert_eq!(
        exchanges[2].0.step(&store, None, 3_050),
        Next::Done(StoreAnswer::Begun(Err(StoreError::TimedOut)))
    );
    // A new exchange fetches anew; one that arrives while a stale fetch is still marked in
    // flight (nobody stepped a waiter since its deadline) fetches anew as well.
    let (_, step) = started(&store, 4..=4, 3_100).pop().unwrap();
    assert!(is_fetch(&step), "{step:?}");
    let (_, step) = started(&store, 5..=5, 9_000).pop().unwrap();
    assert!(is_fetch(&step), "{step:?}");
}

#[test]
fn one_token_refused_to_several_exchanges_is_fetched_again_once() {
    let store = with_auth();
    *store.token.borrow_mut() = Some("stale.1".into());
    let mut exchanges = started(&store, 1..=3, 0);
    assert!(exchanges
        .iter()
        .all(|(_, s)| matches!(s, Next::Call(Request { token: Some(t), .. }) if t == "stale.1")));
    // All three are refused; the first to hear it fetches, the others wait for that fetch.
    let steps: Vec<Next> =
        exchanges.iter_mut().map(|(e, _)| e.step(&store, answer(old_revision()), 5)).collect();
    assert_eq!(steps.iter().filter(|s| is_fetch(s)).count(), 1, "{steps:?}");
    assert!(steps[1..].iter().all(|s| *s == Next::Wait), "{steps:?}");
    let step = exchanges[0].0.step(&store, answer(authenticated("fresh.2")), 10);
    assert!(matches!(&step, Next::Call(Request { token: Some(t), .. }) if t == "fresh.2"), "{step:?}");
    assert!(store.take_fetch_ended());
    for (e, _) in &mut exchanges[1..] {
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

/// Steps `op` through `answers` (the last may fail it) and returns the exchange, finished.
fn exchange_after(
    store: &EtcdStore,
    op: StoreOp,
    now_ms: u64,
    answers: Vec<Canned>,
) -> (Exchange, StoreAnswer) {
    let mut exchange = store.start(op);
    let mut answer = None;
    let mut answers = answers.into_iter();
    loop {
        match exchange.step(store, answer.take(), now_ms) {
            Next::Done(done) => return (exchange, done),
            Next::Call(_) => {
                let (status, body) = answers.next().expect("an answer for every call");
                answer = Some(Answer { status, body, grpc: None });
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
    let (exchange, done) = exchange_after(&store, StoreOp::Begin(attempt(0)), 0, vec![timed_out()]);
    assert!(matches!(begun(done), Err(StoreError::Unavailable(_))));
    let claim = exchange.unanswered_claim().expect("the claim went out unanswered");
    assert_eq!(
        claim,
        Claim { scope: scope(1), owner: 11, locator: UNANSWERED, written: Some(processing(11, 0)) }
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
    let (exchange, _) = exchange_after(&store, StoreOp::Begin(a), 0, vec![(None, Vec::new())]);
    let claim = exchange.unanswered_claim().expect("the claim went out unanswered");
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
    let (exchange, _) = exchange_after(&store(), StoreOp::Begin(attempt(0)), 0, vec![timed_out()]);
    assert_eq!(exchange.unanswered_claim(), None);
    // A lease grant that failed: the claim was never sent.
    let (exchange, _) = exchange_after(
        &store(),
        StoreOp::Begin(attempt(0)),
        0,
        vec![ok(read_answer(1, None, &[])), timed_out()],
    );
    assert_eq!(exchange.unanswered_claim(), None);
    // An answered claim is the caller's to settle.
    let (exchange, done) =
        exchange_after(&warm_store(0), StoreOp::Begin(attempt(0)), 0, vec![ok(written(2))]);
    assert!(matches!(begun(done), Ok(Begin::Claimed(_))));
    assert_eq!(exchange.unanswered_claim(), None);
    // A takeover's transaction that timed out is in doubt like a new claim's.
    let abandoned = value(processing(9, 0), None);
    let (exchange, _) = exchange_after(
        &warm_store(1_000),
        StoreOp::Begin(attempt(1_000)),
        1_000,
        vec![ok(read_answer(5, Some((&key, &abandoned, 4)), &[])), timed_out()],
    );
    let claim = exchange.unanswered_claim().expect("the takeover went out unanswered");
    assert_eq!((claim.owner, claim.locator), (11, UNANSWERED));
    // Marking a lease-ended record as outcome unknown claims nothing: a retry marks it again.
    let refusing = ClaimAttempt { unknown_outcome: UnknownOutcome::Refuse, ..attempt(1_000) };
    let (exchange, _) = exchange_after(
        &warm_store(1_000),
        StoreOp::Begin(refusing),
        1_000,
        vec![ok(read_answer(5, Some((&key, &abandoned, 4)), &[])), timed_out()],
    );
    assert_eq!(exchange.unanswered_claim(), None);
    // Settlements are their claim's owner's, who retries them.
    let claim = Claim { scope: scope(1), owner: 11, locator: 4, written: Some(processing(11, 0)) };
    let (exchange, _) = exchange_after(&store(), StoreOp::Release(claim), 0, vec![timed_out()]);
    assert_eq!(exchange.unanswered_claim(), None);
}

#[test]
fn a_claim_whose_call_is_given_up_on_is_in_doubt() {
    // The glue never hands Envoy's timeout to the exchange: it gives up on it with the claim's
    // call out.
    let store = warm_store(0);
    let mut exchange = store.start(StoreOp::Begin(attempt(0)));
    assert!(matches!(exchange.step(&store, None, 0), Next::Call(_)));
    let claim = exchange.unanswered_claim().expect("the claim's call is out");
    assert_eq!((claim.owner, claim.locator, claim.written), (11, UNANSWERED, Some(processing(11, 0))));
    // A read's call out claims nothing (a worker without leases reads first).
    let cold = plain_store();
    let mut exchange = cold.start(StoreOp::Begin(attempt(0)));
    assert!(matches!(exchange.step(&cold, None, 0), Next::Call(_)));
    assert_eq!(exchange.unanswered_claim(), None);
}
