//! An admin instance's requests through the worker with the local store: a list over a store far
//! larger than one callback may read is read in bounded parts, the first in the request's own
//! callback and the rest at the root's ticks (every `ADMIN_TICK_MS` while it goes on, so that
//! Envoy serves the worker's requests in between), and answered as one scan would; an operator
//! who left meanwhile costs nothing more. Every action is audited in one info line naming the
//! record's tag, route and tenant, the action, and the token by a prefix of its SHA-256 (never
//! of the token).

use super::{capture_logs, logged, pairs};
use crate::host::fake::FakeHost;
use crate::store::conformance::{attempt, claimed, scope};
use crate::store::local::LocalStore;
use crate::worker::flow::Verdict;
use crate::worker::root::{Root, ADMIN_TICK_MS, TICK_MS};

const ADMIN: &str = r#"{"store":{"type":"local","capacity":4000},"admin":{}}"#;
const TOKEN: &str = "audit-me-s3cret";

/// An admin instance's root over a local store holding `records` claims (keys `key-1`...).
fn admin_root(records: u64) -> (FakeHost, Root<FakeHost>) {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = ADMIN.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure());
    // The data plane's records, in the store the admin instance opened (its placement secret).
    let store = LocalStore::open(&h.0.data, 4_000, [9; 32], 1_000).unwrap();
    for n in 1..=records {
        claimed(store.begin(&attempt(n, 1, n, 1_000)).unwrap());
    }
    // Its once-a-second work (the sweep's part) done, and not due again in these tests.
    root.on_tick();
    (h, root)
}

fn get(h: &FakeHost, root: &Root<FakeHost>, context: u32, path: &str) {
    h.0.effective.set(context);
    *h.0.request_headers.borrow_mut() = pairs(&[(":method", "GET"), (":path", path)]);
    assert_eq!(root.http_context(context).on_request_headers(true), Verdict::Pause);
}

fn body_of(h: &FakeHost, context: u32) -> Option<String> {
    h.0.calls.borrow().iter().find_map(|c| match c {
        crate::host::fake::HostCall::SendResponse { context: c, body, .. } if *c == context => {
            Some(String::from_utf8_lossy(body).into_owned())
        }
        _ => None,
    })
}

#[test]
fn a_list_by_key_over_a_large_store_is_read_in_bounded_parts_at_the_roots_ticks() {
    capture_logs();
    let (h, mut root) = admin_root(1_500);
    get(&h, &root, 7, "/idempotency/records?key=key-777");
    // One part in the request's callback; the rest is the root's, which ticks fast meanwhile.
    assert_eq!(body_of(&h, 7), None);
    root.on_queue_ready(0);
    assert_eq!(h.0.tick_ms.get(), ADMIN_TICK_MS);
    let mut ticks = 0;
    while body_of(&h, 7).is_none() {
        ticks += 1;
        assert!(ticks < 100, "no answer after {ticks} ticks");
        let _ = h.take_tally();
        root.on_tick();
        let reads = h.take_tally().get("get_shared_data").map_or(0, |(n, _)| *n);
        assert!(reads <= (crate::store::local::admin::SCAN_READS + 9) as u64, "{reads} reads in one tick");
    }
    assert!(ticks >= 2, "{ticks}");
    let body = body_of(&h, 7).unwrap();
    assert_eq!(body.matches("\"tag\"").count(), 1, "{body}");
    assert!(body.contains(&scope(777).log_tag()), "{body}");
    assert!(logged(log::Level::Info)
        .iter()
        .any(|l| l.starts_with("admin listed tag=- route=- tenant=- token=- (GET")));
    // Nothing left to go on: back to the usual period.
    root.on_tick();
    assert_eq!(h.0.tick_ms.get(), TICK_MS);
}

#[test]
fn an_operator_who_left_mid_scan_costs_nothing_more() {
    let (h, mut root) = admin_root(1_500);
    get(&h, &root, 7, "/idempotency/records?key=key-777");
    h.0.gone.borrow_mut().push(7);
    let _ = h.take_tally();
    root.on_tick();
    assert_eq!(h.take_tally().get("get_shared_data"), None);
    assert_eq!(body_of(&h, 7), None);
    root.on_tick();
    assert_eq!(h.0.tick_ms.get(), TICK_MS);
}

fn post(h: &FakeHost, root: &Root<FakeHost>, context: u32, path: &str, body: &str) {
    h.0.effective.set(context);
    *h.0.request_headers.borrow_mut() =
        pairs(&[(":method", "POST"), (":path", path), ("authorization", &format!("Bearer {TOKEN}"))]);
    *h.0.request_body.borrow_mut() = body.as_bytes().to_vec();
    let mut http = root.http_context(context);
    assert_eq!(http.on_request_headers(body.is_empty()), Verdict::Pause);
    if !body.is_empty() {
        assert_eq!(http.on_request_body(body.len(), true), Verdict::Pause);
    }
}

