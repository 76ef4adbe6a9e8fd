//! Plugin configuration: the JSON string Envoy hands to `on_configure`, parsed and validated into
//! the compiled [`Config`] the engine reads on every request. Pure: no host calls, table-tested.
//!
//! A bad configuration must stop the filter from starting (Envoy then refuses the listener), so
//! every error names the offending field, e.g. `routes[0].ttl: "24x" is not a duration ...`.
//!
//! This file owns `parse` (defaults, validation, the memory bounds) and rule resolution
//! (`Config::rule_for`), what the rest of the crate calls; the types are in `model.rs`, the
//! typed JSON readers in `fields.rs`, the etcd store's section in `etcd.rs`.

use std::rc::Rc;

use crate::json::{self, JsonValue as Value, MemberOrder};
use crate::router_control::EnvoyHeaders;
use fields::{
    array, boolean, duration_ms, err, get, index, json_error, key, object, object_any, optional,
    reject_unknown, required, string, uint, unique_list, Obj, Res,
};

pub mod etcd;
mod fields;
mod model;
#[cfg(test)]
mod tests;

pub use model::{
    AdminConfig, Concurrency, Config, ConfigError, Disposition, Execution, JwtPrincipal, KeySource,
    PathMatch, ProblemStatuses, Quota, Reconcile, Rule, ScopeHost, StatusPattern, StatusPolicy, StoreConfig,
    UnknownOutcome, UpstreamRewrite,
};

// ---- rule resolution: which rule, if any, protects a request ----

impl Rule {
    pub fn matches(&self, method: &str, path_without_query: &str) -> bool {
        // Methods are case-sensitive (RFC 9110 §9.1); the configured ones are already uppercase.
        self.methods.iter().any(|m| m == method) && self.matches_path(path_without_query)
    }

    /// The header the key is read from (`key_header`, or the rule's own); None when the key is
    /// in the body. A rule with `reconcile` always has one (config).
    pub fn key_header(&self) -> Option<&str> {
        match &self.key {
            KeySource::Header { name, .. } => Some(name),
            KeySource::Json { .. } | KeySource::Fingerprint => None,
        }
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

    /// The field that names `cluster` as the store's, as a log line names it: `store.cluster`,
    /// or its entry in `store.shards` or `store.previous_shards`.
    pub fn store_cluster_field(&self, cluster: &str) -> String {
        let StoreConfig::Etcd(etcd) = &self.store else { return "store.cluster".into() };
        let entry = |list: &[etcd::EtcdShard]| list.iter().position(|s| s.cluster == cluster);
        if let Some(i) = entry(&etcd.shards) {
            return format!("store.shards[{i}].cluster");
        }
        match entry(&etcd.previous_shards) {
            Some(i) => format!("store.previous_shards[{i}].cluster"),
            None => "store.cluster".into(),
        }
    }

    /// A rule as the configuration names it: `routes[<index>]` (rule names are unique).
    pub fn rule_field(&self, rule: &str) -> String {
        match self.rules.iter().position(|r| r.name == rule) {
            Some(i) => format!("routes[{i}]"),
            None => format!("route rule {rule}"),
        }
    }
}

const DEFAULT_KEY_HEADER: &str = "idempotency-key";
const DEFAULT_PRINCIPAL_HEADER: &str = "authorization";
const DEFAULT_CAPACITY: u32 = 100_000;
const MAX_CAPACITY: u64 = 10_000_000;
/// The local store's tombstones at most: 83 bytes each, 1.7 GB at this bound.
const MAX_TOMBSTONES: u64 = 20_000_000;
/// The default room for tombstones is at most this many times the records' capacity.
const DEFAULT_TOMBSTONE_RATIO_MAX: u64 = 4;
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
/// Room for the longest name built on it (`<prefix>-upstream-rq-per-try-timeout-ms`) within
/// `MAX_HEADER_NAME_LEN`.
const MAX_HEADER_PREFIX_LEN: usize = 64;
const MAX_RULE_NAME_LEN: usize = 64;
/// Nesting the configuration may use. Its own constant, not the canonical form's: the two
/// limits happen to be equal, but changing the fingerprint contract must not change which
/// configurations Envoy accepts.
const MAX_NESTING: usize = 64;

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
            "publish_outcome",
            "audit",
            "mode",
            "admin",
            "envoy_header_prefix",
            "scope_host",
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
    let store = optional(top, "", "store", store)?
        .unwrap_or(StoreConfig::Local { capacity: DEFAULT_CAPACITY, tombstones: 0 });
    let problem_statuses =
        optional(top, "", "problem_statuses", problem_statuses)?.unwrap_or(ProblemStatuses::DEFAULT);
    let waiters = |k: &str, default: u64| -> Res<u32> {
        let n = optional(top, "", k, |v, f| uint(v, f, 1, MAX_WAITERS_LIMIT))?.unwrap_or(default);
        u32::try_from(n).map_err(|_| err(k, "out of range"))
    };
    let max_waiters_per_key = waiters("max_waiters_per_key", DEFAULT_MAX_WAITERS_PER_KEY)?;
    let jwt_principal = optional(top, "", "principal", jwt_principal)?;
    let quota = optional(top, "", "quota", quota)?.unwrap_or_default();
    let publish_outcome = optional(top, "", "publish_outcome", boolean)?.unwrap_or(false);
    let audit = optional(top, "", "audit", boolean)?.unwrap_or(false);
    let shadow = match optional(top, "", "mode", |v, f| string(v, f).map(str::to_owned))?.as_deref() {
        None | Some("enforce") => false,
        Some("shadow") => true,
        Some(other) => return Err(err("mode", format!("{other:?}: expected \"enforce\" or \"shadow\""))),
    };
    let scope_host = optional(top, "", "scope_host", scope_host)?.unwrap_or(ScopeHost::Authority);
    let envoy_headers = match optional(top, "", "envoy_header_prefix", envoy_header_prefix)? {
        Some(prefix) => EnvoyHeaders::new(&prefix),
        None => EnvoyHeaders::default(),
    };

