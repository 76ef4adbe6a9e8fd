//! A record whose shard changes while traffic runs (`store.previous_shards`): what an Envoy on
//! the new shard list does with a record whose old home (by the previous list) differs from its
//! new one, as a plan of operations on the two homes. Pure: each step names the shard and the
//! operation; whoever carries it (`EtcdShards`, and the model checker over this very code)
//! runs it there and hands back its answer.
//!
//! During a change three kinds of Envoys may run: on the old list only, on the new list with the
//! old one as `previous_shards`, and (once `previous_shards` is dropped) on the new list only.
//! The operator's procedure (docs/ETCD.md, Shards) keeps the first and the last apart by the
//! longest ttl plus `processing_timeout`, so every pair that may meet shares one home:
//! - a begin claims the old home first, as an old-list Envoy would, and only then the new home,
//!   as a new-list Envoy would: two requests of one key, on any two of the lists, always race
//!   on a home they both claim, so only one of them executes. A record on either home answers
//!   the begin (the old home's first), and an old-home claim the new home refuses is given
//!   back;
//! - a settlement (completion or release) is made on both homes, the old first: Envoys still
//!   reading the old home see the outcome, and so do those that will read only the new one.

use crate::store::{Begin, Claim, ClaimAttempt, ShardClaim, StoreAnswer, StoreOp};

/// The next leg of a moving record's operation: run on one of its homes, or over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// Run the operation on that shard, then hand its answer to `Moving::answered`.
    Run(u8, StoreOp),
    /// The operation's answer.
    Done(StoreAnswer),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moving {
    /// As asked: started again from it after a failure.
    op: StoreOp,
    stage: Stage,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// The begin on the old home.
    BeginOld { new: u8 },
    /// The begin on the new home, the old one claimed (`took_over`: by a takeover).
    BeginNew { old: Claim, took_over: bool },
    /// The new home holds the record: the old home's claim is given back, then the new home's
    /// answer is the begin's.
    GiveBack { answer: StoreAnswer },
    /// The settlement on the old home; then on the new one (`new`: the claim there).
    SettleOld { new: Claim },
    /// The settlement on the new home.
    SettleNew,
    /// Answered; a begin that failed may leave a claim for the caller to give back.
    Ended { unanswered: Option<Claim> },
}

impl Moving {
    /// A begin of a record whose home moves from shard `old` to shard `new`.
    pub fn begin(attempt: ClaimAttempt, old: u8, new: u8) -> (Moving, Leg) {
        let op = StoreOp::Begin(attempt);
        (Moving { op: op.clone(), stage: Stage::BeginOld { new } }, Leg::Run(old, op))
    }

    /// A completion or release of a claim held on both homes (`Claim::old_home`); None for any
    /// other operation.
    pub fn settle(op: StoreOp) -> Option<(Moving, Leg)> {
        let claim = match &op {
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => *claim,
            _ => return None,
        };
        let old = claim.old_home?;
        let old_claim =
            Claim { locator: old.locator, written: None, shard: old.shard, old_home: None, ..claim };
        let new = Claim { old_home: None, ..claim };
        let first = Leg::Run(old.shard, with_claim(&op, old_claim));
        Some((Moving { op, stage: Stage::SettleOld { new } }, first))
    }

