//! Reconciliation in a request's flow (`routes[].reconcile`): the lookup a held request makes
//! when its record's lease ended unsettled, what the upstream's answer does to the record, and
//! the root's own lookup when a lease ends (`LeaseEndLookup`), which has no stream.

use super::{Found, LaterLookup, LeaseEnd, LeaseEndLookup, LeaseEndState, LookupAnswer};
use crate::config::{Concurrency, Config, Rule};
use crate::engine::{self, Decision, Reply};
use crate::metrics::Counter;
use crate::store::{Begin, Claim, ClaimAttempt, Settled, StoreAnswer, StoreError, StoreOp};
use crate::worker::flow::{
    said, Admitted, Output, Phase, RequestFlow, Settlement, Step, DETAILS_PROBLEM, DETAILS_REPLAY,
};
use std::rc::Rc;

impl RequestFlow {
    /// The root's own lookup of a record whose lease ended after an unknown outcome it saw
    /// (`Step::LookUpAtLeaseEnd`), as a flow the root's executor holds: its one phase is the
    /// `LeaseEndLookup`, which has no stream.
    pub fn lease_end(context_id: u32, later: LaterLookup, call: LeaseEnd) -> RequestFlow {
        let (rule, scope) = (Rc::clone(&later.pending.rule), later.pending.scope);
        RequestFlow {
            rule: Some(rule),
            scope: Some(scope),
            body_seen: true,
            phase: Phase::LeaseEnd(Box::new(LeaseEndLookup::new(context_id, later, call))),
            ..RequestFlow::new(context_id)
        }
    }

    /// A lease-end lookup's call, and its rule.
    pub fn lease_end_call(&self) -> Option<(&LeaseEnd, &Rc<Rule>)> {
        match &self.phase {
            Phase::LeaseEnd(lookup) => Some(lookup.call()),
            _ => None,
        }
    }

    /// A lease-end lookup is due (`LeaseEndLookup::due`).
    pub fn lease_end_due(&mut self, now_ms: u64) -> Output {
        match &mut self.phase {
            Phase::LeaseEnd(lookup) => lookup.due(now_ms),
            _ => Output::go(Vec::new()),
        }
    }

    /// A lease-end lookup settled nothing once more: how often now.
    pub fn lease_end_tried(&mut self) -> u32 {
        match &mut self.phase {
            Phase::LeaseEnd(lookup) => lookup.tried(),
            _ => 0,
        }
    }

    /// True while the upstream's lookup is to be asked (or asked again).
    pub fn awaiting_lookup(&self) -> bool {
        match &self.phase {
            Phase::Reconciling { .. } => true,
            Phase::LeaseEnd(lookup) => lookup.awaiting_lookup(),
            _ => false,
        }
    }

    /// The upstream's lookup answered (`Step::Lookup`).
    pub fn lookup_answered(&mut self, answer: LookupAnswer, now_ms: u64) -> Output {
        if let Phase::LeaseEnd(lookup) = &mut self.phase {
            return lookup.lookup_answered(answer, now_ms);
        }
        let Phase::Reconciling { attempt } = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return Output::go(Vec::new());
        };
        // Acting on a final answer takes the record over.
        let attempt = attempt.after_lookup(now_ms);
        match answer {
            LookupAnswer::Found { status, snapshot } => {
                said(
                    self.context_id,
                    "the upstream executed it: adopting its answer for",
                    self.scope.as_ref(),
                );
                self.phase = Phase::Adopting { now_ms, found: Found { status, snapshot } };
                Output::hold(vec![Step::Store(StoreOp::Begin(attempt))])
            }
            LookupAnswer::NotFound => {
                // Never executed: this request executes now, as a takeover, so that no other
                // retry runs beside it.
                said(self.context_id, "the upstream never executed it: executing", self.scope.as_ref());
                self.phase = Phase::AwaitingBegin { now_ms, attempt: attempt.clone() };
                Output::hold(vec![
                    Step::Count(Counter::ReconciledNotFound),
                    Step::Store(StoreOp::Begin(attempt)),
                ])
            }
            LookupAnswer::Failed(why) => {
                log::debug!(
                    "#{} lookup of key {} settled nothing: {why}",
                    self.context_id,
                    self.scope.map(|s| s.log_tag()).unwrap_or_default()
                );
                let reply = Reply::problem(&engine::unsettled(engine::LOOKUP_SPACING_MS));
                self.answer(reply, DETAILS_PROBLEM, vec![Step::Count(Counter::ReconcileFailed)])
            }
        }
    }

    /// No lookup settled the record now (it failed, or one is under way or was made less than
    /// `retry_after_ms` ago): 503 `outcome-unknown` with `retry-after`; the next retry asks again.
    pub fn lookup_refused(&mut self, retry_after_ms: u64) -> Output {
        if let Phase::LeaseEnd(lookup) = &mut self.phase {
            return lookup.lookup_refused();
        }
        let (Phase::Reconciling { attempt }, Some(admitted)) =
            (std::mem::replace(&mut self.phase, Phase::Idle), self.admitted.clone())
        else {
            return Output::go(Vec::new());
        };
        if matches!(admitted.pending.rule.concurrency, Concurrency::Wait { .. }) {
            // Another lookup of the record is under way: wait for it as for any original.
            let decision = Decision::Wait { lease_remaining_ms: retry_after_ms };
            return self.decided(&admitted, attempt.now_ms, decision);
        }
        let reply = Reply::problem(&engine::unsettled(retry_after_ms));
        self.answer(reply, DETAILS_PROBLEM, vec![Step::Count(Counter::ReconcileFailed)])
    }

    /// The lookup's answer was written as the record's outcome (or not).
    pub(in crate::worker) fn found_settled(
        &mut self,
        cfg: &Config,
        admitted: &Admitted,
        claim: Claim,
        found: Found,
        settled: Result<Settled, StoreError>,
    ) -> Output {
        match settled {
            Ok(Settled::Done) => {
                let details = if found.snapshot.is_some() { DETAILS_REPLAY } else { DETAILS_PROBLEM };
                let begun = match found.snapshot {
                    Some(snapshot) => Begin::Replay(snapshot),
                    None => Begin::NotStored { status: found.status },
                };
                let pending = &admitted.pending;
                let mut steps = vec![Step::Count(Counter::ReconciledFound)];
                if matches!(pending.rule.concurrency, Concurrency::Wait { .. }) {
                    steps.push(Step::Wake(claim.scope));
                }
                match engine::decision_of(cfg, pending, Ok(begun)) {
                    Decision::Respond { reply, .. } => self.answer(reply, details, steps),
                    // A replay or "not stored" is always an answer.
                    _ => Output::go(steps),
                }
            }
            // Taken from this request in between (its fresh lease makes that all but
            // impossible), or not written: nothing is settled; the next retry asks again.
            Ok(Settled::Lost) | Err(_) => {
                if let Err(e) = &settled {
                    log::warn!("#{} writing the lookup's answer failed: {e}", self.context_id);
                }
                let reply = Reply::problem(&engine::unsettled(engine::LOOKUP_SPACING_MS));
                self.answer(reply, DETAILS_PROBLEM, vec![Step::Count(Counter::ReconcileFailed)])
            }
        }
    }
}

