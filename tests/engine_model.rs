//! Model-based property test of the engine over the shared-data fake: random interleavings of
//! 2-4 simulated workers with random arrivals, completions, releases, abandoned requests,
//! lease and ttl expiries, sweeps and capacity pressure, checked against the guarantees:
//! - at most one execution per scope while a record for it is live (a lease not yet expired, or
//!   a completed response not yet expired);
//! - a replay returns exactly the response of an execution with the same scope and payload;
//! - an owner whose lease was taken over never completes (its late write is refused);
//! - no live record is evicted: while one lives, its scope is answered from it;
//! - with `unknown_outcome: "refuse"` (the default), a claim left without an outcome is never
//!   executed again: after its lease its scope answers 502 `outcome-unknown` until the ttl, and
//!   nothing is ever taken over. The model runs with both values;
//! - a claim lives as long as its owner (C25): each worker's root renews the claims its owners
//!   hold at every 100 ms tick, as the worker does (`renewal::Renewals`), so an owner whose
//!   upstream takes several leases is never taken over, refused or evicted while it waits; an
//!   owner that dies (its claim left) ends its claim a lease after its last renewal at most.

#![allow(clippy::unwrap_used, clippy::panic)]

use idempotency_filter::config::{parse, Config};
use idempotency_filter::metrics::Counter;
use idempotency_filter::renewal::Renewals;
use idempotency_filter::store::fake::FakeSharedData;
use idempotency_filter::store::local::LocalStore;
use idempotency_filter::store::{RecordStore, StoreOp};
use idempotency_filter::worker::flow::{Output, RequestFlow, Step, StreamFacts, Unreadable, Verdict};
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
    /// Its claim's owner token, and when it was claimed.
    owner: u64,
    started: u64,
    /// Its claim's lease end: one lease after the claim, then after each renewal of it.
    lease_deadline: u64,
    /// Its owner is still at work (its request forwarded, its answer not yet in).
    alive: bool,
    /// Set once the store accepted its completion: (completed at, response body). For a claim
    /// left without an outcome on a refusing rule: when a retry completed it as outcome unknown.
    completed_at: Option<u64>,
    /// Completed as outcome unknown (never replayed).
    unknown: bool,
    /// Released or abandoned or lost: no longer holds the record.
    ended: bool,
}

/// A request the model forwarded: its flow goes on with the upstream's answer.
struct InFlight {
    exec: usize,
    flow: RequestFlow,
}

fn config(capacity: u32, unknown_outcome: &str) -> Config {
    let json = format!(
        // Quotas are lifted here: this model checks execution and replay guarantees; the quota
        // has its own model below (`quotas_and_eviction_hold_under_random_interleavings`).
        r#"{{"store":{{"type":"local","capacity":{capacity}}},"quota":{{"per_tenant":10000000,"per_principal":10000000}},"routes":[{{"name":"r","match":{{"prefix":"/"}},
        "require_key":true,"ttl":"{TTL_MS}ms","processing_timeout":"{LEASE_MS}ms","unknown_outcome":"{unknown_outcome}"}}]}}"#
    );
    parse(json.as_bytes()).unwrap()
}

/// One stream as the flow reads it: the request of `scope_key` with `body`, and the upstream's
/// answer once there is one. Scope = (principal, key): spread over two principals so that equal
/// keys of different callers are different scopes.
struct Stream {
    now_ms: u64,
    owner: u64,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    response: Vec<(String, Vec<u8>)>,
    response_body: Vec<u8>,
}

impl Stream {
    fn request(scope_key: u64, body: &str, now_ms: u64, owner: u64) -> Stream {
        Stream {
            now_ms,
            owner,
            headers: vec![
                (":method".to_string(), b"POST".to_vec()),
                (":path".to_string(), b"/orders".to_vec()),
                ("idempotency-key".to_string(), format!("key-{}", scope_key / 2).into_bytes()),
                ("authorization".to_string(), format!("caller-{}", scope_key % 2).into_bytes()),
            ],
            body: body.as_bytes().to_vec(),
            response: Vec::new(),
            response_body: Vec::new(),
        }
    }