    /// The answer of the last `Leg::Run`, and the claim its conversation may have left when it
    /// failed (`Conversation::unanswered_claim`): the next step.
    pub fn answered(&mut self, answer: StoreAnswer, unanswered: Option<Claim>) -> Leg {
        let stage = std::mem::replace(&mut self.stage, Stage::Ended { unanswered: None });
        match (stage, answer) {
            (
                Stage::BeginOld { new },
                StoreAnswer::Begun(Ok(begun @ (Begin::Claimed(_) | Begin::TookOver(_)))),
            ) => {
                let (old, took_over) = match begun {
                    Begin::TookOver(old) => (old, true),
                    Begin::Claimed(old) => (old, false),
                    _ => return Leg::Done(StoreAnswer::Begun(Ok(begun))),
                };
                self.stage = Stage::BeginNew { old, took_over };
                Leg::Run(new, self.op.clone())
            }
            (Stage::BeginOld { .. }, answer) => {
                self.stage = Stage::Ended { unanswered };
                Leg::Done(answer)
            }
            (Stage::BeginNew { old, took_over }, StoreAnswer::Begun(Ok(Begin::Claimed(new)))) => {
                let both = joined(new, &old);
                Leg::Done(StoreAnswer::Begun(Ok(if took_over {
                    Begin::TookOver(both)
                } else {
                    Begin::Claimed(both)
                })))
            }
            (Stage::BeginNew { old, .. }, StoreAnswer::Begun(Ok(Begin::TookOver(new)))) => {
                Leg::Done(StoreAnswer::Begun(Ok(Begin::TookOver(joined(new, &old)))))
            }
            (Stage::BeginNew { old, .. }, answer @ StoreAnswer::Begun(Ok(_))) => {
                // The new home holds the record (written by an Envoy on the new list alone):
                // its answer is the begin's, and the old home's claim goes back.
                self.stage = Stage::GiveBack { answer };
                Leg::Run(old.shard, StoreOp::Release(old))
            }
            (Stage::BeginNew { old, .. }, answer) => {
                // Failed: both claims, the old one held and the new one if it may have been
                // written, are the caller's to give back (tried again until they land).
                self.stage =
                    Stage::Ended { unanswered: Some(unanswered.map_or(old, |new| joined(new, &old))) };
                Leg::Done(answer)
            }
            // Given back or not, the record is the new home's: a claim left behind on the old
            // home ends with its lease.
            (Stage::GiveBack { answer }, _) => Leg::Done(answer),
            (Stage::SettleOld { new }, StoreAnswer::Settled(Ok(_))) => {
                self.stage = Stage::SettleNew;
                Leg::Run(new.shard, with_claim(&self.op, new))
            }
            // Failed on the old home: the whole settlement is tried again (a completion written
            // already is recognised as its own).
            (Stage::SettleOld { .. } | Stage::SettleNew | Stage::Ended { .. }, answer) => Leg::Done(answer),
        }
    }

    /// The claim the caller is to give back if it gives up on the operation now (its call timed
    /// out), given what the conversation under way would leave (`sub`): the old home's claim is
    /// held once the new home is being asked.
    pub fn unanswered(&self, sub: Option<Claim>) -> Option<Claim> {
        match &self.stage {
            Stage::BeginOld { .. } => sub,
            Stage::BeginNew { old, .. } => Some(sub.map_or(*old, |new| joined(new, old))),
            Stage::Ended { unanswered } => *unanswered,
            Stage::GiveBack { .. } | Stage::SettleOld { .. } | Stage::SettleNew => None,
        }
    }

    pub fn into_op(self) -> StoreOp {
        self.op
    }
}

/// The new home's claim, with the old home's as its `old_home`.
fn joined(new: Claim, old: &Claim) -> Claim {
    Claim { old_home: Some(ShardClaim { shard: old.shard, locator: old.locator }), ..new }
}

