//! Issue 46, part 3: with `"audit": true` each change a protected request makes to a record is
//! one JSON entry in its stream's filter state `wasm.idempotency.audit`, for its access log;
//! a replay changes nothing and publishes nothing, and without `audit` nothing is published.

use super::{executed, filter_states, host_with, post, upstream_answers};
use crate::host::fake::FakeHost;
use crate::worker::flow::Verdict;

fn entries(h: &FakeHost) -> Vec<String> {
    filter_states(h, "idempotency.audit")
}

const AUDITED: &str = r#"{"audit":true,"tenant_header":"x-tenant","routes":[
    {"name":"orders","match":{"prefix":"/orders"}}]}"#;

#[test]
fn a_completion_and_a_release_are_audited_and_a_replay_is_not() {
    let h = host_with(AUDITED);
    let root = super::root(&h);
    executed(&h, &root, 2, "k-1", b"{\"id\":1}");
    let stored = entries(&h);
    assert_eq!(stored.len(), 1, "{stored:?}");
    let e = &stored[0];
    assert!(e.starts_with(r#"{"event":"stored","record":""#), "{e}");
    assert!(
        e.contains(
            r#""route":"orders","tenant":"","key":"k-1","state":"succeeded","status":201,"fingerprint":""#
        ),
        "{e}"
    );
    assert!(e.ends_with(r#","created_ms":1000,"completed_ms":1000}"#), "{e}");
    // The replay changes nothing: no entry.
    let mut retry = root.http_context(3);
    assert_eq!(post(&h, &mut retry, "/orders", "k-1"), Verdict::Pause);
    assert_eq!(entries(&h).len(), 1);
    // A 503 releases the claim: audited as such.
    let mut failing = root.http_context(4);
    assert_eq!(post(&h, &mut failing, "/orders", "k-2"), Verdict::Continue);
    upstream_answers(&h, "503", b"busy");
    assert_eq!(failing.on_response_headers(false), Verdict::Continue);
    let released = entries(&h);
    assert_eq!(released.len(), 2, "{released:?}");
    assert!(released[1].starts_with(r#"{"event":"released""#), "{}", released[1]);
    assert!(released[1].contains(r#""key":"k-2","state":"released","status":null"#), "{}", released[1]);
}

#[test]
fn without_audit_nothing_is_published() {
    let h = host_with(r#"{"routes":[{"name":"orders","match":{"prefix":"/orders"}}]}"#);
    let root = super::root(&h);
    executed(&h, &root, 2, "k", b"{}");
    assert!(entries(&h).is_empty());
}
