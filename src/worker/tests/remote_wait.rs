//! Wait mode with a store across the network: waiters poll it (the root's callouts) with
//! backoff, are woken by this Envoy's completions, and resolve like local waiters.

use super::{last_token, pairs, Begins, Scripted};
use crate::config::etcd::{EtcdSettings, OnStoreError, Protocol};
use crate::host::fake::{FakeHost, HostCall};
use crate::metrics::WATCH_ENDED_METRIC;
use crate::store::etcd::watch::RecordWatch;
use crate::store::etcd::EtcdStore;
use crate::store::record::Snapshot;
use crate::store::remote::RemoteSettings;
use crate::store::{Begin, StoreOp};
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

const CONFIG: &str = r#"{"routes":[{"name":"w","match":{"prefix":"/orders"},"require_key":true,
    "concurrent":"wait","wait_timeout":"2s","processing_timeout":"30s"}]}"#;

struct Rig {
    h: FakeHost,
    root: Root<FakeHost>,
    ops: Rc<RefCell<Vec<StoreOp>>>,
    begins: Begins,
}

const IN_FLIGHT: Begin = Begin::InFlight { retry_after_ms: 30_000 };

fn rig(on_error: OnStoreError) -> Rig {
    rig_with(on_error, None)
}

/// A rig whose store watches records, as the etcd store does over gRPC (keys under `/idem/`).
fn watching_rig() -> Rig {
    let settings = EtcdSettings { protocol: Protocol::Grpc, ..crate::store::etcd::tests::settings(None) };
    rig_with(OnStoreError::FailClosed, Some(RecordWatch::new(Rc::new(EtcdStore::new(settings)), "etcd")))
}

fn rig_with(on_error: OnStoreError, watch: Option<RecordWatch>) -> Rig {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().push("etcd".into());
    let mut root = Root::new(1, h.clone());
    let settings = RemoteSettings {
        cluster: "etcd".into(),
        authority: "etcd".into(),
        timeout_ms: 250,
        on_error,
        protocol: Default::default(),
    };
    let ops = Rc::new(RefCell::new(Vec::new()));
    let begins: Begins = Rc::new(RefCell::new(VecDeque::new()));
    let store = Scripted { settings, ops: Rc::clone(&ops), begins: Rc::clone(&begins), watch };
    assert!(root.on_configure_with(Some(Box::new(store))));
    root.on_tick(); // advertises the wake queue, as Envoy's first tick does
    Rig { h, root, ops, begins }
}

fn answer(r: &mut Rig, status: Option<&str>) {
    *r.h.0.call_response_headers.borrow_mut() = status.map(|s| pairs(&[(":status", s)])).unwrap_or_default();
    *r.h.0.call_response_body.borrow_mut() = b"{}".to_vec();
    let token = last_token(&r.h);
    r.root.on_http_call_response(token, 2);
}

/// A protected POST whose `begin` the root makes; the store answers it with `begun`.
fn request(r: &mut Rig, id: u32, begun: Option<Begin>) -> Http<FakeHost> {
    let mut http = r.root.http_context(id);
    *r.h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
    *r.h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(2, true), Verdict::Pause);
    r.h.0.effective.set(1);
    r.root.on_queue_ready(0);
    r.begins.borrow_mut().extend(begun);
    answer(r, Some("200"));
    http
}

/// The original (context 2, forwarded) and a duplicate held waiting (context 3).
fn original_and_waiter(r: &mut Rig) -> (Http<FakeHost>, Http<FakeHost>) {
    pair(r, 2, 3)
}

fn pair(r: &mut Rig, original: u32, waiter: u32) -> (Http<FakeHost>, Http<FakeHost>) {
    let counts = |r: &Rig| (r.h.counter("claimed"), r.h.counter("waiting"), r.h.replies().len());
    let (claimed, waiting, replies) = counts(r);
    let o = request(r, original, None);
    let w = request(r, waiter, Some(IN_FLIGHT));
    assert_eq!(counts(r), (claimed + 1, waiting + 1, replies));
    (o, w)
}

