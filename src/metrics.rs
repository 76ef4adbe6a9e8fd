//! The filter's counters: what happened to each request, by name. The names are a contract
//! with dashboards, alerts and the end-to-end tests: a variant is never renamed, and a change of
//! the stat names is a breaking change, listed in docs/OPERATIONS.md (Metrics, "Changed
//! names").
//!
//! An outcome is counted under the route rule the request matched:
//! `idempotency.route.<rule>.requests_total.<outcome>`. The rule's name sits before a fixed
//! `requests_total.<outcome>` tail, and outcomes never contain a dot, so a stats-tag regex
//! anchored at the end takes out any rule name (dots included) as the `route` label and the
//! outcome as the `outcome` label, and Prometheus sees one family,
//! `idempotency_requests_total{route, outcome}` (envoy/envoy.yaml's `stats_config`). There is
//! no second, all-routes family (it would count every request twice in one `sum`): totals are
//! `sum by (outcome)`. A request that matched no rule has no route: it is counted in
//! `idempotency.unmatched_requests_total` only. Counter names end in `_total`, as Prometheus
//! names counters; Envoy's Prometheus output adds nothing to a stat's name.

use crate::problem::Kind;

/// Requests that matched no route rule (passed through untouched): they have no route to be
/// counted under.
pub const UNMATCHED_METRIC: &str = "idempotency.unmatched_requests_total";

/// Expired records reclaimed by the sweep.
pub const SWEPT_METRIC: &str = "idempotency.records_swept_total";
/// Claims kept for another lease because their owner was still at work (`renewal`): requests
/// that outlived three quarters of their lease, about once per lease each.
pub const RENEWED_METRIC: &str = "idempotency.claims_renewed_total";
/// Claims a renewal found no longer their owner's while the owner was still at work: their
/// lease ended before it could be renewed (the store out of reach for longer than the lease
/// key's slack, a worker stalled) and a retry may have executed beside them. Alert on any.
pub const CLAIMS_LOST_METRIC: &str = "idempotency.claims_lost_total";

/// The etcd store over gRPC (0 on any other store): a worker's watch stream to etcd ended (etcd
/// closed it, a connection was cut, a message was refused) or could not be opened. Its waiters
/// poll until it is open again; a steady rise means wait mode across the fleet is polling.
/// The admin API's requests, one counter per `admin::Action`: `idempotency.admin.<action>_total`.
pub const ADMIN_METRIC_PREFIX: &str = "idempotency.admin.";
pub const WATCH_ENDED_METRIC: &str = "idempotency.store_watch_ended_total";

/// Calls the filter tried to make to a cluster Envoy does not know (a misspelled `store.cluster`
/// or shard cluster, `routes[].cluster` or `routes[].reconcile.cluster`): Envoy refused each,
/// nothing was sent, and the request that needed it failed. Each counted; the first per field
/// and cluster on a worker also logged as a critical line naming both.
pub const UNKNOWN_CLUSTER_METRIC: &str = "idempotency.unknown_cluster_calls_total";

/// A remote store's calls that failed, per cluster of the store (each shard of `store.shards`):
/// no answer within the timeout, a reset, Envoy's refusal to send, or an error status. A stats
/// tag takes out everything after `.shard.` as the `shard` label (envoy/envoy.yaml), dots and
/// all, so Prometheus sees `idempotency_store_calls_failed_total{shard="<cluster>"}`: one shard's
/// outage shows as its own series while the others stay at 0. Their latency is Envoy's own per
/// cluster (`envoy_cluster_upstream_rq_time`).
pub fn store_calls_failed_metric(cluster: &str) -> String {
    format!("idempotency.store_calls_failed_total.shard.{cluster}")
}