    /// The upstream's answer, as Envoy's router hands it on (with its service-time header).
    fn answered(now_ms: u64, status: u16, body: Vec<u8>) -> Stream {
        let mut s = Stream::request(0, "", now_ms, 0);
        s.response = vec![
            (":status".to_string(), status.to_string().into_bytes()),
            ("x-envoy-upstream-service-time".to_string(), b"1".to_vec()),
        ];
        s.response_body = body;
        s
    }
}

impl StreamFacts for Stream {
    fn now_ms(&mut self) -> u64 {
        self.now_ms
    }
    fn owner_token(&mut self) -> u64 {
        self.owner
    }
    fn request_header(&mut self, name: &str) -> Option<Vec<u8>> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }
    fn request_headers(&mut self) -> Result<Vec<(String, Vec<u8>)>, Unreadable> {
        Ok(self.headers.clone())
    }
    fn request_body(&mut self, _size: usize) -> Result<Vec<u8>, Unreadable> {
        Ok(self.body.clone())
    }
    fn response_headers(&mut self) -> Vec<(String, Vec<u8>)> {
        self.response.clone()
    }
    fn response_body(&mut self, _size: usize) -> Result<Vec<u8>, Unreadable> {
        Ok(self.response_body.clone())
    }
    fn property(&mut self, _path: &[&str]) -> Result<Option<Vec<u8>>, Unreadable> {
        Ok(None)
    }
}

/// Carries out the flow's steps as the worker does with the local store (a store operation is
/// answered at once and its answer goes back to the flow; a claim held or let go is the
/// worker's `renewals`'): the counters and the reply, if any.
fn carry_out(
    cfg: &Config,
    flow: &mut RequestFlow,
    store: &dyn RecordStore,
    renewals: &mut Renewals,
    out: Output,
) -> (Vec<Counter>, Option<Vec<u8>>, Verdict) {
    let (mut counted, mut reply, mut verdict) = (Vec::new(), None, out.verdict);
    let mut steps: std::collections::VecDeque<Step> = out.steps.into();
    while let Some(step) = steps.pop_front() {
        match step {
            Step::Count(c) => counted.push(c),
            Step::Reply { reply: r, .. } => reply = Some(r.body),
            Step::Store(op) => {
                let more = flow.store_answered(cfg, StoreOp::perform(&op, store));
                verdict = more.verdict;
                steps.extend(more.steps);
            }
            Step::Hold(hold) => assert!(renewals.hold(hold), "a worker of the model holds few claims"),
            Step::LetGo(owner) => {
                renewals.let_go(owner);
            }
            Step::Wake(_) | Step::FixHeaders(_) => {}
            other => panic!("the model's route does not {other:?}"),
        }
    }
    (counted, reply, verdict)
}

