//! Detached execution (`execution: "detached"`): the root makes the call, records its answer
//! like an upstream answer, and answers the client if it is still there.

use super::{pairs, root, sent_to};
use crate::host::fake::{FakeHost, HostCall};
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;

const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"max_detached_calls":2,"routes":[
    {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
     "processing_timeout":"10s","upstream_timeout":"4s"}]}"#;

fn host() -> FakeHost {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().push("orders".into());
    h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
    h
}

/// A protected POST of `key`, held; the root then makes its call (returned: the callout).
fn posted(h: &FakeHost, root: &mut Root<FakeHost>, id: u32, key: &str) -> (Http<FakeHost>, Option<HostCall>) {
    let mut http = root.http_context(id);
    // Envoy runs a stream's callbacks with its own context the effective one.
    h.0.effective.set(id);
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", "/pay?x=1"),
        (":authority", "shop.example"),
        ("idempotency-key", key),
        ("content-type", "application/json"),
        ("content-length", "2"),
    ]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(2, true), Verdict::Pause, "held: the root carries it");
    let before = h.dispatches().len();
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let call = (h.dispatches().len() > before).then(|| h.dispatches().last().cloned()).flatten();
    (http, call)
}

/// The upstream's answer, as Envoy's router hands it over (with its service time).
fn answers(h: &FakeHost, status: &str, body: &[u8]) {
    *h.0.call_response_headers.borrow_mut() = pairs(&[
        (":status", status),
        ("content-type", "application/json"),
        ("x-order", "7"),
        ("x-envoy-upstream-service-time", "3"),
    ]);
    *h.0.call_response_body.borrow_mut() = body.to_vec();
}

/// Envoy's own 504 when `upstream_timeout` passed.
fn times_out(h: &FakeHost) {
    *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "504"), ("content-type", "text/plain")]);
    *h.0.call_response_body.borrow_mut() = b"upstream request timeout".to_vec();
}

fn token(call: &Option<HostCall>) -> u32 {
    match call {
        Some(HostCall::Dispatch { token, .. }) => *token,
        other => panic!("no callout: {other:?}"),
    }
}

/// C8, C9 in detached execution: a new key is claimed and called, and its client gets the
/// upstream's answer; a retry gets that answer again, marked replayed, without a second call.
#[test]
fn the_root_makes_the_call_records_the_answer_and_sends_it_as_the_first_response() {
    let h = host();
    let mut root = root(&h);
    let (mut http, call) = posted(&h, &mut root, 2, "k1");
    let Some(HostCall::Dispatch { context: 1, cluster, headers, body, timeout_ms: 4_000, .. }) = &call else {
        panic!("{call:?}")
    };
    assert_eq!(cluster, "orders");
    assert_eq!(body, b"{}");
    let h_of = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
    assert_eq!(
        (h_of(":method"), h_of(":path"), h_of(":authority")),
        (Some("POST"), Some("/pay?x=1"), Some("shop.example"))
    );
    assert_eq!(h_of("idempotency-key"), Some("k1"));
    assert_eq!(h_of("content-length"), None, "Envoy sets it from the body");
    assert_eq!(h.counter("claimed"), 1);
    answers(&h, "201", b"{\"id\":1}");
    root.on_http_call_response(token(&call), 8);
    assert_eq!(h.counter("stored"), 1);
    let sent = sent_to(&h, 2);
    let [(201, headers, body)] = sent.as_slice() else { panic!("{sent:?}") };
    assert_eq!(body, b"{\"id\":1}");
    assert!(headers.iter().any(|(n, v)| n == "x-order" && v == b"7"));
    assert!(!headers.iter().any(|(n, _)| n == crate::engine::REPLAYED_HEADER || n == ":status"));
    // Our own reply comes back through the encode callbacks: not an upstream answer.
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "201"), ("content-type", "application/json")]);
    assert_eq!(http.on_response_headers(false), Verdict::Continue);
    assert_eq!(http.on_response_body(8, true), Verdict::Continue);
    http.on_log();
    assert_eq!(h.counter("stored"), 1);
    // A retry is the replay.
    let (_, none) = posted(&h, &mut root, 3, "k1");
    assert!(none.is_none());
    let replay = sent_to(&h, 3);
    assert!(matches!(replay.as_slice(), [(201, headers, body)]
        if body == b"{\"id\":1}" && headers.iter().any(|(n, _)| n == crate::engine::REPLAYED_HEADER)));
}

/// C9: the answer is stored though its client left, and a retry gets it without a second call.
#[test]
fn a_client_gone_before_the_answer_still_has_its_answer_recorded() {
    let h = host();
    let mut root = root(&h);
    let (mut http, call) = posted(&h, &mut root, 2, "k2");
    http.on_log();
    drop(http);
    h.fail("set_effective_context", 2);
    answers(&h, "201", b"{}");
    root.on_http_call_response(token(&call), 2);
    assert_eq!(h.counter("stored"), 1);
    assert!(sent_to(&h, 2).is_empty(), "nobody to answer");
    h.0.failing.borrow_mut().clear();
    let (_, none) = posted(&h, &mut root, 3, "k2");
    assert!(none.is_none(), "the retry is not executed again");
    assert!(matches!(sent_to(&h, 3).as_slice(), [(201, _, _)]));
}

