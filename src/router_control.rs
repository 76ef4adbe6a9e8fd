//! Envoy's router headers, by the prefix Envoy gives them. The control headers: request headers
//! with which a caller tells Envoy's router how long to wait for the upstream and how often to
//! send the request again. The async client that
//! carries a detached call runs the same router and obeys them from the call's own headers.
//!
//! Envoy's connection manager strips them from external callers, but keeps them when it counts
//! the caller as internal (`use_remote_address: true` with an `internal_address_config` that
//! covers the caller), a common edge set-up behind an internal load balancer. On a protected
//! request they are the caller's hand on two bounds the configuration owns:
//! - a retry or a hedge is a second execution under one claim;
//! - a longer timeout outlives the lease (`processing_timeout`; on a detached rule it lifts
//!   `upstream_timeout`), so a retry takes the record over while the first call still runs
//!   (`takeover`), or finds it completed as an unknown outcome and the late answer is lost
//!   (`refuse`).
//!
//! So a protected request never carries them upstream: the filter removes them from an inline
//! request before the router sees it (counted as `router_controls_removed`), and never copies
//! them into a detached call. Unprotected traffic is left alone.
//!
//! The list is what Envoy 1.40's router reads from a request to change its timeouts, retries
//! and hedging (`source/common/router/router.cc`: `FilterUtility::finalTimeout`,
//! `finalHedgingParams`, `Filter::decodeHeaders`; `retry_state_impl.cc`: `RetryStateImpl::create`
//! and its constructor; the names in `source/common/http/headers.h`). The async client's route
//! (`NullRouteImpl`) takes the callout's timeout as its route timeout, which
//! `x-envoy-upstream-rq-timeout-ms` overrides (`0`: none), and its default retry policy retries
//! whatever `x-envoy-retry-on` asks for. Headers the router only sets (`x-envoy-attempt-count`,
//! `x-envoy-is-timeout-retry`) or that change only its stats (`x-envoy-upstream-alt-stat-name`)
//! are not in it.
//!
//! Each of Envoy's names is its prefix, `x-envoy`, and a fixed suffix. An Envoy whose bootstrap
//! sets `header_prefix` (say `x-acme`) reads and writes `x-acme-retry-on`,
//! `x-acme-upstream-service-time`, ... instead, and only those (`Http::Headers`, every name built
//! on `Http::PrefixValue`), its async client too. So the names are built once from the
//! configuration's `envoy_header_prefix` (`EnvoyHeaders`), which must be Envoy's: a filter that
//! expects another prefix removes nothing a caller's `x-acme-retry-on` asks for, and takes every
//! detached call's answer for Envoy's own reply (`UPSTREAM_SERVICE_TIME`). Where it can see the
//! two differ (an answer with another prefix's upstream service time and without ours) it says
//! so, once per worker (`prefix_mismatch_line`).

/// Envoy's router control headers, each after `<prefix>-`.
pub const ROUTER_CONTROLS: &[&str] = &[
    // finalTimeout: the global timeout, unless the next one is respected.
    "upstream-rq-timeout-ms",
    // finalTimeout: the per-try timeout (retries and hedging).
    "upstream-rq-per-try-timeout-ms",
    // finalTimeout: the global timeout itself where the router has respect_expected_rq_timeout.
    "expected-rq-timeout-ms",
    // decodeHeaders: a timeout answered 204 instead of 504.
    "upstream-rq-timeout-alt-response",
    // RetryStateImpl: the retry policy and its bound.
    "retry-on",
    "retry-grpc-on",
    "max-retries",
    "retriable-status-codes",
    "retriable-header-names",
    // finalHedgingParams: a second request when the per-try timeout fires.
    "hedge-on-per-try-timeout",
    // decodeHeaders: a max stream duration of the caller's. The connection manager keeps this
    // one even from external callers.
    "upstream-stream-duration-ms",
];