fn with_claim(op: &StoreOp, claim: Claim) -> StoreOp {
    match op {
        StoreOp::Complete { completion, .. } => StoreOp::Complete { claim, completion: completion.clone() },
        _ => StoreOp::Release(claim),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::scope::ScopeId;
    use crate::store::{Completion, Settled, StoreError};

    const OLD: u8 = 1;
    const NEW: u8 = 2;

    fn attempt() -> ClaimAttempt {
        super::super::tests::claim_attempt(ScopeId([4; 32]))
    }

    fn claim(shard: u8, locator: u64) -> Claim {
        Claim {
            scope: ScopeId([4; 32]),
            owner: 7,
            locator,
            written: None,
            shard,
            old_home: None,
            tombstone_s: 0,
        }
    }

    fn begun(b: Begin) -> StoreAnswer {
        StoreAnswer::Begun(Ok(b))
    }

    fn both() -> Claim {
        Claim { old_home: Some(ShardClaim { shard: OLD, locator: 3 }), ..claim(NEW, 7) }
    }

    #[test]
    fn a_begin_claims_the_old_home_then_the_new_one_and_holds_both() {
        let (mut plan, first) = Moving::begin(attempt(), OLD, NEW);
        assert_eq!(first, Leg::Run(OLD, StoreOp::Begin(attempt())));
        assert_eq!(
            plan.answered(begun(Begin::Claimed(claim(OLD, 3))), None),
            Leg::Run(NEW, StoreOp::Begin(attempt()))
        );
        // Given up on now, the old home's claim is held for sure, the new one's maybe.
        assert_eq!(plan.unanswered(None), Some(claim(OLD, 3)));
        assert_eq!(plan.unanswered(Some(claim(NEW, 7))), Some(both()));
        assert_eq!(
            plan.answered(begun(Begin::Claimed(claim(NEW, 7))), None),
            Leg::Done(begun(Begin::Claimed(both())))
        );
        // A takeover on either home is the begin's.
        let (mut plan, _) = Moving::begin(attempt(), OLD, NEW);
        plan.answered(begun(Begin::TookOver(claim(OLD, 3))), None);
        assert_eq!(
            plan.answered(begun(Begin::Claimed(claim(NEW, 7))), None),
            Leg::Done(begun(Begin::TookOver(both())))
        );
    }

    #[test]
    fn a_record_on_the_old_home_answers_without_asking_the_new_one() {
        for answer in [
            begun(Begin::InFlight { retry_after_ms: 5 }),
            begun(Begin::Mismatch),
            StoreAnswer::Begun(Err(StoreError::TimedOut)),
        ] {
            let (mut plan, _) = Moving::begin(attempt(), OLD, NEW);
            assert_eq!(plan.answered(answer.clone(), Some(claim(OLD, 0))), Leg::Done(answer));
            // A failed begin leaves what its conversation may have written to give back.
            assert_eq!(plan.unanswered(None), Some(claim(OLD, 0)));
        }
    }

    #[test]
    fn a_record_on_the_new_home_answers_and_the_old_homes_claim_goes_back() {
        let (mut plan, _) = Moving::begin(attempt(), OLD, NEW);
        plan.answered(begun(Begin::Claimed(claim(OLD, 3))), None);
        let in_flight = begun(Begin::InFlight { retry_after_ms: 5 });
        assert_eq!(plan.answered(in_flight.clone(), None), Leg::Run(OLD, StoreOp::Release(claim(OLD, 3))));
        assert_eq!(plan.unanswered(None), None);
        assert_eq!(
            plan.answered(StoreAnswer::Settled(Err(StoreError::TimedOut)), None),
            Leg::Done(in_flight)
        );
    }

    #[test]
    fn a_begin_the_new_home_failed_leaves_both_claims_to_give_back() {
        let (mut plan, _) = Moving::begin(attempt(), OLD, NEW);
        plan.answered(begun(Begin::Claimed(claim(OLD, 3))), None);
        let failed = StoreAnswer::Begun(Err(StoreError::TimedOut));
        assert_eq!(plan.answered(failed.clone(), Some(claim(NEW, 7))), Leg::Done(failed.clone()));
        assert_eq!(plan.unanswered(None), Some(both()));
        let (mut plan, _) = Moving::begin(attempt(), OLD, NEW);
        plan.answered(begun(Begin::Claimed(claim(OLD, 3))), None);
        plan.answered(failed, None);
        assert_eq!(plan.unanswered(None), Some(claim(OLD, 3)));
    }

    #[test]
    fn a_settlement_is_made_on_the_old_home_then_the_new_one() {
        let completion = Completion::outcome_unknown(2_000, 60_000);
        let op = |claim| StoreOp::Complete { claim, completion: completion.clone() };
        let (mut plan, first) = Moving::settle(op(both())).expect("a claim on both homes");
        assert_eq!(first, Leg::Run(OLD, op(claim(OLD, 3))));
        assert_eq!(
            plan.answered(StoreAnswer::Settled(Ok(Settled::Lost)), None),
            Leg::Run(NEW, op(claim(NEW, 7)))
        );
        let done = StoreAnswer::Settled(Ok(Settled::Done));
        assert_eq!(plan.answered(done.clone(), None), Leg::Done(done));
        assert_eq!(plan.into_op(), op(both()));
        // Failed on the old home: the settlement fails whole, to be tried again whole.
        let (mut plan, _) = Moving::settle(StoreOp::Release(both())).expect("a claim on both homes");
        let failed = StoreAnswer::Settled(Err(StoreError::TimedOut));
        assert_eq!(plan.answered(failed.clone(), None), Leg::Done(failed));
        // A claim on one home is not moving.
        assert!(Moving::settle(StoreOp::Release(claim(NEW, 7))).is_none());
    }
}
