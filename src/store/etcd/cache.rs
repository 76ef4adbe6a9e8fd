//! The replay cache: a worker's bounded copy of completed records it has read from etcd or
//! written there, so that a hot replay is answered without a round trip.
//!
//! Why it is safe: a completed record never changes until it expires. Completion, release and
//! takeover all require a processing record (their guards and checks refuse a completed one), so
//! the only next state of a completed record is "expired", decided by its own `expires_at_ms`
//! against the caller's clock, exactly as for a record read from etcd. A cached record is
//! therefore answered only while it has not expired, and with the same decision as
//! `EtcdConversation::begin_read` makes: a different fingerprint is a mismatch, a record without its
//! body answers "not stored". Claims never come from here: a miss, an expired entry or a
//! processing record always goes to etcd. Nor do outcome-unknown records, which an operator
//! may settle (C24): each begin of one reads etcd. What the cache cannot see is etcd losing a
//! record before its expiry, an operator force-releasing a known outcome (C24), or another Envoy whose clock runs ahead
//! claiming the key anew once it considers the record expired: this worker keeps replaying the
//! record until its own clock reaches the expiry.
//!
//! Bounds: at most `entries` records and `max_bytes` bytes (each record counts its snapshot's
//! bytes plus `ENTRY_OVERHEAD_BYTES`); the oldest insertion goes first. An expired record is
//! dropped when it is looked up, else it waits its turn (it is within the bounds all the same).
//! A record larger than `max_bytes` is not kept.

use std::collections::{HashMap, VecDeque};

use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::store::record::{Entry, Snapshot};
use crate::store::{completed_answer, Begin};

/// Configured bounds (`store.replay_cache`), per worker; defined with their defaults and limits
/// in `config::etcd`.
pub use crate::config::etcd::ReplayCacheSettings;

/// Bookkeeping per cached record (the entry, map and queue slots, header strings' headers),
/// counted against `max_bytes` so that many small records cannot exceed it unseen.
const ENTRY_OVERHEAD_BYTES: u64 = 256;

#[derive(Debug)]
struct Cached {
    entry: Entry,
    snapshot: Option<Snapshot>,
    bytes: u64,
    /// Which insertion this is: the queue may hold older insertions of the same scope.
    serial: u64,
}

#[derive(Debug)]
pub struct ReplayCache {
    settings: ReplayCacheSettings,
    records: HashMap<ScopeId, Cached>,
    /// Insertion order (scope, serial); a pair whose serial is no longer the record's is stale.
    order: VecDeque<(ScopeId, u64)>,
    bytes: u64,
    serial: u64,
}

fn snapshot_bytes(s: &Snapshot) -> u64 {
    let headers: usize = s.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    (headers + s.body.len()) as u64
}