    let admin = optional(top, "", "admin", admin)?;
    if admin.is_some() {
        // One filter entry, one job: an admin instance sits on its own listener, where no
        // protected traffic comes, and a data-plane entry never answers admin paths.
        if get(top, "routes").is_some() {
            return Err(err(
                "admin",
                "an admin instance protects no routes: put the admin API in its own filter entry, on its own listener",
            ));
        }
    }
    let routes = match (&admin, get(top, "routes")) {
        (Some(_), _) => Vec::new(),
        (None, v) => array(v.ok_or_else(|| err("routes", "required"))?, "routes")?.to_vec(),
    };
    if routes.is_empty() && admin.is_none() {
        return Err(err("routes", "must contain at least one route"));
    }
    // A lookup is the caller's own request as the upstream authorizes it: by default it carries
    // the headers that name the caller and its tenant.
    let lookup_headers: Vec<String> = principal_headers.iter().chain(&tenant_header).cloned().collect();
    let mut rules: Vec<Rc<Rule>> = Vec::with_capacity(routes.len());
    for (i, v) in routes.iter().enumerate() {
        let path = index("routes", i);
        let r = rule(v, &path, &key_header, &lookup_headers, &envoy_headers)?;
        // Names label metrics and logs; a duplicate would silently merge two routes' numbers.
        if rules.iter().any(|x| x.name == r.name) {
            return Err(err(&key(&path, "name"), format!("duplicate route name {:?}", r.name)));
        }
        if matches!(store, StoreConfig::Etcd(_)) {
            etcd::etcd_fits(&r, &path)?;
        }
        rules.push(Rc::new(r));
    }
    let store = tombstone_room(store, &rules)?;
    let max_waiters = max_waiters(top, &rules)?;
    let max_detached_calls = max_detached_calls(top, &rules)?;
    Ok(Config {
        key_header,
        tenant_header,
        principal_headers,
        store,
        problem_statuses,
        rules,
        max_waiters_per_key,
        max_waiters,
        jwt_principal,
        quota,
        max_detached_calls,
        publish_outcome,
        audit,
        shadow,
        scope_host,
        admin,
        envoy_headers,
    })
}

