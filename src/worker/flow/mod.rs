//! One request's life as a pure state machine: what happens to the request comes in as an
//! `Event` (`RequestFlow::handle`, its one entry: Envoy's callbacks, and what the root brings
//! back), and what the worker must do goes out as data (`Step`s and a `Verdict`). The store is
//! asked through `Step::Store` and answers with `Event::StoreAnswered`, in the same callback (the
//! local store) or a later one (a store across the network); an answer that never comes is
//! `Event::StoreFailed`, an ordinary transition (`store_failed`) that fails closed with 503 or
//! forwards unprotected, by the store's `on_error`.
//!
//! ```text
//! Idle ─head─► Collecting ─body─► AwaitingBegin ─answer─► Forwarded ─response head─► Capturing
//!   │              │                   │                     │                        │ end
//!   └ pass         └ refuse            ├ reply ► Answered     └ release/keep ►        ▼
//!                                      │                                              Settling ─answer─► Idle
//!                                      └ wait ► Parking ─► Waiting ─root rechecks─► Rechecking
//!                                                    ▲                                │ answer: forward or
//!                                                    └──────── still processing ──────┘ reply, as above
//! ```
//!
//! A waiter's flow is held in the wait room (the root's); its look at the record is a `begin`
//! like its first, and the answer is read the same way (`Decision`), except that "wait" puts it
//! back in the room. Its steps are carried out by the same executor as every flow's.
//!
//! The flow reads what a decision needs through `StreamFacts`, one read at a time, so that the
//! worker never reads (pays a host call for) what no decision looks at.

use crate::config::etcd::OnStoreError;
use crate::config::{Config, Execution, KeySource, Rule, ScopeHost};
use crate::engine::{
    self, Admission, Decision, HeaderFix, Pending, ReplayShape, Reply, RequestHead, Unprotected,
};
use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::metrics::Counter;
use crate::problem::{Kind, Problem};
use crate::renewal::Hold;
use crate::store::record::State;
use crate::store::{Begin, Claim, ClaimAttempt, StoreAnswer, StoreError, StoreOp};
use crate::worker::audit::AuditRecord;
use crate::worker::reconcile::{Found, LaterLookup, LeaseEndLookup};
use crate::worker::wait;
use facts::verified_claims;
use std::rc::Rc;

mod event;
mod facts;
mod response;
pub use event::{Callback, Event};
pub use facts::{StreamFacts, Unreadable};
pub use response::{retry_window_end, Retry, Settlement};

pub use crate::engine::{DETAILS_PROBLEM, DETAILS_REPLAY};

/// A debug line about a request, `#<context> <what>`, and its record's `key <tag>` when there
/// is one: one function formats them all, so that each such line costs the module a call, not
/// formatting code of its own (the tag is only computed when debug lines are on).
#[inline(never)]
pub(crate) fn said(context_id: u32, what: &str, scope: Option<&ScopeId>) {
    match scope {
        Some(scope) => log::debug!("#{context_id} {what} key {}", scope.log_tag()),
        None => log::debug!("#{context_id} {what}"),
    }
}

/// What the worker does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Add one to this counter.
    Count(Counter),
    /// Send this local reply (the stream stays paused; it comes back through the encode
    /// callbacks).
    Reply { reply: Reply, details: &'static str },
    /// Perform this store operation, then hand its answer to the flow (`Event::StoreAnswered`;
    /// `Event::StoreFailed` when the store failed or did not answer in time).
    Store(StoreOp),
    /// Hold the request (its flow) in the wait room, then tell `parked` whether it was admitted.
    Park(ParkPlan),
    /// A waiter's look at its record found the original still processing: hold it in the wait
    /// room again (it was admitted), then tell `parked` whether it still waits (its give-up
    /// time may have come).
    Repark { lease_remaining_ms: u64 },
    /// This record may have an outcome now: wake its waiters on every worker.
    Wake(ScopeId),
    /// Change the response headers (a replay's framing headers, back as stored).
    FixHeaders(Vec<HeaderFix>),
    /// Remove these headers from the held request before anything carries it upstream: Envoy's
    /// router control headers (`router_control.rs`), which would let the caller lift the
    /// rule's bounds or ask for a second execution.
    RemoveRequestHeaders(Vec<String>),
    /// Take the request out of the wait room: its client went away, or its look at the record
    /// settled its fate.
    LeaveWaitRoom,
    /// Envoy sent this claimed request upstream several times: warn, once per rule per Envoy.
    WarnRetried { rule: String, attempts: u64 },
    /// An upstream answer carried `seen` (another prefix's `*-upstream-service-time`) and not
    /// ours: Envoy's bootstrap `header_prefix` is not `envoy_header_prefix`. Log it at error
    /// level, once per worker (`router_control::prefix_mismatch_line`).
    ErrorHeaderPrefix { seen: String },
    /// A request held for its body ended before any of it arrived, and nothing says its body
    /// ever reached Envoy (its client left first, or Envoy's count is unreadable): warn (at
    /// most once a minute per worker), since every request does so when Envoy is missing
    /// `allow_on_headers_stop_iteration: true`.
    WarnBodyNeverReceived { rule: String, details: Option<String> },
    /// A request held for its body ended before any of it arrived although Envoy had received
    /// `body_bytes` of it: Envoy kept the body from the filter, which it does exactly when the
    /// Wasm filter's config lacks `allow_on_headers_stop_iteration: true` (or the control plane
    /// dropped it). Log it at error level, once per worker.
    ErrorStopIterationMissing { rule: String, details: Option<String>, body_bytes: u64 },
    /// Detached execution: the worker's root carries the claimed request upstream (read its
    /// head and body, make the call, record the answer, reply if the client is still there).
    /// The request stays held, and the root holds its flow until the call is answered; if no
    /// call can be made, `detach_refused`. The call's answer is `detached_answered`.
    Detach { claim: Claim, rule: Rc<Rule> },
    /// `reconcile`: ask the upstream's lookup about this request's record (the worker builds the
    /// call from the rule and the held request), then hand its answer to `lookup_answered`;
    /// if no lookup can be made now, `lookup_refused`.
    Lookup { rule: Rc<Rule>, request: Vec<(String, Vec<u8>)> },
    /// The request now owns this claim and is at work on it: the worker's root keeps it (renews
    /// its lease) until the flow lets it go (`renewal`).
    Hold(Hold),
    /// The request is done with the claim of this owner token (settled, or ended without an
    /// outcome): no longer renewed.
    LetGo(u64),
    /// `reconcile`: this request's outcome is unknown and its record kept in flight; the
    /// worker's root asks the upstream itself when the lease ends (`RequestFlow::lease_end`),
    /// so that a key nobody retries settles too. The worker builds the lookup now, from the
    /// request's head.
    LookUpAtLeaseEnd(Box<LaterLookup>),
}

/// The answer to the callback: let the stream go on, or hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    Pause,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub steps: Vec<Step>,
    pub verdict: Verdict,
}

impl Output {
    pub(super) fn go(steps: Vec<Step>) -> Output {
        Output { steps, verdict: Verdict::Continue }
    }
    pub(super) fn hold(steps: Vec<Step>) -> Output {
        Output { steps, verdict: Verdict::Pause }
    }
}

/// How to hold a waiter: its record, until when, and when to look again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkPlan {
    pub scope: ScopeId,
    pub give_up_at_ms: u64,
    pub lease_remaining_ms: u64,
    pub now_ms: u64,
}

