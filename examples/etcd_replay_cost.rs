//! What a replay costs on the etcd store as its caller's live records grow (issue 18, item 8):
//! one record of principal P is claimed and completed, then P is given `live - 1` more live
//! records (their quota index keys, written straight into etcd), then the record is replayed
//! `iterations` times through the same exchanges the filter makes. Prints the median and the
//! 90th percentile of one replay, in microseconds.
//!
//!   cargo run --release --example etcd_replay_cost -- 127.0.0.1:2379 20000 200
//!
//! `bench/etcd_replay_cost.py` (`make bench-etcd-replay`) starts etcd and runs this at 1 and
//! 20,000 live records, for this build and, with BENCH_BEFORE, an older one.

// A measuring tool: a failed step is the tool's failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idempotency_filter::codec::base64;
use idempotency_filter::config;
use idempotency_filter::store::conformance::{charged, claimed, done};
use idempotency_filter::store::etcd::blocking::BlockingEtcd;
use idempotency_filter::store::{Begin, ClaimAttempt, RecordStore};

const PRINCIPAL: u8 = 4;
/// Index keys per transaction (etcd's default --max-txn-ops is 128).
const PUTS_PER_TXN: usize = 100;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let addr: SocketAddr = args.get(1).expect("etcd address").parse().expect("host:port");
    let live: usize = args.get(2).map_or(1, |s| s.parse().expect("live records"));
    let iterations: usize = args.get(3).map_or(200, |s| s.parse().expect("iterations"));
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let prefix = format!("/bench-replay/{}-{live}-{now}/", std::process::id());
    // Through the configuration parser, so that this file builds against older trees too
    // (`make bench-etcd-replay BENCH_BEFORE=...`): those from `StoreConfig::Etcd` on (issue 21
    // §1); before it the settings were `Config.etcd`.
    let config = format!(
        r#"{{"store":{{"type":"etcd","cluster":"etcd","prefix":"{prefix}","timeout":"5s"}},
            "routes":[{{"name":"r","match":{{"prefix":"/"}}}}]}}"#
    );
    let config::StoreConfig::Etcd(settings) = config::parse(config.as_bytes()).unwrap().store else {
        panic!("an etcd store")
    };
    let worker = BlockingEtcd::new(addr, settings);
    let attempt = |owner: u64, at: u64| ClaimAttempt {
        ttl_ms: 3_600_000,
        ..charged(1, owner, at, PRINCIPAL, None, (1_000_000, 1_000_000))
    };
    let claim = claimed(worker.begin(&attempt(11, now)).unwrap());
    let outcome = idempotency_filter::store::Completion { ttl_ms: 3_600_000, ..done("replayed", now) };
    worker.complete(&claim, &outcome).unwrap();
    // The principal's other live records: index keys that count until an hour from now (the
    // layout of docs/ETCD.md: q/p/<first 8 bytes of the digest, hex>/<until, hex>/<scope>).
    let tag = format!("{:016x}", u64::from_be_bytes([PRINCIPAL; 8]));
    let until = now + 3_600_000;
    let keys: Vec<String> =
        (1..live).map(|n| format!("{prefix}q/p/{tag}/{until:016x}/{:064x}", n as u128 + 1_000)).collect();
    for chunk in keys.chunks(PUTS_PER_TXN) {
        let puts: Vec<String> = chunk
            .iter()
            .map(|k| format!(r#"{{"request_put":{{"key":"{}","value":""}}}}"#, base64::encode(k.as_bytes())))
            .collect();
        let body = format!(r#"{{"compare":[],"success":[{}],"failure":[]}}"#, puts.join(","));
        let answer = worker.post("/v3/kv/txn", body.as_bytes(), None);
        assert_eq!(answer.status, Some(200), "{}", String::from_utf8_lossy(&answer.body));
    }
    let mut micros = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let started = Instant::now();
        let answer = worker.begin(&attempt(100 + i as u64, now + 1)).unwrap();
        micros.push(started.elapsed().as_micros() as u64);
        assert!(matches!(answer, Begin::Replay(_)), "{answer:?}");
    }
    micros.sort_unstable();
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q) as usize];
    println!("live={live} iterations={iterations} median_us={} p90_us={}", at(0.5), at(0.9));
}
