//! The compiled configuration: the types `parse` builds and the engine reads on every request
//! (`Config`, its `Rule`s, `Quota`, `StoreConfig`, ...). Data and small methods on it only, so
//! that reading what a configuration can say does not mean reading how JSON is checked.

use std::fmt;
use std::rc::Rc;

use super::etcd::EtcdSettings;
use crate::router_control::EnvoyHeaders;

/// Compiled, validated configuration. Built once per `on_configure`, shared by every request.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Lowercased request header carrying the Idempotency-Key.
    pub key_header: String,
    /// Lowercased header whose value names the tenant; `None`: every request is in one tenant.
    pub tenant_header: Option<String>,
    /// Lowercased headers whose values identify the caller (hashed into the scope).
    pub principal_headers: Vec<String>,
    /// Which store keeps the records (`store.type`).
    pub store: StoreConfig,
    pub problem_statuses: ProblemStatuses,
    /// Ordered; the first matching rule applies. Shared, so that a held request carries its
    /// rule with it instead of an index to look up again.
    pub rules: Vec<Rc<Rule>>,
    /// Requests one Envoy worker holds waiting for the same record (wait mode), at most.
    pub max_waiters_per_key: u32,
    /// Requests one Envoy worker holds waiting in all (wait mode), at most.
    pub max_waiters: u32,
    /// The principal from claims a JWT filter in front of this one verified, when configured.
    pub jwt_principal: Option<JwtPrincipal>,
    /// Live records one tenant or one principal may hold; opt-in (no bound by default).
    pub quota: Quota,
    /// Detached calls (`execution: "detached"`) one Envoy worker carries at once, at most.
    pub max_detached_calls: u32,
    /// Each protected request's outcome as its filter state `wasm.idempotency.outcome`, for
    /// access logs. Off by default: one host call per outcome counted.
    pub publish_outcome: bool,
    /// Each change a protected request makes to a record as its filter state
    /// `wasm.idempotency.audit` (a JSON entry), for access logs: the audit trail. Off by
    /// default: one host call per changed record.
    pub audit: bool,
    /// `mode: "shadow"`: claim, fingerprint and record as usual, but never answer for the
    /// upstream: whatever would have been a local answer (a replay, a refusal, a wait) is
    /// forwarded without a claim and counted as `shadow_<outcome>`. For watching the filter in
    /// front of an API before it enforces anything.
    pub shadow: bool,
    /// Which name of the service a record's scope holds (`scope_host`).
    pub scope_host: ScopeHost,
    /// This instance serves the admin API (and protects no routes: `rules` is empty).
    pub admin: Option<AdminConfig>,
    /// Envoy's own header names by `envoy_header_prefix` (its bootstrap's `header_prefix`):
    /// the router control headers a protected request loses, and the mark of an upstream answer.
    pub envoy_headers: EnvoyHeaders,
}

/// `scope_host`: the host part of a record's scope. One service answers to several names in a
/// mesh (`payments`, `payments.prod`, `payments.prod.svc.cluster.local`, with or without a port),
/// and a scope that holds the name as the caller wrote it is one record per spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeHost {
    /// The request's `:authority`, normalized (the default, and every build's before the field).
    Authority,
    /// The upstream cluster Envoy routed the request to (`xds.cluster_name`): one service, one
    /// scope, whatever name the caller used. A request Envoy routed to no cluster keeps its
    /// authority (Envoy answers it itself: nothing executes).
    Cluster,
    /// No host at all: every host behind this filter is one API (a single-API gateway).
    None,
}

/// `admin` in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// SHA-256 of the bearer token every request must present; None: no token (the listener
    /// alone guards the API: the shipped configs bind it to loopback).
    pub token_sha256: Option<[u8; 32]>,
}

/// What a forwarded request whose outcome cannot be known (a timeout, an upstream reset after
/// the request was sent, a client gone while the upstream worked) does to its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownOutcome {
    /// The record stays in flight until `processing_timeout` ends; then a retry takes it over
    /// and executes again (only for routes where a second execution is harmless).
    Takeover,
    /// The record is completed at once as "outcome unknown": every retry within the ttl gets
    /// 502 `outcome-unknown` and is never executed (the default: at most one execution per key).
    Refuse,
    /// `routes[].reconcile` is set: the record stays in flight until `processing_timeout` ends;
    /// then the upstream's lookup decides (`Rule::reconcile`): its answer is replayed, or the
    /// request executes because the upstream says it never did, or nothing is settled yet.
    Reconcile,
}

