//! etcd's v3 API as the conversations speak it: the calls they make (a transaction, a range, a lease
//! grant, an authenticate) and what they read from etcd's answers, in either of the two encodings
//! etcd serves on its client port (`store.protocol`): JSON through its gateway (`json.rs`) or
//! protobuf through gRPC (`grpc.rs`). The conversations never see which: they build calls here and
//! read answers as the types below.

mod grpc;
mod json;

use crate::json::JsonValue;
use crate::store::remote::Answer;
use crate::store::StoreError;

pub use crate::config::etcd::Protocol;
pub use grpc::{
    envoy_grpc_service, read_watch, watch_cancel, watch_create, WatchAnswer, WATCH_METHOD, WATCH_SERVICE,
};

/// gRPC status codes etcd reports (in `grpc-status`, or the gateway's error bodies).
const CODE_INVALID_ARGUMENT: i64 = 3;
const CODE_NOT_FOUND: i64 = 5;
const CODE_UNAUTHENTICATED: i64 = 16;

/// One key-value pair of a range answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// A range answer: the first keys (as many as the limit allowed) and how many matched.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RangeAnswer {
    pub kvs: Vec<Kv>,
    pub count: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnAnswer {
    /// The store's revision after the transaction: the mod_revision of anything it wrote.
    pub revision: i64,
    pub succeeded: bool,
    /// The range answers among the responses, in order (puts and deletes are skipped).
    pub ranges: Vec<RangeAnswer>,
}

/// Why an answer cannot be used as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdRefusal {
    /// The token cannot be used any more: expired or revoked ("invalid auth token": etcd
    /// restarted, simple tokens time out), issued before an auth change ("revision of auth store
    /// is old": a user, role or permission changed since; JWT tokens carry the revision they were
    /// issued at), or not seen ("user name is empty"). etcd's own client authenticates again on
    /// all three; so does the conversation. Carries etcd's message.
    InvalidToken(String),
    /// A put named a lease etcd no longer knows (expired, revoked, etcd's data lost): grant a new
    /// one.
    LeaseNotFound,
    /// Anything else: the store cannot be used.
    Unusable(String),
}

impl EtcdRefusal {
    pub fn into_error(self) -> StoreError {
        match self {
            EtcdRefusal::InvalidToken(m) => {
                StoreError::Unavailable(format!("etcd refused the auth token: {m}"))
            }
            EtcdRefusal::LeaseNotFound => StoreError::Unavailable("etcd lost the lease".into()),
            EtcdRefusal::Unusable(m) => StoreError::Unavailable(m),
        }
    }
}

/// etcd's error, whichever encoding carried it: a gRPC code and etcd's message.
fn refusal(code: Option<i64>, message: String, status: u16) -> EtcdRefusal {
    match code {
        Some(CODE_UNAUTHENTICATED) if message.contains("invalid auth token") => {
            EtcdRefusal::InvalidToken(message)
        }
        Some(CODE_INVALID_ARGUMENT)
            if message.contains("revision of auth store is old")
                || message.contains("user name is empty") =>
        {
            EtcdRefusal::InvalidToken(message)
        }
        Some(CODE_NOT_FOUND) if message.contains("lease not found") => EtcdRefusal::LeaseNotFound,
        Some(code) => EtcdRefusal::Unusable(format!("etcd refused the call (code {code}): {message}")),
        None => EtcdRefusal::Unusable(format!("etcd refused the call ({status}): {message}")),
    }
}

/// What an answer Envoy made itself says: Envoy could not reach etcd, its status, and the
/// start of its own words (the body, or a gRPC answer's `grpc-message`).
fn envoy_answered(cluster: &str, answer: &Answer) -> String {
    let status = answer.status.unwrap_or_default();
    let (code, words) = match &answer.grpc {
        Some(g) if g.code != 0 => (format!(", grpc-status {}", g.code), g.message.as_bytes()),
        _ => (String::new(), answer.body.as_slice()),
    };
    format!(
        "Envoy could not reach etcd on cluster {cluster:?}: the answer is Envoy's own, {status}{code} {:?}",
        excerpt(words)
    )
}

/// The first bytes of someone else's words, for a log line: at most `EXCERPT_BYTES`, as text.
fn excerpt(words: &[u8]) -> String {
    const EXCERPT_BYTES: usize = 160;
    let cut = words.get(..EXCERPT_BYTES).unwrap_or(words);
    let mut text = String::from_utf8_lossy(cut).into_owned();
    if cut.len() < words.len() {
        text.push_str("...");
    }
    text
}