/// The local store's room for tombstones: `store.tombstones`, or by default enough for a store
/// whose records all leave one, as long as the longest-lived tombstone stands against its
/// rule's ttl: `capacity × ⌈tombstone_ttl / ttl⌉` (24 h records with 48 h tombstones: twice
/// the capacity), at most four times the capacity (a tombstone costs about a sixteenth of a
/// record with a 1 KiB response: four times as many cost a quarter as much again), and at most
/// `MAX_TOMBSTONES`. None without a rule that keeps tombstones, and a
/// room given without one is refused as a mistake.
fn tombstone_room(store: StoreConfig, rules: &[Rc<Rule>]) -> Res<StoreConfig> {
    let StoreConfig::Local { capacity, tombstones } = store else { return Ok(store) };
    let ratio = rules.iter().filter(|r| r.tombstone_ms > 0).map(|r| r.tombstone_ms.div_ceil(r.ttl_ms)).max();
    let tombstones = match (ratio, tombstones) {
        (None, 0) => 0,
        (None, _) => {
            return Err(err("store.tombstones", "no rule keeps tombstones (routes[].tombstone_ttl)"));
        }
        (Some(_), given) if given > 0 => given,
        (Some(ratio), _) => {
            let ratio = ratio.min(DEFAULT_TOMBSTONE_RATIO_MAX);
            let room = u64::from(capacity).saturating_mul(ratio).min(MAX_TOMBSTONES);
            u32::try_from(room).unwrap_or(u32::MAX)
        }
    };
    Ok(StoreConfig::Local { capacity, tombstones })
}

/// `scope_host`: which name of the service a record's scope holds.
fn scope_host(v: &Value, path: &str) -> Res<ScopeHost> {
    match string(v, path)? {
        "authority" => Ok(ScopeHost::Authority),
        "cluster" => Ok(ScopeHost::Cluster),
        "none" => Ok(ScopeHost::None),
        other => Err(err(path, format!("{other:?}: expected \"authority\", \"cluster\" or \"none\""))),
    }
}

/// `envoy_header_prefix`: the bootstrap `header_prefix` of the Envoy the filter runs in. Envoy
/// lowercases it; a name that is not lowercase here is refused rather than guessed at, since
/// the filter compares header names as Envoy holds them.
fn envoy_header_prefix(v: &Value, path: &str) -> Res<String> {
    let s = string(v, path)?;
    if s.len() > MAX_HEADER_PREFIX_LEN || !is_token(s) || s.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(err(
            path,
            format!(
                "{s:?} is not a header prefix: expected 1 to {MAX_HEADER_PREFIX_LEN} lowercase token \
                 characters, as Envoy's bootstrap header_prefix (default \"{}\")",
                crate::router_control::DEFAULT_PREFIX
            ),
        ));
    }
    Ok(s.to_owned())
}

/// `admin`: `{"token_sha256": "<64 hex digits>"}` (the token itself never appears in a config).
fn admin(v: &Value, path: &str) -> Res<AdminConfig> {
    let o = object(v, path, &["token_sha256"])?;
    let token_sha256 = optional(o, path, "token_sha256", |v, f| {
        let s = string(v, f)?;
        crate::codec::unhex(s)
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| err(f, "expected the token's SHA-256 as 64 hex digits (sha256sum of the token)"))
    })?;
    Ok(AdminConfig { token_sha256 })
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