impl ParkPlan {
    /// When to look at the record again without a wake-up. A worker whose wake-up queue was
    /// advertised only now may have missed a completion that happened meanwhile: at once.
    pub fn recheck_at_ms(&self, queue_just_advertised: bool) -> u64 {
        if queue_just_advertised {
            self.now_ms
        } else {
            wait::first_recheck(self.now_ms, self.lease_remaining_ms, self.give_up_at_ms)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Capture {
    claim: Claim,
    rule: Rc<Rule>,
    state: State,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    /// The body outgrew `max_response_bytes`, or was cut: the outcome is kept without it.
    overflowed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    /// Not (or no longer) our business.
    Idle,
    /// Protected request held until its body is complete.
    Collecting(Pending),
    /// `begin` asked; the request stays held until the store answers.
    AwaitingBegin { now_ms: u64, attempt: ClaimAttempt },
    /// Wait mode: asked to be parked in the wait room (`again`: back, after a recheck).
    Parking { lease_remaining_ms: u64, again: bool },
    /// Held in the wait room (its body stays in Envoy's buffer, never read again: its
    /// fingerprint is `Admitted`'s); the root looks at its record again (`recheck`).
    Waiting,
    /// A waiter's `begin` asked again (at `now_ms`); its answer is the waiter's fate.
    Rechecking { now_ms: u64 },
    /// We answered locally; our own reply comes back through the encode callbacks and must be
    /// left alone (never snapshotted), except that a replay's framing headers are put back.
    Answered { replay_shape: Option<ReplayShape> },
    /// Detached execution: the root carries the request, with its flow, and owns its record
    /// until the call's answer (`detached_answered`).
    Detached { claim: Claim, rule: Rc<Rule> },
    /// The detached call's outcome is being written; its client gets `reply` once it is.
    SettlingDetached { settlement: Settlement, reply: Reply },
    /// That write was handed to the root's carrier, which sends `reply` once it is over
    /// (`written`).
    AwaitingWrite { reply: Reply },
    /// Forwarded with a claim; waiting for the response.
    Forwarded { claim: Claim, rule: Rc<Rule> },
    /// A real upstream answer worth keeping; its body is copied as it streams by.
    Capturing(Capture),
    /// `complete` or `release` asked; the answer only decides what is counted and who is woken.
    Settling { claim: Claim, rule: Rc<Rule>, done: Counter },
    /// `reconcile`: the record's lease ended without an outcome; the upstream's lookup is asked.
    Reconciling { attempt: ClaimAttempt },
    /// The lookup found the answer: the record is taken over (`begin` asked again) so that the
    /// answer becomes its outcome.
    Adopting { now_ms: u64, found: Found },
    /// The lookup's answer is being written as the record's outcome; the request gets it then.
    SettlingFound { claim: Claim, found: Found },
    /// The root's own lookup when a lease ends (`lease_end`), for no stream: its whole life.
    LeaseEnd(Box<LeaseEndLookup>),
}

/// What admission decided once for a protected request, read by every phase that asks the
/// store about its record (`AwaitingBegin` to `SettlingFound`): its rule, record, caller and
/// head (`engine::Pending`) and its body's fingerprint. Shared, so that a phase reads it while
/// the flow moves to the next one; the phases carry only their own data.
#[derive(Debug)]
pub(super) struct Admitted {
    pub(super) pending: Pending,
    pub(super) fingerprint: Fingerprint,
}

/// One request's state. `context_id` only names it in logs.
#[derive(Debug)]
pub struct RequestFlow {
    pub(super) context_id: u32,
    /// What admission decided once, for the phases that ask the store about the record (set
    /// when the body is in; let go once the request is forwarded).
    pub(super) admitted: Option<Rc<Admitted>>,
    pub(super) phase: Phase,
    /// With `audit`: what this request's record is, for the entries its changes publish.
    pub(super) audit: Option<Box<AuditRecord>>,
    /// `mode: "shadow"`: every local answer becomes a forward, counted (`shadowed`).
    pub(super) shadow: bool,
    /// The rule of a request that went upstream under a claim, until its stream ends: the
    /// router's attempt count is only final then.
    pub(super) forwarded_rule: Option<Rc<Rule>>,
    /// The route rule the request matched, for its whole life: what it counts is counted
    /// under that rule too.
    pub(super) rule: Option<Rc<Rule>>,
    /// A request body callback came while the request was held for its body.
    pub(super) body_seen: bool,
    /// The record this request is about, once its key and identity made one.
    pub(super) scope: Option<ScopeId>,
    /// `reconcile`: what a lookup at the lease's end needs, kept while the request is forwarded.
    pub(super) later: Option<Box<LaterLookup>>,
    /// `reconcile`: the request's head as a lookup needs it, kept from admission.
    pub(super) lookup_request: Vec<(String, Vec<u8>)>,
    /// Its stream went away while the root carried the flow (`stream_gone`).
    pub(super) stream_gone: bool,
}

impl RequestFlow {
    pub fn new(context_id: u32) -> RequestFlow {
        RequestFlow {
            context_id,
            admitted: None,
            phase: Phase::Idle,
            forwarded_rule: None,
            rule: None,
            body_seen: false,
            scope: None,
            later: None,
            lookup_request: Vec::new(),
            audit: None,
            shadow: false,
            stream_gone: false,
        }
    }

    /// A lease-end lookup's flow (`lease_end`): no stream to answer or resume.
    pub fn headless(&self) -> bool {
        matches!(self.phase, Phase::LeaseEnd(_))
    }

    /// True when no stream hears what this flow says: a lease-end lookup's, or one whose stream
    /// went away while the root carried it. What it counts is counted, and published to no
    /// stream; its replies go to nobody.
    pub fn streamless(&self) -> bool {
        self.headless() || self.stream_gone
    }

    /// The record this request is about (None before its body made one, or when unprotected).
    pub fn scope(&self) -> Option<&ScopeId> {
        self.scope.as_ref()
    }

    /// The route rule the request matched (None: no rule, so it passed through).
    pub fn rule(&self) -> Option<&Rule> {
        self.rule.as_deref()
    }

    /// True while a store operation this flow asked for has not been answered.
    #[cfg(test)]
    pub fn awaiting_store(&self) -> bool {
        matches!(
            self.phase,
            Phase::AwaitingBegin { .. }
                | Phase::Settling { .. }
                | Phase::SettlingDetached { .. }
                | Phase::Adopting { .. }
                | Phase::SettlingFound { .. }
        )
    }

    /// True while an upstream answer's body is being copied for its record (and still fits).
    pub fn capturing(&self) -> bool {
        matches!(&self.phase, Phase::Capturing(c) if !c.overflowed)
    }

    /// True when nothing later in the stream can concern this flow: it is idle (its request
    /// passed through, or was never seen) with no request to settle. Every later callback of an
    /// idle flow answers "go on" and does nothing (`request_body`, `response_headers`,
    /// `response_body`, `stream_ended` all leave an idle flow as it is).
    pub fn inert(&self) -> bool {
        matches!(self.phase, Phase::Idle) && self.forwarded_rule.is_none()
    }

    pub(super) fn answer(&mut self, reply: Reply, details: &'static str, mut steps: Vec<Step>) -> Output {
        self.phase = Phase::Answered { replay_shape: reply.replay_shape.clone() };
        steps.push(Step::Reply { reply, details });
        Output::hold(steps)
    }

    fn refuse(&mut self, problem: &Problem) -> Output {
        let counter = Counter::of_problem(problem.kind);
        if let Some(shadowed) = self.shadowed(counter) {
            return shadowed;
        }
        self.answer(Reply::problem(problem), DETAILS_PROBLEM, vec![Step::Count(counter)])
    }

    /// Shadow mode (`mode: "shadow"`): the local answer counted as `counter` is not given; the
    /// request is forwarded as it came, without a claim (none was granted: a replay, a refusal,
    /// a record in flight), and counted as what it would have been. None: enforce it.
    pub(super) fn shadowed(&mut self, counter: Counter) -> Option<Output> {
        let shadow = counter.shadow().filter(|_| self.shadow)?;
        said(self.context_id, shadow.name(), self.scope.as_ref());
        self.phase = Phase::Idle;
        Some(Output::go(vec![Step::Count(shadow)]))
    }

    /// Request headers. A host call that returns data costs Envoy about as much as a small
    /// header map copy (a callback into the module to allocate, then the copy: ~2 us each, see
    /// BENCHMARKS.md), so every request costs one read: the worker reads the whole map once per
    /// callback and answers `request_header` and `request_headers` from it (`:path` and
    /// `:method` of unprotected traffic are found in place, nothing decoded).
    pub fn request_headers(
        &mut self,
        cfg: &Config,
        facts: &mut dyn StreamFacts,
        end_of_stream: bool,
    ) -> Output {
        let passed = || Output::go(vec![Step::Count(Counter::PassedThrough)]);
        let path = facts.request_header(":path").unwrap_or_default();
        let path = crate::host::pairs::text(&path);
        let path_only = path.split('?').next().unwrap_or_default();
        if !cfg.any_rule_for_path(path_only) {
            return passed();
        }
        let Ok(headers) = facts.request_headers() else {
            log::warn!("#{} cannot read request headers; passing through", self.context_id);
            return passed();
        };
        let method =
            headers.iter().find(|(n, _)| n == ":method").map(|(_, v)| v.as_slice()).unwrap_or_default();
        let method = crate::host::pairs::text(method);
        let Some(rule) = cfg.rule_for(&method, path_only) else { return passed() };
        self.rule = Some(Rc::clone(rule));
        self.shadow = cfg.shadow;
        let verified_claims =
            cfg.jwt_principal.as_ref().and_then(|jwt| verified_claims(facts, &jwt.payload, &jwt.claims));
        // One host call more, and only where the configuration names the service by its cluster.
        let cluster = match cfg.scope_host {
            ScopeHost::Cluster => facts.property(&["xds", "cluster_name"]).ok().flatten(),
            ScopeHost::Authority | ScopeHost::None => None,
        };
        let head = RequestHead {
            method: &method,
            path: &path,
            headers: &headers,
            verified_claims: verified_claims.as_deref(),
            cluster: cluster.as_deref(),
        };
        match engine::admit(cfg, &head) {
            Admission::PassThrough => passed(),
            Admission::Reject(problem) => {
                log::debug!("#{} refused at headers: {}", self.context_id, problem.kind.slug());
                self.refuse(&problem)
            }
            Admission::Collect(pending) => {
                if let Some(reconcile) = &pending.rule.reconcile {
                    self.lookup_request =
                        crate::worker::reconcile::lookup_request(&pending.rule, reconcile, &headers);
                }
                let own_key = matches!(pending.rule.key, KeySource::Header { own: true, .. });
                // A protected request's retries and deadlines are the configuration's, never
                // its caller's: whatever carries it upstream, it goes without them.
                let controls = cfg.envoy_headers.present(&headers);
                let mut out = if end_of_stream {
                    self.body_complete(cfg, pending, Ok(Vec::new()), facts)
                } else {
                    self.phase = Phase::Collecting(pending);
                    Output::hold(Vec::new())
                };
                if !controls.is_empty() {
                    let removed =
                        [Step::RemoveRequestHeaders(controls), Step::Count(Counter::RouterControlsRemoved)];
                    out.steps.splice(0..0, removed);
                }
                if own_key {
                    out.steps.insert(0, Step::Count(Counter::KeyFromHeader));
                }
                out
            }
        }
    }

    /// A request body frame; `size` is all that Envoy has buffered so far.
    pub fn request_body(
        &mut self,
        cfg: &Config,
        facts: &mut dyn StreamFacts,
        size: usize,
        end_of_stream: bool,
    ) -> Output {
        let rule = match &self.phase {
            Phase::Collecting(p) => Rc::clone(&p.rule),
            Phase::Answered { .. } => return Output::hold(Vec::new()),
            _ => return Output::go(Vec::new()),
        };
        self.body_seen = true;
        // Refuse as soon as the buffered body outgrows the limit, not at its end.
        if size as u64 > rule.max_request_bytes {
            return self.refuse(&engine::too_large(&rule));
        }
        if end_of_stream {
            self.read_body(cfg, facts, size)
        } else {
            Output::hold(Vec::new())
        }
    }

    /// Request trailers: the body before them is complete.
    pub fn request_trailers(&mut self, cfg: &Config, facts: &mut dyn StreamFacts) -> Output {
        match self.phase {
            Phase::Collecting(_) => {
                self.body_seen = true;
                self.read_body(cfg, facts, usize::MAX)
            }
            Phase::Answered { .. } => Output::hold(Vec::new()),
            _ => Output::go(Vec::new()),
        }
    }

    fn read_body(&mut self, cfg: &Config, facts: &mut dyn StreamFacts, size: usize) -> Output {
        let Phase::Collecting(pending) = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return Output::go(Vec::new());
        };
        let body = facts.request_body(size);
        self.body_complete(cfg, pending, body, facts)
    }

    fn body_complete(
        &mut self,
        cfg: &Config,
        pending: Pending,
        body: Result<Vec<u8>, Unreadable>,
        facts: &mut dyn StreamFacts,
    ) -> Output {
        let Ok(body) = body else {
            log::warn!("#{} cannot read the request body", self.context_id);
            if let Some(shadowed) = self.shadowed(Counter::StoreError) {
                return shadowed;
            }
            let problem =
                Problem::new(Kind::StoreUnavailable, 503, "the request body could not be read; retry later")
                    .retry_after_ms(1000);
            return self.answer(
                Reply::problem(&problem),
                DETAILS_PROBLEM,
                vec![Step::Count(Counter::StoreError)],
            );
        };
        let fingerprint = match engine::fingerprint_body(&pending, &body) {
            Ok(fingerprint) => fingerprint,
            Err(problem) => return self.refuse(&problem),
        };
        let mut pending = pending;
        let source = match pending.rule.key {
            KeySource::Json { .. } => Counter::KeyFromJson,
            KeySource::Fingerprint => Counter::KeyFromFingerprint,
            KeySource::Header { .. } => return self.claim(cfg, pending, fingerprint, facts, Vec::new()),
        };
        match engine::key_body(cfg, &mut pending, &body, &fingerprint) {
            Ok(()) => self.claim(cfg, pending, fingerprint, facts, vec![Step::Count(source)]),
            // Forwarded as it came, without a claim: the body held is let go with it.
            Err(Unprotected::PassThrough) => Output::go(vec![Step::Count(Counter::PassedThrough)]),
            Err(Unprotected::Reject(problem)) => self.refuse(&problem),
        }
    }

    /// The key and fingerprint are known: ask the store for the claim (`steps` go first).
    fn claim(
        &mut self,
        cfg: &Config,
        pending: Pending,
        fingerprint: Fingerprint,
        facts: &mut dyn StreamFacts,
        mut steps: Vec<Step>,
    ) -> Output {
        let now_ms = facts.now_ms();
        let owner = facts.owner_token();
        self.scope = Some(pending.scope);
        if cfg.audit {
            self.audit = Some(Box::new(AuditRecord::new(&pending, &fingerprint, now_ms)));
        }
        let attempt = engine::claim_attempt(cfg, &pending, fingerprint, now_ms, owner);
        self.admitted = Some(Rc::new(Admitted { pending, fingerprint }));
        self.phase = Phase::AwaitingBegin { now_ms, attempt: attempt.clone() };
        steps.push(Step::Store(StoreOp::Begin(attempt)));
        Output::hold(steps)
    }

    /// The store answered the operation this flow asked for.
    pub fn store_answered(&mut self, cfg: &Config, answer: StoreAnswer) -> Output {
        if let Phase::LeaseEnd(lookup) = &mut self.phase {
            return lookup.store_answered(cfg, answer);
        }
        let admitted = self.admitted.clone();
        match (std::mem::replace(&mut self.phase, Phase::Idle), answer, admitted) {
            (Phase::AwaitingBegin { attempt, .. }, StoreAnswer::Begun(Ok(Begin::Unsettled)), Some(a))
                if a.pending.rule.reconcile.is_some() && !self.shadow =>
            {
                said(
                    self.context_id,
                    "lease ended unsettled; asking the upstream about",
                    Some(&a.pending.scope),
                );
                let rule = Rc::clone(&a.pending.rule);
                self.phase = Phase::Reconciling { attempt };
                Output::hold(vec![Step::Lookup { rule, request: self.lookup_request.clone() }])
            }
            (Phase::AwaitingBegin { now_ms, .. }, StoreAnswer::Begun(begun), Some(a)) => {
                let decision = engine::decision_of(cfg, &a.pending, begun);
                self.decided(&a, now_ms, decision)
            }
            (Phase::Rechecking { now_ms }, StoreAnswer::Begun(begun), Some(a)) => {
                let decision = engine::decision_of(cfg, &a.pending, begun);
                self.rechecked(&a, now_ms, decision)
            }
            (Phase::Adopting { now_ms, found }, StoreAnswer::Begun(begun), Some(a)) => {
                match begun {
                    // The record is this request's now: the lookup's answer becomes its outcome.
                    Ok(Begin::Claimed(claim) | Begin::TookOver(claim)) => {
                        let completion = found.completion(now_ms, a.pending.rule.ttl_ms);
                        self.audit_outcome(completion.state, completion.status);
                        self.phase = Phase::SettlingFound { claim, found };
                        Output::hold(vec![Step::Store(StoreOp::Complete { claim, completion })])
                    }
                    // Settled by someone else meanwhile (a replay, a request in flight, ...).
                    begun => {
                        let decision = engine::decision_of(cfg, &a.pending, begun);
                        self.decided(&a, now_ms, decision)
                    }
                }
            }
            (Phase::SettlingFound { claim, found }, StoreAnswer::Settled(settled), Some(a)) => {
                self.found_settled(cfg, &a, claim, found, settled)
            }
            (Phase::Settling { claim, rule, done }, StoreAnswer::Settled(settled), _) => {
                let settlement = Settlement { context_id: self.context_id, claim, rule, done };
                Output::go(settlement.answered(settled))
            }
            (Phase::SettlingDetached { settlement, reply }, StoreAnswer::Settled(settled), _) => {
                let steps = settlement.answered(settled);
                self.answer(reply, crate::worker::detached::DETAILS_DETACHED, steps)
            }
            (phase, _, _) => {
                // An answer nobody here asked for (a late one after a timeout): nothing to do.
                said(self.context_id, "ignored a store answer nobody was waiting for", None);
                self.phase = phase;
                Output::go(Vec::new())
            }
        }
    }

    /// The store could not be used (it failed or did not answer in time). For a request waiting
    /// for its claim, `mode` decides: fail closed (503) or forward unprotected. A settlement
    /// is counted as a store error either way (the response is already on its way).
    pub fn store_failed(&mut self, cfg: &Config, error: StoreError, mode: OnStoreError) -> Output {
        match (&mut self.phase, mode) {
            // Nothing of it is ever forwarded: whatever the fail mode, as the store's failure.
            (Phase::LeaseEnd(lookup), _) => lookup.store_failed(cfg, error),
            (Phase::AwaitingBegin { .. }, OnStoreError::FailOpen) => {
                log::debug!(
                    "#{} store unavailable ({error}); forwarding key {} unprotected",
                    self.context_id,
                    self.scope.map(|s| s.log_tag()).unwrap_or_default()
                );
                self.phase = Phase::Idle;
                Output::go(vec![Step::Count(Counter::StoreBypassed)])
            }
            (Phase::Rechecking { .. }, OnStoreError::FailOpen) => {
                log::debug!(
                    "#{} store unavailable ({error}); forwarding waiter on key {} unprotected",
                    self.context_id,
                    self.scope.map(|s| s.log_tag()).unwrap_or_default()
                );
                self.phase = Phase::Idle;
                Output::go(vec![Step::LeaveWaitRoom, Step::Count(Counter::StoreBypassed)])
            }
            (Phase::AwaitingBegin { .. } | Phase::Rechecking { .. }, OnStoreError::FailClosed) => {
                self.store_answered(cfg, StoreAnswer::Begun(Err(error)))
            }
            (Phase::Settling { .. } | Phase::SettlingFound { .. } | Phase::SettlingDetached { .. }, _) => {
                self.store_answered(cfg, StoreAnswer::Settled(Err(error)))
            }
            // The lookup said the request executed: it is never forwarded unprotected.
            (Phase::Adopting { .. }, _) => self.store_answered(cfg, StoreAnswer::Begun(Err(error))),
            _ => Output::go(Vec::new()),
        }
    }

    /// The store answered `begin` after the request's stream had ended: nobody will forward it,
    /// so a claim it got is given back at once (the release to perform, and what to count when
    /// it is answered) rather than left to block retries until its lease ends.
    pub fn answered_without_stream(&mut self, answer: &StoreAnswer) -> Option<Settlement> {
        let (Phase::AwaitingBegin { .. } | Phase::Rechecking { .. }) =
            std::mem::replace(&mut self.phase, Phase::Idle)
        else {
            return None;
        };
        let rule = Rc::clone(&self.admitted.as_ref()?.pending.rule);
        match answer {
            StoreAnswer::Begun(Ok(Begin::Claimed(claim) | Begin::TookOver(claim))) => {
                said(self.context_id, "client gone before its claim; releasing", Some(&claim.scope));
                let settlement =
                    Settlement { context_id: self.context_id, claim: *claim, rule, done: Counter::Released };
                Some(settlement)
            }
            _ => None,
        }
    }

    /// The store failed this flow's `begin` (or never answered it) after writing a claim that
    /// may have landed: nobody will forward the request, so the claim is given back (what to
    /// count when the release is answered), and the flow goes on to its fail mode.
    pub fn unanswered_claim(&self, claim: Claim) -> Option<Settlement> {
        if let Phase::LeaseEnd(lookup) = &self.phase {
            return lookup.unanswered_claim(claim);
        }
        let (Phase::AwaitingBegin { .. } | Phase::Rechecking { .. }) = &self.phase else {
            return None;
        };
        let pending = &self.admitted.as_ref()?.pending;
        said(self.context_id, "claim unanswered; giving back", Some(&claim.scope));
        Some(Settlement {
            context_id: self.context_id,
            claim,
            rule: Rc::clone(&pending.rule),
            done: Counter::Released,
        })
    }

    /// Takes the `complete`/`release` this flow is waiting for out of its hands, for someone
    /// who outlives the stream to settle (`Settlement::answered`); the flow is done with the record.
    pub fn hand_off_settlement(&mut self) -> Option<Settlement> {
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Settling { claim, rule, done } => {
                Some(Settlement { context_id: self.context_id, claim, rule, done })
            }
            Phase::SettlingDetached { settlement, reply } => {
                self.phase = Phase::AwaitingWrite { reply };
                Some(settlement)
            }
            phase => {
                self.phase = phase;
                None
            }
        }
    }

    pub(super) fn decided(&mut self, admitted: &Admitted, now_ms: u64, decision: Decision) -> Output {
        let Admitted { pending, fingerprint } = admitted;
        match decision {
            Decision::Forward { claim, counter } => {
                if pending.rule.reconcile.is_some() {
                    let due_ms = now_ms.saturating_add(pending.rule.processing_timeout_ms);
                    let request = std::mem::take(&mut self.lookup_request);
                    let later = LaterLookup {
                        pending: pending.clone(),
                        fingerprint: *fingerprint,
                        request,
                        due_ms,
                        route_cluster: None,
                        owner: claim.owner,
                    };
                    self.later = Some(Box::new(later));
                }
                self.forward(pending, claim, counter, now_ms)
            }
            Decision::Respond { reply, counter } => self.respond(pending, reply, counter),
            Decision::Wait { .. } if self.shadow => {
                self.shadowed(Counter::InFlight).unwrap_or_else(|| Output::go(Vec::new()))
            }
            Decision::Wait { lease_remaining_ms } => {
                let plan = ParkPlan {
                    give_up_at_ms: wait::give_up_at(pending, now_ms),
                    scope: pending.scope,
                    lease_remaining_ms,
                    now_ms,
                };
                self.phase = Phase::Parking { lease_remaining_ms, again: false };
                Output::hold(vec![Step::Park(plan)])
            }
        }
    }

    /// The request owns the record: forwarded upstream through Envoy, or carried by the root on
    /// a detached rule. Its claim, made at `now_ms`, is held (renewed) while it is at work.
    pub(super) fn forward(
        &mut self,
        pending: &Pending,
        claim: Claim,
        counter: Counter,
        now_ms: u64,
    ) -> Output {
        said(self.context_id, counter.name(), Some(&pending.scope));
        let rule = &pending.rule;
        let hold = Step::Hold(Hold {
            claim,
            lease_ms: rule.processing_timeout_ms,
            lease_end_ms: now_ms.saturating_add(rule.processing_timeout_ms),
            expires_at_ms: now_ms.saturating_add(rule.ttl_ms),
        });
        // Nothing asks the store about the record again: what admission decided goes.
        self.admitted = None;
        // In shadow mode the route's own router carries it: a detached call would be the filter
        // answering the client in the upstream's stead.
        if matches!(pending.rule.execution, Execution::Detached { .. }) && !self.shadow {
            self.phase = Phase::Detached { claim, rule: Rc::clone(&pending.rule) };
            return Output::hold(vec![
                Step::Count(counter),
                hold,
                Step::Detach { claim, rule: Rc::clone(&pending.rule) },
            ]);
        }
        self.forwarded_rule = Some(Rc::clone(&pending.rule));
        self.phase = Phase::Forwarded { claim, rule: Rc::clone(&pending.rule) };
        Output::go(vec![Step::Count(counter), hold])
    }

    /// Answered locally: a replay or a problem.
    pub(super) fn respond(&mut self, pending: &Pending, reply: Reply, counter: Counter) -> Output {
        if let Some(shadowed) = self.shadowed(counter) {
            return shadowed;
        }
        said(self.context_id, counter.name(), Some(&pending.scope));
        self.answer(reply, engine::reply_details(counter), vec![Step::Count(counter)])
    }

    /// The root could not resume this paused request (its stream is going away): a claim it
    /// was to be forwarded with is given back, since nothing was sent upstream (the release to
    /// perform, and what to count when it is answered).
    pub fn not_resumed(&mut self) -> Option<Settlement> {
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Forwarded { claim, rule } => {
                said(self.context_id, "not resumed; releasing", Some(&claim.scope));
                self.forwarded_rule = None;
                Some(Settlement { context_id: self.context_id, claim, rule, done: Counter::Released })
            }
            phase => {
                self.phase = phase;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use crate::store::fake::FakeSharedData;
    use crate::store::local::LocalStore;
    use crate::store::Completion;
    use crate::store::RecordStore;
    use crate::store::Settled;
    use crate::worker::wait::NotHeld;
    use std::collections::HashMap;

    const CONFIG: &str = r#"{"routes":[
        {"name":"orders","match":{"prefix":"/orders"},"require_key":true,"max_response_bytes":8,
         "unknown_outcome":"takeover"},
        {"name":"waits","match":{"prefix":"/wait"},"require_key":true,"concurrent":"wait"},
        {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"unknown_outcome":"refuse",
         "processing_timeout":"1s"},
        {"name":"waitpay","match":{"prefix":"/held-pay"},"require_key":true,"concurrent":"wait",
         "unknown_outcome":"refuse"}]}"#;

    fn cfg() -> Config {
        parse(CONFIG.as_bytes()).unwrap()
    }

    /// A stream as Envoy would report it; `None` properties are absent, listed ones unreadable.
    #[derive(Default)]
    struct Facts {
        now_ms: u64,
        owner: u64,
        request: Vec<(String, Vec<u8>)>,
        request_body: Option<Vec<u8>>,
        response: Vec<(String, Vec<u8>)>,
        response_body: Vec<u8>,
        properties: HashMap<String, Vec<u8>>,
        unreadable: Vec<String>,
    }

    impl Facts {
        fn post(path: &str, key: &str, body: &[u8]) -> Facts {
            Facts {
                request: vec![
                    (":method".into(), b"POST".to_vec()),
                    (":path".into(), path.as_bytes().to_vec()),
                    ("idempotency-key".into(), key.as_bytes().to_vec()),
                ],
                request_body: Some(body.to_vec()),
                ..Facts::default()
            }
        }
        fn upstream_answer(mut self, status: u16, body: &[u8]) -> Facts {
            self.response = vec![(":status".into(), status.to_string().into_bytes())];
            self.response_body = body.to_vec();
            self.properties.insert("response\0code_details".into(), b"via_upstream".to_vec());
            self
        }
        fn local_reply(mut self, details: &str, flags: u64, upstream_address: &str) -> Facts {
            self.response = vec![(":status".into(), b"503".to_vec())];
            self.properties.insert("response\0code_details".into(), details.as_bytes().to_vec());
            self.properties.insert("response\0flags".into(), flags.to_le_bytes().to_vec());
            self.properties.insert("upstream\0address".into(), upstream_address.as_bytes().to_vec());
            self
        }
    }

    impl StreamFacts for Facts {
        fn now_ms(&mut self) -> u64 {
            self.now_ms
        }
        fn owner_token(&mut self) -> u64 {
            self.owner += 1;
            self.owner
        }
        fn request_header(&mut self, name: &str) -> Option<Vec<u8>> {
            self.request.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
        }
        fn request_headers(&mut self) -> Result<Vec<(String, Vec<u8>)>, Unreadable> {
            Ok(self.request.clone())
        }
        fn request_body(&mut self, _size: usize) -> Result<Vec<u8>, Unreadable> {
            self.request_body.clone().ok_or(Unreadable)
        }
        fn response_headers(&mut self) -> Vec<(String, Vec<u8>)> {
            self.response.clone()
        }
        fn response_body(&mut self, size: usize) -> Result<Vec<u8>, Unreadable> {
            Ok(self.response_body.iter().copied().take(size).collect())
        }
        fn property(&mut self, path: &[&str]) -> Result<Option<Vec<u8>>, Unreadable> {
            let key = path.join("\0");
            if self.unreadable.contains(&key) {
                return Err(Unreadable);
            }
            Ok(self.properties.get(&key).cloned())
        }
    }

    use crate::engine::tests::World;

    /// Performs store steps at once, as the worker does with the local store; returns the other
    /// steps in order and the last verdict.
    fn run(flow: &mut RequestFlow, out: Output, store: &dyn RecordStore) -> (Vec<Step>, Verdict) {
        let mut verdict = out.verdict;
        let mut done = Vec::new();
        let mut queue: std::collections::VecDeque<Step> = out.steps.into();
        while let Some(step) = queue.pop_front() {
            match step {
                Step::Store(op) => {
                    let more = flow.store_answered(&cfg(), op.perform(store));
                    verdict = more.verdict;
                    queue.extend(more.steps);
                }
                other => done.push(other),
            }
        }
        (done, verdict)
    }

    fn counters(steps: &[Step]) -> Vec<Counter> {
        steps.iter().filter_map(|s| if let Step::Count(c) = s { Some(*c) } else { None }).collect()
    }

    fn reply_of(steps: &[Step]) -> (&Reply, &'static str) {
        steps
            .iter()
            .find_map(|s| if let Step::Reply { reply, details } = s { Some((reply, *details)) } else { None })
            .unwrap()
    }

    fn header<'r>(r: &'r Reply, name: &str) -> Option<&'r [u8]> {
        r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// Headers, then the whole body: where the store is asked.
    fn to_begin(flow: &mut RequestFlow, facts: &mut Facts) -> Output {
        let c = cfg();
        assert_eq!(flow.request_headers(&c, facts, false), Output::hold(Vec::new()));
        let size = facts.request_body.as_ref().map_or(0, Vec::len);
        flow.request_body(&c, facts, size, true)
    }