/// One run; what it counted, by outcome.
fn run(
    seed: u64,
    workers: usize,
    capacity: u32,
    scopes: u64,
    steps: usize,
    refuse: bool,
) -> HashMap<&'static str, u32> {
    let cfg = config(capacity, if refuse { "refuse" } else { "takeover" });
    let data = FakeSharedData::new();
    // As the plugin opens them: while a rule refuses, abandoned claims keep their place.
    let stores: Vec<LocalStore<&FakeSharedData>> = (0..workers)
        .map(|w| {
            LocalStore::open(&data, capacity, [w as u8; 32], 0).unwrap().keeping_abandoned_claims(refuse)
        })
        .collect();
    let mut rng = Lcg(seed);
    let mut now = 1u64;
    let mut execs: Vec<Execution> = Vec::new();
    let mut in_flight: Vec<Vec<InFlight>> = (0..workers).map(|_| Vec::new()).collect();
    let mut renewals: Vec<Renewals> = (0..workers).map(|_| Renewals::default()).collect();
    let mut owner = 0u64;
    let mut counts: HashMap<&'static str, u32> = HashMap::new();

    for step in 0..steps {
        let w = rng.below(workers as u64) as usize;
        let ctx = format!("seed {seed} step {step} worker {w} now {now}");
        match rng.below(10) {
            0..=3 => {
                // A request arrives: headers, then its whole body, as Envoy delivers them.
                let scope_key = rng.below(scopes);
                let payload = rng.below(3).min(1); // mostly the same payload
                owner += 1;
                let body = format!("payload-{payload}");
                let mut stream = Stream::request(scope_key, &body, now, owner);
                let mut flow = RequestFlow::new(step as u32);
                let held = flow.request_headers(&cfg, &mut stream, false);
                assert_eq!(held.verdict, Verdict::Pause, "a protected request is held for its body ({ctx})");
                let out = flow.request_body(&cfg, &mut stream, body.len(), true);
                let (counted, reply, verdict) = carry_out(&cfg, &mut flow, &stores[w], &mut renewals[w], out);
                let counter = match counted.as_slice() {
                    [c] => *c,
                    other => panic!("one outcome per request, got {other:?} ({ctx})"),
                };
                *counts.entry(counter.name()).or_default() += 1;
                match (counter, verdict) {
                    (Counter::TakenOver, _) if refuse => panic!("taken over on a refusing rule ({ctx})"),
                    (Counter::UnknownRefused, Verdict::Pause) => {
                        assert!(refuse, "502 outcome-unknown on a takeover rule ({ctx})");
                        let same = |e: &Execution| e.scope_key == scope_key && e.payload == payload;
                        // Marked earlier and still within its ttl, or left without an outcome
                        // and past its lease: this retry marks it now.
                        let marked = execs.iter().any(|e| {
                            same(e) && e.unknown && e.completed_at.is_some_and(|c| now < c + TTL_MS)
                        });
                        if !marked {
                            let left = execs.iter_mut().find(|e| {
                                same(e) && !e.ended && e.completed_at.is_none() && now >= e.lease_deadline
                            });
                            let left = left
                                .unwrap_or_else(|| panic!("outcome unknown without a claim left ({ctx})"));
                            left.completed_at = Some(now);
                            left.unknown = true;
                        }
                    }
                    (Counter::Claimed | Counter::TakenOver, Verdict::Continue) => {
                        for e in execs.iter().filter(|e| e.scope_key == scope_key) {
                            // An owner still at work keeps its claim whatever its first lease said.
                            assert!(!e.alive, "a live owner's claim executed again: {e:?} ({ctx})");
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
                            owner,
                            started: now,
                            alive: true,
                            lease_deadline: now + LEASE_MS,
                            completed_at: None,
                            unknown: false,
                            ended: false,
                        });
                        in_flight[w].push(InFlight { exec: execs.len() - 1, flow });
                    }
                    (Counter::Replayed, Verdict::Pause) => {
                        let body = reply.unwrap_or_else(|| panic!("a replay without a reply ({ctx})"));
                        let id: usize =
                            String::from_utf8_lossy(&body).trim_start_matches("exec-").parse().unwrap();
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
                    (Counter::Mismatch, Verdict::Pause) => {
                        let live_other = execs.iter().any(|e| {
                            e.scope_key == scope_key
                                && e.payload != payload
                                && (e
                                    .completed_at
                                    .map_or(now < e.lease_deadline + TTL_MS, |c| now < c + TTL_MS))
                        });
                        assert!(live_other, "mismatch without a record of another payload ({ctx})");
                    }
                    (Counter::InFlight | Counter::StoreFull, Verdict::Pause) => {}
                    other => panic!("unexpected {other:?} ({ctx})"),
                }
            }
            4..=5 => {
                // The upstream answers 201: the flow captures it and completes the record.
                if in_flight[w].is_empty() {
                    continue;
                }
                let i = rng.below(in_flight[w].len() as u64) as usize;
                let mut f = in_flight[w].swap_remove(i);
                let body = format!("exec-{}", f.exec).into_bytes();
                let mut stream = Stream::answered(now, 201, body.clone());
                let out = f.flow.response_headers(&cfg, &mut stream, false);
                let (mut counted, _, _) = carry_out(&cfg, &mut f.flow, &stores[w], &mut renewals[w], out);
                let out = f.flow.response_body(&mut stream, body.len(), true);
                counted.extend(carry_out(&cfg, &mut f.flow, &stores[w], &mut renewals[w], out).0);
                let e = &mut execs[f.exec];
                e.alive = false;
                if now - e.started >= 2 * LEASE_MS {
                    *counts.entry("answered_after_two_leases").or_default() += 1;
                }
                match counted.as_slice() {
                    [Counter::Stored] => {
                        assert!(!e.ended, "an owner that lost its claim completed it ({ctx})");
                        e.completed_at = Some(now);
                    }
                    [Counter::CompletionLost] => e.ended = true,
                    other => panic!("a completion counts stored or lost, got {other:?} ({ctx})"),
                }
            }
            6 => {
                // The upstream answers 503 (a released status): the flow gives the claim back.
                if let Some(mut f) = in_flight[w].pop() {
                    let mut stream = Stream::answered(now, 503, Vec::new());
                    let out = f.flow.response_headers(&cfg, &mut stream, true);
                    let (counted, _, _) = carry_out(&cfg, &mut f.flow, &stores[w], &mut renewals[w], out);
                    let e = &mut execs[f.exec];
                    e.alive = false;
                    if counted.contains(&Counter::Released) {
                        assert!(!e.ended, "an owner that lost its claim released it ({ctx})");
                    }
                    e.ended = true;
                }
            }
            7 => {
                // Outcome unknown (timeout, reset, client gone), or its Envoy died: the claim is
                // simply left, and no longer renewed.
                if !in_flight[w].is_empty() {
                    let i = rng.below(in_flight[w].len() as u64) as usize;
                    let f = in_flight[w].swap_remove(i);
                    let e = &mut execs[f.exec];
                    e.alive = false;
                    renewals[w].let_go(e.owner);
                }
            }
            8 => {
                stores[w].sweep(now).unwrap();
            }
            _ => {
                // Time passes; every worker's root ticks each 100 ms and renews its owners'
                // claims that are due, as the worker does.
                let until = now + rng.below(LEASE_MS / 2);
                while now < until {
                    now = (now + 100).min(until);
                    for (w, r) in renewals.iter_mut().enumerate() {
                        for renew in r.due(now) {
                            let kept = stores[w].renew(&renew).unwrap();
                            let out = r.answered(&renew, Ok(&kept));
                            assert!(out.lost.is_empty(), "a live owner's claim lost at {now} ({ctx})");
                            *counts.entry("renewed").or_default() += u32::try_from(out.kept).unwrap();
                            for c in &renew.claims {
                                let e = execs.iter_mut().find(|e| e.owner == c.owner && e.alive).unwrap();
                                e.lease_deadline = (now + LEASE_MS).min(e.started + TTL_MS);
                            }
                        }
                    }
                }
            }
        }
    }

    let replays = counts.get("replayed").copied().unwrap_or(0);
    assert!(
        replays > 0 && counts.get("claimed").copied().unwrap_or(0) > 0,
        "the run exercised nothing: {counts:?}"
    );
    counts
}