fn begins_started(r: &Rig) -> usize {
    r.ops.borrow().iter().filter(|op| matches!(op, StoreOp::Begin(_))).count()
}

/// Ticks at `at_ms`; true when a recheck was dispatched.
fn tick_at(r: &mut Rig, at_ms: u64) -> bool {
    let before = begins_started(r);
    r.h.0.now_ms.set(at_ms);
    r.root.on_tick();
    begins_started(r) > before
}

fn resumes(h: &FakeHost, context: u32) -> usize {
    h.0.calls.borrow().iter().filter(|c| **c == HostCall::Resume { context }).count()
}

fn replay() -> Begin {
    Begin::Replay(Snapshot { status: 201, headers: vec![], body: b"done".to_vec() })
}

/// C11 on a remote store: a held retry gets the original's replay once it has completed.
#[test]
fn a_remote_waiter_polls_with_backoff_and_gets_the_replay() {
    let mut r = rig(OnStoreError::FailClosed);
    let (_original, mut waiter) = original_and_waiter(&mut r);
    // Polls 50 ms after parking, then 100, 200, 400, 800 ms after each answer (the tick
    // checks every 100 ms in Envoy; here it is driven at the exact times).
    let mut at = 1_000;
    for gap in [50, 100, 200, 400, 800] {
        assert!(!tick_at(&mut r, at + gap - 1), "not before {}", at + gap);
        assert!(tick_at(&mut r, at + gap), "at {}", at + gap);
        // While its recheck is in flight the waiter is not due again.
        assert!(!tick_at(&mut r, at + gap + 5_000 - 1_000 * 4));
        r.h.0.now_ms.set(at + gap);
        r.begins.borrow_mut().push_back(IN_FLIGHT);
        answer(&mut r, Some("200"));
        at += gap;
    }
    assert_eq!(at, 2_550);
    // The original completes (elsewhere): the next poll replays it to the waiter.
    assert!(!tick_at(&mut r, 2_999), "the give-up time caps the backoff");
    assert!(tick_at(&mut r, 3_000));
    r.begins.borrow_mut().push_back(replay());
    answer(&mut r, Some("200"));
    assert_eq!(r.h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
    assert_eq!(r.h.counter("replayed"), 1);
    // The replay passes the waiter's encode callbacks: not captured as an upstream answer.
    *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
    assert_eq!(waiter.on_response_headers(true), Verdict::Continue);
    let settlements = r.ops.borrow().iter().filter(|op| !matches!(op, StoreOp::Begin(_))).count();
    assert_eq!(settlements, 0);
}

/// C11 on a remote store: a held retry that finds the original released is forwarded, with a
/// claim of its own.
#[test]
fn a_remote_waiter_that_finds_the_record_released_becomes_the_owner() {
    let mut r = rig(OnStoreError::FailClosed);
    let (_original, mut waiter) = original_and_waiter(&mut r);
    assert!(tick_at(&mut r, 1_050));
    answer(&mut r, Some("200")); // nothing scripted: the recheck claims
    assert_eq!(resumes(&r.h, 3), 1);
    assert_eq!(r.h.counter("claimed"), 2);
    assert!(r.h.replies().is_empty());
    // It is forwarded with its claim: its response is stored by the root.
    *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
    r.h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    *r.h.0.response_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(waiter.on_response_headers(false), Verdict::Continue);
    assert_eq!(waiter.on_response_body(2, true), Verdict::Pause);
    r.root.on_queue_ready(0);
    assert!(matches!(r.ops.borrow().last(), Some(StoreOp::Complete { .. })));
}

/// C11 on a remote store: a held retry gets 409 at its `wait_timeout`.
#[test]
fn a_remote_waiter_gets_409_at_its_wait_timeout() {
    let mut r = rig(OnStoreError::FailClosed);
    let (_original, _waiter) = original_and_waiter(&mut r);
    assert!(tick_at(&mut r, 3_000));
    r.begins.borrow_mut().push_back(IN_FLIGHT);
    answer(&mut r, Some("200"));
    assert_eq!(r.h.replies(), vec![(3, 409, "idempotency_problem".to_string())]);
    assert_eq!(r.h.counter("wait_timed_out"), 1);
    assert!(!tick_at(&mut r, 10_000), "answered: no longer held");
}

#[test]
fn a_remote_waiter_whose_client_left_releases_the_claim_its_recheck_got() {
    let mut r = rig(OnStoreError::FailClosed);
    let (_original, mut waiter) = original_and_waiter(&mut r);
    assert!(tick_at(&mut r, 1_050));
    waiter.on_log(); // the client left while the recheck was in flight
    drop(waiter);
    answer(&mut r, Some("200")); // the recheck claims
    assert!(matches!(r.ops.borrow().last(), Some(StoreOp::Release(_))), "{:?}", r.ops.borrow());
    answer(&mut r, Some("200"));
    assert_eq!(r.h.counter("released"), 1);
    assert_eq!(resumes(&r.h, 3), 0);
    assert!(r.h.replies().is_empty());
    // A client that left before its poll is not polled for.
    let (_original, mut waiter) = pair(&mut r, 4, 5);
    waiter.on_log();
    assert!(!tick_at(&mut r, 5_000));
}

/// C19: a store failure while a retry is held fails closed: 503, nothing forwarded.
#[test]
fn a_store_failure_during_a_recheck_fails_closed_with_503() {
    let mut r = rig(OnStoreError::FailClosed);
    let (_original, _waiter) = original_and_waiter(&mut r);
    assert!(tick_at(&mut r, 1_050));
    answer(&mut r, None); // no :status: the callout failed
    let replies = r.h.replies();
    assert_eq!(replies.len(), 1);
    assert_eq!((replies[0].0, replies[0].1), (3, 503));
    assert_eq!(r.h.counter("store_error"), 1);
    assert_eq!(resumes(&r.h, 3), 0);
    // A refused callout is the same failure.
    let (_o, _w) = pair(&mut r, 4, 5);
    r.h.fail("dispatch_http_call", 1);
    r.h.0.now_ms.set(1_200);
    r.root.on_tick();
    assert_eq!(r.h.replies().last().map(|x| (x.0, x.1)), Some((5, 503)));
    assert_eq!(r.h.counter("store_error"), 2);
}

/// C19: with `on_error: fail_open` the held retry is forwarded unprotected instead, counted.
#[test]
fn a_store_failure_during_a_recheck_fails_open_unprotected_and_counted() {
    let mut r = rig(OnStoreError::FailOpen);
    let (_original, mut waiter) = original_and_waiter(&mut r);
    assert!(tick_at(&mut r, 1_050));
    answer(&mut r, Some("504")); // Envoy's timeout
    assert_eq!(resumes(&r.h, 3), 1);
    assert_eq!(r.h.counter("store_bypassed"), 1);
    assert!(r.h.replies().is_empty());
    // Forwarded without a claim: its response settles nothing.
    let ops = r.ops.borrow().len();
    *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
    r.h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    assert_eq!(waiter.on_response_headers(true), Verdict::Continue);
    r.root.on_queue_ready(0);
    assert_eq!(r.ops.borrow().len(), ops);
}

#[test]
fn a_completion_on_this_envoy_wakes_its_waiters_at_once() {
    let mut r = rig(OnStoreError::FailClosed);
    let (mut original, _waiter) = original_and_waiter(&mut r);
    // A poll is in flight when the original completes here.
    assert!(tick_at(&mut r, 1_050));
    let poll = last_token(&r.h);
    *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
    r.h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    *r.h.0.response_body.borrow_mut() = b"{}".to_vec();
    original.on_response_headers(false);
    assert_eq!(original.on_response_body(2, true), Verdict::Pause);
    r.root.on_queue_ready(0); // starts the completion
    answer(&mut r, Some("200")); // the completion is written: wakes this Envoy's waiters
    assert_eq!(r.h.counter("stored"), 1);
    let before = begins_started(&r);
    r.root.on_queue_ready(0);
    assert_eq!(begins_started(&r), before, "its recheck is still in flight: marked woken");
    // That poll read the record before the completion: it looks again at once.
    *r.h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "200")]);
    r.begins.borrow_mut().push_back(IN_FLIGHT);
    r.root.on_http_call_response(poll, 2);
    assert!(tick_at(&mut r, 1_050));
    r.begins.borrow_mut().push_back(replay());
    answer(&mut r, Some("200"));
    assert_eq!(r.h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
    // Woken while not checking: rechecked from the queue callback itself.
    let (mut original, _waiter) = pair(&mut r, 4, 5);
    original.on_response_headers(false);
    assert_eq!(original.on_response_body(2, true), Verdict::Pause);
    r.root.on_queue_ready(0);
    answer(&mut r, Some("200"));
    let before = begins_started(&r);
    r.root.on_queue_ready(0);
    assert_eq!(begins_started(&r), before + 1, "rechecked on the wake-up, before its poll time");
}

