//! What a worker counts and says: its counters (defined once per root context, since
//! `define_metric` hands out a new id per call), the outcome it publishes for access logs, and
//! the warnings that may come with every request but are logged once per period or once per
//! worker. One service of `PluginState`, held beside the store, the wait room and the wake-ups.

use crate::config::{KeySource, Rule};
use crate::host::{Host, HostError};
use crate::identity::scope::ScopeId;
use crate::metrics::{
    store_calls_failed_metric, Counter, ADMIN_METRIC_PREFIX, CLAIMS_LOST_METRIC, RENEWED_METRIC,
    SWEPT_METRIC, UNKNOWN_CLUSTER_METRIC, UNMATCHED_METRIC, WATCH_ENDED_METRIC,
};
use crate::store::factory::remotes;
use crate::store::seam::Store;
use crate::worker::admin::Action;
use crate::worker::audit::AUDIT_PROPERTY;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// The filter state a decided request's outcome is published under (Envoy prefixes `wasm.`).
pub const OUTCOME_PROPERTY: &str = "idempotency.outcome";

/// Fail-open bypasses are logged at most this often per worker.
const BYPASS_LOG_EVERY_MS: u64 = 1000;
/// Requests that ended before their body arrived are logged at most this often per worker: a
/// misconfigured Envoy makes every protected request one.
const BODY_NEVER_RECEIVED_LOG_EVERY_MS: u64 = 60_000;

/// (field, cluster) pairs one worker says once each; past it, unknown clusters are only counted
/// (the configuration names a bounded set, but a route's cluster is whatever Envoy's routes say).
const MAX_UNKNOWN_CLUSTERS_LOGGED: usize = 64;

/// Counter ids: the outcomes per route rule (by the rule's name), the requests no rule matched,
/// the sweep, the renewals, the store's failed calls by shard, an admin instance's requests.
struct Ids {
    /// Per configured rule (the same `Rc`s the configuration holds, in its order), its
    /// outcomes' ids in `Counter::ALL` order.
    routes: Vec<(Rc<Rule>, Vec<Option<u32>>)>,
    unmatched: Option<u32>,
    swept: Option<u32>,
    renewed: Option<u32>,
    claims_lost: Option<u32>,
    watch_ended: Option<u32>,
    unknown_cluster: Option<u32>,
    /// A remote store's failed calls, by shard (`Request::shard`).
    calls_failed: Vec<Option<u32>>,
    /// An admin instance's requests, by `admin::Action` (none elsewhere).
    admin: Vec<Option<u32>>,
}

impl Ids {
    fn define<H: Host>(host: &H, rules: &[Rc<Rule>], admin: bool, shadow: bool, store: &dyn Store) -> Ids {
        let define = |name: String| match host.define_counter(&name) {
            Ok(id) => Some(id),
            Err(e) => {
                log::warn!("cannot define metric {name}: host status {}", e.0);
                None
            }
        };
        Ids {
            routes: rules
                .iter()
                .map(|r| {
                    // The shadow outcomes only where they can happen: 13 series a rule fewer.
                    let ids = Counter::ALL
                        .iter()
                        .map(|c| {
                            (shadow || !c.is_shadow()).then(|| define(c.route_metric_name(&r.name))).flatten()
                        })
                        .collect();
                    (Rc::clone(r), ids)
                })
                .collect(),
            unmatched: define(UNMATCHED_METRIC.to_string()),
            swept: define(SWEPT_METRIC.to_string()),
            renewed: define(RENEWED_METRIC.to_string()),
            claims_lost: define(CLAIMS_LOST_METRIC.to_string()),
            // Defined whatever the store, as the sweep's is: a family that is always there (at 0
            // where nothing watches) lets one dashboard and one alert serve every fleet.
            watch_ended: define(WATCH_ENDED_METRIC.to_string()),
            // Always there too: any filter configuration names clusters (a detached rule may
            // name none, and take the route's).
            unknown_cluster: define(UNKNOWN_CLUSTER_METRIC.to_string()),
            calls_failed: remotes(store)
                .map(|remote| define(store_calls_failed_metric(&remote.cluster)))
                .collect(),
            admin: if admin {
                Action::ALL
                    .iter()
                    .map(|a| define(format!("{ADMIN_METRIC_PREFIX}{}_total", a.name())))
                    .collect()
            } else {
                Vec::new()
            },
        }
    }
}

