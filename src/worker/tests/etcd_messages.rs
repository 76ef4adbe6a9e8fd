//! What the log says when etcd cannot be used, over either protocol: an answer Envoy made itself
//! (etcd down: a 503, or in gRPC form `grpc-status: 14`, with Envoy's own words) says that Envoy
//! could not reach etcd on its cluster, with the status and the start of Envoy's words; an
//! error etcd answered says that etcd refused the call, with its code and message; a call Envoy
//! reports failed without an answer says that.

use super::{capture_logs, logged, pairs, sent_to};
use crate::host::fake::{FakeHost, HostCall};
use crate::worker::flow::Verdict;
use crate::worker::root::Root;

const ENVOY_503: &str = "upstream connect error or disconnect/reset before headers. reset reason: remote \
                         connection failure, transport failure reason: delayed connect error: Connection refused";

fn rig(protocol: &str) -> (FakeHost, Root<FakeHost>) {
    let config = format!(
        r#"{{"store":{{"type":"etcd","cluster":"etcd-main","protocol":"{protocol}"}},
            "routes":[{{"name":"orders","match":{{"prefix":"/orders"}},"require_key":true}}]}}"#
    );
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = config.into_bytes();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().push("etcd-main".into());
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure());
    (h, root)
}

/// A protected POST whose store call gets `headers` and `body` as its answer: the warning the
/// request's store error was logged with (it gets 503 `store-unavailable`).
fn store_error_logged(protocol: &str, headers: &[(&str, &str)], body: &[u8]) -> String {
    let (h, mut root) = rig(protocol);
    capture_logs();
    let mut http = root.http_context(2);
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(2, true), Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let Some(HostCall::Dispatch { token, .. }) = h.dispatches().pop() else { panic!("no store call") };
    *h.0.call_response_headers.borrow_mut() = pairs(headers);
    *h.0.call_response_body.borrow_mut() = body.to_vec();
    root.on_http_call_response(token, body.len());
    assert!(matches!(sent_to(&h, 2).as_slice(), [(503, _, _)]));
    let warnings = logged(log::Level::Warn);
    let [line] = warnings.as_slice() else { panic!("one warning: {warnings:?}") };
    line.clone()
}

/// C19: etcd down, over the JSON gateway: Envoy's own 503 is Envoy's, not etcd's.
#[test]
fn envoys_own_answer_says_envoy_could_not_reach_etcd_over_json() {
    let line = store_error_logged(
        "json",
        &[(":status", "503"), ("content-type", "text/plain")],
        ENVOY_503.as_bytes(),
    );
    assert!(
        line.ends_with(&format!(
            "store unavailable: Envoy could not reach etcd on cluster \"etcd-main\": the answer is Envoy's own, \
             503 \"{}...\"",
            &ENVOY_503[..160]
        )),
        "{line}"
    );
}

/// C19: etcd down, over gRPC: Envoy's trailers-only UNAVAILABLE (its HTTP status is 200) is
/// Envoy's, not an answer of etcd's.
#[test]
fn envoys_own_answer_says_envoy_could_not_reach_etcd_over_grpc() {
    let short = "upstream connect error or disconnect/reset before headers. reset reason: connection failure";
    let line = store_error_logged(
        "grpc",
        &[
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("grpc-message", short),
        ],
        b"",
    );
    assert!(
        line.ends_with(&format!(
            "store unavailable: Envoy could not reach etcd on cluster \"etcd-main\": the answer is Envoy's own, \
             200, grpc-status 14 \"{short}\""
        )),
        "{line}"
    );
}

/// C19: Envoy's report of a call that failed without an answer (no `:status`).
#[test]
fn a_call_without_an_answer_says_so() {
    let line = store_error_logged("json", &[], b"");
    assert!(
        line.ends_with(
            "store unavailable: the call to etcd failed without an answer (Envoy reports a reset after \
             etcd's headers, or an answer over its buffer limit)"
        ),
        "{line}"
    );
}

/// C19: an error etcd answered (it carries the router's service time) is etcd's refusal.
#[test]
fn etcds_own_error_says_etcd_refused_the_call() {
    let line = store_error_logged(
        "json",
        &[(":status", "403"), ("x-envoy-upstream-service-time", "2")],
        br#"{"error":"etcdserver: permission denied","code":7,"message":"etcdserver: permission denied"}"#,
    );
    assert!(
        line.ends_with("store unavailable: etcd refused the call (code 7): etcdserver: permission denied"),
        "{line}"
    );
    let line = store_error_logged(
        "grpc",
        &[
            (":status", "200"),
            ("x-envoy-upstream-service-time", "2"),
            ("grpc-status", "7"),
            ("grpc-message", "etcdserver: permission denied"),
        ],
        b"",
    );
    assert!(
        line.ends_with("store unavailable: etcd refused the call (code 7): etcdserver: permission denied"),
        "{line}"
    );
}
