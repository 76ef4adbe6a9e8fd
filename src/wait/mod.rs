//! Wait mode: duplicates that arrive while the original is processing are held instead of
//! refused, and answered when the original's outcome is known. Pure bookkeeping, one room per
//! root context (per worker thread): who waits for which record, until when, within which
//! bounds. The glue parks and wakes; `recheck` decides what a woken waiter gets.

pub mod wake;

use crate::config::etcd::OnStoreError;
use crate::config::{Concurrency, Config, Rule};
use crate::engine::{
    claim_attempt, decision_of, in_flight_reply, reply_details, Decision, Pending, ReplayShape, Reply,
};
use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::metrics::Counter;
#[cfg(test)]
use crate::store::RecordStore;
use crate::store::{Claim, StoreAnswer, StoreError, StoreOp};
use std::rc::Rc;

/// Longest a waiter goes without looking at its record again, even if no wake-up message
/// reaches it (a lost message must cost latency, never a wrong answer or a stuck request).
pub const RECHECK_EVERY_MS: u64 = 1_000;
/// With a store shared by several Envoys an original may finish on another Envoy, whose
/// wake-ups never reach this one: its waiters poll the store, first after this long...
pub const POLL_FIRST_MS: u64 = 50;
/// ...then twice as long each time, up to this (still capped by the lease end and give-up).
pub const POLL_MAX_MS: u64 = RECHECK_EVERY_MS;
/// The cap while etcd watches the waiter's record for this worker (its change wakes the
/// waiter): polling is then only the fallback for a lost event.
pub const POLL_WATCHED_MAX_MS: u64 = 5_000;

pub struct Waiter<H> {
    pub context_id: u32,
    pub pending: Pending,
    /// Computed once when the request parked; its body stays in Envoy's buffer, not here.
    pub fingerprint: Fingerprint,
    /// After this the waiter gets 409, as in reject mode.
    pub give_up_at_ms: u64,
    /// When to look at the record again without being woken (lease end, fallback poll).
    pub recheck_at_ms: u64,
    /// The glue's link to the held request.
    pub handle: H,
    /// Polling backoff with a remote store (the wait before the next look); 0: no polling, the
    /// local store's wake-ups and `RECHECK_EVERY_MS` fallback.
    pub poll_ms: u64,
    /// Its recheck is in flight (a remote store's conversation): not due, not woken, but still
    /// held, so it still counts against the room's bounds.
    pub checking: bool,
    /// A wake-up came while its recheck was in flight: look again at once if that recheck
    /// still finds the original processing (its read may predate the completion).
    pub woken: bool,
    /// A remote store watches its record for this worker: it polls up to `POLL_WATCHED_MAX_MS`.
    pub watched: bool,
}

