//! One request's path through the worker with the local store (Envoy's shared data): a refused
//! configuration is logged in one line and a missing one leaves every stream untouched; a replay
//! gets its stored content-type back; an unreadable body is a 503; a response from no upstream
//! host releases the claim and a body cut short keeps the outcome without it; trailers end the
//! request body and the captured response; the router-retry warning and the "body never
//! received" log are said once (per rule, per minute) while every occurrence is counted.

use super::{capture_logs, executed, host, logged, pairs, post, root, upstream_answers};
use crate::host::fake::{FakeHost, HostCall};
use crate::worker::flow::Verdict;
use crate::worker::root::Root;

#[test]
fn a_refused_configuration_is_logged_in_one_line() {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = br#"{"routes":[]}"#.to_vec();
    assert!(!Root::new(1, h.clone()).on_configure());
    assert!(matches!(h.0.calls.borrow().as_slice(), [HostCall::Critical(m)] if m.contains("routes")));
}

#[test]
fn without_a_configuration_every_stream_goes_on_untouched() {
    let h = FakeHost::default();
    let root = Root::new(1, h.clone());
    let mut http = root.http_context(2);
    *h.0.request_headers.borrow_mut() = pairs(&[(":method", "POST"), (":path", "/orders")]);
    assert_eq!(http.on_request_headers(false), Verdict::Continue);
    assert_eq!(http.on_request_body(2, true), Verdict::Continue);
    assert_eq!(http.on_response_headers(true), Verdict::Continue);
    http.on_log();
    assert!(h.0.calls.borrow().is_empty());
}

/// C9: a replay is the stored answer, headers too: its content-type comes back even where
/// Envoy's local-reply path dropped it.
#[test]
fn a_replay_gets_its_stored_content_type_back() {
    let h = host();
    let root = root(&h);
    executed(&h, &root, 2, "k", b"");
    assert_eq!((h.counter("claimed"), h.counter("stored")), (1, 1));

    let mut retry = root.http_context(3);
    assert_eq!(post(&h, &mut retry, "/orders", "k"), Verdict::Pause);
    assert_eq!(h.replies(), vec![(0, 201, "idempotency_replay".to_string())]);
    // Envoy's local-reply path dropped the stored content-type of an empty body.
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
    assert_eq!(retry.on_response_headers(false), Verdict::Continue);
    assert!(h
        .0
        .calls
        .borrow()
        .contains(&HostCall::SetHeader { name: "content-type".into(), value: b"application/json".to_vec() }));

    // With a body Envoy keeps the type it was given: the replay's headers are not even read.
    executed(&h, &root, 4, "j", b"{\"id\":1}");
    let mut retry = root.http_context(5);
    assert_eq!(post(&h, &mut retry, "/orders", "j"), Verdict::Pause);
    let _ = h.take_tally();
    assert_eq!(retry.on_response_headers(false), Verdict::Continue);
    assert!(h.take_tally().is_empty());
}

#[test]
fn an_unreadable_request_body_is_a_503() {
    let h = host();
    let root = root(&h);
    let mut http = root.http_context(2);
    h.fail("buffer", 2);
    assert_eq!(post(&h, &mut http, "/orders", "k"), Verdict::Pause);
    assert_eq!(h.replies(), vec![(0, 503, "idempotency_problem".to_string())]);
    assert_eq!(h.counter("store_error"), 1);
}