/// Every run of a test together exercised what an unknown outcome leads to for that value, and
/// owners whose upstream answered after two leases or more, renewed meanwhile.
fn assert_unknown_outcomes_exercised(totals: &HashMap<&'static str, u32>, refuse: bool) {
    let seen = totals.get(if refuse { "unknown_refused" } else { "taken_over" }).copied().unwrap_or(0);
    assert!(seen > 0, "no run reached an unknown outcome's lease end: {totals:?}");
    let long = totals.get("answered_after_two_leases").copied().unwrap_or(0);
    let renewed = totals.get("renewed").copied().unwrap_or(0);
    assert!(long > 0 && renewed > 0, "no owner outlived two leases: {totals:?}");
}

fn add(totals: &mut HashMap<&'static str, u32>, counts: HashMap<&'static str, u32>) {
    for (k, v) in counts {
        *totals.entry(k).or_default() += v;
    }
}

#[test]
fn guarantees_hold_under_random_interleavings() {
    for refuse in [true, false] {
        let mut totals = HashMap::new();
        for seed in 1..=150u64 {
            let workers = 2 + (seed % 3) as usize;
            add(&mut totals, run(seed, workers, 64, 24, 600, refuse));
        }
        assert_unknown_outcomes_exercised(&totals, refuse);
    }
}

