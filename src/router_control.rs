//! Envoy's router control headers: request headers with which a caller tells Envoy's router how
//! long to wait for the upstream and how often to send the request again. The async client that
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
pub const ROUTER_CONTROL_HEADERS: &[&str] = &[
    // finalTimeout: the global timeout, unless the next one is respected.
    "x-envoy-upstream-rq-timeout-ms",
    // finalTimeout: the per-try timeout (retries and hedging).
    "x-envoy-upstream-rq-per-try-timeout-ms",
    // finalTimeout: the global timeout itself where the router has respect_expected_rq_timeout.
    "x-envoy-expected-rq-timeout-ms",
    // decodeHeaders: a timeout answered 204 instead of 504.
    "x-envoy-upstream-rq-timeout-alt-response",
    // RetryStateImpl: the retry policy and its bound.
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    // finalHedgingParams: a second request when the per-try timeout fires.
    "x-envoy-hedge-on-per-try-timeout",
    // decodeHeaders: a max stream duration of the caller's. The connection manager keeps this
    // one even from external callers.
    "x-envoy-upstream-stream-duration-ms",
];

/// The listed name `name` is, if it is one (names as Envoy holds them: lowercase). The prefix
/// test first: most headers are not Envoy's.
fn control_named(name: &str) -> Option<&'static str> {
    if !name.starts_with("x-envoy-") {
        return None;
    }
    ROUTER_CONTROL_HEADERS.iter().copied().find(|c| *c == name)
}

/// True for a router control header.
pub fn is_router_control(name: &str) -> bool {
    control_named(name).is_some()
}

/// The router control headers among a request's headers, each once, in the request's order.
pub fn present(headers: &[(String, Vec<u8>)]) -> Vec<&'static str> {
    let mut found = Vec::new();
    for control in headers.iter().filter_map(|(name, _)| control_named(name)) {
        if !found.contains(&control) {
            found.push(control);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(names: &[&str]) -> Vec<(String, Vec<u8>)> {
        names.iter().map(|n| (n.to_string(), b"1".to_vec())).collect()
    }

    #[test]
    fn every_listed_header_is_an_envoy_header_and_a_control() {
        for name in ROUTER_CONTROL_HEADERS {
            assert!(
                name.starts_with("x-envoy-") && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
            );
            assert!(is_router_control(name), "{name}");
        }
        for name in ["x-envoy-attempt-count", "x-envoy-internal", "x-request-id", "idempotency-key"] {
            assert!(!is_router_control(name), "{name}");
        }
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
        assert_eq!(
            present(&headers),
            vec!["x-envoy-max-retries", "x-envoy-retry-on", "x-envoy-upstream-rq-timeout-ms"]
        );
        assert!(present(&pairs(&[":path", "x-envoy-attempt-count", "authorization"])).is_empty());
    }
}