/// What happened to a request, one counter per route rule each
/// (`idempotency.route.<rule>.requests_total.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    PassedThrough,
    Claimed,
    TakenOver,
    Replayed,
    NotReplayable,
    Mismatch,
    InFlight,
    MissingKey,
    InvalidKey,
    TooLarge,
    StoreFull,
    StoreError,
    Stored,
    ResponseNotStored,
    Released,
    KeptUnknown,
    CompletionLost,
    /// Held in wait mode (counted once per held request).
    Waiting,
    /// Held, then answered 409 when `wait_timeout` passed.
    WaitTimedOut,
    /// Not held because a waiter bound was reached: 409 at once.
    WaitRefused,
    /// A new record refused because its tenant or principal holds its bound of live records.
    QuotaExceeded,
    /// A gRPC call on a protected route: refused, never executed (its replay could not be
    /// faithful: Envoy turns local replies to gRPC calls into trailers-only errors).
    GrpcRefused,
    /// Envoy's router sent the request upstream more than once under one claim (route retry
    /// policy, hedging, internal redirect).
    UpstreamRetried,
    /// The store could not be used and the route's store fails open (`on_error: "fail_open"`):
    /// forwarded without a claim, so without protection.
    StoreBypassed,
    /// Held for its body, the request ended before any of it reached the filter: its client
    /// left early, or (then every protected request with a body) Envoy lacks
    /// `allow_on_headers_stop_iteration: true`. Nothing was claimed or forwarded.
    BodyNeverReceived,
    /// A completion or release the store could not take (unreachable or too slow) after being
    /// tried again until its claim's lease had ended one `processing_timeout` ago, or still
    /// unwritten when a configuration update retired its root past the drain bound: the record
    /// stays in flight until its lease key ends.
    SettlementAbandoned,
    /// A verified JWT payload lacks one of `principal.claims`: refused (403), never executed,
    /// since such callers cannot be told apart.
    PrincipalIncomplete,
    /// A claimed request on a detached route for which no detached call could be made (the
    /// worker carries `max_detached_calls` already, or Envoy refused the call): 503, its claim
    /// released, nothing sent upstream.
    DetachedRefused,
    /// The outcome of a forwarded request is unknown (timeout, reset after it was sent, client
    /// gone while the upstream worked) and its rule has `unknown_outcome: "refuse"`: the record
    /// was completed as "outcome unknown", so no retry executes it again within the ttl.
    /// Someone must reconcile with the upstream: alert on it. With `reconcile`, the record is
    /// kept in flight for the upstream's lookup instead (`reconciled_*` count how it settled).
    OutcomeUnknown,
    /// A retry of a record completed as "outcome unknown": 502 `outcome-unknown`, not executed.
    UnknownRefused,
    /// A protected request came with Envoy's router control headers (`x-envoy-retry-on`,
    /// `x-envoy-upstream-rq-timeout-ms`, ...; `router_control.rs`), which Envoy keeps from
    /// callers it counts as internal: removed before the router saw them, so the caller could
    /// neither ask for a retry nor outlive the lease. Counted besides the request's outcome.
    RouterControlsRemoved,
    /// `reconcile`: the upstream's lookup said the request executed, and its answer became the
    /// record's outcome (replayed to this request and every later one).
    ReconciledFound,
    /// `reconcile`: the upstream's lookup said the request never executed: it executes now, as
    /// a takeover of the record (or, with no request waiting, the record is released).
    ReconciledNotFound,
    /// `reconcile`: the lookup settled nothing (an error, a timeout, an answer that is not final,
    /// a lookup already under way or made less than a second ago): 503 `outcome-unknown` with
    /// `retry-after`; the next retry asks again.
    ReconcileFailed,
    /// The request's key came from its rule's own header (`routes[].key.header`), not from
    /// `key_header`: counted beside its outcome, once per request that had one.
    KeyFromHeader,
    /// The request's key came from its JSON body (`routes[].key.json`).
    KeyFromJson,
    /// The request's fingerprint was its key (`routes[].key.fingerprint`).
    KeyFromFingerprint,
    /// A retry after its record's ttl, within its tombstone's (`routes[].tombstone_ttl`): 410
    /// `result-expired` with the original status, not executed.
    ResultExpired,
    // `mode: "shadow"`: what the filter would have answered, and did not: the request was
    // forwarded (without a claim). Defined only in shadow mode.
    ShadowReplayed,
    ShadowNotReplayable,
    ShadowMismatch,
    ShadowInFlight,
    ShadowMissingKey,
    ShadowInvalidKey,
    ShadowTooLarge,
    ShadowStoreFull,
    ShadowStoreError,
    ShadowQuotaExceeded,
    ShadowGrpcRefused,
    ShadowPrincipalIncomplete,
    ShadowUnknownRefused,
}

impl Counter {
    /// The counter's place in `ALL` (which lists them in declaration order: a unit test
    /// checks it), without searching it.
    pub fn index(self) -> usize {
        self as usize
    }

