//! Plugin configuration: the JSON string Envoy hands to `on_configure`, parsed and validated into
//! the compiled [`Config`] the engine reads on every request. Pure: no host calls, table-tested.
//!
//! A bad configuration must stop the filter from starting (Envoy then refuses the listener), so
//! every error names the offending field, e.g. `routes[0].ttl: "24x" is not a duration ...`.

use std::borrow::Cow;
use std::fmt;
use std::rc::Rc;

use crate::json::{self, JsonError, JsonValue as Value, MemberOrder};
use crate::store::etcd::cache::{self, ReplayCacheSettings};
use crate::store::etcd::{self, EtcdAuth, EtcdSettings, OnStoreError};

/// Compiled, validated configuration. Built once per `on_configure`, shared by every request.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Lowercased request header carrying the Idempotency-Key.
    pub key_header: String,
    /// Lowercased header whose value names the tenant; `None`: every request is in one tenant.
    pub tenant_header: Option<String>,
    /// Lowercased headers whose values identify the caller (hashed into the scope).
    pub principal_headers: Vec<String>,
    /// The local store (Envoy's shared data). With `store.type: "etcd"` it is not used for
    /// records (`etcd` is Some) and keeps its default capacity.
    pub store: StoreConfig,
    /// `store.type: "etcd"`: records live in etcd, shared by every Envoy pointed at it. A field
    /// beside `store` rather than a `StoreConfig` variant for now, so the glue's existing
    /// `StoreConfig::Local` binding keeps compiling until it opens either store.
    pub etcd: Option<EtcdSettings>,
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
}

/// What a forwarded request whose outcome cannot be known (a timeout, an upstream reset after
/// the request was sent, a client gone while the upstream worked) does to its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownOutcome {
    /// The record stays in flight until `processing_timeout` ends; then a retry takes it over
    /// and executes again (the default: for routes where a repeat is tolerable).
    Takeover,
    /// The record is completed at once as "outcome unknown": every retry within the ttl gets
    /// 502 `outcome-unknown` and is never executed (for payment-like routes).
    Refuse,
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
    },
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

#[derive(Debug, Clone, PartialEq)]
pub enum StoreConfig {
    /// Envoy's shared data: one Envoy process, all its workers.
    Local { capacity: u32 },
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
    pub unknown_outcome: UnknownOutcome,
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

impl Rule {
    pub fn matches(&self, method: &str, path_without_query: &str) -> bool {
        // Methods are case-sensitive (RFC 9110 §9.1); the configured ones are already uppercase.
        self.methods.iter().any(|m| m == method) && self.matches_path(path_without_query)
    }

    pub fn matches_path(&self, path_without_query: &str) -> bool {
        match &self.path {
            PathMatch::Prefix(p) => path_without_query.starts_with(p.as_str()),
            PathMatch::Exact(p) => path_without_query == p,
        }
    }
}

impl Config {
    /// Whether some rule could protect this path (whatever the method): traffic no rule's path
    /// matches is passed on without reading anything else.
    pub fn any_rule_for_path(&self, path_without_query: &str) -> bool {
        self.rules.iter().any(|r| r.matches_path(path_without_query))
    }

    pub fn rule_for(&self, method: &str, path_without_query: &str) -> Option<&Rc<Rule>> {
        self.rules.iter().find(|r| r.matches(method, path_without_query))
    }
}

impl ProblemStatuses {
    pub const DEFAULT: ProblemStatuses = ProblemStatuses { invalid_key: 400, mismatch: 422, in_flight: 409 };
}

const DEFAULT_KEY_HEADER: &str = "idempotency-key";
const DEFAULT_PRINCIPAL_HEADER: &str = "authorization";
const DEFAULT_CAPACITY: u32 = 100_000;
const MAX_CAPACITY: u64 = 10_000_000;
const DEFAULT_TTL_MS: u64 = 24 * 3_600_000;
const DEFAULT_PROCESSING_TIMEOUT_MS: u64 = 30_000;
const DEFAULT_BODY_BYTES: u64 = 1 << 20;
const MAX_BODY_BYTES: u64 = 64 << 20;
// A route with default sizes must be valid with the etcd store too.
const _: () = assert!(DEFAULT_BODY_BYTES <= etcd::MAX_STORED_BODY_BYTES);
const DEFAULT_METHODS: [&str; 2] = ["POST", "PATCH"];
const DEFAULT_STORE_STATUSES: [StatusPattern; 3] =
    [StatusPattern::Class(2), StatusPattern::Class(3), StatusPattern::Class(4)];
/// Statuses that say the request did not execute (or must be sent again): a server error, a
/// timeout, too early, too many requests, and the ones that refuse the caller or the state
/// (401, 403, 409). Keeping a 401 for the ttl would freeze a permission problem that is fixed a
/// minute later; the validation answers (400, 422) and 404 describe the request itself and stay.
const DEFAULT_RELEASE_STATUSES: [StatusPattern; 7] = [
    StatusPattern::Class(5),
    StatusPattern::Code(401),
    StatusPattern::Code(403),
    StatusPattern::Code(408),
    StatusPattern::Code(409),
    StatusPattern::Code(425),
    StatusPattern::Code(429),
];
const DEFAULT_WAIT_TIMEOUT_MS: u64 = 10_000;
/// Longest a held request may wait: beyond this a client is better served by a 409 and its own
/// retry than by an open connection, and every time computed from it stays far from overflow.
pub const MAX_WAIT_TIMEOUT_MS: u64 = 5 * 60_000;
/// Request bodies one worker may hold for waiters at most (Envoy keeps a held request's body in
/// its buffer): `max_waiters` x the largest `max_request_bytes` of the wait rules.
pub const WAITER_MEMORY_BUDGET: u64 = 256 << 20;
/// Request and response bytes one worker may hold for its detached calls: `max_detached_calls`
/// x the largest `max_request_bytes + max_response_bytes` of the detached rules.
pub const DETACHED_MEMORY_BUDGET: u64 = 256 << 20;
const DEFAULT_MAX_DETACHED_CALLS: u64 = 1_000;
const MAX_DETACHED_CALLS_LIMIT: u64 = 100_000;
/// The longest `upstream_timeout`: Envoy's callout timeout is a 32-bit count of milliseconds.
const MAX_UPSTREAM_TIMEOUT_MS: u64 = 24 * 3_600_000;
const MAX_JWT_CLAIMS: usize = 8;
const DEFAULT_MAX_WAITERS_PER_KEY: u64 = 100;
const DEFAULT_MAX_WAITERS: u64 = 1_000;
const MAX_WAITERS_LIMIT: u64 = 100_000;
const MAX_HEADER_NAME_LEN: usize = 128;
const MAX_RULE_NAME_LEN: usize = 64;
/// Nesting the configuration may use. Its own constant, not the canonical form's: the two
/// limits happen to be equal, but changing the fingerprint contract must not change which
/// configurations Envoy accepts.
const MAX_NESTING: usize = 64;

/// An object's members in document order, so the first unknown field is the one reported.
type Obj<'j> = [(Cow<'j, str>, Value<'j>)];
type Res<T> = Result<T, ConfigError>;

/// Parses and validates the plugin configuration.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    let doc = json::read(bytes, MAX_NESTING, MemberOrder::Document).map_err(json_error)?;
    let top = object(
        &doc,
        "",
        &[
            "key_header",
            "tenant_header",
            "principal_headers",
            "store",
            "problem_statuses",
            "routes",
            "max_waiters_per_key",
            "max_waiters",
            "principal",
            "quota",
            "max_detached_calls",
        ],
    )?;
    let key_header =
        optional(top, "", "key_header", header_name)?.unwrap_or_else(|| DEFAULT_KEY_HEADER.into());
    // null is accepted here (and only here) so templated configs can switch tenancy off explicitly.
    let tenant_header = match get(top, "tenant_header") {
        None | Some(Value::Null) => None,
        Some(v) => Some(header_name(v, "tenant_header")?),
    };
    let principal_headers = optional(top, "", "principal_headers", |v, f| unique_list(v, f, header_name))?
        .unwrap_or_else(|| vec![DEFAULT_PRINCIPAL_HEADER.into()]);
    let (store, etcd) = match optional(top, "", "store", store)? {
        None => (StoreConfig::Local { capacity: DEFAULT_CAPACITY }, None),
        Some(StoreChoice::Local(local)) => (local, None),
        Some(StoreChoice::Etcd(settings)) => {
            (StoreConfig::Local { capacity: DEFAULT_CAPACITY }, Some(settings))
        }
    };
    let problem_statuses =
        optional(top, "", "problem_statuses", problem_statuses)?.unwrap_or(ProblemStatuses::DEFAULT);
    let waiters = |k: &str, default: u64| -> Res<u32> {
        let n = optional(top, "", k, |v, f| uint(v, f, 1, MAX_WAITERS_LIMIT))?.unwrap_or(default);
        u32::try_from(n).map_err(|_| err(k, "out of range"))
    };
    let max_waiters_per_key = waiters("max_waiters_per_key", DEFAULT_MAX_WAITERS_PER_KEY)?;
    let jwt_principal = optional(top, "", "principal", jwt_principal)?;
    let quota = optional(top, "", "quota", quota)?.unwrap_or_default();

    let routes = array(get(top, "routes").ok_or_else(|| err("routes", "required"))?, "routes")?;
    if routes.is_empty() {
        return Err(err("routes", "must contain at least one route"));
    }
    let mut rules: Vec<Rc<Rule>> = Vec::with_capacity(routes.len());
    for (i, v) in routes.iter().enumerate() {
        let path = index("routes", i);
        let r = rule(v, &path)?;
        // Names label metrics and logs; a duplicate would silently merge two routes' numbers.
        if rules.iter().any(|x| x.name == r.name) {
            return Err(err(&key(&path, "name"), format!("duplicate route name {:?}", r.name)));
        }
        if etcd.is_some() {
            etcd_fits(&r, &path)?;
        }
        rules.push(Rc::new(r));
    }
    let max_waiters = max_waiters(top, &rules)?;
    let max_detached_calls = max_detached_calls(top, &rules)?;
    Ok(Config {
        key_header,
        tenant_header,
        principal_headers,
        store,
        etcd,
        problem_statuses,
        rules,
        max_waiters_per_key,
        max_waiters,
        jwt_principal,
        quota,
        max_detached_calls,
    })
}

/// A detached call holds its request body and then its response in the worker's memory, so
/// the calls in flight times the largest request and response a detached rule admits is memory
/// one worker may have to hold.
fn max_detached_calls(top: &Obj, rules: &[Rc<Rule>]) -> Res<u32> {
    let largest = rules
        .iter()
        .filter(|r| matches!(r.execution, Execution::Detached { .. }))
        .map(|r| r.max_request_bytes.saturating_add(r.max_response_bytes))
        .max();
    memory_bounded(top, &DETACHED_CALLS, largest)
}

