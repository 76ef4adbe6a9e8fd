//! Model-based property test of the engine over the shared-data fake: random interleavings of
//! 2-4 simulated workers with random arrivals, completions, releases, abandoned requests,
//! lease and ttl expiries, sweeps and capacity pressure, checked against the guarantees:
//! - at most one execution per scope while a record for it is live (a lease not yet expired, or
//!   a completed response not yet expired);
//! - a replay returns exactly the response of an execution with the same scope and payload;
//! - an owner whose lease was taken over never completes (its late write is refused);
//! - no live record is evicted: while one lives, its scope is answered from it.

#![allow(clippy::unwrap_used, clippy::panic)]

use idempotency_filter::config::{parse, Config};
use idempotency_filter::engine::{admit, decide, Admission, Decision, Outcome, Pending, RequestHead};
use idempotency_filter::local_store::LocalStore;
use idempotency_filter::record::{Snapshot, State};
use idempotency_filter::shared_data::FakeSharedData;
use idempotency_filter::store::{Claim, Completion, RecordStore, Settled};
use std::collections::HashMap;

const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 5_000;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone)]
struct Execution {
    scope_key: u64,
    payload: u64,
    lease_deadline: u64,
    /// Set once the store accepted its completion: (completed at, response body).
    completed_at: Option<u64>,
    /// Released or abandoned or lost: no longer holds the record.
    ended: bool,
}

struct InFlight {
    exec: usize,
    claim: Claim,
}

fn config(capacity: u32) -> Config {
    let json = format!(
        r#"{{"store":{{"type":"local","capacity":{capacity}}},"routes":[{{"name":"r","match":{{"prefix":"/"}},
        "require_key":true,"ttl":"{TTL_MS}ms","processing_timeout":"{LEASE_MS}ms"}}]}}"#
    );
    parse(json.as_bytes()).unwrap()
}

fn pending(cfg: &Config, scope_key: u64) -> Pending {
    // Scope = (principal, key): spread over two principals so that equal keys of different
    // callers are different scopes.
    let h = vec![
        ("idempotency-key".to_string(), format!("key-{}", scope_key / 2).into_bytes()),
        ("authorization".to_string(), format!("caller-{}", scope_key % 2).into_bytes()),
    ];
    match admit(cfg, &RequestHead { method: "POST", path: "/orders", headers: &h }) {
        Admission::Collect(p) => p,
        other => panic!("{other:?}"),
    }
}

