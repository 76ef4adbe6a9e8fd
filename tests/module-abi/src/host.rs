//! The host side: Envoy's state behind the imports Envoy 1.40 gives a proxy-wasm module (ABI
//! 0.2.1) and the WASI ones its runtime adds (the imports themselves are in `imports.rs`), with
//! Envoy's rules where the module's correctness depends on them:
//!
//! - every call acts on the *effective* context: the callback's own, or the one
//!   `proxy_set_effective_context` chose (refused for a context that is gone);
//! - a value handed to the module is allocated through its `malloc` export (else
//!   `proxy_on_memory_allocate`) and written there; an empty value is no allocation, pointer 0;
//! - shared data: a set on a missing key ignores its CAS and inserts, a set on an existing key
//!   with a CAS other than 0 and the current one is `CasMismatch`, keys are never deleted;
//! - header maps: the request's (response's) map is gone once its headers callback returned
//!   Continue, and readable again (not writable) during `proxy_on_log`;
//! - `proxy_send_local_response` and `proxy_continue_stream` are carried out after the VM call
//!   that made them returns (the driver, lib.rs, does it), never inside it;
//! - a shared queue's owner is told (`proxy_on_queue_ready`) after the call that enqueued.
//!
//! What Envoy would refuse or never do is kept in `violations` for the tests to assert empty: a
//! host call while the module initializes, memory out of the module's bounds, a map that is not
//! a proxy-wasm map, a stream call made on a root.

use crate::wire::Pairs;
use std::collections::{BTreeMap, VecDeque};
use wasmi::{Memory, TypedFunc};

pub const OK: i32 = 0;
pub const NOT_FOUND: i32 = 1;
pub const BAD_ARGUMENT: i32 = 2;
pub const INVALID_MEMORY_ACCESS: i32 = 6;
pub const EMPTY: i32 = 7;
pub const CAS_MISMATCH: i32 = 8;

pub const LOG_CRITICAL: i32 = 5;

pub const MAP_REQUEST_HEADERS: i32 = 0;
pub const MAP_RESPONSE_HEADERS: i32 = 2;
pub const MAP_HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
pub const MAP_HTTP_CALL_RESPONSE_TRAILERS: i32 = 7;

pub const BUFFER_REQUEST_BODY: i32 = 0;
pub const BUFFER_RESPONSE_BODY: i32 = 1;
pub const BUFFER_HTTP_CALL_RESPONSE_BODY: i32 = 4;
pub const BUFFER_GRPC_RECEIVE: i32 = 5;
pub const BUFFER_VM_CONFIGURATION: i32 = 6;
pub const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;

pub const METRIC_COUNTER: i32 = 0;
pub const METRIC_GAUGE: i32 = 1;
pub const METRIC_HISTOGRAM: i32 = 2;

/// One `proxy_send_local_response`, as the module made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Pairs,
    pub grpc_status: i32,
}

impl LocalResponse {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }
}

/// What reached the client (headers once let go, the body as far as let go).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientResponse {
    pub headers: Pairs,
    pub body: Vec<u8>,
}

impl ClientResponse {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }
    pub fn status(&self) -> Option<u32> {
        std::str::from_utf8(self.header(":status")?).ok()?.parse().ok()
    }
}

/// An HTTP context (one stream) as Envoy holds it.
#[derive(Debug, Default)]
pub struct Stream {
    pub root: u32,
    pub request_headers: Pairs,
    /// Envoy still holds the request's map for the module (its headers callback has not
    /// returned Continue).
    pub(crate) request_headers_live: bool,
    /// Request body bytes Envoy buffers for the module (not forwarded yet).
    pub request_body: Vec<u8>,
    pub response_headers: Pairs,
    pub(crate) response_headers_live: bool,
    pub response_body: Vec<u8>,
    /// Envoy's properties for this stream, by path parts joined with NUL (`prop_key`).
    pub properties: BTreeMap<String, Vec<u8>>,
    /// What the module set with `proxy_set_property` (Envoy: filter state `wasm.<name>`).
    pub filter_state: BTreeMap<String, Vec<u8>>,
    /// Every `proxy_send_local_response` on this stream, in order.
    pub local_responses: Vec<LocalResponse>,
    /// Every `proxy_continue_stream` on this stream (0 request, 1 response), in order.
    pub continued: Vec<i32>,
    /// What went upstream (headers, body); None while nothing did.
    pub upstream: Option<(Pairs, Vec<u8>)>,
    /// What the client got; None while nothing.
    pub client: Option<ClientResponse>,
    /// A local reply was sent: the request goes no further.
    pub(crate) replied: bool,
    /// In `proxy_on_log`: the maps are readable (Envoy's access-log view), none writable.
    pub(crate) logging: bool,
}