/// A warning that may come with every request, logged at most once per period.
struct LogEvery {
    period_ms: u64,
    last_ms: Cell<Option<u64>>,
}

impl LogEvery {
    const fn new(period_ms: u64) -> LogEvery {
        LogEvery { period_ms, last_ms: Cell::new(None) }
    }

    fn due(&self, now_ms: u64) -> bool {
        match self.last_ms.get() {
            Some(last) if now_ms.saturating_sub(last) < self.period_ms => false,
            _ => {
                self.last_ms.set(Some(now_ms));
                true
            }
        }
    }
}

/// A worker's counters, published outcomes and rate-limited warnings.
pub struct Meter<H: Host> {
    host: H,
    ids: Ids,
    /// `publish_outcome`: each request outcome goes to the stream's filter state too.
    publish_outcome: bool,
    bypass_log: LogEvery,
    body_never_received_log: LogEvery,
    held_full_log: LogEvery,
    /// Set once this worker has logged that Envoy keeps request bodies from the filter
    /// (`allow_on_headers_stop_iteration` missing): one error line per worker, not per request.
    stop_iteration_error_logged: Cell<bool>,
    /// Set once this worker has logged that Envoy's header prefix is not `envoy_header_prefix`.
    prefix_error_logged: Cell<bool>,
    /// The (field, cluster) pairs this worker has said Envoy does not know: one critical line
    /// each, not one per request.
    unknown_clusters_logged: RefCell<Vec<(String, String)>>,
}

impl<H: Host> Meter<H> {
    /// Defines the counters of these rules, of an admin instance when `admin`, and of the
    /// store's remotes.
    pub fn new(
        host: H,
        rules: &[Rc<Rule>],
        admin: bool,
        store: &dyn Store,
        publish_outcome: bool,
        shadow: bool,
    ) -> Meter<H> {
        Meter {
            ids: Ids::define(&host, rules, admin, shadow, store),
            host,
            publish_outcome,
            bypass_log: LogEvery::new(BYPASS_LOG_EVERY_MS),
            body_never_received_log: LogEvery::new(BODY_NEVER_RECEIVED_LOG_EVERY_MS),
            held_full_log: LogEvery::new(BODY_NEVER_RECEIVED_LOG_EVERY_MS),
            stop_iteration_error_logged: Cell::new(false),
            prefix_error_logged: Cell::new(false),
            unknown_clusters_logged: RefCell::new(Vec::new()),
        }
    }

    /// Counts an outcome under the route rule the request matched; a request that matched no
    /// rule (passed through) in the unmatched counter. One host call per counted event.
    pub fn count(&self, counter: Counter, rule: Option<&Rule>) {
        let id = match rule {
            Some(rule) => {
                // Every request's rule is one of the configuration's: found by address, without
                // hashing its name on every count (by name for any other).
                let ids = self
                    .ids
                    .routes
                    .iter()
                    .find(|(r, _)| std::ptr::eq(Rc::as_ptr(r), rule))
                    .or_else(|| self.ids.routes.iter().find(|(r, _)| r.name == rule.name));
                ids.and_then(|(_, ids)| ids.get(counter.index()).copied().flatten())
            }
            None => self.ids.unmatched,
        };
        if let Some(id) = id {
            self.host.increment(id, 1);
        }
    }

    /// An outcome of the stream that is the effective context: counted, and published for its
    /// access log (`publish`).
    pub fn count_for_stream(&self, counter: Counter, rule: Option<&Rule>, scope: Option<&ScopeId>) {
        self.count(counter, rule);
        self.publish(counter, rule, scope);
    }

    /// With `publish_outcome`, what just happened to the effective context's protected request
    /// (`<outcome> <scope tag>`, the tag the filter's logs use too) as its filter state
    /// `wasm.idempotency.outcome`, for access logs (`%FILTER_STATE(wasm.idempotency.outcome:PLAIN)%`).
    /// Written at each outcome counted while the stream is there, so the last one stands (a new
    /// key: `claimed`, then `stored`): one host call each, none when not configured. A key from
    /// anywhere but `key_header` is named after the tag (`claimed 1a2b3c4d5e6f key=json`).
    pub fn publish(&self, counter: Counter, rule: Option<&Rule>, scope: Option<&ScopeId>) {
        if !self.publish_outcome || !counter.is_request_outcome() {
            return;
        }
        let tag = scope.map_or_else(|| "-".to_string(), ScopeId::log_tag);
        let source = match rule.map(|r| &r.key) {
            Some(KeySource::Header { own: true, .. }) => " key=header",
            Some(KeySource::Json { .. }) => " key=json",
            Some(KeySource::Fingerprint) => " key=fingerprint",
            Some(KeySource::Header { own: false, .. }) | None => "",
        };
        let value = format!("{} {tag}{source}", counter.name());
        if let Err(HostError(s)) = self.host.set_property(OUTCOME_PROPERTY, value.as_bytes()) {
            log::debug!("cannot publish the outcome {value} (host status {s})");
        }
    }

