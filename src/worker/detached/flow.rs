//! The flow's detached side (`routes[].execution: "detached"`): the worker's root carried the
//! request upstream itself, holding its flow meanwhile, and the call's answer becomes
//! the flow's steps as an inline upstream answer's does (`ending::plan_response`): the record
//! completed or released, then the client's reply once the store has answered; or, when the
//! outcome is unknown, what the rule's `unknown_outcome` says.

use crate::config::{Rule, UnknownOutcome};
use crate::ending::{plan_response, ResponsePlan, StreamReport, VIA_UPSTREAM};
use crate::engine::{self, Reply};
use crate::metrics::Counter;
use crate::store::record::Snapshot;
use crate::store::{Claim, Completion, StoreOp};
use crate::worker::detached::{self, CallAnswer, DETAILS_DETACHED};
use crate::worker::flow::{Output, Phase, RequestFlow, Settlement, Step};
use std::rc::Rc;

impl RequestFlow {
    /// The detached call's answer. `held_ms`: how long past its lease the store keeps the claim
    /// its owner's (`Store::held_past_lease_ms`), which a retry's 409s last too.
    pub fn detached_answered(&mut self, answer: CallAnswer, now_ms: u64, held_ms: u64) -> Output {
        let (claim, rule) = match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Detached { claim, rule } => (claim, rule),
            phase => {
                self.phase = phase;
                return Output::go(Vec::new());
            }
        };
        let (status, headers, body) = match answer {
            CallAnswer::Answered { status, headers, body } => (status, headers, body),
            // Nothing reached the upstream: the claim is given back, and Envoy's reply passed on.
            CallAnswer::NeverSent { status, headers, body } => {
                let reply = detached::first_reply(status, &headers, body);
                return self.settle_detached(StoreOp::Release(claim), claim, rule, Counter::Released, reply);
            }
            CallAnswer::Unknown { timed_out } => {
                return self.unknown_detached(claim, rule, timed_out, now_ms, held_ms)
            }
        };
        let report = StreamReport { details: Some(VIA_UPSTREAM), flags: 0, upstream_selected: true };
        let reply = detached::first_reply(status, &headers, body.clone());
        // One attempt: a callout's router does not use the route's retry policy (its route is
        // the async client's own), and the caller's retry headers never reach it
        // (`router_control.rs`). So an upstream answer, and Envoy's "never sent" reply above,
        // speak for the only attempt there was; only the inline path reads the count.
        match plan_response(&rule, Some(status), report, || Some(1)) {
            ResponsePlan::Capture { state, status } => {
                let fits = body.len() as u64 <= rule.max_response_bytes;
                let snapshot = fits.then(|| Snapshot {
                    status,
                    headers: engine::snapshot_headers(headers, &rule.replay_exclude_headers),
                    body,
                });
                let done = if fits { Counter::Stored } else { Counter::ResponseNotStored };
                self.audit_outcome(state, status);
                let completion = Completion { state, status, snapshot, now_ms, ttl_ms: rule.ttl_ms };
                self.settle_detached(StoreOp::Complete { claim, completion }, claim, rule, done, reply)
            }
            ResponsePlan::Release => {
                self.settle_detached(StoreOp::Release(claim), claim, rule, Counter::Released, reply)
            }
            // Not reached for an answer with a status; kept for completeness.
            ResponsePlan::Keep | ResponsePlan::CompleteUnknown => {
                self.unknown_detached(claim, rule, false, now_ms, held_ms)
            }
        }
    }

    /// The record's completion or release first; the reply goes out once the store answered
    /// (`store_answered`), so that a retry sent after its client had it is replayed.
    fn settle_detached(
        &mut self,
        op: StoreOp,
        claim: Claim,
        rule: Rc<Rule>,
        done: Counter,
        reply: Reply,
    ) -> Output {
        let settlement = Settlement { context_id: self.context_id, claim, rule, done };
        self.phase = Phase::SettlingDetached { settlement, reply };
        Output::hold(vec![Step::Store(op)])
    }

    /// No answer after the call may have been sent: by the rule's `unknown_outcome`, the claim
    /// stays until its lease ends (`takeover`; `reconcile`, whose root also looks the record up
    /// then, should no retry), or the record is completed at once as "outcome unknown"
    /// (`refuse`).
    fn unknown_detached(
        &mut self,
        claim: Claim,
        rule: Rc<Rule>,
        timed_out: bool,
        now_ms: u64,
        held_ms: u64,
    ) -> Output {
        let reply = detached::unknown_reply(&rule, timed_out, held_ms);
        match rule.unknown_outcome {
            // The call is over without an outcome: its claim ends where its last lease does.
            UnknownOutcome::Takeover => {
                let steps = vec![Step::Count(Counter::KeptUnknown), Step::LetGo(claim.owner)];
                self.answer(reply, DETAILS_DETACHED, steps)
            }
            // Kept for the lookup at the lease's end, and counted as what it is until then.
            UnknownOutcome::Reconcile => {
                let mut steps = vec![Step::Count(Counter::OutcomeUnknown)];
                steps.extend(self.later.take().map(Step::LookUpAtLeaseEnd));
                steps.push(Step::LetGo(claim.owner));
                self.answer(reply, DETAILS_DETACHED, steps)
            }
            UnknownOutcome::Refuse => {
                let completion = Completion::outcome_unknown(now_ms, rule.ttl_ms);
                let op = StoreOp::Complete { claim, completion };
                self.settle_detached(op, claim, rule, Counter::OutcomeUnknown, reply)
            }
        }
    }

    /// True while a detached call's outcome is being written.
    pub fn settling_detached(&self) -> bool {
        matches!(self.phase, Phase::SettlingDetached { .. })
    }

    /// A detached request's settlement handed to the root's carrier (`hand_off_settlement`)
    /// is over (written, or failed once and being tried again): its client's reply, which the
    /// flow then knows as its own when it passes.
    pub fn written(&mut self) -> Option<(Reply, &'static str)> {
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::AwaitingWrite { reply } => {
                self.phase = Phase::Answered { replay_shape: reply.replay_shape.clone() };
                Some((reply, DETAILS_DETACHED))
            }
            phase => {
                self.phase = phase;
                None
            }
        }
    }

    /// No detached call could be made for this claimed request (its claim is given back by the
    /// worker, nothing was sent upstream): 503 with retry-after.
    pub fn detach_refused(&mut self, why: &str) -> Output {
        let Phase::Detached { claim, .. } = &self.phase else { return Output::go(Vec::new()) };
        let owner = claim.owner;
        log::debug!("#{} no detached call: {why}", self.context_id);
        let reply = detached::refused_reply(why);
        let steps = vec![Step::Count(Counter::DetachedRefused), Step::LetGo(owner)];
        self.answer(reply, crate::worker::flow::DETAILS_PROBLEM, steps)
    }

    /// A detached request's lookup at its lease's end may be built after its client left,
    /// when the route's cluster can no longer be read: whether the worker should read it now.
    pub fn wants_route_cluster(&self) -> bool {
        self.later.as_ref().is_some_and(|l| {
            l.route_cluster.is_none()
                && l.pending.rule.reconcile.as_ref().is_some_and(|r| r.cluster.is_none())
        })
    }

    /// The route's cluster, read while the request's stream is there (`wants_route_cluster`).
    pub fn keep_route_cluster(&mut self, cluster: String) {
        if let Some(later) = self.later.as_mut() {
            later.route_cluster = Some(cluster);
        }
    }

    /// The stream this flow answers went away while the root carried it: what it still does is
    /// counted, and published and replied to nobody.
    pub fn stream_gone(&mut self) {
        self.stream_gone = true;
    }

    #[cfg(test)]
    pub(crate) fn detached_for_test(context_id: u32, claim: Claim, rule: Rc<Rule>) -> RequestFlow {
        RequestFlow { phase: Phase::Detached { claim, rule }, ..RequestFlow::new(context_id) }
    }
}