/// A property's key: its path parts as the module sends them, NUL-separated.
pub fn prop_key(path: &[&str]) -> String {
    path.join("\0")
}

#[derive(Debug, Default)]
pub struct RootContext {
    pub tick_ms: u32,
    /// `proxy_done` was called while this root was the effective context.
    pub done_called: bool,
}

#[derive(Debug)]
pub struct Queue {
    pub name: String,
    /// The root context told when something is enqueued.
    pub owner: u32,
    pub items: VecDeque<Vec<u8>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Debug)]
pub struct Metric {
    pub kind: MetricKind,
    pub name: String,
    pub value: i64,
}

#[derive(Debug, Clone)]
pub struct HttpCall {
    pub token: u32,
    /// The root the answer goes to (Envoy registers every callout on the root context).
    pub root: u32,
    pub cluster: String,
    pub headers: Pairs,
    pub body: Vec<u8>,
    pub timeout_ms: u32,
}

/// What a callback may read besides the streams' maps and buffers.
#[derive(Debug, Default)]
pub(crate) enum Callback {
    #[default]
    Plain,
    VmStart(Vec<u8>),
    Configure(Vec<u8>),
    HttpCallResponse {
        headers: Pairs,
        body: Vec<u8>,
        trailers: Pairs,
    },
    GrpcReceive(Vec<u8>),
}

/// Work Envoy does once the VM call that asked for it has returned.
#[derive(Debug, Clone, Copy)]
pub(crate) enum After {
    LocalReply(u32),
    ContinueRequest(u32),
    ContinueResponse(u32),
}

/// Envoy's state as the module can see it, and what the module did to it.
#[derive(Debug)]
pub struct Host {
    /// Fuel spent since each `log_execution` id (a module instrumented by wasm-opt's
    /// `--log-execution`), and the last id with the fuel left then.
    pub fuel_by_site: BTreeMap<i32, (u64, u64)>,
    /// How often execution went from one site to the next (the caller's last site before a
    /// function's first is its call).
    pub site_steps: BTreeMap<(i32, i32), u64>,
    pub(crate) last_site: Option<(i32, u64)>,
    pub(crate) memory: Option<Memory>,
    pub(crate) malloc: Option<TypedFunc<i32, i32>>,
    pub(crate) initializing: bool,
    /// The context host calls act on.
    pub(crate) effective: u32,
    pub(crate) callback: Callback,
    pub(crate) after: VecDeque<After>,
    pub(crate) queue_ready: VecDeque<(u32, u32)>,
    /// Envoy's log level for the wasm component (2: info).
    pub log_level: u32,
    /// Every `proxy_log` line (level, message).
    pub logs: Vec<(i32, String)>,
    /// What the module wrote to stdout or stderr (WASI `fd_write`).
    pub stdio: Vec<u8>,
    pub now_ns: u64,
    /// Shared data of the plugin's vm_id: key → (value, cas).
    pub shared: BTreeMap<String, (Vec<u8>, u32)>,
    last_cas: u32,
    /// Keys of every successful `proxy_set_shared_data`, in order.
    pub shared_writes: Vec<String>,
    pub queues: Vec<Queue>,
    pub metrics: Vec<Metric>,
    pub roots: BTreeMap<u32, RootContext>,
    pub streams: BTreeMap<u32, Stream>,
    /// Clusters Envoy knows: a callout elsewhere is refused (BadArgument).
    pub clusters: Vec<String>,
    pub http_calls: Vec<HttpCall>,
    pub grpc_streams: Vec<(u32, String, String)>,
    pub(crate) next_token: u32,
    /// Plugin-level properties (`plugin_name`, `plugin_root_id`, `plugin_vm_id`).
    pub plugin_properties: BTreeMap<String, Vec<u8>>,
    pub vm_id: String,
    /// What Envoy would have refused or never seen a well-behaved module do.
    pub violations: Vec<String>,
    rng: u64,
}