/// A WatchResponse as etcd encodes it: header, watch id, created, and `events` puts.
fn watch_response(id: u8, created: bool, events: usize) -> Vec<u8> {
    let mut out = vec![0x0a, 0x02, 0x18, 0x05];
    if id != 0 {
        out.extend_from_slice(&[0x10, id]);
    }
    if created {
        out.extend_from_slice(&[0x18, 0x01]);
    }
    for _ in 0..events {
        out.extend_from_slice(&[0x5a, 0x05, 0x12, 0x03, 0x0a, 0x01, b'k']);
    }
    out
}

/// The watch stream's message `message` arrives; true when it started a recheck.
fn watch_says(r: &mut Rig, token: u32, message: Vec<u8>) -> bool {
    let before = begins_started(r);
    let size = message.len();
    *r.h.0.grpc_message.borrow_mut() = message;
    r.root.on_grpc_receive(token, size);
    begins_started(r) > before
}

fn grpc_calls(h: &FakeHost) -> Vec<HostCall> {
    h.0.calls
        .borrow()
        .iter()
        .filter(|c| {
            matches!(c, HostCall::GrpcStream { .. } | HostCall::GrpcSend { .. } | HostCall::GrpcCancel { .. })
        })
        .cloned()
        .collect()
}

/// Ten ticks at `at_ms`: the root's once-a-second work runs among them.
fn second_at(r: &mut Rig, at_ms: u64) {
    r.h.0.now_ms.set(at_ms);
    for _ in 0..10 {
        r.root.on_tick();
    }
}

