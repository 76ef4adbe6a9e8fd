//! The worker with a store across the network (a scripted `store::seam::Store`, one callout per
//! operation): a stream's `begin` and its settlements are the root's callouts while the stream
//! stays paused, and every way a callout can fail: a missing cluster, an answer without status
//! or a timeout fail closed (503) or, failing open, forward unprotected and are counted; a claim
//! answered after its client left, or for a request that cannot be resumed, is released; a
//! completion the store failed is tried again with backoff until it lands or its lease has
//! passed; a retired root finishes (or, at its bound, abandons and counts) its completions
//! before it tells Envoy it is done.

use super::{last_token, pairs, Begins, Scripted, Sent};
use crate::config::etcd::OnStoreError;
use crate::host::fake::{FakeHost, HostCall};
use crate::store::remote::RemoteSettings;
use crate::store::StoreOp;
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;
use std::cell::RefCell;
use std::rc::Rc;

const CONFIG: &str = r#"{"routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#;

fn host() -> FakeHost {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().push("etcd".into());
    h
}

fn root(h: &FakeHost, cluster: &str, on_error: OnStoreError) -> Root<FakeHost> {
    root_with_ops(h, cluster, on_error).0
}

/// The root, and every operation its store was asked to start.
fn root_with_ops(
    h: &FakeHost,
    cluster: &str,
    on_error: OnStoreError,
) -> (Root<FakeHost>, Rc<RefCell<Vec<StoreOp>>>) {
    let mut root = Root::new(1, h.clone());
    let settings = RemoteSettings {
        cluster: cluster.into(),
        authority: "store".into(),
        timeout_ms: 250,
        on_error,
        protocol: Default::default(),
    };
    let ops = Rc::new(RefCell::new(Vec::new()));
    let store = Scripted { settings, ops: Rc::clone(&ops), begins: Begins::default(), watch: None };
    assert!(root.on_configure_with(Some(Box::new(store))));
    (root, ops)
}

fn post(h: &FakeHost, http: &mut Http<FakeHost>) -> Verdict {
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    http.on_request_body(2, true)
}

/// What the next `on_http_call_response` reads: a status (None: Envoy's failure report,
/// no `:status`) and a body.
fn store_answers(h: &FakeHost, status: Option<&str>, body: &[u8]) {
    *h.0.call_response_headers.borrow_mut() = status.map(|s| pairs(&[(":status", s)])).unwrap_or_default();
    *h.0.call_response_body.borrow_mut() = body.to_vec();
}

fn resumed(h: &FakeHost) -> usize {
    h.0.calls.borrow().iter().filter(|c| matches!(c, HostCall::Resume { .. })).count()
}

fn problem_reply(h: &FakeHost) -> Sent {
    h.0.calls
        .borrow()
        .iter()
        .rev()
        .find_map(|c| match c {
            HostCall::SendResponse { status, headers, body, .. } => {
                Some((*status, headers.clone(), body.clone()))
            }
            _ => None,
        })
        .expect("a reply")
}

fn assert_store_unavailable(h: &FakeHost) {
    let (status, headers, body) = problem_reply(h);
    assert_eq!(status, 503);
    assert!(headers.iter().any(|(n, _)| n == "retry-after"), "{headers:?}");
    assert!(String::from_utf8_lossy(&body).contains("store-unavailable"));
    assert_eq!(resumed(h), 0, "nothing may be forwarded");
    assert_eq!(h.counter("store_error"), 1);
}

/// A protected POST up to its `begin`, which the root starts from its queue callback (the
/// root's own context is the effective one there); returns the callout's token.
fn begin(h: &FakeHost, root: &mut Root<FakeHost>, http: &mut Http<FakeHost>) -> Option<u32> {
    assert_eq!(post(h, http), Verdict::Pause);
    let before = h.dispatches().len();
    h.0.effective.set(1);
    root.on_queue_ready(0);
    (h.dispatches().len() > before).then(|| last_token(h))
}