impl<H> Waiter<H> {
    pub fn scope(&self) -> ScopeId {
        self.pending.scope
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomFull {
    PerKey,
    Total,
}

pub struct WaitRoom<H> {
    waiters: Vec<Waiter<H>>,
    max_per_key: usize,
    max_total: usize,
}

impl<H> WaitRoom<H> {
    pub fn new(max_per_key: u32, max_total: u32) -> Self {
        WaitRoom { waiters: Vec::new(), max_per_key: max_per_key as usize, max_total: max_total as usize }
    }

    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Holds a new waiter, within the bounds.
    pub fn park(&mut self, w: Waiter<H>) -> Result<(), RoomFull> {
        if self.waiters.len() >= self.max_total {
            return Err(RoomFull::Total);
        }
        let scope = w.scope();
        if self.waiters.iter().filter(|x| x.scope() == scope).count() >= self.max_per_key {
            return Err(RoomFull::PerKey);
        }
        self.waiters.push(w);
        Ok(())
    }

    /// Puts back a waiter that was taken out to be rechecked (it was already admitted).
    pub fn repark(&mut self, w: Waiter<H>) {
        self.waiters.push(w);
    }

    /// The held request's client went away.
    pub fn leave(&mut self, context_id: u32) -> Option<Waiter<H>> {
        let i = self.waiters.iter().position(|w| w.context_id == context_id)?;
        Some(self.waiters.swap_remove(i))
    }

    /// Everyone waiting for this record: its outcome may be known now. A waiter whose recheck
    /// is in flight stays, marked woken.
    pub fn wake(&mut self, scope: &ScopeId) -> Vec<Waiter<H>> {
        for w in self.waiters.iter_mut().filter(|w| w.checking && w.scope() == *scope) {
            w.woken = true;
        }
        self.take(|w| !w.checking && w.scope() == *scope)
    }

    /// Makes this record's waiters due by `at_ms` (a watch that would have woken them ended).
    pub fn hasten(&mut self, scope: &ScopeId, at_ms: u64) {
        for w in self.waiters.iter_mut().filter(|w| w.scope() == *scope) {
            w.recheck_at_ms = w.recheck_at_ms.min(at_ms);
            w.watched = false;
        }
    }

    /// True when someone here waits on this record.
    pub fn waits_on(&self, scope: &ScopeId) -> bool {
        self.waiters.iter().any(|w| w.scope() == *scope)
    }

    /// Waiters whose recheck or give-up time has come (not those being rechecked).
    pub fn due(&mut self, now_ms: u64) -> Vec<Waiter<H>> {
        self.take(|w| !w.checking && (now_ms >= w.recheck_at_ms || now_ms >= w.give_up_at_ms))
    }

    /// Keeps a waiter held while its recheck is in flight; `end_check` takes it back.
    pub fn start_check(&mut self, w: Waiter<H>) {
        self.waiters.push(Waiter { checking: true, woken: false, ..w });
    }

    /// The waiter whose recheck was answered, unless its client left meanwhile.
    pub fn end_check(&mut self, context_id: u32) -> Option<Waiter<H>> {
        let i = self.waiters.iter().position(|w| w.checking && w.context_id == context_id)?;
        let w = self.waiters.swap_remove(i);
        Some(Waiter { checking: false, ..w })
    }

    fn take(&mut self, pick: impl Fn(&Waiter<H>) -> bool) -> Vec<Waiter<H>> {
        let (taken, kept): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.waiters).into_iter().partition(|w| pick(w));
        self.waiters = kept;
        taken
    }
}

/// How a held request was resolved by its root (read once by its stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resumed {
    Forwarded {
        claim: Claim,
        rule: Rc<Rule>,
    },
    Answered {
        replay_shape: Option<ReplayShape>,
    },
    /// The store failed during its recheck and the fail mode is open: forwarded unprotected.
    Bypassed,
}

/// A waiter's fate, decided when it looks at its record again (`recheck_answered`,
/// `recheck_failed`): the one place it is decided, from the request's `Decision`; the root only
/// carries it out, and leaves the stream word of it (`Resumed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaiterPlan {
    /// Still processing: put it back, to look again at this time.
    Repark { recheck_at_ms: u64 },
    /// It owns the record now: count, leave word, resume it. If it cannot be resumed, `release`
    /// its claim (nothing was sent upstream).
    Resume { counter: Counter, resumed: Resumed, release: StoreOp },
    /// Answer it (replay, problem, or 409 after its wait timeout): count, leave word, reply.
    Answer { counter: Counter, resumed: Resumed, reply: Reply, details: &'static str },
    /// The store failed during its recheck, fail_open: count, leave word, resume it without a
    /// claim.
    Bypass { counter: Counter, resumed: Resumed },
}

/// The first wait: when to look again if no wake-up comes.
pub fn first_recheck(now_ms: u64, lease_remaining_ms: u64, give_up_at_ms: u64) -> u64 {
    now_ms.saturating_add(lease_remaining_ms.min(RECHECK_EVERY_MS)).min(give_up_at_ms)
}

/// The next poll of a waiter on a remote store: after `poll_ms`, or at the lease end or its
/// give-up time if sooner.
pub fn poll_recheck(now_ms: u64, poll_ms: u64, lease_remaining_ms: u64, give_up_at_ms: u64) -> u64 {
    now_ms.saturating_add(lease_remaining_ms.min(poll_ms)).min(give_up_at_ms)
}

