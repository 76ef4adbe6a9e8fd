//! Wait mode with the local store: a duplicate held while its original runs is woken through
//! the root's queue and answered with the replay; one whose client left gets nothing and gives
//! back a claim its recheck got; one that cannot be resumed releases the claim it took over; and
//! the tick gives up on a waiter (409) once its wait timeout has passed.

use super::{host, original_and_waiter, post, root, upstream_answers};
use crate::worker::flow::Verdict;

/// C11: a retry held in wait mode gets the original's replay once it completes.
#[test]
fn a_woken_waiter_is_answered_with_the_replay() {
    let h = host();
    let mut root = root(&h);
    let (mut original, mut waiter) = original_and_waiter(&h, &root);
    upstream_answers(&h, "201", b"ok");
    original.on_response_headers(false);
    original.on_response_body(2, true);
    root.on_queue_ready(0);
    assert_eq!(h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
    assert_eq!(h.counter("replayed"), 1);
    // The replay passes the waiter's encode callbacks: not captured as an upstream answer. The
    // root let the waiter's flow go before it sent the reply, so the flow reads it as ours.
    assert_eq!(waiter.on_response_headers(true), Verdict::Continue);
    assert_eq!(h.counter("stored"), 1);
    drop((original, waiter));
    assert_eq!(root.flows_kept(), 0);
}

#[test]
fn a_waiter_whose_client_left_gets_nothing() {
    let h = host();
    let mut root = root(&h);
    let (mut original, _waiter) = original_and_waiter(&h, &root);
    upstream_answers(&h, "201", b"ok");
    original.on_response_headers(false);
    original.on_response_body(2, true);
    h.fail("set_effective_context", 1);
    root.on_queue_ready(0);
    assert!(h.replies().is_empty());
    assert_eq!(h.counter("replayed"), 0);
}

/// Its recheck claimed the record (the original was released) after its client left: nobody will
/// forward it, so the claim is given back at once rather than blocking the key until its lease
/// ends.
#[test]
fn a_waiter_whose_client_left_gives_back_the_claim_its_recheck_got() {
    let h = host();
    let mut root = root(&h);
    let (mut original, _waiter) = original_and_waiter(&h, &root);
    upstream_answers(&h, "503", b"");
    original.on_response_headers(true);
    h.fail("set_effective_context", 1);
    root.on_queue_ready(0);
    assert!(h.replies().is_empty());
    assert_eq!((h.counter("claimed"), h.counter("released")), (1, 2));
    let mut next = root.http_context(4);
    assert_eq!(post(&h, &mut next, "/wait", "w"), Verdict::Continue);
    assert_eq!(h.counter("claimed"), 2);
}

#[test]
fn a_waiter_that_cannot_be_resumed_releases_its_claim() {
    let h = host();
    let mut root = root(&h);
    let (mut original, _waiter) = original_and_waiter(&h, &root);
    // The upstream answers 503: released, so the waiter becomes the owner.
    upstream_answers(&h, "503", b"");
    original.on_response_headers(true);
    assert_eq!(h.counter("released"), 1);
    h.fail("resume_request", 1);
    root.on_queue_ready(0);
    assert_eq!(h.counter("claimed"), 2);
    // Its claim was released: the next request claims instead of being told to wait.
    let mut next = root.http_context(4);
    assert_eq!(post(&h, &mut next, "/wait", "w"), Verdict::Continue);
    assert_eq!(h.counter("claimed"), 3);
}

/// C11: a held retry gets 409 once its `wait_timeout` has passed.
#[test]
fn the_tick_sweeps_and_gives_up_on_waiters_after_their_timeout() {
    let h = host();
    let mut root = root(&h);
    let (_original, _waiter) = original_and_waiter(&h, &root);
    h.0.now_ms.set(1_000 + 10_001);
    root.on_tick();
    assert_eq!(h.replies(), vec![(3, 409, "idempotency_problem".to_string())]);
    assert_eq!(h.counter("wait_timed_out"), 1);
}
