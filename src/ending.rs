//! What a forwarded request's ending means for its record. Pure: reads only the status, the
//! response code details and the response flags Envoy reports.
//!
//! The rule that matters: only a response whose details are `via_upstream` is a real upstream
//! answer. Everything else is a local reply (router, another filter, ourselves), and the record
//! may only be released when the request provably never reached the upstream (what Envoy
//! reports proves it only for the router's last attempt, so also that there was no earlier one:
//! `plan_unfinished`); when the upstream
//! may have executed (timeout, reset after sending, client gone) releasing would turn a timeout
//! into a second execution. The rule's `unknown_outcome` says what happens instead: the record
//! stays PROCESSING until its lease ends and a retry then takes it over (`takeover`), or it is
//! completed at once as "outcome unknown" and never executed again within its ttl (`refuse`).

use crate::config::{Disposition, Rule, UnknownOutcome};
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
const NEVER_SENT_DETAILS: &[&str] =
    &["no_healthy_upstream", "cluster_not_found", "route_not_found", "maintenance_mode"];

/// Envoy's reasons for an upstream request that failed before any byte of it was written: the
/// connection pool gave up (`UpstreamRequest::onPoolFailure` in Envoy 1.40's
/// `source/common/router/upstream_request.cc` maps each `ConnectionPool::PoolFailureReason`
/// to one of these `StreamResetReason`s), as `Http::Utility::resetReasonToString` spells them.
/// "connection failure" is what older Envoys said for either connection failure. Every other
/// reason (connection termination, a remote or local reset, a protocol error, ...) comes from
/// a stream that may have carried the request, so its outcome is unknown. The one list for both
/// forms Envoy reports them in: `response.code_details` inline (`never_sent_details`), the body
/// of its own reply to a detached call (`detached::answer_of`).
pub const NEVER_SENT_RESETS: &[&str] = &[
    "local connection failure",
    "remote connection failure",
    "connection timeout",
    "overflow",
    "connection failure",
];

/// True when `response.code_details` say no upstream request ever carried the request: a
/// local reply made before one existed, or a reset whose reason is in `NEVER_SENT_RESETS`
/// (`upstream_reset_before_response_started{<reason, spaces as _>}`, or `{<reason>|<transport
/// failure>}`).
pub fn never_sent_details(details: &str) -> bool {
    if NEVER_SENT_DETAILS.iter().any(|p| details.starts_with(p)) {
        return true;
    }
    let Some(reason) = details.strip_prefix("upstream_reset_before_response_started{") else { return false };
    let reason = reason.split(['|', '}']).next().unwrap_or_default().replace('_', " ");
    NEVER_SENT_RESETS.contains(&reason.as_str())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponsePlan {
    /// A real upstream answer worth keeping: capture the body and complete the record.
    Capture { state: State, status: u16 },
    /// Forget the claim: a retry executes again.
    Release,
    /// The upstream may have executed (`unknown_outcome: "takeover"`, or `reconcile`): leave the
    /// record PROCESSING until its lease ends (then a retry takes it over, or the lookup decides).
    Keep,
    /// The upstream may have executed (`unknown_outcome: "refuse"`): complete the record at once
    /// as "outcome unknown" (`Completion::outcome_unknown`).
    CompleteUnknown,
}

/// What Envoy reports about a stream's end, as the worker read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamReport<'a> {
    pub details: Option<&'a str>,
    pub flags: u64,
    /// False only when Envoy positively reports that no upstream host was ever selected (the
    /// `upstream.address` property is empty): a `direct_response` route, or a rate limit or
    /// ext_authz after this filter answered. A failed read counts as selected (unknown).
    pub upstream_selected: bool,
}

/// Decides from the response headers (`details` readable there already). `attempts`: as for
/// `plan_unfinished`, asked only for a local reply that looks never sent.
pub fn plan_response(
    rule: &Rule,
    status: Option<u16>,
    report: StreamReport,
    attempts: impl FnOnce() -> Option<u64>,
) -> ResponsePlan {
    let StreamReport { details, .. } = report;
    match (details, status) {
        (Some(VIA_UPSTREAM), Some(status)) => match rule.statuses.disposition(status) {
            Disposition::Store => {
                let state = if status < 400 { State::Succeeded } else { State::FailedFinal };
                ResponsePlan::Capture { state, status }
            }
            Disposition::Release => ResponsePlan::Release,
        },
        _ => plan_unfinished(rule, report, attempts),
    }
}