fn run(seed: u64, workers: usize, capacity: u32, scopes: u64, steps: usize) {
    let cfg = config(capacity);
    let data = FakeSharedData::new();
    let stores: Vec<LocalStore<&FakeSharedData>> =
        (0..workers).map(|w| LocalStore::open(&data, capacity, [w as u8; 32], 0).unwrap()).collect();
    let mut rng = Lcg(seed);
    let mut now = 1u64;
    let mut execs: Vec<Execution> = Vec::new();
    let mut in_flight: Vec<Vec<InFlight>> = (0..workers).map(|_| Vec::new()).collect();
    let mut owner = 0u64;
    let mut counts: HashMap<&'static str, u32> = HashMap::new();

    for step in 0..steps {
        let w = rng.below(workers as u64) as usize;
        let ctx = format!("seed {seed} step {step} worker {w} now {now}");
        match rng.below(10) {
            0..=3 => {
                let scope_key = rng.below(scopes);
                let payload = rng.below(3).min(1); // mostly the same payload
                owner += 1;
                let p = pending(&cfg, scope_key);
                let body = format!("payload-{payload}");
                match decide(&cfg, &p, body.as_bytes(), &stores[w], now, owner) {
                    Decision::Forward { claim, outcome } => {
                        *counts.entry(outcome.name()).or_default() += 1;
                        for e in execs.iter().filter(|e| e.scope_key == scope_key) {
                            let lease_live = !e.ended && e.completed_at.is_none() && now < e.lease_deadline;
                            let response_live = e.completed_at.is_some_and(|c| now < c + TTL_MS);
                            assert!(
                                !lease_live && !response_live,
                                "second execution while a record lives: {e:?} ({ctx})"
                            );
                        }
                        // A takeover ends the previous owner's claim.
                        for e in
                            execs.iter_mut().filter(|e| e.scope_key == scope_key && e.completed_at.is_none())
                        {
                            e.ended = true;
                        }
                        execs.push(Execution {
                            scope_key,
                            payload,
                            lease_deadline: now + LEASE_MS,
                            completed_at: None,
                            ended: false,
                        });
                        in_flight[w].push(InFlight { exec: execs.len() - 1, claim });
                    }
                    Decision::Wait { .. } => panic!("reject mode never waits ({ctx})"),
                    Decision::Respond { reply, outcome } => {
                        *counts.entry(outcome.name()).or_default() += 1;
                        match outcome {
                            Outcome::Replayed => {
                                let id: usize = String::from_utf8_lossy(&reply.body)
                                    .trim_start_matches("exec-")
                                    .parse()
                                    .unwrap();
                                let e = &execs[id];
                                assert_eq!(
                                    (e.scope_key, e.payload),
                                    (scope_key, payload),
                                    "replay of another request ({ctx})"
                                );
                                assert!(
                                    e.completed_at.is_some_and(|c| now < c + TTL_MS),
                                    "replay of a dead record ({ctx})"
                                );
                            }
                            Outcome::Mismatch => {
                                let live_other = execs.iter().any(|e| {
                                    e.scope_key == scope_key
                                        && e.payload != payload
                                        && (e
                                            .completed_at
                                            .map_or(now < e.lease_deadline + TTL_MS, |c| now < c + TTL_MS))
                                });
                                assert!(live_other, "mismatch without a record of another payload ({ctx})");
                            }
                            Outcome::InFlight | Outcome::StoreFull => {}
                            other => panic!("unexpected {other:?} ({ctx})"),
                        }
                    }
                }
            }
            4..=5 => {
                if in_flight[w].is_empty() {
                    continue;
                }
                let i = rng.below(in_flight[w].len() as u64) as usize;
                let f = in_flight[w].swap_remove(i);
                let snapshot =
                    Snapshot { status: 201, headers: vec![], body: format!("exec-{}", f.exec).into_bytes() };
                let c = Completion {
                    state: State::Succeeded,
                    status: 201,
                    snapshot: Some(snapshot),
                    now_ms: now,
                    ttl_ms: TTL_MS,
                };
                let settled = stores[w].complete(&f.claim, &c).unwrap();
                let e = &mut execs[f.exec];
                if settled == Settled::Done {
                    assert!(!e.ended, "an owner that lost its claim completed it ({ctx})");
                    e.completed_at = Some(now);
                } else {
                    e.ended = true;
                }
            }
            6 => {
                if let Some(f) = in_flight[w].pop() {
                    let settled = stores[w].release(&f.claim).unwrap();
                    let e = &mut execs[f.exec];
                    if settled == Settled::Done {
                        assert!(!e.ended, "an owner that lost its claim released it ({ctx})");
                    }
                    e.ended = true;
                }
            }
            7 => {
                // Outcome unknown (timeout, reset, client gone): the claim is simply left.
                if !in_flight[w].is_empty() {
                    let i = rng.below(in_flight[w].len() as u64) as usize;
                    in_flight[w].swap_remove(i);
                }
            }
            8 => {
                stores[w].sweep(now).unwrap();
            }
            _ => now += rng.below(LEASE_MS / 2),
        }
    }
    let replays = counts.get("replayed").copied().unwrap_or(0);
    assert!(
        replays > 0 && counts.get("claimed").copied().unwrap_or(0) > 0,
        "the run exercised nothing: {counts:?}"
    );
}

#[test]
fn guarantees_hold_under_random_interleavings() {
    for seed in 1..=150u64 {
        let workers = 2 + (seed % 3) as usize;
        run(seed, workers, 64, 24, 600);
    }
}

#[test]
fn guarantees_hold_under_capacity_pressure() {
    for seed in 1000..1100u64 {
        run(seed, 3, 8, 40, 600);
    }
}