#[test]
fn guarantees_hold_under_capacity_pressure() {
    for refuse in [true, false] {
        let mut totals = HashMap::new();
        for seed in 1000..1100u64 {
            add(&mut totals, run(seed, 3, 8, 40, 600, refuse));
        }
        assert_unknown_outcomes_exercised(&totals, refuse);
    }
}

/// Store-level model with quotas and eviction: every arrival is charged to its scope's tenant
/// and principal, the store is small enough that abandoned claims get evicted, and the model
/// predicts what the store may and must answer:
/// - a new record is never claimed while its tenant or principal already holds its bound of
///   live records (the store must refuse), and a quota refusal only comes when the identity has
///   that many records the store may still count (charged in the counter's current epoch, not
///   released, not replaced, the counter not healed);
/// - no live record is ever evicted: probing a live scope with another payload is a mismatch;
/// - never two owners executing one scope while a record lives; an evicted or taken-over owner
///   never completes.
mod quota_model {
    use super::Lcg;
    use idempotency_filter::identity::fingerprint::Fingerprint;
    use idempotency_filter::identity::scope::ScopeId;
    use idempotency_filter::store::fake::FakeSharedData;
    use idempotency_filter::store::local::LocalStore;
    use idempotency_filter::store::record::{Snapshot, State};
    use idempotency_filter::store::{
        Begin, Claim, ClaimAttempt, Completion, OnLeaseEnd, QuotaCharge, RecordStore, Settled,
    };
    use std::collections::HashMap;

    const LEASE: u64 = 1_000;
    const TTL: u64 = 4_000;
    const PRINCIPALS: u64 = 6;
    const TENANTS: u64 = 2;
    const PER_PRINCIPAL: u32 = 3;
    const PER_TENANT: u32 = 8;

    #[derive(Debug, Clone)]
    struct Exec {
        scope: u64,
        payload: u8,
        claim: Claim,
        /// The record this execution belongs to (the index of the execution that created it;
        /// takeovers keep it) and when it was charged.
        record: usize,
        charged_at: u64,
        lease_deadline: u64,
        completed_at: Option<u64>,
        /// Released, lost, replaced or abandoned-and-gone: it no longer holds the record.
        ended: bool,
        released: bool,
    }

    impl Exec {
        fn live(&self, now: u64) -> bool {
            match self.completed_at {
                Some(c) => now < c + TTL,
                None => !self.ended && now < self.lease_deadline,
            }
        }
    }

    #[derive(Debug, Clone, Copy, Default)]
    struct Epoch {
        since: u64,
        until: u64,
    }

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Id {
        Tenant(u64),
        Principal(u64),
    }

    fn ids(scope: u64) -> [(Id, u32); 2] {
        [(Id::Tenant(scope % TENANTS), PER_TENANT), (Id::Principal(scope % PRINCIPALS), PER_PRINCIPAL)]
    }

    fn scope_id(n: u64) -> ScopeId {
        use sha2::{Digest, Sha256};
        ScopeId(Sha256::digest(n.to_be_bytes()).into())
    }

