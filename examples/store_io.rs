//! What the local store costs the host per operation, and how full it gets: host calls and
//! value bytes copied per new-key claim, completion (1 KiB response) and replay, measured over the
//! shared-data fake at several fills, plus the share of new keys refused at each fill with churn
//! (a random record released, a new key claimed), and the memory per live record.
//!   cargo run --release --example store_io [capacity]
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use idempotency_filter::identity::fingerprint::Fingerprint;
use idempotency_filter::identity::scope::ScopeId;
use idempotency_filter::splitmix::SeededRng;
use idempotency_filter::store::fake::{FakeSharedData, Io};
use idempotency_filter::store::local::LocalStore;
use idempotency_filter::store::record::{Label, LabelScope, Snapshot, State};
use idempotency_filter::store::{Begin, Claim, ClaimAttempt, Completion, OnLeaseEnd, RecordStore};
use sha2::{Digest, Sha256};

const TTL: u64 = 86_400_000;

fn attempt(n: u64, owner: u64) -> ClaimAttempt {
    ClaimAttempt {
        scope: ScopeId(Sha256::digest(n.to_be_bytes()).into()),
        fingerprint: Fingerprint([1; 32]),
        owner,
        now_ms: 1,
        lease_ms: 30_000,
        ttl_ms: TTL,
        quota: None,
        on_lease_end: OnLeaseEnd::TakeOver,
        tombstone_ms: 0,
        // A typical label: a short route name, a UUID key, and its scope (a POST to a host's
        // path, one tenant, the caller's digest).
        label: Some(Label::scoped(
            "orders",
            "5f0c6d2e-8a41-4b7e-9c3d-2f1e0a9b8c7d",
            &LabelScope {
                method: "POST",
                host: b"api.example.com",
                path: "/v1/orders",
                tenant: Some(&[b"tenant-0042"]),
                principal: &[7; 32],
            },
        )),
    }
}

fn completion() -> Completion {
    let snapshot = Snapshot {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: vec![b'x'; 1024],
    };
    Completion { state: State::Succeeded, status: 201, snapshot: Some(snapshot), now_ms: 2, ttl_ms: TTL }
}

/// Snapshot bytes as stored (status, header count, header, body length, body).
const SNAPSHOT_BYTES: usize = 2 + 2 + (2 + 12 + 4 + 16) + 4 + 1024;

fn add(a: Io, b: Io) -> Io {
    Io {
        gets: a.gets + b.gets,
        sets: a.sets + b.sets,
        bytes_read: a.bytes_read + b.bytes_read,
        bytes_written: a.bytes_written + b.bytes_written,
    }
}

#[derive(Default)]
struct Tally {
    tried: u64,
    refused: u64,
    claims: u64,
    io: Io,
}

fn claim_one(
    store: &LocalStore<&FakeSharedData>,
    data: &FakeSharedData,
    t: &mut Tally,
    open: &mut Vec<Claim>,
    rng: &mut SeededRng,
    owner: &mut u64,
) {
    *owner += 1;
    t.tried += 1;
    let before = data.io();
    match store.begin(&attempt(rng.next_u64(), *owner)).expect("begin") {
        Begin::Claimed(c) => {
            t.io = add(t.io, data.io() - before);
            t.claims += 1;
            open.push(c);
        }
        Begin::Full { .. } => t.refused += 1,
        other => panic!("{other:?}"),
    }
}

