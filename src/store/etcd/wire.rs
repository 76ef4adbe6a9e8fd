//! etcd v3 JSON gateway messages (etcd 3.4 and later, grpc-gateway over the client port): the
//! requests the exchanges send and the reading of etcd's answers.
//!
//! Gateway facts these rely on (checked against etcd 3.4.23): keys and values are base64; int64
//! fields (revisions, counts, lease ids and TTLs) are JSON strings; proto3 omits defaults, so
//! `succeeded` is absent when false, `kvs` and `count` when nothing matched, `value` when empty;
//! a range's `count` is the number of keys in the range whatever its `limit`; errors come as a
//! non-200 status with `{"error": text, "message": text, "code": grpc code}`.

use crate::json::{self, JsonValue, MemberOrder};
use crate::store::etcd::base64;
use crate::store::StoreError;

pub const TXN: &str = "/v3/kv/txn";
pub const RANGE: &str = "/v3/kv/range";
pub const LEASE_GRANT: &str = "/v3/lease/grant";
pub const AUTHENTICATE: &str = "/v3/auth/authenticate";

/// etcd's answers nest a few levels (txn → responses → range → kvs → kv); anything deeper is not
/// an etcd answer.
const MAX_DEPTH: usize = 8;

/// gRPC status codes etcd reports in error bodies.
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
    /// all three; so does the exchange. Carries etcd's message.
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

fn int64(v: Option<&JsonValue>) -> Option<i64> {
    match v? {
        JsonValue::String(s) => s.parse().ok(),
        JsonValue::Number(n) => n.parse().ok(),
        _ => None,
    }
}

fn text<'a>(v: Option<&'a JsonValue>) -> Option<&'a str> {
    match v? {
        JsonValue::String(s) => Some(s),
        _ => None,
    }
}

/// Reads an answer's body as etcd JSON, refusing failed callouts, error statuses and error bodies.
pub fn body(status: Option<u16>, bytes: &[u8]) -> Result<JsonValue<'_>, EtcdRefusal> {
    let Some(status) = status else {
        return Err(EtcdRefusal::Unusable("the callout to etcd failed (no status)".into()));
    };
    let parsed = json::read(bytes, MAX_DEPTH, MemberOrder::Document);
    let error = parsed.as_ref().ok().and_then(|v| {
        let message = text(v.get("error")).or(text(v.get("message")))?;
        Some((message.to_owned(), int64(v.get("code"))))
    });
    if let Some((message, code)) = error {
        return Err(match code {
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
            _ => EtcdRefusal::Unusable(format!("etcd answered {status}: {message}")),
        });
    }
    if status != 200 {
        // Envoy's own answers (504 on timeout, 503 on reset) and proxies' error pages land here.
        return Err(EtcdRefusal::Unusable(format!("etcd answered {status}")));
    }
    parsed.map_err(|e| EtcdRefusal::Unusable(format!("etcd's answer is not JSON: {e}")))
}

fn malformed(what: &str) -> EtcdRefusal {
    EtcdRefusal::Unusable(format!("etcd's answer has no valid {what}"))
}

fn range_answer(v: &JsonValue) -> Result<RangeAnswer, EtcdRefusal> {
    let mut kvs = Vec::new();
    match v.get("kvs") {
        None => {}
        Some(JsonValue::Array(items)) => {
            for item in items {
                let key = text(item.get("key")).and_then(base64::decode).ok_or_else(|| malformed("key"))?;
                let value = match item.get("value") {
                    None => Vec::new(),
                    Some(v) => text(Some(v)).and_then(base64::decode).ok_or_else(|| malformed("value"))?,
                };
                let mod_revision =
                    int64(item.get("mod_revision")).ok_or_else(|| malformed("mod_revision"))?;
                kvs.push(Kv { key, value, mod_revision });
            }
        }
        Some(_) => return Err(malformed("kvs")),
    }
    let count = match v.get("count") {
        None => 0,
        some => int64(some).ok_or_else(|| malformed("count"))?,
    };
    Ok(RangeAnswer { kvs, count })
}

fn revision(v: &JsonValue) -> Result<i64, EtcdRefusal> {
    int64(v.get("header").and_then(|h| h.get("revision"))).ok_or_else(|| malformed("header revision"))
}

