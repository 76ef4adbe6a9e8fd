//! Native cost of the engine's work for one protected request (admit, decide with a claim,
//! complete with a 1 KiB snapshot) and for one replay, over the shared-data fake. Run under
//! callgrind for instruction-exact, repeatable counts:
//!   cargo build --release --example engine_cost
//!   valgrind --tool=callgrind target/release/examples/engine_cost 2000
#![allow(clippy::expect_used)]

use idempotency_filter::config::parse;
use idempotency_filter::config::Config;
use idempotency_filter::engine::{
    admit, claim_attempt, decision_of, fingerprint_body, Admission, Decision, Pending, RequestHead,
};
use idempotency_filter::store::fake::FakeSharedData;
use idempotency_filter::store::local::LocalStore;
use idempotency_filter::store::record::{Snapshot, State};
use idempotency_filter::store::{Completion, RecordStore};
use std::time::Instant;

/// What `flow::RequestFlow` does with a whole body and a store that answers at once: the
/// fingerprint, the claim attempt, `begin`, the decision.
fn decide(
    cfg: &Config,
    p: &Pending,
    body: &[u8],
    store: &dyn RecordStore,
    now: u64,
    owner: u64,
) -> Option<Decision> {
    let fingerprint = fingerprint_body(p, body).ok()?;
    Some(decision_of(cfg, p, store.begin(&claim_attempt(cfg, p, fingerprint, now, owner))))
}

fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let cfg = parse(br#"{"store":{"type":"local","capacity":100000},"routes":[{"name":"orders","match":{"prefix":"/orders","methods":["POST"]},"require_key":true}]}"#).expect("config");
    let data = FakeSharedData::new();
    let store = LocalStore::open(&data, 100_000, [7; 32], 0).expect("store");
    let body = format!("{{\"item\":\"book\",\"qty\":1,\"pad\":\"{}\"}}", "x".repeat(980)).into_bytes();
    let response = Snapshot {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: vec![b'x'; 1024],
    };
    let started = Instant::now();
    for i in 0..n {
        let headers = vec![
            ("content-type".to_string(), b"application/json".to_vec()),
            ("idempotency-key".to_string(), format!("key-{i}").into_bytes()),
            ("authorization".to_string(), b"Bearer token".to_vec()),
        ];
        let Admission::Collect(p) = admit(
            &cfg,
            &RequestHead {
                method: "POST",
                path: "/orders",
                headers: &headers,
                verified_claims: None,
                cluster: None,
            },
        ) else {
            continue;
        };
        if let Some(Decision::Forward { claim, .. }) = decide(&cfg, &p, &body, &store, i, i + 1) {
            let c = Completion {
                state: State::Succeeded,
                status: 201,
                snapshot: Some(response.clone()),
                now_ms: i,
                ttl_ms: 86_400_000,
            };
            let _ = store.complete(&claim, &c);
        }
        // the replay of the same key
        let _ = decide(&cfg, &p, &body, &store, i, i + 2);
    }
    let per = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    println!("{n} requests + replays: {per:.2} us per pair (native, wall clock)");
}