#[test]
fn begin_is_the_roots_callout_while_the_request_stays_paused_and_its_answer_resumes_it() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    assert_eq!(post(&h, &mut http), Verdict::Pause);
    assert!(h.dispatches().is_empty(), "not from the stream's callback");
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let dispatches = h.dispatches();
    let [HostCall::Dispatch { context: 1, token, cluster, headers, timeout_ms: 250, .. }] =
        dispatches.as_slice()
    else {
        panic!("{dispatches:?}")
    };
    assert_eq!(cluster, "etcd");
    for pseudo in [":method", ":path", ":authority"] {
        assert!(headers.iter().any(|(n, _)| n == pseudo));
    }
    // The authority the store's settings name, whatever the cluster is called.
    assert!(headers.iter().any(|(n, v)| n == ":authority" && v == "store"), "{headers:?}");
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(*token, 2);
    assert_eq!(h.0.calls.borrow().last(), Some(&HostCall::Resume { context: 2 }));
    assert_eq!(h.counter("claimed"), 1);
    // The stream has its flow back: the response is captured and completed.
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    assert_eq!(http.on_response_headers(true), Verdict::Pause);
}

/// A claimed request the root cannot resume (its stream is going away) sent nothing upstream:
/// its claim is given back at once, not left to block the key until its lease ends.
#[test]
fn a_claimed_request_the_root_cannot_resume_gives_its_claim_back() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    h.fail("resume_request", 1);
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(token, 2);
    assert_eq!(h.counter("claimed"), 1);
    assert_eq!(releases(&ops, 0), 1);
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!(h.counter("released"), 1);
    // The stream's end finds nothing more to settle.
    http.on_log();
    h.0.effective.set(1);
    root.on_queue_ready(0);
    assert_eq!(releases(&ops, 0), 1);
    assert_eq!(ops.borrow().len(), 2, "{:?}", ops.borrow());
}

/// C19: a store Envoy cannot call (no such cluster) fails closed: 503 `store-unavailable` with
/// `retry-after`, nothing forwarded.
#[test]
fn a_missing_cluster_refuses_the_callout_and_fails_closed_with_503() {
    let h = host();
    let mut root = root(&h, "no-such-cluster", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    assert_eq!(begin(&h, &mut root, &mut http), None);
    assert_store_unavailable(&h);
    assert_eq!(h.replies()[0].0, 2, "the reply goes to the request, not the root");
}

/// C19: a store callout that fails (no status) fails closed: 503 `store-unavailable`.
#[test]
fn an_answer_without_status_fails_closed() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    store_answers(&h, None, b"");
    root.on_http_call_response(token, 0);
    assert_store_unavailable(&h);
}

/// C19: a store that does not answer in time fails closed: 503 `store-unavailable`.
#[test]
fn a_timeout_fails_closed_and_a_late_answer_is_ignored() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    store_answers(&h, Some("504"), b"upstream request timeout");
    root.on_http_call_response(token, 24);
    assert_store_unavailable(&h);
    let calls = h.0.calls.borrow().len();
    // A second answer for the same token, or one for a token nobody awaits: nothing happens.
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(token, 2);
    root.on_http_call_response(token + 41, 2);
    assert_eq!(h.0.calls.borrow().len(), calls);
    assert_eq!((h.counter("claimed"), h.counter("store_error")), (0, 1));
}

/// The releases the store was asked for since `from`.
fn releases(ops: &Rc<RefCell<Vec<StoreOp>>>, from: usize) -> usize {
    ops.borrow()[from..].iter().filter(|op| matches!(op, StoreOp::Release(_))).count()
}

/// C19: the client of a claim whose answer was lost gets 503 `store-unavailable`, nothing
/// forwarded.
#[test]
fn a_claim_whose_answer_was_lost_is_given_back_while_the_client_gets_503() {
    // Envoy's timeout, or a failed callout: the claim's write went out and may have landed,
    // yet nobody will forward the request. Left alone it would block the key until its lease
    // ended, and then, on a rule that refuses unknown outcomes, read as one (502) for the ttl.
    for (status, body) in [(Some("504"), &b"upstream request timeout"[..]), (None, &b""[..])] {
        let h = host();
        let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
        let mut http = root.http_context(2);
        let token = begin(&h, &mut root, &mut http).expect("a callout");
        store_answers(&h, status, body);
        root.on_http_call_response(token, body.len());
        assert_store_unavailable(&h);
        let [StoreOp::Begin(ref a), StoreOp::Release(claim)] = ops.borrow().clone()[..] else {
            panic!("{:?}", ops.borrow())
        };
        assert_eq!((claim.scope, claim.owner), (a.scope, a.owner));
        // Given back from the root, counted when the store answers.
        let release = last_token(&h);
        assert_ne!(release, token);
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(release, 2);
        assert_eq!((h.counter("released"), h.counter("store_error")), (1, 1), "{status:?}");
    }
}

