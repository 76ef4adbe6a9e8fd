//! etcd v3 gRPC messages (`store.protocol: "grpc"`): the requests as protobuf in a gRPC frame,
//! and etcd's answers read from theirs. Hand-written for the few messages and fields the store
//! uses (etcd's `rpc.proto` and `kv.proto`, field numbers below): a protobuf library would cost
//! the module more than the whole codec.
//!
//! Facts these rely on (checked against etcd 3.4.23 and 3.5.16 through Envoy 1.40): a unary call
//! is a POST of one length-prefixed message (`00`, then its length as 4 bytes big-endian); the
//! answer's message comes the same way, and its `grpc-status` (0: OK) in the trailers, or in the
//! headers of a trailers-only answer (every error); etcd's errors carry the same codes and
//! messages as the gateway's error bodies. proto3 leaves out fields at their default (false, 0,
//! empty), except a `oneof` member, which is written even at 0: the claim's guard
//! `create_revision == 0` is one.

use super::{malformed, refusal, EtcdRefusal, Guard, Kv, RangeAnswer, TxnAnswer, TxnOp};
use crate::store::remote::Answer;

pub const TXN: &str = "/etcdserverpb.KV/Txn";
pub const RANGE: &str = "/etcdserverpb.KV/Range";
pub const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
pub const AUTHENTICATE: &str = "/etcdserverpb.Auth/Authenticate";

/// gRPC's frame header: one byte of flags (0: not compressed) and the message's length.
const FRAME_HEADER: usize = 5;

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

// Field numbers, from etcd's rpc.proto and kv.proto (etcdserverpb, mvccpb).
mod field {
    // ResponseHeader
    pub const HEADER_REVISION: u32 = 3;
    // Compare
    pub const COMPARE_TARGET: u32 = 2;
    pub const COMPARE_KEY: u32 = 3;
    pub const COMPARE_CREATE_REVISION: u32 = 5;
    pub const COMPARE_MOD_REVISION: u32 = 6;
    pub const COMPARE_VALUE: u32 = 7;
    // TxnRequest, TxnResponse
    pub const TXN_COMPARE: u32 = 1;
    pub const TXN_SUCCESS: u32 = 2;
    pub const TXN_FAILURE: u32 = 3;
    pub const TXN_HEADER: u32 = 1;
    pub const TXN_SUCCEEDED: u32 = 2;
    pub const TXN_RESPONSES: u32 = 3;
    // RequestOp, ResponseOp
    pub const OP_RANGE: u32 = 1;
    pub const OP_PUT: u32 = 2;
    pub const OP_DELETE_RANGE: u32 = 3;
    // RangeRequest, RangeResponse
    pub const RANGE_KEY: u32 = 1;
    pub const RANGE_END: u32 = 2;
    pub const RANGE_LIMIT: u32 = 3;
    pub const RANGE_KEYS_ONLY: u32 = 8;
    pub const RANGE_HEADER: u32 = 1;
    pub const RANGE_KVS: u32 = 2;
    pub const RANGE_COUNT: u32 = 4;
    // KeyValue
    pub const KV_KEY: u32 = 1;
    pub const KV_MOD_REVISION: u32 = 3;
    pub const KV_VALUE: u32 = 5;
    // PutRequest, DeleteRangeRequest
    pub const PUT_KEY: u32 = 1;
    pub const PUT_VALUE: u32 = 2;
    pub const PUT_LEASE: u32 = 3;
    pub const DELETE_KEY: u32 = 1;
    // LeaseGrantRequest, LeaseGrantResponse
    pub const GRANT_TTL: u32 = 1;
    pub const GRANT_ID: u32 = 2;
    pub const GRANTED_ID: u32 = 2;
    pub const GRANTED_ERROR: u32 = 4;
    // AuthenticateRequest, AuthenticateResponse
    pub const AUTH_NAME: u32 = 1;
    pub const AUTH_PASSWORD: u32 = 2;
    pub const AUTH_TOKEN: u32 = 2;
    // WatchRequest, WatchCreateRequest, WatchCancelRequest
    pub const WATCH_CREATE: u32 = 1;
    pub const WATCH_CANCEL: u32 = 2;
    pub const WATCH_CREATE_KEY: u32 = 1;
    pub const WATCH_CANCEL_ID: u32 = 1;
    // WatchResponse, mvccpb.Event
    pub const WATCHED_HEADER: u32 = 1;
    pub const WATCHED_ID: u32 = 2;
    pub const WATCHED_CREATED: u32 = 3;
    pub const WATCHED_CANCELED: u32 = 4;
    pub const WATCHED_CANCEL_REASON: u32 = 6;
    pub const WATCHED_EVENTS: u32 = 11;
    // Envoy's GrpcService and its EnvoyGrpc (envoy.config.core.v3)
    pub const SERVICE_ENVOY_GRPC: u32 = 1;
    pub const ENVOY_GRPC_CLUSTER: u32 = 1;
    pub const ENVOY_GRPC_AUTHORITY: u32 = 2;
}

