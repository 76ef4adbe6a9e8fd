//! Reconciliation (`routes[].reconcile`, C23) over every order of the events around one key
//! whose first request's outcome is unknown: its lease ending, a retry on the Envoy that saw it,
//! a retry on a second Envoy, the first Envoy's own lookup at the lease's end, and the original's
//! late answer (its owner's completion arriving after all). The upstream's lookup answers found,
//! not found, or fails first and then answers either. Two Envoys share one store (as a fleet
//! shares etcd: both backends meet one contract), each with its own lookup gate. In every order:
//! at most one execution, no record settled twice, every replay is the one execution's answer,
//! and a last retry settles the key with exactly one execution.

#![allow(clippy::unwrap_used, clippy::panic)]

use idempotency_filter::config::{parse, Config};
use idempotency_filter::engine::{
    admit, claim_attempt, fingerprint_body, Admission, RequestHead, REPLAYED_HEADER,
};
use idempotency_filter::store::fake::permutations;
use idempotency_filter::store::fake::FakeSharedData;
use idempotency_filter::store::local::LocalStore;
use idempotency_filter::store::{Begin, ClaimAttempt, Settled, StoreAnswer, StoreOp};
use idempotency_filter::worker::flow::{Output, RequestFlow, Step, StreamFacts, Unreadable, Verdict};
use idempotency_filter::worker::reconcile::{answer_of, LaterLookup, LeaseEnd, LookupAnswer, LookupGate};

const LEASE_MS: u64 = 1_000;
const CONFIG: &str = r#"{"routes":[{"name":"pay","match":{"prefix":"/pay"},"require_key":true,
    "processing_timeout":"1s","ttl":"60s","reconcile":{"path":"/l/{key}","timeout":"500ms"}}]}"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    LeaseEnd,
    RetryA,
    RetryB,
    LookupAtLeaseEndA,
    LateOriginal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Upstream {
    /// The original executed and committed its answer.
    Found,
    /// The original never executed.
    NotFound,
    /// The first lookup fails, then the upstream answers as found / not found.
    FailedThen(bool),
}

struct Stream {
    now_ms: u64,
    owner: u64,
    headers: Vec<(String, Vec<u8>)>,
    response: Vec<(String, Vec<u8>)>,
    response_body: Vec<u8>,
    upstream_selected: bool,
}

impl Stream {
    fn new(now_ms: u64, owner: u64) -> Stream {
        let headers = [(":method", "POST"), (":path", "/pay"), (":authority", "a"), ("idempotency-key", "k")];
        Stream {
            now_ms,
            owner,
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect(),
            response: Vec::new(),
            response_body: Vec::new(),
            upstream_selected: false,
        }
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
        Ok(b"{}".to_vec())
    }
    fn response_headers(&mut self) -> Vec<(String, Vec<u8>)> {
        self.response.clone()
    }
    fn response_body(&mut self, _size: usize) -> Result<Vec<u8>, Unreadable> {
        Ok(self.response_body.clone())
    }
    fn property(&mut self, path: &[&str]) -> Result<Option<Vec<u8>>, Unreadable> {
        Ok(match path {
            ["response", "code_details"] if !self.response.is_empty() => Some(b"via_upstream".to_vec()),
            ["upstream", "address"] if self.upstream_selected => Some(b"10.0.0.1:80".to_vec()),
            _ => None,
        })
    }
}

/// One run's world: the shared store, each Envoy's gate, the upstream, what was observed.
struct World<'d> {
    cfg: Config,
    store: LocalStore<&'d FakeSharedData>,
    gates: [LookupGate<&'d FakeSharedData>; 2],
    upstream: Upstream,
    lookups: u32,
    /// The answer the upstream committed, once one execution did ("orig", or "retry-N").
    committed: Option<Vec<u8>>,
    executions: u32,
    completions: u32,
    replays: Vec<Vec<u8>>,
    now_ms: u64,
    owner: u64,
    later: Option<LaterLookup>,
    /// Envoy A's lease-end lookup, kept while it settled nothing.
    lease_end: Option<RequestFlow>,
    original: Option<idempotency_filter::store::Claim>,
}