#[test]
fn an_unanswered_claim_is_given_back_failing_open_or_with_the_client_gone_and_tried_again() {
    // Failing open: the request goes on unprotected; the claim nobody holds is given back.
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailOpen);
    let mut http = root.http_context(2);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    store_answers(&h, Some("504"), b"");
    root.on_http_call_response(token, 0);
    assert_eq!(h.counter("store_bypassed"), 1);
    assert_eq!(releases(&ops, 0), 1);
    // The client left while the claim's answer was late.
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    http.on_log();
    drop(http);
    h.fail("set_effective_context", 2);
    store_answers(&h, Some("504"), b"");
    root.on_http_call_response(token, 0);
    assert_eq!(releases(&ops, 0), 1);
    // A release the store failed too is tried again, as any settlement.
    store_answers(&h, Some("504"), b"");
    root.on_http_call_response(last_token(&h), 0);
    h.0.now_ms.set(h.0.now_ms.get() + 150);
    root.on_tick();
    assert_eq!(releases(&ops, 0), 2);
}

#[test]
fn a_lost_claim_is_left_to_its_lease_while_the_store_fails_many_settlements() {
    // 256 completions the store failed are being tried again: a struggling store gets no
    // give-backs on top of them.
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    for id in 0..256 {
        let mut http = forwarded(&h, &mut root, 10 + id, "201");
        *h.0.response_body.borrow_mut() = b"{}".to_vec();
        http.on_response_headers(false);
        assert_eq!(http.on_response_body(2, true), Verdict::Pause);
        h.0.effective.set(1);
        root.on_queue_ready(0);
        store_answers(&h, Some("500"), b"");
        root.on_http_call_response(last_token(&h), 0);
    }
    let before = ops.borrow().len();
    let mut http = root.http_context(999);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    store_answers(&h, Some("504"), b"upstream request timeout");
    root.on_http_call_response(token, 24);
    assert_eq!(releases(&ops, before), 0, "{:?}", &ops.borrow()[before..]);
    // The store recovers: the completions are tried again and land, and the next lost claim
    // is given back again.
    let sent = h.dispatches().len();
    h.0.now_ms.set(h.0.now_ms.get() + 150);
    root.on_tick();
    let retried: Vec<u32> = h.dispatches()[sent..]
        .iter()
        .filter_map(|c| match c {
            HostCall::Dispatch { token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(retried.len(), 256);
    store_answers(&h, Some("200"), b"{}");
    for token in retried {
        root.on_http_call_response(token, 2);
    }
    assert_eq!(h.counter("stored"), 256);
    let before = ops.borrow().len();
    let mut http = root.http_context(1_000);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    store_answers(&h, Some("504"), b"upstream request timeout");
    root.on_http_call_response(token, 24);
    assert_eq!(releases(&ops, before), 1);
}

#[test]
fn a_callout_envoy_refused_claimed_nothing_and_gives_nothing_back() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "no-such-cluster", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    assert_eq!(begin(&h, &mut root, &mut http), None);
    assert_store_unavailable(&h);
    assert_eq!(releases(&ops, 0), 0, "{:?}", ops.borrow());
}

/// C19: with `on_error: fail_open` a store that cannot be used lets the request go on
/// unprotected, counted, instead of a 503.
#[test]
fn fail_open_forwards_unprotected_and_counts_every_bypass() {
    let h = host();
    let mut root = root(&h, "no-such-cluster", OnStoreError::FailOpen);
    for id in [2, 3] {
        let mut http = root.http_context(id);
        begin(&h, &mut root, &mut http);
    }
    assert_eq!(resumed(&h), 2);
    assert_eq!((h.counter("store_bypassed"), h.counter("store_error")), (2, 0));
    assert!(h.replies().is_empty());
    // A timeout resumes the paused request.
    let h = host();
    let mut root = self::root(&h, "etcd", OnStoreError::FailOpen);
    let mut timed_out = root.http_context(4);
    let token = begin(&h, &mut root, &mut timed_out).expect("a callout");
    store_answers(&h, Some("504"), b"");
    root.on_http_call_response(token, 0);
    assert_eq!(h.0.calls.borrow().last(), Some(&HostCall::Resume { context: 4 }));
    assert_eq!((h.counter("store_bypassed"), h.counter("store_error")), (1, 0));
    assert!(h.replies().is_empty());
}

#[test]
fn a_claim_answered_after_the_client_left_is_released_at_once() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    let token = begin(&h, &mut root, &mut http).expect("a callout");
    http.on_log(); // the client went away while the request was paused
    drop(http);
    assert_eq!(root.flows_kept(), 1, "the root's begin holds the flow");
    h.fail("set_effective_context", 2);
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(token, 2);
    assert_eq!(root.flows_kept(), 0, "the flow ended with the root's work");
    assert!(matches!(ops.borrow().last(), Some(StoreOp::Release(_))), "{:?}", ops.borrow());
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!((h.counter("claimed"), h.counter("released")), (0, 1));
    assert!(!h
        .0
        .calls
        .borrow()
        .iter()
        .any(|c| matches!(c, HostCall::Resume { .. } | HostCall::SendResponse { .. })));
}

/// A stream whose `begin` was answered with a claim, its response headers in.
fn forwarded(h: &FakeHost, root: &mut Root<FakeHost>, id: u32, status: &str) -> Http<FakeHost> {
    let mut http = root.http_context(id);
    let token = begin(h, root, &mut http).expect("a callout");
    store_answers(h, Some("200"), b"{}");
    root.on_http_call_response(token, 2);
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", status)]);
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    http
}

#[test]
fn the_root_counts_a_remote_requests_outcomes_under_its_rule() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let mut http = forwarded(&h, &mut root, 2, "201");
    assert_eq!((h.counter("claimed"), h.route_counter("orders", "claimed")), (1, 1));
    *h.0.response_body.borrow_mut() = b"{}".to_vec();
    http.on_response_headers(false);
    assert_eq!(http.on_response_body(2, true), Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!((h.counter("stored"), h.route_counter("orders", "stored")), (1, 1));
}

#[test]
fn the_body_is_held_while_copied_and_each_frame_read_once() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let mut http = forwarded(&h, &mut root, 2, "201");
    // Envoy's buffer keeps held frames: each callback's size counts them all.
    *h.0.response_body.borrow_mut() = b"abcdef".to_vec();
    assert_eq!(http.on_response_headers(false), Verdict::Continue);
    assert_eq!(http.on_response_body(3, false), Verdict::Pause);
    assert_eq!(http.on_response_body(6, false), Verdict::Pause);
    assert_eq!(http.on_response_body(6, true), Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!(h.0.calls.borrow().last(), Some(&HostCall::ResumeResponse { context: 2 }));
    let ops = ops.borrow();
    let Some(StoreOp::Complete { completion, .. }) = ops.last() else { panic!("{ops:?}") };
    let snapshot = completion.snapshot.as_ref().expect("kept with its body");
    assert_eq!(snapshot.body, b"abcdef");
}

#[test]
fn the_completion_is_dispatched_by_the_root_and_survives_the_end_of_its_stream() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let mut http = forwarded(&h, &mut root, 2, "201");
    *h.0.response_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_response_headers(false), Verdict::Continue);
    // The end of the response waits for the record to be written.
    assert_eq!(http.on_response_body(2, true), Verdict::Pause);
    // Not dispatched by the stream: handed to the root, which is woken through its queue.
    let dispatched = h.dispatches().len();
    h.0.effective.set(1);
    root.on_queue_ready(0);
    assert_eq!(h.dispatches().len(), dispatched + 1);
    assert!(matches!(h.dispatches().last(), Some(HostCall::Dispatch { context: 1, .. })));
    assert_eq!(h.counter("stored"), 0);
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!(h.counter("stored"), 1);
    assert_eq!(h.0.calls.borrow().last(), Some(&HostCall::ResumeResponse { context: 2 }));

    // The stream is gone before the store answers (its client left): the root still
    // counts the outcome, and resumes nothing.
    let mut gone = forwarded(&h, &mut root, 3, "201");
    gone.on_response_headers(false);
    assert_eq!(gone.on_response_body(2, true), Verdict::Pause);
    gone.on_log();
    drop(gone);
    root.on_queue_ready(0);
    h.fail("set_effective_context", 2);
    let calls = h.0.calls.borrow().len();
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!(h.counter("stored"), 2);
    assert_eq!(h.0.calls.borrow().len(), calls, "nothing resumed");
}