/// Compare.CompareTarget values. (Compare.result is EQUAL, 0, proto3's default: never written.)
const TARGET_CREATE: u64 = 1;
const TARGET_MOD: u64 = 2;
const TARGET_VALUE: u64 = 3;

// ---- encoding ----

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn tag(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

/// A varint field, left out at 0 (proto3's default) unless `always`.
fn int_field(out: &mut Vec<u8>, field: u32, v: i64, always: bool) {
    if v != 0 || always {
        tag(out, field, VARINT);
        // int64 is the two's complement as a 64-bit varint.
        varint(out, v as u64);
    }
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    tag(out, field, LEN);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A nested message field: `write` encodes the message, then its length goes in front.
fn message_field(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::with_capacity(64);
    write(&mut inner);
    bytes_field(out, field, &inner);
}

/// One message in a gRPC frame: `write` encodes it after the frame header, whose length is then
/// filled in.
fn framed(write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(&[0; FRAME_HEADER]);
    write(&mut out);
    // etcd refuses requests over its --max-request-bytes (1.5 MiB) long before 4 GiB.
    let len = u32::try_from(out.len() - FRAME_HEADER).unwrap_or(u32::MAX);
    out[1..FRAME_HEADER].copy_from_slice(&len.to_be_bytes());
    out
}

fn op(out: &mut Vec<u8>, op: &TxnOp) {
    match op {
        TxnOp::Put { key, value, lease } => message_field(out, field::OP_PUT, |m| {
            bytes_field(m, field::PUT_KEY, key);
            bytes_field(m, field::PUT_VALUE, value);
            int_field(m, field::PUT_LEASE, *lease, false);
        }),
        TxnOp::Delete { key } => message_field(out, field::OP_DELETE_RANGE, |m| {
            bytes_field(m, field::DELETE_KEY, key);
        }),
        TxnOp::Range { key, range_end, limit, keys_only } => message_field(out, field::OP_RANGE, |m| {
            bytes_field(m, field::RANGE_KEY, key);
            if let Some(end) = range_end {
                bytes_field(m, field::RANGE_END, end);
            }
            int_field(m, field::RANGE_LIMIT, *limit, false);
            int_field(m, field::RANGE_KEYS_ONLY, i64::from(*keys_only), false);
        }),
    }
}

pub fn txn(guards: &[(&[u8], Guard)], success: &[TxnOp], failure: &[TxnOp]) -> Vec<u8> {
    framed(|out| {
        for &(key, guard) in guards {
            message_field(out, field::TXN_COMPARE, |m| {
                match guard {
                    Guard::Absent => {
                        int_field(m, field::COMPARE_TARGET, TARGET_CREATE as i64, true);
                        bytes_field(m, field::COMPARE_KEY, key);
                        // A oneof member: written at 0 too.
                        int_field(m, field::COMPARE_CREATE_REVISION, 0, true);
                    }
                    Guard::ModRevision(r) => {
                        int_field(m, field::COMPARE_TARGET, TARGET_MOD as i64, true);
                        bytes_field(m, field::COMPARE_KEY, key);
                        int_field(m, field::COMPARE_MOD_REVISION, r, true);
                    }
                    Guard::Owner(owner) => {
                        int_field(m, field::COMPARE_TARGET, TARGET_VALUE as i64, true);
                        bytes_field(m, field::COMPARE_KEY, key);
                        bytes_field(m, field::COMPARE_VALUE, &owner.to_be_bytes());
                    }
                }
            });
        }
        for o in success {
            message_field(out, field::TXN_SUCCESS, |m| op(m, o));
        }
        for o in failure {
            message_field(out, field::TXN_FAILURE, |m| op(m, o));
        }
    })
}

pub fn range(key: &[u8]) -> Vec<u8> {
    framed(|out| bytes_field(out, field::RANGE_KEY, key))
}

pub fn lease_grant(ttl_s: u64) -> Vec<u8> {
    framed(|out| {
        int_field(out, field::GRANT_TTL, i64::try_from(ttl_s).unwrap_or(i64::MAX), true);
        // ID 0: etcd picks one.
        int_field(out, field::GRANT_ID, 0, false);
    })
}

pub fn authenticate(username: &str, password: &str) -> Vec<u8> {
    framed(|out| {
        bytes_field(out, field::AUTH_NAME, username.as_bytes());
        bytes_field(out, field::AUTH_PASSWORD, password.as_bytes());
    })
}

// ---- decoding ----

enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// Fixed-width fields: none of the messages read has one worth keeping.
    Fixed,
}

/// The fields of one message, in order; `None` after the last, `Some(Err)` at bytes that are not
/// protobuf (and nothing after them).
struct Fields<'a> {
    rest: &'a [u8],
}

