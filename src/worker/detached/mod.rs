//! Detached execution (`routes[].execution: "detached"`), pure: what the worker's root sends
//! upstream for a claimed request, how its answer is read, and the client's replies; what the
//! answer means for the record is the flow's (`flow.rs`). The worker reads the request
//! and the answer and carries out the flow's steps.
//!
//! Why it exists: inline, the request's upstream call lives on the client's stream, and Envoy
//! resets it when the client leaves or Envoy times the stream out, so the outcome is lost and a
//! retry after the lease executes again. A callout made by the root does not depend on the
//! stream: its answer is recorded whether or not the client is still there, and a client that
//! is still there gets it as its first response.
//!
//! What a detached call does not get, because it is a callout and not the router (measured on
//! Envoy 1.40; docs/CONTRACT.md *Detached execution* lists each with its test): route retries,
//! the route timeout (it has `upstream_timeout` instead), the route's rewrites (said again in
//! `upstream_rewrite`), route and virtual-host `request_headers_to_add`, the HTTP filters after
//! this one, response trailers, responses over the async client's 32 MiB, and the status of an
//! answer cut after its headers; Envoy adds `x-envoy-internal` and
//! `x-envoy-expected-rq-timeout-ms` to the call.

use crate::config::{PathMatch, Rule, UnknownOutcome, UpstreamRewrite};
use crate::ending::NEVER_SENT_RESETS;
use crate::engine::{ReplayShape, Reply};
use crate::problem::{Kind, Problem};
use crate::router_control::EnvoyHeaders;

mod flow;
pub(crate) mod root;

/// `response.code_details` of the reply a detached call's answer is sent to its client with.
pub const DETAILS_DETACHED: &str = "idempotency_detached";

/// Connection-level headers: meaningful for one hop only, never copied from the client's
/// request into the call, nor from the call's answer into the client's reply. Envoy sets
/// `content-length` from the body itself.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
    "content-length",
];

fn hop_by_hop(name: &str) -> bool {
    HOP_BY_HOP.contains(&name)
}

/// The callout's headers from the client's request as Envoy holds it (earlier filters' changes
/// included): the pseudo-headers `:method`, `:path` (with its query) and `:authority` as the
/// client sent them, or as the rule's `upstream_rewrite` says the route would rewrite them,
/// then every other header but the connection-level ones and Envoy's router control headers
/// by `envoy`'s prefix (`router_control.rs`: the async client's router would obey them, so the
/// caller could lift `upstream_timeout` or ask for retries). None when one of the three is
/// missing (Envoy would refuse the call).
pub fn call_headers(
    matched: &PathMatch,
    rewrite: &UpstreamRewrite,
    envoy: &EnvoyHeaders,
    request: Vec<(String, Vec<u8>)>,
) -> Option<Vec<(String, Vec<u8>)>> {
    let pseudo = |name: &str| request.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let path = pseudo(":path")?;
    let path = match &rewrite.prefix_rewrite {
        Some(to) => rewritten_path(matched, to, path),
        None => path,
    };
    let authority = match &rewrite.host_rewrite_literal {
        Some(host) => host.as_bytes().to_vec(),
        None => pseudo(":authority")?,
    };
    let mut headers = Vec::with_capacity(request.len());
    headers.push((":method".to_string(), pseudo(":method")?));
    headers.push((":path".to_string(), path));
    headers.push((":authority".to_string(), authority));
    headers.extend(
        request.into_iter().filter(|(n, _)| !n.starts_with(':') && !hop_by_hop(n) && !envoy.is_control(n)),
    );
    Some(headers)
}

/// `prefix_rewrite` as Envoy's route applies it: what the rule matched (its prefix, or the whole
/// exact path) is replaced, the rest of the path and the query are kept. A path the rule does
/// not match (it always does: the rule was chosen by it) is sent as it is.
fn rewritten_path(matched: &PathMatch, to: &str, path: Vec<u8>) -> Vec<u8> {
    let prefix = match matched {
        PathMatch::Prefix(p) | PathMatch::Exact(p) => p.as_bytes(),
    };
    match path.strip_prefix(prefix) {
        Some(rest) => [to.as_bytes(), rest].concat(),
        None => path,
    }
}