impl Host {
    pub fn new() -> Host {
        let vm_id = "idempotency".to_string();
        let mut plugin_properties = BTreeMap::new();
        for (name, value) in [("plugin_name", "idempotency"), ("plugin_root_id", "idempotency")] {
            plugin_properties.insert(name.to_string(), value.as_bytes().to_vec());
        }
        plugin_properties.insert("plugin_vm_id".to_string(), vm_id.as_bytes().to_vec());
        Host {
            fuel_by_site: BTreeMap::new(),
            site_steps: BTreeMap::new(),
            last_site: None,
            memory: None,
            malloc: None,
            initializing: false,
            effective: 0,
            callback: Callback::Plain,
            after: VecDeque::new(),
            queue_ready: VecDeque::new(),
            log_level: 2,
            logs: Vec::new(),
            stdio: Vec::new(),
            // 2026-01-01T00:00:00Z: a wall clock, as Envoy's is.
            now_ns: 1_767_225_600_000_000_000,
            shared: BTreeMap::new(),
            last_cas: 0,
            shared_writes: Vec::new(),
            queues: Vec::new(),
            metrics: Vec::new(),
            roots: BTreeMap::new(),
            streams: BTreeMap::new(),
            clusters: Vec::new(),
            http_calls: Vec::new(),
            grpc_streams: Vec::new(),
            next_token: 0,
            plugin_properties,
            vm_id,
            violations: Vec::new(),
            rng: 0x2545_F491_4F6C_DD1D,
        }
    }

    /// Log lines at `level`.
    pub fn logs_at(&self, level: i32) -> Vec<&str> {
        self.logs.iter().filter(|(l, _)| *l == level).map(|(_, m)| m.as_str()).collect()
    }

    /// A metric's value by its full name (the module's, without Envoy's `wasmcustom.`): the sum
    /// over every id the name was defined with (Envoy maps them to one stat).
    pub fn metric(&self, name: &str) -> i64 {
        self.metrics.iter().filter(|m| m.name == name).map(|m| m.value).sum()
    }

    pub(crate) fn root_of(&self, context: u32) -> Option<u32> {
        if self.roots.contains_key(&context) {
            return Some(context);
        }
        self.streams.get(&context).map(|s| s.root)
    }

    pub(crate) fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    pub(crate) fn next_cas(&mut self) -> u32 {
        // One counter for every key; it wraps and skips 0 (0 means "no CAS").
        self.last_cas = self.last_cas.wrapping_add(1);
        if self.last_cas == 0 {
            self.last_cas = 1;
        }
        self.last_cas
    }

    /// `proxy_set_shared_data`'s rule (proxy-wasm-cpp-host shared_data.cc): a missing key
    /// takes the write whatever the CAS; an existing one only with CAS 0 or its current one.
    /// Every write gives the key a new CAS; nothing is ever deleted.
    pub fn set_shared(&mut self, key: String, value: Vec<u8>, cas: u32) -> i32 {
        if let Some((_, current)) = self.shared.get(&key) {
            if cas != 0 && cas != *current {
                return CAS_MISMATCH;
            }
        }
        let next = self.next_cas();
        self.shared.insert(key.clone(), (value, next));
        self.shared_writes.push(key);
        OK
    }