/// The root's own lookup (`LeaseEndLookup`): the same store operations and lookup a held
/// request makes, with nobody to answer. It never forwards, never answers a client, and never
/// takes a record over but to write the upstream's answer or to release what never executed.
impl LeaseEndLookup {
    /// Its time came: it asks the store first (at `now_ms`), and looks the record up only while
    /// it is unsettled (`Begin::Unsettled`); in flight (etcd keeps a claim's lease by its own
    /// clock, a few seconds late) it is asked again later; settled, it is done.
    pub(crate) fn due(&mut self, now_ms: u64) -> Output {
        if self.state != LeaseEndState::Due {
            return Output::go(Vec::new());
        }
        let attempt = ClaimAttempt { now_ms, ..self.call.attempt.clone() };
        self.state = LeaseEndState::Asking { attempt: attempt.clone() };
        Output::go(vec![Step::Store(StoreOp::Begin(attempt))])
    }

    /// The store answered what it asked.
    pub(crate) fn store_answered(&mut self, cfg: &Config, answer: StoreAnswer) -> Output {
        match (std::mem::replace(&mut self.state, LeaseEndState::Done), answer) {
            (LeaseEndState::Asking { attempt }, StoreAnswer::Begun(Ok(Begin::Unsettled)))
                if self.pending.rule.reconcile.is_some() =>
            {
                said(
                    self.context_id,
                    "lease ended unsettled; asking the upstream about",
                    Some(&self.pending.scope),
                );
                self.state = LeaseEndState::LookingUp { attempt };
                let rule = Rc::clone(&self.pending.rule);
                Output::hold(vec![Step::Lookup { rule, request: Vec::new() }])
            }
            (LeaseEndState::Asking { .. }, StoreAnswer::Begun(begun)) => {
                self.decided(engine::decision_of(cfg, &self.pending, begun))
            }
            (LeaseEndState::Adopting { now_ms, found }, StoreAnswer::Begun(begun)) => match begun {
                // The record is this lookup's now: the upstream's answer becomes its outcome.
                Ok(Begin::Claimed(claim) | Begin::TookOver(claim)) => {
                    let completion = found.completion(now_ms, self.pending.rule.ttl_ms);
                    self.state = LeaseEndState::Writing { claim, found };
                    Output::hold(vec![Step::Store(StoreOp::Complete { claim, completion })])
                }
                // Settled by someone else meanwhile (a retry's lookup, say).
                begun => self.decided(engine::decision_of(cfg, &self.pending, begun)),
            },
            (LeaseEndState::Writing { claim, .. }, StoreAnswer::Settled(settled)) => {
                self.written(claim, settled)
            }
            (LeaseEndState::Releasing { claim }, StoreAnswer::Settled(settled)) => {
                let rule = Rc::clone(&self.pending.rule);
                let settlement =
                    Settlement { context_id: self.context_id, claim, rule, done: Counter::Released };
                Output::go(settlement.answered(settled))
            }
            (state, _) => {
                said(self.context_id, "ignored a store answer nobody was waiting for", None);
                self.state = state;
                Output::go(Vec::new())
            }
        }
    }

