//! Wait mode: duplicates that arrive while the original is processing are held instead of
//! refused, and answered when the original's outcome is known. Pure bookkeeping, one room per
//! root context (per worker thread): who waits for which record, until when, within which
//! bounds. The worker parks and wakes; a woken waiter's flow looks at its record again
//! (`flow::RequestFlow::recheck`) and the store's answer decides its fate, as for any request.

mod flow;
pub(crate) mod root;
pub mod wake;

use crate::config::Concurrency;
use crate::engine::Pending;
use crate::identity::scope::ScopeId;

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
    /// The record it waits for.
    pub scope: ScopeId,
    /// After this the waiter gets 409, as in reject mode.
    pub give_up_at_ms: u64,
    /// When to look at the record again without being woken (lease end, fallback poll).
    pub recheck_at_ms: u64,
    /// The worker's held request (its flow); None while it looks at its record again (its
    /// recheck has it): not due, not woken, but still held, so it still counts against the
    /// room's bounds.
    pub held: Option<H>,
    /// Polling backoff with a remote store (the wait before the next look); 0: no polling, the
    /// local store's wake-ups and `RECHECK_EVERY_MS` fallback.
    pub poll_ms: u64,
    /// A wake-up came while its recheck was under way: look again at once if that recheck
    /// still finds the original processing (its read may predate the completion).
    pub woken: bool,
    /// A remote store watches its record for this worker: it polls up to `POLL_WATCHED_MAX_MS`.
    pub watched: bool,
}

impl<H> Waiter<H> {
    /// Its recheck is under way.
    pub fn checking(&self) -> bool {
        self.held.is_none()
    }

    /// To be held again after a look that found the original still processing
    /// (`lease_remaining_ms` left on its lease): it looks next at once if a wake-up came
    /// meanwhile, else after its polling backoff or at the lease end. None once its give-up time
    /// has come.
    pub fn again(self, now_ms: u64, lease_remaining_ms: u64) -> Option<Waiter<H>> {
        if now_ms >= self.give_up_at_ms {
            return None;
        }
        let poll_ms = if self.poll_ms > 0 { next_poll(self.poll_ms, self.watched) } else { 0 };
        let recheck_at_ms = if self.woken {
            now_ms
        } else if poll_ms > 0 {
            poll_recheck(now_ms, poll_ms, lease_remaining_ms, self.give_up_at_ms)
        } else {
            first_recheck(now_ms, lease_remaining_ms, self.give_up_at_ms)
        };
        Some(Waiter { recheck_at_ms, poll_ms, woken: false, ..self })
    }
}