    fn begun(flow: &mut RequestFlow, facts: &mut Facts, store: &dyn RecordStore) -> (Vec<Step>, Verdict) {
        let out = to_begin(flow, facts);
        run(flow, out, store)
    }

    #[test]
    fn a_claimed_request_is_captured_completed_and_then_replayed() {
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"{}").upstream_answer(201, b"{\"id\":1}");
        let mut flow = RequestFlow::new(1);
        let (steps, verdict) = begun(&mut flow, &mut facts, &w.store());
        assert_eq!((counters(&steps), verdict), (vec![Counter::Claimed], Verdict::Continue));
        assert_eq!(flow.response_headers(&cfg(), &mut facts, false), Output::go(Vec::new()));
        let out = flow.response_body(&mut facts, 8, true);
        let (steps, _) = run(&mut flow, out, &w.store());
        assert_eq!(counters(&steps), vec![Counter::Stored]);
        // A retry: replayed, with our details string, and its headers fixed on the way out.
        let mut retry_facts = Facts::post("/orders", "k", b"{}");
        let mut retry = RequestFlow::new(2);
        let (steps, verdict) = begun(&mut retry, &mut retry_facts, &w.store());
        assert_eq!((counters(&steps), verdict), (vec![Counter::Replayed], Verdict::Pause));
        let (reply, details) = reply_of(&steps);
        assert_eq!((reply.status, reply.body.as_slice(), details), (201, &b"{\"id\":1}"[..], DETAILS_REPLAY));
        // Envoy's local-reply path invented a content-type the upstream never sent.
        retry_facts.response = vec![("content-type".into(), b"text/plain".to_vec())];
        let out = retry.response_headers(&cfg(), &mut retry_facts, false);
        assert_eq!(out, Output::go(vec![Step::FixHeaders(vec![HeaderFix::Remove("content-type")])]));
    }

    #[test]
    fn a_request_that_ends_before_any_of_its_body_is_counted_and_warned_about() {
        let c = cfg();
        let mut facts = Facts::post("/orders", "k", b"{}");
        facts.properties.insert("response\0code_details".into(), b"stream_idle_timeout".to_vec());
        let mut flow = RequestFlow::new(1);
        assert_eq!(flow.request_headers(&c, &mut facts, false), Output::hold(Vec::new()));
        assert_eq!(
            flow.stream_ended(&mut facts),
            Output::go(vec![
                Step::Count(Counter::BodyNeverReceived),
                Step::WarnBodyNeverReceived {
                    rule: "orders".into(),
                    details: Some("stream_idle_timeout".into())
                },
            ])
        );
        // A client that left in the middle of its body is not this: part of it arrived.
        let mut flow = RequestFlow::new(2);
        flow.request_headers(&c, &mut facts, false);
        assert_eq!(flow.request_body(&c, &mut facts, 1, false), Output::hold(Vec::new()));
        assert_eq!(flow.stream_ended(&mut facts), Output::go(Vec::new()));
        // Nor is a request that passed through, or one whose body came whole.
        let mut flow = RequestFlow::new(3);
        let mut other = Facts::post("/elsewhere", "k", b"{}");
        flow.request_headers(&c, &mut other, false);
        assert_eq!(flow.stream_ended(&mut other), Output::go(Vec::new()));
        let w = World::new();
        let mut flow = RequestFlow::new(4);
        begun(&mut flow, &mut Facts::post("/orders", "k4", b"{}"), &w.store());
        assert!(counters(&flow.stream_ended(&mut facts).steps)
            .iter()
            .all(|c| *c != Counter::BodyNeverReceived));
    }

    #[test]
    fn a_body_envoy_received_and_kept_from_the_filter_is_the_missing_setting() {
        let c = cfg();
        // Envoy's request.total_size: the header map (names and values) plus the body bytes
        // that came off the connection, whether or not any filter saw them.
        let with_body_at_envoy = |body_bytes: u64| {
            let mut facts = Facts::post("/orders", "k", b"{}");
            let head: usize = facts.request.iter().map(|(n, v)| n.len() + v.len()).sum();
            let total = head as u64 + body_bytes;
            facts.properties.insert("request\0total_size".into(), total.to_le_bytes().to_vec());
            facts.properties.insert("response\0code_details".into(), b"stream_idle_timeout".to_vec());
            facts
        };
        let mut facts = with_body_at_envoy(23);
        let mut flow = RequestFlow::new(1);
        assert_eq!(flow.request_headers(&c, &mut facts, false), Output::hold(Vec::new()));
        assert_eq!(
            flow.stream_ended(&mut facts),
            Output::go(vec![
                Step::Count(Counter::BodyNeverReceived),
                Step::ErrorStopIterationMissing {
                    rule: "orders".into(),
                    details: Some("stream_idle_timeout".into()),
                    body_bytes: 23
                },
            ])
        );
        // Envoy received no body either (the client left first): the ambiguous warning.
        let mut facts = with_body_at_envoy(0);
        let mut flow = RequestFlow::new(2);
        flow.request_headers(&c, &mut facts, false);
        let steps = flow.stream_ended(&mut facts).steps;
        assert!(
            matches!(steps.as_slice(), [Step::Count(_), Step::WarnBodyNeverReceived { .. }]),
            "{steps:?}"
        );
        // Envoy's count unreadable: nothing proves the setting missing, so the warning too.
        let mut facts = with_body_at_envoy(23);
        facts.unreadable.push("request\0total_size".into());
        let mut flow = RequestFlow::new(3);
        flow.request_headers(&c, &mut facts, false);
        let steps = flow.stream_ended(&mut facts).steps;
        assert!(
            matches!(steps.as_slice(), [Step::Count(_), Step::WarnBodyNeverReceived { .. }]),
            "{steps:?}"
        );
    }

    #[test]
    fn a_verified_payload_must_carry_every_configured_claim() {
        let c = parse(
            br#"{"principal":{"jwt_payload":"jwt","claims":["iss","sub"]},
            "routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#,
        )
        .unwrap();
        const PAYLOAD: &str = "metadata\0filter_metadata\0envoy.filters.http.jwt_authn\0jwt";
        let claim = |name: &str| format!("{PAYLOAD}\0{name}");
        let admitted = |facts: &mut Facts| {
            let out = RequestFlow::new(1).request_headers(&c, facts, false);
            (out.verdict, counters(&out.steps))
        };
        let refused = (Verdict::Pause, vec![Counter::PrincipalIncomplete]);
        let held = (Verdict::Pause, vec![]);
        // Every claim: admitted.
        let mut facts = Facts::post("/orders", "k", b"{}");
        facts.properties.insert(claim("iss"), b"i".to_vec());
        facts.properties.insert(claim("sub"), b"u1".to_vec());
        assert_eq!(admitted(&mut facts), held);
        // iss without sub, or a sub Envoy cannot hand over: refused.
        facts.properties.remove(&claim("sub"));
        assert_eq!(admitted(&mut facts), refused);
        facts.unreadable.push(claim("sub"));
        assert_eq!(admitted(&mut facts), refused);
        // A payload with neither claim (readable or not): refused.
        let mut facts = Facts::post("/orders", "k", b"{}");
        facts.properties.insert(PAYLOAD.into(), b"pairs".to_vec());
        assert_eq!(admitted(&mut facts), refused);
        let mut facts = Facts::post("/orders", "k", b"{}");
        facts.unreadable.push(PAYLOAD.into());
        assert_eq!(admitted(&mut facts), refused);
        // No payload at all (no token): the principal headers name the caller.
        assert_eq!(admitted(&mut Facts::post("/orders", "k", b"{}")), held);
    }

    #[test]
    fn a_store_answer_may_come_in_a_later_callback() {
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"x");
        let mut flow = RequestFlow::new(1);
        let out = to_begin(&mut flow, &mut facts);
        assert_eq!(out.verdict, Verdict::Pause);
        let [Step::Store(op)] = out.steps.as_slice() else { panic!("{out:?}") };
        assert!(flow.awaiting_store());
        // Nothing else happens while the request is held; then the answer arrives.
        let answer = op.perform(&w.store());
        let out = flow.store_answered(&cfg(), answer);
        // Forwarded, its claim held (renewed while it is at work) from the begin's time.
        let [Step::Count(Counter::Claimed), Step::Hold(hold)] = out.steps.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!((out.verdict, hold.lease_end_ms - hold.lease_ms), (Verdict::Continue, facts.now_ms));
        assert!(!flow.awaiting_store());
    }

    #[test]
    fn a_store_that_never_answers_fails_closed_with_503_and_retry_after() {
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"x");
        let mut flow = RequestFlow::new(1);
        let out = to_begin(&mut flow, &mut facts);
        let [Step::Store(op)] = out.steps.as_slice() else { panic!("{out:?}") };
        let op = op.clone();
        let out = flow.store_failed(
            &cfg(),
            StoreError::Unavailable("no answer in time".into()),
            OnStoreError::FailClosed,
        );
        assert_eq!((counters(&out.steps), out.verdict), (vec![Counter::StoreError], Verdict::Pause));
        let (reply, details) = reply_of(&out.steps);
        assert_eq!((reply.status, details), (503, DETAILS_PROBLEM));
        assert!(header(reply, "retry-after").is_some());
        assert!(String::from_utf8_lossy(&reply.body).contains("store-unavailable"));
        // The answer that comes too late changes nothing.
        assert_eq!(flow.store_answered(&cfg(), op.perform(&w.store())), Output::go(Vec::new()));
        // A settlement that never gets its answer is counted as a store error.
        let mut facts = Facts::post("/orders", "k2", b"x").upstream_answer(201, b"");
        let mut flow = RequestFlow::new(2);
        begun(&mut flow, &mut facts, &w.store());
        let out = flow.response_headers(&cfg(), &mut facts, true);
        assert!(matches!(out.steps.as_slice(), [Step::Store(StoreOp::Complete { .. })]));
        assert_eq!(
            flow.store_failed(
                &cfg(),
                StoreError::Unavailable("no answer in time".into()),
                OnStoreError::FailClosed
            )
            .steps,
            vec![Step::Count(Counter::StoreError), Step::LetGo(1)]
        );
    }

    #[test]
    fn a_failed_store_fails_closed_or_forwards_unprotected_by_the_fail_mode() {
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"x");
        let mut flow = RequestFlow::new(1);
        to_begin(&mut flow, &mut facts);
        let out = flow.store_failed(&cfg(), StoreError::TimedOut, OnStoreError::FailClosed);
        assert_eq!(counters(&out.steps), vec![Counter::StoreError]);
        assert_eq!(reply_of(&out.steps).0.status, 503);
        // Fail open: forwarded, no claim held, so nothing is settled when the response ends.
        let mut facts = Facts::post("/orders", "k", b"x").upstream_answer(201, b"");
        let mut flow = RequestFlow::new(2);
        to_begin(&mut flow, &mut facts);
        let out = flow.store_failed(&cfg(), StoreError::Unavailable("down".into()), OnStoreError::FailOpen);
        assert_eq!(out, Output::go(vec![Step::Count(Counter::StoreBypassed)]));
        assert!(!flow.awaiting_store());
        assert_eq!(flow.response_headers(&cfg(), &mut facts, true), Output::go(Vec::new()));
        assert_eq!(flow.stream_ended(&mut facts), Output::go(Vec::new()));
        // A settlement's failure is a store error whatever the mode.
        let mut facts = Facts::post("/orders", "k3", b"x").upstream_answer(201, b"");
        let mut flow = RequestFlow::new(3);
        begun(&mut flow, &mut facts, &w.store());
        flow.response_headers(&cfg(), &mut facts, true);
        let out = flow.store_failed(&cfg(), StoreError::TimedOut, OnStoreError::FailOpen);
        assert_eq!(out.steps, vec![Step::Count(Counter::StoreError), Step::LetGo(1)]);
    }

    #[test]
    fn a_handed_off_settlement_is_counted_by_whoever_settles_it() {
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"x").upstream_answer(201, b"");
        let mut flow = RequestFlow::new(1);
        begun(&mut flow, &mut facts, &w.store());
        let out = flow.response_headers(&cfg(), &mut facts, true);
        let [Step::Store(op)] = out.steps.as_slice() else { panic!("{out:?}") };
        let settlement = flow.hand_off_settlement().expect("settling");
        assert!(!flow.awaiting_store());
        assert!(flow.hand_off_settlement().is_none());
        let StoreAnswer::Settled(settled) = op.perform(&w.store()) else { panic!() };
        assert_eq!(settlement.answered(settled), vec![Step::Count(Counter::Stored), Step::LetGo(1)]);
        assert_eq!(
            settlement.answered(Ok(Settled::Lost)),
            vec![Step::Count(Counter::CompletionLost), Step::LetGo(1)]
        );
    }

    #[test]
    fn an_unavailable_store_is_503_and_an_unreadable_body_too() {
        let data = FakeSharedData::new(); // layout never created
        let mut facts = Facts::post("/orders", "k", b"x");
        let mut flow = RequestFlow::new(1);
        let (steps, _) = begun(&mut flow, &mut facts, &LocalStore::new(&data, 64));
        assert_eq!((counters(&steps), reply_of(&steps).0.status), (vec![Counter::StoreError], 503));

        let mut facts = Facts { request_body: None, ..Facts::post("/orders", "k", b"") };
        let mut flow = RequestFlow::new(2);
        flow.request_headers(&cfg(), &mut facts, false);
        let out = flow.request_body(&cfg(), &mut facts, 3, true);
        assert_eq!(counters(&out.steps), vec![Counter::StoreError]);
        let (reply, _) = reply_of(&out.steps);
        assert_eq!(reply.status, 503);
        assert!(header(reply, "retry-after").is_some());
    }

    #[test]
    fn releases_keeps_and_cut_responses() {
        let w = World::new();
        let forwarded = |key: &str, facts: &mut Facts| {
            let mut flow = RequestFlow::new(1);
            let (steps, _) = begun(&mut flow, facts, &w.store());
            assert_eq!(counters(&steps), vec![Counter::Claimed], "{key}");
            flow
        };
        // No upstream host was ever selected (a direct response): release.
        let mut facts = Facts::post("/orders", "a", b"x").local_reply("direct_response", 0, "");
        let mut flow = forwarded("a", &mut facts);
        let out = flow.response_headers(&cfg(), &mut facts, true);
        assert_eq!(counters(&run(&mut flow, out, &w.store()).0), vec![Counter::Released]);
        // The address cannot be read: it may have been sent, keep.
        let mut facts = Facts::post("/orders", "b", b"x").local_reply("ext_authz_denied", 0, "");
        facts.unreadable.push("upstream\0address".into());
        let mut flow = forwarded("b", &mut facts);
        // Kept: its owner lets its claim go (the first owner token of its stream's facts).
        assert_eq!(
            flow.response_headers(&cfg(), &mut facts, true).steps,
            vec![Step::Count(Counter::KeptUnknown), Step::LetGo(1)]
        );
        // A timeout: keep.
        let mut facts = Facts::post("/orders", "c", b"x").local_reply("response_timeout", 0x4, "10.0.0.1:80");
        let mut flow = forwarded("c", &mut facts);
        assert_eq!(
            flow.stream_ended(&mut facts).steps,
            vec![Step::Count(Counter::KeptUnknown), Step::LetGo(1)]
        );
        // Cut mid-body: completed without the body, a retry gets 410.
        let mut facts = Facts::post("/orders", "d", b"x").upstream_answer(201, b"abc");
        let mut flow = forwarded("d", &mut facts);
        flow.response_headers(&cfg(), &mut facts, false);
        flow.response_body(&mut facts, 3, false);
        let out = flow.stream_ended(&mut facts);
        let [Step::Store(StoreOp::Complete { completion, .. })] = out.steps.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(completion.snapshot, None);
        assert_eq!(counters(&run(&mut flow, out, &w.store()).0), vec![Counter::ResponseNotStored]);
        let mut retry = RequestFlow::new(9);
        let (steps, _) = begun(&mut retry, &mut Facts::post("/orders", "d", b"x"), &w.store());
        assert_eq!(reply_of(&steps).0.status, 410);
    }

    /// The outcome-unknown completion in `steps`, performed on `w`'s store; what it counted.
    fn completed_unknown(flow: &mut RequestFlow, out: Output, w: &World, at_ms: u64) -> Vec<Counter> {
        let [Step::Store(StoreOp::Complete { completion, .. })] = out.steps.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(completion, &Completion::outcome_unknown(at_ms, 86_400_000));
        counters(&run(flow, out, &w.store()).0)
    }

    fn retried(w: &World, key: &str, body: &[u8], now_ms: u64) -> (Vec<Counter>, u16, Vec<u8>) {
        let mut facts = Facts { now_ms, ..Facts::post("/pay", key, body) };
        let (steps, _) = begun(&mut RequestFlow::new(9), &mut facts, &w.store());
        let counted = counters(&steps);
        let (reply, _) = reply_of(&steps);
        (counted, reply.status, reply.body.clone())
    }

    #[test]
    fn refuse_completes_an_unknown_outcome_at_once_and_every_retry_gets_502() {
        let w = World::new();
        let forwarded = |facts: &mut Facts| {
            let mut flow = RequestFlow::new(1);
            assert_eq!(counters(&begun(&mut flow, facts, &w.store()).0), vec![Counter::Claimed]);
            flow
        };
        // The router's timeout reply at the response headers.
        let mut facts = Facts { now_ms: 5, ..Facts::post("/pay", "t", b"x") }.local_reply(
            "response_timeout",
            0x4,
            "10.0.0.1:80",
        );
        let mut flow = forwarded(&mut facts);
        let out = flow.response_headers(&cfg(), &mut facts, true);
        assert_eq!(completed_unknown(&mut flow, out, &w, 5), vec![Counter::OutcomeUnknown]);
        assert_eq!(flow.stream_ended(&mut facts), Output::go(Vec::new()), "settled once");
        // The client gone while the upstream worked: only the stream's end tells.
        let mut facts = Facts { now_ms: 7, ..Facts::post("/pay", "c", b"x") }.local_reply(
            "downstream_remote_disconnect",
            0x4000,
            "10.0.0.1:80",
        );
        let mut flow = forwarded(&mut facts);
        let out = flow.stream_ended(&mut facts);
        assert_eq!(completed_unknown(&mut flow, out, &w, 7), vec![Counter::OutcomeUnknown]);
        for key in ["t", "c"] {
            // At once, after the 1 s lease, and just before the ttl: 502, never a claim.
            for now in [8, 5_000, 86_400_004] {
                let (counted, status, body) = retried(&w, key, b"x", now);
                assert_eq!((counted, status), (vec![Counter::UnknownRefused], 502), "{key} at {now}");
                let body = String::from_utf8_lossy(&body);
                assert!(body.contains("urn:idempotency-filter:outcome-unknown"), "{body}");
                assert!(body.contains("new Idempotency-Key"), "{body}");
            }
            // Another payload under the key: the usual 422.
            assert_eq!(retried(&w, key, b"other", 9).0, vec![Counter::Mismatch]);
        }
    }

    /// C26: the router's last attempt failed to connect, but an earlier one was sent (a route
    /// retry policy retried its reset): the outcome is unknown, whatever the last reason says.
    /// At the response headers (the router's 503) and at the stream's end alike; one attempt, or
    /// none (Envoy answered before picking a host), is still released.
    #[test]
    fn a_connect_failure_after_an_earlier_attempt_is_an_unknown_outcome() {
        const REFUSED: &str =
            "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}";
        let w = World::new();
        let attempts = |key: &str, path: &str, n: Option<u64>| {
            let mut facts = Facts::post(path, key, b"x").local_reply(REFUSED, 0x20, "127.0.0.1:1");
            match n {
                Some(n) => {
                    facts
                        .properties
                        .insert("upstream\0request_attempt_count".into(), n.to_le_bytes().to_vec());
                }
                None => facts.unreadable.push("upstream\0request_attempt_count".into()),
            }
            let mut flow = RequestFlow::new(1);
            assert_eq!(counters(&begun(&mut flow, &mut facts, &w.store()).0), vec![Counter::Claimed]);
            (flow, facts)
        };
        // refuse: completed as outcome unknown at the headers, and a retry gets 502.
        let (mut flow, mut facts) = attempts("r", "/pay", Some(3));
        let out = flow.response_headers(&cfg(), &mut facts, true);
        assert_eq!(completed_unknown(&mut flow, out, &w, 0), vec![Counter::OutcomeUnknown]);
        assert_eq!(retried(&w, "r", b"x", 1).1, 502);
        // An attempt count that cannot be read proves nothing either.
        let (mut flow, mut facts) = attempts("u", "/pay", None);
        let out = flow.response_headers(&cfg(), &mut facts, true);
        assert_eq!(completed_unknown(&mut flow, out, &w, 0), vec![Counter::OutcomeUnknown]);
        // takeover: kept in flight, at the headers and at the stream's end.
        let (mut flow, mut facts) = attempts("t", "/orders", Some(2));
        assert_eq!(
            flow.response_headers(&cfg(), &mut facts, true).steps,
            vec![Step::Count(Counter::KeptUnknown), Step::LetGo(1)]
        );
        let (mut flow, mut facts) = attempts("e", "/orders", Some(2));
        let steps = flow.stream_ended(&mut facts).steps;
        assert_eq!(counters(&steps), vec![Counter::UpstreamRetried, Counter::KeptUnknown], "{steps:?}");
        // One attempt (or none) that never left: released, as before.
        for (key, n) in [("one", 1), ("none", 0)] {
            let (mut flow, mut facts) = attempts(key, "/pay", Some(n));
            let out = flow.response_headers(&cfg(), &mut facts, true);
            assert_eq!(counters(&run(&mut flow, out, &w.store()).0), vec![Counter::Released], "{key}");
        }
    }

    #[test]
    fn refuse_never_takes_over_a_claim_whose_lease_ended_without_an_outcome() {
        // The claim's Envoy died while the request was upstream: no outcome was ever written.
        let w = World::new();
        let mut facts = Facts::post("/pay", "d", b"x");
        assert_eq!(
            counters(&begun(&mut RequestFlow::new(1), &mut facts, &w.store()).0),
            vec![Counter::Claimed]
        );
        let (counted, status, _) = retried(&w, "d", b"x", 5);
        assert_eq!((counted, status), (vec![Counter::InFlight], 409), "within the lease");
        // After the lease (1 s) and until the ttl: 502, never forwarded again.
        for now in [1_000, 1_001, 86_400_999] {
            let (counted, status, body) = retried(&w, "d", b"x", now);
            assert_eq!((counted, status), (vec![Counter::UnknownRefused], 502), "at {now}");
            assert!(String::from_utf8_lossy(&body).contains("urn:idempotency-filter:outcome-unknown"));
        }
        assert_eq!(retried(&w, "d", b"other", 2_000).0, vec![Counter::Mismatch]);
    }

    #[test]
    fn takeover_keeps_an_unknown_outcome_in_flight_until_its_lease_ends() {
        // A rule with `"unknown_outcome": "takeover"`: nothing is written, a retry gets 409, and
        // after the lease it takes the record over.
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"x").local_reply("response_timeout", 0x4, "10.0.0.1:80");
        let mut flow = RequestFlow::new(1);
        begun(&mut flow, &mut facts, &w.store());
        // The owner ended without an outcome: its claim is let go, and ends with its lease.
        assert_eq!(
            flow.response_headers(&cfg(), &mut facts, true).steps,
            vec![Step::Count(Counter::KeptUnknown), Step::LetGo(1)]
        );
        let retry = |now_ms| {
            let mut facts = Facts { now_ms, ..Facts::post("/orders", "k", b"x") };
            counters(&begun(&mut RequestFlow::new(2), &mut facts, &w.store()).0)
        };
        assert_eq!(retry(1), vec![Counter::InFlight]);
        assert_eq!(retry(30_001), vec![Counter::TakenOver]);
    }

    #[test]
    fn an_outcome_unknown_wakes_waiters_who_then_get_502() {
        let w = World::new();
        let mut facts =
            Facts::post("/held-pay", "k", b"x").local_reply("response_timeout", 0x4, "10.0.0.1:80");
        let mut first = RequestFlow::new(1);
        begun(&mut first, &mut facts, &w.store());
        assert_eq!(first.rule().map(|r| r.name.as_str()), Some("waitpay"));
        // A duplicate while the original runs is parked, as in any wait rule.
        let mut dup = RequestFlow::new(2);
        let (steps, _) = begun(&mut dup, &mut Facts::post("/held-pay", "k", b"x"), &w.store());
        assert!(matches!(steps.as_slice(), [Step::Park(_)]), "{steps:?}");
        // The original's outcome becomes unknown: completed, and its waiters are woken...
        let out = first.response_headers(&cfg(), &mut facts, true);
        let (steps, _) = run(&mut first, out, &w.store());
        assert!(
            matches!(steps.as_slice(), [Step::Wake(_), Step::Count(Counter::OutcomeUnknown), Step::LetGo(_)]),
            "{steps:?}"
        );
        // ...and what a woken waiter's recheck gets is what any retry gets: 502, not a claim.
        let mut again = RequestFlow::new(3);
        let (steps, _) = begun(&mut again, &mut Facts::post("/held-pay", "k", b"x"), &w.store());
        assert_eq!((counters(&steps), reply_of(&steps).0.status), (vec![Counter::UnknownRefused], 502));
    }

    #[test]
    fn a_remote_stores_outcome_unknown_is_handed_to_the_root_and_counted_there() {
        let w = World::new();
        let mut facts = Facts::post("/pay", "k", b"x").local_reply("response_timeout", 0x4, "10.0.0.1:80");
        let mut flow = RequestFlow::new(1);
        begun(&mut flow, &mut facts, &w.store());
        let out = flow.stream_ended(&mut facts);
        let [Step::Store(op @ StoreOp::Complete { .. })] = out.steps.as_slice() else { panic!("{out:?}") };
        let settlement = flow.hand_off_settlement().expect("settling");
        let StoreAnswer::Settled(settled) = op.perform(&w.store()) else { panic!() };
        assert_eq!(settlement.answered(settled), vec![Step::Count(Counter::OutcomeUnknown), Step::LetGo(1)]);
        assert_eq!(retried(&w, "k", b"x", 1).1, 502);
    }

    #[test]
    fn a_body_over_the_limit_is_kept_without_it_and_router_retries_are_reported() {
        let w = World::new();
        let mut facts = Facts::post("/orders", "k", b"x").upstream_answer(200, b"123456789");
        facts.properties.insert("upstream\0request_attempt_count".into(), 2u64.to_le_bytes().to_vec());
        let mut flow = RequestFlow::new(1);
        begun(&mut flow, &mut facts, &w.store());
        flow.response_headers(&cfg(), &mut facts, false);
        let out = flow.response_body(&mut facts, 9, true);
        assert_eq!(counters(&run(&mut flow, out, &w.store()).0), vec![Counter::ResponseNotStored]);
        let out = flow.stream_ended(&mut facts);
        assert_eq!(
            out.steps,
            vec![
                Step::Count(Counter::UpstreamRetried),
                Step::WarnRetried { rule: "orders".into(), attempts: 2 }
            ]
        );
    }

    #[test]
    fn wait_mode_parks_refuses_resumes_and_wakes() {
        let w = World::new();
        let mut first = RequestFlow::new(1);
        let mut facts = Facts::post("/wait", "k", b"x").upstream_answer(201, b"ok");
        begun(&mut first, &mut facts, &w.store());
        // A duplicate: asked to park; refused by the room's bounds, it gets 409 at once.
        let mut dup = RequestFlow::new(2);
        let (steps, verdict) = begun(&mut dup, &mut Facts::post("/wait", "k", b"x"), &w.store());
        let [Step::Park(plan)] = steps.as_slice() else { panic!("{steps:?}") };
        assert_eq!(verdict, Verdict::Pause);
        assert_eq!(plan.recheck_at_ms(true), plan.now_ms);
        assert!(plan.recheck_at_ms(false) > plan.now_ms);
        let out = dup.parked(&cfg(), Err(NotHeld::PerKey));
        assert_eq!(counters(&out.steps), vec![Counter::WaitRefused]);
        assert_eq!(reply_of(&out.steps).0.status, 409);
        // Admitted: held; its client leaving takes it out of the room.
        let mut held = RequestFlow::new(3);
        begun(&mut held, &mut Facts::post("/wait", "k", b"x"), &w.store());
        assert_eq!(held.parked(&cfg(), Ok(())), Output::hold(vec![Step::Count(Counter::Waiting)]));
        assert!(held.waiting());
        assert_eq!(held.stream_ended(&mut Facts::default()).steps, vec![Step::LeaveWaitRoom]);
        // The original completes: its waiters are woken.
        first.response_headers(&cfg(), &mut facts, false);
        let out = first.response_body(&mut facts, 2, true);
        let (steps, _) = run(&mut first, out, &w.store());
        assert!(
            matches!(steps.as_slice(), [Step::Wake(_), Step::Count(Counter::Stored), Step::LetGo(_)]),
            "{steps:?}"
        );
        // Only a detached request takes a detached call's answer: a forwarded one goes on as such.
        let mut forwarded = RequestFlow::new(4);
        let mut facts = Facts::post("/wait", "other", b"x").upstream_answer(201, b"ok");
        begun(&mut forwarded, &mut facts, &w.store());
        let unknown = crate::worker::detached::CallAnswer::Unknown { timed_out: true };
        assert_eq!(forwarded.detached_answered(unknown, 0, 0), Output::go(Vec::new()));
        assert_eq!(forwarded.written(), None);
        forwarded.response_headers(&cfg(), &mut facts, false);
        assert!(forwarded.capturing(), "only a detached flow takes word from its root");
    }

    /// A duplicate on a wait rule, held in the wait room (as the worker does on `Park`).
    fn held_waiter(w: &World, context_id: u32, key: &str, now_ms: u64) -> RequestFlow {
        let mut flow = RequestFlow::new(context_id);
        let mut facts = Facts { now_ms, ..Facts::post("/wait", key, b"x") };
        let (steps, _) = begun(&mut flow, &mut facts, &w.store());
        assert!(matches!(steps.as_slice(), [Step::Park(_)]), "{steps:?}");
        assert_eq!(flow.parked(&cfg(), Ok(())).steps, vec![Step::Count(Counter::Waiting)]);
        flow
    }

    /// A waiter looks at its record again: its `begin`, answered by `w`'s store.
    fn rechecked(flow: &mut RequestFlow, w: &World, now_ms: u64, owner: u64) -> Output {
        let op = flow.recheck(&cfg(), now_ms, owner).expect("waiting");
        assert!(flow.rechecking() && !flow.waiting());
        flow.store_answered(&cfg(), op.perform(&w.store()))
    }

    #[test]
    fn a_rechecked_waiter_is_replayed_forwarded_held_again_or_gives_up() {
        let w = World::new();
        let mut facts = Facts::post("/wait", "a", b"x").upstream_answer(201, b"done");
        let mut original = RequestFlow::new(1);
        begun(&mut original, &mut facts, &w.store());
        // Still processing: held again (the room says until when, or that its wait is over).
        let mut waiter = held_waiter(&w, 7, "a", 10);
        let out = rechecked(&mut waiter, &w, 100, 2);
        let [Step::Repark { lease_remaining_ms }] = out.steps.as_slice() else { panic!("{out:?}") };
        assert!(*lease_remaining_ms > 0);
        assert_eq!(out.verdict, Verdict::Pause);
        assert_eq!(waiter.parked(&cfg(), Ok(())), Output::hold(Vec::new()), "counted once, when it came");
        assert!(waiter.waiting());
        // At its give-up time: 409 with retry-after, counted as a timed-out wait.
        let mut impatient = held_waiter(&w, 8, "a", 10);
        rechecked(&mut impatient, &w, 1_500, 3);
        let out = impatient.parked(&cfg(), Err(NotHeld::GaveUp));
        assert_eq!(counters(&out.steps), vec![Counter::WaitTimedOut]);
        let (reply, details) = reply_of(&out.steps);
        assert_eq!((reply.status, details), (409, DETAILS_PROBLEM));
        assert!(header(reply, "retry-after").is_some());
        // The original completes: the waiter leaves the room with the replay.
        original.response_headers(&cfg(), &mut facts, false);
        let out = original.response_body(&mut facts, 4, true);
        run(&mut original, out, &w.store());
        let out = rechecked(&mut waiter, &w, 201, 4);
        assert_eq!(out.verdict, Verdict::Pause);
        assert_eq!(out.steps.first(), Some(&Step::LeaveWaitRoom));
        assert_eq!(counters(&out.steps), vec![Counter::Replayed]);
        let (reply, details) = reply_of(&out.steps);
        assert_eq!((reply.body.as_slice(), details), (&b"done"[..], DETAILS_REPLAY));
        // A released record: the first waiter to look becomes the owner, the next one waits.
        let mut facts =
            Facts { now_ms: 300, ..Facts::post("/wait", "b", b"x") }.local_reply("direct_response", 0, "");
        let mut original = RequestFlow::new(2);
        begun(&mut original, &mut facts, &w.store());
        let (mut w1, mut w2) = (held_waiter(&w, 8, "b", 300), held_waiter(&w, 9, "b", 300));
        let out = original.response_headers(&cfg(), &mut facts, true);
        assert!(counters(&run(&mut original, out, &w.store()).0).contains(&Counter::Released));
        let out = rechecked(&mut w1, &w, 301, 6);
        // A waiter that becomes the owner holds its claim from its recheck's time.
        let [Step::LeaveWaitRoom, Step::Count(Counter::Claimed), Step::Hold(hold)] = out.steps.as_slice()
        else {
            panic!("{out:?}")
        };
        assert_eq!(
            (out.verdict, hold.lease_end_ms - hold.lease_ms, hold.claim.owner),
            (Verdict::Continue, 301, 6)
        );
        // Should it not be resumed, its own claim is what is released.
        let settlement = w1.not_resumed().expect("forwarded with a claim");
        assert_eq!(settlement.done, Counter::Released);
        assert!(w1.not_resumed().is_none());
        assert!(matches!(rechecked(&mut w2, &w, 302, 7).steps.as_slice(), [Step::Repark { .. }]));
        // Only a waiting flow looks again.
        assert!(w1.recheck(&cfg(), 303, 8).is_none());
    }

    #[test]
    fn a_store_failure_during_a_recheck_fails_closed_or_forwards_unprotected() {
        let w = World::new();
        let mut original = RequestFlow::new(1);
        begun(&mut original, &mut Facts::post("/wait", "a", b"x"), &w.store());
        let mut waiter = held_waiter(&w, 2, "a", 10);
        waiter.recheck(&cfg(), 100, 2).expect("waiting");
        let out = waiter.store_failed(&cfg(), StoreError::TimedOut, OnStoreError::FailClosed);
        assert_eq!(out.steps.first(), Some(&Step::LeaveWaitRoom));
        assert_eq!((counters(&out.steps), reply_of(&out.steps).0.status), (vec![Counter::StoreError], 503));
        let mut waiter = held_waiter(&w, 3, "a", 10);
        waiter.recheck(&cfg(), 100, 3).expect("waiting");
        let out = waiter.store_failed(&cfg(), StoreError::TimedOut, OnStoreError::FailOpen);
        assert_eq!(out, Output::go(vec![Step::LeaveWaitRoom, Step::Count(Counter::StoreBypassed)]));
        // Its client gone when the answer comes: nothing to answer, a claim it got is given back.
        let mut waiter = held_waiter(&w, 4, "a", 10);
        let op = waiter.recheck(&cfg(), 100, 4).expect("waiting");
        assert!(waiter.answered_without_stream(&op.perform(&w.store())).is_none(), "still in flight");
    }
}