#[test]
fn without_a_queue_the_tick_starts_what_streams_hand_over() {
    let h = host();
    h.fail("register_queue", 1);
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    assert_eq!(post(&h, &mut http), Verdict::Pause);
    assert!(h.dispatches().is_empty());
    root.on_tick();
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!(resumed(&h), 1);
    // A failed release goes on at once, and is tried again at a later tick.
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "500")]);
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    assert_eq!(http.on_response_headers(true), Verdict::Pause);
    root.on_tick();
    store_answers(&h, None, b"");
    root.on_http_call_response(last_token(&h), 0);
    assert!(matches!(h.0.calls.borrow().last(), Some(HostCall::ResumeResponse { .. })));
    let dispatched = h.dispatches().len();
    h.0.now_ms.set(h.0.now_ms.get() + 100);
    root.on_tick();
    assert_eq!(h.dispatches().len(), dispatched + 1);
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!((h.counter("released"), h.counter("store_error")), (1, 0));
}

/// A forwarded request whose 201 has come back whole: its completion is the root's
/// callout now (returned: its token).
fn completing(h: &FakeHost, root: &mut Root<FakeHost>, id: u32) -> (Http<FakeHost>, u32) {
    let mut http = forwarded(h, root, id, "201");
    *h.0.response_body.borrow_mut() = b"{}".to_vec();
    http.on_response_headers(false);
    assert_eq!(http.on_response_body(2, true), Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    (http, last_token(h))
}

fn at(h: &FakeHost, root: &mut Root<FakeHost>, now_ms: u64) {
    h.0.now_ms.set(now_ms);
    root.on_tick();
}

#[test]
fn a_completion_the_store_failed_is_tried_again_with_backoff_until_it_lands() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let (_http, token) = completing(&h, &mut root, 2);
    // Envoy timed the callout out: the client gets its response now, nothing is counted.
    store_answers(&h, Some("504"), b"upstream request timeout");
    root.on_http_call_response(token, 24);
    assert_eq!(h.0.calls.borrow().last(), Some(&HostCall::ResumeResponse { context: 2 }));
    assert_eq!((h.counter("stored"), h.counter("store_error")), (0, 0));
    // Tried again after 100 ms, then 200 ms, as a new conversation of the same completion.
    let dispatched = h.dispatches().len();
    at(&h, &mut root, 1_050);
    assert_eq!(h.dispatches().len(), dispatched, "not due yet");
    at(&h, &mut root, 1_100);
    assert_eq!(h.dispatches().len(), dispatched + 1);
    store_answers(&h, None, b"");
    root.on_http_call_response(last_token(&h), 0);
    at(&h, &mut root, 1_250);
    assert_eq!(h.dispatches().len(), dispatched + 1, "backoff doubled");
    at(&h, &mut root, 1_300);
    assert_eq!(h.dispatches().len(), dispatched + 2);
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!((h.counter("stored"), h.counter("settlement_abandoned")), (1, 0));
    let completions: Vec<StoreOp> =
        ops.borrow().iter().filter(|op| matches!(op, StoreOp::Complete { .. })).cloned().collect();
    assert_eq!(completions.len(), 3);
    assert!(completions.iter().all(|op| *op == completions[0]), "the same completion each time");
    // Nothing left to try.
    at(&h, &mut root, 10_000);
    assert_eq!(h.dispatches().len(), dispatched + 2);
    assert_eq!(h.0.calls.borrow().iter().filter(|c| matches!(c, HostCall::ResumeResponse { .. })).count(), 1);
}