/// What came back from a detached call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallAnswer {
    /// The upstream answered.
    Answered { status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8> },
    /// Envoy answered for an upstream it never sent the request to (no connection, no healthy
    /// host): the status, headers and body of its own reply.
    NeverSent { status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8> },
    /// No answer after the request may have been sent: the call failed (a reset, an answer over
    /// the async client's limit) or `upstream_timeout` passed. Whether it executed is unknown.
    Unknown { timed_out: bool },
}

// `<prefix>-upstream-service-time` (`EnvoyHeaders::upstream_service_time`) is on every response
// the async client's router received from an upstream; a reply Envoy made itself (its timeout,
// a reset, no connection) has none. Measured on Envoy 1.40: a reset after the upstream read the request came back as
// a 503 `upstream connect error or disconnect/reset before headers. reset reason: connection
// termination` without it, an answer with it.

/// Envoy's own replies that prove no upstream connection carried the request: the router's
/// refusals before it asks for a connection (no healthy host, the cluster in maintenance mode
/// or dropping overload: `Filter::decodeHeaders`), or a reset whose reason (Envoy 1.40's
/// `Filter::onUpstreamReset` writes `reset reason: <reason>`, after `retried and the latest `
/// on a retry, then `, transport failure reason: ...` when there is one) is one of
/// `NEVER_SENT_RESETS`, the list `ending.rs` reads inline from `response.code_details`.
fn never_sent(body: &str) -> bool {
    if ["no healthy upstream", "maintenance mode", "drop overload"].contains(&body) {
        return true;
    }
    let Some((_, reason)) = body.split_once("reset reason: ") else { return false };
    let reason = reason.split(", transport failure reason: ").next().unwrap_or_default();
    NEVER_SENT_RESETS.contains(&reason)
}

/// Reads a callout's answer: `status` None is Envoy's report of a failed call (no headers). An
/// answer is the upstream's by `envoy`'s mark on it; without it (another prefix's mark
/// included: `EnvoyHeaders::foreign_service_time`, which the worker logs) it is Envoy's own.
pub fn answer_of(
    envoy: &EnvoyHeaders,
    status: Option<u16>,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
) -> CallAnswer {
    let Some(status) = status else { return CallAnswer::Unknown { timed_out: false } };
    if envoy.from_upstream(&headers) {
        return CallAnswer::Answered { status, headers, body };
    }
    if never_sent(&String::from_utf8_lossy(&body)) {
        CallAnswer::NeverSent { status, headers, body }
    } else {
        // Envoy's timeout (504 `upstream request timeout`) or a reset after sending.
        CallAnswer::Unknown { timed_out: status == 504 }
    }
}

/// The upstream's answer as its client's first response: status, headers and body as they
/// came, without the replay marker. Like a replay, its `content-type` and `content-length` are
/// put back if Envoy's local-reply path changes them.
pub fn first_reply(status: u16, headers: &[(String, Vec<u8>)], body: Vec<u8>) -> Reply {
    let find = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let replay_shape =
        ReplayShape { content_type: find("content-type"), content_length: find("content-length") };
    let headers = headers.iter().filter(|(n, _)| !n.starts_with(':') && !hop_by_hop(n)).cloned().collect();
    Reply { status, headers, body, replay_shape: Some(replay_shape) }
}

/// A 5xx for the client whose call's outcome is unknown: 504 when `upstream_timeout` passed,
/// 502 when the call failed after it may have been sent.
pub fn unknown_reply(rule: &Rule, timed_out: bool, held_ms: u64) -> Reply {
    // The claim is in flight for its lease, then for as long as the store still holds it.
    let in_flight_s = rule.processing_timeout_ms.saturating_add(held_ms).div_ceil(1000);
    let (status, what) = if timed_out {
        (504, "the upstream did not answer within upstream_timeout")
    } else {
        (502, "the call to the upstream failed after it may have been sent")
    };
    let detail = match rule.unknown_outcome {
        UnknownOutcome::Takeover => format!(
            "{what}: whether the request executed is unknown. Retries with this Idempotency-Key get 409 \
             until its claim ends, {in_flight_s} s after the request came; reconcile with the upstream before \
             retrying"
        ),
        UnknownOutcome::Refuse => format!(
            "{what}: whether the request executed is unknown, and it will not be executed again with this \
             Idempotency-Key (retries get 502 outcome-unknown). Reconcile with the upstream, then send a new \
             Idempotency-Key if it must run"
        ),
        UnknownOutcome::Reconcile => format!(
            "{what}: whether the request executed is unknown. Retries with this Idempotency-Key get 409 \
             until its claim ends, {in_flight_s} s after the request came; then the upstream is asked what \
             happened, and a retry gets its answer (or executes, if it never did)"
        ),
    };
    Reply::problem(&Problem::new(Kind::OutcomeUnknown, status, detail))
}