    pub const ALL: [Counter; 51] = [
        Counter::PassedThrough,
        Counter::Claimed,
        Counter::TakenOver,
        Counter::Replayed,
        Counter::NotReplayable,
        Counter::Mismatch,
        Counter::InFlight,
        Counter::MissingKey,
        Counter::InvalidKey,
        Counter::TooLarge,
        Counter::StoreFull,
        Counter::StoreError,
        Counter::Stored,
        Counter::ResponseNotStored,
        Counter::Released,
        Counter::KeptUnknown,
        Counter::CompletionLost,
        Counter::Waiting,
        Counter::WaitTimedOut,
        Counter::WaitRefused,
        Counter::QuotaExceeded,
        Counter::GrpcRefused,
        Counter::UpstreamRetried,
        Counter::StoreBypassed,
        Counter::BodyNeverReceived,
        Counter::SettlementAbandoned,
        Counter::PrincipalIncomplete,
        Counter::DetachedRefused,
        Counter::OutcomeUnknown,
        Counter::UnknownRefused,
        Counter::RouterControlsRemoved,
        Counter::ReconciledFound,
        Counter::ReconciledNotFound,
        Counter::ReconcileFailed,
        Counter::KeyFromHeader,
        Counter::KeyFromJson,
        Counter::KeyFromFingerprint,
        Counter::ResultExpired,
        Counter::ShadowReplayed,
        Counter::ShadowNotReplayable,
        Counter::ShadowMismatch,
        Counter::ShadowInFlight,
        Counter::ShadowMissingKey,
        Counter::ShadowInvalidKey,
        Counter::ShadowTooLarge,
        Counter::ShadowStoreFull,
        Counter::ShadowStoreError,
        Counter::ShadowQuotaExceeded,
        Counter::ShadowGrpcRefused,
        Counter::ShadowPrincipalIncomplete,
        Counter::ShadowUnknownRefused,
    ];

    /// What shadow mode counts instead of answering with this (`mode: "shadow"`): None for an
    /// outcome that is no local answer (the request goes upstream in either mode).
    pub fn shadow(self) -> Option<Counter> {
        Some(match self {
            Counter::Replayed => Counter::ShadowReplayed,
            Counter::NotReplayable | Counter::ResultExpired => Counter::ShadowNotReplayable,
            Counter::Mismatch => Counter::ShadowMismatch,
            Counter::InFlight | Counter::WaitRefused | Counter::WaitTimedOut => Counter::ShadowInFlight,
            Counter::MissingKey => Counter::ShadowMissingKey,
            Counter::InvalidKey => Counter::ShadowInvalidKey,
            Counter::TooLarge => Counter::ShadowTooLarge,
            Counter::StoreFull => Counter::ShadowStoreFull,
            Counter::StoreError => Counter::ShadowStoreError,
            Counter::QuotaExceeded => Counter::ShadowQuotaExceeded,
            Counter::GrpcRefused => Counter::ShadowGrpcRefused,
            Counter::PrincipalIncomplete => Counter::ShadowPrincipalIncomplete,
            Counter::UnknownRefused | Counter::ReconcileFailed => Counter::ShadowUnknownRefused,
            _ => return None,
        })
    }

    /// Counted only in shadow mode (and defined only there).
    pub fn is_shadow(self) -> bool {
        Counter::ALL.iter().any(|c| c.shadow() == Some(self))
    }