/// The claims renewed so far (`idempotency.claims_renewed_total`).
fn renewed(h: &FakeHost) -> i64 {
    h.plain_counter(crate::metrics::RENEWED_METRIC).unwrap_or(-1)
}

/// Runs `root`'s ticks every 100 ms from `from_ms` to `until_ms`, each callout answered at once
/// with the status `status` gives its operation (None: the call failed): when the last
/// completion was tried, and how often it was.
fn ticks_answering(
    h: &FakeHost,
    root: &mut Root<FakeHost>,
    ops: &Rc<RefCell<Vec<StoreOp>>>,
    (from_ms, until_ms): (u64, u64),
    status: impl Fn(&StoreOp) -> Option<&'static str>,
) -> (u64, usize) {
    let completions = || ops.borrow().iter().filter(|op| matches!(op, StoreOp::Complete { .. })).count();
    let (mut now, mut last) = (from_ms, 0);
    while now < until_ms {
        now += 100;
        let before = (ops.borrow().len(), completions());
        at(h, root, now);
        if completions() > before.1 {
            last = now;
        }
        // Each operation of the scripted store is one call, answered in the order made.
        for i in before.0..ops.borrow().len() {
            let answer = status(&ops.borrow()[i]);
            store_answers(h, answer, if answer.is_some() { b"{}" } else { b"" });
            root.on_http_call_response(last_token(h), if answer.is_some() { 2 } else { 0 });
        }
    }
    (last, completions())
}

