//! What a forwarded request's ending means for its record. Pure: reads only the status, the
//! response code details and the response flags Envoy reports.
//!
//! The rule that matters: only a response whose details are `via_upstream` is a real upstream
//! answer. Everything else is a local reply (router, another filter, ourselves), and the record
//! may only be released when the request provably never reached the upstream; when the upstream
//! may have executed (timeout, reset after sending, client gone) the record stays PROCESSING
//! until its lease ends, because releasing then would turn a timeout into a second execution.

use crate::config::{Disposition, Rule};
use crate::store::record::State;

pub const VIA_UPSTREAM: &str = "via_upstream";

// Envoy StreamInfo::CoreResponseFlag bits (envoy/stream_info/stream_info.h).
const NO_HEALTHY_UPSTREAM: u64 = 0x2;
const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
const UPSTREAM_REMOTE_RESET: u64 = 0x10;
const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
const UPSTREAM_OVERFLOW: u64 = 0x80;
const NO_ROUTE_FOUND: u64 = 0x100;
const UPSTREAM_MAX_STREAM_DURATION: u64 = 0x80000;
const UPSTREAM_PROTOCOL_ERROR: u64 = 0x800000;
const NO_CLUSTER_FOUND: u64 = 0x1000000;

/// Flags that prove no upstream connection carried the request.
const NEVER_SENT: u64 =
    NO_HEALTHY_UPSTREAM | UPSTREAM_CONNECTION_FAILURE | UPSTREAM_OVERFLOW | NO_ROUTE_FOUND | NO_CLUSTER_FOUND;
/// Flags that say the request may have been sent and its result is unknown.
const MAYBE_EXECUTED: u64 = UPSTREAM_REQUEST_TIMEOUT
    | UPSTREAM_REMOTE_RESET
    | UPSTREAM_CONNECTION_TERMINATION
    | UPSTREAM_MAX_STREAM_DURATION
    | UPSTREAM_PROTOCOL_ERROR;

/// Details prefixes of local replies sent before any upstream request existed.
const NEVER_SENT_DETAILS: &[&str] = &[
    "no_healthy_upstream",
    "cluster_not_found",
    "route_not_found",
    "maintenance_mode",
    "upstream_reset_before_response_started{connection_failure",
    "upstream_reset_before_response_started{remote_connection_failure",
    "upstream_reset_before_response_started{local_connection_failure",
    "upstream_reset_before_response_started{overflow",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponsePlan {
    /// A real upstream answer worth keeping: capture the body and complete the record.
    Capture { state: State, status: u16 },
    /// Forget the claim: a retry executes again.
    Release,
    /// The upstream may have executed: leave the record PROCESSING until its lease ends.
    Keep,
}

/// What Envoy reports about a stream's end, as the glue read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamReport<'a> {
    pub details: Option<&'a str>,
    pub flags: u64,
    /// False only when Envoy positively reports that no upstream host was ever selected (the
    /// `upstream.address` property is empty): a `direct_response` route, or a rate limit or
    /// ext_authz after this filter answered. A failed read counts as selected (unknown).
    pub upstream_selected: bool,
}

/// Decides from the response headers (`details` readable there already).
pub fn plan_response(rule: &Rule, status: Option<u16>, report: StreamReport) -> ResponsePlan {
    let StreamReport { details, .. } = report;
    match (details, status) {
        (Some(VIA_UPSTREAM), Some(status)) => match rule.statuses.disposition(status) {
            Disposition::Store => {
                let state = if status < 400 { State::Succeeded } else { State::FailedFinal };
                ResponsePlan::Capture { state, status }
            }
            Disposition::Release => ResponsePlan::Release,
        },
        _ => plan_unfinished(report),
    }
}

