//! Reconciliation (`routes[].reconcile`, C23) on the local store and a remote one: an unknown
//! outcome is kept in flight; after its lease a retry's lookup (made by the root, with the
//! retry's flow) decides: its 2xx is written as the record's outcome and replayed, its 404 lets
//! the retry execute as a takeover, anything else answers 503 with `retry-after` and writes
//! nothing; a client gone before the answer leaves the record as it was.

use super::{pairs, root, sent_to, Scripted, Sent};
use crate::host::fake::{FakeHost, HostCall};
use crate::store::remote::RemoteSettings;
use crate::store::{Begin, Claim, StoreOp};
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;
use std::cell::RefCell;
use std::rc::Rc;

const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
    {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"processing_timeout":"10s",
     "reconcile":{"path":"/lookup/{key}","timeout":"2s"}}]}"#;

fn host() -> FakeHost {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().extend(["orders".to_string(), "etcd".to_string()]);
    h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
    h
}

fn post(h: &FakeHost, root: &Root<FakeHost>, id: u32, key: &str) -> (Http<FakeHost>, Verdict) {
    let mut http = root.http_context(id);
    h.0.effective.set(id);
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", "/pay"),
        (":authority", "shop.example"),
        ("idempotency-key", key),
        ("authorization", "Bearer t"),
        ("x-envoy-max-retries", "3"),
        ("content-type", "application/json"),
    ]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    let verdict = http.on_request_body(2, true);
    (http, verdict)
}

/// The first request of `key` on context 2, whose stream ends with the upstream selected and no
/// answer (the client left while the upstream worked): an unknown outcome.
fn unknown_outcome(h: &FakeHost, root: &Root<FakeHost>, key: &str) {
    let (mut first, verdict) = post(h, root, 2, key);
    assert_eq!(verdict, Verdict::Continue);
    h.0.properties.borrow_mut().insert("upstream.address".into(), b"10.0.0.1:80".to_vec());
    first.on_log();
    h.0.properties.borrow_mut().remove("upstream.address");
    assert_eq!(h.counter("outcome_unknown"), 1);
}

/// A retry past the lease on `id`: held while the root makes the lookup (returned).
fn retry_looked_up(
    h: &FakeHost,
    root: &mut Root<FakeHost>,
    id: u32,
    key: &str,
) -> (Http<FakeHost>, HostCall) {
    let before = h.dispatches().len();
    let (http, verdict) = post(h, root, id, key);
    assert_eq!(verdict, Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let dispatches = h.dispatches();
    assert_eq!(dispatches.len(), before + 1, "one lookup");
    (http, dispatches[before].clone())
}

fn lookup_answers(h: &FakeHost, root: &mut Root<FakeHost>, call: &HostCall, status: &str, body: &[u8]) {
    let HostCall::Dispatch { token, .. } = call else { panic!("{call:?}") };
    *h.0.call_response_headers.borrow_mut() =
        pairs(&[(":status", status), ("content-type", "application/json"), ("set-cookie", "s=1")]);
    *h.0.call_response_body.borrow_mut() = body.to_vec();
    root.on_http_call_response(*token, body.len());
}

fn header<'s>(sent: &'s Sent, name: &str) -> Option<&'s [u8]> {
    sent.1.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
}

