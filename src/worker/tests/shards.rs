//! A store in shards (`store.shards`) on the fake host: each record's calls go to its shard's
//! cluster, with that shard's authority, the same key always to the same shard; a call that
//! fails is counted under its shard's cluster, and only there.

use super::pairs;
use crate::host::fake::{FakeHost, HostCall};
use crate::metrics::store_calls_failed_metric;
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;

const CONFIG: &str = r#"{"store":{"type":"etcd","shards":[{"cluster":"etcd-a"},{"cluster":"etcd-b","authority":"etcd-b.db"},{"cluster":"etcd-c"}]},
    "routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#;
const CLUSTERS: [&str; 3] = ["etcd-a", "etcd-b", "etcd-c"];

fn rig() -> (FakeHost, Root<FakeHost>) {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().extend(CLUSTERS.map(String::from));
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure());
    (h, root)
}

/// A protected POST with `key`, paused for its begin, which the root then starts: the callout
/// it made (token, cluster, :authority).
fn post(
    h: &FakeHost,
    root: &mut Root<FakeHost>,
    id: u32,
    key: &str,
) -> (Http<FakeHost>, (u32, String, String)) {
    let mut http = root.http_context(id);
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", key)]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    assert_eq!(http.on_request_body(2, true), Verdict::Pause);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    let call = match h.dispatches().pop() {
        Some(HostCall::Dispatch { token, cluster, headers, .. }) => {
            let authority =
                headers.into_iter().find(|(n, _)| n == ":authority").map(|(_, v)| v).unwrap_or_default();
            (token, cluster, authority)
        }
        other => panic!("no callout: {other:?}"),
    };
    (http, call)
}

fn failed_calls(h: &FakeHost) -> Vec<Option<i64>> {
    CLUSTERS.iter().map(|c| h.plain_counter(&store_calls_failed_metric(c))).collect()
}

#[test]
fn each_records_calls_go_to_its_shard_and_a_failed_call_is_counted_under_that_shard_only() {
    let (h, mut root) = rig();
    // Defined at 0 for every shard before anything fails: a dashboard sees every shard.
    assert_eq!(failed_calls(&h), [Some(0), Some(0), Some(0)]);
    let mut went = Vec::new();
    for i in 0..12u32 {
        let key = format!("k{i}");
        let (_http, (token, cluster, authority)) = post(&h, &mut root, 10 + i, &key);
        let expected_authority = if cluster == "etcd-b" { "etcd-b.db" } else { "etcd" };
        assert_eq!(authority, expected_authority, "{cluster}");
        // etcd is down on that shard: Envoy's report of a failed callout.
        *h.0.call_response_headers.borrow_mut() = Vec::new();
        *h.0.call_response_body.borrow_mut() = Vec::new();
        root.on_http_call_response(token, 0);
        let shard = CLUSTERS.iter().position(|c| *c == cluster).expect("a shard's cluster");
        went.push((key, shard));
        let mut expected = [0i64; 3];
        for (_, s) in &went {
            expected[*s] += 1;
        }
        assert_eq!(failed_calls(&h), expected.map(Some), "after {:?}", went.last());
    }
    // Twelve keys reach every shard.
    assert!((0..3).all(|s| went.iter().any(|(_, w)| *w == s)), "{went:?}");
    // The same key goes to the same shard again.
    for (i, (key, shard)) in went.iter().enumerate() {
        let (_http, (_, cluster, _)) = post(&h, &mut root, 100 + i as u32, key);
        assert_eq!(cluster, CLUSTERS[*shard], "{key}");
    }
}