/// `routes[].reconcile`: the upstream's own lookup that tells, for a key, whether it executed
/// the request and what it answered (a GET by idempotency key or client reference).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconcile {
    /// The lookup's path; `{key}` is replaced by the Idempotency-Key, percent-encoded.
    pub path: String,
    pub method: String,
    /// The Envoy cluster to ask; None: the one Envoy's route picked (`xds.cluster_name`).
    pub cluster: Option<String>,
    /// How long the lookup may take; below `processing_timeout`, so a lookup's answer is never
    /// older than a lease that another request's takeover started after it.
    pub timeout_ms: u64,
    /// Lowercased request headers copied from the request that makes the lookup, so that the
    /// upstream authorizes it as the same caller (default: the principal and tenant headers).
    pub headers: Vec<String>,
}

/// Who carries a protected request to the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution {
    /// Envoy's router, on the client's stream (the default): a client that leaves, or Envoy's
    /// own timeout, resets the upstream request, and the outcome is unknown.
    Inline,
    /// The worker's root, as an HTTP callout that does not depend on the client's stream: the
    /// answer is recorded whether or not the client is still there.
    Detached {
        /// The Envoy cluster to call; None: the one Envoy's route picked (`xds.cluster_name`).
        cluster: Option<String>,
        /// How long the callout may take; below `processing_timeout`, so a takeover never
        /// starts while it runs.
        upstream_timeout_ms: u64,
        /// The route's rewrites, said again for the callout, which Envoy's route never sees.
        rewrite: UpstreamRewrite,
    },
}

/// `routes[].upstream_rewrite`: what Envoy's route would rewrite before the router sends the
/// request (`prefix_rewrite`, `host_rewrite_literal`), for a detached call, which is a callout
/// and not the router, and so names its own `:path` and `:authority`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamRewrite {
    /// Replaces the part of the path the rule's `match` matched (its prefix, or the whole
    /// exact path), as Envoy's `prefix_rewrite` replaces what the route matched; the query stays.
    pub prefix_rewrite: Option<String>,
    /// The call's `:authority`.
    pub host_rewrite_literal: Option<String>,
}

/// Where a verified caller identity comes from: Envoy's `jwt_authn` filter writes the claims of
/// a token it verified into dynamic metadata (`payload_in_metadata`), which a client cannot set.
/// Unlike a hash of the raw `Authorization` value, these claims stay the same when a client
/// refreshes its token, so a retry with a refreshed token is the same caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtPrincipal {
    /// The `payload_in_metadata` name of the jwt_authn provider(s).
    pub payload: String,
    /// Claims that together name the caller, in this order (e.g. `iss`, `sub`).
    pub claims: Vec<String>,
}

/// Bounds on live records, so that one tenant or one caller cannot fill the store for all.
/// Opt-in: None is no bound, and the default. A default bound would refuse honest traffic
/// wherever the filter cannot tell callers apart (no identity: every anonymous request is one
/// principal; one service token in front of many users), so only the operator, who knows how
/// identities map to clients, can choose one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quota {
    /// Applies only when `tenant_header` is set (otherwise there is one tenant: everybody).
    pub per_tenant: Option<u32>,
    pub per_principal: Option<u32>,
}

/// What a duplicate that arrives while the original is still processing gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concurrency {
    /// 409 with retry-after at once (the IETF draft's answer).
    Reject,
    /// Held until the original's outcome is known (then replayed, or executed if released), or
    /// until `timeout_ms` passes (then 409).
    Wait { timeout_ms: u64 },
}

/// Where records live: the store says which one it is, and carries only its own settings.
#[derive(Debug, Clone, PartialEq)]
// Read once per configuration: the etcd settings' size costs nothing per request.
#[allow(clippy::large_enum_variant)]
pub enum StoreConfig {
    /// Envoy's shared data: one Envoy process, all its workers. `tombstones`: the room kept for
    /// tombstones (`store.tombstones`), apart from the records'; 0 when no rule keeps any.
    Local { capacity: u32, tombstones: u32 },
    /// etcd, shared by every Envoy pointed at it (`store.type: "etcd"`).
    Etcd(EtcdSettings),
}

