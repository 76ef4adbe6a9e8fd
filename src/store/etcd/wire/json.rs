//! etcd v3 JSON gateway messages (`store.protocol: "json"`; etcd 3.4 and later, grpc-gateway over
//! the client port): the requests the conversations send and the reading of etcd's answers.
//!
//! Gateway facts these rely on (checked against etcd 3.4.23): keys and values are base64; int64
//! fields (revisions, counts, lease ids and TTLs) are JSON strings; proto3 omits defaults, so
//! `succeeded` is absent when false, `kvs` and `count` when nothing matched, `value` when empty;
//! a range's `count` is the number of keys in the range whatever its `limit`; errors come as a
//! non-200 status with `{"error": text, "message": text, "code": grpc code}`.

use super::{malformed, refusal, EtcdRefusal, Guard, Kv, RangeAnswer, TxnAnswer, TxnOp};
use crate::codec::base64;
use crate::json::{self, JsonValue, MemberOrder};

pub const TXN: &str = "/v3/kv/txn";
pub const RANGE: &str = "/v3/kv/range";
pub const LEASE_GRANT: &str = "/v3/lease/grant";
pub const AUTHENTICATE: &str = "/v3/auth/authenticate";

/// etcd's answers nest a few levels (txn → responses → range → kvs → kv); anything deeper is not
/// an etcd answer.
const MAX_DEPTH: usize = 8;

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
pub(super) fn body(status: Option<u16>, bytes: &[u8]) -> Result<JsonValue<'_>, EtcdRefusal> {
    let Some(status) = status else { return Err(super::no_answer()) };
    let parsed = json::read(bytes, MAX_DEPTH, MemberOrder::Document);
    let error = parsed.as_ref().ok().and_then(|v| {
        let message = text(v.get("error")).or(text(v.get("message")))?;
        Some((message.to_owned(), int64(v.get("code"))))
    });
    if let Some((message, code)) = error {
        return Err(refusal(code, message, status));
    }
    if status != 200 {
        // Envoy's own answers were told apart before (`Answer::from_envoy`): a proxy's error page.
        return Err(EtcdRefusal::Unusable(format!("etcd answered {status}, without an error of its own")));
    }
    parsed.map_err(|e| EtcdRefusal::Unusable(format!("etcd's answer is not JSON: {e}")))
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

/// A transaction: if every guard holds on its key, `success`; otherwise `failure`.
pub fn txn(guards: &[(&[u8], Guard)], success: &[TxnOp], failure: &[TxnOp]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"compare\":[");
    for (i, (key, guard)) in guards.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'{');
        field_b64(&mut out, "key", key);
        let revision = |out: &mut Vec<u8>, target: &str, field: &str, revision: i64| {
            out.extend_from_slice(
                format!(",\"target\":\"{target}\",\"result\":\"EQUAL\",\"{field}\":\"{revision}\"}}")
                    .as_bytes(),
            )
        };
        match *guard {
            Guard::Absent => revision(&mut out, "CREATE", "create_revision", 0),
            Guard::ModRevision(r) => revision(&mut out, "MOD", "mod_revision", r),
            Guard::Owner(owner) => {
                out.extend_from_slice(b",\"target\":\"VALUE\",\"result\":\"EQUAL\",");
                field_b64(&mut out, "value", &owner.to_be_bytes());
                out.push(b'}');
            }
        }
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