/// What a detached request's access log says: its outcome is published on its own stream as an
/// inline request's is (`publish_outcome`), the last one standing (`claimed`, then `stored`);
/// for a client gone before the answer, on no stream at all (the root's context is no stream).
#[test]
fn a_detached_outcome_is_published_on_its_stream_and_never_on_another() {
    let published = |h: &FakeHost| -> Vec<(u32, String)> {
        h.0.calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                HostCall::SetProperty { context, name, value } if name == "idempotency.outcome" => {
                    Some((*context, value.split(' ').next().unwrap_or_default().to_string()))
                }
                _ => None,
            })
            .collect()
    };
    let h = host();
    *h.0.config.borrow_mut() = CONFIG.replacen('{', r#"{"publish_outcome":true,"#, 1).into_bytes();
    let mut root = root(&h);
    let (_http, call) = posted(&h, &mut root, 2, "p1");
    answers(&h, "201", b"{}");
    root.on_http_call_response(token(&call), 2);
    assert_eq!(published(&h), vec![(2, "claimed".to_string()), (2, "stored".to_string())]);
    // Its client gone: the outcome is counted, and published nowhere.
    let (mut http, call) = posted(&h, &mut root, 3, "p2");
    http.on_log();
    h.fail("set_effective_context", 3);
    answers(&h, "201", b"{}");
    root.on_http_call_response(token(&call), 2);
    assert_eq!(h.counter("stored"), 2);
    assert_eq!(published(&h).last(), Some(&(3, "claimed".to_string())), "{:?}", published(&h));
}

/// `reconcile` on a detached rule whose lookup goes to the route's cluster: a call that ends
/// without an outcome after its client left still gets the root's lookup at the lease's end,
/// to the cluster the route picked while the client was there (none can be read later).
#[test]
fn a_detached_unknown_outcome_is_looked_up_at_its_lease_end_after_its_client_left() {
    let h = host();
    *h.0.config.borrow_mut() = CONFIG
        .replace(
            r#""upstream_timeout":"4s""#,
            r#""upstream_timeout":"4s","reconcile":{"path":"/orders/{key}"}"#,
        )
        .into_bytes();
    let mut root = root(&h);
    let (mut http, call) = posted(&h, &mut root, 2, "r1");
    http.on_log();
    drop(http);
    // Its stream is gone: neither it nor its route can be read any more.
    h.fail("set_effective_context", 2);
    h.fail("property", 2);
    h.0.now_ms.set(5_000);
    times_out(&h);
    root.on_http_call_response(token(&call), 24);
    assert_eq!(h.counter("outcome_unknown"), 1);
    h.0.failing.borrow_mut().remove("set_effective_context");
    // Its lease ends 10 s after the claim; the root looks the record up itself.
    let before = h.dispatches().len();
    h.0.now_ms.set(20_000);
    root.on_tick();
    let lookups: Vec<_> = h.dispatches()[before..].to_vec();
    let [HostCall::Dispatch { cluster, headers, .. }] = lookups.as_slice() else { panic!("{lookups:?}") };
    assert_eq!(cluster, "orders");
    assert!(headers.iter().any(|(n, v)| n == ":path" && v == "/orders/r1"), "{headers:?}");
}

/// C20: no answer within `upstream_timeout` is 504 `outcome-unknown`, and the record follows
/// `unknown_outcome`; C16: on `refuse`, the default, a retry gets 502 `outcome-unknown` and is
/// never executed again.
#[test]
fn upstream_timeout_is_an_unknown_outcome_a_5xx_and_never_executed_again() {
    let h = host();
    let mut root = root(&h);
    let (_http, call) = posted(&h, &mut root, 2, "k3");
    h.0.now_ms.set(1_000 + 4_000);
    times_out(&h);
    root.on_http_call_response(token(&call), 24);
    assert_eq!((h.counter("outcome_unknown"), h.counter("stored")), (1, 0));
    let sent = sent_to(&h, 2);
    assert!(
        matches!(sent.as_slice(), [(504, _, body)] if String::from_utf8_lossy(body).contains("outcome-unknown"))
    );
    // A retry at once gets 502 outcome-unknown (the default, unknown_outcome: refuse), never a
    // second execution.
    let (_, none) = posted(&h, &mut root, 3, "k3");
    assert!(none.is_none());
    assert!(matches!(sent_to(&h, 3).as_slice(), [(502, _, _)]));
    // An upstream's own 504, sooner than the timeout, is its answer (released, by default).
    let (_, call) = posted(&h, &mut root, 4, "k4");
    answers(&h, "504", b"busy");
    root.on_http_call_response(token(&call), 4);
    assert_eq!(h.counter("released"), 1);
    assert!(matches!(sent_to(&h, 4).as_slice(), [(504, _, body)] if body == b"busy"));
}