#[test]
fn a_completion_is_tried_until_its_lease_ended_a_processing_timeout_ago_then_abandoned() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    // Claimed at 1 s with the default processing_timeout, 30 s: its lease ends at 31 s.
    let (_http, token) = completing(&h, &mut root, 2);
    store_answers(&h, None, b"");
    root.on_http_call_response(token, 0);
    let (last, tries) = ticks_answering(&h, &mut root, &ops, (1_000, 70_000), |_| None);
    assert_eq!(h.counter("settlement_abandoned"), 1);
    assert_eq!(h.route_counter("orders", "settlement_abandoned"), 1);
    assert_eq!((h.counter("stored"), h.counter("store_error")), (0, 0));
    // Tried until 61 s, one processing_timeout past its lease's end (its lease key, by etcd's
    // clock, outlives that: nobody can take it over meanwhile), not only 30 s after the first
    // failure: 100, 200, 400, 800, 1600 ms, then every 2 s. The store that fails its completion
    // fails the renewals of its claim too, which so ends where it did.
    assert!((59_000..61_000).contains(&last), "last try at {last} ms");
    assert!((30..=35).contains(&tries), "{tries} tries");
    let renewals = ops.borrow().iter().filter(|op| matches!(op, StoreOp::Renew(_))).count();
    assert!(renewals > 0 && renewed(&h) == 0, "{renewals} renewals");
}

#[test]
fn a_completion_whose_claim_is_renewed_meanwhile_is_tried_a_lease_past_its_last_renewal() {
    let h = host();
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let (_http, token) = completing(&h, &mut root, 2);
    store_answers(&h, None, b"");
    root.on_http_call_response(token, 0);
    // The completion keeps failing while the claim's renewals land: its owner is still at work,
    // so it keeps its claim and its tries go on past 61 s, where an unrenewed claim's end.
    let renewals_only = |op: &StoreOp| matches!(op, StoreOp::Renew(_)).then_some("200");
    let (last, _) = ticks_answering(&h, &mut root, &ops, (1_000, 90_000), renewals_only);
    assert!(renewed(&h) >= 2, "renewed {}", renewed(&h));
    assert!(last > 86_000, "last try at {last} ms");
    assert_eq!(h.counter("settlement_abandoned"), 0);
    // Then it lands, and the claim is let go: nothing more is renewed.
    ticks_answering(&h, &mut root, &ops, (90_000, 93_000), |_| Some("200"));
    assert_eq!(h.counter("stored"), 1);
    let so_far = renewed(&h);
    ticks_answering(&h, &mut root, &ops, (93_000, 200_000), |_| Some("200"));
    assert_eq!(renewed(&h), so_far);
}

#[test]
fn a_retired_root_finishes_its_completions_before_it_tells_envoy_it_is_done() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    let (http, token) = completing(&h, &mut root, 2);
    drop(http);
    h.fail("set_effective_context", 2);
    // The configuration is replaced: Envoy must wait for the completion in flight.
    assert!(!root.on_done());
    assert!(!h.0.calls.borrow().contains(&HostCall::Done));
    at(&h, &mut root, 1_500);
    assert!(!h.0.calls.borrow().contains(&HostCall::Done));
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(token, 2);
    assert_eq!(h.counter("stored"), 1);
    assert_eq!(h.0.calls.borrow().iter().filter(|c| **c == HostCall::Done).count(), 1);
    // A root with nothing under way goes at once.
    let h = host();
    let mut idle = root_with_ops(&h, "etcd", OnStoreError::FailClosed).0;
    assert!(idle.on_done());
    assert!(!h.0.calls.borrow().contains(&HostCall::Done));
}