/// The status codes of the filter's own problem responses that operators may change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProblemStatuses {
    /// Missing (when required) or malformed key. Default 400.
    pub invalid_key: u16,
    /// Same key, different payload. Default 422.
    pub mismatch: u16,
    /// Same key while the original is still being processed. Default 409.
    pub in_flight: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Prefix(String),
    Exact(String),
}

/// One status code or a whole class (`"2xx"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusPattern {
    Code(u16),
    /// 1..=5 for 1xx..5xx.
    Class(u8),
}

/// What to do with a real upstream answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Keep the snapshot; retries replay it.
    Store,
    /// Forget the claim; a retry executes again.
    Release,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusPolicy {
    pub store: Vec<StatusPattern>,
    pub release: Vec<StatusPattern>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub path: PathMatch,
    /// Uppercase method names.
    pub methods: Vec<String>,
    pub require_key: bool,
    /// Where the request's key comes from (`routes[].key`).
    pub key: KeySource,
    /// With `KeySource::Fingerprint`, its `window`.
    pub ttl_ms: u64,
    pub processing_timeout_ms: u64,
    pub max_request_bytes: u64,
    pub max_response_bytes: u64,
    /// Lowercased header names folded into the fingerprint.
    pub fingerprint_headers: Vec<String>,
    /// Decoded RFC 6901 JSON Pointers (reference tokens, already unescaped) removed from JSON
    /// bodies before hashing.
    pub ignore_json_fields: Vec<Vec<String>>,
    pub statuses: StatusPolicy,
    /// Lowercased response headers never stored, so never replayed (beyond hop-by-hop ones).
    pub replay_exclude_headers: Vec<String>,
    pub concurrency: Concurrency,
    pub execution: Execution,
    /// `Reconcile` exactly when `reconcile` is set.
    pub unknown_outcome: UnknownOutcome,
    pub reconcile: Option<Reconcile>,
    /// `tombstone_ttl`: how long a compact tombstone of a completed record stands after its
    /// completion, longer than `ttl_ms` (0: none, the record is forgotten at its ttl).
    pub tombstone_ms: u64,
}

/// `routes[].key`: where a rule reads the key that names one intent. The source is part of the
/// record's scope (`KeySource::scope_key`), so the header value "42" and the body value 42
/// are never one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header: `key_header` (the default, `own` false), or the rule's own
    /// (`{"header": ...}`, `own` true when it is not `key_header`).
    Header { name: String, own: bool },
    /// The value at a JSON Pointer in the request body (`{"json": "/order_id"}`): the business
    /// number the body already carries. Read once the body is whole.
    Json {
        /// As written in the configuration, for the scope and the problems' details.
        pointer: String,
        /// Its reference tokens, unescaped.
        tokens: Vec<String>,
    },
    /// No key: the request's fingerprint is its key (`{"fingerprint": {"window": ...}}`), and
    /// the record lives `window` (the rule's ttl). For clients that cannot send one.
    Fingerprint,
}

impl KeySource {
    /// Read at the end of the body, not at the headers.
    pub fn in_body(&self) -> bool {
        !matches!(self, KeySource::Header { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `routes[1].match.prefix`; empty for the document itself.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid configuration: {}", self.reason)
        } else {
            write!(f, "invalid configuration: field `{}`: {}", self.field, self.reason)
        }
    }
}

impl StatusPolicy {
    /// An exact code beats a class; a status in neither set is released (the upstream answered,
    /// and nothing asked for it to be kept).
    pub fn disposition(&self, status: u16) -> Disposition {
        let code = StatusPattern::Code(status);
        if self.store.contains(&code) {
            return Disposition::Store;
        }
        if self.release.contains(&code) {
            return Disposition::Release;
        }
        // Statuses >= 600 have no class digit in 1..=5, so they fall through to Release.
        let class = u8::try_from(status / 100).map(StatusPattern::Class);
        match class {
            Ok(c) if self.store.contains(&c) => Disposition::Store,
            _ => Disposition::Release,
        }
    }
}

impl ProblemStatuses {
    pub const DEFAULT: ProblemStatuses = ProblemStatuses { invalid_key: 400, mismatch: 422, in_flight: 409 };
}
