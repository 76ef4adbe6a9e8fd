//! Issue 47: the unsettled records gauge. A request that meets an unknown outcome notes its
//! record in the Envoy's registry and the route's gauge says so at once; one root every few
//! seconds looks each noted record up again, and one settled (here by an operator's release) or
//! forgotten by its store leaves the gauge. (A replay and a new key never touch the registry:
//! their host-call budgets in `costs.rs` hold.)

use super::{pairs, root};
use crate::host::fake::FakeHost;
use crate::store::local::LocalStore;
use crate::store::{Amendment, RecordQuery, RecordStore, StateFilter};
use crate::worker::flow::Verdict;
use crate::worker::root::Root;
use crate::worker::unsettled::RECHECK_MS;

const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
    {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"processing_timeout":"1s","ttl":"60s"}]}"#;

const UNKNOWN: &str = "idempotency.route.pay.unsettled_records.outcome_unknown";
const PROCESSING: &str = "idempotency.route.pay.unsettled_records.processing";

fn host() -> FakeHost {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h
}

/// A POST of `key` on `id`, to its body's end: the stream and what the filter said.
fn post(
    h: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    key: &str,
) -> (crate::worker::http::Http<FakeHost>, Verdict) {
    let mut http = root.http_context(id);
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", "/pay"),
        (":authority", "shop.example"),
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    let verdict = http.on_request_body(2, true);
    (http, verdict)
}

/// An operator's release of the one unknown outcome, at 2.5 s (its 1 s lease over), through the
/// store as the admin API makes it.
fn release_at_2500(h: &FakeHost) {
    h.0.now_ms.set(2_500);
    let admin = LocalStore::open(&h.0.data, 64, [9; 32], 2_500).unwrap();
    let query = RecordQuery {
        id: None,
        state: StateFilter::OutcomeUnknown,
        route: None,
        key: None,
        tenant: None,
        host: None,
        limit: 10,
        cursor: None,
        detail: false,
        now_ms: 2_500,
    };
    let view = admin.records(&query).unwrap().views.remove(0);
    assert_eq!(admin.amend(&view, &Amendment::Release { force: false }, 2_500).unwrap(), Ok(()));
}

/// A POST of `key` on `id` whose stream ends with no upstream answer while an upstream host was
/// selected: its outcome is unknown. What the filter said at the body's end.
fn unknown_outcome(h: &FakeHost, root: &Root<FakeHost>, id: u32, key: &str) -> Verdict {
    let (mut first, verdict) = post(h, root, id, key);
    h.0.properties.borrow_mut().insert("upstream.address".into(), b"10.0.0.1:80".to_vec());
    first.on_log();
    h.0.properties.borrow_mut().remove("upstream.address");
    verdict
}

fn gauges(h: &FakeHost) -> (Option<u64>, Option<u64>) {
    (h.gauge(UNKNOWN), h.gauge(PROCESSING))
}

#[test]
fn an_unknown_outcome_shows_in_its_route_s_gauge_until_it_is_settled() {
    let h = host();
    let mut root = root(&h);
    // Defined at configure (Envoy shows a defined gauge at 0; the fake, once set).
    assert_eq!(gauges(&h), (None, None));
    assert_eq!(unknown_outcome(&h, &root, 2, "k1"), Verdict::Continue);
    assert_eq!(h.counter("outcome_unknown"), 1);
    assert_eq!(gauges(&h), (Some(1), Some(0)));
    // A retry that meets it (502) is the same record.
    let (_, verdict) = post(&h, &root, 3, "k1");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(h.counter("unknown_refused"), 1);
    assert_eq!(gauges(&h), (Some(1), Some(0)));
    // A root's check finds it still unknown.
    root.on_tick();
    assert_eq!(gauges(&h), (Some(1), Some(0)));
    // An operator releases it (its lease over): the next check, a few seconds on, drops it.
    release_at_2500(&h);
    root.on_tick();
    assert_eq!(gauges(&h), (Some(1), Some(0)), "not before the next check");
    h.0.now_ms.set(1_000 + RECHECK_MS + 1);
    root.on_tick();
    assert_eq!(gauges(&h), (Some(0), Some(0)));
}

#[test]
fn a_record_its_store_forgets_leaves_the_gauge() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, 2, "k2");
    assert_eq!(gauges(&h), (Some(1), Some(0)));
    // Past the record's ttl (60 s): absent to the store, so dropped.
    h.0.now_ms.set(62_000);
    root.on_tick();
    assert_eq!(gauges(&h), (Some(0), Some(0)));
}

/// Every configuration on the Envoy's VM shares the registry, and any of their roots may win a
/// check: here the admin listener's (no route rule, so no gauge of its own) drops the released
/// record. The filter's root, at its own next look, sets its gauges from what the registry
/// holds, whoever checked it: the gauge does not wait for a check this root wins.
#[test]
fn a_check_another_configuration_won_still_moves_this_one_s_gauge() {
    let h = host();
    let mut root = root(&h);
    unknown_outcome(&h, &root, 2, "k3");
    assert_eq!(gauges(&h), (Some(1), Some(0)));
    // The admin listener's root, on the same VM and store.
    *h.0.config.borrow_mut() = br#"{"store":{"type":"local","capacity":64},"admin":{}}"#.to_vec();
    let mut admin_root = Root::new(9, h.clone());
    assert!(admin_root.on_configure());
    // Released (its lease over); the admin root's check comes first and drops it.
    release_at_2500(&h);
    h.0.now_ms.set(1_000 + RECHECK_MS + 1);
    admin_root.on_tick();
    assert_eq!(gauges(&h), (Some(1), Some(0)), "the admin root has no gauge of route pay");
    // The filter's root comes to its own check time: the registry's check is not due (the
    // admin root took it), yet its gauge follows the registry.
    root.on_tick();
    assert_eq!(gauges(&h), (Some(0), Some(0)));
}
