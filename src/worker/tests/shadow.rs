//! Issue 47, part 3: `mode: "shadow"`. The filter claims, fingerprints and records as usual,
//! but never answers for the upstream: a duplicate, a mismatch, a request in flight, a missing
//! key are forwarded, without a claim, and counted as what they would have been
//! (`shadow_<outcome>`); the record the first request wrote is never touched by them.

use super::{executed, host_with, pairs, post, upstream_answers};
use crate::host::fake::FakeHost;
use crate::worker::flow::Verdict;

const SHADOW: &str = r#"{"mode":"shadow","publish_outcome":true,"routes":[
    {"name":"orders","match":{"prefix":"/orders"},"require_key":true},
    {"name":"waits","match":{"prefix":"/wait"},"require_key":true,"concurrent":"wait"}]}"#;

fn replies(h: &FakeHost) -> usize {
    h.replies().len()
}

#[test]
fn what_would_be_answered_locally_is_forwarded_and_counted() {
    let h = host_with(SHADOW);
    let root = super::root(&h);
    executed(&h, &root, 2, "k", b"{\"n\":1}");
    assert_eq!((h.counter("claimed"), h.counter("stored")), (1, 1));
    // The duplicate goes upstream; its answer is not recorded (it holds no claim).
    let mut again = root.http_context(3);
    assert_eq!(post(&h, &mut again, "/orders", "k"), Verdict::Continue);
    upstream_answers(&h, "201", b"{\"n\":2}");
    assert_eq!(again.on_response_headers(false), Verdict::Continue);
    assert_eq!(again.on_response_body(7, true), Verdict::Continue);
    assert_eq!(h.counter("shadow_replayed"), 1);
    assert_eq!((h.counter("replayed"), h.counter("stored")), (0, 1));
    // Another body under the key: forwarded too.
    let mut other = root.http_context(4);
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", "/orders"),
        ("idempotency-key", "k"),
        ("content-type", "application/json"),
    ]);
    *h.0.request_body.borrow_mut() = b"{\"other\":1}".to_vec();
    assert_eq!(other.on_request_headers(false), Verdict::Pause);
    assert_eq!(other.on_request_body(11, true), Verdict::Continue);
    assert_eq!(h.counter("shadow_mismatch"), 1);
    // No key on a rule that requires one: forwarded at the headers.
    let mut keyless = root.http_context(5);
    *h.0.request_headers.borrow_mut() = pairs(&[(":method", "POST"), (":path", "/orders")]);
    assert_eq!(keyless.on_request_headers(false), Verdict::Continue);
    assert_eq!(h.counter("shadow_missing_key"), 1);
    // A duplicate while the original is in flight, on a wait rule: not held, forwarded.
    let mut original = root.http_context(6);
    assert_eq!(post(&h, &mut original, "/wait", "w"), Verdict::Continue);
    let mut duplicate = root.http_context(7);
    assert_eq!(post(&h, &mut duplicate, "/wait", "w"), Verdict::Continue);
    assert_eq!((h.counter("shadow_in_flight"), h.counter("waiting")), (1, 0));
    assert_eq!(replies(&h), 0, "the filter answered nothing itself");
    let published = super::filter_states(&h, "idempotency.outcome");
    assert!(published.iter().any(|v| v.starts_with("shadow_replayed ")), "{published:?}");
}

#[test]
fn shadow_counters_exist_only_in_shadow_mode() {
    let defined = |config: &str| {
        let h = host_with(config);
        let _root = super::root(&h);
        h.metrics_defined()
    };
    let enforce = SHADOW.replace(r#""mode":"shadow","#, "");
    // Two rules, 13 shadow outcomes each.
    assert_eq!(defined(SHADOW) - defined(&enforce), 2 * 13);
}