/// Why the wait room does not hold a request: one of its bounds, or (for a waiter that looked
/// again) its wait is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotHeld {
    PerKey,
    Total,
    GaveUp,
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

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Whether a new waiter on this record is within the bounds.
    pub fn admits(&self, scope: &ScopeId) -> Result<(), NotHeld> {
        if self.waiters.len() >= self.max_total {
            return Err(NotHeld::Total);
        }
        if self.waiters.iter().filter(|x| x.scope == *scope).count() >= self.max_per_key {
            return Err(NotHeld::PerKey);
        }
        Ok(())
    }

    /// Holds a waiter the room admitted (new, or held again after its recheck).
    pub fn hold(&mut self, w: Waiter<H>) {
        self.waiters.push(w);
    }

    /// The held request's client went away (or its recheck settled its fate).
    pub fn leave(&mut self, context_id: u32) -> Option<Waiter<H>> {
        let i = self.waiters.iter().position(|w| w.context_id == context_id)?;
        Some(self.waiters.swap_remove(i))
    }

    /// Everyone waiting for this record: its outcome may be known now. A waiter whose recheck
    /// is under way stays, marked woken.
    pub fn wake(&mut self, scope: &ScopeId) -> Vec<Waiter<H>> {
        for w in self.waiters.iter_mut().filter(|w| w.checking() && w.scope == *scope) {
            w.woken = true;
        }
        self.take(|w| !w.checking() && w.scope == *scope)
    }

    /// Makes this record's waiters due by `at_ms` (a watch that would have woken them ended).
    pub fn hasten(&mut self, scope: &ScopeId, at_ms: u64) {
        for w in self.waiters.iter_mut().filter(|w| w.scope == *scope) {
            w.recheck_at_ms = w.recheck_at_ms.min(at_ms);
            w.watched = false;
        }
    }

    /// True when someone here waits on this record.
    pub fn waits_on(&self, scope: &ScopeId) -> bool {
        self.waiters.iter().any(|w| w.scope == *scope)
    }

    /// Waiters whose recheck or give-up time has come (not those being rechecked).
    pub fn due(&mut self, now_ms: u64) -> Vec<Waiter<H>> {
        self.take(|w| !w.checking() && (now_ms >= w.recheck_at_ms || now_ms >= w.give_up_at_ms))
    }

    /// Keeps a waiter held while its recheck is under way, and hands over what it holds (the
    /// recheck carries it); `end_check` takes it back, `leave` ends it.
    pub fn start_check(&mut self, mut w: Waiter<H>) -> Option<H> {
        let held = w.held.take();
        self.waiters.push(Waiter { woken: false, ..w });
        held
    }

    /// True while this waiter's recheck is under way (its client has not left meanwhile).
    pub fn checking(&self, context_id: u32) -> bool {
        self.waiters.iter().any(|w| w.checking() && w.context_id == context_id)
    }

    /// The waiter whose recheck was answered, unless its client left meanwhile.
    pub fn end_check(&mut self, context_id: u32) -> Option<Waiter<H>> {
        let i = self.waiters.iter().position(|w| w.checking() && w.context_id == context_id)?;
        Some(self.waiters.swap_remove(i))
    }

    fn take(&mut self, pick: impl Fn(&Waiter<H>) -> bool) -> Vec<Waiter<H>> {
        let (taken, kept): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.waiters).into_iter().partition(|w| pick(w));
        self.waiters = kept;
        taken
    }
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
    use crate::config::{parse, Config};
    use crate::engine::{admit, Admission, RequestHead};

    fn cfg() -> Config {
        parse(
            br#"{"max_waiters_per_key":2,"max_waiters":3,"routes":[{"name":"w","match":{"prefix":"/"},
            "require_key":true,"concurrent":"wait","wait_timeout":"5s","processing_timeout":"2s"}]}"#,
        )
        .unwrap()
    }

    fn pending(cfg: &Config, key: &str) -> Pending {
        let h = vec![("idempotency-key".to_string(), key.as_bytes().to_vec())];
        match admit(
            cfg,
            &RequestHead { method: "POST", path: "/", headers: &h, verified_claims: None, cluster: None },
        ) {
            Admission::Collect(p) => p,
            other => panic!("{other:?}"),
        }
    }

    fn waiter(cfg: &Config, ctx: u32, key: &str, now: u64) -> Waiter<()> {
        Waiter {
            context_id: ctx,
            scope: pending(cfg, key).scope,
            give_up_at_ms: now + 5_000,
            recheck_at_ms: first_recheck(now, 2_000, now + 5_000),
            held: Some(()),
            poll_ms: 0,
            woken: false,
            watched: false,
        }
    }

    /// Admits and holds, as the worker does.
    fn park(room: &mut WaitRoom<()>, w: Waiter<()>) -> Result<(), NotHeld> {
        room.admits(&w.scope)?;
        room.hold(w);
        Ok(())
    }

    #[test]
    fn bounds_per_key_and_in_total() {
        let c = cfg();
        let mut room = WaitRoom::new(c.max_waiters_per_key, c.max_waiters);
        assert!(park(&mut room, waiter(&c, 1, "a", 0)).is_ok());
        assert!(park(&mut room, waiter(&c, 2, "a", 0)).is_ok());
        assert_eq!(park(&mut room, waiter(&c, 3, "a", 0)).err(), Some(NotHeld::PerKey));
        assert!(park(&mut room, waiter(&c, 4, "b", 0)).is_ok());
        assert_eq!(park(&mut room, waiter(&c, 5, "c", 0)).err(), Some(NotHeld::Total));
        assert!(room.leave(4).is_some());
        assert!(room.leave(4).is_none());
        assert!(park(&mut room, waiter(&c, 5, "c", 0)).is_ok());
    }

    #[test]
    fn wake_takes_only_that_record_and_due_honours_times() {
        let c = cfg();
        let mut room = WaitRoom::new(10, 10);
        park(&mut room, waiter(&c, 1, "a", 0)).ok();
        park(&mut room, waiter(&c, 2, "b", 0)).ok();
        let a = pending(&c, "a").scope;
        assert_eq!(room.wake(&a).iter().map(|w| w.context_id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(room.len(), 1);
        assert!(room.due(RECHECK_EVERY_MS - 1).is_empty());
        assert_eq!(room.due(RECHECK_EVERY_MS).len(), 1);
        assert!(room.is_empty());
    }

    #[test]
    fn a_waiter_still_waiting_looks_again_at_the_lease_end_or_gives_up() {
        let c = cfg();
        // Still processing, 2 s left on the lease: the next look within a second.
        let w = waiter(&c, 7, "a", 10).again(100, 2_000).expect("still waiting");
        assert_eq!((w.recheck_at_ms, w.poll_ms), (1_100, 0));
        // ...or at the lease end, if sooner.
        assert_eq!(waiter(&c, 7, "a", 10).again(100, 300).map(|w| w.recheck_at_ms), Some(400));
        // At the give-up time (before the lease ends) its wait is over: 409, counted as a
        // timed-out wait (flow.rs). After the lease it would have been a takeover instead.
        let impatient = Waiter { give_up_at_ms: 1_500, ..waiter(&c, 7, "a", 10) };
        assert!(impatient.again(1_500, 2_000).is_none());
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
        let w = Waiter { poll_ms: 200, ..waiter(&c, 7, "a", 10) };
        let again = w.again(100, 2_000).expect("still waiting");
        assert_eq!((again.recheck_at_ms, again.poll_ms), (500, 400));
        // Woken while its recheck was under way: look again at once.
        let w = Waiter { poll_ms: 200, woken: true, ..waiter(&c, 7, "a", 10) };
        let again = w.again(100, 2_000).expect("still waiting");
        assert_eq!((again.recheck_at_ms, again.woken), (100, false));
    }

    #[test]
    fn a_waiter_being_checked_stays_held_and_counted_but_is_neither_due_nor_taken_by_a_wake() {
        let c = cfg();
        let mut room = WaitRoom::new(c.max_waiters_per_key, c.max_waiters);
        assert_eq!(room.start_check(waiter(&c, 1, "a", 0)), Some(()));
        assert!(room.checking(1));
        park(&mut room, waiter(&c, 2, "a", 0)).ok();
        assert!(!room.checking(2));
        assert_eq!(park(&mut room, waiter(&c, 3, "a", 0)).err(), Some(NotHeld::PerKey));
        assert_eq!(room.due(u64::MAX).len(), 1);
        assert!(room.wake(&pending(&c, "a").scope).is_empty());
        let w = room.end_check(1).expect("still held");
        assert!(w.woken && w.checking());
        assert!(room.end_check(1).is_none());
        // A client that left while its check was under way is gone from the room.
        room.start_check(w);
        assert!(room.leave(1).is_some());
        assert!(!room.checking(1));
        assert!(room.end_check(1).is_none());
    }

    #[test]
    fn first_recheck_is_capped_by_lease_poll_and_give_up() {
        assert_eq!(first_recheck(0, 300, 5_000), 300);
        assert_eq!(first_recheck(0, 30_000, 5_000), RECHECK_EVERY_MS);
        assert_eq!(first_recheck(0, 30_000, 200), 200);
    }
}
