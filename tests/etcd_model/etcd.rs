//! The model etcd: a linearizable key-value store with revisions, leases and transactions,
//! answering the v3 JSON gateway's requests (`store.protocol: "json"`) with the JSON etcd 3.4
//! emits (the canned answers of src/store/etcd/tests/mod.rs were captured from a real etcd 3.4.23).
//! A test fake, kept to etcd's semantics where the store relies on them:
//! - one revision counter for the whole store, raised by one for each transaction (or lease
//!   expiry) that changes a key; a key's `create_revision`, `mod_revision` and `version`;
//! - a transaction's compares (`CREATE`, `MOD`, `VERSION`, `VALUE` with `EQUAL`, `NOT_EQUAL`,
//!   `GREATER`, `LESS`; a `VALUE` compare on an absent key fails, as in etcd's `applyCompare`),
//!   then its success or failure branch, whose reads see its own earlier writes;
//! - a put naming a lease etcd does not know refuses the whole transaction ("requested lease
//!   not found", gRPC code 5), checked before anything is applied;
//! - leases granted with a TTL (at least etcd's minimum, 2 s with the default election
//!   timeout) and no keepalives: when etcd's clock reaches the end, the lease's keys are deleted
//!   (one revision). Real etcd revokes a little after the end, never before;
//! - ranges of one key or `[key, range_end)`, with `limit`, `keys_only` and `count_only`.
//!
//! etcd's own clock is the model's (`now_ms`); the Envoys' clocks are skewed from it
//! (`fleet.rs`). One etcd: a second one (shard migration) would be a second value of this
//! type, addressed by the Envoys' requests.

use idempotency_filter::codec::base64;
use idempotency_filter::json::{self, JsonValue, MemberOrder};
use std::collections::BTreeMap;

/// etcd's minimum lease TTL with the default election timeout (1 s): 3/2 of it, rounded up.
const MIN_TTL_S: i64 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Kv {
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    pub lease: i64,
    /// etcd's clock when this value was written (the model's, not etcd's: never emitted).
    pub written_at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Etcd {
    pub now_ms: u64,
    pub revision: i64,
    pub kvs: BTreeMap<Vec<u8>, Kv>,
    /// Lease id -> when it ends, by etcd's clock.
    pub leases: BTreeMap<i64, u64>,
    next_lease: i64,
}

/// An HTTP answer as Envoy hands it to the filter.
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

fn int64(v: Option<&JsonValue>) -> Option<i64> {
    match v? {
        JsonValue::String(s) => s.parse().ok(),
        JsonValue::Number(n) => n.parse().ok(),
        _ => None,
    }
}

fn bytes(v: Option<&JsonValue>) -> Option<Vec<u8>> {
    match v? {
        JsonValue::String(s) => base64::decode(s),
        _ => None,
    }
}

fn text<'a>(v: Option<&'a JsonValue>) -> Option<&'a str> {
    match v? {
        JsonValue::String(s) => Some(s),
        _ => None,
    }
}

fn flag(v: Option<&JsonValue>) -> bool {
    matches!(v, Some(JsonValue::Bool(true)))
}

fn header(revision: i64) -> String {
    format!(
        r#""header":{{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"{revision}","raft_term":"2"}}"#
    )
}

