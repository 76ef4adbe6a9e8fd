//! A cluster Envoy does not know, named by the configuration (a store's shard, a detached
//! rule's `cluster`, a lookup's `reconcile.cluster`): Envoy refuses every call to it
//! (BadArgument) and nothing is sent. The request that needed it fails as it did before; the
//! first refusal per field and cluster on a worker is said in one critical line naming both,
//! and every refusal is counted (`idempotency.unknown_cluster_calls_total`, at 0 from the start).

use super::{pairs, sent_to};
use crate::host::fake::{FakeHost, HostCall};
use crate::metrics::UNKNOWN_CLUSTER_METRIC;
use crate::worker::flow::Verdict;
use crate::worker::http::Http;
use crate::worker::root::Root;

fn rig(config: &str, clusters: &[&str]) -> (FakeHost, Root<FakeHost>) {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = config.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h.0.clusters.borrow_mut().extend(clusters.iter().map(|c| c.to_string()));
    h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure());
    (h, root)
}

/// A protected POST of `key` on context `id`, then the root's callback that takes on what it
/// handed over; the callouts made meanwhile.
fn post(h: &FakeHost, root: &mut Root<FakeHost>, id: u32, path: &str, key: &str) -> (Http<FakeHost>, usize) {
    let mut http = root.http_context(id);
    h.0.effective.set(id);
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", path),
        (":authority", "shop.example"),
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    let before = h.dispatches().len();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    let _ = http.on_request_body(2, true);
    h.0.effective.set(1);
    root.on_queue_ready(0);
    (http, h.dispatches().len() - before)
}

fn critical_lines(h: &FakeHost) -> Vec<String> {
    h.0.calls
        .borrow()
        .iter()
        .filter_map(|c| match c {
            HostCall::Critical(m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

fn refusals(h: &FakeHost) -> Option<i64> {
    h.plain_counter(UNKNOWN_CLUSTER_METRIC)
}

/// C19: a shard whose cluster Envoy does not know fails closed for its records (503), the
/// other shard serves its own; the line names `store.shards[1].cluster` and the cluster, once.
#[test]
fn a_store_cluster_envoy_does_not_know_is_said_once_naming_its_field_and_counted_every_time() {
    let config = r#"{"store":{"type":"etcd","shards":[{"cluster":"etcd-a"},{"cluster":"etcd-tpyo"}]},
        "routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#;
    let (h, mut root) = rig(config, &["etcd-a"]);
    assert_eq!(refusals(&h), Some(0), "defined from the start");
    let (mut refused, mut called) = (0, 0);
    for i in 0..12u32 {
        let (_http, made) = post(&h, &mut root, 10 + i, "/orders", &format!("k{i}"));
        if made == 0 {
            refused += 1;
            let sent = sent_to(&h, 10 + i);
            assert!(
                matches!(sent.as_slice(), [(503, _, body)]
                if String::from_utf8_lossy(body).contains("store-unavailable")),
                "{sent:?}"
            );
        } else {
            called += 1;
        }
    }
    assert!(refused > 0 && called > 0, "twelve keys reach both shards: {refused} {called}");
    assert_eq!(refusals(&h), Some(refused));
    let lines = critical_lines(&h);
    let [line] = lines.as_slice() else { panic!("one line: {lines:?}") };
    assert!(
        line.starts_with("store.shards[1].cluster: Envoy does not know the cluster \"etcd-tpyo\""),
        "{line}"
    );
    assert!(line.contains("503 store-unavailable"), "{line}");
}

/// C21: a detached rule's cluster Envoy does not know: each new key gets 503
/// `detached-capacity` and its claim back; said once, naming `routes[1].cluster`.
#[test]
fn a_detached_cluster_envoy_does_not_know_is_said_once_naming_its_field() {
    let config = r#"{"store":{"type":"local","capacity":64},"routes":[
        {"name":"orders","match":{"prefix":"/orders"}},
        {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
         "cluster":"ordres","processing_timeout":"10s","upstream_timeout":"4s"}]}"#;
    let (h, mut root) = rig(config, &["orders"]);
    for (id, key) in [(2, "a"), (3, "b"), (4, "c")] {
        let (_http, made) = post(&h, &mut root, id, "/pay", key);
        assert_eq!(made, 0);
        assert!(matches!(sent_to(&h, id).as_slice(), [(503, _, body)]
            if String::from_utf8_lossy(body).contains("detached-capacity")));
    }
    assert_eq!((h.counter("detached_refused"), h.counter("released")), (3, 3));
    assert_eq!(refusals(&h), Some(3));
    let lines = critical_lines(&h);
    let [line] = lines.as_slice() else { panic!("one line: {lines:?}") };
    assert!(line.starts_with("routes[1].cluster: Envoy does not know the cluster \"ordres\""), "{line}");
    assert!(line.contains("every new key on this rule gets 503 detached-capacity"), "{line}");
}

/// C23: a lookup cluster Envoy does not know settles nothing (503 with `retry-after`); said
/// once, naming `routes[0].reconcile.cluster`.
#[test]
fn a_lookup_cluster_envoy_does_not_know_is_said_once_naming_its_field() {
    let config = r#"{"store":{"type":"local","capacity":64},"routes":[
        {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"processing_timeout":"10s",
         "reconcile":{"path":"/lookup/{key}","timeout":"2s","cluster":"lookups"}}]}"#;
    let (h, mut root) = rig(config, &["orders"]);
    // The first request's outcome is unknown: the upstream was selected, then its client left.
    let (mut first, made) = post(&h, &mut root, 2, "/pay", "k");
    assert_eq!(made, 0);
    h.0.effective.set(2);
    h.0.properties.borrow_mut().insert("upstream.address".into(), b"10.0.0.1:80".to_vec());
    first.on_log();
    h.0.properties.borrow_mut().remove("upstream.address");
    // Past the lease, each retry a second apart asks for a lookup, which Envoy refuses.
    for (id, now_ms) in [(3, 11_000), (4, 12_000)] {
        h.0.now_ms.set(now_ms);
        let (_http, made) = post(&h, &mut root, id, "/pay", "k");
        assert_eq!(made, 0);
        let sent = sent_to(&h, id);
        assert!(
            matches!(sent.as_slice(), [(503, headers, _)] if headers.iter().any(|(n, _)| n == "retry-after")),
            "{sent:?}"
        );
    }
    assert_eq!(h.counter("reconcile_failed"), 2);
    assert_eq!(refusals(&h), Some(2));
    let lines = critical_lines(&h);
    let [line] = lines.as_slice() else { panic!("one line: {lines:?}") };
    assert!(
        line.starts_with("routes[0].reconcile.cluster: Envoy does not know the cluster \"lookups\""),
        "{line}"
    );
}