#[test]
fn the_lookup_is_the_callers_own_and_its_2xx_becomes_the_replayed_outcome() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k/1");
    // Within the lease: in flight, no lookup.
    h.0.now_ms.set(2_000);
    let (_, verdict) = post(&h, &root, 3, "k/1");
    assert_eq!((verdict, sent_to(&h, 3)[0].0, h.dispatches().len()), (Verdict::Pause, 409, 0));
    h.0.now_ms.set(11_000);
    let (_, call) = retry_looked_up(&h, &mut root, 4, "k/1");
    let HostCall::Dispatch { context: 1, cluster, headers, body, timeout_ms: 2_000, .. } = &call else {
        panic!("{call:?}")
    };
    assert_eq!((cluster.as_str(), body.as_slice()), ("orders", &b""[..]));
    let h_of = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
    assert_eq!(
        (h_of(":method"), h_of(":path"), h_of(":authority"), h_of("authorization")),
        (Some("GET"), Some("/lookup/k%2F1"), Some("shop.example"), Some("Bearer t"))
    );
    assert_eq!((h_of("idempotency-key"), h_of("x-envoy-max-retries")), (Some("k/1"), None));
    lookup_answers(&h, &mut root, &call, "201", b"{\"id\":9}");
    let sent = sent_to(&h, 4);
    let [reply] = sent.as_slice() else { panic!("{sent:?}") };
    assert_eq!((reply.0, reply.2.as_slice()), (201, &b"{\"id\":9}"[..]));
    assert_eq!(header(reply, "idempotent-reconciled"), Some(&b"true"[..]));
    assert_eq!(header(reply, "idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(header(reply, "set-cookie"), Some(&b"s=1"[..]));
    assert_eq!(h.counter("reconciled_found"), 1);
    // Written: the next retry replays it without a lookup.
    let (_, verdict) = post(&h, &root, 5, "k/1");
    let sent = sent_to(&h, 5);
    assert_eq!(
        (verdict, sent[0].0, header(&sent[0], "idempotent-reconciled")),
        (Verdict::Pause, 201, Some(&b"true"[..]))
    );
    assert_eq!((h.dispatches().len(), h.counter("replayed")), (1, 1));
}

#[test]
fn a_404_lets_the_retry_execute_as_a_takeover() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    h.0.now_ms.set(11_000);
    let (mut retry, call) = retry_looked_up(&h, &mut root, 4, "k");
    lookup_answers(&h, &mut root, &call, "404", b"{}");
    assert!(h.0.calls.borrow().iter().any(|c| matches!(c, HostCall::Resume { context: 4 })));
    assert_eq!((h.counter("reconciled_not_found"), h.counter("taken_over")), (1, 1));
    // The stream takes its flow back and captures the upstream's answer as any owner does.
    h.0.effective.set(4);
    super::upstream_answers(&h, "201", b"{\"id\":2}");
    assert_eq!(retry.on_response_headers(false), Verdict::Continue);
    assert_eq!(retry.on_response_body(8, true), Verdict::Continue);
    assert_eq!(h.counter("stored"), 1);
}

#[test]
fn a_failed_lookup_writes_nothing_and_the_next_may_start_a_second_later() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    h.0.now_ms.set(11_000);
    let (_, call) = retry_looked_up(&h, &mut root, 4, "k");
    lookup_answers(&h, &mut root, &call, "503", b"busy");
    let sent = sent_to(&h, 4);
    assert_eq!((sent[0].0, header(&sent[0], "retry-after")), (503, Some(&b"1"[..])));
    assert_eq!(h.counter("reconcile_failed"), 1);
    // At once again (another worker of this Envoy sees the same gate): refused, no lookup.
    h.0.now_ms.set(11_500);
    let (_, verdict) = post(&h, &root, 5, "k");
    assert_eq!((verdict, sent_to(&h, 5)[0].0, h.dispatches().len()), (Verdict::Pause, 503, 1));
    // A second after the first started: asked again, and found.
    h.0.now_ms.set(12_000);
    let (_, call) = retry_looked_up(&h, &mut root, 6, "k");
    lookup_answers(&h, &mut root, &call, "200", b"{\"id\":1}");
    assert_eq!(sent_to(&h, 6)[0].0, 200);
}

#[test]
fn a_client_gone_before_the_answer_leaves_the_record_for_the_next_lookup() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    h.0.now_ms.set(11_000);
    let (_, call) = retry_looked_up(&h, &mut root, 4, "k");
    h.0.gone.borrow_mut().push(4);
    lookup_answers(&h, &mut root, &call, "201", b"{}");
    assert_eq!((h.counter("reconciled_found"), h.counter("taken_over")), (0, 0));
    h.0.now_ms.set(12_000);
    let (_, call) = retry_looked_up(&h, &mut root, 5, "k");
    lookup_answers(&h, &mut root, &call, "201", b"{}");
    assert_eq!((sent_to(&h, 5)[0].0, h.counter("reconciled_found")), (201, 1));
}

