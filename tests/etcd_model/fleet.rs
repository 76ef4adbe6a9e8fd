//! The fleet: Envoys that drive the product's own etcd conversations (`EtcdStore::start`,
//! `EtcdConversation::step`) against the model etcd over a network that delays, reorders and
//! loses their callouts, with skewed clocks, crashes, completion retries and reconciliation
//! lookups: every interleaving of them is explored (`explore.rs`).
//!
//! Real: everything the store decides (the calls, their guards, what each answer means, the
//! lease caches of each worker, the give-back of an unanswered claim), and which claims an
//! owner still at work renews, and when (`renewal::Renewals`, the product's own, with its
//! `StoreOp::Renew` conversations). Modelled, after the worker (which builds for wasm32 and the
//! crate's own unit tests only): what an Envoy does with a store answer (forward on a claim,
//! retry a failed completion as the root does (`flow::Retry`, the product's own, its window
//! following the claim's renewals), give back a claim whose answer was lost, look up an
//! unsettled record), the root's ticks that renew, and the upstream, which may take several
//! leases to answer (`Fleet::upstream_ticks`).

use crate::etcd::Etcd;
use idempotency_filter::config::UnknownOutcome;
use idempotency_filter::engine::on_lease_end;
use idempotency_filter::identity::fingerprint::Fingerprint;
use idempotency_filter::identity::scope::ScopeId;
use idempotency_filter::renewal::{Hold, Renewals};
use idempotency_filter::store::etcd::shards::moving::{Leg, Moving};
use idempotency_filter::store::etcd::shards::on_shard;
use idempotency_filter::store::etcd::{EtcdConversation, EtcdSettings, EtcdStore, OnStoreError, Protocol};
use idempotency_filter::store::record::{self, Snapshot, State};
use idempotency_filter::store::remote::{Answer, Next, Request};
use idempotency_filter::store::{
    Begin, Claim, ClaimAttempt, Completion, Renew, Settled, StoreAnswer, StoreError, StoreOp,
};
use idempotency_filter::worker::flow::{retry_window_end, Retry};
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

pub const EXECUTIONS: &str = "at most one execution per key, but a takeover the rule allows";
pub const REPLACED: &str = "a stored outcome is never replaced";
pub const REPLAYS: &str = "every replay is the stored outcome";
pub const SCOPES: &str = "no request of another scope reads a record";
pub const IN_FLIGHT: &str = "no record stays in flight past its lease plus the bound";
pub const OUTCOMES_KEPT: &str = "an outcome its live owner was answered with is kept";
pub const RENEWALS: &str = "a claim its live owner renews is never found lost";

/// What the checker must reach somewhere (`FleetState::seen`; which, depends on the rule).
pub const SEEN_REPLAY: u16 = 1;
pub const SEEN_EXECUTED_AGAIN: u16 = 2;
pub const SEEN_RETRY_LANDED: u16 = 4;
pub const SEEN_ADOPTED: u16 = 8;
pub const SEEN_MARKED_UNKNOWN: u16 = 16;
pub const SEEN_GIVEN_BACK: u16 = 32;
pub const SEEN_ANSWER_LOST: u16 = 64;
pub const SEEN_RENEWED: u16 = 128;
pub const SEEN_TOMBSTONE: u16 = 256;

/// The names of the `SEEN_*` flags, in bit order.
pub const REACHED: [&str; 9] = [
    "a replay",
    "a takeover executed again",
    "a settlement tried again landed",
    "a lookup's answer recorded",
    "an outcome-unknown answer",
    "an unanswered claim given back",
    "an answer lost after etcd applied its call",
    "a claim renewed while its owner waited for the upstream",
    "a retry after the ttl answered by the tombstone",
];

/// The names of the flags set in `seen`.
pub fn reached(seen: u16) -> Vec<&'static str> {
    REACHED.iter().enumerate().filter(|(i, _)| seen & (1 << i) != 0).map(|(_, name)| *name).collect()
}

/// What the checker explores: the fleet's size and what may go wrong in it.
#[derive(Debug, Clone)]
pub struct Fleet {
    /// Each Envoy's clock ahead of etcd's, in ms (their differences are the skew).
    pub skews_ms: Vec<u64>,
    /// Each Envoy's client requests, one after the other: (scope, begins it may make). Scope 0
    /// is the key everyone retries; scope 1 is the same key under another tenant.
    pub requests: Vec<Vec<(u8, u8)>>,
    pub rule: UnknownOutcome,
    /// Callouts that time out (their request lost or delayed, or their answer lost after etcd
    /// applied them) and reconciliation lookups that fail, in all.
    pub faults: u8,
    /// Whether faults may also strike begins and lookups (false: completions and releases only,
    /// so that a run can afford several of them).
    pub begin_faults: bool,
    pub crashes: u8,
    pub tick_ms: u64,
    pub horizon_ms: u64,
    pub lease_ms: u64,
    pub ttl_ms: u64,
    /// The rule's `tombstone_ttl` (0: none): a record's tombstone stands this long after its
    /// completion.
    pub tombstone_ms: u64,
    /// Each Envoy's shard list, while the record's home moves from etcd 0 to etcd 1 (missing:
    /// `Old`, the one etcd every run without a change has).
    pub lists: Vec<List>,
    /// How many ticks the upstream takes to answer a forwarded request (0: at once, within its
    /// lease, as before renewals). More than a lease: its owner renews its claim meanwhile.
    pub upstream_ticks: u64,
}

/// The shard list an Envoy runs with while the records' home moves from etcd 0 (the old list's
/// home) to etcd 1 (the new list's): the three kinds of Envoys of a rolling change
/// (docs/ETCD.md, Shards).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum List {
    /// The old list: etcd 0 only.
    Old,
    /// The new list with the old one as `previous_shards`: the product's `Moving` plan over both.
    Moving,
    /// The new list alone: etcd 1 only.
    New,
}

/// A product value without `Hash` (a claim, an attempt, an operation), told apart by all it
/// holds: its derived `Debug` shows every field.
#[derive(Clone, Debug)]
pub struct Dbg<T>(pub T);

impl<T: std::fmt::Debug> Hash for Dbg<T> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        format!("{:?}", self.0).hash(h);
    }
}

/// A worker's store: its conversations' lease caches. Told apart by what it keeps.
#[derive(Clone, Debug)]
pub struct Worker(EtcdStore);

impl Hash for Worker {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.cached_state().hash(h);
    }
}

/// A conversation in progress and its callout out.
#[derive(Clone, Debug)]
pub struct Conv {
    conversation: EtcdConversation,
    /// The etcd it talks to.
    etcd: u8,
    call: u32,
    /// The tick its call went out in. A callout's timeout (250 ms) is shorter than a tick: time
    /// moves on only once it is answered or timed out (its request may still reach etcd later).
    sent_tick: u64,
}