    /// What happened to one protected request, as its access log may say it: not traffic the
    /// filter lets pass, nor warnings about the stream or the root.
    pub fn is_request_outcome(self) -> bool {
        !matches!(
            self,
            Counter::PassedThrough
                | Counter::UpstreamRetried
                | Counter::BodyNeverReceived
                | Counter::SettlementAbandoned
                | Counter::RouterControlsRemoved
                | Counter::KeyFromHeader
                | Counter::KeyFromJson
                | Counter::KeyFromFingerprint
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Counter::PassedThrough => "passed_through",
            Counter::Claimed => "claimed",
            Counter::TakenOver => "taken_over",
            Counter::Replayed => "replayed",
            Counter::NotReplayable => "not_replayable",
            Counter::Mismatch => "mismatch",
            Counter::InFlight => "in_flight",
            Counter::MissingKey => "missing_key",
            Counter::InvalidKey => "invalid_key",
            Counter::TooLarge => "too_large",
            Counter::StoreFull => "store_full",
            Counter::StoreError => "store_error",
            Counter::Stored => "stored",
            Counter::ResponseNotStored => "response_not_stored",
            Counter::Released => "released",
            Counter::KeptUnknown => "kept_unknown",
            Counter::CompletionLost => "completion_lost",
            Counter::Waiting => "waiting",
            Counter::WaitTimedOut => "wait_timed_out",
            Counter::WaitRefused => "wait_refused",
            Counter::QuotaExceeded => "quota_exceeded",
            Counter::GrpcRefused => "grpc_refused",
            Counter::UpstreamRetried => "upstream_retried",
            Counter::StoreBypassed => "store_bypassed",
            Counter::BodyNeverReceived => "body_never_received",
            Counter::SettlementAbandoned => "settlement_abandoned",
            Counter::PrincipalIncomplete => "principal_incomplete",
            Counter::DetachedRefused => "detached_refused",
            Counter::OutcomeUnknown => "outcome_unknown",
            Counter::UnknownRefused => "unknown_refused",
            Counter::RouterControlsRemoved => "router_controls_removed",
            Counter::ReconciledFound => "reconciled_found",
            Counter::ReconciledNotFound => "reconciled_not_found",
            Counter::ReconcileFailed => "reconcile_failed",
            Counter::KeyFromHeader => "key_from_header",
            Counter::KeyFromJson => "key_from_json",
            Counter::KeyFromFingerprint => "key_from_fingerprint",
            Counter::ResultExpired => "result_expired",
            Counter::ShadowReplayed => "shadow_replayed",
            Counter::ShadowNotReplayable => "shadow_not_replayable",
            Counter::ShadowMismatch => "shadow_mismatch",
            Counter::ShadowInFlight => "shadow_in_flight",
            Counter::ShadowMissingKey => "shadow_missing_key",
            Counter::ShadowInvalidKey => "shadow_invalid_key",
            Counter::ShadowTooLarge => "shadow_too_large",
            Counter::ShadowStoreFull => "shadow_store_full",
            Counter::ShadowStoreError => "shadow_store_error",
            Counter::ShadowQuotaExceeded => "shadow_quota_exceeded",
            Counter::ShadowGrpcRefused => "shadow_grpc_refused",
            Counter::ShadowPrincipalIncomplete => "shadow_principal_incomplete",
            Counter::ShadowUnknownRefused => "shadow_unknown_refused",
        }
    }

    /// The counter of one route rule: `idempotency.route.<rule>.requests_total.<outcome>`.
    /// Rule names are `A-Z a-z 0-9 _ . -` (config), all of which Envoy keeps in a stat name.
    pub fn route_metric_name(self, rule: &str) -> String {
        format!("idempotency.route.{rule}.requests_total.{}", self.name())
    }

    pub fn of_problem(kind: Kind) -> Counter {
        match kind {
            Kind::MissingKey => Counter::MissingKey,
            Kind::InvalidKey => Counter::InvalidKey,
            Kind::PayloadMismatch => Counter::Mismatch,
            Kind::RequestInFlight => Counter::InFlight,
            Kind::RequestTooLarge => Counter::TooLarge,
            Kind::StoreFull => Counter::StoreFull,
            Kind::StoreUnavailable => Counter::StoreError,
            Kind::ResponseNotStored => Counter::NotReplayable,
            Kind::ResultExpired => Counter::ResultExpired,
            Kind::QuotaExceeded => Counter::QuotaExceeded,
            Kind::GrpcNotSupported => Counter::GrpcRefused,
            Kind::PrincipalIncomplete => Counter::PrincipalIncomplete,
            Kind::OutcomeUnknown => Counter::UnknownRefused,
            Kind::DetachedCapacity => Counter::DetachedRefused,
            // The admin API's own problems: never a protected request's answer (it counts them
            // in `ADMIN_METRIC_PREFIX`'s counters instead).
            Kind::AdminUnauthorized | Kind::AdminBadRequest | Kind::RecordNotFound | Kind::RecordConflict => {
                Counter::StoreError
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_names_have_no_dot_so_the_route_tag_regex_finds_the_rule() {
        for c in Counter::ALL {
            assert!(c.name().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{}", c.name());
        }
        assert_eq!(
            Counter::Replayed.route_metric_name("pay.v1-x"),
            "idempotency.route.pay.v1-x.requests_total.replayed"
        );
    }

    #[test]
    fn every_counter_is_listed_once() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(Counter::ALL.iter().position(|d| d == c), Some(i), "{}", c.name());
            // In declaration order: `index` is its place without a search.
            assert_eq!(c.index(), i, "{}", c.name());
        }
    }
}