/// Envoy's report that a call failed without an answer (`:status` missing).
fn no_answer() -> EtcdRefusal {
    EtcdRefusal::Unusable(
        "the call to etcd failed without an answer (Envoy reports a reset after etcd's headers, or an \
         answer over its buffer limit)"
            .into(),
    )
}

fn malformed(what: &str) -> EtcdRefusal {
    EtcdRefusal::Unusable(format!("etcd's answer has no valid {what}"))
}

/// One operation of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
    },
    Delete {
        key: Vec<u8>,
    },
    /// `limit` 0: every key; `keys_only` leaves values out (quota indexes have none worth reading).
    Range {
        key: Vec<u8>,
        range_end: Option<Vec<u8>>,
        limit: i64,
        keys_only: bool,
    },
}

/// What a transaction compares on its key: the create revision (0: absent), the mod revision,
/// or (on a claim's lease key) the value being this owner token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    Absent,
    ModRevision(i64),
    Owner(u64),
}

/// A call to etcd, encoded: POST `body` to `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub path: &'static str,
    pub body: Vec<u8>,
}

/// A transaction: if `guard` holds on `key`, `success`; otherwise `failure`.
pub fn txn(protocol: Protocol, guard: Option<(&[u8], Guard)>, success: &[TxnOp], failure: &[TxnOp]) -> Call {
    txn_all(protocol, guard.as_slice(), success, failure)
}

/// A transaction: if every guard holds on its key, `success`; otherwise `failure`.
pub fn txn_all(protocol: Protocol, guards: &[(&[u8], Guard)], success: &[TxnOp], failure: &[TxnOp]) -> Call {
    match protocol {
        Protocol::Json => Call { path: json::TXN, body: json::txn(guards, success, failure) },
        Protocol::Grpc => Call { path: grpc::TXN, body: grpc::txn(guards, success, failure) },
    }
}

/// A range of one key.
pub fn range(protocol: Protocol, key: &[u8]) -> Call {
    match protocol {
        Protocol::Json => Call { path: json::RANGE, body: json::range(key) },
        Protocol::Grpc => Call { path: grpc::RANGE, body: grpc::range(key) },
    }
}

pub fn lease_grant(protocol: Protocol, ttl_s: u64) -> Call {
    match protocol {
        Protocol::Json => Call { path: json::LEASE_GRANT, body: json::lease_grant(ttl_s) },
        Protocol::Grpc => Call { path: grpc::LEASE_GRANT, body: grpc::lease_grant(ttl_s) },
    }
}

pub fn authenticate(protocol: Protocol, username: &str, password: &str) -> Call {
    match protocol {
        Protocol::Json => Call { path: json::AUTHENTICATE, body: json::authenticate(username, password) },
        Protocol::Grpc => Call { path: grpc::AUTHENTICATE, body: grpc::authenticate(username, password) },
    }
}

/// An answer etcd gave, not yet read as any one message.
pub enum Body<'a> {
    Json(JsonValue<'a>),
    Proto(&'a [u8]),
}

/// Reads an answer from etcd on `cluster`, refusing failed callouts, Envoy's own answers, error
/// statuses and etcd's errors.
pub fn body<'a>(protocol: Protocol, cluster: &str, answer: &'a Answer) -> Result<Body<'a>, EtcdRefusal> {
    if answer.from_envoy {
        return Err(EtcdRefusal::Unusable(envoy_answered(cluster, answer)));
    }
    match protocol {
        Protocol::Json => json::body(answer.status, &answer.body).map(Body::Json),
        Protocol::Grpc => grpc::body(answer).map(Body::Proto),
    }
}

impl Body<'_> {
    pub fn txn(&self) -> Result<TxnAnswer, EtcdRefusal> {
        match self {
            Body::Json(v) => json::read_txn(v),
            Body::Proto(m) => grpc::read_txn(m),
        }
    }
    pub fn range(&self) -> Result<RangeAnswer, EtcdRefusal> {
        match self {
            Body::Json(v) => json::read_range(v),
            Body::Proto(m) => grpc::read_range(m),
        }
    }
    pub fn lease_id(&self) -> Result<i64, EtcdRefusal> {
        match self {
            Body::Json(v) => json::read_lease_id(v),
            Body::Proto(m) => grpc::read_lease_id(m),
        }
    }
    pub fn token(&self) -> Result<String, EtcdRefusal> {
        match self {
            Body::Json(v) => json::read_token(v),
            Body::Proto(m) => grpc::read_token(m),
        }
    }
}