fn error(status: u16, message: &str, code: i64) -> Reply {
    Reply {
        status,
        body: format!(r#"{{"error":"{message}","message":"{message}","code":{code}}}"#).into_bytes(),
    }
}

/// A request the model etcd does not understand: the model is wrong, not the store.
fn unknown(what: &str) -> Reply {
    error(400, &format!("model etcd: {what}"), 3)
}

/// A range request's fields.
struct Range {
    key: Vec<u8>,
    range_end: Option<Vec<u8>>,
    limit: i64,
    keys_only: bool,
    count_only: bool,
}

impl Range {
    fn read(v: &JsonValue) -> Option<Range> {
        Some(Range {
            key: bytes(v.get("key"))?,
            range_end: match v.get("range_end") {
                None => None,
                some => Some(bytes(some)?),
            },
            limit: match v.get("limit") {
                None => 0,
                some => int64(some)?,
            },
            keys_only: flag(v.get("keys_only")),
            count_only: flag(v.get("count_only")),
        })
    }
}

enum Op {
    Put { key: Vec<u8>, value: Vec<u8>, lease: i64 },
    Delete { key: Vec<u8>, range_end: Option<Vec<u8>> },
    Range(Range),
}

impl Op {
    fn read(v: &JsonValue) -> Option<Op> {
        if let Some(put) = v.get("request_put") {
            return Some(Op::Put {
                key: bytes(put.get("key"))?,
                value: match put.get("value") {
                    None => Vec::new(),
                    some => bytes(some)?,
                },
                lease: match put.get("lease") {
                    None => 0,
                    some => int64(some)?,
                },
            });
        }
        if let Some(delete) = v.get("request_delete_range") {
            return Some(Op::Delete {
                key: bytes(delete.get("key"))?,
                range_end: match delete.get("range_end") {
                    None => None,
                    some => Some(bytes(some)?),
                },
            });
        }
        Range::read(v.get("request_range")?).map(Op::Range)
    }
}

fn ops(v: Option<&JsonValue>) -> Option<Vec<Op>> {
    match v {
        None => Some(Vec::new()),
        Some(JsonValue::Array(items)) => items.iter().map(Op::read).collect(),
        Some(_) => None,
    }
}

impl Etcd {
    pub fn new() -> Etcd {
        // etcd's revisions start at 1 on an empty store.
        Etcd { now_ms: 0, revision: 1, kvs: BTreeMap::new(), leases: BTreeMap::new(), next_lease: 7_000 }
    }

    /// etcd's clock moves on; leases that ended take their keys with them (one revision each).
    pub fn advance(&mut self, to_ms: u64) {
        self.now_ms = to_ms;
        let ended: Vec<i64> =
            self.leases.iter().filter(|(_, end)| **end <= to_ms).map(|(id, _)| *id).collect();
        for id in ended {
            self.leases.remove(&id);
            let before = self.kvs.len();
            self.kvs.retain(|_, kv| kv.lease != id);
            if self.kvs.len() != before {
                self.revision += 1;
            }
        }
    }

    /// One request, applied atomically.
    pub fn handle(&mut self, path: &str, body: &[u8]) -> Reply {
        let Ok(v) = json::read(body, 16, MemberOrder::Document) else { return unknown("not JSON") };
        match path {
            "/v3/kv/txn" => self.txn(&v),
            "/v3/kv/range" => match Range::read(&v) {
                Some(range) => {
                    let answer = self.range(&range);
                    Reply {
                        status: 200,
                        body: format!("{{{},{answer}}}", header(self.revision)).into_bytes(),
                    }
                }
                None => unknown("range"),
            },
            "/v3/lease/grant" => {
                let Some(ttl) = int64(v.get("TTL")) else { return unknown("lease TTL") };
                let ttl = ttl.max(MIN_TTL_S);
                self.next_lease += 1;
                let id = self.next_lease;
                self.leases.insert(id, self.now_ms + u64::try_from(ttl).unwrap_or(0) * 1_000);
                let body = format!(r#"{{{},"ID":"{id}","TTL":"{ttl}"}}"#, header(self.revision));
                Reply { status: 200, body: body.into_bytes() }
            }
            _ => unknown(path),
        }
    }

    fn in_range<'a>(
        &'a self,
        key: &'a [u8],
        range_end: Option<&'a [u8]>,
    ) -> impl Iterator<Item = (&'a Vec<u8>, &'a Kv)> {
        self.kvs.iter().filter(move |(k, _)| match range_end {
            None => k.as_slice() == key,
            // "\0" as range_end: every key from `key` on.
            Some([0]) => k.as_slice() >= key,
            Some(end) => k.as_slice() >= key && k.as_slice() < end,
        })
    }

    /// A range answer's members after the header: `kvs`, `more` and `count`, each left out when
    /// empty, false or zero (proto3 through the gateway).
    fn range(&self, r: &Range) -> String {
        let found: Vec<(&Vec<u8>, &Kv)> = self.in_range(&r.key, r.range_end.as_deref()).collect();
        let count = found.len();
        let shown =
            if r.limit > 0 { count.min(usize::try_from(r.limit).unwrap_or(usize::MAX)) } else { count };
        let mut out = Vec::new();
        if !r.count_only && shown > 0 {
            let kvs: Vec<String> = found[..shown]
                .iter()
                .map(|(k, kv)| {
                    let mut item = format!(
                        r#"{{"key":"{}","create_revision":"{}","mod_revision":"{}","version":"{}""#,
                        base64::encode(k),
                        kv.create_revision,
                        kv.mod_revision,
                        kv.version
                    );
                    if !r.keys_only && !kv.value.is_empty() {
                        item.push_str(&format!(r#","value":"{}""#, base64::encode(&kv.value)));
                    }
                    if kv.lease != 0 {
                        item.push_str(&format!(r#","lease":"{}""#, kv.lease));
                    }
                    item.push('}');
                    item
                })
                .collect();
            out.push(format!(r#""kvs":[{}]"#, kvs.join(",")));
        }
        if shown < count && !r.count_only {
            out.push(r#""more":true"#.to_string());
        }
        if count > 0 {
            out.push(format!(r#""count":"{count}""#));
        }
        out.join(",")
    }

    fn compare(&self, c: &JsonValue) -> Option<bool> {
        let key = bytes(c.get("key"))?;
        let kv = self.kvs.get(&key);
        let target = text(c.get("target")).unwrap_or("VERSION");
        let result = text(c.get("result")).unwrap_or("EQUAL");
        let ordering = match target {
            // etcd: comparing a value on a key that does not exist always fails.
            "VALUE" => {
                let kv = kv?;
                let wanted = bytes(c.get("value")).unwrap_or_default();
                kv.value.cmp(&wanted)
            }
            "CREATE" => {
                kv.map_or(0, |kv| kv.create_revision).cmp(&int64(c.get("create_revision")).unwrap_or(0))
            }
            "MOD" => kv.map_or(0, |kv| kv.mod_revision).cmp(&int64(c.get("mod_revision")).unwrap_or(0)),
            "VERSION" => kv.map_or(0, |kv| kv.version).cmp(&int64(c.get("version")).unwrap_or(0)),
            _ => return None,
        };
        Some(match result {
            "EQUAL" => ordering.is_eq(),
            "NOT_EQUAL" => ordering.is_ne(),
            "GREATER" => ordering.is_gt(),
            "LESS" => ordering.is_lt(),
            _ => return None,
        })
    }

    fn txn(&mut self, v: &JsonValue) -> Reply {
        let compares = match v.get("compare") {
            None => Vec::new(),
            Some(JsonValue::Array(items)) => items.iter().collect(),
            Some(_) => return unknown("compare"),
        };
        let mut succeeded = true;
        for c in compares {
            match self.compare(c) {
                Some(true) => {}
                Some(false) => succeeded = false,
                None => return unknown("a compare"),
            }
        }
        let branch = if succeeded { ops(v.get("success")) } else { ops(v.get("failure")) };
        let Some(branch) = branch else { return unknown("txn operations") };
        // etcd checks every put's lease before applying anything.
        for op in &branch {
            if let Op::Put { lease, .. } = op {
                if *lease != 0 && !self.leases.contains_key(lease) {
                    return error(404, "etcdserver: requested lease not found", 5);
                }
            }
        }
        let next = self.revision + 1;
        let mut changed = false;
        let mut responses = Vec::new();
        for op in branch {
            match op {
                Op::Put { key, value, lease } => {
                    let (create_revision, version) = match self.kvs.get(&key) {
                        Some(old) => (old.create_revision, old.version + 1),
                        None => (next, 1),
                    };
                    let kv = Kv {
                        value,
                        create_revision,
                        mod_revision: next,
                        version,
                        lease,
                        written_at_ms: self.now_ms,
                    };
                    self.kvs.insert(key, kv);
                    changed = true;
                    responses.push(format!(r#"{{"response_put":{{"header":{{"revision":"{next}"}}}}}}"#));
                }
                Op::Delete { key, range_end } => {
                    let gone: Vec<Vec<u8>> =
                        self.in_range(&key, range_end.as_deref()).map(|(k, _)| k.clone()).collect();
                    for k in &gone {
                        self.kvs.remove(k);
                    }
                    changed |= !gone.is_empty();
                    let deleted = if gone.is_empty() {
                        String::new()
                    } else {
                        format!(r#","deleted":"{}""#, gone.len())
                    };
                    responses.push(format!(
                        r#"{{"response_delete_range":{{"header":{{"revision":"{next}"}}{deleted}}}}}"#
                    ));
                }
                Op::Range(range) => {
                    let at = if changed { next } else { self.revision };
                    let answer = self.range(&range);
                    let sep = if answer.is_empty() { "" } else { "," };
                    responses.push(format!(
                        r#"{{"response_range":{{"header":{{"revision":"{at}"}}{sep}{answer}}}}}"#
                    ));
                }
            }
        }
        if changed {
            self.revision = next;
        }
        let mut body = format!("{{{}", header(self.revision));
        if succeeded {
            body.push_str(r#","succeeded":true"#);
        }
        if !responses.is_empty() {
            body.push_str(&format!(r#","responses":[{}]"#, responses.join(",")));
        }
        body.push('}');
        Reply { status: 200, body: body.into_bytes() }
    }
}