/// C8: a released record counts as no record, so the retry executes. C15: an answer cut
/// mid-body is not kept, and the next retry gets 410, not a second execution.
#[test]
fn no_upstream_host_releases_the_claim_and_a_cut_body_keeps_the_outcome_without_it() {
    let h = host();
    let root = root(&h);
    let mut http = root.http_context(2);
    post(&h, &mut http, "/orders", "k");
    // A direct response: upstream.address is empty.
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "200")]);
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"direct_response".to_vec());
    h.0.properties.borrow_mut().insert("upstream.address".into(), Vec::new());
    http.on_response_headers(true);
    assert_eq!(h.counter("released"), 1);
    // Released: the retry executes.
    let mut again = root.http_context(3);
    assert_eq!(post(&h, &mut again, "/orders", "k"), Verdict::Continue);
    upstream_answers(&h, "201", b"abcdef");
    again.on_response_headers(false);
    again.on_response_body(3, false);
    again.on_log(); // the upstream reset mid-body
    assert_eq!(h.counter("response_not_stored"), 1);
    let mut late = root.http_context(4);
    post(&h, &mut late, "/orders", "k");
    assert_eq!(h.replies().last().map(|r| r.1), Some(410));
}

#[test]
fn the_router_retry_warning_is_claimed_once_per_rule_by_one_worker() {
    let h = host();
    let _ = root(&h);
    let keys = h.0.data.key_count();
    let (worker1, worker2) = (
        crate::worker::plugin::PluginState::configure_with(h.clone(), 1, None).unwrap(),
        crate::worker::plugin::PluginState::configure_with(h.clone(), 2, None).unwrap(),
    );
    assert!(worker1.first_retry_warning("orders"));
    assert!(!worker2.first_retry_warning("orders"));
    assert!(!worker1.first_retry_warning("orders"));
    assert!(worker2.first_retry_warning("waits"));
    // Every flag existed before traffic: asking created no data key.
    assert_eq!(h.0.data.key_count(), keys);
    assert!(!worker1.first_retry_warning("no-such-rule"));
    assert_eq!(h.0.data.key_count(), keys);
}

#[test]
fn a_request_ended_before_its_body_is_counted_each_time_and_logged_once_a_minute() {
    let h = host();
    let root = root(&h);
    let plugin = crate::worker::plugin::PluginState::configure_with(h.clone(), 1, None).unwrap();
    assert!(plugin.meter.body_never_received_log_due(1_000));
    assert!(!plugin.meter.body_never_received_log_due(60_999));
    assert!(plugin.meter.body_never_received_log_due(61_000));
    // Through the stream's callbacks: held at its headers, ended without a body frame.
    for n in 0..3 {
        let mut http = root.http_context(2 + n);
        *h.0.request_headers.borrow_mut() =
            pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        http.on_log();
    }
    assert_eq!((h.counter("body_never_received"), h.counter("claimed")), (3, 0));
}

#[test]
fn a_body_envoy_kept_from_the_filter_is_logged_as_an_error_once_per_worker() {
    capture_logs();
    let h = host();
    let root = root(&h);
    let head = pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
    let head_bytes: usize = head.iter().map(|(n, v)| n.len() + v.len()).sum();
    // Envoy received 23 bytes of body (request.total_size counts them with the header map) and
    // handed none of them over: allow_on_headers_stop_iteration is missing.
    let total = (head_bytes as u64 + 23).to_le_bytes().to_vec();
    h.0.properties.borrow_mut().insert("request.total_size".into(), total);
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"stream_idle_timeout".to_vec());
    for n in 0..3 {
        let mut http = root.http_context(2 + n);
        *h.0.request_headers.borrow_mut() = head.clone();
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        http.on_log();
    }
    assert_eq!((h.counter("body_never_received"), h.counter("claimed")), (3, 0));
    let errors = logged(log::Level::Error);
    assert_eq!(errors.len(), 1, "{errors:?}");
    for words in [
        "route rule orders: 23 bytes",
        "(stream_idle_timeout)",
        "lacks allow_on_headers_stop_iteration: true",
        "counter body_never_received",
        "Istio >= 1.28",
    ] {
        assert!(errors[0].contains(words), "{words:?} in {:?}", errors[0]);
    }
    assert!(logged(log::Level::Warn).iter().all(|w| !w.contains("allow_on_headers_stop_iteration")));
    // A client that left before its body (Envoy received none): the once-a-minute warning, not
    // the error.
    let total = (head_bytes as u64).to_le_bytes().to_vec();
    h.0.properties.borrow_mut().insert("request.total_size".into(), total);
    let mut http = root.http_context(9);
    *h.0.request_headers.borrow_mut() = head.clone();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    http.on_log();
    assert_eq!(logged(log::Level::Error).len(), 1);
    let warnings = logged(log::Level::Warn);
    assert!(warnings.iter().any(|w| w.contains("ended before any of it arrived")), "{warnings:?}");
}