impl ReplayCache {
    pub fn new(settings: ReplayCacheSettings) -> ReplayCache {
        ReplayCache { settings, records: HashMap::new(), order: VecDeque::new(), bytes: 0, serial: 0 }
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The answer to a begin of `scope` with `fingerprint` at `now_ms`, when a live completed
    /// record is cached; None sends the begin to etcd.
    pub fn answer(&mut self, scope: &ScopeId, fingerprint: &Fingerprint, now_ms: u64) -> Option<Begin> {
        let cached = self.records.get(scope)?;
        if cached.entry.is_expired(now_ms) {
            self.remove(scope);
            return None;
        }
        let e = &cached.entry;
        if e.fingerprint != *fingerprint {
            return Some(Begin::Mismatch);
        }
        // A record with a body is kept with its snapshot (`keep`), so None cannot happen here.
        completed_answer(e, cached.snapshot.clone()).or(Some(Begin::NotStored { status: e.status }))
    }

    /// Keeps a completed record (anything else is ignored) that has not expired at `now_ms`.
    /// An outcome-unknown record is not kept: it waits for an operator's release or resolve
    /// (C24), which every worker must see on its next begin.
    pub fn keep(&mut self, entry: Entry, snapshot: Option<&Snapshot>, now_ms: u64) {
        if !entry.is_completed() || entry.outcome_unknown() || entry.is_expired(now_ms) {
            return;
        }
        let snapshot = snapshot.filter(|_| entry.body_stored());
        let bytes = snapshot.map_or(0, snapshot_bytes).saturating_add(ENTRY_OVERHEAD_BYTES);
        if bytes > self.settings.max_bytes || self.settings.entries == 0 {
            return;
        }
        self.remove(&entry.scope);
        while self.records.len() >= self.settings.entries as usize
            || self.bytes.saturating_add(bytes) > self.settings.max_bytes
        {
            if !self.evict_oldest() {
                break;
            }
        }
        self.serial = self.serial.wrapping_add(1);
        let serial = self.serial;
        self.order.push_back((entry.scope, serial));
        self.bytes = self.bytes.saturating_add(bytes);
        self.records.insert(entry.scope, Cached { entry, snapshot: snapshot.cloned(), bytes, serial });
    }

    fn remove(&mut self, scope: &ScopeId) {
        if let Some(old) = self.records.remove(scope) {
            self.bytes = self.bytes.saturating_sub(old.bytes);
        }
        // Its queue slot goes stale and is skipped when it comes up; the queue is compacted
        // when stale slots outnumber the records, so it stays within twice the entry bound.
        if self.order.len() > 2 * self.records.len() + 16 {
            let records = &self.records;
            self.order.retain(|(s, serial)| records.get(s).is_some_and(|c| c.serial == *serial));
        }
    }

    /// Drops the oldest insertion still cached; false when nothing is left.
    fn evict_oldest(&mut self) -> bool {
        while let Some((scope, serial)) = self.order.pop_front() {
            if self.records.get(&scope).is_some_and(|c| c.serial == serial) {
                self.remove(&scope);
                return true;
            }
        }
        false
    }
}

// Cloned only by the model checker (tests/etcd_model), which copies a worker's store and its
// conversations into each state it explores. Written out at the end of the file, so that no
// line of the code above moves: the module's panic locations, and so its bytes, stay the same.
#[cfg(feature = "testing")]
impl Clone for Cached {
    fn clone(&self) -> Self {
        Cached { entry: self.entry, snapshot: self.snapshot.clone(), bytes: self.bytes, serial: self.serial }
    }
}

#[cfg(feature = "testing")]
impl Clone for ReplayCache {
    fn clone(&self) -> Self {
        ReplayCache {
            settings: self.settings,
            records: self.records.clone(),
            order: self.order.clone(),
            bytes: self.bytes,
            serial: self.serial,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::{State, FLAG_BODY_NOT_STORED, STATUS_OUTCOME_UNKNOWN};

    const TTL: u64 = 10_000;

    fn completed(n: u8, fingerprint: u8, stored: bool) -> Entry {
        Entry {
            position: 0,
            state: State::Succeeded,
            flags: if stored { 0 } else { FLAG_BODY_NOT_STORED },
            status: 201,
            scope: ScopeId([n; 32]),
            fingerprint: Fingerprint([fingerprint; 32]),
            owner: 7,
            lease_deadline_ms: 500,
            expires_at_ms: TTL,
            charged_at_ms: 0,
            tenant_tag: 0,
            principal_tag: 0,
        }
    }

    fn snapshot(body_bytes: usize) -> Snapshot {
        Snapshot {
            status: 201,
            headers: vec![("content-type".into(), b"text/plain".to_vec())],
            body: vec![b'x'; body_bytes],
        }
    }

    fn cache(entries: u32, max_bytes: u64) -> ReplayCache {
        ReplayCache::new(ReplayCacheSettings { entries, max_bytes })
    }

    #[test]
    fn answers_like_etcd_until_the_record_expires() {
        let mut c = cache(8, 1 << 20);
        let s = snapshot(100);
        c.keep(completed(1, 9, true), Some(&s), 0);
        let scope = ScopeId([1; 32]);
        assert_eq!(c.answer(&scope, &Fingerprint([9; 32]), 0), Some(Begin::Replay(s.clone())));
        assert_eq!(c.answer(&scope, &Fingerprint([9; 32]), TTL - 1), Some(Begin::Replay(s)));
        // Another payload under the same key: refused, as etcd's record would refuse it.
        assert_eq!(c.answer(&scope, &Fingerprint([8; 32]), 0), Some(Begin::Mismatch));
        // At its expiry the record is absent: the begin goes to etcd (and may claim there).
        assert_eq!(c.answer(&scope, &Fingerprint([9; 32]), TTL), None);
        assert!(c.is_empty());
        assert_eq!(c.bytes(), 0);
        // Unknown scopes are misses.
        assert_eq!(c.answer(&ScopeId([2; 32]), &Fingerprint([9; 32]), 0), None);
    }

    #[test]
    fn a_record_kept_without_its_body_answers_not_stored() {
        let mut c = cache(8, 1 << 20);
        c.keep(completed(1, 9, false), None, 0);
        assert_eq!(
            c.answer(&ScopeId([1; 32]), &Fingerprint([9; 32]), 0),
            Some(Begin::NotStored { status: 201 })
        );
        // A snapshot next to a not-stored flag is not served either.
        c.keep(completed(2, 9, false), Some(&snapshot(10)), 0);
        assert_eq!(
            c.answer(&ScopeId([2; 32]), &Fingerprint([9; 32]), 0),
            Some(Begin::NotStored { status: 201 })
        );
    }

    #[test]
    fn a_record_whose_outcome_is_unknown_is_never_kept() {
        // An operator settles it (C24's release or resolve), and every worker must see that
        // at once, not when its copy expires a ttl later.
        let mut c = cache(8, 1 << 20);
        let unknown =
            Entry { state: State::FailedFinal, status: STATUS_OUTCOME_UNKNOWN, ..completed(1, 9, false) };
        c.keep(unknown, None, 0);
        assert!(c.is_empty());
        assert_eq!(c.answer(&ScopeId([1; 32]), &Fingerprint([9; 32]), 0), None);
    }

    #[test]
    fn claims_and_expired_records_are_never_kept() {
        let mut c = cache(8, 1 << 20);
        let mut claim = completed(1, 9, true);
        claim.state = State::Processing;
        c.keep(claim, None, 0);
        c.keep(completed(2, 9, true), Some(&snapshot(1)), TTL);
        assert!(c.is_empty());
        assert_eq!(c.answer(&ScopeId([1; 32]), &Fingerprint([9; 32]), 0), None);
    }

    #[test]
    fn the_entry_bound_drops_the_oldest_first() {
        let mut c = cache(2, 1 << 20);
        for n in 1..=3 {
            c.keep(completed(n, 9, true), Some(&snapshot(10)), 0);
        }
        assert_eq!(c.len(), 2);
        assert_eq!(c.answer(&ScopeId([1; 32]), &Fingerprint([9; 32]), 0), None);
        assert!(c.answer(&ScopeId([2; 32]), &Fingerprint([9; 32]), 0).is_some());
        assert!(c.answer(&ScopeId([3; 32]), &Fingerprint([9; 32]), 0).is_some());
        // Keeping a scope again replaces it (one record per scope) and makes it the newest.
        c.keep(completed(2, 9, true), Some(&snapshot(10)), 0);
        c.keep(completed(4, 9, true), Some(&snapshot(10)), 0);
        assert_eq!(c.len(), 2);
        assert_eq!(c.answer(&ScopeId([3; 32]), &Fingerprint([9; 32]), 0), None);
        assert!(c.answer(&ScopeId([2; 32]), &Fingerprint([9; 32]), 0).is_some());
    }

    #[test]
    fn the_byte_bound_holds_and_an_oversized_record_is_not_kept() {
        let per = 1_000 + 12 + 10 + ENTRY_OVERHEAD_BYTES; // body, header name and value, overhead
        let mut c = cache(100, 3 * per);
        for n in 1..=5 {
            c.keep(completed(n, 9, true), Some(&snapshot(1_000)), 0);
            assert!(c.bytes() <= 3 * per, "{} bytes after {n}", c.bytes());
        }
        assert_eq!(c.len(), 3);
        assert_eq!(c.bytes(), 3 * per);
        c.keep(completed(9, 9, true), Some(&snapshot(4 * 1_000)), 0);
        assert_eq!(c.answer(&ScopeId([9; 32]), &Fingerprint([9; 32]), 0), None);
        assert_eq!(c.len(), 3, "an oversized record evicts nothing");
    }

    #[test]
    fn churn_keeps_the_queue_bounded() {
        let mut c = cache(4, 1 << 20);
        for round in 0..1_000u32 {
            let n = (round % 6) as u8;
            c.keep(completed(n, 9, true), Some(&snapshot(1)), 0);
            assert!(c.len() <= 4);
            assert!(c.order.len() <= 2 * 4 + 16 + 1, "queue {} after {round}", c.order.len());
        }
        let total: u64 = c.records.values().map(|r| r.bytes).sum();
        assert_eq!(total, c.bytes());
    }
}