/// A remote store (the worker's stand-in for etcd) whose begins answer `begins` first, then a
/// claim; and the operations it was asked.
fn scripted(begins: &[Begin]) -> (Scripted, Rc<RefCell<Vec<StoreOp>>>) {
    let ops = Rc::new(RefCell::new(Vec::new()));
    let remote = Scripted {
        settings: RemoteSettings {
            cluster: "etcd".into(),
            authority: "store".into(),
            timeout_ms: 250,
            on_error: crate::config::etcd::OnStoreError::FailClosed,
            protocol: Default::default(),
        },
        ops: Rc::clone(&ops),
        begins: Rc::new(RefCell::new(begins.iter().cloned().collect())),
        watch: None,
    };
    (remote, ops)
}

#[test]
fn on_a_remote_store_the_root_carries_the_begin_the_lookup_and_the_takeover() {
    let h = host();
    let (remote, ops) = scripted(&[Begin::Unsettled]);
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure_with(Some(Box::new(remote))));
    let (_, verdict) = post(&h, &root, 4, "k");
    assert_eq!(verdict, Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    // The begin's callout, answered Unsettled: the root makes the lookup next.
    let begin = h.dispatches()[0].clone();
    let HostCall::Dispatch { token, .. } = begin else { panic!() };
    *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "200")]);
    *h.0.call_response_body.borrow_mut() = Vec::new();
    root.on_http_call_response(token, 0);
    let lookup = h.dispatches()[1].clone();
    let HostCall::Dispatch { cluster, .. } = &lookup else { panic!() };
    assert_eq!(cluster, "orders");
    lookup_answers(&h, &mut root, &lookup, "201", b"{\"id\":3}");
    // Then the takeover (a claim, scripted) and the completion with the lookup's answer.
    for n in [2, 3] {
        let HostCall::Dispatch { token, .. } = h.dispatches()[n].clone() else { panic!() };
        *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "200")]);
        *h.0.call_response_body.borrow_mut() = Vec::new();
        root.on_http_call_response(token, 0);
    }
    let ops = ops.borrow();
    assert!(
        matches!(&ops[..], [StoreOp::Begin(_), StoreOp::Begin(a), StoreOp::Complete { claim: Claim { .. }, completion }]
        if a.on_lease_end == crate::store::OnLeaseEnd::TakeOver && completion.status == 201)
    );
    let sent = sent_to(&h, 4);
    assert_eq!((sent[0].0, header(&sent[0], "idempotent-reconciled")), (201, Some(&b"true"[..])));
    assert_eq!(h.counter("reconciled_found"), 1);
}

/// The root's own lookup when the lease ends, with no retry: answered with `status`.
fn looked_up_at_lease_end(h: &FakeHost, root: &mut Root<FakeHost>, status: &str, body: &[u8]) {
    let before = h.dispatches().len();
    h.0.effective.set(1);
    h.0.now_ms.set(12_999);
    root.on_tick();
    assert_eq!(h.dispatches().len(), before, "not before the margin past the lease's end");
    h.0.now_ms.set(13_000);
    root.on_tick();
    let dispatches = h.dispatches();
    assert_eq!(dispatches.len(), before + 1, "one lookup at the lease's end");
    let HostCall::Dispatch { headers, .. } = &dispatches[before] else { panic!() };
    assert!(headers.iter().any(|(n, v)| n == ":path" && v == "/lookup/k"), "{headers:?}");
    lookup_answers(h, root, &dispatches[before], status, body);
}

