//! Issue 46, part 1: where a rule reads its key (`routes[].key`). A key from the rule's own
//! header, from the JSON body (a business number), or the request's fingerprint for clients
//! that send none; each source its own records, counted and published beside the outcome.

use super::{host_with, pairs, root, upstream_answers};
use crate::host::fake::{FakeHost, HostCall};
use crate::worker::flow::Verdict;
use crate::worker::root::Root;

const ROUTES: &str = r#"{"publish_outcome":true,"routes":[
    {"name":"orders","match":{"prefix":"/orders"},"require_key":true,"key":{"json":"/order_id"}},
    {"name":"soft","match":{"prefix":"/soft"},"key":{"json":"/order/id"}},
    {"name":"rid","match":{"prefix":"/rid"},"key":{"header":"x-request-id"}},
    {"name":"legacy","match":{"prefix":"/legacy"},"key":{"fingerprint":{"window":"3s"}}},
    {"name":"plain","match":{"prefix":"/plain"}}]}"#;

/// One POST to `path` with `headers` besides the pseudo-headers and `body`: what the filter
/// did with it. `Some(status)`: answered locally; None: forwarded, and the upstream answered
/// 201 with `answer`, which the filter saw through.
pub(super) fn send(
    h: &FakeHost,
    root: &Root<FakeHost>,
    context: u32,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<u16> {
    let before = h.0.calls.borrow().len();
    let mut http = root.http_context(context);
    let mut all = vec![(":method", "POST"), (":path", path), ("content-type", "application/json")];
    all.extend_from_slice(headers);
    *h.0.request_headers.borrow_mut() = pairs(&all);
    *h.0.request_body.borrow_mut() = body.as_bytes().to_vec();
    let verdict = match http.on_request_headers(body.is_empty()) {
        Verdict::Pause if !body.is_empty() => http.on_request_body(body.len(), true),
        v => v,
    };
    let reply = h.0.calls.borrow()[before..].iter().find_map(|c| match c {
        HostCall::SendResponse { status, body, .. } => Some((*status, body.clone())),
        _ => None,
    });
    if let Some((status, body)) = reply {
        assert_eq!(verdict, Verdict::Pause);
        h.0.properties.borrow_mut().insert(format!("reply.{context}"), body);
        return Some(status);
    }
    assert_eq!(verdict, Verdict::Continue, "{path} {body}");
    let answer = format!("{{\"n\":{context}}}");
    upstream_answers(h, "201", answer.as_bytes());
    assert_eq!(http.on_response_headers(false), Verdict::Continue);
    assert_eq!(http.on_response_body(answer.len(), true), Verdict::Continue);
    http.on_log();
    None
}

fn published(h: &FakeHost) -> Vec<String> {
    super::filter_states(h, "idempotency.outcome")
}

/// The body of the reply the filter sent on `context` (kept by `send`).
pub(super) fn reply_body(h: &FakeHost, context: u32) -> String {
    let kept = h.0.properties.borrow().get(&format!("reply.{context}")).cloned().unwrap_or_default();
    String::from_utf8_lossy(&kept).into_owned()
}

#[test]
fn a_business_number_in_the_body_is_the_key() {
    let h = host_with(ROUTES);
    let root = root(&h);
    assert_eq!(send(&h, &root, 2, "/orders", &[], r#"{"order_id":"A-1","amount":5}"#), None);
    // The same order and body, members in another order: the first answer, byte for byte.
    assert_eq!(send(&h, &root, 3, "/orders", &[], r#"{"amount":5,"order_id":"A-1"}"#), Some(201));
    assert_eq!(reply_body(&h, 3), "{\"n\":2}");
    // The same order with another body: refused, never executed.
    assert_eq!(send(&h, &root, 4, "/orders", &[], r#"{"order_id":"A-1","amount":6}"#), Some(422));
    // No order id, with require_key: 400 naming where the key was looked for.
    assert_eq!(send(&h, &root, 5, "/orders", &[], r#"{"amount":5}"#), Some(400));
    assert!(reply_body(&h, 5).contains("at /order_id in the JSON body"), "{}", reply_body(&h, 5));
    assert!(reply_body(&h, 5).contains("missing-key"));
    assert_eq!(send(&h, &root, 6, "/orders", &[], "not json"), Some(400));
    assert_eq!(send(&h, &root, 7, "/orders", &[], r#"{"order_id":true}"#), Some(400));
    assert!(reply_body(&h, 7).contains("invalid-key"));
    // A key header is not this rule's key: its body decides.
    assert_eq!(send(&h, &root, 8, "/orders", &[("idempotency-key", "A-1")], r#"{"order_id":"B-2"}"#), None);
    assert_eq!(h.counter("claimed"), 2);
    assert_eq!(h.counter("replayed"), 1);
    assert_eq!(h.counter("key_from_json"), 4);
    let values = published(&h);
    assert!(
        values.first().is_some_and(|v| v.starts_with("claimed ") && v.ends_with(" key=json")),
        "{values:?}"
    );
}

#[test]
fn a_body_without_the_key_passes_through_unless_the_rule_requires_one() {
    let h = host_with(ROUTES);
    let root = root(&h);
    // The rule does not require a key: a body without it is forwarded, each time, unclaimed.
    for context in [2, 3] {
        assert_eq!(send(&h, &root, context, "/soft", &[], r#"{"order":{}}"#), None);
    }
    assert_eq!(send(&h, &root, 4, "/soft", &[], "<xml/>"), None);
    assert_eq!(h.counter("passed_through"), 3);
    assert_eq!(h.counter("claimed"), 0);
    // A request with no body at all is one without the key.
    assert_eq!(send(&h, &root, 5, "/soft", &[], ""), None);
    // A nested business number is found, and 42 and "42" are one intent: another body, 422.
    assert_eq!(send(&h, &root, 6, "/soft", &[], r#"{"order":{"id":42}}"#), None);
    assert_eq!(send(&h, &root, 7, "/soft", &[], r#"{"order":{"id":"42"}}"#), Some(422));
}

#[test]
fn each_source_is_its_own_record() {
    let h = host_with(ROUTES);
    let root = root(&h);
    // The header "42" and the body's 42 on one path would be one record if the source were not
    // in the scope; here they are two, each executed once.
    assert_eq!(send(&h, &root, 2, "/rid", &[("x-request-id", "42")], "{}"), None);
    assert_eq!(send(&h, &root, 3, "/rid", &[("x-request-id", "42")], "{}"), Some(201));
    assert_eq!(send(&h, &root, 4, "/rid", &[("idempotency-key", "42")], "{}"), None);
    assert_eq!(send(&h, &root, 5, "/plain", &[("idempotency-key", "42")], "{}"), None);
    assert_eq!(send(&h, &root, 6, "/plain", &[("x-request-id", "42")], "{}"), None);
    assert_eq!(h.counter("claimed"), 2);
    assert_eq!(h.counter("key_from_header"), 2);
    assert_eq!(h.counter("passed_through"), 2);
    // A repeated or malformed own header: 400 naming the header.
    assert_eq!(send(&h, &root, 7, "/rid", &[("x-request-id", "a b")], "{}"), Some(400));
    assert!(reply_body(&h, 7).contains("in the header x-request-id"), "{}", reply_body(&h, 7));
}

#[test]
fn a_fingerprint_window_replays_a_repeat_and_forgets_it_after() {
    let h = host_with(ROUTES);
    let root = root(&h);
    let body = r#"{"to":"bob","amount":5}"#;
    assert_eq!(send(&h, &root, 2, "/legacy", &[], body), None);
    h.0.now_ms.set(3_500);
    assert_eq!(send(&h, &root, 3, "/legacy", &[], body), Some(201));
    assert_eq!(reply_body(&h, 3), "{\"n\":2}");
    // Another body is another key: it executes; no 422 exists here.
    assert_eq!(send(&h, &root, 4, "/legacy", &[], r#"{"to":"bob","amount":6}"#), None);
    // After the window the same body is a new intent.
    h.0.now_ms.set(4_100);
    assert_eq!(send(&h, &root, 5, "/legacy", &[], body), None);
    assert_eq!(h.counter("claimed"), 3);
    assert_eq!(h.counter("replayed"), 1);
    assert_eq!(h.counter("mismatch"), 0);
    assert_eq!(h.counter("key_from_fingerprint"), 4);
}