#[test]
fn a_watched_record_wakes_its_waiters_at_once_and_they_poll_only_as_a_fallback() {
    let mut r = watching_rig();
    let (_original, _waiter) = original_and_waiter(&mut r);
    // Parking opened the worker's watch stream (from the root) and asked for the record.
    let calls = grpc_calls(&r.h);
    let [HostCall::GrpcStream { token, service, method, metadata }, HostCall::GrpcSend { token: sent_on, message }] =
        calls.as_slice()
    else {
        panic!("{calls:?}")
    };
    assert_eq!(sent_on, token);
    assert_eq!(method, "etcdserverpb.Watch/Watch");
    assert!(metadata.is_empty(), "no auth, no token");
    // GrpcService{envoy_grpc{cluster_name "etcd", authority "etcd"}}
    assert_eq!(
        service,
        &[0x0a, 0x0c, 0x0a, 0x04, b'e', b't', b'c', b'd', 0x12, 0x04, b'e', b't', b'c', b'd']
    );
    assert!(String::from_utf8_lossy(message).contains("/idem/r/"), "{message:?}");
    let token = *token;
    // Created: the waiter looks once (a change before the watch began made no event)...
    assert!(watch_says(&mut r, token, watch_response(0, true, 0)));
    r.begins.borrow_mut().push_back(IN_FLIGHT);
    answer(&mut r, Some("200"));
    // ...then polls only every 5 s (here its give-up time, 2 s, comes first), not 50 ms
    // later: the watch wakes it.
    assert!(!tick_at(&mut r, 2_999));
    assert!(watch_says(&mut r, token, watch_response(0, false, 1)), "the record changed");
    r.begins.borrow_mut().push_back(replay());
    answer(&mut r, Some("200"));
    assert_eq!(r.h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
    // Nobody waits on it any more: the watch is ended within a second.
    let before = grpc_calls(&r.h).len();
    second_at(&mut r, 6_000);
    let calls = grpc_calls(&r.h);
    assert!(matches!(&calls[before..], [HostCall::GrpcSend { .. }]), "{calls:?}");
    // An event on an ended watch wakes nobody.
    assert!(!watch_says(&mut r, token, watch_response(0, false, 1)));
}

#[test]
fn a_closed_watch_stream_makes_waiters_poll_until_it_reopens() {
    let mut r = watching_rig();
    let (_original, _waiter) = original_and_waiter(&mut r);
    let Some(HostCall::GrpcStream { token, .. }) = grpc_calls(&r.h).first().cloned() else { panic!() };
    watch_says(&mut r, token, watch_response(0, true, 0));
    r.begins.borrow_mut().push_back(IN_FLIGHT);
    answer(&mut r, Some("200"));
    // etcd went away: the waiter polls at the usual pace again, the next time within a second
    // (not at once: etcd is likely unreachable).
    assert_eq!(r.h.plain_counter(WATCH_ENDED_METRIC), Some(0));
    r.root.on_grpc_close(token, 14);
    assert_eq!(r.h.plain_counter(WATCH_ENDED_METRIC), Some(1));
    assert!(!tick_at(&mut r, 1_999));
    assert!(tick_at(&mut r, 2_000));
    r.begins.borrow_mut().push_back(IN_FLIGHT);
    answer(&mut r, Some("200"));
    // A message on the old stream is nobody's.
    assert!(!watch_says(&mut r, token, watch_response(0, false, 1)));
    // A second after it closed, the stream is opened again with the same watch.
    let before = grpc_calls(&r.h).len();
    second_at(&mut r, 2_200);
    let calls = grpc_calls(&r.h);
    assert!(
        matches!(&calls[before..], [HostCall::GrpcStream { .. }, HostCall::GrpcSend { .. }]),
        "{calls:?}"
    );
}

#[test]
fn a_watch_stream_envoy_refuses_or_garbles_leaves_waiters_polling() {
    let mut r = watching_rig();
    r.h.fail("grpc_stream", 2);
    let (_original, _waiter) = original_and_waiter(&mut r);
    assert!(grpc_calls(&r.h).is_empty());
    assert_eq!(r.h.plain_counter(WATCH_ENDED_METRIC), Some(1), "a stream Envoy refused");
    assert!(tick_at(&mut r, 1_050), "polls as without a watch");
    r.begins.borrow_mut().push_back(IN_FLIGHT);
    answer(&mut r, Some("200"));
    // Opened later; a message that is not a WatchResponse ends the stream.
    r.h.0.failing.borrow_mut().clear();
    second_at(&mut r, 2_100);
    let Some(HostCall::GrpcStream { token, .. }) = grpc_calls(&r.h).first().cloned() else { panic!() };
    assert!(!watch_says(&mut r, token, vec![0xff, 0xff]));
    assert!(grpc_calls(&r.h).contains(&HostCall::GrpcCancel { token }));
    assert_eq!(r.h.plain_counter(WATCH_ENDED_METRIC), Some(2), "and one that garbled");
}