    /// The store could not be used: as its failure of what was asked (nothing to forward).
    pub(crate) fn store_failed(&mut self, cfg: &Config, error: StoreError) -> Output {
        let answer = match self.state {
            LeaseEndState::Asking { .. } | LeaseEndState::Adopting { .. } => StoreAnswer::Begun(Err(error)),
            LeaseEndState::Writing { .. } | LeaseEndState::Releasing { .. } => {
                StoreAnswer::Settled(Err(error))
            }
            _ => return Output::go(Vec::new()),
        };
        self.store_answered(cfg, answer)
    }

    /// What the store's answer means with nobody here to execute.
    fn decided(&mut self, decision: Decision) -> Output {
        match decision {
            // The upstream never executed it and no request is here to: the record goes, so
            // the client's retry executes.
            Decision::Forward { claim, .. } => {
                said(self.context_id, "never executed: releasing", Some(&claim.scope));
                self.state = LeaseEndState::Releasing { claim };
                Output::go(vec![Step::Store(StoreOp::Release(claim))])
            }
            // Still in flight by the store's clock (etcd ends a lease key by its own, a few
            // seconds late), or the store failed: asked again later.
            Decision::Respond { counter: Counter::InFlight | Counter::StoreError, .. }
            | Decision::Wait { .. } => {
                self.state = LeaseEndState::Due;
                Output::go(Vec::new())
            }
            // Settled by someone else meanwhile: nothing to do.
            Decision::Respond { .. } => Output::go(Vec::new()),
        }
    }

    /// The upstream's lookup answered.
    pub(crate) fn lookup_answered(&mut self, answer: LookupAnswer, now_ms: u64) -> Output {
        let LeaseEndState::LookingUp { attempt } = std::mem::replace(&mut self.state, LeaseEndState::Done)
        else {
            return Output::go(Vec::new());
        };
        // Acting on a final answer takes the record over; a lookup that settled nothing leaves
        // the record as it is (asked again later: it must never take over then).
        let taking_over = attempt.after_lookup(now_ms);
        match answer {
            LookupAnswer::Found { status, snapshot } => {
                said(
                    self.context_id,
                    "the upstream executed it: adopting its answer for",
                    Some(&self.pending.scope),
                );
                self.state = LeaseEndState::Adopting { now_ms, found: Found { status, snapshot } };
                Output::hold(vec![Step::Store(StoreOp::Begin(taking_over))])
            }
            LookupAnswer::NotFound => {
                said(self.context_id, "the upstream never executed it: releasing", Some(&self.pending.scope));
                self.state = LeaseEndState::Asking { attempt: taking_over.clone() };
                Output::hold(vec![
                    Step::Count(Counter::ReconciledNotFound),
                    Step::Store(StoreOp::Begin(taking_over)),
                ])
            }
            LookupAnswer::Failed(why) => {
                log::debug!(
                    "#{} lookup of key {} settled nothing: {why}",
                    self.context_id,
                    self.pending.scope.log_tag()
                );
                self.state = LeaseEndState::Due;
                Output::go(vec![Step::Count(Counter::ReconcileFailed)])
            }
        }
    }

    /// No lookup could be made (one of the record is under way on this Envoy): on a wait rule
    /// asked again later, as a waiter would; else left to the request asking.
    pub(crate) fn lookup_refused(&mut self) -> Output {
        if !matches!(self.state, LeaseEndState::LookingUp { .. }) {
            return Output::go(Vec::new());
        }
        if matches!(self.pending.rule.concurrency, Concurrency::Wait { .. }) {
            self.state = LeaseEndState::Due;
            return Output::go(Vec::new());
        }
        self.state = LeaseEndState::Done;
        Output::go(vec![Step::Count(Counter::ReconcileFailed)])
    }

    /// The upstream's answer was written as the record's outcome (or not).
    fn written(&mut self, claim: Claim, settled: Result<Settled, StoreError>) -> Output {
        match settled {
            Ok(Settled::Done) => {
                let mut steps = vec![Step::Count(Counter::ReconciledFound)];
                if matches!(self.pending.rule.concurrency, Concurrency::Wait { .. }) {
                    steps.push(Step::Wake(claim.scope));
                }
                Output::go(steps)
            }
            Ok(Settled::Lost) | Err(_) => {
                if let Err(e) = &settled {
                    log::warn!("#{} writing the lookup's answer failed: {e}", self.context_id);
                }
                Output::go(vec![Step::Count(Counter::ReconcileFailed)])
            }
        }
    }

    /// The store failed its `begin` after writing a claim that may have landed: given back.
    pub(crate) fn unanswered_claim(&self, claim: Claim) -> Option<Settlement> {
        let LeaseEndState::Asking { .. } = self.state else {
            return None;
        };
        said(self.context_id, "claim unanswered; giving back", Some(&claim.scope));
        let rule = Rc::clone(&self.pending.rule);
        Some(Settlement { context_id: self.context_id, claim, rule, done: Counter::Released })
    }
}
