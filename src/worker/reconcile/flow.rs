//! Reconciliation in a request's flow (`routes[].reconcile`): the lookup a held request makes
//! when its record's lease ended unsettled, what the upstream's answer does to the record, and
//! the headless flow the root keeps to look a record up itself when its lease ends.

use super::{Found, LaterLookup, LeaseEnd, LookupAnswer};
use crate::config::{Concurrency, Config, Rule};
use crate::engine::{self, Decision, Reply};
use crate::metrics::Counter;
use crate::store::{Begin, Claim, ClaimAttempt, Settled, StoreError, StoreOp};
use crate::worker::flow::{Admitted, Output, Phase, RequestFlow, Step, DETAILS_PROBLEM, DETAILS_REPLAY};
use std::rc::Rc;

impl RequestFlow {
    /// The root's own lookup of a record whose lease ended after an unknown outcome it saw
    /// (`Step::LookUpAtLeaseEnd`); `attempt` is what acting on the answer asks the store.
    pub fn lease_end(context_id: u32, later: LaterLookup, lease_end: LeaseEnd) -> RequestFlow {
        let attempt = lease_end.attempt.clone();
        let LaterLookup { pending, fingerprint, request, .. } = later;
        RequestFlow {
            context_id,
            forwarded_rule: None,
            rule: Some(Rc::clone(&pending.rule)),
            body_seen: true,
            scope: Some(pending.scope),
            later: None,
            lookup_request: request,
            lease_end: Some(Box::new(lease_end)),
            stream_gone: false,
            admitted: Some(Rc::new(Admitted { pending, fingerprint })),
            phase: Phase::Reconciling { attempt },
        }
    }

    /// A lease-end lookup's call, and its rule.
    pub fn lease_end_call(&self) -> Option<(&LeaseEnd, &Rc<Rule>)> {
        Some((self.lease_end.as_deref()?, self.rule.as_ref()?))
    }

    /// A lease-end lookup is due: it asks the store first (at `now_ms`), and looks the record up
    /// only while it is unsettled (`Begin::Unsettled`); in flight (etcd keeps a claim's lease by
    /// its own clock, a few seconds late) it is asked again later; settled, it is done.
    pub fn lease_end_due(&mut self, now_ms: u64) -> Output {
        let Phase::Reconciling { attempt } = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return Output::go(Vec::new());
        };
        if !self.headless() {
            self.phase = Phase::Reconciling { attempt };
            return Output::go(Vec::new());
        }
        let attempt = ClaimAttempt { now_ms, ..attempt };
        self.phase = Phase::AwaitingBegin { now_ms, attempt: attempt.clone() };
        Output::go(vec![Step::Store(StoreOp::Begin(attempt))])
    }

    /// A lease-end lookup settled nothing once more: how often now.
    pub fn lease_end_tried(&mut self) -> u32 {
        match &mut self.lease_end {
            Some(l) => {
                l.tries = l.tries.saturating_add(1);
                l.tries
            }
            None => 0,
        }
    }

    /// True while the upstream's lookup is to be asked (or asked again).
    pub fn awaiting_lookup(&self) -> bool {
        matches!(self.phase, Phase::Reconciling { .. })
    }

    /// The upstream's lookup answered (`Step::Lookup`).
    pub fn lookup_answered(&mut self, answer: LookupAnswer, now_ms: u64) -> Output {
        let Phase::Reconciling { attempt } = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return Output::go(Vec::new());
        };
        let tag = self.scope.map(|s| s.log_tag()).unwrap_or_default();
        // Acting on a final answer takes the record over; a lookup that settled nothing leaves
        // the attempt as it was (a lease-end lookup asks again with it: it must never take over).
        let (attempt, unsettled) = (attempt.clone().after_lookup(now_ms), attempt);
        match answer {
            LookupAnswer::Found { status, snapshot } => {
                log::debug!(
                    "#{} the upstream executed key {tag} ({status}): adopting its answer",
                    self.context_id
                );
                self.phase = Phase::Adopting { now_ms, found: Found { status, snapshot } };
                Output::hold(vec![Step::Store(StoreOp::Begin(attempt))])
            }
            LookupAnswer::NotFound => {
                // Never executed: this request executes now, as a takeover, so that no other
                // retry runs beside it.
                log::debug!("#{} the upstream never executed key {tag}: executing it", self.context_id);
                self.phase = Phase::AwaitingBegin { now_ms, attempt: attempt.clone() };
                Output::hold(vec![
                    Step::Count(Counter::ReconciledNotFound),
                    Step::Store(StoreOp::Begin(attempt)),
                ])
            }
            LookupAnswer::Failed(why) => {
                log::debug!("#{} lookup of key {tag} settled nothing: {why}", self.context_id);
                if self.headless() {
                    // Asked again later by the root.
                    self.phase = Phase::Reconciling { attempt: unsettled };
                    return Output::go(vec![Step::Count(Counter::ReconcileFailed)]);
                }
                let reply = Reply::problem(&engine::unsettled(engine::LOOKUP_SPACING_MS));
                self.answer(reply, DETAILS_PROBLEM, vec![Step::Count(Counter::ReconcileFailed)])
            }
        }
    }

    /// No lookup settled the record now (it failed, or one is under way or was made less than
    /// `retry_after_ms` ago): 503 `outcome-unknown` with `retry-after`; the next retry asks again.
    pub fn lookup_refused(&mut self, retry_after_ms: u64) -> Output {
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
                if self.headless() {
                    return Output::go(steps);
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
                if self.headless() {
                    return Output::go(vec![Step::Count(Counter::ReconcileFailed)]);
                }
                let reply = Reply::problem(&engine::unsettled(engine::LOOKUP_SPACING_MS));
                self.answer(reply, DETAILS_PROBLEM, vec![Step::Count(Counter::ReconcileFailed)])
            }
        }
    }
}