/// Held requests keep their bodies in Envoy's buffers, so the number of waiters times the
/// largest body a wait rule admits is memory one worker may have to hold.
fn max_waiters(top: &Obj, rules: &[Rc<Rule>]) -> Res<u32> {
    let largest_body = rules
        .iter()
        .filter(|r| matches!(r.concurrency, Concurrency::Wait { .. }))
        .map(|r| r.max_request_bytes)
        .max();
    memory_bounded(top, &WAITERS, largest_body)
}

/// A per-worker count of things that each hold up to the largest body of some rules.
struct MemoryBound {
    field: &'static str,
    /// Plural noun of what is counted, and what the largest size is.
    things: &'static str,
    size: &'static str,
    budget: u64,
    default: u64,
    limit: u64,
}

const WAITERS: MemoryBound = MemoryBound {
    field: "max_waiters",
    things: "waiters",
    size: "request bytes (the largest max_request_bytes of a wait rule)",
    budget: WAITER_MEMORY_BUDGET,
    default: DEFAULT_MAX_WAITERS,
    limit: MAX_WAITERS_LIMIT,
};

const DETACHED_CALLS: MemoryBound = MemoryBound {
    field: "max_detached_calls",
    things: "detached calls",
    size: "bytes (the largest max_request_bytes + max_response_bytes of a detached rule)",
    budget: DETACHED_MEMORY_BUDGET,
    default: DEFAULT_MAX_DETACHED_CALLS,
    limit: MAX_DETACHED_CALLS_LIMIT,
};

/// The count times `largest` (None: no rule holds anything) must fit the budget: an explicit
/// value over it is refused; the default shrinks to fit it.
fn memory_bounded(top: &Obj, b: &MemoryBound, largest: Option<u64>) -> Res<u32> {
    let fits = |n: u64| largest.is_none_or(|size| n.saturating_mul(size) <= b.budget);
    let n = match optional(top, "", b.field, |v, f| uint(v, f, 1, b.limit))? {
        Some(n) if !fits(n) => {
            return Err(err(
                b.field,
                format!(
                    "{n} {} x {} {} exceeds the {} MiB a worker may hold for {}",
                    b.things,
                    largest.unwrap_or(0),
                    b.size,
                    b.budget >> 20,
                    b.things
                ),
            ))
        }
        Some(n) => n,
        None => match largest {
            Some(size) => b.default.min(b.budget / size).max(1),
            None => b.default,
        },
    };
    u32::try_from(n).map_err(|_| err(b.field, "out of range"))
}

fn jwt_principal(v: &Value, path: &str) -> Res<JwtPrincipal> {
    let o = object(v, path, &["jwt_payload", "claims"])?;
    let payload = required(o, path, "jwt_payload", |v, f| {
        let s = string(v, f)?;
        if s.is_empty() || s.len() > MAX_HEADER_NAME_LEN {
            return Err(err(f, format!("expected 1 to {MAX_HEADER_NAME_LEN} characters")));
        }
        Ok(s.to_owned())
    })?;
    let claims = required(o, path, "claims", |v, f| {
        unique_list(v, f, |v, f| {
            let s = string(v, f)?;
            if s.is_empty() || s.len() > MAX_HEADER_NAME_LEN {
                return Err(err(
                    f,
                    format!("expected a claim name of 1 to {MAX_HEADER_NAME_LEN} characters"),
                ));
            }
            Ok(s.to_owned())
        })
    })?;
    if claims.is_empty() || claims.len() > MAX_JWT_CLAIMS {
        return Err(err(&key(path, "claims"), format!("expected 1 to {MAX_JWT_CLAIMS} claim names")));
    }
    Ok(JwtPrincipal { payload, claims })
}

/// The explicit bounds; an absent one is no bound.
fn quota(v: &Value, path: &str) -> Res<Quota> {
    let o = object(v, path, &["per_tenant", "per_principal"])?;
    let bound = |k: &str| -> Res<Option<u32>> {
        optional(o, path, k, |v, f| uint(v, f, 1, MAX_CAPACITY))?
            .map(|n| u32::try_from(n).map_err(|_| err(&key(path, k), "out of range")))
            .transpose()
    };
    Ok(Quota { per_tenant: bound("per_tenant")?, per_principal: bound("per_principal")? })
}

/// What a route asks of the store that the etcd store cannot give.
fn etcd_fits(r: &Rule, path: &str) -> Res<()> {
    // A record is written in one etcd request, which etcd bounds (--max-request-bytes).
    if r.max_response_bytes > etcd::MAX_STORED_BODY_BYTES {
        return Err(err(
            &key(path, "max_response_bytes"),
            format!(
                "{} bytes cannot be stored in etcd: a record must fit its {}-byte request limit, which leaves at most {} bytes of body",
                r.max_response_bytes,
                etcd::ETCD_MAX_REQUEST_BYTES,
                etcd::MAX_STORED_BODY_BYTES
            ),
        ));
    }
    Ok(())
}

enum StoreChoice {
    Local(StoreConfig),
    Etcd(EtcdSettings),
}

/// Longest a callout to etcd may take: a request stays paused for it.
const MAX_ETCD_TIMEOUT_MS: u64 = 10_000;
const MAX_ETCD_PREFIX_LEN: usize = 128;

fn etcd_settings(o: &Obj, path: &str) -> Res<EtcdSettings> {
    reject_unknown(o, path, &["type", "cluster", "prefix", "timeout", "on_error", "auth", "replay_cache"])?;
    let cluster = required(o, path, "cluster", |v, f| {
        let s = string(v, f)?;
        if s.is_empty() || s.chars().any(char::is_control) {
            return Err(err(f, "expected the name of an Envoy cluster"));
        }
        Ok(s.to_owned())
    })?;
    let prefix = optional(o, path, "prefix", |v, f| {
        let s = string(v, f)?;
        // Keys are `<prefix>r/...` and `<prefix>q/...`: a prefix ending in '/' keeps them apart
        // from whatever else lives in the same etcd.
        if s.is_empty()
            || !s.ends_with('/')
            || s.len() > MAX_ETCD_PREFIX_LEN
            || s.chars().any(char::is_control)
        {
            return Err(err(
                f,
                format!(
                    "expected 1 to {MAX_ETCD_PREFIX_LEN} bytes ending in '/', without control characters"
                ),
            ));
        }
        Ok(s.to_owned())
    })?
    .unwrap_or_else(|| etcd::DEFAULT_PREFIX.into());
    let timeout_ms = optional(o, path, "timeout", |v, f| {
        let ms = duration_ms(v, f)?;
        if ms > MAX_ETCD_TIMEOUT_MS {
            return Err(err(f, format!("{ms} ms exceeds the longest callout, {MAX_ETCD_TIMEOUT_MS} ms")));
        }
        Ok(ms)
    })?
    .unwrap_or(etcd::DEFAULT_TIMEOUT_MS);
    let on_error = optional(o, path, "on_error", |v, f| match string(v, f)? {
        "fail_closed" => Ok(OnStoreError::FailClosed),
        "fail_open" => Ok(OnStoreError::FailOpen),
        other => Err(err(f, format!("{other:?}: expected \"fail_closed\" or \"fail_open\""))),
    })?
    .unwrap_or_default();
    let mut auth_timeout_ms = etcd::DEFAULT_AUTH_TIMEOUT_MS;
    let auth = optional(o, path, "auth", |v, f| {
        let a = object(v, f, &["username", "password", "timeout"])?;
        // The token fetch is its own callout: authenticate costs etcd a bcrypt check and a Raft
        // write, slow under load, and every exchange needing a token waits for the one fetch.
        if let Some(ms) = optional(a, f, "timeout", |v, f| {
            let ms = duration_ms(v, f)?;
            if ms > MAX_ETCD_TIMEOUT_MS {
                return Err(err(f, format!("{ms} ms exceeds the longest callout, {MAX_ETCD_TIMEOUT_MS} ms")));
            }
            Ok(ms)
        })? {
            auth_timeout_ms = ms;
        }
        let part = |v: &Value, f: &str| -> Res<String> {
            let s = string(v, f)?;
            if s.is_empty() {
                return Err(err(f, "must not be empty"));
            }
            Ok(s.to_owned())
        };
        Ok(EtcdAuth {
            username: required(a, f, "username", part)?,
            password: required(a, f, "password", part)?,
        })
    })?;
    // Off unless asked for: it is memory in every worker's Wasm VM (which never gives memory
    // back), sized by the operator for the replays worth keeping; see docs/ETCD.md.
    let replay_cache = optional(o, path, "replay_cache", |v, f| {
        let c = object(v, f, &["entries", "max_bytes"])?;
        let entries = optional(c, f, "entries", |v, f| uint(v, f, 1, u64::from(cache::MAX_ENTRIES)))?
            .map_or(Ok(cache::DEFAULT_ENTRIES), |n| {
                u32::try_from(n).map_err(|_| err(&key(f, "entries"), "out of range"))
            })?;
        let max_bytes =
            optional(c, f, "max_bytes", |v, f| uint(v, f, MIN_REPLAY_CACHE_BYTES, cache::MAX_BYTES))?
                .unwrap_or(cache::DEFAULT_MAX_BYTES);
        Ok(ReplayCacheSettings { entries, max_bytes })
    })?;
    Ok(EtcdSettings { cluster, prefix, timeout_ms, on_error, auth, auth_timeout_ms, replay_cache })
}

/// Smallest `store.replay_cache.max_bytes`: a few small records.
const MIN_REPLAY_CACHE_BYTES: u64 = 4_096;

fn store(v: &Value, path: &str) -> Res<StoreChoice> {
    let o = object_any(v, path)?;
    let type_path = key(path, "type");
    let kind = string(get(o, "type").ok_or_else(|| err(&type_path, "required"))?, &type_path)?;
    // The allowed keys depend on the type, so the type is read before the unknown-key check.
    match kind {
        "local" => {
            reject_unknown(o, path, &["type", "capacity"])?;
            let capacity = optional(o, path, "capacity", |v, f| uint(v, f, 1, MAX_CAPACITY))?
                .map_or(Ok(DEFAULT_CAPACITY), |c| {
                    u32::try_from(c).map_err(|_| err(&key(path, "capacity"), "out of range"))
                })?;
            Ok(StoreChoice::Local(StoreConfig::Local { capacity }))
        }
        "etcd" => etcd_settings(o, path).map(StoreChoice::Etcd),
        other => {
            Err(err(&type_path, format!("unsupported store type {other:?}: expected \"local\" or \"etcd\"")))
        }
    }
}

fn problem_statuses(v: &Value, path: &str) -> Res<ProblemStatuses> {
    let o = object(v, path, &["invalid_key", "mismatch", "in_flight"])?;
    let status = |k: &str, default: u16| -> Res<u16> {
        optional(o, path, k, |v, f| uint(v, f, 400, 499))?
            .map_or(Ok(default), |s| u16::try_from(s).map_err(|_| err(&key(path, k), "out of range")))
    };
    let d = ProblemStatuses::DEFAULT;
    Ok(ProblemStatuses {
        invalid_key: status("invalid_key", d.invalid_key)?,
        mismatch: status("mismatch", d.mismatch)?,
        in_flight: status("in_flight", d.in_flight)?,
    })
}