impl Conv {
    fn key(&self) -> String {
        format!("{:?}", self.conversation)
    }
}
impl Hash for Conv {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.key().hash(h);
        self.etcd.hash(h);
        self.call.hash(h);
        self.sent_tick.hash(h);
    }
}

#[derive(Clone, Debug, Hash)]
pub enum Phase {
    /// Its client (re)sends it when it has begins left.
    Idle,
    /// Its begin is under way; `adopt`: after a lookup found the execution, its answer is
    /// recorded instead of executing.
    Beginning {
        attempt: Dbg<ClaimAttempt>,
        conv: Conv,
        adopt: Option<usize>,
        /// A moving record's begin: the plan `conv` is a step of.
        plan: Option<Dbg<Moving>>,
    },
    /// Claimed: forwarded next (before time moves: the upstream answers within the lease).
    Claimed {
        claim: Dbg<Claim>,
    },
    /// Forwarded, the upstream still at work (`Fleet::upstream_ticks`): it answers at
    /// `answers_at_ms` by its Envoy's clock; the claim is held (renewed) meanwhile.
    Executing {
        claim: Dbg<Claim>,
        execution: usize,
        answers_at_ms: u64,
    },
    /// The begin answered `Unsettled`: the upstream's lookup is asked.
    Looking {
        attempt: Dbg<ClaimAttempt>,
    },
    Finished,
}

#[derive(Clone, Debug, Hash)]
pub struct ClientRequest {
    scope: u8,
    begins_left: u8,
    phase: Phase,
}

/// A completion or a release the root carries (tried again when the store failed it).
#[derive(Clone, Debug, Hash)]
pub struct Settlement {
    op: Dbg<StoreOp>,
    /// None: waiting to be started again (`retry`).
    conv: Option<Conv>,
    /// A settlement on both homes of a moving record: the plan `conv` is a step of.
    plan: Option<Dbg<Moving>>,
    retry: Option<Retry>,
    /// The execution a completion records.
    execution: Option<usize>,
    /// A completion with the answer a lookup found.
    adopted: bool,
}

/// A renewal the Envoy's root carries (`StoreOp::Renew` on one etcd).
#[derive(Clone, Debug, Hash)]
pub struct Renewing {
    renew: Dbg<Renew>,
    conv: Conv,
}

