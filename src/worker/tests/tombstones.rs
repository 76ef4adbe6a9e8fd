//! Issue 46, part 2: a tombstone after the ttl (`routes[].tombstone_ttl`). A retry after its
//! record's ttl learns that its request executed (410 `result-expired`, with the original
//! status) instead of executing again; another payload is still 422; after the tombstone's end
//! the key is new.

use super::key_sources::{reply_body, send};
use super::{host_with, root};
use crate::host::fake::HostCall;

const ROUTES: &str = r#"{"routes":[
    {"name":"pay","match":{"prefix":"/pay"},"ttl":"2s","processing_timeout":"1s","tombstone_ttl":"60s"},
    {"name":"plain","match":{"prefix":"/plain"},"ttl":"2s","processing_timeout":"1s"}]}"#;

fn original_status(h: &crate::host::fake::FakeHost) -> Option<Vec<u8>> {
    h.0.calls.borrow().iter().rev().find_map(|c| match c {
        HostCall::SendResponse { headers, .. } => {
            headers.iter().find(|(n, _)| n == "idempotent-original-status").map(|(_, v)| v.clone())
        }
        _ => None,
    })
}

#[test]
fn a_retry_after_the_ttl_gets_410_with_the_original_status_and_never_executes() {
    let h = host_with(ROUTES);
    let root = root(&h);
    let key = [("idempotency-key", "pay-1")];
    // Executed and completed at 1 s (the fake's clock starts there).
    assert_eq!(h.0.now_ms.get(), 1_000);
    assert_eq!(send(&h, &root, 2, "/pay", &key, r#"{"amount":5}"#), None);
    h.0.now_ms.set(2_999);
    assert_eq!(send(&h, &root, 3, "/pay", &key, r#"{"amount":5}"#), Some(201));
    h.0.now_ms.set(3_000);
    assert_eq!(send(&h, &root, 4, "/pay", &key, r#"{"amount":5}"#), Some(410));
    assert!(reply_body(&h, 4).contains("urn:idempotency-filter:result-expired"), "{}", reply_body(&h, 4));
    assert_eq!(original_status(&h), Some(b"201".to_vec()));
    assert_eq!(send(&h, &root, 5, "/pay", &key, r#"{"amount":6}"#), Some(422));
    // A rule without tombstones forgets its record at the ttl, as before.
    let other = [("idempotency-key", "plain-1")];
    assert_eq!(send(&h, &root, 6, "/plain", &other, "{}"), None);
    h.0.now_ms.set(5_001);
    assert_eq!(send(&h, &root, 7, "/plain", &other, "{}"), None);
    assert_eq!(h.counter("result_expired"), 1);
    h.0.now_ms.set(60_999);
    assert_eq!(send(&h, &root, 8, "/pay", &key, r#"{"amount":5}"#), Some(410));
    // The tombstone ends 60 s after the completion: the key is new again.
    h.0.now_ms.set(61_000);
    assert_eq!(send(&h, &root, 9, "/pay", &key, r#"{"amount":5}"#), None);
    assert_eq!(h.counter("claimed"), 4);
    assert_eq!(h.counter("result_expired"), 2);
}