fn rule(v: &Value, path: &str) -> Res<Rule> {
    let o = object(
        v,
        path,
        &[
            "name",
            "match",
            "require_key",
            "ttl",
            "processing_timeout",
            "max_request_bytes",
            "max_response_bytes",
            "fingerprint",
            "store_statuses",
            "release_statuses",
            "replay_exclude_headers",
            "concurrent",
            "wait_timeout",
            "execution",
            "cluster",
            "upstream_timeout",
            "unknown_outcome",
        ],
    )?;
    let name = required(o, path, "name", rule_name)?;
    let (path_match, methods) = required(o, path, "match", rule_match)?;
    let require_key = optional(o, path, "require_key", boolean)?.unwrap_or(false);
    let ttl_ms = optional(o, path, "ttl", duration_ms)?.unwrap_or(DEFAULT_TTL_MS);
    let processing_timeout_ms =
        optional(o, path, "processing_timeout", duration_ms)?.unwrap_or(DEFAULT_PROCESSING_TIMEOUT_MS);
    // A claim that outlives its record would let a retry find neither and execute twice.
    if processing_timeout_ms > ttl_ms {
        return Err(err(
            &key(path, "processing_timeout"),
            format!("{processing_timeout_ms} ms exceeds ttl ({ttl_ms} ms)"),
        ));
    }
    let body_size = |v: &Value, f: &str| uint(v, f, 1, MAX_BODY_BYTES);
    let max_request_bytes = optional(o, path, "max_request_bytes", body_size)?.unwrap_or(DEFAULT_BODY_BYTES);
    let max_response_bytes =
        optional(o, path, "max_response_bytes", body_size)?.unwrap_or(DEFAULT_BODY_BYTES);
    let (fingerprint_headers, ignore_json_fields) =
        optional(o, path, "fingerprint", fingerprint)?.unwrap_or_default();
    let status_list = |v: &Value, f: &str| unique_list(v, f, status_pattern);
    let store =
        optional(o, path, "store_statuses", status_list)?.unwrap_or_else(|| DEFAULT_STORE_STATUSES.to_vec());
    let release = optional(o, path, "release_statuses", status_list)?
        .unwrap_or_else(|| DEFAULT_RELEASE_STATUSES.to_vec());
    if let Some(p) = release.iter().find(|p| store.contains(p)) {
        return Err(err(
            &key(path, "release_statuses"),
            format!("{} is also listed in store_statuses", pattern_text(*p)),
        ));
    }
    let replay_exclude_headers =
        optional(o, path, "replay_exclude_headers", |v, f| unique_list(v, f, header_name))?
            .unwrap_or_default();
    let wait_timeout_ms = optional(o, path, "wait_timeout", duration_ms)?;
    if let Some(ms) = wait_timeout_ms.filter(|ms| *ms > MAX_WAIT_TIMEOUT_MS) {
        return Err(err(
            &key(path, "wait_timeout"),
            format!("{ms} ms exceeds the longest wait, {} ms", MAX_WAIT_TIMEOUT_MS),
        ));
    }
    let concurrency = match optional(o, path, "concurrent", |v, f| string(v, f).map(str::to_owned))?
        .as_deref()
    {
        None | Some("reject") => {
            if wait_timeout_ms.is_some() {
                return Err(err(&key(path, "wait_timeout"), "only applies with \"concurrent\": \"wait\""));
            }
            Concurrency::Reject
        }
        Some("wait") => Concurrency::Wait { timeout_ms: wait_timeout_ms.unwrap_or(DEFAULT_WAIT_TIMEOUT_MS) },
        Some(other) => {
            return Err(err(&key(path, "concurrent"), format!("{other:?}: expected \"reject\" or \"wait\"")))
        }
    };
    let execution = execution(o, path, processing_timeout_ms)?;
    let unknown_outcome =
        match optional(o, path, "unknown_outcome", |v, f| string(v, f).map(str::to_owned))?.as_deref() {
            None | Some("takeover") => UnknownOutcome::Takeover,
            Some("refuse") => UnknownOutcome::Refuse,
            Some(other) => {
                return Err(err(
                    &key(path, "unknown_outcome"),
                    format!("{other:?}: expected \"takeover\" or \"refuse\""),
                ))
            }
        };
    Ok(Rule {
        name,
        path: path_match,
        methods,
        require_key,
        ttl_ms,
        processing_timeout_ms,
        max_request_bytes,
        max_response_bytes,
        fingerprint_headers,
        ignore_json_fields,
        statuses: StatusPolicy { store, release },
        replay_exclude_headers,
        concurrency,
        execution,
        unknown_outcome,
    })
}

/// `execution`, and the fields only a detached rule has.
fn execution(o: &Obj, path: &str, processing_timeout_ms: u64) -> Res<Execution> {
    let cluster = optional(o, path, "cluster", |v, f| {
        let s = string(v, f)?;
        if s.is_empty() || s.len() > 255 {
            return Err(err(f, "expected an Envoy cluster name of 1 to 255 bytes"));
        }
        Ok(s.to_owned())
    })?;
    let upstream_timeout_ms = optional(o, path, "upstream_timeout", duration_ms)?;
    match optional(o, path, "execution", |v, f| string(v, f).map(str::to_owned))?.as_deref() {
        None | Some("inline") => {
            for (field, set) in
                [("cluster", cluster.is_some()), ("upstream_timeout", upstream_timeout_ms.is_some())]
            {
                if set {
                    return Err(err(&key(path, field), "only applies with \"execution\": \"detached\""));
                }
            }
            Ok(Execution::Inline)
        }
        Some("detached") => {
            // A call still running when the lease ends could be taken over and run twice.
            let upstream_timeout_ms = upstream_timeout_ms.unwrap_or(processing_timeout_ms / 2).max(1);
            if upstream_timeout_ms >= processing_timeout_ms || upstream_timeout_ms > MAX_UPSTREAM_TIMEOUT_MS {
                return Err(err(
                    &key(path, "upstream_timeout"),
                    format!(
                        "{upstream_timeout_ms} ms: must be below processing_timeout ({processing_timeout_ms} ms), \
                         so that no takeover starts while the detached call runs"
                    ),
                ));
            }
            Ok(Execution::Detached { cluster, upstream_timeout_ms })
        }
        Some(other) => {
            Err(err(&key(path, "execution"), format!("{other:?}: expected \"inline\" or \"detached\"")))
        }
    }
}

/// The name goes into the rule's counters (`idempotency.route.<name>.requests.<outcome>`), where
/// dots separate the parts of an Envoy stat name: a dot must sit between two parts (Envoy
/// drops a trailing one, so `a.` and `a` would share one `route` label).
fn rule_name(v: &Value, path: &str) -> Res<String> {
    let s = string(v, path)?;
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    let dots_inside = s.split('.').all(|part| !part.is_empty());
    if s.is_empty() || s.len() > MAX_RULE_NAME_LEN || !s.chars().all(ok_char) || !dots_inside {
        return Err(err(
            path,
            format!(
                "{s:?} is not a route name: expected 1 to {MAX_RULE_NAME_LEN} of A-Z a-z 0-9 _ . -, \
                 no leading, trailing or doubled dot"
            ),
        ));
    }
    Ok(s.to_owned())
}

fn rule_match(v: &Value, path: &str) -> Res<(PathMatch, Vec<String>)> {
    let o = object(v, path, &["prefix", "exact", "methods"])?;
    let path_match = match (get(o, "prefix"), get(o, "exact")) {
        (Some(p), None) => PathMatch::Prefix(url_path(p, &key(path, "prefix"))?),
        (None, Some(e)) => PathMatch::Exact(url_path(e, &key(path, "exact"))?),
        _ => return Err(err(path, "expected exactly one of \"prefix\" or \"exact\"")),
    };
    let methods = match optional(o, path, "methods", |v, f| unique_list(v, f, method))? {
        Some(m) if m.is_empty() => return Err(err(&key(path, "methods"), "must not be empty")),
        Some(m) => m,
        None => DEFAULT_METHODS.iter().map(|m| (*m).to_owned()).collect(),
    };
    Ok((path_match, methods))
}

fn url_path(v: &Value, path: &str) -> Res<String> {
    let s = string(v, path)?;
    // Rules match the path with the query already stripped, so '?' or '#' could never match.
    if !s.starts_with('/') || s.contains(['?', '#']) {
        return Err(err(
            path,
            format!("{s:?} is not a path: expected to start with '/' and contain no '?' or '#'"),
        ));
    }
    Ok(s.to_owned())
}

fn fingerprint(v: &Value, path: &str) -> Res<(Vec<String>, Vec<Vec<String>>)> {
    let o = object(v, path, &["headers", "ignore_json_fields"])?;
    let headers = optional(o, path, "headers", |v, f| unique_list(v, f, header_name))?;
    let pointers = optional(o, path, "ignore_json_fields", |v, f| unique_list(v, f, json_pointer))?;
    Ok((headers.unwrap_or_default(), pointers.unwrap_or_default()))
}

/// RFC 9110 field-name, lowercased because HTTP/2 and Envoy present header names in lowercase.
fn header_name(v: &Value, path: &str) -> Res<String> {
    let s = string(v, path)?;
    if s.starts_with(':') {
        return Err(err(path, format!("{s:?} is a pseudo-header, not a header name")));
    }
    if s.len() > MAX_HEADER_NAME_LEN || !is_token(s) {
        return Err(err(
            path,
            format!("{s:?} is not a header name: expected 1 to {MAX_HEADER_NAME_LEN} token characters"),
        ));
    }
    Ok(s.to_ascii_lowercase())
}

fn method(v: &Value, path: &str) -> Res<String> {
    let s = string(v, path)?;
    if !is_token(s) {
        return Err(err(path, format!("{s:?} is not an HTTP method: expected token characters")));
    }
    Ok(s.to_ascii_uppercase())
}

/// RFC 9110 §5.6.2 `token = 1*tchar`.
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// RFC 6901, decoded into reference tokens. The empty pointer is refused: it names the whole
/// body, and ignoring the whole body would make every payload fingerprint the same.
fn json_pointer(v: &Value, path: &str) -> Res<Vec<String>> {
    let s = string(v, path)?;
    let Some(rest) = s.strip_prefix('/') else {
        return Err(err(path, format!("{s:?} is not a JSON Pointer: expected to start with '/'")));
    };
    rest.split('/')
        .map(|token| {
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    _ => {
                        return Err(err(
                            path,
                            format!("{s:?} is not a JSON Pointer: '~' must be followed by 0 or 1"),
                        ))
                    }
                }
            }
            Ok(out)
        })
        .collect()
}