#[test]
fn every_action_is_audited_with_the_records_tag_route_and_tenant_and_a_digest_of_the_token() {
    use crate::store::conformance::{label_in, LEASE};
    use crate::store::{Begin, ClaimAttempt, OnLeaseEnd};
    use sha2::{Digest, Sha256};
    capture_logs();
    let (h, mut root) = admin_root(0);
    h.0.properties.borrow_mut().insert("source.address".into(), b"10.0.0.7:51234".to_vec());
    let store = LocalStore::open(&h.0.data, 4_000, [9; 32], 1_000).unwrap();
    // Two records of tenant acme whose outcome is unknown, and a live claim of no tenant.
    for n in [1, 2] {
        let labelled = |owner, now| ClaimAttempt {
            label: Some(label_in(Some("acme"), "k")),
            ..attempt(n, 1, owner, now)
        };
        claimed(store.begin(&labelled(n, 1_000)).unwrap());
        let refuse =
            ClaimAttempt { on_lease_end: OnLeaseEnd::MarkUnknown, ..labelled(n + 10, 1_000 + LEASE) };
        assert_eq!(store.begin(&refuse).unwrap(), Begin::OutcomeUnknown);
    }
    claimed(
        store.begin(&ClaimAttempt { label: Some(label_in(None, "j")), ..attempt(3, 1, 3, 2_000) }).unwrap(),
    );
    h.0.now_ms.set(2_001);
    let (one, two, three) = (scope(1).log_tag(), scope(2).log_tag(), scope(3).log_tag());
    // Each found by its tag: a scan in parts, at the root's ticks.
    let asks = [
        (7, format!("/idempotency/records/{one}/release"), ""),
        (8, format!("/idempotency/records/{two}/resolve"), r#"{"status":201,"body":"ok"}"#),
        (9, format!("/idempotency/records/{three}/release"), ""),
    ];
    for (context, path, body) in asks {
        post(&h, &root, context, &path, body);
        while body_of(&h, context).is_none() {
            root.on_tick();
        }
    }
    assert_eq!(h.replies().iter().map(|r| r.1).collect::<Vec<_>>(), [200, 200, 409]);
    let token = format!("sha256:{}", &crate::codec::hex(&Sha256::digest(TOKEN.as_bytes()))[..8]);
    let lines: Vec<String> =
        logged(log::Level::Info).into_iter().filter(|l| l.starts_with("admin ")).collect();
    assert_eq!(
        lines,
        [
            format!("admin released tag={one} route=\"orders\" tenant=\"acme\" token={token} (POST /idempotency/records/{one}/release -> 200)"),
            format!("admin resolved tag={two} route=\"orders\" tenant=\"acme\" token={token} (POST /idempotency/records/{two}/resolve -> 200)"),
            format!("admin refused tag={three} route=\"orders\" tenant=- token={token} (POST /idempotency/records/{three}/release -> 409)"),
        ]
    );
    // Nothing of the token itself, not even its first characters.
    assert!(lines.iter().all(|l| !l.contains(&TOKEN[..6])), "{lines:?}");
    // The same, as JSON in each admin stream's filter state for its access log, with the
    // states before and after and the peer.
    let entries: Vec<(u32, String)> =
        h.0.calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                crate::host::fake::HostCall::SetProperty { context, name, value }
                    if name == "idempotency.audit" =>
                {
                    Some((*context, value.clone()))
                }
                _ => None,
            })
            .collect();
    let request = |tag: &str, verb: &str| format!("POST /idempotency/records/{tag}/{verb}");
    let entry = |action: &str,
                 tag: &str,
                 tenant: &str,
                 key: &str,
                 before: &str,
                 after: &str,
                 verb: &str,
                 status: u16| {
        format!(
            r#"{{"event":"admin","action":"{action}","record":"{tag}","route":"orders","tenant":{tenant},"key":"{key}","state_before":"{before}","state_after":"{after}","token":"{token}","peer":"10.0.0.7:51234","request":"{}","status":{status}}}"#,
            request(tag, verb)
        )
    };
    assert_eq!(
        entries,
        [
            (7, entry("released", &one, r#""acme""#, "k", "outcome_unknown", "released", "release", 200)),
            (8, entry("resolved", &two, r#""acme""#, "k", "outcome_unknown", "completed", "resolve", 200)),
            (9, entry("refused", &three, "null", "j", "processing", "processing", "release", 409)),
        ]
    );
    // The records released or resolved are announced to every worker's queue, so that the
    // requests waiting for them look now; the refused one is not.
    // (A queue also carries the root's own wake-ups, which name no record.)
    let woken: Vec<Vec<u8>> =
        h.0.queues.borrow().iter().flat_map(|(_, q)| q.iter().cloned()).filter(|m| m.len() == 32).collect();
    assert_eq!(woken, [scope(1).0.to_vec(), scope(2).0.to_vec()]);
}