/// Decides for a stream that ended without a captured upstream answer (a local reply, a reset,
/// a client that went away).
pub fn plan_unfinished(report: StreamReport) -> ResponsePlan {
    let StreamReport { details, flags, upstream_selected } = report;
    if flags & MAYBE_EXECUTED != 0 {
        return ResponsePlan::Keep;
    }
    let never_sent_details = details.is_some_and(|d| NEVER_SENT_DETAILS.iter().any(|p| d.starts_with(p)));
    if never_sent_details || flags & NEVER_SENT != 0 || !upstream_selected {
        ResponsePlan::Release
    } else {
        ResponsePlan::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    fn rule() -> Rule {
        let cfg = parse(br#"{"routes":[{"name":"r","match":{"prefix":"/"}}]}"#).unwrap();
        (*cfg.rules[0]).clone()
    }

    fn sent(details: Option<&str>, flags: u64) -> StreamReport<'_> {
        StreamReport { details, flags, upstream_selected: true }
    }

    #[test]
    fn upstream_statuses_follow_the_rule() {
        let r = rule();
        let plan = |s| plan_response(&r, Some(s), sent(Some(VIA_UPSTREAM), 0));
        assert_eq!(plan(201), ResponsePlan::Capture { state: State::Succeeded, status: 201 });
        assert_eq!(plan(302), ResponsePlan::Capture { state: State::Succeeded, status: 302 });
        assert_eq!(plan(404), ResponsePlan::Capture { state: State::FailedFinal, status: 404 });
        for s in [500, 503, 401, 403, 408, 409, 425, 429] {
            assert_eq!(plan(s), ResponsePlan::Release, "{s}");
        }
    }

    #[test]
    fn local_replies_are_never_captured() {
        let r = rule();
        // A router 503 that looks like an upstream 503 by status alone.
        let plan = plan_response(
            &r,
            Some(200),
            sent(Some("upstream_reset_before_response_started{connection_failure}"), 0x20),
        );
        assert_eq!(plan, ResponsePlan::Release);
        assert_eq!(plan_response(&r, Some(200), sent(None, 0)), ResponsePlan::Keep);
    }

    #[test]
    fn local_replies_that_never_selected_an_upstream_host_release() {
        let r = rule();
        for details in ["direct_response", "ext_authz_denied", "local_rate_limited"] {
            let report = StreamReport { details: Some(details), flags: 0, upstream_selected: false };
            assert_eq!(plan_response(&r, Some(200), report), ResponsePlan::Release, "{details}");
            assert_eq!(plan_unfinished(report), ResponsePlan::Release, "{details}");
        }
        // A timeout is a timeout even if the address is somehow missing: it may have executed.
        let timeout =
            StreamReport { details: Some("response_timeout"), flags: 0x4, upstream_selected: false };
        assert_eq!(plan_unfinished(timeout), ResponsePlan::Keep);
    }

    #[test]
    fn unknown_outcomes_keep_the_record() {
        let cases: &[(Option<&str>, u64)] = &[
            (Some("response_timeout"), 0x4),
            (Some("upstream_reset_before_response_started{connection_termination}"), 0x40),
            (Some("upstream_reset_after_response_started{protocol_error}"), 0x800000),
            (Some("downstream_remote_disconnect"), 0x4000),
            (Some("stream_idle_timeout"), 0x10000),
            (Some("ext_authz_denied"), 0),
            (None, 0),
            // A retried request whose first try timed out and second failed to connect.
            (Some("upstream_reset_before_response_started{connection_failure}"), 0x20 | 0x4),
        ];
        for (d, f) in cases {
            assert_eq!(plan_unfinished(sent(*d, *f)), ResponsePlan::Keep, "{d:?} {f:#x}");
        }
    }

    #[test]
    fn never_reached_releases() {
        let cases: &[(Option<&str>, u64)] = &[
            (Some("no_healthy_upstream"), 0x2),
            (Some("upstream_reset_before_response_started{connection_failure}"), 0x20),
            (Some("upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"), 0x20),
            (Some("cluster_not_found"), 0x1000000),
            (Some("route_not_found"), 0x100),
        ];
        for (d, f) in cases {
            assert_eq!(plan_unfinished(sent(*d, *f)), ResponsePlan::Release, "{d:?} {f:#x}");
        }
    }
}
