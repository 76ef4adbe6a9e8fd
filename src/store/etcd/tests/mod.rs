//! The conversations against canned etcd answers, in the exact JSON etcd 3.4.23's gateway emits
//! (captured from a real etcd): call sequences, decisions, and every kind of bad answer. One
//! file per subject, as the store's code is split; here, what they share: etcd's answers, a
//! store's settings (also the watch tests' and the worker's remote wait tests'), a claim attempt
//! and the records it writes, and `run`, which drives one conversation through canned answers.

// Test code: a failed expectation is the test's failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::cache::ReplayCacheSettings;
use super::leases::{window_end, CACHED_LEASES, LIVE_CLAIM_RETRY_MS};
use super::stage::TXN_ATTEMPTS;
use super::*;
use crate::codec::{base64, hex};
use crate::config::etcd::ETCD_MAX_REQUEST_BYTES;
use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::store::record::{Snapshot, State, FLAG_BODY_NOT_STORED, FLAG_PRINCIPAL_CHARGED};
use crate::store::remote::Answer;
use crate::store::{Claim, Completion, OnLeaseEnd, QuotaCharge, Settled, StoreAnswer};

mod auth;
mod bad_answers;
mod begin;
mod cache;
mod leases;
mod quota;
mod settle;
mod unanswered;

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

/// An answer as the worker hands it over: status (None: the callout failed) and body.
type Canned = (Option<u16>, Vec<u8>);

fn ok(body: String) -> Canned {
    (Some(200), body.into_bytes())
}

/// A store's settings as these tests use them (cluster `etcd`, keys under `/idem/`); also the
/// watch tests' and the worker's remote wait tests'.
pub(crate) fn settings(auth: Option<EtcdAuth>) -> EtcdSettings {
    EtcdSettings {
        cluster: "etcd".into(),
        authority: "etcd".into(),
        prefix: "/idem/".into(),
        timeout_ms: 250,
        on_error: OnStoreError::FailClosed,
        auth,
        auth_timeout_ms: 2_000,
        replay_cache: None,
        protocol: Default::default(),
        shards: Vec::new(),
        previous_shards: Vec::new(),
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

/// A call the conversation made.
#[derive(Debug)]
struct Made {
    path: &'static str,
    body: String,
    token: Option<String>,
}

/// Runs `op` feeding `answers` in order; every answer must be asked for, and nothing more.
fn run(store: &EtcdStore, op: StoreOp, now_ms: u64, answers: Vec<Canned>) -> (StoreAnswer, Vec<Made>) {
    let mut conversation = store.start(op);
    let mut made = Vec::new();
    let mut answers = answers.into_iter();
    let mut answer = None;
    loop {
        match conversation.step(store, answer.take(), now_ms) {
            Next::Done(done) => {
                assert!(answers.next().is_none(), "answers left over after {made:?}");
                // A finished conversation stays finished.
                assert!(matches!(conversation.step(store, None, now_ms), Next::Done(_)));
                return (done, made);
            }
            Next::Wait => panic!("no other conversation fetches a token: {made:?}"),
            Next::Call(Request { path, body, token, .. }) => {
                made.push(Made { path, body: String::from_utf8(body).unwrap(), token });
                let (status, body) = answers.next().unwrap_or_else(|| panic!("no answer left for {made:?}"));
                answer = Some(Answer { status, body, grpc: None, from_envoy: false });
            }
        }
    }
}

fn paths(made: &[Made]) -> Vec<&'static str> {
    made.iter().map(|m| m.path).collect()
}

/// The claim of scope 1 by owner 11 at revision 4 (the record not carried: read first).
fn claim_at_4() -> Claim {
    Claim { scope: scope(1), owner: 11, locator: 4, written: None, shard: 0, old_home: None, tombstone_s: 0 }
}

fn scope(n: u8) -> ScopeId {
    ScopeId([n; 32])
}

fn attempt(now_ms: u64) -> ClaimAttempt {
    ClaimAttempt {
        scope: scope(1),
        fingerprint: Fingerprint([7; 32]),
        owner: 11,
        now_ms,
        lease_ms: 1_000,
        ttl_ms: 10_000,
        quota: None,
        on_lease_end: OnLeaseEnd::TakeOver,
        label: None,
        tombstone_ms: 0,
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