fn read_varint(rest: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..70).step_by(7) {
        let (&b, tail) = rest.split_first()?;
        *rest = tail;
        if shift == 63 && b > 1 {
            return None;
        }
        v |= u64::from(b & 0x7F) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), EtcdRefusal>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let field = self.read_field();
        if field.is_none() {
            self.rest = &[];
        }
        Some(field.ok_or_else(|| EtcdRefusal::Unusable("etcd's answer is not protobuf".into())))
    }
}

impl<'a> Fields<'a> {
    fn read_field(&mut self) -> Option<(u32, Value<'a>)> {
        let key = read_varint(&mut self.rest)?;
        let field = u32::try_from(key >> 3).ok().filter(|f| *f > 0)?;
        let value = match (key & 7) as u8 {
            VARINT => Value::Varint(read_varint(&mut self.rest)?),
            LEN => {
                let len = usize::try_from(read_varint(&mut self.rest)?).ok()?;
                if len > self.rest.len() {
                    return None;
                }
                let (bytes, tail) = self.rest.split_at(len);
                self.rest = tail;
                Value::Bytes(bytes)
            }
            FIXED64 | FIXED32 => {
                let width = if (key & 7) as u8 == FIXED64 { 8 } else { 4 };
                self.rest = self.rest.get(width..)?;
                Value::Fixed
            }
            // Groups (3, 4) are long gone from protobuf; nothing else exists.
            _ => return None,
        };
        Some((field, value))
    }
}

fn fields(message: &[u8]) -> Fields<'_> {
    Fields { rest: message }
}

fn as_i64(v: &Value, what: &str) -> Result<i64, EtcdRefusal> {
    match v {
        Value::Varint(n) => Ok(*n as i64),
        _ => Err(malformed(what)),
    }
}

fn as_bytes<'a>(v: &Value<'a>, what: &str) -> Result<&'a [u8], EtcdRefusal> {
    match v {
        Value::Bytes(b) => Ok(b),
        _ => Err(malformed(what)),
    }
}