/// C21: past `max_detached_calls`, or refused by Envoy (unknown cluster), a new key gets 503
/// `detached-capacity` and its claim back.
#[test]
fn past_max_detached_calls_a_new_key_gets_503_and_its_claim_back() {
    let h = host();
    let mut root = root(&h);
    let (_a, first) = posted(&h, &mut root, 2, "a");
    let (_b, second) = posted(&h, &mut root, 3, "b");
    assert!(first.is_some() && second.is_some());
    let (_c, third) = posted(&h, &mut root, 4, "c");
    assert!(third.is_none());
    assert!(matches!(sent_to(&h, 4).as_slice(), [(503, headers, body)]
        if String::from_utf8_lossy(body).contains("detached-capacity") && headers.iter().any(|(n, _)| n == "retry-after")));
    assert_eq!((h.counter("detached_refused"), h.counter("released")), (1, 1));
    // Once a call is over, the key executes (its claim was given back).
    answers(&h, "201", b"{}");
    root.on_http_call_response(token(&first), 2);
    let (_c, again) = posted(&h, &mut root, 5, "c");
    assert!(again.is_some());
    // An unknown cluster: Envoy refuses the call; 503, and the claim is given back.
    h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"nowhere".to_vec());
    let (_d, refused) = posted(&h, &mut root, 6, "d");
    assert!(refused.is_none());
    assert!(matches!(sent_to(&h, 6).as_slice(), [(503, _, _)]));
    assert_eq!((h.counter("detached_refused"), h.counter("released")), (2, 2));
}

/// An upstream's answer as an Envoy whose bootstrap `header_prefix` is `x-acme` hands it over.
fn answers_under_acme(h: &FakeHost, status: &str, body: &[u8]) {
    *h.0.call_response_headers.borrow_mut() = pairs(&[
        (":status", status),
        ("content-type", "application/json"),
        ("x-acme-upstream-service-time", "3"),
    ]);
    *h.0.call_response_body.borrow_mut() = body.to_vec();
}

/// C27: behind an Envoy with `header_prefix: x-acme`, `envoy_header_prefix: "x-acme"`: the
/// call goes without the caller's `x-acme-*` router controls, and its answer, marked
/// `x-acme-upstream-service-time`, is the upstream's: stored, and no error logged.
#[test]
fn with_envoys_header_prefix_configured_a_detached_answer_is_the_upstreams() {
    super::capture_logs();
    let h = host();
    let config = CONFIG.replacen('{', r#"{"envoy_header_prefix":"x-acme","#, 1);
    *h.0.config.borrow_mut() = config.into_bytes();
    let mut root = root(&h);
    let mut http = root.http_context(2);
    h.0.effective.set(2);
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", "/pay"),
        (":authority", "shop.example"),
        ("idempotency-key", "k"),
        ("x-acme-retry-on", "5xx"),
        ("x-acme-max-retries", "3"),
        ("x-envoy-retry-on", "5xx"),
    ]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(2, true), Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let call = h.dispatches().last().cloned();
    let Some(HostCall::Dispatch { headers, .. }) = &call else { panic!("{call:?}") };
    let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.iter().any(|n| n.starts_with("x-acme-")), "{names:?}");
    assert_eq!(h.counter("router_controls_removed"), 1);
    answers_under_acme(&h, "201", b"{}");
    root.on_http_call_response(token(&call), 2);
    assert_eq!((h.counter("stored"), h.counter("outcome_unknown")), (1, 0));
    assert!(super::logged(log::Level::Error).is_empty());
}

/// C27: the filter expects `x-envoy` (the default) behind an Envoy whose prefix is `x-acme`.
/// A detached answer is then Envoy's own reply for all the filter can tell (an unknown outcome,
/// the safe side), and it says what is wrong in one error line per worker naming
/// `envoy_header_prefix`, however many answers (detached or inline) show it.
#[test]
fn a_header_prefix_other_than_the_configured_one_is_one_error_line_per_worker() {
    super::capture_logs();
    let h = host();
    let mut root = root(&h);
    for (id, key) in [(2, "a"), (4, "b")] {
        let (_http, call) = posted(&h, &mut root, id, key);
        answers_under_acme(&h, "201", b"{}");
        root.on_http_call_response(token(&call), 2);
    }
    assert_eq!((h.counter("outcome_unknown"), h.counter("stored")), (2, 0));
    let errors = super::logged(log::Level::Error);
    assert_eq!(errors.len(), 1, "{errors:?}");
    for words in
        ["x-acme-upstream-service-time", "envoy_header_prefix is \"x-envoy\"", "header_prefix differs"]
    {
        assert!(errors[0].contains(words), "{words:?} in {:?}", errors[0]);
    }
}
