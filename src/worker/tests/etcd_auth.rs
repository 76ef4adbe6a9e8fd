//! The real etcd store (`store::etcd::remote`) with auth, on the fake host: a worker's streams share
//! one token fetch; a fetch that times out or is refused fails every stream waiting for it, by
//! its fail mode, and streams that left while waiting end with nothing held.

use super::pairs;
use crate::host::fake::{FakeHost, HostCall};
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;

const CONFIG: &str = r#"{"store":{"type":"etcd","cluster":"etcd","auth":{"username":"idem","password":"pw"}},
    "routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#;
const AUTHENTICATE: &str = "/v3/auth/authenticate";

fn rig(config: &str) -> (FakeHost, Root<FakeHost>) {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = config.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().push("etcd".into());
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure());
    (h, root)
}

/// `n` protected POSTs, paused for their `begin`, which the root then starts.
fn posts(h: &FakeHost, root: &mut Root<FakeHost>, ids: std::ops::Range<u32>) -> Vec<Http<FakeHost>> {
    let streams = ids
        .map(|id| {
            let mut http = root.http_context(id);
            let key = format!("k{id}");
            *h.0.request_headers.borrow_mut() =
                pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", &key)]);
            *h.0.request_body.borrow_mut() = b"{}".to_vec();
            assert_eq!(http.on_request_headers(false), Verdict::Pause);
            assert_eq!(http.on_request_body(2, true), Verdict::Pause);
            http
        })
        .collect();
    h.0.effective.set(1);
    root.on_queue_ready(0);
    streams
}

/// (token, :path) of every callout made so far.
fn callouts(h: &FakeHost) -> Vec<(u32, String)> {
    h.dispatches()
        .into_iter()
        .filter_map(|c| match c {
            HostCall::Dispatch { token, headers, .. } => {
                headers.into_iter().find(|(n, _)| n == ":path").map(|(_, p)| (token, p))
            }
            _ => None,
        })
        .collect()
}

fn fetches(h: &FakeHost) -> usize {
    callouts(h).iter().filter(|(_, p)| p == AUTHENTICATE).count()
}

fn answer(h: &FakeHost, root: &mut Root<FakeHost>, token: u32, status: &str, body: &str) {
    *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", status)]);
    *h.0.call_response_body.borrow_mut() = body.as_bytes().to_vec();
    h.0.effective.set(1);
    root.on_http_call_response(token, body.len());
}

fn timeouts(h: &FakeHost) -> Vec<u32> {
    h.dispatches()
        .into_iter()
        .filter_map(|c| match c {
            HostCall::Dispatch { timeout_ms, .. } => Some(timeout_ms),
            _ => None,
        })
        .collect()
}

fn replies_503(h: &FakeHost) -> Vec<u32> {
    h.0.calls
        .borrow()
        .iter()
        .filter_map(|c| match c {
            HostCall::SendResponse { context, status: 503, .. } => Some(*context),
            _ => None,
        })
        .collect()
}

const TOKEN: &str = r#"{"header":{"revision":"6"},"token":"tok.1"}"#;

#[test]
fn streams_without_a_token_share_one_fetch() {
    let (h, mut root) = rig(CONFIG);
    let _streams = posts(&h, &mut root, 2..6);
    assert_eq!(fetches(&h), 1, "{:?}", callouts(&h));
    // The fetch has its own timeout (store.auth.timeout, 2 s by default).
    assert_eq!(timeouts(&h), vec![2_000]);
    // Its answer sends every waiting stream's read, each with the token, on the store's
    // timeout (a fresh worker has no lease for a claim's puts yet: it reads first).
    let (token, _) = callouts(&h)[0].clone();
    answer(&h, &mut root, token, "200", TOKEN);
    let reads: Vec<_> = callouts(&h)[1..].to_vec();
    assert_eq!(reads.len(), 4, "{reads:?}");
    assert!(reads.iter().all(|(_, p)| p == "/v3/kv/txn"), "{reads:?}");
    assert_eq!(timeouts(&h)[1..], [250, 250, 250, 250]);
    assert!(h.dispatches()[1..].iter().all(|c| matches!(c, HostCall::Dispatch { headers, .. }
        if headers.iter().any(|(n, v)| n == "authorization" && v == "tok.1"))));
    assert_eq!(fetches(&h), 1);
}

/// C19: without the etcd token the store cannot be used: every stream waiting for it fails
/// closed (503), and no store request goes out.
#[test]
fn a_fetch_that_times_out_fails_every_waiting_stream_by_its_fail_mode() {
    let (h, mut root) = rig(CONFIG);
    let _streams = posts(&h, &mut root, 2..6);
    let (token, _) = callouts(&h)[0].clone();
    // Envoy gives up on the fetch after its 2 s: its stream fails closed at once...
    h.0.now_ms.set(3_000);
    answer(&h, &mut root, token, "504", "upstream request timeout");
    assert_eq!(replies_503(&h), vec![2]);
    // ...and the waiting ones at the next tick (the fetch's deadline has passed).
    h.0.effective.set(1);
    root.on_tick();
    let mut failed = replies_503(&h);
    failed.sort_unstable();
    assert_eq!(failed, vec![2, 3, 4, 5]);
    assert_eq!(h.counter("store_error"), 4);
    assert_eq!(fetches(&h), 1, "no stream fetched on its own");
    assert_eq!(h.dispatches().len(), 1, "nothing sent without a token");
}

const REFUSED: &str = r#"{"error":"etcdserver: authentication failed, invalid user ID or password","message":"etcdserver: authentication failed, invalid user ID or password","code":3}"#;

/// C19: a refused token fetch fails the waiting streams closed (503).
#[test]
fn a_refused_fetch_fails_the_waiting_streams_at_once_and_nothing_stays_parked() {
    let (h, mut root) = rig(CONFIG);
    let _streams = posts(&h, &mut root, 2..5);
    let (token, _) = callouts(&h)[0].clone();
    answer(&h, &mut root, token, "400", REFUSED);
    let mut failed = replies_503(&h);
    failed.sort_unstable();
    assert_eq!(failed, vec![2, 3, 4]);
    // Nothing waits any more: a tick sends and answers nothing, and a new stream fetches
    // anew.
    let calls = h.0.calls.borrow().len();
    h.0.effective.set(1);
    root.on_tick();
    assert_eq!(h.0.calls.borrow().len(), calls);
    let _later = posts(&h, &mut root, 6..7);
    assert_eq!(fetches(&h), 2);
}

#[test]
fn streams_that_left_while_waiting_end_with_nothing_held() {
    let (h, mut root) = rig(CONFIG);
    let streams = posts(&h, &mut root, 2..5);
    let (token, _) = callouts(&h)[0].clone();
    for mut s in streams {
        s.on_log();
    }
    // Envoy refuses the contexts of streams that are gone.
    h.fail("set_effective_context", 2);
    let calls = h.0.calls.borrow().len();
    answer(&h, &mut root, token, "400", REFUSED);
    h.0.now_ms.set(10_000);
    root.on_tick();
    assert_eq!(h.0.calls.borrow().len(), calls, "no reply, no callout for streams that left");
    // And the next stream, present, fetches anew and is answered.
    h.0.failing.borrow_mut().clear();
    let _later = posts(&h, &mut root, 6..7);
    assert_eq!(fetches(&h), 2);
}