impl World<'_> {
    fn lookup(&mut self) -> LookupAnswer {
        self.lookups += 1;
        let found = match self.upstream {
            Upstream::Found => true,
            Upstream::NotFound => false,
            Upstream::FailedThen(_) if self.lookups == 1 => {
                return LookupAnswer::Failed("the model's first lookup fails".into())
            }
            Upstream::FailedThen(found) => found,
        };
        // What the upstream committed, if anything did: the original's, or a retry's since.
        match (&self.committed, found) {
            (Some(body), _) => {
                let headers = vec![("content-type".to_string(), b"text/plain".to_vec())];
                answer_of(&self.cfg.rules[0], Some(201), headers, body.clone())
            }
            (None, _) => answer_of(&self.cfg.rules[0], Some(404), Vec::new(), Vec::new()),
        }
    }

    /// Carries out a flow's steps as the worker does: store operations at once, a lookup through
    /// Envoy `envoy`'s gate, a forwarded request executed by the upstream and answered 201.
    fn drive(&mut self, envoy: usize, flow: &mut RequestFlow, stream: &mut Stream, out: Output) {
        let mut verdict = out.verdict;
        let mut steps: std::collections::VecDeque<Step> = out.steps.into();
        let mut forwarded = false;
        while let Some(step) = steps.pop_front() {
            let more = match step {
                Step::Store(op) => {
                    let answer = StoreOp::perform(&op, &self.store);
                    if let (StoreOp::Complete { .. }, StoreAnswer::Settled(Ok(Settled::Done))) =
                        (&op, &answer)
                    {
                        self.completions += 1;
                    }
                    Some(flow.store_answered(&self.cfg, answer))
                }
                Step::Lookup { .. } => {
                    let scope = *flow.scope().unwrap();
                    match self.gates[envoy].start(&scope, self.now_ms, 500) {
                        Err(retry_after_ms) => Some(flow.lookup_refused(retry_after_ms)),
                        Ok(()) => {
                            let answer = self.lookup();
                            self.gates[envoy].finished(&scope, self.now_ms, self.now_ms);
                            Some(flow.lookup_answered(answer, self.now_ms))
                        }
                    }
                }
                Step::Reply { reply, .. } => {
                    if reply.headers.iter().any(|(n, _)| n == REPLAYED_HEADER) {
                        self.replays.push(reply.body);
                    }
                    None
                }
                Step::LookUpAtLeaseEnd(later) => {
                    self.later = Some(*later);
                    None
                }
                Step::Count(
                    idempotency_filter::metrics::Counter::Claimed
                    | idempotency_filter::metrics::Counter::TakenOver,
                ) => {
                    forwarded = true;
                    None
                }
                _ => None,
            };
            if let Some(more) = more {
                verdict = more.verdict;
                steps.extend(more.steps);
            }
        }
        if verdict == Verdict::Continue && forwarded && !flow.headless() {
            // The upstream executes the retry and answers; the filter captures and completes.
            self.executions += 1;
            let body = format!("retry-{}", self.owner).into_bytes();
            self.committed.get_or_insert(body.clone());
            stream.response = vec![(":status".into(), b"201".to_vec())];
            stream.response_body = body;
            let out = flow.response_headers(&self.cfg.clone(), stream, false);
            self.drive(envoy, flow, stream, out);
            let size = stream.response_body.len();
            let out = flow.response_body(stream, size, true);
            self.drive(envoy, flow, stream, out);
        }
    }

    fn retry(&mut self, envoy: usize) {
        self.owner += 1;
        let mut stream = Stream::new(self.now_ms, self.owner);
        let mut flow = RequestFlow::new(self.owner as u32);
        let out = flow.request_headers(&self.cfg.clone(), &mut stream, false);
        self.drive(envoy, &mut flow, &mut stream, out);
        let out = flow.request_body(&self.cfg.clone(), &mut stream, 2, true);
        self.drive(envoy, &mut flow, &mut stream, out);
    }

    /// Envoy A's root: its lease-end lookup, made (or made again, while it settled nothing).
    fn lookup_at_lease_end(&mut self) {
        let mut flow = match self.lease_end.take() {
            Some(flow) => flow,
            None => {
                let Some(later) = self.later.take() else { return };
                if self.now_ms < later.due_ms {
                    self.later = Some(later);
                    return;
                }
                self.owner += 1;
                let attempt: ClaimAttempt =
                    claim_attempt(&self.cfg, &later.pending, later.fingerprint, self.now_ms, self.owner);
                let lease_end =
                    LeaseEnd { cluster: "c".into(), headers: Vec::new(), timeout_ms: 500, attempt, tries: 0 };
                RequestFlow::lease_end(0, later, lease_end)
            }
        };
        let mut stream = Stream::new(self.now_ms, self.owner);
        let out = flow.lease_end_due(self.now_ms);
        self.drive(0, &mut flow, &mut stream, out);
        if flow.awaiting_lookup() {
            self.lease_end = Some(flow);
        }
    }
}