/// The answer's message, once its gRPC status says etcd did what was asked.
pub(super) fn body(answer: &Answer) -> Result<&[u8], EtcdRefusal> {
    let Some(status) = answer.status else { return Err(super::no_answer()) };
    match &answer.grpc {
        Some(g) if g.code != 0 => return Err(refusal(Some(i64::from(g.code)), g.message.clone(), status)),
        _ if status != 200 => {
            // Envoy's own answers were told apart before (`Answer::from_envoy`): a proxy's page.
            return Err(EtcdRefusal::Unusable(format!("etcd answered {status}, without a grpc-status")));
        }
        // No grpc-status: the stream ended before etcd finished it.
        None => return Err(EtcdRefusal::Unusable("etcd's answer has no grpc-status".into())),
        Some(_) => {}
    }
    let bytes = &answer.body;
    let (header, message) = bytes
        .split_at_checked(FRAME_HEADER)
        .ok_or_else(|| EtcdRefusal::Unusable("etcd's answer is not one gRPC message".into()))?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    if header[0] != 0 || usize::try_from(len).ok() != Some(message.len()) {
        return Err(EtcdRefusal::Unusable("etcd's answer is not one uncompressed gRPC message".into()));
    }
    Ok(message)
}

fn revision(header: &[u8]) -> Result<i64, EtcdRefusal> {
    let mut revision = None;
    for f in fields(header) {
        if let (field::HEADER_REVISION, v) = f? {
            revision = Some(as_i64(&v, "header revision")?);
        }
    }
    revision.ok_or_else(|| malformed("header revision"))
}

fn kv(message: &[u8]) -> Result<Kv, EtcdRefusal> {
    let (mut key, mut value, mut mod_revision) = (None, Vec::new(), None);
    for f in fields(message) {
        match f? {
            (field::KV_KEY, v) => key = Some(as_bytes(&v, "key")?.to_vec()),
            (field::KV_VALUE, v) => value = as_bytes(&v, "value")?.to_vec(),
            (field::KV_MOD_REVISION, v) => mod_revision = Some(as_i64(&v, "mod_revision")?),
            _ => {}
        }
    }
    // A key is never empty, and a key's mod_revision never 0: absent means not etcd's.
    Ok(Kv {
        key: key.ok_or_else(|| malformed("key"))?,
        value,
        mod_revision: mod_revision.ok_or_else(|| malformed("mod_revision"))?,
    })
}

/// A RangeResponse's keys and count, and its header's revision (None without a header).
fn range_answer(message: &[u8]) -> Result<(RangeAnswer, Option<i64>), EtcdRefusal> {
    let mut answer = RangeAnswer::default();
    let mut header = None;
    for f in fields(message) {
        match f? {
            (field::RANGE_HEADER, v) => header = Some(revision(as_bytes(&v, "header")?)?),
            (field::RANGE_KVS, v) => answer.kvs.push(kv(as_bytes(&v, "kvs")?)?),
            (field::RANGE_COUNT, v) => answer.count = as_i64(&v, "count")?,
            _ => {}
        }
    }
    Ok((answer, header))
}