/// What the router adds to every upstream answer (unless the operator suppresses Envoy's
/// headers), never to a reply Envoy made itself (`Filter::onUpstreamHeaders`): where it is
/// present the answer is the upstream's without asking Envoy for `response.code_details` (a
/// host call), and a detached call's answer is told from Envoy's own reply by it alone.
pub const UPSTREAM_SERVICE_TIME: &str = "upstream-service-time";

/// The prefix of Envoy's own headers unless its bootstrap's `header_prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "x-envoy";

/// Envoy's header names, by the prefix its bootstrap's `header_prefix` gives them (Envoy
/// lowercases it; `x-envoy` unless set), which the configuration's `envoy_header_prefix` must
/// name: built once when the configuration is read, so a request builds no name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyHeaders {
    /// `envoy_header_prefix`: `x-envoy`, `x-acme`.
    pub prefix: String,
    /// `<prefix>-upstream-service-time`.
    pub upstream_service_time: String,
    /// `<prefix>-<control>` for each of `ROUTER_CONTROLS`, in its order.
    controls: Vec<String>,
}

impl Default for EnvoyHeaders {
    fn default() -> EnvoyHeaders {
        EnvoyHeaders::new(DEFAULT_PREFIX)
    }
}

impl EnvoyHeaders {
    pub fn new(prefix: &str) -> EnvoyHeaders {
        let named = |suffix: &str| format!("{prefix}-{suffix}");
        EnvoyHeaders {
            prefix: prefix.to_owned(),
            upstream_service_time: named(UPSTREAM_SERVICE_TIME),
            controls: ROUTER_CONTROLS.iter().map(|c| named(c)).collect(),
        }
    }

    /// The router control header `name` is, if it is one (names as Envoy holds them:
    /// lowercase). The prefix test first: most headers are not Envoy's.
    fn control_named(&self, name: &str) -> Option<&str> {
        let suffix = name.strip_prefix(self.prefix.as_str())?.strip_prefix('-')?;
        let at = ROUTER_CONTROLS.iter().position(|c| *c == suffix)?;
        self.controls.get(at).map(String::as_str)
    }

    /// True for a router control header.
    pub fn is_control(&self, name: &str) -> bool {
        self.control_named(name).is_some()
    }

    /// The router control headers among a request's headers, each once, in the request's order.
    pub fn present(&self, headers: &[(String, Vec<u8>)]) -> Vec<String> {
        let mut found: Vec<String> = Vec::new();
        for control in headers.iter().filter_map(|(name, _)| self.control_named(name)) {
            if !found.iter().any(|f| f == control) {
                found.push(control.to_owned());
            }
        }
        found
    }

    /// True when an answer's headers carry our `<prefix>-upstream-service-time`.
    pub fn from_upstream(&self, headers: &[(String, Vec<u8>)]) -> bool {
        headers.iter().any(|(n, _)| *n == self.upstream_service_time)
    }

    /// Another prefix's `*-upstream-service-time` on an answer that lacks ours: the mark of an
    /// Envoy whose bootstrap `header_prefix` is not `envoy_header_prefix` (or of an upstream
    /// behind another Envoy whose own answer lacks ours). Asked only of an answer without ours.
    pub fn foreign_service_time<'h>(&self, headers: &'h [(String, Vec<u8>)]) -> Option<&'h str> {
        headers.iter().map(|(n, _)| n.as_str()).find(|n| {
            n.len() > UPSTREAM_SERVICE_TIME.len() + 1
                && n.ends_with(UPSTREAM_SERVICE_TIME)
                && n.as_bytes().get(n.len() - UPSTREAM_SERVICE_TIME.len() - 1) == Some(&b'-')
                && *n != self.upstream_service_time
        })
    }
}