#[test]
fn a_retired_root_counts_what_it_abandons_at_its_bound() {
    let h = host();
    let mut root = root(&h, "etcd", OnStoreError::FailClosed);
    // A completion whose answer never comes back to the root.
    let _ = completing(&h, &mut root, 2);
    assert!(!root.on_done());
    // The bound: the longest processing_timeout (30 s) and two tries of 4 calls of 250 ms.
    at(&h, &mut root, 1_000 + 31_999);
    assert!(!h.0.calls.borrow().contains(&HostCall::Done));
    assert_eq!(h.counter("settlement_abandoned"), 0);
    at(&h, &mut root, 1_000 + 32_000);
    assert_eq!(h.0.calls.borrow().iter().filter(|c| **c == HostCall::Done).count(), 1);
    assert_eq!(h.counter("settlement_abandoned"), 1);
    assert_eq!(h.route_counter("orders", "settlement_abandoned"), 1);
    // Said once.
    at(&h, &mut root, 40_000);
    assert_eq!(h.0.calls.borrow().iter().filter(|c| **c == HostCall::Done).count(), 1);
}

/// Detached execution on a store across the network: the call's answer is written by the
/// root's carrier, and its client gets it only once the write is over (written, or failed
/// once and being tried again: the client is not kept waiting for the store to recover);
/// the write is tried again until it lands, and the reply passes its stream as ours.
#[test]
fn a_detached_answer_goes_out_once_its_write_is_over_and_the_write_is_tried_until_it_lands() {
    let h = host();
    *h.0.config.borrow_mut() = br#"{"routes":[{"name":"pay","match":{"prefix":"/orders"},"require_key":true,
        "execution":"detached","upstream_timeout":"4s"}]}"#
        .to_vec();
    h.0.clusters.borrow_mut().push("orders".into());
    h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
    let (mut root, ops) = root_with_ops(&h, "etcd", OnStoreError::FailClosed);
    let mut http = root.http_context(2);
    h.0.effective.set(2);
    let claim = begin(&h, &mut root, &mut http).expect("the claim's callout");
    // The call is made from the request's head as Envoy holds it (with its authority).
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/orders"), (":authority", "shop"), ("idempotency-key", "k")]);
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(claim, 2);
    // Claimed: the root makes the detached call at its next run.
    let before = h.dispatches().len();
    root.on_queue_ready(0);
    assert_eq!(h.dispatches().len(), before + 1, "the detached call");
    let replies = |h: &FakeHost| {
        h.0.calls.borrow().iter().filter(|c| matches!(c, HostCall::SendResponse { context: 2, .. })).count()
    };
    *h.0.call_response_headers.borrow_mut() =
        pairs(&[(":status", "201"), ("content-type", "text/plain"), ("x-envoy-upstream-service-time", "3")]);
    *h.0.call_response_body.borrow_mut() = b"paid".to_vec();
    root.on_http_call_response(last_token(&h), 4);
    assert!(matches!(ops.borrow().last(), Some(StoreOp::Complete { .. })), "{:?}", ops.borrow());
    assert_eq!(replies(&h), 0, "not before its record is written");
    // The store timed out: the client gets its answer now; the write is tried again.
    store_answers(&h, Some("504"), b"upstream request timeout");
    root.on_http_call_response(last_token(&h), 24);
    assert_eq!(replies(&h), 1);
    assert_eq!((h.counter("stored"), h.counter("store_error")), (0, 0));
    // The reply passes its stream as ours: nothing captured, nothing settled from the stream.
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "201"), ("content-type", "text/plain")]);
    h.0.effective.set(2);
    assert_eq!(http.on_response_headers(false), Verdict::Continue);
    assert_eq!(http.on_response_body(4, true), Verdict::Continue);
    http.on_log();
    let dispatched = h.dispatches().len();
    h.0.effective.set(1);
    at(&h, &mut root, 1_100);
    assert_eq!(h.dispatches().len(), dispatched + 1, "tried again");
    store_answers(&h, Some("200"), b"{}");
    root.on_http_call_response(last_token(&h), 2);
    assert_eq!((h.counter("stored"), h.counter("settlement_abandoned")), (1, 0));
    assert_eq!(replies(&h), 1, "answered once");
    let completions = ops.borrow().iter().filter(|op| matches!(op, StoreOp::Complete { .. })).count();
    assert_eq!(completions, 2);
}