fn status_pattern(v: &Value, path: &str) -> Res<StatusPattern> {
    let s = string(v, path)?;
    let bad = || err(path, format!("{s:?} is not a status: expected a class 1xx..5xx or a code 100..599"));
    match *s.as_bytes() {
        [c @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => Ok(StatusPattern::Class(c - b'0')),
        [b'1'..=b'5', b'0'..=b'9', b'0'..=b'9'] => s.parse().map(StatusPattern::Code).map_err(|_| bad()),
        _ => Err(bad()),
    }
}

fn pattern_text(p: StatusPattern) -> String {
    match p {
        StatusPattern::Code(c) => format!("\"{c}\""),
        StatusPattern::Class(c) => format!("\"{c}xx\""),
    }
}

const DURATION_GRAMMAR: &str = "digits followed by ms, s, m, h or d (e.g. \"30s\")";

fn duration_ms(v: &Value, path: &str) -> Res<u64> {
    let Value::String(s) = v else {
        return Err(err(path, format!("expected a duration string of {DURATION_GRAMMAR}, got {}", kind(v))));
    };
    let bad = || err(path, format!("{s:?} is not a duration: expected {DURATION_GRAMMAR}"));
    let unit = s.trim_start_matches(|c: char| c.is_ascii_digit());
    let digits = s.strip_suffix(unit).unwrap_or_default();
    let scale: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    if digits.is_empty() {
        return Err(bad());
    }
    let too_large = || err(path, format!("{s:?} is too large"));
    let ms = digits.parse::<u64>().ok().and_then(|n| n.checked_mul(scale)).ok_or_else(too_large)?;
    if ms == 0 {
        return Err(err(path, format!("{s:?} must be greater than zero")));
    }
    Ok(ms)
}

// ---- generic JSON walking: each helper takes the field path so errors can name it ----

fn err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.to_owned(), reason: reason.into() }
}

fn key(parent: &str, k: &str) -> String {
    if parent.is_empty() {
        k.to_owned()
    } else {
        format!("{parent}.{k}")
    }
}

fn index(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// The parser's wording talks about a request body; this names the configuration instead.
fn json_error(e: JsonError) -> ConfigError {
    let reason = match e {
        JsonError::InvalidUtf8 => "not valid UTF-8".to_owned(),
        JsonError::ByteOrderMark => "starts with a UTF-8 byte order mark".to_owned(),
        JsonError::Empty => "empty: expected a JSON object".to_owned(),
        JsonError::Syntax { offset } => format!("not valid JSON: syntax error at byte {offset}"),
        JsonError::DuplicateMember => "not valid JSON: an object has a duplicate member name".to_owned(),
        JsonError::TooDeep { limit } => format!("not valid JSON: nested deeper than {limit} levels"),
        JsonError::LoneSurrogate => {
            "not valid JSON: a string escape holds an unpaired UTF-16 surrogate".to_owned()
        }
        JsonError::TrailingData => "not valid JSON: data after the top-level value".to_owned(),
    };
    err("", reason)
}

fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => (*n).to_owned(),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn type_error(path: &str, expected: &str, v: &Value) -> ConfigError {
    err(path, format!("expected {expected}, got {}", kind(v)))
}

/// An object whose keys must all be in `allowed`: a misspelt optional field would otherwise
/// silently fall back to its default.
fn object<'v, 'j>(v: &'v Value<'j>, path: &str, allowed: &[&str]) -> Res<&'v Obj<'j>> {
    let o = object_any(v, path)?;
    reject_unknown(o, path, allowed)?;
    Ok(o)
}

fn object_any<'v, 'j>(v: &'v Value<'j>, path: &str) -> Res<&'v Obj<'j>> {
    match v {
        Value::Object(members) => Ok(members),
        _ => Err(type_error(path, "an object", v)),
    }
}

fn get<'v, 'j>(o: &'v Obj<'j>, k: &str) -> Option<&'v Value<'j>> {
    o.iter().find(|(name, _)| name == k).map(|(_, v)| v)
}

fn reject_unknown(o: &Obj, path: &str, allowed: &[&str]) -> Res<()> {
    match o.iter().find(|(k, _)| !allowed.contains(&k.as_ref())) {
        Some((k, _)) => Err(err(&key(path, k), "unknown field")),
        None => Ok(()),
    }
}

fn array<'v, 'j>(v: &'v Value<'j>, path: &str) -> Res<&'v [Value<'j>]> {
    match v {
        Value::Array(items) => Ok(items),
        _ => Err(type_error(path, "an array", v)),
    }
}

fn string<'v>(v: &'v Value, path: &str) -> Res<&'v str> {
    match v {
        Value::String(s) => Ok(s),
        _ => Err(type_error(path, "a string", v)),
    }
}

fn boolean(v: &Value, path: &str) -> Res<bool> {
    match v {
        Value::Bool(b) => Ok(*b),
        _ => Err(type_error(path, "true or false", v)),
    }
}

/// Only plain decimal digits: negatives, fractions (even `1.0`) and exponents (even `1e3`) are
/// refused rather than converted, so a value means exactly what it spells. The JSON grammar
/// already rules out a `+` sign and leading zeros.
fn uint(v: &Value, path: &str, min: u64, max: u64) -> Res<u64> {
    let n = match v {
        Value::Number(text) if text.bytes().all(|b| b.is_ascii_digit()) => text.parse::<u64>().ok(),
        _ => None,
    };
    n.filter(|n| (min..=max).contains(n))
        .ok_or_else(|| type_error(path, &format!("an integer from {min} to {max}"), v))
}

/// An array of distinct items; a duplicate is refused at its own index since it is always a
/// copy-paste slip and, for statuses, could hide which entry was meant.
fn unique_list<T: PartialEq>(v: &Value, path: &str, item: impl Fn(&Value, &str) -> Res<T>) -> Res<Vec<T>> {
    let items = array(v, path)?;
    let mut out: Vec<T> = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        let p = index(path, i);
        let parsed = item(x, &p)?;
        if out.contains(&parsed) {
            return Err(err(&p, "duplicate entry"));
        }
        out.push(parsed);
    }
    Ok(out)
}

fn optional<T>(o: &Obj, parent: &str, k: &str, f: impl FnOnce(&Value, &str) -> Res<T>) -> Res<Option<T>> {
    get(o, k).map(|v| f(v, &key(parent, k))).transpose()
}