/// 503 for a claimed request no detached call could be made for (the worker carries
/// `max_detached_calls` already, or Envoy refused the call); its claim is released, so a retry
/// executes.
pub fn refused_reply(why: &str) -> Reply {
    let detail = format!("{why}; nothing was sent upstream, retry later with the same Idempotency-Key");
    Reply::problem(&Problem::new(Kind::DetachedCapacity, 503, detail).retry_after_ms(1000))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a failing unwrap is a failing test
mod tests {
    use super::*;
    use crate::config::parse;
    use crate::engine;
    use crate::identity::scope::ScopeId;
    use crate::metrics::Counter;
    use crate::store::record::State;
    use crate::store::{Claim, Completion, Settled, StoreAnswer, StoreOp};
    use crate::worker::flow::{RequestFlow, Step};

    /// What a detached call's answer leads its flow to (`RequestFlow::detached_answered`): the
    /// store operation (None: the record stays as it is), what is counted once the store
    /// answered, and the client's reply, which goes out last.
    #[derive(Debug)]
    struct After {
        op: Option<StoreOp>,
        done: Counter,
        reply: Reply,
    }

    fn outcome(rule: &Rule, claim: Claim, answer: CallAnswer, now_ms: u64, held_ms: u64) -> After {
        let mut flow = RequestFlow::detached_for_test(2, claim, std::rc::Rc::new(rule.clone()));
        let mut steps = flow.detached_answered(answer, now_ms, held_ms).steps;
        let op = match steps.as_slice() {
            [Step::Store(op)] => Some(op.clone()),
            _ => None,
        };
        if op.is_some() {
            let cfg = parse(br#"{"routes":[{"name":"r","match":{"prefix":"/"}}]}"#).unwrap();
            steps = flow.store_answered(&cfg, StoreAnswer::Settled(Ok(Settled::Done))).steps;
        }
        let done = steps.iter().find_map(|s| if let Step::Count(c) = s { Some(*c) } else { None });
        let Some(Step::Reply { reply, details: DETAILS_DETACHED }) = steps.last() else {
            panic!("{steps:?}")
        };
        After { op, done: done.unwrap(), reply: reply.clone() }
    }

    fn rule(extra: &str) -> Rule {
        let json = format!(
            r#"{{"routes":[{{"name":"r","match":{{"prefix":"/"}},"execution":"detached"{extra}}}]}}"#
        );
        (*parse(json.as_bytes()).unwrap().rules[0]).clone()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    /// The call's headers for a request on `rule`, as the worker asks for them.
    fn headers_for(rule: &Rule, request: Vec<(String, Vec<u8>)>) -> Option<Vec<(String, Vec<u8>)>> {
        let crate::config::Execution::Detached { rewrite, .. } = &rule.execution else { panic!("inline") };
        call_headers(&rule.path, rewrite, &EnvoyHeaders::default(), request)
    }

    const CLAIM: Claim = Claim {
        scope: ScopeId([1; 32]),
        owner: 7,
        locator: 3,
        written: None,
        shard: 0,
        old_home: None,
        tombstone_s: 0,
    };

    #[test]
    fn the_call_carries_the_clients_head_without_connection_headers() {
        let request = pairs(&[
            (":authority", "shop.example"),
            (":path", "/orders?x=1"),
            (":method", "POST"),
            (":scheme", "https"),
            ("content-type", "application/json"),
            ("content-length", "12"),
            ("connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("idempotency-key", "k"),
            ("x-custom", "a"),
            ("x-custom", "b"),
            ("x-envoy-upstream-rq-timeout-ms", "20000"),
            ("x-envoy-retry-on", "5xx"),
            ("x-envoy-max-retries", "3"),
            ("x-envoy-hedge-on-per-try-timeout", "true"),
        ]);
        assert_eq!(
            headers_for(&rule(""), request).unwrap(),
            pairs(&[
                (":method", "POST"),
                (":path", "/orders?x=1"),
                (":authority", "shop.example"),
                ("content-type", "application/json"),
                ("idempotency-key", "k"),
                ("x-custom", "a"),
                ("x-custom", "b"),
            ])
        );
        assert_eq!(headers_for(&rule(""), pairs(&[(":method", "POST"), (":path", "/")])), None);
    }

    #[test]
    fn the_rules_upstream_rewrite_is_the_routes_rewrite_said_again() {
        let request =
            || pairs(&[(":method", "POST"), (":path", "/api/pay/7?x=1"), (":authority", "shop.example")]);
        let head = |rule: &Rule| {
            let h = headers_for(rule, request()).unwrap();
            (String::from_utf8(h[1].1.clone()).unwrap(), String::from_utf8(h[2].1.clone()).unwrap())
        };
        let prefix = |extra: &str| {
            let json = format!(
                r#"{{"routes":[{{"name":"r","match":{{"prefix":"/api/pay"}},"execution":"detached"{extra}}}]}}"#
            );
            (*parse(json.as_bytes()).unwrap().rules[0]).clone()
        };
        assert_eq!(head(&prefix("")), ("/api/pay/7?x=1".into(), "shop.example".into()));
        let both = prefix(
            r#","upstream_rewrite":{"prefix_rewrite":"/v2/inl","host_rewrite_literal":"payments.internal"}"#,
        );
        assert_eq!(head(&both), ("/v2/inl/7?x=1".into(), "payments.internal".into()));
        let host = prefix(r#","upstream_rewrite":{"host_rewrite_literal":"payments.internal:8443"}"#);
        assert_eq!(head(&host), ("/api/pay/7?x=1".into(), "payments.internal:8443".into()));
        // An exact match is replaced whole, as Envoy's prefix_rewrite does with a path match.
        let exact = r#"{"routes":[{"name":"r","match":{"exact":"/api/pay/7"},"execution":"detached",
            "upstream_rewrite":{"prefix_rewrite":"/charge"}}]}"#;
        let exact = (*parse(exact.as_bytes()).unwrap().rules[0]).clone();
        assert_eq!(head(&exact), ("/charge?x=1".into(), "shop.example".into()));
    }

    #[test]
    fn only_an_answer_envoy_received_from_the_upstream_is_one() {
        let upstream = |status: &str| pairs(&[(":status", status), ("x-envoy-upstream-service-time", "3")]);
        let envoys = pairs(&[(":status", "503"), ("content-type", "text/plain")]);
        // The upstream's own 504 and 503 are answers.
        for status in [504, 503, 201] {
            let got = answer_of(
                &EnvoyHeaders::default(),
                Some(status),
                upstream(&status.to_string()),
                b"x".to_vec(),
            );
            assert!(matches!(got, CallAnswer::Answered { status: s, .. } if s == status), "{got:?}");
        }
        // Envoy's timeout, and its reply to a reset after the request was sent: unknown.
        assert_eq!(
            answer_of(
                &EnvoyHeaders::default(),
                Some(504),
                pairs(&[(":status", "504")]),
                b"upstream request timeout".to_vec()
            ),
            CallAnswer::Unknown { timed_out: true }
        );
        let reset = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        assert_eq!(
            answer_of(&EnvoyHeaders::default(), Some(503), envoys.clone(), reset.to_vec()),
            CallAnswer::Unknown { timed_out: false }
        );
        // Its reply when no connection carried the request: never sent, released.
        let refused = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        let never = answer_of(&EnvoyHeaders::default(), Some(503), envoys.clone(), refused.to_vec());
        assert!(matches!(never, CallAnswer::NeverSent { status: 503, .. }));
        let out = outcome(&rule(""), CLAIM, never, 0, 0);
        assert_eq!(
            (out.op, out.done, out.reply.body),
            (Some(StoreOp::Release(CLAIM)), Counter::Released, refused.to_vec())
        );
        assert!(matches!(
            answer_of(&EnvoyHeaders::default(), Some(503), envoys, b"no healthy upstream".to_vec()),
            CallAnswer::NeverSent { .. }
        ));
        // A failed call (no :status).
        assert_eq!(
            answer_of(&EnvoyHeaders::default(), None, vec![], vec![]),
            CallAnswer::Unknown { timed_out: false }
        );
    }

    /// C27: behind an Envoy whose `header_prefix` is `x-acme` (and `envoy_header_prefix` says
    /// so) its names are the ones: the call loses the caller's `x-acme-*` controls, and an answer
    /// is the upstream's by `x-acme-upstream-service-time` (another prefix's mark proves nothing).
    #[test]
    fn envoys_header_prefix_names_the_controls_and_the_upstreams_mark() {
        let acme = EnvoyHeaders::new("x-acme");
        let crate::config::Execution::Detached { rewrite, .. } = &rule("").execution else {
            panic!("inline")
        };
        let request = pairs(&[
            (":method", "POST"),
            (":path", "/p"),
            (":authority", "a"),
            ("x-acme-retry-on", "5xx"),
            ("x-acme-upstream-rq-timeout-ms", "20000"),
            ("x-envoy-retry-on", "5xx"),
        ]);
        let sent = call_headers(&rule("").path, rewrite, &acme, request).unwrap();
        let names: Vec<&str> = sent.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, [":method", ":path", ":authority", "x-envoy-retry-on"]);
        let marked = |name: &str| pairs(&[(":status", "201"), (name, "3")]);
        assert!(matches!(
            answer_of(&acme, Some(201), marked("x-acme-upstream-service-time"), vec![]),
            CallAnswer::Answered { status: 201, .. }
        ));
        assert_eq!(
            answer_of(&acme, Some(201), marked("x-envoy-upstream-service-time"), vec![]),
            CallAnswer::Unknown { timed_out: false }
        );
        assert_eq!(
            answer_of(&EnvoyHeaders::default(), Some(201), marked("x-acme-upstream-service-time"), vec![]),
            CallAnswer::Unknown { timed_out: false }
        );
    }

    #[test]
    fn every_reason_a_request_never_left_releases_and_no_other_does() {
        let envoys = pairs(&[(":status", "503"), ("content-type", "text/plain")]);
        let answer =
            |body: String| answer_of(&EnvoyHeaders::default(), Some(503), envoys.clone(), body.into_bytes());
        let head = "upstream connect error or disconnect/reset before headers. ";
        for reason in NEVER_SENT_RESETS {
            for body in [
                format!("{head}reset reason: {reason}"),
                format!("{head}retried and the latest reset reason: {reason}"),
                format!("{head}reset reason: {reason}, transport failure reason: TLS_error:|268435581:SSL routines"),
            ] {
                assert!(matches!(answer(body.clone()), CallAnswer::NeverSent { status: 503, .. }), "{body}");
            }
        }
        // The pool's connect timeout (a host whose SYNs are dropped) by name: issue 30.
        let timeout = format!("{head}reset reason: connection timeout");
        assert!(matches!(answer(timeout), CallAnswer::NeverSent { .. }));
        for refusal in ["no healthy upstream", "maintenance mode", "drop overload"] {
            assert!(matches!(answer(refusal.into()), CallAnswer::NeverSent { .. }), "{refusal}");
        }
        for reason in ["connection termination", "remote reset", "local reset", "protocol error", "overflows"]
        {
            let body = format!("{head}reset reason: {reason}");
            assert_eq!(answer(body.clone()), CallAnswer::Unknown { timed_out: false }, "{body}");
        }
        // The reason must be Envoy's, not a word inside an upstream's body Envoy never saw.
        assert_eq!(
            answer("reset reason: overflow and more".into()),
            CallAnswer::Unknown { timed_out: false }
        );
    }

    #[test]
    fn an_answer_is_recorded_and_sent_as_it_came() {
        let r = rule("");
        let headers = pairs(&[
            (":status", "201"),
            ("content-type", "application/json"),
            ("x-a", "1"),
            ("transfer-encoding", "chunked"),
        ]);
        let out =
            outcome(&r, CLAIM, CallAnswer::Answered { status: 201, headers, body: b"{}".to_vec() }, 50, 0);
        let Some(StoreOp::Complete { claim, completion }) = &out.op else { panic!("{out:?}") };
        assert_eq!(*claim, CLAIM);
        assert_eq!((completion.state, completion.status, completion.now_ms), (State::Succeeded, 201, 50));
        let snapshot = completion.snapshot.as_ref().unwrap();
        assert_eq!(snapshot.body, b"{}");
        assert_eq!(snapshot.headers, pairs(&[("content-type", "application/json"), ("x-a", "1")]));
        assert_eq!(out.done, Counter::Stored);
        assert_eq!(out.reply.status, 201);
        assert_eq!(out.reply.headers, pairs(&[("content-type", "application/json"), ("x-a", "1")]));
        assert!(!out.reply.headers.iter().any(|(n, _)| n == engine::REPLAYED_HEADER));
        assert_eq!(out.reply.body, b"{}");
    }

    #[test]
    fn a_body_over_max_response_bytes_reaches_the_client_but_is_not_stored() {
        let r = rule(r#","max_response_bytes":4"#);
        let out =
            outcome(&r, CLAIM, CallAnswer::Answered { status: 200, headers: vec![], body: vec![7; 5] }, 0, 0);
        let Some(StoreOp::Complete { completion, .. }) = &out.op else { panic!("{out:?}") };
        assert_eq!(completion.snapshot, None);
        assert_eq!(out.done, Counter::ResponseNotStored);
        assert_eq!(out.reply.body, vec![7; 5]);
    }

    #[test]
    fn a_released_status_releases_and_on_a_takeover_rule_an_unknown_outcome_keeps_the_claim() {
        let r = rule(r#","unknown_outcome":"takeover""#);
        let out =
            outcome(&r, CLAIM, CallAnswer::Answered { status: 503, headers: vec![], body: vec![] }, 0, 0);
        assert_eq!(
            (out.op, out.done, out.reply.status),
            (Some(StoreOp::Release(CLAIM)), Counter::Released, 503)
        );
        for (timed_out, status) in [(true, 504), (false, 502)] {
            let out = outcome(&r, CLAIM, CallAnswer::Unknown { timed_out }, 0, 0);
            assert_eq!((out.op, out.done, out.reply.status), (None, Counter::KeptUnknown, status));
            assert!(String::from_utf8_lossy(&out.reply.body).contains("outcome-unknown"));
        }
    }

    #[test]
    fn a_kept_unknown_outcome_tells_its_client_how_long_retries_get_409_on_the_store_it_runs_on() {
        for (extra, what) in [
            (r#","unknown_outcome":"takeover""#, "reconcile with"),
            (r#","reconcile":{"path":"/k/{key}"}"#, "then the upstream"),
        ] {
            let r = rule(extra);
            // The default 30 s lease; etcd holds the claim one lease more.
            for (held_ms, seconds) in [(0, 30), (30_000, 60)] {
                let out = outcome(&r, CLAIM, CallAnswer::Unknown { timed_out: true }, 0, held_ms);
                let body = String::from_utf8_lossy(&out.reply.body);
                assert!(
                    body.contains(&format!("until its claim ends, {seconds} s after the request came")),
                    "{body}"
                );
                assert!(body.contains(what), "{body}");
            }
        }
    }

    #[test]
    fn by_default_an_unknown_outcome_is_completed_at_once() {
        let r = rule("");
        for (timed_out, status) in [(true, 504), (false, 502)] {
            let out = outcome(&r, CLAIM, CallAnswer::Unknown { timed_out }, 40, 0);
            let completion = Completion::outcome_unknown(40, r.ttl_ms);
            assert_eq!(
                (out.op, out.done, out.reply.status),
                (Some(StoreOp::Complete { claim: CLAIM, completion }), Counter::OutcomeUnknown, status)
            );
            let body = String::from_utf8_lossy(&out.reply.body);
            assert!(body.contains("outcome-unknown") && body.contains("new Idempotency-Key"), "{body}");
        }
        // A real answer is recorded as with takeover.
        let out =
            outcome(&r, CLAIM, CallAnswer::Answered { status: 201, headers: vec![], body: vec![] }, 0, 0);
        assert_eq!(out.done, Counter::Stored);
    }
}