/// The one error line for an Envoy whose header prefix is not the configured one, naming the
/// field and what was seen.
pub fn prefix_mismatch_line(configured: &str, seen: &str) -> String {
    format!(
        "envoy_header_prefix is \"{configured}\", but an upstream answer carried {seen} and no \
         {configured}-{UPSTREAM_SERVICE_TIME}: Envoy's bootstrap header_prefix differs. Until \
         envoy_header_prefix names it, detached answers count as unknown outcomes and callers' router \
         control headers under Envoy's prefix are not removed (logged once per worker)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(names: &[&str]) -> Vec<(String, Vec<u8>)> {
        names.iter().map(|n| (n.to_string(), b"1".to_vec())).collect()
    }

    #[test]
    fn every_listed_header_is_an_envoy_header_and_a_control() {
        let envoy = EnvoyHeaders::default();
        assert_eq!(envoy.controls.len(), ROUTER_CONTROLS.len());
        for name in &envoy.controls {
            assert!(
                name.starts_with("x-envoy-") && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
            );
            assert!(envoy.is_control(name), "{name}");
        }
        for name in [
            "x-envoy-attempt-count",
            "x-envoy-internal",
            "x-request-id",
            "idempotency-key",
            "x-envoy",
            "x-envoy-",
        ] {
            assert!(!envoy.is_control(name), "{name}");
        }
        assert_eq!(envoy.upstream_service_time, "x-envoy-upstream-service-time");
    }

    #[test]
    fn present_finds_each_control_once_and_nothing_else() {
        let headers = pairs(&[
            ":path",
            "x-envoy-max-retries",
            "x-envoy-retry-on",
            "x-envoy-retry-on",
            "x-envoy-internal",
            "x-envoy-upstream-rq-timeout-ms",
            "content-type",
        ]);
        let envoy = EnvoyHeaders::default();
        assert_eq!(
            envoy.present(&headers),
            vec!["x-envoy-max-retries", "x-envoy-retry-on", "x-envoy-upstream-rq-timeout-ms"]
        );
        assert!(envoy.present(&pairs(&[":path", "x-envoy-attempt-count", "authorization"])).is_empty());
    }

    /// C27: behind an Envoy with `header_prefix: x-acme` the controls are the `x-acme-*` ones
    /// (Envoy obeys no other), and its mark on an upstream answer too.
    #[test]
    fn another_prefix_names_every_header_and_only_those() {
        let acme = EnvoyHeaders::new("x-acme");
        assert_eq!(acme.upstream_service_time, "x-acme-upstream-service-time");
        let headers = pairs(&[
            "x-acme-retry-on",
            "x-envoy-max-retries",
            "x-acme-upstream-rq-timeout-ms",
            "x-acmeretry-on",
        ]);
        assert_eq!(acme.present(&headers), vec!["x-acme-retry-on", "x-acme-upstream-rq-timeout-ms"]);
        for c in ROUTER_CONTROLS {
            assert!(acme.is_control(&format!("x-acme-{c}")), "{c}");
            assert!(!acme.is_control(&format!("x-envoy-{c}")), "{c}");
        }
        // A prefix that is the start of another's names is not that other's.
        assert!(!EnvoyHeaders::new("x").is_control("x-envoy-retry-on"));
    }

    #[test]
    fn another_prefixs_upstream_service_time_is_seen_on_an_answer_without_ours() {
        let envoy = EnvoyHeaders::default();
        let acme = pairs(&[":status", "x-acme-upstream-service-time", "content-type"]);
        assert!(!envoy.from_upstream(&acme));
        assert_eq!(envoy.foreign_service_time(&acme), Some("x-acme-upstream-service-time"));
        let ours = pairs(&[":status", "x-envoy-upstream-service-time"]);
        assert!(envoy.from_upstream(&ours));
        assert_eq!(envoy.foreign_service_time(&ours), None);
        for name in [
            "upstream-service-time",
            "-upstream-service-time",
            "x-upstream-service-timer",
            "xupstream-service-time",
        ] {
            assert_eq!(envoy.foreign_service_time(&pairs(&[name])), None, "{name}");
        }
        let line = prefix_mismatch_line("x-envoy", "x-acme-upstream-service-time");
        assert!(line.starts_with("envoy_header_prefix is \"x-envoy\", but an upstream answer carried x-acme-upstream-service-time and no x-envoy-upstream-service-time"), "{line}");
    }
}