pub fn read_txn(message: &[u8]) -> Result<TxnAnswer, EtcdRefusal> {
    let (mut header, mut succeeded, mut ranges) = (None, false, Vec::new());
    for f in fields(message) {
        match f? {
            (field::TXN_HEADER, v) => header = Some(revision(as_bytes(&v, "header")?)?),
            (field::TXN_SUCCEEDED, v) => succeeded = as_i64(&v, "succeeded")? != 0,
            (field::TXN_RESPONSES, v) => {
                for r in fields(as_bytes(&v, "responses")?) {
                    if let (field::OP_RANGE, v) = r? {
                        ranges.push(range_answer(as_bytes(&v, "response_range")?)?.0);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(TxnAnswer { revision: header.ok_or_else(|| malformed("header revision"))?, succeeded, ranges })
}

pub fn read_range(message: &[u8]) -> Result<RangeAnswer, EtcdRefusal> {
    let (answer, header) = range_answer(message)?;
    header.ok_or_else(|| malformed("header revision"))?;
    Ok(answer)
}

pub fn read_lease_id(message: &[u8]) -> Result<i64, EtcdRefusal> {
    let mut id = 0;
    for f in fields(message) {
        match f? {
            (field::GRANTED_ID, v) => id = as_i64(&v, "lease ID")?,
            (field::GRANTED_ERROR, v) => {
                let error = String::from_utf8_lossy(as_bytes(&v, "error")?).into_owned();
                if !error.is_empty() {
                    return Err(EtcdRefusal::Unusable(format!("etcd refused the lease: {error}")));
                }
            }
            _ => {}
        }
    }
    Some(id).filter(|id| *id != 0).ok_or_else(|| malformed("lease ID"))
}

pub fn read_token(message: &[u8]) -> Result<String, EtcdRefusal> {
    let mut token = String::new();
    for f in fields(message) {
        if let (field::AUTH_TOKEN, v) = f? {
            token = std::str::from_utf8(as_bytes(&v, "token")?).map_err(|_| malformed("token"))?.to_owned();
        }
    }
    Some(token).filter(|t| !t.is_empty()).ok_or_else(|| malformed("token"))
}

// ---- Watch: a stream, whose messages Envoy frames and unframes itself ----

pub const WATCH_SERVICE: &str = "etcdserverpb.Watch";
pub const WATCH_METHOD: &str = "Watch";

/// How Envoy is asked to open a gRPC stream (`proxy_grpc_stream`): a serialized `GrpcService`
/// naming the cluster and the `:authority` (etcd's server refuses an invalid one, such as an
/// Istio cluster name).
pub fn envoy_grpc_service(cluster: &str, authority: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(cluster.len() + authority.len() + 8);
    message_field(&mut out, field::SERVICE_ENVOY_GRPC, |m| {
        bytes_field(m, field::ENVOY_GRPC_CLUSTER, cluster.as_bytes());
        bytes_field(m, field::ENVOY_GRPC_AUTHORITY, authority.as_bytes());
    });
    out
}

/// A watch on one key from now on (every put and delete of it).
pub fn watch_create(key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 8);
    message_field(&mut out, field::WATCH_CREATE, |m| bytes_field(m, field::WATCH_CREATE_KEY, key));
    out
}

/// The end of the watch `id` (a oneof member: written even when its id is 0, the first id).
pub fn watch_cancel(id: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    message_field(&mut out, field::WATCH_CANCEL, |m| int_field(m, field::WATCH_CANCEL_ID, id, false));
    out
}

/// One message of the Watch stream: a watch created or canceled, or events on a watch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WatchAnswer {
    pub id: i64,
    pub created: bool,
    pub canceled: bool,
    pub cancel_reason: String,
    /// How many events it carries (what they are does not matter: any change of the record is
    /// a reason for its waiters to look at it).
    pub events: usize,
}

pub fn read_watch(message: &[u8]) -> Result<WatchAnswer, EtcdRefusal> {
    let mut answer = WatchAnswer::default();
    let mut header = false;
    for f in fields(message) {
        match f? {
            (field::WATCHED_HEADER, v) => {
                revision(as_bytes(&v, "header")?)?;
                header = true;
            }
            (field::WATCHED_ID, v) => answer.id = as_i64(&v, "watch_id")?,
            (field::WATCHED_CREATED, v) => answer.created = as_i64(&v, "created")? != 0,
            (field::WATCHED_CANCELED, v) => answer.canceled = as_i64(&v, "canceled")? != 0,
            (field::WATCHED_CANCEL_REASON, v) => {
                answer.cancel_reason = String::from_utf8_lossy(as_bytes(&v, "cancel_reason")?).into_owned()
            }
            (field::WATCHED_EVENTS, v) => {
                as_bytes(&v, "events")?;
                answer.events += 1;
            }
            _ => {}
        }
    }
    if !header {
        return Err(malformed("header revision"));
    }
    Ok(answer)
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod tests;