fn required<T>(o: &Obj, parent: &str, k: &str, f: impl FnOnce(&Value, &str) -> Res<T>) -> Res<T> {
    optional(o, parent, k, f)?.ok_or_else(|| err(&key(parent, k), "required"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use StatusPattern::{Class, Code};

    /// Top-level fields before a minimal valid route list.
    fn top(fields: &str) -> String {
        format!(r#"{{{fields},"routes":[{{"name":"a","match":{{"prefix":"/"}}}}]}}"#)
    }

    /// Extra fields inside an otherwise minimal route.
    fn rule_json(fields: &str) -> String {
        format!(r#"{{"routes":[{{"name":"a","match":{{"prefix":"/"}},{fields}}}]}}"#)
    }

    fn matcher(m: &str) -> String {
        format!(r#"{{"routes":[{{"name":"a","match":{m}}}]}}"#)
    }

    fn parse_str(s: &str) -> Result<Config, ConfigError> {
        parse(s.as_bytes())
    }

    fn only_rule(json: &str) -> Rule {
        match parse_str(json) {
            Ok(mut c) if c.rules.len() == 1 => (*c.rules.remove(0)).clone(),
            other => unreachable!("{json}: {other:?}"),
        }
    }

    fn default_rule(name: &str, path: PathMatch) -> Rule {
        Rule {
            name: name.into(),
            path,
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            ttl_ms: 86_400_000,
            processing_timeout_ms: 30_000,
            max_request_bytes: 1_048_576,
            max_response_bytes: 1_048_576,
            fingerprint_headers: vec![],
            ignore_json_fields: vec![],
            statuses: StatusPolicy {
                store: vec![Class(2), Class(3), Class(4)],
                release: vec![Class(5), Code(401), Code(403), Code(408), Code(409), Code(425), Code(429)],
            },
            replay_exclude_headers: vec![],
            concurrency: Concurrency::Reject,
            execution: Execution::Inline,
            unknown_outcome: UnknownOutcome::Takeover,
        }
    }

    #[test]
    fn rejects_bad_configs_naming_the_field() {
        let long_header = format!(r#""key_header":"{}""#, "h".repeat(129));
        let long_name = format!(r#"{{"routes":[{{"name":"{}","match":{{"prefix":"/"}}}}]}}"#, "n".repeat(65));
        let cases: Vec<(&str, String, &str)> = vec![
            // document
            ("invalid json", "{".into(), ""),
            ("empty input", "".into(), ""),
            ("top-level array", "[]".into(), ""),
            ("top-level null", "null".into(), ""),
            ("top-level string", r#""x""#.into(), ""),
            ("duplicate top-level key", r#"{"routes":[{"name":"a","match":{"prefix":"/"}}],"routes":[{"name":"b","match":{"prefix":"/"}}]}"#.into(), ""),
            ("duplicate nested key", rule_json(r#""ttl":"1h","ttl":"2h""#), ""),
            ("byte order mark", "\u{feff}{}".into(), ""),
            ("trailing data", format!("{} x", top(r#""key_header":"k""#)), ""),
            ("unknown top-level field", top(r#""foo":1"#), "foo"),
            ("missing routes", "{}".into(), "routes"),
            ("routes not array", r#"{"routes":{}}"#.into(), "routes"),
            ("empty routes", r#"{"routes":[]}"#.into(), "routes"),
            // wait mode and replay
            ("concurrent unknown", rule_json(r#""concurrent":"queue""#), "routes[0].concurrent"),
            ("execution unknown", rule_json(r#""execution":"async""#), "routes[0].execution"),
            ("unknown_outcome unknown", rule_json(r#""unknown_outcome":"retry""#), "routes[0].unknown_outcome"),
            ("unknown_outcome not string", rule_json(r#""unknown_outcome":true"#), "routes[0].unknown_outcome"),
            ("unknown_outcome wrong case", rule_json(r#""unknown_outcome":"Refuse""#), "routes[0].unknown_outcome"),
            ("execution not string", rule_json(r#""execution":1"#), "routes[0].execution"),
            ("cluster inline", rule_json(r#""cluster":"orders""#), "routes[0].cluster"),
            ("upstream_timeout inline", rule_json(r#""upstream_timeout":"1s""#), "routes[0].upstream_timeout"),
            ("cluster empty", rule_json(r#""execution":"detached","cluster":"""#), "routes[0].cluster"),
            (
                "upstream_timeout at the lease",
                rule_json(r#""execution":"detached","processing_timeout":"10s","upstream_timeout":"10s""#),
                "routes[0].upstream_timeout",
            ),
            (
                "upstream_timeout past the lease",
                rule_json(r#""execution":"detached","upstream_timeout":"31s""#),
                "routes[0].upstream_timeout",
            ),
            ("detached calls zero", top(r#""max_detached_calls":0"#), "max_detached_calls"),
            (
                "detached calls over the memory budget",
                r#"{"max_detached_calls":129,"routes":[{"name":"a","match":{"prefix":"/"},"execution":"detached"}]}"#.into(),
                "max_detached_calls",
            ),
            ("concurrent not string", rule_json(r#""concurrent":true"#), "routes[0].concurrent"),
            ("wait_timeout without wait", rule_json(r#""wait_timeout":"5s""#), "routes[0].wait_timeout"),
            ("wait_timeout bad", rule_json(r#""concurrent":"wait","wait_timeout":"5""#), "routes[0].wait_timeout"),
            ("waiters zero", top(r#""max_waiters":0"#), "max_waiters"),
            ("waiters per key too many", top(r#""max_waiters_per_key":100001"#), "max_waiters_per_key"),
            ("replay exclude bad", rule_json(r#""replay_exclude_headers":["set cookie"]"#), "routes[0].replay_exclude_headers[0]"),
            ("wait_timeout over the bound", rule_json(r#""concurrent":"wait","wait_timeout":"301s""#), "routes[0].wait_timeout"),
            ("wait_timeout huge", rule_json(r#""concurrent":"wait","wait_timeout":"99999999999999d""#), "routes[0].wait_timeout"),
            ("waiters over the memory budget", r#"{"max_waiters":257,"routes":[{"name":"a","match":{"prefix":"/"},"concurrent":"wait"}]}"#.into(), "max_waiters"),
            ("waiters x largest wait body", r#"{"max_waiters":100000,"routes":[{"name":"a","match":{"prefix":"/"},"concurrent":"wait","max_request_bytes":67108864}]}"#.into(), "max_waiters"),
            // identity and quota
            ("principal not object", top(r#""principal":"jwt""#), "principal"),
            ("principal unknown field", top(r#""principal":{"jwt_payload":"p","claims":["sub"],"x":1}"#), "principal.x"),
            ("principal payload missing", top(r#""principal":{"claims":["sub"]}"#), "principal.jwt_payload"),
            ("principal payload empty", top(r#""principal":{"jwt_payload":"","claims":["sub"]}"#), "principal.jwt_payload"),
            ("principal claims missing", top(r#""principal":{"jwt_payload":"p"}"#), "principal.claims"),
            ("principal claims empty", top(r#""principal":{"jwt_payload":"p","claims":[]}"#), "principal.claims"),
            ("principal claim duplicate", top(r#""principal":{"jwt_payload":"p","claims":["sub","sub"]}"#), "principal.claims[1]"),
            ("principal claim number", top(r#""principal":{"jwt_payload":"p","claims":[1]}"#), "principal.claims[0]"),
            ("quota not object", top(r#""quota":5"#), "quota"),
            ("quota unknown field", top(r#""quota":{"per_route":5}"#), "quota.per_route"),
            ("quota zero", top(r#""quota":{"per_principal":0}"#), "quota.per_principal"),
            ("quota too big", top(r#""quota":{"per_tenant":10000001}"#), "quota.per_tenant"),
            ("route not object", r#"{"routes":[1]}"#.into(), "routes[0]"),
            // headers
            ("key header with space", top(r#""key_header":"idem key""#), "key_header"),
            ("key header empty", top(r#""key_header":"""#), "key_header"),
            ("key header pseudo", top(r#""key_header":":authority""#), "key_header"),
            ("key header too long", top(&long_header), "key_header"),
            ("key header number", top(r#""key_header":1"#), "key_header"),
            ("key header null", top(r#""key_header":null"#), "key_header"),
            ("tenant header bad", top(r#""tenant_header":"x y""#), "tenant_header"),
            ("tenant header bool", top(r#""tenant_header":false"#), "tenant_header"),
            ("principal not array", top(r#""principal_headers":"authorization""#), "principal_headers"),
            ("principal entry number", top(r#""principal_headers":[1]"#), "principal_headers[0]"),
            ("principal entry bad", top(r#""principal_headers":["a","b(c)"]"#), "principal_headers[1]"),
            ("principal duplicate after lowercasing", top(r#""principal_headers":["Authorization","authorization"]"#), "principal_headers[1]"),
            // store
            ("store not object", top(r#""store":"local""#), "store"),
            ("store missing type", top(r#""store":{"capacity":10}"#), "store.type"),
            ("store type redis", top(r#""store":{"type":"redis"}"#), "store.type"),
            ("store type number", top(r#""store":{"type":1}"#), "store.type"),
            ("store unknown field", top(r#""store":{"type":"local","foo":1}"#), "store.foo"),
            ("capacity zero", top(r#""store":{"type":"local","capacity":0}"#), "store.capacity"),
            ("capacity too big", top(r#""store":{"type":"local","capacity":10000001}"#), "store.capacity"),
            ("capacity negative", top(r#""store":{"type":"local","capacity":-1}"#), "store.capacity"),
            ("capacity float", top(r#""store":{"type":"local","capacity":1.5}"#), "store.capacity"),
            ("capacity integral float", top(r#""store":{"type":"local","capacity":10.0}"#), "store.capacity"),
            ("capacity string", top(r#""store":{"type":"local","capacity":"10"}"#), "store.capacity"),
            (
                "replay_cache with the local store",
                top(r#""store":{"type":"local","replay_cache":{}}"#),
                "store.replay_cache",
            ),
            ("capacity exponent", top(r#""store":{"type":"local","capacity":1e3}"#), "store.capacity"),
            ("capacity upper exponent", top(r#""store":{"type":"local","capacity":10E0}"#), "store.capacity"),
            ("capacity negative zero", top(r#""store":{"type":"local","capacity":-0}"#), "store.capacity"),
            ("capacity above u64", top(r#""store":{"type":"local","capacity":18446744073709551616}"#), "store.capacity"),
            ("waiters plus sign", top(r#""max_waiters":+5"#), ""),
            ("waiters leading zero", top(r#""max_waiters":05"#), ""),
            // problem statuses
            ("problem statuses not object", top(r#""problem_statuses":[]"#), "problem_statuses"),
            ("problem status unknown", top(r#""problem_statuses":{"foo":400}"#), "problem_statuses.foo"),
            ("problem status 200", top(r#""problem_statuses":{"invalid_key":200}"#), "problem_statuses.invalid_key"),
            ("problem status 600", top(r#""problem_statuses":{"mismatch":600}"#), "problem_statuses.mismatch"),
            ("problem status 500", top(r#""problem_statuses":{"in_flight":500}"#), "problem_statuses.in_flight"),
            ("problem status string", top(r#""problem_statuses":{"in_flight":"409"}"#), "problem_statuses.in_flight"),
            // route name
            ("unknown route field", rule_json(r#""foo":1"#), "routes[0].foo"),
            ("name missing", r#"{"routes":[{"match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
            ("name empty", r#"{"routes":[{"name":"","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
            ("name with space", r#"{"routes":[{"name":"a b","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
            ("name ending with a dot", r#"{"routes":[{"name":"a.","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
            ("name starting with a dot", r#"{"routes":[{"name":".a","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
            ("name with two dots", r#"{"routes":[{"name":"a..b","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
            ("name too long", long_name, "routes[0].name"),
            ("duplicate names", r#"{"routes":[{"name":"a","match":{"prefix":"/a"}},{"name":"a","match":{"prefix":"/b"}}]}"#.into(), "routes[1].name"),
            // match
            ("match missing", r#"{"routes":[{"name":"a"}]}"#.into(), "routes[0].match"),
            ("match not object", matcher(r#""/""#), "routes[0].match"),
            ("match unknown field", matcher(r#"{"prefix":"/","foo":1}"#), "routes[0].match.foo"),
            ("prefix and exact", matcher(r#"{"prefix":"/","exact":"/a"}"#), "routes[0].match"),
            ("neither prefix nor exact", matcher(r#"{"methods":["POST"]}"#), "routes[0].match"),
            ("prefix without slash", matcher(r#"{"prefix":"orders"}"#), "routes[0].match.prefix"),
            ("prefix empty", matcher(r#"{"prefix":""}"#), "routes[0].match.prefix"),
            ("prefix with fragment", matcher(r##"{"prefix":"/a#b"}"##), "routes[0].match.prefix"),
            ("exact with query", matcher(r#"{"exact":"/a?b=1"}"#), "routes[0].match.exact"),
            ("prefix number", matcher(r#"{"prefix":1}"#), "routes[0].match.prefix"),
            ("methods empty", matcher(r#"{"prefix":"/","methods":[]}"#), "routes[0].match.methods"),
            ("methods string", matcher(r#"{"prefix":"/","methods":"POST"}"#), "routes[0].match.methods"),
            ("method bad token", matcher(r#"{"prefix":"/","methods":["PO ST"]}"#), "routes[0].match.methods[0]"),
            ("method duplicate after uppercasing", matcher(r#"{"prefix":"/","methods":["post","POST"]}"#), "routes[0].match.methods[1]"),
            // booleans and durations
            ("require_key string", rule_json(r#""require_key":"yes""#), "routes[0].require_key"),
            ("ttl empty", rule_json(r#""ttl":"""#), "routes[0].ttl"),
            ("ttl no unit", rule_json(r#""ttl":"10""#), "routes[0].ttl"),
            ("ttl fraction", rule_json(r#""ttl":"1.5s""#), "routes[0].ttl"),
            ("ttl negative", rule_json(r#""ttl":"-1s""#), "routes[0].ttl"),
            ("ttl zero", rule_json(r#""ttl":"0s""#), "routes[0].ttl"),
            ("ttl bad unit", rule_json(r#""ttl":"10x""#), "routes[0].ttl"),
            ("ttl uppercase unit", rule_json(r#""ttl":"10S""#), "routes[0].ttl"),
            ("ttl leading space", rule_json(r#""ttl":" 10s""#), "routes[0].ttl"),
            ("ttl trailing space", rule_json(r#""ttl":"10s ""#), "routes[0].ttl"),
            ("ttl unit only", rule_json(r#""ttl":"s""#), "routes[0].ttl"),
            ("ttl two units", rule_json(r#""ttl":"1h30m""#), "routes[0].ttl"),
            ("ttl number", rule_json(r#""ttl":10"#), "routes[0].ttl"),
            ("ttl null", rule_json(r#""ttl":null"#), "routes[0].ttl"),
            ("ttl digits overflow", rule_json(r#""ttl":"99999999999999999999ms""#), "routes[0].ttl"),
            ("ttl ms overflow", rule_json(r#""ttl":"213503982335d""#), "routes[0].ttl"),
            ("processing timeout zero", rule_json(r#""processing_timeout":"0ms""#), "routes[0].processing_timeout"),
            ("processing timeout above ttl", rule_json(r#""ttl":"10s","processing_timeout":"11s""#), "routes[0].processing_timeout"),
            ("default processing timeout above ttl", rule_json(r#""ttl":"1s""#), "routes[0].processing_timeout"),
            // sizes
            ("request bytes zero", rule_json(r#""max_request_bytes":0"#), "routes[0].max_request_bytes"),
            ("request bytes negative", rule_json(r#""max_request_bytes":-1"#), "routes[0].max_request_bytes"),
            ("request bytes float", rule_json(r#""max_request_bytes":1.5"#), "routes[0].max_request_bytes"),
            ("request bytes exponent", rule_json(r#""max_request_bytes":1e3"#), "routes[0].max_request_bytes"),
            ("request bytes above 64 MiB", rule_json(r#""max_request_bytes":67108865"#), "routes[0].max_request_bytes"),
            ("request bytes string", rule_json(r#""max_request_bytes":"1""#), "routes[0].max_request_bytes"),
            ("response bytes zero", rule_json(r#""max_response_bytes":0"#), "routes[0].max_response_bytes"),
            ("response bytes huge", rule_json(r#""max_response_bytes":18446744073709551616"#), "routes[0].max_response_bytes"),
            // fingerprint
            ("fingerprint not object", rule_json(r#""fingerprint":[]"#), "routes[0].fingerprint"),
            ("fingerprint unknown field", rule_json(r#""fingerprint":{"foo":1}"#), "routes[0].fingerprint.foo"),
            ("fingerprint header bad", rule_json(r#""fingerprint":{"headers":["content type"]}"#), "routes[0].fingerprint.headers[0]"),
            ("fingerprint header duplicate", rule_json(r#""fingerprint":{"headers":["A","a"]}"#), "routes[0].fingerprint.headers[1]"),
            ("pointer empty", rule_json(r#""fingerprint":{"ignore_json_fields":[""]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
            ("pointer without slash", rule_json(r#""fingerprint":{"ignore_json_fields":["a/b"]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
            ("pointer bad escape", rule_json(r#""fingerprint":{"ignore_json_fields":["/a~2"]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
            ("pointer dangling tilde", rule_json(r#""fingerprint":{"ignore_json_fields":["/ok","/a~"]}"#), "routes[0].fingerprint.ignore_json_fields[1]"),
            ("pointer not string", rule_json(r#""fingerprint":{"ignore_json_fields":[1]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
            (
                "pointer error in second route",
                r#"{"routes":[{"name":"a","match":{"prefix":"/a"}},{"name":"b","match":{"prefix":"/b"},"fingerprint":{"ignore_json_fields":["/x","/y","z"]}}]}"#.into(),
                "routes[1].fingerprint.ignore_json_fields[2]",
            ),
            // statuses
            ("statuses not array", rule_json(r#""store_statuses":"2xx""#), "routes[0].store_statuses"),
            ("status number", rule_json(r#""store_statuses":[200]"#), "routes[0].store_statuses[0]"),
            ("status class 6xx", rule_json(r#""store_statuses":["6xx"]"#), "routes[0].store_statuses[0]"),
            ("status class 0xx", rule_json(r#""store_statuses":["0xx"]"#), "routes[0].store_statuses[0]"),
            ("status half class", rule_json(r#""store_statuses":["2x0"]"#), "routes[0].store_statuses[0]"),
            ("status 600", rule_json(r#""store_statuses":["600"]"#), "routes[0].store_statuses[0]"),
            ("status 099", rule_json(r#""store_statuses":["099"]"#), "routes[0].store_statuses[0]"),
            ("status two digits", rule_json(r#""store_statuses":["20"]"#), "routes[0].store_statuses[0]"),
            ("status four digits", rule_json(r#""store_statuses":["2000"]"#), "routes[0].store_statuses[0]"),
            ("status with sign", rule_json(r#""release_statuses":["+50"]"#), "routes[0].release_statuses[0]"),
            ("status duplicate class", rule_json(r#""store_statuses":["2xx","2XX"]"#), "routes[0].store_statuses[1]"),
            ("status duplicate code", rule_json(r#""release_statuses":["500","500"]"#), "routes[0].release_statuses[1]"),
            ("code in both lists", rule_json(r#""store_statuses":["429"]"#), "routes[0].release_statuses"),
            ("class in both lists", rule_json(r#""store_statuses":["5xx"]"#), "routes[0].release_statuses"),
        ];
        for (name, json, field) in cases {
            match parse_str(&json) {
                Err(e) => assert_eq!(e.field, field, "{name}: {json}: {e}"),
                Ok(c) => unreachable!("{name}: {json} parsed: {c:?}"),
            }
        }
    }

    #[test]
    fn full_example_parses_exactly() {
        let json = r#"{
          "key_header": "idempotency-key",
          "tenant_header": "x-tenant-id",
          "principal_headers": ["authorization"],
          "store": {"type": "local", "capacity": 100000},
          "problem_statuses": {"invalid_key": 400, "mismatch": 422, "in_flight": 409},
          "routes": [
            {
              "name": "orders",
              "match": {"prefix": "/orders", "methods": ["POST"]},
              "require_key": true,
              "ttl": "24h",
              "processing_timeout": "30s",
              "max_request_bytes": 1048576,
              "max_response_bytes": 1048576,
              "fingerprint": {"headers": ["content-type"], "ignore_json_fields": ["/meta/sent_at"]},
              "store_statuses": ["2xx", "3xx", "4xx"],
                  "release_statuses": ["5xx", "408", "425", "429"]
            }
          ],
          "principal": {"jwt_payload": "jwt_payload", "claims": ["iss", "sub"]},
          "quota": {"per_tenant": 5000, "per_principal": 100}
        }"#;
        let expected = Config {
            key_header: "idempotency-key".into(),
            tenant_header: Some("x-tenant-id".into()),
            principal_headers: vec!["authorization".into()],
            store: StoreConfig::Local { capacity: 100_000 },
            etcd: None,
            problem_statuses: ProblemStatuses { invalid_key: 400, mismatch: 422, in_flight: 409 },
            rules: vec![Rule {
                methods: vec!["POST".into()],
                require_key: true,
                fingerprint_headers: vec!["content-type".into()],
                ignore_json_fields: vec![vec!["meta".into(), "sent_at".into()]],
                statuses: StatusPolicy {
                    store: vec![Class(2), Class(3), Class(4)],
                    release: vec![Class(5), Code(408), Code(425), Code(429)],
                },
                ..default_rule("orders", PathMatch::Prefix("/orders".into()))
            }
            .into()],
            max_waiters_per_key: 100,
            max_waiters: 1_000,
            jwt_principal: Some(JwtPrincipal {
                payload: "jwt_payload".into(),
                claims: vec!["iss".into(), "sub".into()],
            }),
            quota: Quota { per_tenant: Some(5000), per_principal: Some(100) },
            max_detached_calls: 1_000,
        };
        assert_eq!(parse_str(json), Ok(expected));
    }

    #[test]
    fn wait_mode_and_replay_exclusions() {
        let r = only_rule(&rule_json(r#""concurrent":"wait","replay_exclude_headers":["Set-Cookie"]"#));
        assert_eq!(r.concurrency, Concurrency::Wait { timeout_ms: 10_000 });
        assert_eq!(r.replay_exclude_headers, vec!["set-cookie".to_string()]);
        let r = only_rule(&rule_json(r#""concurrent":"wait","wait_timeout":"250ms""#));
        assert_eq!(r.concurrency, Concurrency::Wait { timeout_ms: 250 });
        assert_eq!(only_rule(&rule_json(r#""concurrent":"reject""#)).concurrency, Concurrency::Reject);
    }

    #[test]
    fn waiter_defaults_fit_the_memory_budget() {
        let wait = |fields: &str| {
            parse_str(&format!(
                r#"{{{fields}"routes":[{{"name":"a","match":{{"prefix":"/"}},"concurrent":"wait","max_request_bytes":4194304}}]}}"#
            ))
        };
        // 4 MiB bodies: the default 1000 waiters would hold 4 GiB; it shrinks to the budget.
        assert_eq!(wait("").map(|c| c.max_waiters), Ok(64));
        assert_eq!(wait(r#""max_waiters":64,"#).map(|c| c.max_waiters), Ok(64));
        assert_eq!(wait(r#""max_waiters":65,"#).map_err(|e| e.field), Err("max_waiters".to_string()));
        // Reject-mode rules hold nothing: no budget applies.
        assert_eq!(parse_str(&top(r#""max_waiters":100000"#)).map(|c| c.max_waiters), Ok(100_000));
    }

    #[test]
    fn quotas_are_opt_in_and_an_explicit_one_stays_as_configured() {
        // Issue 18, item 5: the defaults were capacity/10 per caller and capacity/4 per tenant,
        // so one anonymous caller (or one service token) got 429 once a tenth of the store was
        // live. No default binds now, for either store; only what the operator writes does.
        let quota = |store: &str, quota: &str| {
            let routes = r#""routes":[{"name":"a","match":{"prefix":"/"}}]"#;
            let fields: Vec<&str> = [store, quota, routes].into_iter().filter(|f| !f.is_empty()).collect();
            parse_str(&format!("{{{}}}", fields.join(","))).map(|c| c.quota)
        };
        let none = Quota { per_tenant: None, per_principal: None };
        for store in [
            "",
            r#""store":{"type":"local","capacity":8}"#,
            r#""store":{"type":"local","capacity":10000000}"#,
            r#""store":{"type":"etcd","cluster":"etcd"},"tenant_header":"x-tenant-id""#,
        ] {
            assert_eq!(quota(store, ""), Ok(none), "{store}");
            assert_eq!(quota(store, r#""quota":{}"#), Ok(none), "{store}");
            assert_eq!(
                quota(store, r#""quota":{"per_tenant":3}"#),
                Ok(Quota { per_tenant: Some(3), per_principal: None }),
                "{store}"
            );
            assert_eq!(
                quota(store, r#""quota":{"per_principal":1,"per_tenant":10000000}"#),
                Ok(Quota { per_tenant: Some(10_000_000), per_principal: Some(1) }),
                "{store}"
            );
        }
    }

    #[test]
    fn minimal_config_yields_all_defaults() {
        let expected = Config {
            key_header: "idempotency-key".into(),
            tenant_header: None,
            principal_headers: vec!["authorization".into()],
            store: StoreConfig::Local { capacity: 100_000 },
            etcd: None,
            problem_statuses: ProblemStatuses { invalid_key: 400, mismatch: 422, in_flight: 409 },
            rules: vec![default_rule("a", PathMatch::Prefix("/".into())).into()],
            max_waiters_per_key: 100,
            max_waiters: 1_000,
            jwt_principal: None,
            // No quota: a default bound would refuse a lone honest caller.
            quota: Quota { per_tenant: None, per_principal: None },
            max_detached_calls: 1_000,
        };
        assert_eq!(parse_str(r#"{"routes":[{"name":"a","match":{"prefix":"/"}}]}"#), Ok(expected));
    }

    #[test]
    fn unknown_outcome_defaults_to_takeover_and_takes_both_values() {
        let default = only_rule(r#"{"routes":[{"name":"a","match":{"prefix":"/"}}]}"#);
        assert_eq!(default.unknown_outcome, UnknownOutcome::Takeover);
        let cases = [("takeover", UnknownOutcome::Takeover), ("refuse", UnknownOutcome::Refuse)];
        for (value, expected) in cases {
            let json = rule_json(&format!(r#""unknown_outcome":"{value}""#));
            assert_eq!(only_rule(&json).unknown_outcome, expected, "{value}");
        }
        // Per rule: one rule's choice is not another's.
        let cfg = parse_str(
            r#"{"routes":[{"name":"pay","match":{"prefix":"/pay"},"unknown_outcome":"refuse"},
                {"name":"search","match":{"prefix":"/"}}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.rules[0].unknown_outcome, UnknownOutcome::Refuse);
        assert_eq!(cfg.rules[1].unknown_outcome, UnknownOutcome::Takeover);
        // The error names the field and the accepted values.
        let e = parse_str(&rule_json(r#""unknown_outcome":"retry""#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"invalid configuration: field `routes[0].unknown_outcome`: "retry": expected "takeover" or "refuse""#
        );
    }

    #[test]
    fn detached_execution_and_its_defaults() {
        let cfg = parse_str(
            r#"{"routes":[{"name":"a","match":{"prefix":"/"},"execution":"detached"},
                {"name":"b","match":{"prefix":"/b"},"execution":"detached","cluster":"pay","upstream_timeout":"9s",
                 "max_request_bytes":65536,"max_response_bytes":65536},
                {"name":"c","match":{"prefix":"/c"},"execution":"inline"}]}"#,
        )
        .unwrap();
        // Half the lease by default; the route's own cluster unless one is named.
        assert_eq!(
            cfg.rules[0].execution,
            Execution::Detached { cluster: None, upstream_timeout_ms: 15_000 }
        );
        assert_eq!(
            cfg.rules[1].execution,
            Execution::Detached { cluster: Some("pay".into()), upstream_timeout_ms: 9_000 }
        );
        assert_eq!(cfg.rules[2].execution, Execution::Inline);
        // 256 MiB over the largest detached request + response (1 + 1 MiB by default).
        assert_eq!(cfg.max_detached_calls, 128);
        let few =
            parse_str(r#"{"max_detached_calls":7,"routes":[{"name":"a","match":{"prefix":"/"}}]}"#).unwrap();
        assert_eq!(few.max_detached_calls, 7);
    }

    #[test]
    fn normalises_case_and_accepts_optional_forms() {
        let json = r#"{
          "key_header": "Idempotency-Key",
          "tenant_header": null,
          "principal_headers": [],
          "store": {"type": "local"},
          "problem_statuses": {"mismatch": 400},
          "routes": [{
            "name": "Pay_v1.x-y",
            "match": {"exact": "/pay", "methods": ["put", "Post"]},
            "fingerprint": {"headers": ["Content-Type", "X-Api-Version"]},
            "store_statuses": ["2XX", "201"],
            "release_statuses": []
          }]
        }"#;
        let c = match parse_str(json) {
            Ok(c) => c,
            Err(e) => unreachable!("{e}"),
        };
        assert_eq!(c.key_header, "idempotency-key");
        assert_eq!(c.tenant_header, None);
        assert!(c.principal_headers.is_empty());
        assert_eq!(c.store, StoreConfig::Local { capacity: 100_000 });
        assert_eq!(c.problem_statuses, ProblemStatuses { invalid_key: 400, mismatch: 400, in_flight: 409 });
        let r = &c.rules[0];
        assert_eq!(r.name, "Pay_v1.x-y");
        assert_eq!(r.path, PathMatch::Exact("/pay".into()));
        assert_eq!(r.methods, ["PUT", "POST"]);
        assert_eq!(r.fingerprint_headers, ["content-type", "x-api-version"]);
        assert_eq!(r.statuses, StatusPolicy { store: vec![Class(2), Code(201)], release: vec![] });
    }

    #[test]
    fn accepts_boundaries() {
        let r = only_rule(&rule_json(
            r#""max_request_bytes":1,"max_response_bytes":67108864,"ttl":"1ms","processing_timeout":"1ms""#,
        ));
        assert_eq!(
            (r.max_request_bytes, r.max_response_bytes, r.ttl_ms, r.processing_timeout_ms),
            (1, 67_108_864, 1, 1)
        );
        let c = parse_str(&top(
            r#""store":{"type":"local","capacity":10000000},"problem_statuses":{"invalid_key":499,"in_flight":400}"#,
        ));
        assert_eq!(c.as_ref().map(|c| c.store.clone()), Ok(StoreConfig::Local { capacity: 10_000_000 }));
        assert_eq!(
            c.map(|c| c.problem_statuses),
            Ok(ProblemStatuses { invalid_key: 499, mismatch: 422, in_flight: 400 })
        );
        let long = format!(
            r#"{{"key_header":"{}","routes":[{{"name":"{}","match":{{"prefix":"/"}}}}]}}"#,
            "h".repeat(128),
            "n".repeat(64)
        );
        assert!(parse_str(&long).is_ok());
    }

    #[test]
    fn durations_convert_to_milliseconds() {
        let cases = [
            ("1ms", 1),
            ("2s", 2_000),
            ("3m", 180_000),
            ("4h", 14_400_000),
            ("5d", 432_000_000),
            ("007s", 7_000),
            ("213503982334d", 213_503_982_334 * 86_400_000),
        ];
        for (text, ms) in cases {
            let r = only_rule(&rule_json(&format!(r#""ttl":"{text}","processing_timeout":"1ms""#)));
            assert_eq!(r.ttl_ms, ms, "{text}");
        }
    }

    #[test]
    fn duration_error_states_the_grammar() {
        let e = parse_str(&rule_json(r#""ttl":"10x""#));
        let expected =
            r#""10x" is not a duration: expected digits followed by ms, s, m, h or d (e.g. "30s")"#;
        assert_eq!(e.map_err(|e| e.reason), Err(expected.to_owned()));
        let e = parse_str(&rule_json(r#""ttl":10"#));
        assert!(e.is_err_and(|e| e.reason.contains("digits followed by ms, s, m, h or d")));
    }

    #[test]
    fn json_pointers_are_decoded() {
        let cases: [(&str, &[&str]); 6] = [
            ("/a~1b/0", &["a/b", "0"]),
            ("/meta/sent_at", &["meta", "sent_at"]),
            ("/", &[""]),
            ("/a//b", &["a", "", "b"]),
            ("/~01", &["~1"]),
            ("/~1~0", &["/~"]),
        ];
        for (pointer, tokens) in cases {
            let r =
                only_rule(&rule_json(&format!(r#""fingerprint":{{"ignore_json_fields":["{pointer}"]}}"#)));
            assert_eq!(r.ignore_json_fields, [tokens.to_vec()], "{pointer}");
        }
    }

    #[test]
    fn status_entries_parse() {
        let r = only_rule(&rule_json(
            r#""store_statuses":["1xx","2Xx","100","599"],"release_statuses":["5xx","200"]"#,
        ));
        assert_eq!(r.statuses.store, [Class(1), Class(2), Code(100), Code(599)]);
        assert_eq!(r.statuses.release, [Class(5), Code(200)]);
    }

    #[test]
    fn errors_display_with_field() {
        let e = parse_str(&rule_json(r#""fingerprint":{"foo":1}"#));
        assert_eq!(
            e.map_err(|e| e.to_string()),
            Err("invalid configuration: field `routes[0].fingerprint.foo`: unknown field".to_owned())
        );
        let e = parse_str("{");
        assert_eq!(
            e.map_err(|e| (e.field.clone(), e.to_string())),
            Err((String::new(), "invalid configuration: not valid JSON: syntax error at byte 1".to_owned()))
        );
    }

    #[test]
    fn json_errors_name_the_problem() {
        let reason = |json: &[u8]| parse(json).map(|_| ()).map_err(|e| e.reason);
        assert_eq!(
            reason(br#"{"routes":[{"name":"a","match":{"prefix":"/"}}],"routes":[]}"#),
            Err("not valid JSON: an object has a duplicate member name".to_owned())
        );
        assert_eq!(reason(br#"{"routes": [1,]}"#), Err("not valid JSON: syntax error at byte 14".to_owned()));
        assert_eq!(reason(b" \n"), Err("empty: expected a JSON object".to_owned()));
        assert_eq!(reason(b"{\"routes\":\"\xff\"}"), Err("not valid UTF-8".to_owned()));
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert!(reason(deep.as_bytes()).is_err_and(|r| r.contains("deeper than 64")));
    }

    #[test]
    fn integer_errors_quote_the_number_as_written() {
        let e = parse_str(&top(r#""store":{"type":"local","capacity":1e3}"#));
        assert_eq!(
            e.map_err(|e| e.reason),
            Err("expected an integer from 1 to 10000000, got 1e3".to_owned())
        );
        let e = parse_str(&rule_json(r#""max_request_bytes":1.0"#));
        assert!(e.is_err_and(|e| e.reason.ends_with("got 1.0")));
    }

    #[test]
    fn escaped_strings_and_members_in_any_order_are_read() {
        let json = r#"{"routes":[{"match":{"prefix":"\/orders"},"name":"\u006frders","ttl":"1\u0068"}],"key_header":"X-K\u0065y"}"#;
        let c = match parse_str(json) {
            Ok(c) => c,
            Err(e) => unreachable!("{e}"),
        };
        assert_eq!(c.key_header, "x-key");
        assert_eq!(c.rules[0].name, "orders");
        assert_eq!(c.rules[0].path, PathMatch::Prefix("/orders".into()));
        assert_eq!(c.rules[0].ttl_ms, 3_600_000);
    }

    #[test]
    fn first_unknown_field_in_document_order_is_reported() {
        let e = parse_str(&rule_json(r#""zzz":1,"aaa":2"#));
        assert_eq!(e.map_err(|e| e.field), Err("routes[0].zzz".to_owned()));
    }

    #[test]
    fn disposition_prefers_exact_codes_over_classes() {
        let policy = StatusPolicy {
            store: vec![Class(2), Code(503), Class(4)],
            release: vec![Class(5), Code(409), Code(201)],
        };
        let cases = [
            (200, Disposition::Store),
            (201, Disposition::Release),
            (404, Disposition::Store),
            (409, Disposition::Release),
            (500, Disposition::Release),
            (503, Disposition::Store),
            (302, Disposition::Release),
            (100, Disposition::Release),
            (600, Disposition::Release),
            (0, Disposition::Release),
            (u16::MAX, Disposition::Release),
        ];
        for (status, expected) in cases {
            assert_eq!(policy.disposition(status), expected, "{status}");
        }
        let defaults = default_rule("a", PathMatch::Prefix("/".into())).statuses;
        let cases =
            [(200, true), (301, true), (404, true), (408, false), (425, false), (429, false), (500, false)];
        for (status, stored) in cases {
            assert_eq!(defaults.disposition(status) == Disposition::Store, stored, "{status}");
        }
    }

    #[test]
    fn rules_match_method_and_path() {
        let prefix =
            Rule { methods: vec!["POST".into()], ..default_rule("p", PathMatch::Prefix("/orders".into())) };
        let exact = default_rule("e", PathMatch::Exact("/pay".into()));
        let cases = [
            (&prefix, "POST", "/orders", true),
            (&prefix, "POST", "/orders/1", true),
            (&prefix, "POST", "/ordersx", true),
            (&prefix, "POST", "/order", false),
            (&prefix, "post", "/orders", false),
            (&prefix, "PATCH", "/orders", false),
            (&exact, "PATCH", "/pay", true),
            (&exact, "POST", "/pay", true),
            (&exact, "POST", "/pay/", false),
            (&exact, "POST", "/pa", false),
            (&exact, "GET", "/pay", false),
        ];
        for (rule, method, path, expected) in cases {
            assert_eq!(rule.matches(method, path), expected, "{} {method} {path}", rule.name);
        }
    }

    #[test]
    fn rule_for_takes_first_match() {
        let json = r#"{"routes":[
            {"name":"specific","match":{"exact":"/orders/bulk"}},
            {"name":"general","match":{"prefix":"/orders"}}
        ]}"#;
        let c = match parse_str(json) {
            Ok(c) => c,
            Err(e) => unreachable!("{e}"),
        };
        let name = |m, p| c.rule_for(m, p).map(|r| r.name.as_str());
        assert_eq!(name("POST", "/orders/bulk"), Some("specific"));
        assert_eq!(name("POST", "/orders/1"), Some("general"));
        assert_eq!(name("GET", "/orders/1"), None);
        assert_eq!(name("POST", "/users"), None);
    }

    fn etcd(store_fields: &str, route_fields: &str) -> String {
        let sep = if route_fields.is_empty() { "" } else { "," };
        format!(
            r#"{{"store":{{"type":"etcd","cluster":"etcd"{store_fields}}},"routes":[{{"name":"a","match":{{"prefix":"/"}}{sep}{route_fields}}}]}}"#
        )
    }

    #[test]
    fn rejects_bad_etcd_configs_naming_the_field() {
        let long_prefix = format!(r#","prefix":"/{}/""#, "p".repeat(127));
        let over_limit = format!(r#""max_response_bytes":{}"#, etcd::MAX_STORED_BODY_BYTES + 1);
        let cases: Vec<(&str, String, &str)> = vec![
            (
                "cluster missing",
                r#"{"store":{"type":"etcd"},"routes":[{"name":"a","match":{"prefix":"/"}}]}"#.into(),
                "store.cluster",
            ),
            (
                "cluster empty",
                etcd(r#","cluster":"""#, "").replacen(r#""cluster":"etcd","#, "", 1),
                "store.cluster",
            ),
            (
                "cluster number",
                etcd("", "").replace(r#""cluster":"etcd""#, r#""cluster":1"#),
                "store.cluster",
            ),
            ("unknown etcd field", etcd(r#","capacity":10"#, ""), "store.capacity"),
            ("prefix empty", etcd(r#","prefix":"""#, ""), "store.prefix"),
            ("prefix without trailing slash", etcd(r#","prefix":"/idem""#, ""), "store.prefix"),
            ("prefix too long", etcd(&long_prefix, ""), "store.prefix"),
            ("prefix control character", etcd(r#","prefix":"/a\u0001/""#, ""), "store.prefix"),
            ("timeout without unit", etcd(r#","timeout":"250""#, ""), "store.timeout"),
            ("timeout number", etcd(r#","timeout":250"#, ""), "store.timeout"),
            ("timeout zero", etcd(r#","timeout":"0ms""#, ""), "store.timeout"),
            ("timeout over the bound", etcd(r#","timeout":"11s""#, ""), "store.timeout"),
            ("on_error unknown", etcd(r#","on_error":"retry""#, ""), "store.on_error"),
            ("on_error bool", etcd(r#","on_error":true"#, ""), "store.on_error"),
            ("auth not object", etcd(r#","auth":"root:pw""#, ""), "store.auth"),
            ("auth username missing", etcd(r#","auth":{"password":"pw"}"#, ""), "store.auth.username"),
            ("auth password missing", etcd(r#","auth":{"username":"u"}"#, ""), "store.auth.password"),
            (
                "auth username empty",
                etcd(r#","auth":{"username":"","password":"pw"}"#, ""),
                "store.auth.username",
            ),
            (
                "auth password number",
                etcd(r#","auth":{"username":"u","password":1}"#, ""),
                "store.auth.password",
            ),
            (
                "auth timeout without unit",
                etcd(r#","auth":{"username":"u","password":"p","timeout":"2000"}"#, ""),
                "store.auth.timeout",
            ),
            (
                "auth timeout number",
                etcd(r#","auth":{"username":"u","password":"p","timeout":2000}"#, ""),
                "store.auth.timeout",
            ),
            (
                "auth timeout zero",
                etcd(r#","auth":{"username":"u","password":"p","timeout":"0s"}"#, ""),
                "store.auth.timeout",
            ),
            (
                "auth timeout over the bound",
                etcd(r#","auth":{"username":"u","password":"p","timeout":"11s"}"#, ""),
                "store.auth.timeout",
            ),
            (
                "auth unknown field",
                etcd(r#","auth":{"username":"u","password":"p","token":"t"}"#, ""),
                "store.auth.token",
            ),
            // Waiters on etcd keep the same memory budget as on the local store.
            (
                "waiters over the memory budget",
                etcd("", r#""concurrent":"wait""#).replacen('{', r#"{"max_waiters":257,"#, 1),
                "max_waiters",
            ),
            ("response over etcd's request limit", etcd("", &over_limit), "routes[0].max_response_bytes"),
            ("replay_cache not an object", etcd(r#","replay_cache":true"#, ""), "store.replay_cache"),
            ("replay_cache number", etcd(r#","replay_cache":1024"#, ""), "store.replay_cache"),
            (
                "replay_cache unknown field",
                etcd(r#","replay_cache":{"ttl":"1s"}"#, ""),
                "store.replay_cache.ttl",
            ),
            (
                "replay_cache entries zero",
                etcd(r#","replay_cache":{"entries":0}"#, ""),
                "store.replay_cache.entries",
            ),
            (
                "replay_cache entries over the bound",
                etcd(r#","replay_cache":{"entries":100001}"#, ""),
                "store.replay_cache.entries",
            ),
            (
                "replay_cache entries negative",
                etcd(r#","replay_cache":{"entries":-1}"#, ""),
                "store.replay_cache.entries",
            ),
            (
                "replay_cache entries string",
                etcd(r#","replay_cache":{"entries":"10"}"#, ""),
                "store.replay_cache.entries",
            ),
            (
                "replay_cache entries fraction",
                etcd(r#","replay_cache":{"entries":1.5}"#, ""),
                "store.replay_cache.entries",
            ),
            (
                "replay_cache max_bytes under the bound",
                etcd(r#","replay_cache":{"max_bytes":4095}"#, ""),
                "store.replay_cache.max_bytes",
            ),
            (
                "replay_cache max_bytes over the bound",
                etcd(r#","replay_cache":{"max_bytes":268435457}"#, ""),
                "store.replay_cache.max_bytes",
            ),
            (
                "replay_cache max_bytes as text",
                etcd(r#","replay_cache":{"max_bytes":"8MiB"}"#, ""),
                "store.replay_cache.max_bytes",
            ),
        ];
        for (name, json, field) in cases {
            match parse_str(&json) {
                Err(e) => assert_eq!(e.field, field, "{name}: {json}: {e}"),
                Ok(c) => unreachable!("{name}: {json} parsed: {c:?}"),
            }
        }
    }

    #[test]
    fn wait_mode_is_accepted_with_the_etcd_store() {
        let c = match parse_str(&etcd("", r#""concurrent":"wait","wait_timeout":"3s""#)) {
            Ok(c) => c,
            Err(e) => unreachable!("{e}"),
        };
        assert!(c.etcd.is_some());
        assert_eq!(c.rules[0].concurrency, Concurrency::Wait { timeout_ms: 3_000 });
    }

    #[test]
    fn etcd_store_parses_with_defaults_and_in_full() {
        let settings = |json: &str| match parse_str(json) {
            Ok(c) => c.etcd,
            Err(e) => unreachable!("{json}: {e}"),
        };
        assert_eq!(
            settings(&etcd("", "")),
            Some(EtcdSettings {
                cluster: "etcd".into(),
                prefix: "/idempotency/".into(),
                timeout_ms: 250,
                on_error: OnStoreError::FailClosed,
                auth: None,
                auth_timeout_ms: 2_000,
                replay_cache: None,
            })
        );
        let full = etcd(
            r#","prefix":"/shop/idem/","timeout":"1s","on_error":"fail_open","auth":{"username":"idem","password":"s\"ecret","timeout":"5s"}"#,
            &format!(r#""max_response_bytes":{}"#, etcd::MAX_STORED_BODY_BYTES),
        );
        assert_eq!(
            settings(&full),
            Some(EtcdSettings {
                cluster: "etcd".into(),
                prefix: "/shop/idem/".into(),
                timeout_ms: 1_000,
                on_error: OnStoreError::FailOpen,
                auth: Some(EtcdAuth { username: "idem".into(), password: "s\"ecret".into() }),
                auth_timeout_ms: 5_000,
                replay_cache: None,
            })
        );
        // The local store keeps no etcd settings, and wait mode and large bodies stay its own.
        let local = r#"{"store":{"type":"local"},"routes":[{"name":"a","match":{"prefix":"/"},"concurrent":"wait","max_response_bytes":67108864}]}"#;
        assert_eq!(settings(local), None);
        // The replay cache: off by default, defaults per field, bounds inclusive.
        let cache = |fields: &str| settings(&etcd(fields, "")).and_then(|s| s.replay_cache);
        for (fields, expected) in [
            ("", None),
            (r#","replay_cache":{}"#, Some(ReplayCacheSettings { entries: 1_024, max_bytes: 8_388_608 })),
            (
                r#","replay_cache":{"entries":1}"#,
                Some(ReplayCacheSettings { entries: 1, max_bytes: 8_388_608 }),
            ),
            (
                r#","replay_cache":{"max_bytes":4096}"#,
                Some(ReplayCacheSettings { entries: 1_024, max_bytes: 4_096 }),
            ),
            (
                r#","replay_cache":{"entries":100000,"max_bytes":268435456}"#,
                Some(ReplayCacheSettings { entries: 100_000, max_bytes: 268_435_456 }),
            ),
        ] {
            assert_eq!(cache(fields), expected, "{fields}");
        }
        // Explicit fail_closed is the default spelled out.
        assert_eq!(
            settings(&etcd(r#","on_error":"fail_closed""#, "")).map(|s| s.on_error),
            Some(OnStoreError::FailClosed)
        );
    }

    #[test]
    fn etcd_sizing_leaves_the_default_body_limit_room() {
        // 1.5 MiB of request minus 68 KiB of headers and framing: the 1 MiB default fits.
        assert_eq!(etcd::MAX_STORED_BODY_BYTES, 1_503_232);
    }
}