fn run(upstream: Upstream, order: &[Event]) {
    let data = FakeSharedData::new();
    let (gate_a, gate_b) = (FakeSharedData::new(), FakeSharedData::new());
    let gates = [LookupGate::new(&gate_a), LookupGate::new(&gate_b)];
    for gate in &gates {
        gate.create_keys().unwrap();
    }
    let mut w = World {
        cfg: parse(CONFIG.as_bytes()).unwrap(),
        store: LocalStore::open(&data, 64, [0; 32], 0).unwrap().keeping_abandoned_claims(true),
        gates,
        upstream,
        lookups: 0,
        committed: None,
        executions: 0,
        completions: 0,
        replays: Vec::new(),
        now_ms: 1,
        owner: 1,
        later: None,
        lease_end: None,
        original: None,
    };
    // The original, on Envoy A: claimed and forwarded; its outcome is unknown (no answer came),
    // so the record stays in flight and Envoy A keeps its lookup for the lease's end.
    let cfg = w.cfg.clone();
    let headers = Stream::new(1, 1).headers;
    let head =
        RequestHead { method: "POST", path: "/pay", headers: &headers, verified_claims: None, cluster: None };
    let Admission::Collect(pending) = admit(&cfg, &head) else { panic!("not admitted") };
    let fingerprint = fingerprint_body(&pending, b"{}").unwrap();
    let attempt = claim_attempt(&cfg, &pending, fingerprint, 1, 1);
    let Ok(Begin::Claimed(claim)) = w.store.begin(&attempt) else { panic!("not claimed") };
    w.original = Some(claim);
    w.later = Some(LaterLookup {
        pending,
        fingerprint,
        request: headers.clone(),
        due_ms: 1 + LEASE_MS + 2_000,
        route_cluster: None,
        owner: claim.owner,
    });
    if matches!(upstream, Upstream::Found | Upstream::FailedThen(true)) {
        w.executions += 1;
        w.committed = Some(b"orig".to_vec());
    }
    for event in order {
        match event {
            Event::LeaseEnd => w.now_ms = 1 + LEASE_MS + 2_000,
            Event::RetryA => w.retry(0),
            Event::RetryB => w.retry(1),
            Event::LookupAtLeaseEndA => w.lookup_at_lease_end(),
            Event::LateOriginal => {
                // The original owner's completion, arriving late (only an executed one has an
                // answer): taken over or settled meanwhile, it must change nothing.
                if let (Some(claim), Some(b"orig")) = (w.original, w.committed.as_deref()) {
                    let completion = idempotency_filter::store::Completion {
                        state: idempotency_filter::store::record::State::Succeeded,
                        status: 201,
                        snapshot: Some(idempotency_filter::store::record::Snapshot {
                            status: 201,
                            headers: Vec::new(),
                            body: b"orig".to_vec(),
                        }),
                        now_ms: w.now_ms,
                        ttl_ms: 60_000,
                    };
                    if w.store.complete(&claim, &completion).unwrap() == Settled::Done {
                        w.completions += 1;
                    }
                }
            }
        }
        let ctx = format!("{upstream:?} {order:?}");
        assert!(w.executions <= 1, "executed {} times: {ctx}", w.executions);
        assert!(w.completions <= 1, "settled {} times: {ctx}", w.completions);
        for body in &w.replays {
            assert_eq!(Some(body), w.committed.as_ref(), "replayed what was not executed: {ctx}");
        }
    }
    // A last retry, once any lookup may be made again, settles the key: one execution.
    w.now_ms += 10_000;
    w.retry(0);
    w.retry(1);
    w.now_ms += 2_000;
    let replays = w.replays.len();
    w.retry(0);
    let ctx = format!("{upstream:?} {order:?}");
    assert_eq!(w.executions, 1, "{ctx}");
    assert!(w.completions <= 1, "{ctx}");
    assert_eq!(w.replays.len(), replays + 1, "the last retry got no replay: {ctx}");
    for body in &w.replays {
        assert_eq!(Some(body), w.committed.as_ref(), "{ctx}");
    }
}

#[test]
fn every_order_executes_once_and_settles_once() {
    // The lease-end lookup twice: once it may settle nothing, and is asked again.
    let events = [
        Event::LeaseEnd,
        Event::RetryA,
        Event::RetryB,
        Event::LookupAtLeaseEndA,
        Event::LookupAtLeaseEndA,
        Event::LateOriginal,
    ];
    let mut runs = 0;
    for upstream in
        [Upstream::Found, Upstream::NotFound, Upstream::FailedThen(true), Upstream::FailedThen(false)]
    {
        for order in permutations(&events) {
            run(upstream, &order);
            runs += 1;
        }
    }
    assert_eq!(runs, 4 * 720);
}