#[test]
fn with_no_retry_the_root_looks_up_at_the_leases_end_and_settles_the_record() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    looked_up_at_lease_end(&h, &mut root, "201", b"{\"id\":4}");
    assert_eq!(h.counter("reconciled_found"), 1);
    // Nobody to answer: no reply was sent on any stream.
    assert!(!h.0.calls.borrow().iter().any(|c| matches!(c, HostCall::SendResponse { .. })));
    // The client's retry, whenever it comes, is the replay: no lookup of its own.
    h.0.now_ms.set(60_000);
    let (_, verdict) = post(&h, &root, 5, "k");
    let sent = sent_to(&h, 5);
    assert_eq!((verdict, sent[0].0, sent[0].2.as_slice()), (Verdict::Pause, 201, &b"{\"id\":4}"[..]));
    assert_eq!(header(&sent[0], "idempotent-reconciled"), Some(&b"true"[..]));
    assert_eq!(h.dispatches().len(), 1);
    assert_eq!(root.flows_kept(), 0, "the lease-end lookup's flow ended with it");
}

#[test]
fn with_no_retry_a_404_at_the_leases_end_releases_the_record() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    looked_up_at_lease_end(&h, &mut root, "404", b"");
    assert_eq!((h.counter("reconciled_not_found"), h.counter("released")), (1, 1));
    // The retry finds no record: it executes, with no lookup.
    let (_, verdict) = post(&h, &root, 5, "k");
    assert_eq!((verdict, h.counter("claimed"), h.dispatches().len()), (Verdict::Continue, 2, 1));
}

#[test]
fn a_retry_that_asked_within_the_second_leaves_the_root_nothing_to_ask() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    h.0.now_ms.set(12_500);
    let (_, call) = retry_looked_up(&h, &mut root, 4, "k");
    lookup_answers(&h, &mut root, &call, "503", b"");
    h.0.now_ms.set(13_000);
    root.on_tick();
    h.0.now_ms.set(30_000);
    root.on_tick();
    assert_eq!(h.dispatches().len(), 1);
}

#[test]
fn with_no_retry_a_failed_lookup_at_the_leases_end_is_tried_again_later() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, "k");
    looked_up_at_lease_end(&h, &mut root, "500", b"");
    assert_eq!(h.counter("reconcile_failed"), 1);
    h.0.now_ms.set(14_000);
    root.on_tick();
    assert_eq!(h.dispatches().len(), 1, "backs off");
    h.0.now_ms.set(15_000);
    root.on_tick();
    let dispatches = h.dispatches();
    assert_eq!(dispatches.len(), 2);
    assert_eq!(root.flows_kept(), 1, "kept for its next try");
    lookup_answers(&h, &mut root, &dispatches[1], "200", b"{}");
    assert_eq!(h.counter("reconciled_found"), 1);
    assert_eq!(root.flows_kept(), 0);
}

#[test]
fn on_a_store_that_holds_a_claim_past_its_lease_the_roots_own_lookup_waits_for_it() {
    let h = host();
    let (remote, ops) = scripted(&[]);
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure_with(Some(Box::new(remote))));
    // Claimed at 1 s through the store's callout, forwarded, and the client left while the
    // upstream worked: an unknown outcome, kept for the lookup.
    let (mut first, verdict) = post(&h, &root, 2, "k");
    assert_eq!(verdict, Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let HostCall::Dispatch { token, .. } = h.dispatches()[0].clone() else { panic!() };
    *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "200")]);
    *h.0.call_response_body.borrow_mut() = Vec::new();
    root.on_http_call_response(token, 0);
    h.0.properties.borrow_mut().insert("upstream.address".into(), b"10.0.0.1:80".to_vec());
    first.on_log();
    assert_eq!(h.counter("outcome_unknown"), 1);
    // Its lease ends at 11 s, but the store keeps the claim its owner's for one lease more (its
    // completion's retry window): the root asks at 23 s, not at 13 s, when its begin could only
    // have found the claim in flight.
    // (Its record is also looked up every few seconds for the unsettled records gauge: a
    // look, not a begin.)
    let begins = || ops.borrow().iter().filter(|op| matches!(op, StoreOp::Begin(_))).count();
    let before = begins();
    for now in [13_000, 22_999] {
        h.0.now_ms.set(now);
        root.on_tick();
        assert_eq!(begins(), before, "nothing at {now} ms");
    }
    h.0.now_ms.set(23_000);
    root.on_tick();
    assert_eq!(begins(), before + 1, "the lookup's begin at 23 s");
}