/// The backoff after a poll that found the original still processing. A watched record's
/// change wakes its waiters, and they looked once after the watch began (its creation wakes
/// them): polling is then the fallback for a lost event only.
pub fn next_poll(poll_ms: u64, watched: bool) -> u64 {
    if watched {
        return POLL_WATCHED_MAX_MS;
    }
    poll_ms.saturating_mul(2).clamp(POLL_FIRST_MS, POLL_MAX_MS)
}

/// When a request parked now gives up: its rule's `wait_timeout` from now.
pub fn give_up_at(pending: &Pending, now_ms: u64) -> u64 {
    now_ms.saturating_add(wait_timeout_ms(pending).unwrap_or(0))
}

/// A recheck against a store that answers at once.
#[cfg(test)]
fn recheck<H>(cfg: &Config, w: &Waiter<H>, store: &dyn RecordStore, now_ms: u64, owner: u64) -> WaiterPlan {
    recheck_answered(cfg, w, recheck_op(cfg, w, now_ms, owner).perform(store), now_ms)
}

/// What a waiter asks the store when it looks at its record again: a fresh `begin`.
pub fn recheck_op<H>(cfg: &Config, w: &Waiter<H>, now_ms: u64, owner: u64) -> StoreOp {
    StoreOp::Begin(claim_attempt(cfg, &w.pending, w.fingerprint, now_ms, owner))
}

/// What the root does for a woken waiter, from the store's answer to its `recheck_op`: the
/// one place a waiter's fate is decided (the root only carries the plan out).
pub fn recheck_answered<H>(cfg: &Config, w: &Waiter<H>, answer: StoreAnswer, now_ms: u64) -> WaiterPlan {
    let begun = answer.into_begun();
    let respond = |reply: Reply, counter: Counter| WaiterPlan::Answer {
        counter,
        resumed: Resumed::Answered { replay_shape: reply.replay_shape.clone() },
        details: reply_details(counter),
        reply,
    };
    let repark = |recheck_at_ms| WaiterPlan::Repark { recheck_at_ms };
    match decision_of(cfg, &w.pending, begun) {
        // It became the owner (the original was released, or its lease ended): forward it.
        Decision::Forward { claim, counter } => WaiterPlan::Resume {
            counter,
            resumed: Resumed::Forwarded { claim, rule: Rc::clone(&w.pending.rule) },
            release: StoreOp::Release(claim),
        },
        Decision::Respond { reply, counter } => respond(reply, counter),
        Decision::Wait { lease_remaining_ms } if now_ms >= w.give_up_at_ms => {
            respond(in_flight_reply(cfg, lease_remaining_ms), Counter::WaitTimedOut)
        }
        Decision::Wait { .. } if w.woken => repark(now_ms),
        Decision::Wait { lease_remaining_ms } if w.poll_ms > 0 => {
            repark(poll_recheck(now_ms, next_poll(w.poll_ms, w.watched), lease_remaining_ms, w.give_up_at_ms))
        }
        Decision::Wait { lease_remaining_ms } => {
            repark(first_recheck(now_ms, lease_remaining_ms, w.give_up_at_ms))
        }
    }
}

/// What a waiter gets when the store failed during its recheck: the fail mode decides, as for a
/// request's own `begin` (fail_closed: 503 store-unavailable; fail_open: forward unprotected).
pub fn recheck_failed<H>(
    cfg: &Config,
    w: &Waiter<H>,
    error: StoreError,
    mode: OnStoreError,
    now_ms: u64,
) -> WaiterPlan {
    match mode {
        OnStoreError::FailOpen => {
            WaiterPlan::Bypass { counter: Counter::StoreBypassed, resumed: Resumed::Bypassed }
        }
        OnStoreError::FailClosed => recheck_answered(cfg, w, StoreAnswer::Begun(Err(error)), now_ms),
    }
}

