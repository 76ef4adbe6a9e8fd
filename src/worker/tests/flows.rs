//! The worker's flow table (`worker/flows.rs`): a request's flow stays in one place, keyed by its
//! stream, for as long as its stream or the root's work for it lasts, and not a moment longer;
//! while the root holds it, the stream's own callbacks leave it alone.

use super::{executed, host, original_and_waiter, post, root, upstream_answers};
use crate::host::fake::HostCall;
use crate::worker::flow::Verdict;

#[test]
fn a_flow_is_kept_while_its_stream_lasts_and_ends_with_it() {
    let h = host();
    let root = root(&h);
    // Unprotected: passed through at its headers, its flow inert, gone with its stream.
    let mut passing = root.http_context(2);
    *h.0.request_headers.borrow_mut() = super::pairs(&[(":method", "GET"), (":path", "/health")]);
    assert_eq!(passing.on_request_headers(true), Verdict::Continue);
    assert!(passing.inert());
    assert_eq!(root.flows_kept(), 1);
    drop(passing);
    assert_eq!(root.flows_kept(), 0);
    // Protected, executed and stored: gone once its stream is.
    executed(&h, &root, 3, "k", b"{}");
    assert_eq!((h.counter("stored"), root.flows_kept()), (1, 0));
    // Its replay too.
    let mut retry = root.http_context(4);
    assert_eq!(post(&h, &mut retry, "/orders", "k"), crate::worker::flow::Verdict::Pause);
    assert_eq!(root.flows_kept(), 1);
    drop(retry);
    assert_eq!((h.counter("replayed"), root.flows_kept()), (1, 0));
}

#[test]
fn a_waiters_flow_stays_put_in_the_room_and_ends_when_both_its_stream_and_the_room_are_done() {
    let h = host();
    let mut root = root(&h);
    let (mut original, mut waiter) = original_and_waiter(&h, &root);
    assert_eq!(root.flows_kept(), 2);
    // The root holds the waiter's flow: the stream's callbacks leave it alone (Envoy sends a
    // paused request none but its end; this one would otherwise be read as a response).
    upstream_answers(&h, "201", b"ok");
    assert_eq!(waiter.on_response_headers(false), Verdict::Continue);
    assert_eq!(h.counter("stored"), 0);
    // Its stream ends while it waits: the room lets it go, and the flow ends with both.
    waiter.on_log();
    assert_eq!(root.flows_kept(), 2, "its context is not deleted yet");
    drop(waiter);
    assert_eq!(root.flows_kept(), 1);
    // The original completes: its waiter is woken on no stream, and nothing is sent to it.
    original.on_response_headers(false);
    original.on_response_body(2, true);
    root.on_queue_ready(0);
    assert!(!h.0.calls.borrow().iter().any(|c| matches!(c, HostCall::SendResponse { .. })));
    original.on_log();
    drop(original);
    assert_eq!((h.counter("stored"), root.flows_kept()), (1, 0));
}