#[test]
fn trailers_end_the_request_body_and_the_captured_response() {
    let h = host();
    let mut root = root(&h);
    let mut http = root.http_context(2);
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "t")]);
    *h.0.request_body.borrow_mut() = b"x".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(1, false), Verdict::Pause);
    assert_eq!(http.on_request_trailers(), Verdict::Continue);
    upstream_answers(&h, "200", b"ok");
    http.on_response_headers(false);
    http.on_response_body(2, false);
    assert_eq!(http.on_response_trailers(), Verdict::Continue);
    assert_eq!(h.counter("stored"), 1);
    // The root that goes away stops advertising its wake-up queue.
    let registry = crate::worker::wait::wake::Registry::new(h.clone());
    root.on_tick();
    assert_eq!(registry.live(1_000).unwrap().len(), 1);
    assert!(root.on_done());
    assert!(registry.live(1_000).unwrap().is_empty());
}

/// What each request's access log may say (issue 22, item 11): with `publish_outcome`, every
/// outcome counted for a protected request is its filter state (the last one stands), with the
/// record's tag; a refusal before any record has `-`; unprotected traffic sets nothing. Without
/// it nothing is ever set (the host-call budgets hold).
#[test]
fn outcomes_are_published_as_filter_state_only_when_configured() {
    let published = |h: &FakeHost| -> Vec<String> {
        h.0.calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                HostCall::SetProperty { name, value, .. } if name == "idempotency.outcome" => {
                    Some(value.clone())
                }
                _ => None,
            })
            .collect()
    };
    let h = host();
    *h.0.config.borrow_mut() = br#"{"store":{"type":"local","capacity":64},"publish_outcome":true,
        "routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#
        .to_vec();
    let root = root(&h);
    executed(&h, &root, 2, "k", b"{}");
    let mut retry = root.http_context(3);
    assert_eq!(post(&h, &mut retry, "/orders", "k"), Verdict::Pause);
    let values = published(&h);
    let tag = values.first().and_then(|v| v.strip_prefix("claimed ")).unwrap_or_default().to_string();
    assert_eq!(tag.len(), 12, "{values:?}");
    assert_eq!(values, vec![format!("claimed {tag}"), format!("stored {tag}"), format!("replayed {tag}")]);

    let mut keyless = root.http_context(4);
    *h.0.request_headers.borrow_mut() = pairs(&[(":method", "POST"), (":path", "/orders")]);
    keyless.on_request_headers(false);
    let mut elsewhere = root.http_context(5);
    *h.0.request_headers.borrow_mut() = pairs(&[(":method", "POST"), (":path", "/other")]);
    assert_eq!(elsewhere.on_request_headers(false), Verdict::Continue);
    assert_eq!(published(&h).last().map(String::as_str), Some("missing_key -"));
    assert_eq!(published(&h).len(), 4);

    // The default: nothing published.
    let h = host();
    let root = super::root(&h);
    let mut first = root.http_context(2);
    assert_eq!(post(&h, &mut first, "/orders", "k"), Verdict::Continue);
    assert!(published(&h).is_empty());
}