pub fn read_txn(v: &JsonValue) -> Result<TxnAnswer, EtcdRefusal> {
    let succeeded = match v.get("succeeded") {
        None => false,
        Some(JsonValue::Bool(b)) => *b,
        Some(_) => return Err(malformed("succeeded")),
    };
    let mut ranges = Vec::new();
    match v.get("responses") {
        None => {}
        Some(JsonValue::Array(items)) => {
            for item in items {
                if let Some(range) = item.get("response_range") {
                    ranges.push(range_answer(range)?);
                }
            }
        }
        Some(_) => return Err(malformed("responses")),
    }
    Ok(TxnAnswer { revision: revision(v)?, succeeded, ranges })
}

pub fn read_range(v: &JsonValue) -> Result<RangeAnswer, EtcdRefusal> {
    revision(v)?;
    range_answer(v)
}

pub fn read_lease_id(v: &JsonValue) -> Result<i64, EtcdRefusal> {
    int64(v.get("ID")).filter(|id| *id != 0).ok_or_else(|| malformed("lease ID"))
}

pub fn read_token(v: &JsonValue) -> Result<String, EtcdRefusal> {
    text(v.get("token")).filter(|t| !t.is_empty()).map(str::to_owned).ok_or_else(|| malformed("token"))
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

/// What a transaction compares: the record key's create revision (0: absent) or mod revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    Absent,
    ModRevision(i64),
}

fn field_b64(out: &mut Vec<u8>, name: &str, bytes: &[u8]) {
    out.extend_from_slice(format!("\"{name}\":\"{}\"", base64::encode(bytes)).as_bytes());
}

fn op_json(out: &mut Vec<u8>, op: &TxnOp) {
    match op {
        TxnOp::Put { key, value, lease } => {
            out.extend_from_slice(b"{\"request_put\":{");
            field_b64(out, "key", key);
            out.push(b',');
            field_b64(out, "value", value);
            out.extend_from_slice(format!(",\"lease\":\"{lease}\"}}}}").as_bytes());
        }
        TxnOp::Delete { key } => {
            out.extend_from_slice(b"{\"request_delete_range\":{");
            field_b64(out, "key", key);
            out.extend_from_slice(b"}}");
        }
        TxnOp::Range { key, range_end, limit, keys_only } => {
            out.extend_from_slice(b"{\"request_range\":{");
            field_b64(out, "key", key);
            if let Some(end) = range_end {
                out.push(b',');
                field_b64(out, "range_end", end);
            }
            if *limit > 0 {
                out.extend_from_slice(format!(",\"limit\":\"{limit}\"").as_bytes());
            }
            if *keys_only {
                out.extend_from_slice(b",\"keys_only\":true");
            }
            out.extend_from_slice(b"}}");
        }
    }
}

fn ops_json(out: &mut Vec<u8>, ops: &[TxnOp]) {
    out.push(b'[');
    for (i, op) in ops.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        op_json(out, op);
    }
    out.push(b']');
}

/// A transaction: if `guard` holds on `key`, `success`; otherwise `failure`.
pub fn txn(guard: Option<(&[u8], Guard)>, success: &[TxnOp], failure: &[TxnOp]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"compare\":[");
    if let Some((key, guard)) = guard {
        out.push(b'{');
        field_b64(&mut out, "key", key);
        let (target, field, revision) = match guard {
            Guard::Absent => ("CREATE", "create_revision", 0),
            Guard::ModRevision(r) => ("MOD", "mod_revision", r),
        };
        out.extend_from_slice(
            format!(",\"target\":\"{target}\",\"result\":\"EQUAL\",\"{field}\":\"{revision}\"}}").as_bytes(),
        );
    }
    out.extend_from_slice(b"],\"success\":");
    ops_json(&mut out, success);
    out.extend_from_slice(b",\"failure\":");
    ops_json(&mut out, failure);
    out.push(b'}');
    out
}

pub fn range(key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(b'{');
    field_b64(&mut out, "key", key);
    out.push(b'}');
    out
}

pub fn lease_grant(ttl_s: u64) -> Vec<u8> {
    format!("{{\"TTL\":\"{ttl_s}\",\"ID\":\"0\"}}").into_bytes()
}

pub fn authenticate(username: &str, password: &str) -> Vec<u8> {
    let mut out = b"{\"name\":".to_vec();
    json::emit_string(username, &mut out);
    out.extend_from_slice(b",\"password\":");
    json::emit_string(password, &mut out);
    out.push(b'}');
    out
}