/// Decides for a stream that ended without a captured upstream answer (a local reply, a reset,
/// a client that went away).
///
/// Envoy's details and flags describe the router's last attempt only. With a route retry
/// policy (hedging, an internal redirect) an earlier attempt may have been sent, executed and
/// been reset, and the retry then failed to connect: the last reason says "never sent" of a
/// request that ran. So a release on "never sent" grounds also needs the router's attempt count
/// (`upstream.request_attempt_count`, asked through `attempts` only here: it is a host call):
/// at most one attempt (0: Envoy answered before its router tried). More, or a count that
/// could not be read (None), and the outcome is unknown. Nothing else is released.
pub fn plan_unfinished(
    rule: &Rule,
    report: StreamReport,
    attempts: impl FnOnce() -> Option<u64>,
) -> ResponsePlan {
    let StreamReport { details, flags, upstream_selected } = report;
    if flags & MAYBE_EXECUTED != 0 {
        return unknown(rule);
    }
    let never_sent = details.is_some_and(never_sent_details) || flags & NEVER_SENT != 0 || !upstream_selected;
    if never_sent && matches!(attempts(), Some(0 | 1)) {
        ResponsePlan::Release
    } else {
        unknown(rule)
    }
}

/// The plan for an outcome that cannot be known, by the rule's `unknown_outcome`.
pub fn unknown(rule: &Rule) -> ResponsePlan {
    match rule.unknown_outcome {
        UnknownOutcome::Takeover | UnknownOutcome::Reconcile => ResponsePlan::Keep,
        UnknownOutcome::Refuse => ResponsePlan::CompleteUnknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    /// A rule with `"unknown_outcome": "takeover"` (most plans are the same for both values).
    fn rule() -> Rule {
        Rule { unknown_outcome: UnknownOutcome::Takeover, ..refusing() }
    }

    /// The default rule: unknown outcomes are refused.
    fn refusing() -> Rule {
        let cfg = parse(br#"{"routes":[{"name":"r","match":{"prefix":"/"}}]}"#).unwrap();
        (*cfg.rules[0]).clone()
    }

    /// The router made one attempt (or none): what it reports is all there is.
    fn one() -> Option<u64> {
        Some(1)
    }

    fn sent(details: Option<&str>, flags: u64) -> StreamReport<'_> {
        StreamReport { details, flags, upstream_selected: true }
    }

    #[test]
    fn upstream_statuses_follow_the_rule() {
        let r = rule();
        let plan = |s| plan_response(&r, Some(s), sent(Some(VIA_UPSTREAM), 0), one);
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
            one,
        );
        assert_eq!(plan, ResponsePlan::Release);
        assert_eq!(plan_response(&r, Some(200), sent(None, 0), one), ResponsePlan::Keep);
    }

    #[test]
    fn local_replies_that_never_selected_an_upstream_host_release() {
        let r = rule();
        for details in ["direct_response", "ext_authz_denied", "local_rate_limited"] {
            let report = StreamReport { details: Some(details), flags: 0, upstream_selected: false };
            assert_eq!(plan_response(&r, Some(200), report, one), ResponsePlan::Release, "{details}");
            assert_eq!(plan_unfinished(&r, report, one), ResponsePlan::Release, "{details}");
            assert_eq!(plan_unfinished(&refusing(), report, one), ResponsePlan::Release, "{details}");
        }
        // A timeout is a timeout even if the address is somehow missing: it may have executed.
        let timeout =
            StreamReport { details: Some("response_timeout"), flags: 0x4, upstream_selected: false };
        assert_eq!(plan_unfinished(&r, timeout, one), ResponsePlan::Keep);
        assert_eq!(plan_unfinished(&refusing(), timeout, one), ResponsePlan::CompleteUnknown);
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
        let (takeover, refuse) = (rule(), refusing());
        for (d, f) in cases {
            assert_eq!(plan_unfinished(&takeover, sent(*d, *f), one), ResponsePlan::Keep, "{d:?} {f:#x}");
            // unknown_outcome: "refuse": the same endings complete the record as outcome unknown.
            assert_eq!(
                plan_unfinished(&refuse, sent(*d, *f), one),
                ResponsePlan::CompleteUnknown,
                "{d:?} {f:#x}"
            );
        }
        // A local reply at the response headers (the router's 504 after its timeout) too.
        let timeout = sent(Some("response_timeout"), 0x4);
        assert_eq!(plan_response(&takeover, Some(504), timeout, one), ResponsePlan::Keep);
        assert_eq!(plan_response(&refuse, Some(504), timeout, one), ResponsePlan::CompleteUnknown);
    }

    #[test]
    fn refuse_changes_only_unknown_outcomes() {
        let r = refusing();
        let upstream = |s| plan_response(&r, Some(s), sent(Some(VIA_UPSTREAM), 0), one);
        assert_eq!(upstream(201), ResponsePlan::Capture { state: State::Succeeded, status: 201 });
        assert_eq!(upstream(503), ResponsePlan::Release);
        let never_sent = sent(Some("no_healthy_upstream"), 0x2);
        assert_eq!(plan_unfinished(&r, never_sent, one), ResponsePlan::Release);
        // No status a rule can store is 0, the status that marks an outcome unknown.
        assert_eq!(upstream(0), ResponsePlan::Release);
    }

    #[test]
    fn the_details_of_every_never_sent_reason_are_never_sent_and_no_other_reset_is() {
        for reason in NEVER_SENT_RESETS {
            let details = format!("upstream_reset_before_response_started{{{}}}", reason.replace(' ', "_"));
            assert!(never_sent_details(&details), "{details}");
            let with_transport =
                format!("upstream_reset_before_response_started{{{}|TLS_error}}", reason.replace(' ', "_"));
            assert!(never_sent_details(&with_transport), "{with_transport}");
        }
        for reason in [
            "connection_termination",
            "remote_reset",
            "local_reset",
            "protocol_error",
            "connection_timeouts",
            "overflo",
        ] {
            let details = format!("upstream_reset_before_response_started{{{reason}}}");
            assert!(!never_sent_details(&details), "{details}");
        }
        assert!(!never_sent_details("upstream_reset_after_response_started{connection_timeout}"));
    }

    /// C26: "never sent" holds for the router's last attempt only; after an earlier attempt
    /// (a route retry policy) the outcome is unknown, and so it is when the count is unreadable.
    #[test]
    fn a_never_sent_last_attempt_after_an_earlier_one_is_unknown() {
        let refused = "upstream_reset_before_response_started{remote_connection_failure}";
        let reports = [
            sent(Some(refused), 0x20),
            sent(Some("no_healthy_upstream"), 0x2),
            sent(Some("upstream_reset_before_response_started{overflow}"), 0x80),
            StreamReport { details: Some("direct_response"), flags: 0, upstream_selected: false },
        ];
        for report in reports {
            for count in [Some(2), Some(3), Some(u64::MAX), None] {
                let attempts = || count;
                assert_eq!(
                    plan_unfinished(&rule(), report, attempts),
                    ResponsePlan::Keep,
                    "{report:?} {count:?}"
                );
                let plan = plan_unfinished(&refusing(), report, attempts);
                assert_eq!(plan, ResponsePlan::CompleteUnknown, "{report:?} {count:?}");
                assert_eq!(plan_response(&refusing(), Some(503), report, attempts), plan);
            }
            for count in [0, 1] {
                assert_eq!(plan_unfinished(&refusing(), report, || Some(count)), ResponsePlan::Release);
            }
        }
        // The count is a host call: asked only where it decides a release.
        let never = || -> Option<u64> { panic!("the attempt count was read") };
        let upstream = sent(Some(VIA_UPSTREAM), 0);
        assert_eq!(plan_response(&rule(), Some(503), upstream, never), ResponsePlan::Release);
        assert!(matches!(plan_response(&rule(), Some(201), upstream, never), ResponsePlan::Capture { .. }));
        assert_eq!(plan_unfinished(&rule(), sent(Some("response_timeout"), 0x4), never), ResponsePlan::Keep);
        assert_eq!(plan_unfinished(&rule(), sent(None, 0), never), ResponsePlan::Keep);
    }

    #[test]
    fn never_reached_releases() {
        let cases: &[(Option<&str>, u64)] = &[
            (Some("no_healthy_upstream"), 0x2),
            (Some("upstream_reset_before_response_started{connection_failure}"), 0x20),
            (Some("upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"), 0x20),
            (Some("cluster_not_found"), 0x1000000),
            (Some("route_not_found"), 0x100),
            // A pool connect timeout (a host whose SYNs are dropped): UF inline too.
            (Some("upstream_reset_before_response_started{connection_timeout}"), 0x20),
            (Some("upstream_reset_before_response_started{overflow}"), 0x80),
        ];
        for (d, f) in cases {
            assert_eq!(plan_unfinished(&rule(), sent(*d, *f), one), ResponsePlan::Release, "{d:?} {f:#x}");
        }
    }
}