#[derive(Clone, Debug, Hash)]
pub struct Envoy {
    skew_ms: u64,
    alive: bool,
    /// The claims its owners hold (the product's registry), and the renewals under way.
    renewals: Dbg<Renewals>,
    renewing: Vec<Renewing>,
    /// One per etcd.
    workers: Vec<Worker>,
    requests: Vec<ClientRequest>,
    settlements: Vec<Settlement>,
    next_call: u32,
    next_owner: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Msg {
    ToEtcd { envoy: usize, etcd: u8, call: u32, path: &'static str, body: Vec<u8> },
    ToEnvoy { envoy: usize, call: u32, status: u16, body: Vec<u8> },
}

#[derive(Clone, Debug, Hash)]
pub struct Execution {
    envoy: usize,
    scope: u8,
    owner: u64,
    /// Its completion is in etcd (this owner's outcome was written), on every home its claim
    /// held (a moving record's two: its client's answer waits for both).
    landed: bool,
    /// The etcds its claim held (a bit each), and those its outcome is written on so far.
    homes: u8,
    landed_on: u8,
    /// Its Envoy crashed before that: the outcome is unknown to whoever reads a home it did not
    /// reach, and the rule decides, as for any crashed owner.
    crashed: bool,
    /// Its completion was given up after failing for the whole retry window.
    given_up: bool,
}

#[derive(Clone, Debug, Hash)]
pub struct FleetState {
    /// etcd 0, and while a record's home moves, etcd 1.
    pub etcds: Vec<Etcd>,
    pub envoys: Vec<Envoy>,
    pub network: Vec<Msg>,
    pub executions: Vec<Execution>,
    /// Per etcd and scope: the record value of its first stored outcome there.
    pub stored: BTreeMap<(u8, u8), Vec<u8>>,
    /// Scopes whose record has been written at all.
    pub written: Vec<u8>,
    pub faults_left: u8,
    pub crashes_left: u8,
    /// What this path has shown (`SEEN_*`): the checker must reach each somewhere, or the
    /// model would check nothing there.
    pub seen: u16,
    /// The invariants broken on the way here (property name, what happened).
    pub violations: Vec<(&'static str, String)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Tick,
    StartBegin(usize),
    ToEtcd(usize),
    ToEnvoy(usize),
    /// A callout of envoy .0 times out: its begin (None) or its settlement .1.
    Timeout(usize, Option<usize>),
    RetrySettlement(usize, usize),
    Forward(usize),
    /// The upstream of envoy .0's request answers (after `upstream_ticks`).
    Answer(usize),
    /// Envoy .0's root renews the claims that are due (at its 100 ms tick: before time moves on).
    Renew(usize),
    Lookup(usize, Lookup),
    Crash(usize),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lookup {
    Found,
    NotFound,
    Failed,
}

pub fn name(envoy: usize) -> char {
    char::from(b'A' + u8::try_from(envoy).unwrap_or(25))
}

fn scope_id(scope: u8) -> ScopeId {
    ScopeId([scope + 1; 32])
}

fn settings() -> EtcdSettings {
    EtcdSettings {
        cluster: "etcd".into(),
        authority: "etcd".into(),
        prefix: "/idem/".into(),
        timeout_ms: 250,
        on_error: OnStoreError::FailClosed,
        auth: None,
        auth_timeout_ms: 2_000,
        replay_cache: None,
        protocol: Protocol::Json,
        shards: Vec::new(),
        previous_shards: Vec::new(),
    }
}

fn record_key(scope: u8) -> Vec<u8> {
    let hex: String = scope_id(scope).0.iter().map(|b| format!("{b:02x}")).collect();
    format!("/idem/r/{hex}").into_bytes()
}

fn lease_key(scope: u8) -> Vec<u8> {
    let hex: String = scope_id(scope).0.iter().map(|b| format!("{b:02x}")).collect();
    format!("/idem/l/{hex}").into_bytes()
}

/// What a call asks, in a few words (for the traces).
fn call_summary(path: &str, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let what = match path {
        "/v3/lease/grant" => "lease grant".to_string(),
        "/v3/kv/range" => "read".to_string(),
        _ => {
            let guard = if text.contains(r#""target":"CREATE""#) {
                "if absent"
            } else if text.contains(r#""target":"MOD""#) {
                "if unchanged since its revision"
            } else if text.contains(r#""target":"VALUE""#) {
                "if the lease key is still its owner's"
            } else {
                "unguarded"
            };
            let success = text.split(r#""failure""#).next().unwrap_or("");
            let does = if !success.contains("request_put") && !success.contains("request_delete_range") {
                "read"
            } else if success.contains("request_put") {
                "write record"
            } else {
                "delete record"
            };
            format!("txn: {does} {guard}")
        }
    };
    what
}

impl Fleet {
    fn clock(&self, state: &FleetState, envoy: usize) -> u64 {
        state.etcds[0].now_ms + state.envoys[envoy].skew_ms
    }

    fn tick_index(&self, state: &FleetState) -> u64 {
        state.etcds[0].now_ms / self.tick_ms
    }

    fn attempt(&self, scope: u8, owner: u64, now_ms: u64) -> ClaimAttempt {
        ClaimAttempt {
            scope: scope_id(scope),
            fingerprint: Fingerprint([scope + 10; 32]),
            owner,
            now_ms,
            lease_ms: self.lease_ms,
            ttl_ms: self.ttl_ms,
            quota: None,
            on_lease_end: on_lease_end(self.rule),
            label: None,
            tombstone_ms: self.tombstone_ms,
        }
    }

    fn active(state: &FleetState, envoy: usize) -> Option<usize> {
        state.envoys[envoy].requests.iter().position(|r| !matches!(r.phase, Phase::Finished))
    }

    /// Steps a conversation: its next call goes on the network, or its answer comes back.
    fn step(
        &self,
        state: &mut FleetState,
        envoy: usize,
        etcd: u8,
        mut conversation: EtcdConversation,
        answer: Option<Answer>,
    ) -> Result<Conv, (EtcdConversation, StoreAnswer)> {
        let now = self.clock(state, envoy);
        let tick = self.tick_index(state);
        let e = &mut state.envoys[envoy];
        match conversation.step(&e.workers[usize::from(etcd)].0, answer, now) {
            Next::Call(Request { path, body, .. }) => {
                e.next_call += 1;
                let call = e.next_call;
                state.network.push(Msg::ToEtcd { envoy, etcd, call, path, body });
                state.network.sort();
                Ok(Conv { conversation, etcd, call, sent_tick: tick })
            }
            Next::Done(answer) => Err((conversation, answer)),
            // No auth in the model: nothing to wait for.
            Next::Wait => {
                Err((conversation, StoreAnswer::Begun(Err(StoreError::Unavailable("a wait".into())))))
            }
        }
    }

    fn list(&self, envoy: usize) -> List {
        self.lists.get(envoy).copied().unwrap_or(List::Old)
    }

    /// Starts `op` as the Envoy's store does (`EtcdShards::start` for its list): on the one etcd
    /// it belongs to, or as the product's `Moving` plan over both. Ok: a call is out (with the
    /// plan it is a step of); Err: the answer, and the claim a failed begin leaves.
    fn start_op(
        &self,
        state: &mut FleetState,
        envoy: usize,
        op: StoreOp,
    ) -> Result<(Conv, Option<Moving>), (StoreAnswer, Option<Claim>)> {
        let etcd = match (&op, self.list(envoy)) {
            (StoreOp::Begin(a), List::Moving) => {
                let (plan, first) = Moving::begin(a.clone(), 0, 1);
                return self.follow(state, envoy, plan, first);
            }
            (StoreOp::Begin(_), List::Old) => 0,
            (StoreOp::Begin(_), List::New) => 1,
            (StoreOp::Complete { claim, .. } | StoreOp::Release(claim), _) => {
                if let Some((plan, first)) = Moving::settle(op.clone()) {
                    return self.follow(state, envoy, plan, first);
                }
                claim.shard
            }
            _ => 0,
        };
        self.run_on(state, envoy, etcd, op, None)
    }

    fn run_on(
        &self,
        state: &mut FleetState,
        envoy: usize,
        etcd: u8,
        op: StoreOp,
        plan: Option<Moving>,
    ) -> Result<(Conv, Option<Moving>), (StoreAnswer, Option<Claim>)> {
        let conversation = state.envoys[envoy].workers[usize::from(etcd)].0.start(op);
        match self.step(state, envoy, etcd, conversation, None) {
            Ok(conv) => Ok((conv, plan)),
            Err((conversation, answer)) => self.ended(state, envoy, etcd, &conversation, answer, plan),
        }
    }

    /// A conversation on `etcd` ended: its answer is the operation's, or the plan's next step
    /// follows (its answers and claims say their shard, as the store's `on_shard` makes them).
    fn ended(
        &self,
        state: &mut FleetState,
        envoy: usize,
        etcd: u8,
        conversation: &EtcdConversation,
        answer: StoreAnswer,
        plan: Option<Moving>,
    ) -> Result<(Conv, Option<Moving>), (StoreAnswer, Option<Claim>)> {
        let answer = on_shard(answer, etcd);
        let unanswered = conversation.unanswered_claim().map(|c| Claim { shard: etcd, ..c });
        match plan {
            None => Err((answer, unanswered)),
            Some(mut plan) => {
                let next = plan.answered(answer, unanswered);
                self.follow(state, envoy, plan, next)
            }
        }
    }

    fn follow(
        &self,
        state: &mut FleetState,
        envoy: usize,
        plan: Moving,
        next: Leg,
    ) -> Result<(Conv, Option<Moving>), (StoreAnswer, Option<Claim>)> {
        match next {
            Leg::Done(answer) => Err((answer, plan.unanswered(None))),
            Leg::Run(shard, op) => self.run_on(state, envoy, shard, op, Some(plan)),
        }
    }

    /// The claim to give back when a begin is given up now (its call timed out).
    fn unanswered(conv: &Conv, plan: Option<&Moving>) -> Option<Claim> {
        let sub = conv.conversation.unanswered_claim().map(|c| Claim { shard: conv.etcd, ..c });
        match plan {
            Some(plan) => plan.unanswered(sub),
            None => sub,
        }
    }

    fn violate(state: &mut FleetState, property: &'static str, what: String) {
        state.violations.push((property, what));
    }

    /// A settlement started (or started again) from its op.
    fn settle(&self, state: &mut FleetState, envoy: usize, mut s: Settlement, log: &mut String) {
        match self.start_op(state, envoy, s.op.0.clone()) {
            Ok((conv, plan)) => {
                s.conv = Some(conv);
                s.plan = plan.map(Dbg);
                state.envoys[envoy].settlements.push(s);
            }
            Err((answer, _)) => self.settled(state, envoy, s, answer, log),
        }
    }

    /// A settlement's answer: done, or tried again as the root does (`finish_settlement`).
    fn settled(
        &self,
        state: &mut FleetState,
        envoy: usize,
        mut s: Settlement,
        answer: StoreAnswer,
        log: &mut String,
    ) {
        let now = self.clock(state, envoy);
        let owner = match &s.op.0 {
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => Some(claim.owner),
            _ => None,
        };
        // Held (renewed) while the root writes it, as the worker does: let go once it is over.
        let renewals = &mut state.envoys[envoy].renewals.0;
        let held = owner.and_then(|o| renewals.lease_end(o)).map_or(0, |end| end + self.lease_ms);
        let over =
            !matches!(answer, StoreAnswer::Settled(Err(StoreError::Unavailable(_) | StoreError::TimedOut)));
        if over {
            owner.map(|o| renewals.let_go(o));
        }
        match answer.into_settled() {
            Err(StoreError::Unavailable(_) | StoreError::TimedOut) => {
                // The worker's own retry (`flow::Retry`), as the root carries it: until a lease past
                // the claim's, or past the lease it last renewed.
                let retry = match (s.retry, &s.op.0) {
                    (None, StoreOp::Complete { claim, .. } | StoreOp::Release(claim)) => {
                        Retry::first_within(now, retry_window_end(claim, now, self.lease_ms).max(held))
                    }
                    (None, _) => None,
                    (Some(r), _) => r.within(held).next(now),
                };
                match retry {
                    Some(r) => {
                        log.push_str(&format!("; tried again at {} ms by its clock", r.due_ms));
                        s.conv = None;
                        s.retry = Some(r);
                        state.envoys[envoy].settlements.push(s);
                    }
                    None => {
                        log.push_str("; given up");
                        owner.map(|o| state.envoys[envoy].renewals.0.let_go(o));
                        if let Some(x) = s.execution {
                            // Given up once tried again until its retry window closed: the
                            // rule lets its record be taken over then. A completion given up
                            // without being tried again is not (ad30838).
                            state.executions[x].given_up = s.retry.is_some();
                        }
                    }
                }
            }
            Ok(Settled::Lost) => {
                log.push_str(": lost");
                if let Some(x) = s.execution {
                    let exec = &state.executions[x];
                    // Even after being tried again: its lease key outlives its retries.
                    if !exec.landed {
                        let what = format!(
                            "{}'s execution {x} was answered to its client, and its completion found the record \
                             no longer its claim",
                            name(exec.envoy)
                        );
                        Self::violate(state, OUTCOMES_KEPT, what);
                    }
                }
            }
            Ok(Settled::Done) => {
                log.push_str(": done");
                if s.retry.is_some() {
                    state.seen |= SEEN_RETRY_LANDED;
                }
                if s.adopted {
                    state.seen |= SEEN_ADOPTED;
                }
                if matches!(s.op.0, StoreOp::Release(c) if c.locator == idempotency_filter::store::etcd::UNANSWERED)
                {
                    state.seen |= SEEN_GIVEN_BACK;
                }
            }
            Err(e) => log.push_str(&format!(": failed ({e}), not tried again")),
        }
    }

    /// A begin's answer, as the flow takes it.
    fn begun(
        &self,
        state: &mut FleetState,
        envoy: usize,
        r: usize,
        attempt: ClaimAttempt,
        conversation_claim: Option<Claim>,
        adopt: Option<usize>,
        answer: StoreAnswer,
        log: &mut String,
    ) {
        let scope = state.envoys[envoy].requests[r].scope;
        let begun = answer.into_begun();
        log.push_str(&format!(": {}", brief(&begun)));
        let stored = Self::stored_outcomes(state, scope);
        let next = match begun {
            Ok(Begin::Claimed(claim) | Begin::TookOver(claim)) => match adopt {
                Some(x) => {
                    // The lookup found the execution: its answer is recorded, nothing executes.
                    let completion = self.completion(x, self.clock(state, envoy));
                    let s = Settlement {
                        op: Dbg(StoreOp::Complete { claim, completion }),
                        conv: None,
                        plan: None,
                        retry: None,
                        execution: None,
                        adopted: true,
                    };
                    self.settle(state, envoy, s, log);
                    Phase::Finished
                }
                None => Phase::Claimed { claim: Dbg(claim) },
            },
            Ok(Begin::Replay(snapshot)) => {
                state.seen |= SEEN_REPLAY;
                if !stored.iter().any(|s| s.snapshot.as_ref() == Some(&snapshot)) {
                    let what = format!(
                        "{} replayed {:?} for scope {scope}; stored: {:?}",
                        name(envoy),
                        String::from_utf8_lossy(&snapshot.body),
                        stored
                            .iter()
                            .filter_map(|s| s.snapshot.as_ref())
                            .map(|s| String::from_utf8_lossy(&s.body).into_owned())
                            .collect::<Vec<_>>()
                    );
                    Self::violate(state, REPLAYS, what);
                }
                Phase::Finished
            }
            Ok(Begin::OutcomeUnknown) | Ok(Begin::NotStored { .. }) => {
                state.seen |= SEEN_MARKED_UNKNOWN;
                let fits = stored.iter().any(|s| s.entry.outcome_unknown() || !s.entry.body_stored());
                if !fits {
                    Self::violate(
                        state,
                        REPLAYS,
                        format!("{} answered without a body for scope {scope}, none stored", name(envoy)),
                    );
                }
                Phase::Finished
            }
            Ok(Begin::Expired { status }) => {
                state.seen |= SEEN_TOMBSTONE;
                // Only an outcome leaves a tombstone, with its status.
                if !stored.iter().any(|s| s.entry.is_completed() && s.entry.status == status) {
                    Self::violate(
                        state,
                        REPLAYS,
                        format!(
                            "{} answered an expired result {status} for scope {scope}, none stored",
                            name(envoy)
                        ),
                    );
                }
                Phase::Finished
            }
            Ok(Begin::InFlight { .. }) => {
                if !state.written.contains(&scope) {
                    Self::violate(
                        state,
                        SCOPES,
                        format!("{} found scope {scope} in flight: it was never written", name(envoy)),
                    );
                }
                Phase::Idle
            }
            Ok(Begin::Mismatch) => {
                // Every request of a scope carries the same payload.
                Self::violate(
                    state,
                    SCOPES,
                    format!("{} found another payload under scope {scope}", name(envoy)),
                );
                Phase::Finished
            }
            Ok(Begin::Unsettled) => Phase::Looking { attempt: Dbg(attempt) },
            Ok(other) => {
                Self::violate(
                    state,
                    SCOPES,
                    format!("{} got an answer no model request can get: {other:?}", name(envoy)),
                );
                Phase::Finished
            }
            Err(error) => {
                // The fail mode answers (503); a claim etcd may hold is given back first (the
                // worker's begin_failed, for a store that failed or timed out).
                let in_doubt = matches!(error, StoreError::Unavailable(_) | StoreError::TimedOut);
                if let Some(claim) = conversation_claim.filter(|_| in_doubt) {
                    log.push_str(&format!("; gives back claim {}", claim.owner));
                    let s = Settlement {
                        op: Dbg(StoreOp::Release(claim)),
                        conv: None,
                        plan: None,
                        retry: None,
                        execution: None,
                        adopted: false,
                    };
                    self.settle(state, envoy, s, log);
                }
                Phase::Idle
            }
        };
        state.envoys[envoy].requests[r].phase = next;
    }

    /// The upstream answered execution `x`: its completion, carried by the root.
    fn complete(&self, state: &mut FleetState, e: usize, claim: Claim, x: usize, log: &mut String) {
        let completion = self.completion(x, self.clock(state, e));
        let s = Settlement {
            op: Dbg(StoreOp::Complete { claim, completion }),
            conv: None,
            plan: None,
            retry: None,
            execution: Some(x),
            adopted: false,
        };
        log.push_str("; its completion");
        self.settle(state, e, s, log);
    }

    /// A renewal's answer, as the root hands it to its worker's `Renewals`. No fault strikes a
    /// renewal in the model and every Envoy renews at its ticks: a claim a live owner holds is
    /// never found another's.
    fn renewed(
        &self,
        state: &mut FleetState,
        e: usize,
        renew: &Renew,
        answer: StoreAnswer,
        log: &mut String,
    ) {
        let kept = answer.into_renewed();
        let out = match &kept {
            Ok(k) => state.envoys[e].renewals.0.answered(renew, Ok(k)),
            Err(_) => state.envoys[e].renewals.0.answered(renew, Err(())),
        };
        log.push_str(&format!("; renewal: {kept:?}"));
        if out.kept > 0 {
            state.seen |= SEEN_RENEWED;
        }
        if !out.lost.is_empty() {
            let what = format!("{}'s renewal found a claim of its live owner taken over: {kept:?}", name(e));
            Self::violate(state, RENEWALS, what);
        }
    }

    fn completion(&self, execution: usize, now_ms: u64) -> Completion {
        Completion {
            state: State::Succeeded,
            status: 201,
            snapshot: Some(Snapshot {
                status: 201,
                headers: Vec::new(),
                body: format!("execution {execution}").into_bytes(),
            }),
            now_ms,
            ttl_ms: self.ttl_ms,
        }
    }

    /// The outcomes stored for `scope`, on each etcd: a moving record's homes hold the same one,
    /// unless an owner crashed between its two writes and the rule let its record be taken
    /// over on the home it did not reach (EXECUTIONS judges that).
    fn stored_outcomes(state: &FleetState, scope: u8) -> Vec<record::SlotValue> {
        (0..2u8)
            .filter_map(|etcd| state.stored.get(&(etcd, scope)))
            .filter_map(|v| record::decode_record(v).ok())
            .collect()
    }

    /// After every change in etcd `etcd`: what was stored, what landed, what was replaced.
    fn observe(&self, state: &mut FleetState, etcd: u8, before: &Etcd) {
        for scope in 0..2u8 {
            let key = record_key(scope);
            let now = state.etcds[usize::from(etcd)].kvs.get(&key).map(|kv| kv.value.clone());
            if now.is_some()
                && before.kvs.get(&key).map(|kv| &kv.value) != now.as_ref()
                && !state.written.contains(&scope)
            {
                state.written.push(scope);
            }
            let decoded = now.as_ref().and_then(|v| record::decode_record(v).ok());
            if let Some(stored) = state.stored.get(&(etcd, scope)).cloned() {
                if now.as_ref() != Some(&stored) {
                    let what = match &decoded {
                        None => format!("scope {scope}'s stored outcome was deleted from etcd {etcd}"),
                        Some(d) => format!(
                            "scope {scope}'s stored outcome was overwritten on etcd {etcd} by owner {}'s {:?} {}",
                            d.entry.owner, d.entry.state, d.entry.status
                        ),
                    };
                    Self::violate(state, REPLACED, what);
                    state.stored.insert((etcd, scope), now.clone().unwrap_or_default());
                }
            } else if let (Some(v), Some(d)) = (&now, &decoded) {
                if d.entry.is_completed() {
                    state.stored.insert((etcd, scope), v.clone());
                }
            }
            if let Some(d) = decoded.filter(|d| d.entry.is_completed()) {
                for x in state.executions.iter_mut().filter(|x| x.scope == scope && x.owner == d.entry.owner)
                {
                    x.landed_on |= 1 << etcd;
                    x.landed = x.landed_on & x.homes == x.homes;
                }
            }
        }
    }

    /// A record in flight must not outlive its lease, its completion's retry window (one lease
    /// more), the claim lease's reuse window, the lease's slack and the largest skew, by etcd's
    /// clock: by then no begin reads it in flight.
    fn check_in_flight(&self, state: &mut FleetState) {
        let max_skew = self.skews_ms.iter().max().copied().unwrap_or(0);
        let bound = 2 * self.lease_ms + (self.lease_ms / 10).max(1_000) + 1_000 + max_skew;
        for (etcd, scope) in (0..state.etcds.len()).flat_map(|etcd| (0..2u8).map(move |scope| (etcd, scope)))
        {
            let db = &state.etcds[etcd];
            let Some(kv) = db.kvs.get(&record_key(scope)) else { continue };
            let Ok(d) = record::decode_record(&kv.value) else { continue };
            // A claim is kept (its lease key put again) while its owner is at work: counted from
            // its last renewal, and not at all while a live Envoy still holds it.
            let lease = db.kvs.get(&lease_key(scope)).filter(|l| l.value == d.entry.owner.to_be_bytes());
            let since = lease.map_or(kv.written_at_ms, |l| l.written_at_ms.max(kv.written_at_ms));
            let held = state
                .envoys
                .iter()
                .any(|envoy| envoy.alive && envoy.renewals.0.lease_end(d.entry.owner).is_some());
            if d.entry.is_completed() || held || db.now_ms < since + bound {
                continue;
            }
            let lease_key_lives = lease.is_some();
            let blind: Vec<char> = (0..state.envoys.len())
                .filter(|e| state.envoys[*e].alive && self.clock(state, *e) < d.entry.lease_deadline_ms)
                .map(name)
                .collect();
            if lease_key_lives || !blind.is_empty() {
                let what = format!(
                    "scope {scope}'s claim by owner {} written at {} ms on etcd {etcd} is in flight at {} ms \
                     (lease key {}, deadline not yet passed for {blind:?})",
                    d.entry.owner,
                    kv.written_at_ms,
                    db.now_ms,
                    if lease_key_lives { "alive" } else { "gone" }
                );
                Self::violate(state, IN_FLIGHT, what);
            }
        }
    }

    /// The next state and what happened, in words.
    pub fn apply(&self, last: &FleetState, action: &Action) -> (FleetState, String) {
        let mut state = last.clone();
        let mut log = String::new();
        match *action {
            Action::Tick => {
                let to = state.etcds[0].now_ms + self.tick_ms;
                for etcd in 0..state.etcds.len() {
                    let before = state.etcds[etcd].clone();
                    state.etcds[etcd].advance(to);
                    self.observe(&mut state, u8::try_from(etcd).unwrap_or(0), &before);
                }
                log = format!("time passes: etcd's clock {to} ms");
                self.check_in_flight(&mut state);
            }
            Action::StartBegin(e) => {
                let Some(r) = Self::active(&state, e) else { return (state, log) };
                let now = self.clock(&state, e);
                let envoy = &mut state.envoys[e];
                envoy.next_owner += 1;
                let owner = (e as u64 + 1) * 100 + envoy.next_owner;
                let request = &mut envoy.requests[r];
                request.begins_left -= 1;
                let attempt = self.attempt(request.scope, owner, now);
                log = format!("{} (clock {now} ms) begins scope {} as owner {owner}", name(e), request.scope);
                match self.start_op(&mut state, e, StoreOp::Begin(attempt.clone())) {
                    Ok((conv, plan)) => {
                        state.envoys[e].requests[r].phase = Phase::Beginning {
                            attempt: Dbg(attempt),
                            conv,
                            adopt: None,
                            plan: plan.map(Dbg),
                        };
                    }
                    Err((answer, claim)) => {
                        self.begun(&mut state, e, r, attempt, claim, None, answer, &mut log)
                    }
                }
            }
            Action::ToEtcd(i) => {
                let Msg::ToEtcd { envoy, etcd, call, path, body } = state.network.remove(i) else {
                    return (state, log);
                };
                let db = usize::from(etcd);
                let before = state.etcds[db].clone();
                let reply = state.etcds[db].handle(path, &body);
                log = format!(
                    "etcd {etcd} applies {}'s {} (revision {} -> {})",
                    name(envoy),
                    call_summary(path, &body),
                    before.revision,
                    state.etcds[db].revision
                );
                self.observe(&mut state, etcd, &before);
                if self.awaits(&state, envoy, call) {
                    state.network.push(Msg::ToEnvoy { envoy, call, status: reply.status, body: reply.body });
                    state.network.sort();
                } else {
                    log.push_str("; nobody waits for its answer");
                }
            }
            Action::ToEnvoy(i) => {
                let Msg::ToEnvoy { envoy: e, call, status, body } = state.network.remove(i) else {
                    return (state, log);
                };
                let answer = Answer { status: Some(status), body, grpc: None, from_envoy: false };
                log = format!("{} (clock {} ms) reads etcd's answer", name(e), self.clock(&state, e));
                self.deliver(&mut state, e, call, answer, &mut log);
            }
            Action::Timeout(e, which) => {
                state.faults_left -= 1;
                let (call, what) = match which {
                    None => match Self::active(&state, e).map(|r| &state.envoys[e].requests[r].phase) {
                        Some(Phase::Beginning { conv, .. }) => (conv.call, "begin"),
                        _ => return (state, log),
                    },
                    Some(s) => match &state.envoys[e].settlements[s].conv {
                        Some(conv) => (conv.call, "settlement"),
                        None => return (state, log),
                    },
                };
                // Its answer, if etcd gave one, is lost; its request, if still on its way, may
                // yet be applied (delayed) or never (lost).
                let lost = state.network.len();
                state.network.retain(
                    |m| !matches!(m, Msg::ToEnvoy { envoy, call: c, .. } if *envoy == e && *c == call),
                );
                let answer_lost = state.network.len() != lost;
                if answer_lost {
                    state.seen |= SEEN_ANSWER_LOST;
                }
                log = format!(
                    "{}'s {what} callout times out ({})",
                    name(e),
                    if answer_lost {
                        "etcd applied it; its answer is lost"
                    } else {
                        "its request is delayed or lost"
                    }
                );
                match which {
                    None => {
                        let Some(r) = Self::active(&state, e) else { return (state, log) };
                        let Phase::Beginning { attempt, conv, adopt, plan } =
                            std::mem::replace(&mut state.envoys[e].requests[r].phase, Phase::Idle)
                        else {
                            return (state, log);
                        };
                        let claim = Self::unanswered(&conv, plan.as_ref().map(|p| &p.0));
                        self.begun(
                            &mut state,
                            e,
                            r,
                            attempt.0,
                            claim,
                            adopt,
                            StoreAnswer::Begun(Err(StoreError::TimedOut)),
                            &mut log,
                        );
                    }
                    Some(s) => {
                        let settlement = state.envoys[e].settlements.remove(s);
                        self.settled(
                            &mut state,
                            e,
                            settlement,
                            StoreAnswer::Settled(Err(StoreError::TimedOut)),
                            &mut log,
                        );
                    }
                }
            }
            Action::RetrySettlement(e, s) => {
                let settlement = state.envoys[e].settlements.remove(s);
                log = format!(
                    "{} (clock {} ms) starts its {} again",
                    name(e),
                    self.clock(&state, e),
                    op_name(&settlement.op.0)
                );
                self.settle(&mut state, e, settlement, &mut log);
            }
            Action::Forward(e) => {
                let Some(r) = Self::active(&state, e) else { return (state, log) };
                let Phase::Claimed { claim: Dbg(claim) } = state.envoys[e].requests[r].phase.clone() else {
                    return (state, log);
                };
                let scope = state.envoys[e].requests[r].scope;
                let x = state.executions.len();
                log = format!(
                    "{} forwards: the upstream executes scope {scope} (execution {x}) and answers 201",
                    name(e)
                );
                // A takeover rule lets a claim be taken over once its lease ended without an
                // outcome: its owner crashed, or its completion was given up after being tried
                // again for its retry window (its lease key outlives the window: never while it
                // is still being tried). Never one whose completion was given up untried
                // (ad30838).
                let allowed =
                    |p: &Execution| self.rule == UnknownOutcome::Takeover && (p.crashed || p.given_up);
                let earlier: Vec<String> = state
                    .executions
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.scope == scope && !allowed(p))
                    .map(|(i, p)| format!("execution {i} by {} (owner {})", name(p.envoy), p.owner))
                    .collect();
                if state.executions.iter().any(|p| p.scope == scope) {
                    state.seen |= SEEN_EXECUTED_AGAIN;
                }
                if !earlier.is_empty() {
                    let what =
                        format!("{} executes scope {scope} again after {}", name(e), earlier.join(", "));
                    Self::violate(&mut state, EXECUTIONS, what);
                }
                state.executions.push(Execution {
                    envoy: e,
                    scope,
                    owner: claim.owner,
                    landed: false,
                    homes: (1 << claim.shard) | claim.old_home.map_or(0, |h| 1 << h.shard),
                    landed_on: 0,
                    crashed: false,
                    given_up: false,
                });
                let now = self.clock(&state, e);
                if self.upstream_ticks == 0 {
                    // The upstream answers at once: its claim is never due for a renewal before
                    // its completion starts. (Held through a completion tried again, it is
                    // renewed meanwhile: the runs with a long upstream check that, not these,
                    // whose state spaces it would multiply.)
                    state.envoys[e].requests[r].phase = Phase::Finished;
                    self.complete(&mut state, e, claim, x, &mut log);
                    return (state, log);
                }
                // Held by its owner from here (`Step::Hold`), renewed while it is at work.
                let hold = Hold {
                    claim,
                    lease_ms: self.lease_ms,
                    lease_end_ms: claim.written.map_or(now + self.lease_ms, |w| w.lease_deadline_ms),
                    expires_at_ms: claim.written.map_or(now + self.ttl_ms, |w| w.expires_at_ms),
                };
                state.envoys[e].renewals.0.hold(hold);
                let answers_at_ms = now + self.upstream_ticks * self.tick_ms;
                log = log.replace("and answers 201", &format!("and answers at {answers_at_ms} ms"));
                state.envoys[e].requests[r].phase =
                    Phase::Executing { claim: Dbg(claim), execution: x, answers_at_ms };
            }
            Action::Answer(e) => {
                let Some(r) = Self::active(&state, e) else { return (state, log) };
                let Phase::Executing { claim: Dbg(claim), execution, .. } =
                    state.envoys[e].requests[r].phase.clone()
                else {
                    return (state, log);
                };
                log = format!("{} (clock {} ms): the upstream answers 201", name(e), self.clock(&state, e));
                state.envoys[e].requests[r].phase = Phase::Finished;
                self.complete(&mut state, e, claim, execution, &mut log);
            }
            Action::Renew(e) => {
                let now = self.clock(&state, e);
                let due = state.envoys[e].renewals.0.due(now);
                log = format!(
                    "{}'s root (clock {now} ms) renews {} claim(s)",
                    name(e),
                    due.iter().map(|r| r.claims.len()).sum::<usize>()
                );
                for renew in due {
                    let etcd = renew.claims.first().map_or(0, |c| c.shard);
                    let conversation =
                        state.envoys[e].workers[usize::from(etcd)].0.start(StoreOp::Renew(renew.clone()));
                    match self.step(&mut state, e, etcd, conversation, None) {
                        Ok(conv) => state.envoys[e].renewing.push(Renewing { renew: Dbg(renew), conv }),
                        Err((_, answer)) => self.renewed(&mut state, e, &renew, answer, &mut log),
                    }
                }
            }
            Action::Lookup(e, lookup) => {
                let Some(r) = Self::active(&state, e) else { return (state, log) };
                let Phase::Looking { attempt: Dbg(attempt) } = state.envoys[e].requests[r].phase.clone()
                else {
                    return (state, log);
                };
                let scope = state.envoys[e].requests[r].scope;
                let now = self.clock(&state, e);
                log = format!("{}'s lookup of scope {scope}: {lookup:?}", name(e));
                let adopt = match lookup {
                    Lookup::Failed => {
                        state.faults_left -= 1;
                        state.envoys[e].requests[r].phase = Phase::Idle;
                        return (state, log);
                    }
                    Lookup::Found => state.executions.iter().position(|x| x.scope == scope),
                    Lookup::NotFound => None,
                };
                let attempt = attempt.after_lookup(now);
                match self.start_op(&mut state, e, StoreOp::Begin(attempt.clone())) {
                    Ok((conv, plan)) => {
                        state.envoys[e].requests[r].phase =
                            Phase::Beginning { attempt: Dbg(attempt), conv, adopt, plan: plan.map(Dbg) }
                    }
                    Err((answer, claim)) => {
                        self.begun(&mut state, e, r, attempt, claim, adopt, answer, &mut log)
                    }
                }
            }
            Action::Crash(e) => {
                state.crashes_left -= 1;
                log =
                    format!("{} crashes: its requests, completions and answers in flight are gone", name(e));
                let envoy = &mut state.envoys[e];
                envoy.alive = false;
                envoy.settlements.clear();
                envoy.renewing.clear();
                envoy.renewals = Dbg(Renewals::default());
                for r in &mut envoy.requests {
                    r.phase = Phase::Finished;
                }
                state.network.retain(|m| !matches!(m, Msg::ToEnvoy { envoy, .. } if *envoy == e));
                for x in state.executions.iter_mut().filter(|x| x.envoy == e && !x.landed) {
                    x.crashed = true;
                }
            }
        }
        (state, log)
    }

    fn awaits(&self, state: &FleetState, e: usize, call: u32) -> bool {
        let envoy = &state.envoys[e];
        envoy.alive
            && (envoy.settlements.iter().any(|s| s.conv.as_ref().is_some_and(|c| c.call == call))
                || envoy.renewing.iter().any(|r| r.conv.call == call)
                || envoy
                    .requests
                    .iter()
                    .any(|r| matches!(&r.phase, Phase::Beginning { conv, .. } if conv.call == call)))
    }

    fn deliver(&self, state: &mut FleetState, e: usize, call: u32, answer: Answer, log: &mut String) {
        if let Some(i) = state.envoys[e].renewing.iter().position(|r| r.conv.call == call) {
            let Renewing { renew: Dbg(renew), conv } = state.envoys[e].renewing.remove(i);
            log.push_str(" for its renewal");
            match self.step(state, e, conv.etcd, conv.conversation, Some(answer)) {
                Ok(next) => state.envoys[e].renewing.push(Renewing { renew: Dbg(renew), conv: next }),
                Err((_, done)) => self.renewed(state, e, &renew, done, log),
            }
            return;
        }
        if let Some(s) =
            state.envoys[e].settlements.iter().position(|s| s.conv.as_ref().is_some_and(|c| c.call == call))
        {
            let mut settlement = state.envoys[e].settlements.remove(s);
            let Some(conv) = settlement.conv.take() else { return };
            log.push_str(&format!(" for its {}", op_name(&settlement.op.0)));
            let plan = settlement.plan.take().map(|p| p.0);
            let next = match self.step(state, e, conv.etcd, conv.conversation, Some(answer)) {
                Ok(next) => Ok((next, plan)),
                Err((conversation, done)) => self.ended(state, e, conv.etcd, &conversation, done, plan),
            };
            match next {
                Ok((next, plan)) => {
                    settlement.conv = Some(next);
                    settlement.plan = plan.map(Dbg);
                    state.envoys[e].settlements.push(settlement);
                }
                Err((done, _)) => self.settled(state, e, settlement, done, log),
            }
            return;
        }
        let Some(r) = Self::active(state, e) else { return };
        let Phase::Beginning { attempt, conv, adopt, plan } =
            std::mem::replace(&mut state.envoys[e].requests[r].phase, Phase::Idle)
        else {
            return;
        };
        log.push_str(" for its begin");
        let plan = plan.map(|p| p.0);
        let next = match self.step(state, e, conv.etcd, conv.conversation, Some(answer)) {
            Ok(next) => Ok((next, plan)),
            Err((conversation, done)) => self.ended(state, e, conv.etcd, &conversation, done, plan),
        };
        match next {
            Ok((next, plan)) => {
                state.envoys[e].requests[r].phase =
                    Phase::Beginning { attempt, conv: next, adopt, plan: plan.map(Dbg) }
            }
            Err((done, claim)) => self.begun(state, e, r, attempt.0, claim, adopt, done, log),
        }
    }
}

fn op_name(op: &StoreOp) -> &'static str {
    match op {
        StoreOp::Complete { .. } => "completion",
        StoreOp::Release(_) => "release",
        _ => "operation",
    }
}

fn brief(begun: &Result<Begin, StoreError>) -> String {
    match begun {
        Ok(Begin::Claimed(c)) => format!("claimed (revision {})", c.locator),
        Ok(Begin::TookOver(c)) => format!("took over (revision {})", c.locator),
        Ok(Begin::Replay(s)) => format!("replay of {:?}", String::from_utf8_lossy(&s.body)),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("failed: {e}"),
    }
}

/// Runs one operation to its end against `etcd`, every call answered at once.
fn run(worker: &EtcdStore, etcd: &mut Etcd, op: StoreOp, now_ms: u64) -> StoreAnswer {
    let mut conversation = worker.start(op);
    let mut answer = None;
    loop {
        match conversation.step(worker, answer.take(), now_ms) {
            Next::Call(Request { path, body, .. }) => {
                let reply = etcd.handle(path, &body);
                answer = Some(Answer {
                    status: Some(reply.status),
                    body: reply.body,
                    grpc: None,
                    from_envoy: false,
                });
            }
            Next::Done(done) => return done,
            Next::Wait => return StoreAnswer::Begun(Err(StoreError::Unavailable("a wait".into()))),
        }
    }
}

impl Fleet {
    /// Each Envoy's worker starts warm, as one that claimed and released another key a moment
    /// ago: it holds the leases a claim puts on (the record's window, the claim lease), so a
    /// claim is one round trip until its claim lease's reuse window ends.
    fn warm_up(&self, worker: &EtcdStore, etcd: &mut Etcd, envoy: usize, now_ms: u64) {
        let scope = 100 + u8::try_from(envoy).unwrap_or(0);
        let attempt = self.attempt(scope, 1, now_ms);
        let Ok(Begin::Claimed(claim)) = run(worker, etcd, StoreOp::Begin(attempt), now_ms).into_begun()
        else {
            panic!("the warm-up claim of {} failed", name(envoy));
        };
        let released = run(worker, etcd, StoreOp::Release(claim), now_ms).into_settled();
        assert_eq!(released, Ok(Settled::Done), "the warm-up release of {}", name(envoy));
    }

    pub fn init(&self) -> FleetState {
        let uses_two = self.lists.iter().any(|l| *l != List::Old);
        let mut etcds: Vec<Etcd> = (0..if uses_two { 2 } else { 1 }).map(|_| Etcd::new()).collect();
        let envoys = self
            .skews_ms
            .iter()
            .zip(&self.requests)
            .enumerate()
            .map(|(e, (skew_ms, requests))| Envoy {
                skew_ms: *skew_ms,
                alive: true,
                renewals: Dbg(Renewals::default()),
                renewing: Vec::new(),
                workers: etcds
                    .iter_mut()
                    .map(|etcd| {
                        let worker = EtcdStore::new(settings());
                        self.warm_up(&worker, etcd, e, *skew_ms);
                        Worker(worker)
                    })
                    .collect(),
                requests: requests
                    .iter()
                    .map(|(scope, begins)| ClientRequest {
                        scope: *scope,
                        begins_left: *begins,
                        phase: Phase::Idle,
                    })
                    .collect(),
                settlements: Vec::new(),
                next_call: 0,
                next_owner: 0,
            })
            .collect();
        FleetState {
            etcds,
            envoys,
            network: Vec::new(),
            executions: Vec::new(),
            stored: BTreeMap::new(),
            written: Vec::new(),
            faults_left: self.faults,
            crashes_left: self.crashes,
            seen: 0,
            violations: Vec::new(),
        }
    }

    pub fn actions(&self, state: &FleetState, actions: &mut Vec<Action>) {
        // A broken invariant ends the path: its counterexample is the shortest one.
        if !state.violations.is_empty() {
            return;
        }
        let mut time_may_pass = state.etcds[0].now_ms + self.tick_ms <= self.horizon_ms;
        for (e, envoy) in state.envoys.iter().enumerate() {
            if !envoy.alive {
                continue;
            }
            let now = self.clock(state, e);
            if let Some(r) = Self::active(state, e) {
                let request = &envoy.requests[r];
                match &request.phase {
                    Phase::Idle if request.begins_left > 0 => actions.push(Action::StartBegin(e)),
                    Phase::Idle => {}
                    Phase::Beginning { .. } => {
                        if state.faults_left > 0 && self.begin_faults {
                            actions.push(Action::Timeout(e, None));
                        }
                        // Answered or timed out within its tick.
                        time_may_pass = false;
                    }
                    Phase::Claimed { claim } => {
                        actions.push(Action::Forward(e));
                        // The upstream answers at once, or at a later tick still within the
                        // claim's lease (a lease longer than a tick): a completion that starts
                        // late in its lease.
                        let deadline = claim.0.written.map_or(0, |w| w.lease_deadline_ms);
                        time_may_pass &= now + self.tick_ms < deadline;
                    }
                    Phase::Executing { answers_at_ms, .. } => {
                        if now >= *answers_at_ms {
                            actions.push(Action::Answer(e));
                            time_may_pass = false;
                        }
                    }
                    Phase::Looking { .. } => {
                        let executed = state.executions.iter().any(|x| x.scope == request.scope);
                        actions
                            .push(Action::Lookup(e, if executed { Lookup::Found } else { Lookup::NotFound }));
                        if state.faults_left > 0 && self.begin_faults {
                            actions.push(Action::Lookup(e, Lookup::Failed));
                        }
                        time_may_pass = false;
                    }
                    Phase::Finished => {}
                }
            }
            for (s, settlement) in envoy.settlements.iter().enumerate() {
                match (&settlement.conv, settlement.retry) {
                    (Some(_), _) => {
                        if state.faults_left > 0 {
                            actions.push(Action::Timeout(e, Some(s)));
                        }
                        // Answered or timed out within its tick.
                        time_may_pass = false;
                    }
                    (None, Some(retry)) if retry.due_ms <= now => {
                        actions.push(Action::RetrySettlement(e, s));
                        // The root's tick (100 ms) starts it: before the model's next tick.
                        time_may_pass = false;
                    }
                    (None, _) => {}
                }
            }
            // The root's tick renews what is due before time moves on, and waits for its answer.
            if !envoy.renewals.0.clone().due(now).is_empty() {
                actions.push(Action::Renew(e));
                time_may_pass = false;
            }
            if !envoy.renewing.is_empty() {
                time_may_pass = false;
            }
            if state.crashes_left > 0 {
                actions.push(Action::Crash(e));
            }
        }
        for (i, msg) in state.network.iter().enumerate() {
            match msg {
                Msg::ToEtcd { .. } => actions.push(Action::ToEtcd(i)),
                Msg::ToEnvoy { .. } => actions.push(Action::ToEnvoy(i)),
            }
        }
        if time_may_pass {
            actions.push(Action::Tick);
        }
    }
}