    fn attempt(scope: u64, payload: u8, owner: u64, now: u64, quota: bool) -> ClaimAttempt {
        ClaimAttempt {
            scope: scope_id(scope),
            fingerprint: Fingerprint([payload; 32]),
            owner,
            now_ms: now,
            lease_ms: LEASE,
            ttl_ms: TTL,
            quota: quota.then(|| QuotaCharge {
                tenant: Some([(scope % TENANTS) as u8; 32]),
                principal: Some([100 + (scope % PRINCIPALS) as u8; 32]),
                per_tenant: PER_TENANT,
                per_principal: PER_PRINCIPAL,
            }),
            on_lease_end: OnLeaseEnd::TakeOver,
            label: None,
            tombstone_ms: 0,
        }
    }

    struct Model {
        execs: Vec<Exec>,
        epochs: HashMap<Id, Epoch>,
    }

    impl Model {
        fn live_count(&self, id: Id, now: u64) -> u32 {
            self.execs.iter().filter(|e| e.live(now) && ids(e.scope).iter().any(|(i, _)| *i == id)).count()
                as u32
        }

        /// Records the store may still count for `id`: charged in the current epoch, not
        /// released and not replaced by a newer record of their scope.
        fn countable(&self, id: Id, now: u64) -> u32 {
            let epoch = self.epochs.get(&id).copied().unwrap_or_default();
            if now >= epoch.until {
                return 0;
            }
            let mut records: Vec<usize> = Vec::new();
            for e in &self.execs {
                let newest = self.execs.iter().filter(|x| x.scope == e.scope).map(|x| x.record).max();
                if ids(e.scope).iter().any(|(i, _)| *i == id)
                    && e.charged_at >= epoch.since
                    && newest == Some(e.record)
                    && !self.execs.iter().any(|x| x.record == e.record && x.released)
                    && !records.contains(&e.record)
                {
                    records.push(e.record);
                }
            }
            records.len() as u32
        }

        fn charge(&mut self, scope: u64, now: u64) {
            for (id, _) in ids(scope) {
                let epoch = self.epochs.entry(id).or_default();
                if now >= epoch.until {
                    *epoch = Epoch { since: now, until: now + LEASE + TTL };
                } else {
                    epoch.until = epoch.until.max(now + LEASE + TTL);
                }
            }
        }

        fn extend(&mut self, scope: u64, charged_at: u64, until: u64) {
            for (id, _) in ids(scope) {
                let epoch = self.epochs.entry(id).or_default();
                if charged_at >= epoch.since && now_lt(charged_at, epoch.until) {
                    epoch.until = epoch.until.max(until);
                }
            }
        }
    }

    fn now_lt(a: u64, b: u64) -> bool {
        a < b
    }

    pub fn run(
        seed: u64,
        workers: usize,
        capacity: u32,
        scopes: u64,
        steps: usize,
    ) -> HashMap<&'static str, u32> {
        let data = FakeSharedData::new();
        let stores: Vec<LocalStore<&FakeSharedData>> =
            (0..workers).map(|w| LocalStore::open(&data, capacity, [w as u8; 32], 0).unwrap()).collect();
        let mut rng = Lcg(seed);
        let mut now = 1u64;
        let mut m = Model { execs: Vec::new(), epochs: HashMap::new() };
        let mut in_flight: Vec<Vec<usize>> = (0..workers).map(|_| Vec::new()).collect();
        let mut owner = 0u64;
        let mut counts: HashMap<&'static str, u32> = HashMap::new();