fn main() {
    let capacity: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let data = FakeSharedData::new();
    let store = LocalStore::open(&data, capacity, [7; 32], 0).expect("store");
    let fixed = data.value_bytes();
    let mut rng = SeededRng(1);
    let mut owner = 0u64;
    // Claims left processing (released at random for churn) and completed records.
    let mut open: Vec<Claim> = Vec::new();
    let mut completed = 0usize;
    println!("capacity {capacity}, {} buckets", store.buckets());
    println!("| fill | new keys refused | claim: gets / sets / bytes read / written | completion: gets / sets / bytes read / written | replay: gets / sets / bytes read |");
    println!("|---:|---:|---|---|---|");
    for percent in [10u64, 50, 70, 80, 90, 95, 100] {
        let target = (u64::from(capacity) * percent / 100) as usize;
        let mut t = Tally::default();
        while open.len() + completed < target && t.tried < 3 * u64::from(capacity) {
            claim_one(&store, &data, &mut t, &mut open, &mut rng, &mut owner);
        }
        // Churn at this fill: a random record goes (as a sweep drops an expired one), a new key
        // comes.
        for _ in 0..(u64::from(capacity) / 10).max(1_000) {
            if open.is_empty() {
                break;
            }
            let i = (rng.next_u64() % open.len() as u64) as usize;
            let gone = open.swap_remove(i);
            store.release(&gone).expect("release");
            claim_one(&store, &data, &mut t, &mut open, &mut rng, &mut owner);
        }
        // A completion and a replay: complete sample claims in place (the fill stays).
        let (mut comp, mut rep, mut m) = (Io::default(), Io::default(), 0u64);
        for _ in 0..200.min(open.len()) {
            let c = open.swap_remove((rng.next_u64() % open.len() as u64) as usize);
            let before = data.io();
            store.complete(&c, &completion()).expect("complete");
            comp = add(comp, data.io() - before);
            let mut again = attempt(0, owner + 1);
            again.scope = c.scope;
            owner += 1;
            let before = data.io();
            let r = store.begin(&again).expect("replay");
            assert!(matches!(r, Begin::Replay(_)), "{r:?}");
            rep = add(rep, data.io() - before);
            m += 1;
            completed += 1;
        }
        let per = |x: u64, k: u64| x as f64 / k.max(1) as f64;
        println!(
            "| {percent}% | {:.4}% | {:.2} / {:.2} / {:.0} / {:.0} | {:.2} / {:.2} / {:.0} / {:.0} | {:.2} / {:.2} / {:.0} |",
            100.0 * t.refused as f64 / t.tried.max(1) as f64,
            per(t.io.gets, t.claims),
            per(t.io.sets, t.claims),
            per(t.io.bytes_read, t.claims),
            per(t.io.bytes_written, t.claims),
            per(comp.gets, m),
            per(comp.sets, m),
            per(comp.bytes_read, m),
            per(comp.bytes_written, m),
            per(rep.gets, m),
            per(rep.sets, m),
            per(rep.bytes_read, m),
        );
    }
    // Memory: complete every record, then what the values hold beyond the snapshots.
    for c in open.drain(..) {
        store.complete(&c, &completion()).expect("complete");
        completed += 1;
    }
    let per_record = (data.value_bytes() - fixed) as f64 / completed as f64 - SNAPSHOT_BYTES as f64;
    println!(
        "{completed} completed records: {per_record:.0} bytes each beyond the snapshot's {SNAPSHOT_BYTES}"
    );
    tombstones(capacity);
}

/// What a tombstone costs (`routes[].tombstone_ttl`): the same completions (a 1 KiB response
/// each, as above) through a store that keeps a room of one tombstone per record of capacity and
/// one that keeps none. The difference is the tombstones': value bytes and keys per tombstone,
/// beside a record's; and what a new key and a completion copy more.
fn tombstones(capacity: u32) {
    let run = |room: u32| {
        let data = FakeSharedData::new();
        let store = LocalStore::open(&data, capacity, [7; 32], 0)
            .and_then(|s| s.keeping_tombstones(room, 0))
            .expect("store");
        let tombstone_ms = if room > 0 { 2 * TTL } else { 0 };
        let (mut claim_io, mut complete_io) = (Io::default(), Io::default());
        for i in 0..u64::from(capacity) * 9 / 10 {
            let before = data.io();
            let c = match store.begin(&ClaimAttempt { tombstone_ms, ..attempt(i, i + 1) }).expect("begin") {
                Begin::Claimed(c) => c,
                other => panic!("{other:?}"),
            };
            let claimed = data.io();
            store.complete(&c, &completion()).expect("complete");
            claim_io = add(claim_io, claimed - before);
            complete_io = add(complete_io, data.io() - claimed);
        }
        (data.key_count(), data.value_bytes(), claim_io, complete_io)
    };
    let (keys0, bytes0, claim0, complete0) = run(0);
    let (keys1, bytes1, claim1, complete1) = run(capacity);
    // Filled to 90%, where placement still takes every new key.
    let n = (u64::from(capacity) * 9 / 10) as f64;
    let per = |x: u64| x as f64 / n;
    println!(
        "tombstones: {:.1} bytes and {:.3} keys each, beside {:.0} bytes and {:.2} keys per completed record (its 1 KiB response included)",
        (bytes1 - bytes0) as f64 / n,
        (keys1 - keys0) as f64 / n,
        bytes0 as f64 / n,
        keys0 as f64 / n,
    );
    println!(
        "a new key that keeps them: +{:.2} gets, +{:.0} bytes read; its completion: +{:.2} gets, +{:.2} sets, +{:.0} bytes read, +{:.0} written",
        per(claim1.gets) - per(claim0.gets),
        per(claim1.bytes_read) - per(claim0.bytes_read),
        per(complete1.gets) - per(complete0.gets),
        per(complete1.sets) - per(complete0.sets),
        per(complete1.bytes_read) - per(complete0.bytes_read),
        per(complete1.bytes_written) - per(complete0.bytes_written),
    );
}