/// The wait timeout of the rule a pending request matched, if it waits at all.
pub fn wait_timeout_ms(pending: &Pending) -> Option<u64> {
    match pending.rule.concurrency {
        Concurrency::Wait { timeout_ms } => Some(timeout_ms),
        Concurrency::Reject => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use crate::engine::tests::decide;
    use crate::engine::{admit, fingerprint_body, Admission, RequestHead};
    use crate::store::fake::FakeSharedData;
    use crate::store::local::LocalStore;
    use crate::store::record::{Snapshot, State};
    use crate::store::Completion;

    fn cfg() -> Config {
        parse(
            br#"{"max_waiters_per_key":2,"max_waiters":3,"routes":[{"name":"w","match":{"prefix":"/"},
            "require_key":true,"concurrent":"wait","wait_timeout":"5s","processing_timeout":"2s"}]}"#,
        )
        .unwrap()
    }

    fn pending(cfg: &Config, key: &str) -> Pending {
        let h = vec![("idempotency-key".to_string(), key.as_bytes().to_vec())];
        match admit(cfg, &RequestHead { method: "POST", path: "/", headers: &h, verified_claims: None }) {
            Admission::Collect(p) => p,
            other => panic!("{other:?}"),
        }
    }

    fn waiter(cfg: &Config, ctx: u32, key: &str, now: u64) -> Waiter<()> {
        let pending = pending(cfg, key);
        Waiter {
            context_id: ctx,
            fingerprint: fingerprint_body(&pending, b"x").unwrap(),
            pending,
            give_up_at_ms: now + 5_000,
            recheck_at_ms: first_recheck(now, 2_000, now + 5_000),
            handle: (),
            poll_ms: 0,
            checking: false,
            woken: false,
            watched: false,
        }
    }

    #[test]
    fn bounds_per_key_and_in_total() {
        let c = cfg();
        let mut room = WaitRoom::new(c.max_waiters_per_key, c.max_waiters);
        assert!(room.park(waiter(&c, 1, "a", 0)).is_ok());
        assert!(room.park(waiter(&c, 2, "a", 0)).is_ok());
        assert_eq!(room.park(waiter(&c, 3, "a", 0)).err(), Some(RoomFull::PerKey));
        assert!(room.park(waiter(&c, 4, "b", 0)).is_ok());
        assert_eq!(room.park(waiter(&c, 5, "c", 0)).err(), Some(RoomFull::Total));
        assert!(room.leave(4).is_some());
        assert!(room.leave(4).is_none());
        assert!(room.park(waiter(&c, 5, "c", 0)).is_ok());
    }

    #[test]
    fn wake_takes_only_that_record_and_due_honours_times() {
        let c = cfg();
        let mut room = WaitRoom::new(10, 10);
        room.park(waiter(&c, 1, "a", 0)).ok();
        room.park(waiter(&c, 2, "b", 0)).ok();
        let a = pending(&c, "a").scope;
        assert_eq!(room.wake(&a).iter().map(|w| w.context_id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(room.len(), 1);
        assert!(room.due(RECHECK_EVERY_MS - 1).is_empty());
        assert_eq!(room.due(RECHECK_EVERY_MS).len(), 1);
        assert!(room.is_empty());
    }

    #[test]
    fn recheck_replays_forwards_waits_or_gives_up() {
        let c = cfg();
        let data = FakeSharedData::new();
        let store = LocalStore::new(&data, 64);
        store.create_keys().unwrap();
        let p = pending(&c, "a");
        let claim = match decide(&c, &p, b"x", &store, 0, 1) {
            Decision::Forward { claim, .. } => claim,
            other => panic!("{other:?}"),
        };
        let w = waiter(&c, 7, "a", 10);
        assert_eq!(recheck(&c, &w, &store, 100, 2), WaiterPlan::Repark { recheck_at_ms: 1_100 });
        // At the give-up time (before the lease ends): 409 with retry-after, counted as a
        // timed-out wait. After the lease it would have been a takeover instead.
        let impatient = Waiter { give_up_at_ms: 1_500, ..waiter(&c, 7, "a", 10) };
        match recheck(&c, &impatient, &store, 1_500, 3) {
            WaiterPlan::Answer { reply, counter, .. } => {
                assert_eq!((reply.status, counter), (409, Counter::WaitTimedOut));
            }
            other => panic!("{other:?}"),
        }
        // The original completes: the waiter gets the replay.
        let snapshot = Snapshot { status: 201, headers: vec![], body: b"done".to_vec() };
        let completion = Completion {
            state: State::Succeeded,
            status: 201,
            snapshot: Some(snapshot),
            now_ms: 200,
            ttl_ms: 10_000,
        };
        store.complete(&claim, &completion).unwrap();
        match recheck(&c, &w, &store, 201, 4) {
            WaiterPlan::Answer { reply, counter, details, .. } => {
                assert_eq!((reply.body.as_slice(), counter), (&b"done"[..], Counter::Replayed));
                assert_eq!(details, crate::engine::DETAILS_REPLAY);
            }
            other => panic!("{other:?}"),
        }
        // A released record: the first waiter to look becomes the owner, the next one waits.
        let q = pending(&c, "b");
        let claim_b = match decide(&c, &q, b"x", &store, 300, 5) {
            Decision::Forward { claim, .. } => claim,
            other => panic!("{other:?}"),
        };
        store.release(&claim_b).unwrap();
        let (w1, w2) = (waiter(&c, 8, "b", 300), waiter(&c, 9, "b", 300));
        // It owns the record now; should it not be resumed, its own claim is what is released.
        match recheck(&c, &w1, &store, 301, 6) {
            WaiterPlan::Resume { counter, resumed: Resumed::Forwarded { claim, .. }, release } => {
                assert_eq!((counter, release), (Counter::Claimed, StoreOp::Release(claim)))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(recheck(&c, &w2, &store, 302, 7), WaiterPlan::Repark { .. }));
    }

    #[test]
    fn a_polling_waiter_backs_off_from_50_ms_to_1_s_capped_by_lease_and_give_up() {
        let gaps: Vec<u64> =
            std::iter::successors(Some(POLL_FIRST_MS), |p| Some(next_poll(*p, false))).take(7).collect();
        assert_eq!(gaps, vec![50, 100, 200, 400, 800, 1_000, 1_000]);
        // While etcd watches the record for this worker, polling is only the fallback.
        assert_eq!(next_poll(POLL_FIRST_MS, true), POLL_WATCHED_MAX_MS);
        assert_eq!(poll_recheck(0, 400, 30_000, 5_000), 400);
        assert_eq!(poll_recheck(0, 400, 120, 5_000), 120);
        assert_eq!(poll_recheck(4_900, 400, 30_000, 5_000), 5_000);
        // Still processing: the next poll comes after the doubled backoff.
        let c = cfg();
        let data = FakeSharedData::new();
        let store = LocalStore::new(&data, 64);
        store.create_keys().unwrap();
        let p = pending(&c, "a");
        assert!(matches!(decide(&c, &p, b"x", &store, 0, 1), Decision::Forward { .. }));
        let w = Waiter { poll_ms: 200, ..waiter(&c, 7, "a", 10) };
        assert_eq!(recheck(&c, &w, &store, 100, 2), WaiterPlan::Repark { recheck_at_ms: 500 });
        // Woken while its recheck was in flight: look again at once.
        let w = Waiter { woken: true, ..w };
        assert_eq!(recheck(&c, &w, &store, 100, 3), WaiterPlan::Repark { recheck_at_ms: 100 });
    }

    #[test]
    fn a_waiter_being_checked_stays_held_and_counted_but_is_neither_due_nor_taken_by_a_wake() {
        let c = cfg();
        let mut room = WaitRoom::new(c.max_waiters_per_key, c.max_waiters);
        room.start_check(waiter(&c, 1, "a", 0));
        room.park(waiter(&c, 2, "a", 0)).ok();
        assert_eq!(room.park(waiter(&c, 3, "a", 0)).err(), Some(RoomFull::PerKey));
        assert_eq!(room.due(u64::MAX).len(), 1);
        assert!(room.wake(&pending(&c, "a").scope).is_empty());
        let w = room.end_check(1).expect("still held");
        assert!(w.woken && !w.checking);
        assert!(room.end_check(1).is_none());
        // A client that left while its check was in flight is gone from the room.
        room.start_check(w);
        assert!(room.leave(1).is_some());
        assert!(room.end_check(1).is_none());
    }

    #[test]
    fn first_recheck_is_capped_by_lease_poll_and_give_up() {
        assert_eq!(first_recheck(0, 300, 5_000), 300);
        assert_eq!(first_recheck(0, 30_000, 5_000), RECHECK_EVERY_MS);
        assert_eq!(first_recheck(0, 30_000, 200), 200);
    }
}