    pub(crate) fn effective_stream(&mut self, call: &str) -> Option<&mut Stream> {
        let id = self.effective;
        if !self.streams.contains_key(&id) {
            self.violation(format!("{call} with context {id}, which is not a stream"));
        }
        self.streams.get_mut(&id)
    }

    /// The map a read of `map_type` sees now, None where Envoy has none.
    pub(crate) fn readable_map(&self, map_type: i32) -> Option<&Pairs> {
        let stream = self.streams.get(&self.effective);
        match (map_type, stream) {
            (MAP_REQUEST_HEADERS, Some(s)) if s.request_headers_live || s.logging => Some(&s.request_headers),
            (MAP_RESPONSE_HEADERS, Some(s)) if s.response_headers_live || s.logging => {
                Some(&s.response_headers)
            }
            (MAP_HTTP_CALL_RESPONSE_HEADERS, _) => match &self.callback {
                Callback::HttpCallResponse { headers, .. } => Some(headers),
                _ => None,
            },
            (MAP_HTTP_CALL_RESPONSE_TRAILERS, _) => match &self.callback {
                Callback::HttpCallResponse { trailers, .. } => Some(trailers),
                _ => None,
            },
            _ => None,
        }
    }

    /// The map a write to `map_type` changes now: only a stream's held map, never in `on_log`.
    pub(crate) fn writable_map(&mut self, map_type: i32) -> Option<&mut Pairs> {
        let stream = self.streams.get_mut(&self.effective)?;
        match map_type {
            MAP_REQUEST_HEADERS if stream.request_headers_live && !stream.logging => {
                Some(&mut stream.request_headers)
            }
            MAP_RESPONSE_HEADERS if stream.response_headers_live && !stream.logging => {
                Some(&mut stream.response_headers)
            }
            _ => None,
        }
    }

    pub(crate) fn buffer(&self, buffer_type: i32) -> Option<&[u8]> {
        let stream = self.streams.get(&self.effective);
        match (buffer_type, &self.callback, stream) {
            (BUFFER_REQUEST_BODY, _, Some(s)) => Some(&s.request_body),
            (BUFFER_RESPONSE_BODY, _, Some(s)) => Some(&s.response_body),
            (BUFFER_HTTP_CALL_RESPONSE_BODY, Callback::HttpCallResponse { body, .. }, _) => Some(body),
            (BUFFER_GRPC_RECEIVE, Callback::GrpcReceive(message), _) => Some(message),
            (BUFFER_VM_CONFIGURATION, Callback::VmStart(config), _) => Some(config),
            (BUFFER_PLUGIN_CONFIGURATION, Callback::Configure(config), _) => Some(config),
            _ => None,
        }
    }

    pub(crate) fn property(&self, key: &str) -> Option<&Vec<u8>> {
        self.streams
            .get(&self.effective)
            .and_then(|s| s.properties.get(key))
            .or_else(|| self.plugin_properties.get(key))
    }

    pub(crate) fn random(&mut self, out: &mut [u8]) {
        for byte in out {
            // xorshift64: deterministic runs, as reproducible as the tests need.
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            *byte = self.rng as u8;
        }
    }
}

impl Default for Host {
    fn default() -> Host {
        Host::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_data_follows_envoys_cas_rules() {
        let mut host = Host::new();
        let k = || "k".to_string();
        // A missing key: any CAS is ignored (the race Envoy leaves open).
        assert_eq!(host.set_shared(k(), b"a".to_vec(), 12_345), OK);
        let cas = host.shared["k"].1;
        assert_eq!(host.set_shared(k(), b"b".to_vec(), cas + 1), CAS_MISMATCH);
        assert_eq!(host.set_shared(k(), b"b".to_vec(), cas), OK);
        assert_eq!(host.set_shared(k(), b"c".to_vec(), cas), CAS_MISMATCH, "a used CAS is stale");
        assert_eq!(host.set_shared(k(), Vec::new(), 0), OK, "CAS 0 overwrites");
        // An empty value keeps the key, with a CAS.
        assert!(host.shared["k"].0.is_empty() && host.shared["k"].1 != 0);
    }
}