        for step in 0..steps {
            let w = rng.below(workers as u64) as usize;
            let ctx = format!("seed {seed} step {step} worker {w} now {now}");
            match rng.below(12) {
                0..=4 => {
                    let scope = rng.below(scopes);
                    let payload = rng.below(4).min(1) as u8;
                    owner += 1;
                    let begin = stores[w].begin(&attempt(scope, payload, owner, now, true)).unwrap();
                    let prior_live = m.execs.iter().any(|e| e.scope == scope && e.live(now));
                    match begin {
                        Begin::Claimed(claim) => {
                            *counts.entry("claimed").or_default() += 1;
                            assert!(!prior_live, "new record while one lives ({ctx})");
                            for (id, bound) in ids(scope) {
                                assert!(
                                    m.live_count(id, now) < bound,
                                    "{id:?} already holds {bound} live records, yet a new one was claimed ({ctx})"
                                );
                            }
                            for e in m.execs.iter_mut().filter(|e| e.scope == scope) {
                                e.ended = true;
                            }
                            m.charge(scope, now);
                            m.execs.push(Exec {
                                scope,
                                payload,
                                claim,
                                record: m.execs.len(),
                                charged_at: now,
                                lease_deadline: now + LEASE,
                                completed_at: None,
                                ended: false,
                                released: false,
                            });
                            in_flight[w].push(m.execs.len() - 1);
                        }
                        Begin::TookOver(claim) => {
                            *counts.entry("taken_over").or_default() += 1;
                            assert!(!prior_live, "takeover while the record lives ({ctx})");
                            let prev = m
                                .execs
                                .iter()
                                .rposition(|e| e.scope == scope && e.completed_at.is_none() && !e.released)
                                .unwrap_or_else(|| panic!("takeover of nothing ({ctx})"));
                            let (record, charged_at) = (m.execs[prev].record, m.execs[prev].charged_at);
                            m.execs[prev].ended = true;
                            m.extend(scope, charged_at, now + LEASE + TTL);
                            m.execs.push(Exec {
                                scope,
                                payload,
                                claim,
                                record,
                                charged_at,
                                lease_deadline: now + LEASE,
                                completed_at: None,
                                ended: false,
                                released: false,
                            });
                            in_flight[w].push(m.execs.len() - 1);
                        }
                        Begin::Replay(s) => {
                            *counts.entry("replayed").or_default() += 1;
                            let id: usize =
                                String::from_utf8_lossy(&s.body).trim_start_matches("exec-").parse().unwrap();
                            let e = &m.execs[id];
                            assert_eq!(
                                (e.scope, e.payload),
                                (scope, payload),
                                "replay of another request ({ctx})"
                            );
                            assert!(
                                e.completed_at.is_some() && e.live(now),
                                "replay of a dead record ({ctx})"
                            );
                        }
                        Begin::NotStored { .. } => {
                            *counts.entry("not_stored").or_default() += 1;
                            assert!(
                                m.execs
                                    .iter()
                                    .any(|e| e.scope == scope && e.completed_at.is_some() && e.live(now)),
                                "not-stored answer without a completed record ({ctx})"
                            );
                        }
                        Begin::OutcomeUnknown => {
                            panic!("an unknown outcome, but the model never completes one as unknown ({ctx})")
                        }
                        Begin::Unsettled => {
                            panic!("an unsettled record, but the model's attempts never reconcile ({ctx})")
                        }
                        Begin::Expired { .. } => {
                            panic!("a tombstone, but the model's attempts keep none ({ctx})")
                        }
                        Begin::Mismatch => {
                            assert!(
                                m.execs.iter().any(|e| e.scope == scope
                                    && e.payload != payload
                                    // An abandoned claim still names its payload until its ttl.
                                    && (e.live(now)
                                        || (e.completed_at.is_none()
                                            && !e.released
                                            && now < e.lease_deadline - LEASE + TTL))),
                                "mismatch without a record of another payload ({ctx})"
                            );
                        }
                        Begin::InFlight { .. } => {
                            assert!(
                                m.execs
                                    .iter()
                                    .any(|e| e.scope == scope && e.completed_at.is_none() && e.live(now)),
                                "in flight without a live claim ({ctx})"
                            );
                        }
                        Begin::Full { .. } => *counts.entry("full").or_default() += 1,
                        Begin::QuotaExceeded { tenant, .. } => {
                            *counts.entry("quota").or_default() += 1;
                            assert!(!prior_live, "an existing record's answer was charged ({ctx})");
                            let (id, bound) = ids(scope)[usize::from(!tenant)];
                            assert!(
                                m.countable(id, now) >= bound,
                                "{id:?} refused with only {} countable records ({ctx})",
                                m.countable(id, now)
                            );
                        }
                    }
                }
                5..=6 => {
                    if in_flight[w].is_empty() {
                        continue;
                    }
                    let i = rng.below(in_flight[w].len() as u64) as usize;
                    let x = in_flight[w].swap_remove(i);
                    // Now and then the response is cut after its status: kept without a body.
                    let body = (rng.below(5) > 0).then(|| Snapshot {
                        status: 201,
                        headers: vec![],
                        body: format!("exec-{x}").into_bytes(),
                    });
                    let c = Completion {
                        state: State::Succeeded,
                        status: 201,
                        snapshot: body,
                        now_ms: now,
                        ttl_ms: TTL,
                    };
                    let settled = stores[w].complete(&m.execs[x].claim, &c).unwrap();
                    if settled == Settled::Done {
                        assert!(!m.execs[x].ended, "an owner that lost its claim completed it ({ctx})");
                        m.execs[x].completed_at = Some(now);
                        if now > m.execs[x].lease_deadline {
                            let (scope, charged_at) = (m.execs[x].scope, m.execs[x].charged_at);
                            m.extend(scope, charged_at, now + TTL);
                        }
                    } else {
                        m.execs[x].ended = true;
                    }
                }
                7 => {
                    if let Some(x) = in_flight[w].pop() {
                        let settled = stores[w].release(&m.execs[x].claim).unwrap();
                        if settled == Settled::Done {
                            assert!(!m.execs[x].ended, "an owner that lost its claim released it ({ctx})");
                            m.execs[x].released = true;
                        }
                        m.execs[x].ended = true;
                    }
                }
                8 => {
                    // Counter unknown: the claim is simply left (abandoned).
                    if !in_flight[w].is_empty() {
                        let i = rng.below(in_flight[w].len() as u64) as usize;
                        in_flight[w].swap_remove(i);
                    }
                }
                9 => {
                    stores[w].sweep(now).unwrap();
                }
                10 => {
                    // Probe a scope the model believes live with another payload: a live record
                    // answers Mismatch; an evicted or forgotten one would be claimed.
                    let live: Vec<u64> = m.execs.iter().filter(|e| e.live(now)).map(|e| e.scope).collect();
                    if live.is_empty() {
                        continue;
                    }
                    let scope = live[rng.below(live.len() as u64) as usize];
                    owner += 1;
                    let probe = stores[w].begin(&attempt(scope, 99, owner, now, false)).unwrap();
                    assert_eq!(probe, Begin::Mismatch, "live record of scope {scope} is gone ({ctx})");
                }
                _ => now += rng.below(LEASE / 2),
            }
        }
        counts
    }
}

#[test]
fn quotas_and_eviction_hold_under_random_interleavings() {
    let mut total: HashMap<&'static str, u32> = HashMap::new();
    for seed in 1..=120u64 {
        let workers = 2 + (seed % 3) as usize;
        // 16 records in 2 buckets: capacity pressure and eviction; 64: the quota binds first.
        let capacity = if seed % 2 == 0 { 16 } else { 64 };
        for (k, v) in quota_model::run(seed, workers, capacity, 24, 700) {
            *total.entry(k).or_default() += v;
        }
    }
    for outcome in ["claimed", "taken_over", "replayed", "not_stored", "full", "quota"] {
        assert!(total.get(outcome).copied().unwrap_or(0) > 0, "the runs never saw {outcome}: {total:?}");
    }
}
