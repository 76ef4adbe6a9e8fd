//! What one record costs etcd (issue 33, sizing): `records` records are claimed and completed
//! through the filter's own exchanges (a blocking client to a real etcd), each as the filter
//! writes it: its label (route `orders`, a 36-character key, its scope: a tenant, host, method,
//! path and caller prefix), the default 30 s lease, a 24 h
//! ttl, and a 201 with `content-type`, an `x-request-id` and `body` bytes of body; with `quota`,
//! charged to a tenant and a caller (their index keys). `bench/etcd_sizing.py` measures etcd's
//! database around it.
//!
//!   cargo run --release --example etcd_sizing -- 127.0.0.1:2379 2000 2048 [quota] [tombstones]

// A measuring tool: a failed step is the tool's failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idempotency_filter::config;
use idempotency_filter::store::conformance::{attempt, charged, claimed, label_in};
use idempotency_filter::store::etcd::blocking::BlockingEtcd;
use idempotency_filter::store::record::{Snapshot, State};
use idempotency_filter::store::{ClaimAttempt, Completion, RecordStore};

const TTL_MS: u64 = 24 * 3_600_000;
const LEASE_MS: u64 = 30_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let addr: SocketAddr = args.get(1).expect("etcd address").parse().expect("host:port");
    let records: u64 = args.get(2).map_or(1_000, |s| s.parse().expect("records"));
    let body: usize = args.get(3).map_or(2_048, |s| s.parse().expect("body bytes"));
    let quota = args.iter().skip(4).any(|s| s == "quota");
    // Each record leaves a tombstone (`routes[].tombstone_ttl`: 48 h against the 24 h ttl).
    let tombstone_ms = if args.iter().skip(4).any(|s| s == "tombstones") { 2 * TTL_MS } else { 0 };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let config = r#"{"store":{"type":"etcd","cluster":"etcd","prefix":"/idempotency/","timeout":"5s"},
        "routes":[{"name":"orders","match":{"prefix":"/"}}]}"#;
    let config::StoreConfig::Etcd(settings) = config::parse(config.as_bytes()).unwrap().store else {
        panic!("an etcd store")
    };
    let worker = BlockingEtcd::new(addr, settings);
    let started = Instant::now();
    for n in 0..records {
        let base = if quota {
            // One tenant, a caller in it per 100 records: a fleet's callers each hold many.
            charged(n + 1, n + 1, now, (n / 100 % 250) as u8, Some(9), (1_000_000, 1_000_000))
        } else {
            attempt(n + 1, 1, n + 1, now)
        };
        let key = format!("{:08x}-0000-4000-8000-{:012x}", n, now);
        let attempt = ClaimAttempt {
            lease_ms: LEASE_MS,
            ttl_ms: TTL_MS,
            label: Some(label_in(Some("tenant-0042"), &key)),
            tombstone_ms,
            ..base
        };
        let claim = claimed(worker.begin(&attempt).unwrap());
        let snapshot = Snapshot {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-request-id".into(), key.clone().into_bytes()),
            ],
            body: vec![b'x'; body],
        };
        let completion = Completion {
            state: State::Succeeded,
            status: 201,
            snapshot: Some(snapshot),
            now_ms: now,
            ttl_ms: TTL_MS,
        };
        worker.complete(&claim, &completion).unwrap();
    }
    println!("records={records} body={body} quota={quota} seconds={:.1}", started.elapsed().as_secs_f64());
}