/// Issue 30: a caller Envoy counts as internal keeps its router control headers, and with them
/// could ask Envoy's router for a retry (a second execution under one claim) or outlive the
/// lease. The filter takes them off a protected request before the router sees it, counts it,
/// and leaves unprotected traffic alone.
///
/// C22, inline execution; C1: the traffic no rule protects passes through untouched.
#[test]
fn a_protected_request_loses_its_router_control_headers_and_other_traffic_keeps_them() {
    let h = host();
    let root = root(&h);
    let controls = [("x-envoy-retry-on", "5xx"), ("x-envoy-upstream-rq-timeout-ms", "20000")];
    let mut http = root.http_context(2);
    let mut headers = pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
    headers.extend(pairs(&controls));
    headers.extend(pairs(&[("x-envoy-retry-on", "reset"), ("x-envoy-attempt-count", "1")]));
    *h.0.request_headers.borrow_mut() = headers;
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(2, true), Verdict::Continue);
    let left: Vec<String> = h.0.request_headers.borrow().iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(left, [":method", ":path", "idempotency-key", "x-envoy-attempt-count"]);
    assert_eq!((h.counter("router_controls_removed"), h.counter("claimed")), (1, 1));

    // Not protected: untouched, not counted.
    let mut other = root.http_context(3);
    let mut headers = pairs(&[(":method", "POST"), (":path", "/elsewhere")]);
    headers.extend(pairs(&controls));
    *h.0.request_headers.borrow_mut() = headers.clone();
    assert_eq!(other.on_request_headers(false), Verdict::Continue);
    assert_eq!(*h.0.request_headers.borrow(), headers);
    assert_eq!(h.counter("router_controls_removed"), 1);
}

/// C27, inline: an upstream answer marked with another prefix's upstream service time and not
/// ours (Envoy's `header_prefix` is not `envoy_header_prefix`) is still captured (Envoy's
/// details say it came from the upstream), and the mismatch is one error line per worker.
#[test]
fn an_inline_answer_under_another_header_prefix_is_captured_and_logged_once() {
    capture_logs();
    let h = host();
    let root = root(&h);
    for (id, key) in [(2, "a"), (3, "b"), (4, "c")] {
        let mut http = root.http_context(id);
        assert_eq!(post(&h, &mut http, "/orders", key), Verdict::Continue);
        upstream_answers(&h, "201", b"{}");
        let acme = pairs(&[(":status", "201"), ("x-acme-upstream-service-time", "1")]);
        *h.0.response_headers.borrow_mut() = acme;
        assert_eq!(http.on_response_headers(false), Verdict::Continue);
        assert_eq!(http.on_response_body(2, true), Verdict::Continue);
        http.on_log();
    }
    assert_eq!(h.counter("stored"), 3);
    let errors = logged(log::Level::Error);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("envoy_header_prefix"), "{errors:?}");
    // Our own mark: nothing to say.
    capture_logs();
    let fresh = host();
    let plain = super::root(&fresh);
    executed(&fresh, &plain, 2, "k", b"{}");
    assert!(logged(log::Level::Error).is_empty());
}

/// `scope_host: "cluster"`: the record is the routed cluster's, whatever name the caller gave
/// the service; the cluster is read (one host call) only where the configuration asks for it.
#[test]
fn one_record_per_cluster_whatever_name_the_caller_used() {
    let config = |mode: &str| {
        format!(r#"{{"scope_host":"{mode}","routes":[{{"name":"orders","match":{{"prefix":"/orders"}}}}]}}"#)
    };
    for (mode, replayed) in [("cluster", true), ("authority", false)] {
        let h = super::host_with(&config(mode));
        let root = root(&h);
        h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"outbound|8080||payments".to_vec());
        executed(&h, &root, 2, "k", b"{}");
        let mut retry = root.http_context(3);
        *h.0.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", "/orders"),
            (":authority", "payments.prod.svc.cluster.local:8080"),
            ("idempotency-key", "k"),
            ("content-type", "application/json"),
        ]);
        *h.0.request_body.borrow_mut() = b"{}".to_vec();
        let _ = h.take_tally();
        assert_eq!(retry.on_request_headers(false), Verdict::Pause);
        let read_cluster = h.take_tally().contains_key("property");
        assert_eq!(read_cluster, mode == "cluster", "{mode}");
        let verdict = retry.on_request_body(2, true);
        assert_eq!(verdict == Verdict::Pause && h.replies().len() == 1, replayed, "{mode}");
    }
}
