//! Wait mode's part of a request's flow: a request held in the wait room (`Phase::Parking`,
//! `Waiting`), its look at its record again (`recheck`, `Rechecking`), and its fate, which is
//! the `Decision` any request's `begin` leads to.

use super::NotHeld;
use crate::config::Config;
use crate::engine::{self, Decision};
use crate::metrics::Counter;
use crate::store::StoreOp;
use crate::worker::flow::{said, Admitted, Output, Phase, RequestFlow, Step, DETAILS_PROBLEM};

impl RequestFlow {
    /// True while the request is held in the wait room.
    #[cfg(test)]
    pub fn waiting(&self) -> bool {
        matches!(self.phase, Phase::Waiting)
    }

    /// True while a waiter's look at its record is under way (`recheck`).
    pub fn rechecking(&self) -> bool {
        matches!(self.phase, Phase::Rechecking { .. })
    }

    /// Whether the wait room holds the request: admitted (or, after a recheck, held again), or
    /// not: refused by its bounds, or its wait is over (409 either way, counted apart).
    pub fn parked(&mut self, cfg: &Config, held: Result<(), NotHeld>) -> Output {
        let Phase::Parking { lease_remaining_ms, again } = std::mem::replace(&mut self.phase, Phase::Idle)
        else {
            return Output::go(Vec::new());
        };
        match held {
            Ok(()) => {
                said(self.context_id, "waiting for", self.scope.as_ref());
                self.phase = Phase::Waiting;
                let steps = if again { Vec::new() } else { vec![Step::Count(Counter::Waiting)] };
                Output::hold(steps)
            }
            Err(not_held) => {
                let (counter, why) = match not_held {
                    NotHeld::GaveUp => (Counter::WaitTimedOut, "gave up waiting for"),
                    NotHeld::PerKey => (Counter::WaitRefused, "not held (the bound per key) for"),
                    NotHeld::Total => (Counter::WaitRefused, "not held (the bound of the worker) for"),
                };
                said(self.context_id, why, self.scope.as_ref());
                let reply = engine::in_flight_reply(cfg, lease_remaining_ms);
                self.answer(reply, DETAILS_PROBLEM, vec![Step::Count(counter)])
            }
        }
    }

    /// The root looks at a waiter's record again (it was woken, or its time came): the `begin`
    /// to ask, as fresh as its first (None: not waiting). Its answer (`store_answered`) is the
    /// waiter's fate.
    pub fn recheck(&mut self, cfg: &Config, now_ms: u64, owner: u64) -> Option<StoreOp> {
        match (std::mem::replace(&mut self.phase, Phase::Idle), self.admitted.clone()) {
            (Phase::Waiting, Some(a)) => {
                let attempt = engine::claim_attempt(cfg, &a.pending, a.fingerprint, now_ms, owner);
                self.phase = Phase::Rechecking { now_ms };
                Some(StoreOp::Begin(attempt))
            }
            (phase, _) => {
                self.phase = phase;
                None
            }
        }
    }

    /// A waiter's fate, from what its look at the record found: the `Decision` any request's
    /// `begin` leads to, carried out the same way (it leaves the wait room to be forwarded or
    /// answered), except that "wait" holds it in the room again.
    pub(in crate::worker) fn rechecked(
        &mut self,
        admitted: &Admitted,
        now_ms: u64,
        decision: Decision,
    ) -> Output {
        let out = match decision {
            Decision::Wait { lease_remaining_ms } => {
                self.phase = Phase::Parking { lease_remaining_ms, again: true };
                return Output::hold(vec![Step::Repark { lease_remaining_ms }]);
            }
            Decision::Forward { claim, counter } => self.forward(&admitted.pending, claim, counter, now_ms),
            Decision::Respond { reply, counter } => self.respond(&admitted.pending, reply, counter),
        };
        let mut steps = vec![Step::LeaveWaitRoom];
        steps.extend(out.steps);
        Output { steps, ..out }
    }
}