fn store(v: &Value, path: &str) -> Res<StoreConfig> {
    let o = object_any(v, path)?;
    let type_path = key(path, "type");
    let kind = string(get(o, "type").ok_or_else(|| err(&type_path, "required"))?, &type_path)?;
    // The allowed keys depend on the type, so the type is read before the unknown-key check.
    match kind {
        "local" => {
            reject_unknown(o, path, &["type", "capacity", "tombstones"])?;
            let capacity = optional(o, path, "capacity", |v, f| uint(v, f, 1, MAX_CAPACITY))?
                .map_or(Ok(DEFAULT_CAPACITY), |c| {
                    u32::try_from(c).map_err(|_| err(&key(path, "capacity"), "out of range"))
                })?;
            // 0 here: the default, which the rules decide (`tombstone_room`).
            let tombstones = optional(o, path, "tombstones", |v, f| uint(v, f, 1, MAX_TOMBSTONES))?
                .map_or(Ok(0), |c| {
                    u32::try_from(c).map_err(|_| err(&key(path, "tombstones"), "out of range"))
                })?;
            Ok(StoreConfig::Local { capacity, tombstones })
        }
        "etcd" => etcd::etcd_settings(o, path).map(StoreConfig::Etcd),
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

fn rule(
    v: &Value,
    path: &str,
    key_header: &str,
    lookup_headers: &[String],
    envoy: &EnvoyHeaders,
) -> Res<Rule> {
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
            "upstream_rewrite",
            "unknown_outcome",
            "reconcile",
            "key",
            "tombstone_ttl",
        ],
    )?;
    let name = required(o, path, "name", rule_name)?;
    let (path_match, methods) = required(o, path, "match", rule_match)?;
    let require_key = optional(o, path, "require_key", boolean)?.unwrap_or(false);
    let (key_source, window_ms) = optional(o, path, "key", |v, f| key_source(v, f, key_header))?
        .unwrap_or_else(|| (KeySource::Header { name: key_header.to_owned(), own: false }, None));
    let ttl_ms = match (window_ms, optional(o, path, "ttl", duration_ms)?) {
        (Some(_), Some(_)) => {
            return Err(err(
                &key(path, "ttl"),
                "must be left out with key.fingerprint: its window is the record's ttl",
            ))
        }
        (Some(window), None) => window,
        (None, ttl) => ttl.unwrap_or(DEFAULT_TTL_MS),
    };
    // A fingerprint's window may be seconds: its lease fits in it unless one is given.
    let default_lease = match window_ms {
        Some(window) => DEFAULT_PROCESSING_TIMEOUT_MS.min(window),
        None => DEFAULT_PROCESSING_TIMEOUT_MS,
    };
    let processing_timeout_ms =
        optional(o, path, "processing_timeout", duration_ms)?.unwrap_or(default_lease);
    // A claim that outlives its record would let a retry find neither and execute twice.
    if processing_timeout_ms > ttl_ms {
        return Err(err(
            &key(path, "processing_timeout"),
            format!("{processing_timeout_ms} ms exceeds ttl ({ttl_ms} ms)"),
        ));
    }
    let tombstone_ms = optional(o, path, "tombstone_ttl", duration_ms)?.unwrap_or(0);
    if tombstone_ms > 0 && window_ms.is_some() {
        return Err(err(
            &key(path, "tombstone_ttl"),
            "must be left out with key.fingerprint: a request the same as one after its window executes again",
        ));
    }
    // A tombstone is what stays after the ttl: one that ends first would never be read.
    if tombstone_ms > 0 && tombstone_ms <= ttl_ms {
        return Err(err(
            &key(path, "tombstone_ttl"),
            format!(
                "{tombstone_ms} ms must be longer than ttl ({ttl_ms} ms): it counts from the completion too"
            ),
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
    let reconcile =
        optional(o, path, "reconcile", |v, f| reconcile(v, f, processing_timeout_ms, lookup_headers, envoy))?;
    if reconcile.is_some() && key_source.in_body() {
        return Err(err(
            &key(path, "reconcile"),
            "needs a key from a header (key_header or key.header): the upstream's lookup is asked by that key",
        ));
    }
    let unknown_outcome =
        match optional(o, path, "unknown_outcome", |v, f| string(v, f).map(str::to_owned))?.as_deref() {
            // Keeping the record in flight for the lookup is the only policy a lookup can follow.
            Some(_) if reconcile.is_some() => {
                return Err(err(
                    &key(path, "unknown_outcome"),
                    "must be left out with \"reconcile\": an unknown outcome waits for the lookup",
                ))
            }
            None if reconcile.is_some() => UnknownOutcome::Reconcile,
            Some("takeover") => UnknownOutcome::Takeover,
            None | Some("refuse") => UnknownOutcome::Refuse,
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
        key: key_source,
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
        reconcile,
        tombstone_ms,
    })
}

const DEFAULT_LOOKUP_TIMEOUT_MS: u64 = 2_000;

/// `reconcile`: the upstream's lookup by key.
fn reconcile(
    v: &Value,
    path: &str,
    processing_timeout_ms: u64,
    default_headers: &[String],
    envoy: &EnvoyHeaders,
) -> Res<Reconcile> {
    let o = object(v, path, &["path", "method", "cluster", "timeout", "headers"])?;
    let lookup_path = required(o, path, "path", |v, f| {
        let s = url_path(v, f)?;
        // The key goes in as one percent-encoded segment, anywhere a segment may be.
        if s.matches("{key}").count() > 1 || s.replace("{key}", "").contains(['{', '}']) {
            return Err(err(f, format!("{s:?}: at most one {{key}}, and no other braces")));
        }
        Ok(s)
    })?;
    let method = optional(o, path, "method", method)?.unwrap_or_else(|| "GET".into());
    let cluster = optional(o, path, "cluster", cluster_name)?;
    let timeout_ms = optional(o, path, "timeout", duration_ms)?.unwrap_or(DEFAULT_LOOKUP_TIMEOUT_MS).max(1);
    if timeout_ms >= processing_timeout_ms {
        return Err(err(
            &key(path, "timeout"),
            format!(
                "{timeout_ms} ms: must be below processing_timeout ({processing_timeout_ms} ms), so that no \
                 lookup's answer outlives a lease started after it"
            ),
        ));
    }
    let headers = match optional(o, path, "headers", |v, f| unique_list(v, f, header_name))? {
        Some(headers) => {
            // The lookup's bounds (its timeout, one try) are the configuration's, never a caller's.
            if let Some(h) = headers.iter().find(|h| envoy.is_control(h)) {
                return Err(err(
                    &key(path, "headers"),
                    format!("{h:?} is an Envoy router control header, never copied from a caller"),
                ));
            }
            headers
        }
        None => default_headers.to_vec(),
    };
    Ok(Reconcile { path: lookup_path, method, cluster, timeout_ms, headers })
}

fn cluster_name(v: &Value, path: &str) -> Res<String> {
    let s = string(v, path)?;
    if s.is_empty() || s.len() > 255 {
        return Err(err(path, "expected an Envoy cluster name of 1 to 255 bytes"));
    }
    Ok(s.to_owned())
}

/// `execution`, and the fields only a detached rule has.
fn execution(o: &Obj, path: &str, processing_timeout_ms: u64) -> Res<Execution> {
    let cluster = optional(o, path, "cluster", cluster_name)?;
    let upstream_timeout_ms = optional(o, path, "upstream_timeout", duration_ms)?;
    let rewrite = optional(o, path, "upstream_rewrite", upstream_rewrite)?;
    match optional(o, path, "execution", |v, f| string(v, f).map(str::to_owned))?.as_deref() {
        None | Some("inline") => {
            for (field, set) in [
                ("cluster", cluster.is_some()),
                ("upstream_timeout", upstream_timeout_ms.is_some()),
                ("upstream_rewrite", rewrite.is_some()),
            ] {
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
            Ok(Execution::Detached { cluster, upstream_timeout_ms, rewrite: rewrite.unwrap_or_default() })
        }
        Some(other) => {
            Err(err(&key(path, "execution"), format!("{other:?}: expected \"inline\" or \"detached\"")))
        }
    }
}

/// `upstream_rewrite`: Envoy's own field names, so that the operator copies them from the route.
fn upstream_rewrite(v: &Value, path: &str) -> Res<UpstreamRewrite> {
    let o = object(v, path, &["prefix_rewrite", "host_rewrite_literal"])?;
    let prefix_rewrite = optional(o, path, "prefix_rewrite", url_path)?;
    let host_rewrite_literal = optional(o, path, "host_rewrite_literal", |v, f| {
        let s = string(v, f)?;
        // An :authority Envoy sends as it is: visible ASCII, no '/', '?', '#' or '@'.
        let bad = |b: u8| !b.is_ascii_graphic() || matches!(b, b'/' | b'?' | b'#' | b'@');
        if s.is_empty() || s.len() > 255 || s.bytes().any(bad) {
            return Err(err(f, format!("{s:?} is not a host: expected host or host:port, 1 to 255 bytes")));
        }
        Ok(s.to_owned())
    })?;
    if prefix_rewrite.is_none() && host_rewrite_literal.is_none() {
        return Err(err(path, "expected \"prefix_rewrite\", \"host_rewrite_literal\" or both"));
    }
    Ok(UpstreamRewrite { prefix_rewrite, host_rewrite_literal })
}

/// The name goes into the rule's counters (`idempotency.route.<name>.requests_total.<outcome>`), where
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

/// `routes[].key`: exactly one of `{"header": name}`, `{"json": pointer}` and
/// `{"fingerprint": {"window": duration}}`; the window, when it is the fingerprint.
fn key_source(v: &Value, path: &str, key_header: &str) -> Res<(KeySource, Option<u64>)> {
    let o = object(v, path, &["header", "json", "fingerprint"])?;
    if o.len() != 1 {
        return Err(err(path, "expected exactly one of \"header\", \"json\" and \"fingerprint\""));
    }
    if let Some(name) = optional(o, path, "header", header_name)? {
        let own = name != key_header;
        return Ok((KeySource::Header { name, own }, None));
    }
    if let Some(tokens) = optional(o, path, "json", json_pointer)? {
        let pointer = get(o, "json").and_then(|v| match v {
            Value::String(s) => Some(s.to_string()),
            _ => None,
        });
        return Ok((KeySource::Json { pointer: pointer.unwrap_or_default(), tokens }, None));
    }
    let window = required(o, path, "fingerprint", |v, f| {
        let w = object(v, f, &["window"])?;
        required(w, f, "window", duration_ms)
    })?;
    Ok((KeySource::Fingerprint, Some(window)))
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
