//! C25: a claim lives as long as its owner. A request still waiting for its upstream's answer
//! keeps its claim past its lease (the root renews it): a retry gets 409, never a takeover;
//! an owner that ends without an outcome lets its claim go, and the claim ends one lease after
//! its last renewal; a request answered within three quarters of its lease costs no renewal
//! (no host call, no store operation).

use super::{host_with, pairs, post, root, upstream_answers};
use crate::host::fake::FakeHost;
use crate::worker::flow::Verdict;
use crate::worker::root::Root;

/// A takeover rule with a 2 s lease: without renewals, a retry after 2 s executes again.
const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
    {"name":"orders","match":{"prefix":"/orders"},"require_key":true,
     "unknown_outcome":"takeover","processing_timeout":"2s"}]}"#;

fn host() -> FakeHost {
    host_with(CONFIG)
}

/// The root's ticks, every 100 ms, up to `until_ms`.
fn ticks(h: &FakeHost, root: &mut Root<FakeHost>, until_ms: u64) {
    while h.0.now_ms.get() < until_ms {
        h.0.now_ms.set(h.0.now_ms.get() + 100);
        root.on_tick();
    }
}

fn renewed(h: &FakeHost) -> i64 {
    h.plain_counter(crate::metrics::RENEWED_METRIC).unwrap_or(-1)
}

/// A retry of `key` now: forwarded (it executes) or answered (its status).
fn retry(h: &FakeHost, root: &Root<FakeHost>, context: u32, key: &str) -> Result<(), u16> {
    let mut http = root.http_context(context);
    match post(h, &mut http, "/orders", key) {
        Verdict::Continue => Ok(()),
        Verdict::Pause => Err(h.replies().last().map_or(0, |r| r.1)),
    }
}

#[test]
fn a_request_still_waiting_for_its_answer_keeps_its_claim_and_its_retries_get_409() {
    let h = host();
    let mut root = root(&h);
    let mut first = root.http_context(2);
    assert_eq!(post(&h, &mut first, "/orders", "k"), Verdict::Continue);
    // Within three quarters of its lease nothing is renewed.
    ticks(&h, &mut root, 2_400);
    assert_eq!(renewed(&h), 0);
    ticks(&h, &mut root, 2_600);
    assert_eq!(renewed(&h), 1);
    // Past its first lease (3 s) the upstream still works: a retry is in flight, not a takeover.
    ticks(&h, &mut root, 3_500);
    assert_eq!(retry(&h, &root, 3, "k"), Err(409));
    // Renewed again and again while it works.
    ticks(&h, &mut root, 7_000);
    assert!(renewed(&h) >= 4, "{}", renewed(&h));
    assert_eq!(retry(&h, &root, 4, "k"), Err(409));
    // Its answer comes: stored, and every retry replays it.
    upstream_answers(&h, "201", b"{}");
    assert_eq!(first.on_response_headers(false), Verdict::Continue);
    assert_eq!(first.on_response_body(2, true), Verdict::Continue);
    first.on_log();
    assert_eq!(h.counter("stored"), 1);
    assert_eq!(retry(&h, &root, 5, "k"), Err(201));
    // Let go: no more renewals.
    let so_far = renewed(&h);
    ticks(&h, &mut root, 20_000);
    assert_eq!(renewed(&h), so_far);
}

#[test]
fn an_owner_that_ends_without_an_outcome_lets_its_claim_end_a_lease_after_its_last_renewal() {
    let h = host();
    let mut root = root(&h);
    let mut first = root.http_context(2);
    assert_eq!(post(&h, &mut first, "/orders", "k"), Verdict::Continue);
    ticks(&h, &mut root, 2_600);
    assert_eq!(renewed(&h), 1);
    // The route timed out at 3.5 s: Envoy's 504, the outcome unknown, the claim kept.
    h.0.now_ms.set(3_500);
    *h.0.response_headers.borrow_mut() = pairs(&[(":status", "504")]);
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"response_timeout".to_vec());
    h.0.properties.borrow_mut().insert("response.flags".into(), 0x4u64.to_le_bytes().to_vec());
    first.on_response_headers(true);
    first.on_log();
    assert_eq!(h.counter("kept_unknown"), 1);
    // Its last renewal (at 2.5 s, a quarter of its lease before its end) keeps it until 4.5 s,
    // and nothing renews it any more.
    ticks(&h, &mut root, 4_400);
    assert_eq!(renewed(&h), 1);
    assert_eq!(retry(&h, &root, 3, "k"), Err(409));
    ticks(&h, &mut root, 4_500);
    assert_eq!(retry(&h, &root, 4, "k"), Ok(()));
    assert_eq!(h.counter("taken_over"), 1);
}

#[test]
fn a_request_answered_within_its_lease_costs_no_renewal() {
    // The same ticks on two Envoys, one of which serves a request answered at 2.4 s, within
    // three quarters of its 2 s lease.
    let (h, quiet) = (host(), host());
    let (mut root, mut quiet_root) = (root(&h), root(&quiet));
    let mut first = root.http_context(2);
    assert_eq!(post(&h, &mut first, "/orders", "k"), Verdict::Continue);
    let forwarded = h.take_tally();
    ticks(&h, &mut root, 2_400);
    ticks(&quiet, &mut quiet_root, 2_400);
    upstream_answers(&h, "201", b"{}");
    first.on_response_headers(false);
    first.on_response_body(2, true);
    first.on_log();
    assert_eq!(h.counter("stored"), 1);
    let (_, _) = (h.take_tally(), quiet.take_tally());
    ticks(&h, &mut root, 10_000);
    ticks(&quiet, &mut quiet_root, 10_000);
    // The root made the calls the quiet one made (the sweep's, the clock's), besides flushing
    // what the request counted: no store operation, no renewal, then or later.
    let calls = |tally: std::collections::BTreeMap<&'static str, (u64, u64)>| -> Vec<(&str, u64)> {
        tally.into_iter().filter(|(call, _)| *call != "increment_metric").map(|(c, (n, _))| (c, n)).collect()
    };
    assert_eq!(calls(h.take_tally()), calls(quiet.take_tally()));
    assert_eq!(renewed(&h), 0);
    // Holding the claim was no host call: the forwarded request read its headers, its body and
    // the clock, and claimed its key in shared data, as before renewals.
    let made: Vec<&str> = forwarded.keys().copied().collect();
    assert_eq!(made, ["buffer", "get_shared_data", "header_pairs", "now_ms", "set_shared_data"]);
}

#[test]
fn a_settled_claim_leaves_nothing_held() {
    let h = host();
    let root = root(&h);
    for (id, key) in [(2, "a"), (3, "b")] {
        let mut http = root.http_context(id);
        assert_eq!(post(&h, &mut http, "/orders", key), Verdict::Continue);
        upstream_answers(&h, "201", b"{}");
        http.on_response_headers(false);
        http.on_response_body(2, true);
        http.on_log();
    }
    assert_eq!(h.counter("stored"), 2);
    assert_eq!(root.held_claims(), 0);
}