    /// An audit entry (`audit`, `admin`) as the effective context's filter state
    /// `wasm.idempotency.audit`, for its access log: one host call.
    pub fn audit(&self, entry: &[u8]) {
        if let Err(HostError(s)) = self.host.set_property(AUDIT_PROPERTY, entry) {
            log::debug!("cannot publish an audit entry (host status {s})");
        }
    }

    /// A call to the store's `shard` failed (no answer, a refusal, an error status). Counted at
    /// once, as a watch's end is.
    pub fn count_call_failed(&self, shard: u8) {
        if let Some(id) = self.ids.calls_failed.get(usize::from(shard)).copied().flatten() {
            self.host.increment(id, 1);
        }
    }

    /// Envoy does not know the cluster a call named: counted every time; true the first time
    /// this worker sees this (field, cluster) pair, when it is said in one critical line.
    pub fn unknown_cluster(&self, field: &str, cluster: &str) -> bool {
        if let Some(id) = self.ids.unknown_cluster {
            self.host.increment(id, 1);
        }
        let mut logged = self.unknown_clusters_logged.borrow_mut();
        let first = logged.len() < MAX_UNKNOWN_CLUSTERS_LOGGED
            && !logged.iter().any(|(f, c)| f == field && c == cluster);
        if first {
            logged.push((field.to_string(), cluster.to_string()));
        }
        first
    }

    /// Counted at once, not batched to the tick: it is rare, and the moment it happens is what
    /// an operator looks for.
    pub fn count_watch_ended(&self) {
        if let Some(id) = self.ids.watch_ended {
            self.host.increment(id, 1);
        }
    }

    pub fn count_admin(&self, action: Action) {
        let index = Action::ALL.iter().position(|a| *a == action);
        if let Some(id) = index.and_then(|i| self.ids.admin.get(i).copied().flatten()) {
            self.host.increment(id, 1);
        }
    }

    pub fn count_swept(&self, n: u32) {
        if let (Some(id), true) = (self.ids.swept, n > 0) {
            self.host.increment(id, i64::from(n));
        }
    }

    /// Counts what a renewal did: claims kept, claims found lost.
    pub fn count_renewals(&self, kept: usize, lost: usize) {
        for (id, n) in [(self.ids.renewed, kept), (self.ids.claims_lost, lost)] {
            if let (Some(id), true) = (id, n > 0) {
                self.host.increment(id, i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    /// True when a fail-open bypass should be logged now (at most once a second per worker:
    /// a store outage must not flood the log with one line per request).
    pub fn bypass_log_due(&self, now_ms: u64) -> bool {
        self.bypass_log.due(now_ms)
    }

    /// True when a claim the worker could not keep alive (it keeps `renewal::MAX_HELD`) should
    /// be logged now (at most once a minute per worker).
    pub fn held_full_log_due(&self, now_ms: u64) -> bool {
        self.held_full_log.due(now_ms)
    }

    /// True when a request that ended before its body arrived should be logged now (at most
    /// once a minute per worker).
    pub fn body_never_received_log_due(&self, now_ms: u64) -> bool {
        self.body_never_received_log.due(now_ms)
    }

    /// True the first time this worker (this root) asks: the error that Envoy keeps request
    /// bodies from the filter is logged once per worker; every such request is counted.
    pub fn first_stop_iteration_error(&self) -> bool {
        !self.stop_iteration_error_logged.replace(true)
    }

    /// An upstream answer carried another prefix's `seen` upstream service time and not ours
    /// (`prefix`): one error line per worker naming `envoy_header_prefix`, not one per request.
    pub fn header_prefix_mismatch(&self, prefix: &str, seen: &str) {
        if !self.prefix_error_logged.replace(true) {
            log::error!("{}", crate::router_control::prefix_mismatch_line(prefix, seen));
        }
    }
}
