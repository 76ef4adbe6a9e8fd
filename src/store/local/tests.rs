//! Unit tests of the local store: placement and fill under churn, the fixed key space, the
//! commit point under races (`Interleave`), quotas and retirement. The conformance suite is
//! instantiated in `tests/store_conformance.rs`, from outside the crate.

use super::format::{self, Layout, QuotaCounter};
use super::layout::{bucket_key_in, fill_key_in, quota_key_in, slot_key_in};
use super::*;
use crate::splitmix::SeededRng;
use crate::store::conformance::{attempt, charged, claimed, done, snapshot, Backend, LEASE, TTL};
use crate::store::fake::{FakeSharedData, Interleave};
use crate::store::record::{SlotValue, Snapshot};
use crate::store::RecordStore;

struct Local {
    data: FakeSharedData,
    capacity: u32,
}

fn open<S: SharedData>(data: S, capacity: u32, seed: u8) -> LocalStore<S> {
    LocalStore::open(data, capacity, [seed; 32], 0).unwrap()
}

impl Backend for Local {
    fn with_capacity(capacity: u32) -> Self {
        let local = Local { data: FakeSharedData::new(), capacity };
        open(&local.data, capacity, 1);
        local
    }
    fn worker(&self, n: u8) -> Box<dyn RecordStore + '_> {
        // Each worker brings its own fresh secret; the first one installed is shared.
        Box::new(open(&self.data, self.capacity, n.wrapping_add(2)))
    }
}

fn only_bucket(data: &FakeSharedData) -> Vec<Entry> {
    format::decode_bucket(data.get("idem:v3:8:b:0").unwrap().bytes(), ENTRIES_PER_BUCKET).unwrap()
}

#[test]
fn below_ninety_percent_of_capacity_almost_no_new_key_is_refused() {
    // Issue 11: with one bucket of 8 per key, about 10% of new keys were refused at 90% fill
    // (Poisson(7.2) >= 8). Fill to 90% with random keys, then churn at 90% (a random record
    // goes, a new key comes) as many times as the store holds records.
    const CAPACITY: u32 = 4_000;
    let b = Local::with_capacity(CAPACITY);
    let workers = [b.worker(0), b.worker(1)];
    let mut rng = SeededRng(11);
    let mut live: Vec<Claim> = Vec::new();
    let (mut tried, mut refused) = (0u32, 0u32);
    let target = (CAPACITY as usize) * 9 / 10;
    let attempt_one = |live: &mut Vec<Claim>, rng: &mut SeededRng, tried: &mut u32, refused: &mut u32| {
        *tried += 1;
        let w = &workers[rng.below(2)];
        match w.begin(&attempt(rng.next_u64(), 1, u64::from(*tried), 0)).unwrap() {
            Begin::Claimed(c) => live.push(c),
            Begin::Full { .. } => *refused += 1,
            other => panic!("{other:?}"),
        }
    };
    while live.len() < target && tried < 2 * CAPACITY {
        attempt_one(&mut live, &mut rng, &mut tried, &mut refused);
    }
    assert_eq!(live.len(), target, "{refused} of {tried} refused while filling");
    for _ in 0..CAPACITY {
        let gone = live.swap_remove(rng.below(live.len()));
        assert_eq!(workers[rng.below(2)].release(&gone).unwrap(), Settled::Done);
        attempt_one(&mut live, &mut rng, &mut tried, &mut refused);
    }
    assert!(
        u64::from(refused) * 1_000 < u64::from(tried),
        "{refused} of {tried} new keys refused at or below 90% of capacity"
    );
}

#[test]
fn records_expired_but_not_yet_swept_do_not_refuse_new_keys() {
    // A short ttl at a high rate: live records are half the capacity, but the sweep (one shard
    // of 64 buckets a second) takes 30 s per pass, nearly forty ttls, so most records in the
    // store have expired and still count in their shard's fill. Found by the bench's memory
    // phase (ttl 5 s, 4,300 new keys/s: 0.3% refused at 21% live). The claims of such a shard
    // find their own two buckets swept clean and only live, so only reclaiming elsewhere in the
    // shard makes room. Reclaiming in 4 buckets at most refused 11 of these 200,000 new keys
    // (and 1 in 17,000 in the e2e churn test on CI): no honest key may be refused here.
    let capacity: u32 = 10_000; // 1,875 buckets, 30 fill shards: a sweep pass takes 30 s
    let ttl_ms: u64 = 800;
    const STEP_US: u64 = 167; // 6,000 new keys a second: 4,800 live, 48% of capacity
    let b = Local::with_capacity(capacity);
    let w = b.worker(0);
    let mut rng = SeededRng(5);
    let (mut refused, mut next_sweep_ms) = (0u64, 1_000u64);
    // 33 s: the store saturates with ended records after 2 s.
    for n in 0..200_000u64 {
        let now_ms = n * STEP_US / 1_000;
        if now_ms >= next_sweep_ms {
            w.sweep(now_ms).unwrap();
            next_sweep_ms += 1_000;
        }
        // As the bench: one caller, quotas as large as the store, lease as long as the ttl.
        let a = ClaimAttempt {
            ttl_ms,
            lease_ms: ttl_ms,
            ..charged(rng.next_u64(), n + 1, now_ms, 0, Some(0), (capacity, capacity))
        };
        match w.begin(&a).unwrap() {
            Begin::Claimed(c) => {
                let c2 = Completion { ttl_ms, ..done("r", now_ms) };
                assert_eq!(w.complete(&c, &c2).unwrap(), Settled::Done);
            }
            Begin::Full { .. } => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(refused, 0, "new keys refused at 48% of capacity live");
}

#[test]
fn a_shard_full_of_live_records_is_not_searched_again_by_every_claim() {
    // Reclaiming sweeps every bucket of a shard whose count says full; when they all hold live
    // records, the next claims in that shard within RECLAIM_PAUSE_MS are refused without that
    // pass, or a full store would cost 63 bucket reads per refused key.
    const CAPACITY: u32 = 2_000; // 375 buckets, 6 shards
    let b = Local::with_capacity(CAPACITY);
    let w = b.worker(0);
    let mut rng = SeededRng(7);
    let mut live = 0;
    for t in 0..u64::from(CAPACITY) * 11 / 10 {
        // Completed, so they outlive the pause below (a claim's lease would end within it).
        if let Begin::Claimed(c) = w.begin(&attempt(rng.next_u64(), 1, t, 0)).unwrap() {
            assert_eq!(w.complete(&c, &done("r", 0)).unwrap(), Settled::Done);
            live += 1;
        }
    }
    assert_eq!(live, CAPACITY);
    let mut refused_cost = |now_ms: u64, keys: u64| {
        let before = b.data.io().gets;
        for _ in 0..keys {
            let r = w.begin(&attempt(rng.next_u64(), 1, 3_000_000, now_ms)).unwrap();
            assert!(matches!(r, Begin::Full { .. }), "{r:?}");
        }
        (b.data.io().gets - before) / keys
    };
    // The first refusals pay for a pass over their shard (6 shards, 1,000 keys).
    let paused = refused_cost(1, 1_000);
    assert!(paused < 8, "{paused} reads per refused key while paused");
    // Once the pause ends, a claim looks again: every shard's first refusal pays for a pass.
    let looked_again = refused_cost(1 + placement::RECLAIM_PAUSE_MS, 6);
    assert!(looked_again > 30, "{looked_again} reads per refused key after the pause");
}

#[test]
fn at_capacity_new_keys_are_refused_and_no_live_record_is_dropped() {
    // The store fills to exactly its capacity (not a bucket's worth less, not more: positions
    // are overprovisioned, live records are not), then only refuses.
    const CAPACITY: u32 = 2_000;
    let b = Local::with_capacity(CAPACITY);
    let w = b.worker(0);
    let mut rng = SeededRng(7);
    let mut live = Vec::new();
    let mut tried = 0u64;
    while live.len() < CAPACITY as usize && tried < u64::from(CAPACITY) * 11 / 10 {
        tried += 1;
        let n = rng.next_u64();
        match w.begin(&attempt(n, 1, tried, 0)).unwrap() {
            Begin::Claimed(c) => {
                // Half completed, half still processing: both are live.
                if live.len() % 2 == 0 {
                    assert_eq!(w.complete(&c, &done(&format!("r{n}"), 0)).unwrap(), Settled::Done);
                }
                live.push(n);
            }
            Begin::Full { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(live.len(), CAPACITY as usize, "filled to {} in {tried} attempts", live.len());
    for k in 0..1_000u64 {
        let r = w.begin(&attempt(rng.next_u64(), 1, 1_000_000 + k, 1)).unwrap();
        assert!(matches!(r, Begin::Full { retry_after_ms } if retry_after_ms >= 1), "{k}: {r:?}");
    }
    for (i, n) in live.iter().enumerate() {
        let r = w.begin(&attempt(*n, 1, 2_000_000 + i as u64, 2)).unwrap();
        if i % 2 == 0 {
            assert_eq!(r, Begin::Replay(snapshot(&format!("r{n}"))), "{i}");
        } else {
            assert!(matches!(r, Begin::InFlight { .. }), "{i}: {r:?}");
        }
    }
}

/// Fills a store of capacity 8 with 7 completed records and one claim left open (abandoned),
/// all at time 0, with `on_lease_end`; returns the abandoned claim's scope number.
fn fill_with_one_abandoned<S: SharedData>(w: &LocalStore<S>, on_lease_end: OnLeaseEnd) -> u64 {
    let (mut abandoned, mut live, mut n) = (None, 0, 0);
    while live < 8 {
        n += 1;
        assert!(n < 10_000, "the store never filled");
        match w.begin(&ClaimAttempt { on_lease_end, ..attempt(n, 1, n, 0) }).unwrap() {
            Begin::Claimed(_) if abandoned.is_none() => abandoned = Some(n),
            Begin::Claimed(c) => {
                assert_eq!(w.complete(&c, &done(&format!("r{n}"), 0)).unwrap(), Settled::Done)
            }
            Begin::Full { .. } => continue,
            other => panic!("{other:?}"),
        }
        live += 1;
    }
    abandoned.unwrap()
}

/// While a rule refuses lease ends, a full store keeps an abandoned claim until its ttl rather
/// than give its place to a new record: evicted, its retry would find no record and execute
/// again. Its retry gets the unknown outcome instead.
#[test]
fn an_abandoned_claim_is_not_evicted_while_lease_ends_are_refused() {
    let refusing = |n: u64, owner: u64, now: u64| ClaimAttempt {
        on_lease_end: OnLeaseEnd::MarkUnknown,
        ..attempt(n, 1, owner, now)
    };
    let data = FakeSharedData::new();
    let w = open(&data, 8, 1).keeping_abandoned_claims(true);
    let abandoned = fill_with_one_abandoned(&w, OnLeaseEnd::MarkUnknown);
    // After the abandoned claim's lease, a new key is refused for room: nothing is evicted.
    assert!(matches!(w.begin(&refusing(20_000, 90_001, LEASE)).unwrap(), Begin::Full { .. }));
    // The abandoned claim's retry gets the unknown outcome, and keeps getting it.
    assert_eq!(w.begin(&refusing(abandoned, 90_002, LEASE + 1)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(w.begin(&attempt(abandoned, 1, 90_003, LEASE + 2)).unwrap(), Begin::OutcomeUnknown);
    // Without refusing rules, the same full store gives the abandoned claim's place away.
    let data = FakeSharedData::new();
    let w = open(&data, 8, 1);
    fill_with_one_abandoned(&w, OnLeaseEnd::TakeOver);
    assert!(matches!(w.begin(&attempt(20_000, 1, 90_001, LEASE - 1)).unwrap(), Begin::Full { .. }));
    assert!(matches!(w.begin(&attempt(20_000, 1, 90_001, LEASE)).unwrap(), Begin::Claimed(_)));
}

#[test]
fn key_space_is_fixed_whatever_keys_clients_send() {
    let b = Local::with_capacity(64);
    let w = b.worker(0);
    let keys_after_setup = b.data.key_count();
    // 1.5 positions per record: 12 buckets, 96 slots, 12 quota keys, one fill shard, sweep
    // cursor, ready marker; secret and registry.
    assert_eq!(keys_after_setup, 12 + 12 * 8 + 12 + 1 + 2 + 2);
    let mut now = 0;
    for n in 0..5_000u64 {
        now += 7;
        let a = ClaimAttempt {
            ttl_ms: 50,
            ..charged(n, n + 1, now, (n % 251) as u8, Some((n % 7) as u8), (3, 2))
        };
        match w.begin(&a).unwrap() {
            Begin::Claimed(c) => {
                w.complete(&c, &Completion { ttl_ms: 50, ..done("x", now) }).unwrap();
            }
            Begin::Full { .. } | Begin::QuotaExceeded { .. } => {}
            other => panic!("{other:?}"),
        }
        w.sweep(now).unwrap();
    }
    assert_eq!(b.data.key_count(), keys_after_setup, "Envoy never frees a data_key: none may be added");
}

#[test]
fn setup_keeps_records_that_survived_a_reload() {
    let b = Local::with_capacity(64);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    w.complete(&c, &done("kept", 1)).unwrap();
    // A reloaded VM (FAIL_RELOAD, config update) configures again against the same data,
    // with a fresh secret of its own: the installed one stays, so placement does too.
    let reloaded = LocalStore::open(&b.data, 64, [0xee; 32], 2).unwrap();
    assert_eq!(reloaded.keys_created(), 0);
    assert_eq!(reloaded.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::Replay(snapshot("kept")));
}

#[test]
fn claims_fail_closed_when_the_layout_was_never_created() {
    let data = FakeSharedData::new();
    let store = LocalStore::unopened(&data, 64);
    assert!(matches!(store.begin(&attempt(1, 1, 1, 0)), Err(StoreError::Unavailable(_))));
    assert_eq!(data.key_count(), 0, "a claim must never create a data_key: creation ignores CAS");
}

#[test]
fn cas_conflicts_are_retried_then_reported() {
    let b = Local::with_capacity(64);
    let w = b.worker(0);
    b.data.force_cas_mismatches(3);
    assert!(matches!(w.begin(&attempt(1, 1, 1, 0)).unwrap(), Begin::Claimed(_)));
    b.data.force_cas_mismatches(1000);
    assert_eq!(w.begin(&attempt(2, 1, 2, 0)), Err(StoreError::Contention));
}

/// A bucket a newer build wrote (a rollback) is said to be one, with the data key, and left alone.
#[test]
fn a_newer_builds_bucket_is_said_to_be_one() {
    let b = Local::with_capacity(8);
    let store = open(&b.data, 8, 3);
    let data_key = store.bucket_key(0);
    b.data.poke(&data_key, b"\x06\x01newer");
    let Err(StoreError::Corrupt(said)) = store.begin(&attempt(1, 1, 1, 0)) else { panic!("refused") };
    assert_eq!(
        said,
        format!(
            "{data_key}: format version 6, written by a newer build of the filter (this one reads versions up \
             to 5); left as it is"
        )
    );
    assert_eq!(b.data.get(&data_key).unwrap().bytes(), b"\x06\x01newer");
}

#[test]
fn unreadable_bucket_is_reported_and_left_alone() {
    let b = Local::with_capacity(8);
    let store = open(&b.data, 8, 3);
    let data_key = store.bucket_key(0);
    b.data.poke(&data_key, b"\x09garbage");
    assert!(matches!(store.begin(&attempt(1, 1, 1, 0)), Err(StoreError::Corrupt(_))));
    assert_eq!(b.data.get(&data_key).unwrap().bytes(), b"\x09garbage");
}

#[test]
fn a_completion_survives_a_bucket_that_loses_every_write() {
    // Item 3: today's store gave up after 16 lost bucket CASes (Contention) and the answer
    // was lost. The slot is the commit point now; the bucket only catches up.
    let b = Local::with_capacity(64);
    let (w0, w1) = (b.worker(0), b.worker(1));
    let c = claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    b.data.force_cas_mismatches_on(":b:", 1000);
    assert_eq!(w0.complete(&c, &done("kept", 10)).unwrap(), Settled::Done);
    // Readers see the outcome even while the bucket still says processing, and even after
    // the lease: never in flight, never taken over.
    assert_eq!(w1.begin(&attempt(1, 1, 12, 20)).unwrap(), Begin::Replay(snapshot("kept")));
    assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE * 2)).unwrap(), Begin::Replay(snapshot("kept")));
    assert_eq!(w0.release(&c).unwrap(), Settled::Lost, "an outcome is final");
    b.data.force_cas_mismatches(0);
    assert_eq!(w1.begin(&attempt(1, 1, 14, LEASE * 3)).unwrap(), Begin::Replay(snapshot("kept")));
    assert_eq!(w0.complete(&c, &done("again", LEASE * 3)).unwrap(), Settled::Lost);
}

#[test]
fn a_cut_response_is_never_executed_again_even_when_the_bucket_is_busy() {
    let b = Local::with_capacity(64);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    b.data.force_cas_mismatches_on(":b:", 1000);
    let cut = Completion { state: State::Succeeded, status: 201, snapshot: None, now_ms: 5, ttl_ms: TTL };
    assert_eq!(w.complete(&c, &cut).unwrap(), Settled::Done);
    assert_eq!(w.begin(&attempt(1, 1, 12, LEASE + 1)).unwrap(), Begin::NotStored { status: 201 });
}

#[test]
fn an_outcome_whose_promotion_was_lost_is_never_evicted() {
    let b = Local::with_capacity(8);
    let w = b.worker(0);
    let mut claims = Vec::new();
    for n in 1..=8 {
        claims.push(claimed(w.begin(&attempt(n, 1, n, 0)).unwrap()));
    }
    b.data.force_cas_mismatches_on(":b:", 1000);
    assert_eq!(w.complete(&claims[0], &done("one", 1)).unwrap(), Settled::Done);
    b.data.force_cas_mismatches(0);
    assert_eq!(only_bucket(&b.data).iter().filter(|e| e.is_completed()).count(), 0, "promotion lost");
    // Past every lease: seven abandoned claims give their place, the completed one does not.
    for k in 0..7 {
        assert!(matches!(w.begin(&attempt(100 + k, 1, 100 + k, LEASE)).unwrap(), Begin::Claimed(_)));
    }
    assert!(matches!(w.begin(&attempt(200, 1, 200, LEASE)).unwrap(), Begin::Full { .. }));
    assert_eq!(w.begin(&attempt(1, 1, 201, LEASE)).unwrap(), Begin::Replay(snapshot("one")));
}

#[test]
fn an_unclaimed_slot_write_is_refused_after_a_takeover() {
    // Worker 0 owns the record and is completing; exactly between its slot read and its
    // slot write, its lease expires, worker 1 takes over AND completes. Worker 0's write
    // must fail (CAS) and its completion report Lost; worker 1's snapshot survives.
    let data = FakeSharedData::new();
    let w1 = open(&data, 8, 1);
    let old = claimed(open(&data, 8, 2).begin(&attempt(1, 1, 11, 0)).unwrap());
    let racing = Interleave::new(&data, ":s:", 2, || {
        let new = claimed(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap());
        assert_eq!(w1.complete(&new, &done("new", LEASE + 1)).unwrap(), Settled::Done);
    });
    let w0 = open(&racing, 8, 3);
    // 1st slot op: the read; the other worker runs before the 2nd (the write).
    let result = w0.complete(&old, &done("old", LEASE + 2)).unwrap();
    assert_eq!(result, Settled::Lost);
    assert_eq!(w1.begin(&attempt(1, 1, 13, LEASE + 3)).unwrap(), Begin::Replay(snapshot("new")));
}

#[test]
fn a_takeover_between_ownership_check_and_commit_wins() {
    // The takeover's fence (a slot write after its bucket write) fails the old owner's
    // commit, which then sees the record is no longer its own.
    let data = FakeSharedData::new();
    let w1 = open(&data, 8, 1);
    let old = claimed(open(&data, 8, 2).begin(&attempt(1, 1, 11, 0)).unwrap());
    let racing = Interleave::new(&data, ":s:", 2, || {
        claimed(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap());
    });
    let w0 = open(&racing, 8, 3);
    assert_eq!(w0.complete(&old, &done("old", LEASE + 2)).unwrap(), Settled::Lost);
    assert_eq!(
        w1.begin(&attempt(1, 1, 13, LEASE + 3)).unwrap(),
        Begin::InFlight { retry_after_ms: LEASE - 3 }
    );
}

#[test]
fn a_takeover_after_the_commit_replays_instead() {
    // The old owner committed; before it promotes the bucket entry, a retry arrives after
    // the lease. It must see the outcome in the slot: a replay, not a second execution.
    let data = FakeSharedData::new();
    let w1 = open(&data, 8, 1);
    let old = claimed(open(&data, 8, 2).begin(&attempt(1, 1, 11, 0)).unwrap());
    let seen = std::cell::RefCell::new(None);
    // Bucket ops of complete: the ownership read, then the promotion read.
    let racing = Interleave::new(&data, ":b:", 2, || {
        *seen.borrow_mut() = Some(w1.begin(&attempt(1, 1, 12, LEASE + 1)).unwrap());
    });
    let w0 = open(&racing, 8, 3);
    assert_eq!(w0.complete(&old, &done("old", LEASE)).unwrap(), Settled::Done);
    assert_eq!(seen.borrow_mut().take(), Some(Begin::Replay(snapshot("old"))));
}

#[test]
fn an_outcome_committed_before_the_takeover_fence_wins() {
    // The old owner checked ownership before the takeover's bucket write and committed
    // right after it, before the fence: the fence fails, the taker puts the completed
    // record back and answers with its replay.
    let data = FakeSharedData::new();
    let w0 = open(&data, 8, 1);
    claimed(w0.begin(&attempt(1, 1, 11, 0)).unwrap());
    let entry = only_bucket(&data)[0];
    let slot_key = w0.slot_key(0, entry.position);
    let outcome = SlotValue {
        entry: Entry { state: State::Succeeded, status: 201, expires_at_ms: LEASE + TTL, ..entry },
        snapshot: Some(snapshot("old")),
        label: None,
    };
    // Slot ops of a takeover: the read (resolve), the slot pre-read... then the fence.
    let racing = Interleave::new(&data, ":s:", 2, || {
        let r = data.get(&slot_key).unwrap();
        data.set(&slot_key, &record::encode_slot(&outcome), r.cas).unwrap();
    });
    let w1 = open(&racing, 8, 2);
    assert_eq!(w1.begin(&attempt(1, 1, 12, LEASE)).unwrap(), Begin::Replay(snapshot("old")));
    let restored = only_bucket(&data)[0];
    assert_eq!((restored.owner, restored.state), (11, State::Succeeded));
}

#[test]
fn a_key_claimed_in_both_of_its_buckets_at_once_is_claimed_once() {
    // Worker 0 sees the primary busier and places the new key in its secondary; before its
    // write, the primary empties and worker 1 places the same key there. Without the
    // confirmation both would own the key and the request would execute twice.
    let data = FakeSharedData::new();
    let w1 = open(&data, 64, 1);
    let n = (0..1_000).find(|n| {
        let (p, s) = w1.buckets_of(&crate::store::conformance::scope(*n));
        p != s
    });
    let n = n.unwrap();
    let (primary, secondary) = w1.buckets_of(&crate::store::conformance::scope(n));
    let other = Entry {
        position: 0,
        state: State::Processing,
        flags: 0,
        status: 0,
        scope: crate::store::conformance::scope(u64::MAX),
        fingerprint: crate::identity::fingerprint::Fingerprint([9; 32]),
        owner: 77,
        lease_deadline_ms: LEASE,
        expires_at_ms: TTL,
        charged_at_ms: 0,
        tenant_tag: 0,
        principal_tag: 0,
    };
    let primary_key = w1.bucket_key(primary);
    data.poke(&primary_key, &format::encode_bucket(&[other]));
    let seen = std::cell::RefCell::new(None);
    // Bucket ops of worker 0's claim: primary read, secondary read, then its write.
    let racing = Interleave::new(&data, ":b:", 3, || {
        data.poke(&primary_key, &[]);
        *seen.borrow_mut() = Some(w1.begin(&attempt(n, 1, 12, 0)).unwrap());
    });
    let w0 = open(&racing, 64, 2);
    let first = w0.begin(&attempt(n, 1, 11, 0)).unwrap();
    let second = seen.borrow_mut().take().unwrap();
    let claims = [&first, &second].iter().filter(|b| matches!(b, Begin::Claimed(_))).count();
    assert_eq!(claims, 1, "{first:?} {second:?}");
    assert!(matches!(first, Begin::InFlight { .. }), "{first:?}");
    // The withdrawn entry is gone and the fill count holds the one record.
    let left = format::decode_bucket(data.get(&w1.bucket_key(secondary)).unwrap().bytes(), 8).unwrap();
    assert!(left.iter().all(|e| e.scope != crate::store::conformance::scope(n)));
    assert_eq!(format::decode_fill(data.get(&w1.fill_key(0)).unwrap().bytes()), Ok(1));
}

#[test]
fn a_fill_count_that_lost_its_discharges_is_recounted_by_the_sweep() {
    // Crashes between bucket writes and discharges left the count at the bound while the
    // buckets hold one record: new keys are refused until the sweep recounts the shard.
    let b = Local::with_capacity(64);
    let w = b.worker(0);
    claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    let fill = w_fill_key(&b);
    b.data.poke(&fill, &format::encode_fill(64));
    assert!(matches!(w.begin(&attempt(2, 1, 12, 1)).unwrap(), Begin::Full { .. }));
    w.sweep(2).unwrap();
    assert_eq!(format::decode_fill(b.data.get(&fill).unwrap().bytes()), Ok(1));
    claimed(w.begin(&attempt(2, 1, 13, 3)).unwrap());
}

fn w_fill_key(b: &Local) -> String {
    fill_key_in(&prefix_of(b.capacity), 0).to_string()
}

#[test]
fn placement_is_keyed_by_the_shared_secret() {
    let (d1, d2) = (FakeSharedData::new(), FakeSharedData::new());
    let (a, b) = (open(&d1, 8 * 64, 1), open(&d2, 8 * 64, 2));
    let differ = (0..64)
        .filter(|n| {
            a.bucket_of(&crate::store::conformance::scope(*n))
                != b.bucket_of(&crate::store::conformance::scope(*n))
        })
        .count();
    assert!(differ > 32, "placement must depend on the secret ({differ} of 64 differ)");
    let public = (0..64)
        .filter(|n| {
            let s = crate::store::conformance::scope(*n);
            u64::from(a.bucket_of(&s)) == s.placement() % 64
        })
        .count();
    assert!(public < 16, "placement must not be the public function of the scope ({public})");
    // Every worker shares the first secret installed, whatever fresh secret it brought.
    let c = open(&d1, 8 * 64, 9);
    assert_eq!(c.secret, a.secret);
    assert_eq!(a.secret, [1; 32]);
}

#[test]
fn a_secret_installed_by_a_racing_worker_is_the_one_used() {
    let data = FakeSharedData::new();
    let first = LocalStore::unopened(&data, 8);
    first.create_keys(true).unwrap();
    // Another worker installs its secret between our read and our CAS.
    let racing = Interleave::new(&data, "secret", 2, || {
        let r = data.get(SECRET_KEY).unwrap();
        data.set(SECRET_KEY, &[5; 32], r.cas).unwrap();
    });
    let late = LocalStore::open(&racing, 8, [6; 32], 0).unwrap();
    assert_eq!(late.secret, [5; 32]);
}

#[test]
fn eviction_empties_the_snapshot_slots_it_frees() {
    let b = Local::with_capacity(8);
    let w = b.worker(0);
    let big = Snapshot { status: 201, headers: vec![], body: vec![b'x'; 10_000] };
    for n in 1..=8 {
        let c = claimed(w.begin(&attempt(n, 1, n, 0)).unwrap());
        let completion = Completion { snapshot: Some(big.clone()), ..done("x", 0) };
        w.complete(&c, &completion).unwrap();
    }
    assert!(b.data.value_bytes() > 80_000);
    // Expired records are not dropped by a completion any more, only where room is needed.
    for n in 100..108 {
        assert!(matches!(w.begin(&attempt(n, 1, n, TTL)).unwrap(), Begin::Claimed(_)));
    }
    // What stays: the new claims' entries and the labels they left in their slots.
    assert!(b.data.value_bytes() < 3_000, "{}", b.data.value_bytes());
}

#[test]
fn sweep_frees_the_snapshot_memory_of_expired_records() {
    let b = Local::with_capacity(8);
    let w = b.worker(0);
    let c = claimed(w.begin(&attempt(1, 1, 1, 0)).unwrap());
    w.complete(&c, &done("big", 0)).unwrap();
    let before = b.data.value_bytes();
    let swept = w.sweep(TTL).unwrap();
    assert_eq!(swept, 1);
    // What stays: the cursor, the ready marker, the secret and the layout registry.
    let after = b.data.value_bytes();
    assert!(after <= 4 + 1 + 32 + 2 + 16, "{before} -> {after}");
}

#[test]
fn workers_share_sweeping_through_the_cursor() {
    let b = Local::with_capacity(8 * 200);
    let (w0, w1) = (b.worker(0), b.worker(1));
    for n in 0..100 {
        let c = claimed(w0.begin(&attempt(n, 1, n + 1, 0)).unwrap());
        w0.complete(&c, &done("x", 0)).unwrap();
    }
    let mut swept = 0;
    for _ in 0..4 {
        swept += w0.sweep(TTL).unwrap();
        swept += w1.sweep(TTL).unwrap();
    }
    assert_eq!(swept, 100, "200 buckets, 64 per call, 8 calls cover all exactly once or more");
}

#[test]
fn a_lost_discharge_heals_when_its_records_cannot_be_live() {
    let b = Local::with_capacity(8);
    let w = b.worker(0);
    claimed(w.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
    // A crash between the bucket write and the discharge: the record is gone, the count
    // stays.
    b.data.poke("idem:v3:8:b:0", &[]);
    assert!(matches!(w.begin(&charged(2, 12, 1, 1, None, (10, 1))).unwrap(), Begin::QuotaExceeded { .. }));
    assert!(matches!(
        w.begin(&charged(2, 13, TTL + LEASE - 1, 1, None, (10, 1))).unwrap(),
        Begin::QuotaExceeded { .. }
    ));
    claimed(w.begin(&charged(2, 14, TTL + LEASE, 1, None, (10, 1))).unwrap());
}

#[test]
fn a_stale_discharge_does_not_eat_into_a_new_epoch() {
    let b = Local::with_capacity(64);
    let w = b.worker(0);
    // Charged at 0, abandoned, never swept: the counter heals at TTL + LEASE.
    claimed(w.begin(&charged(1, 11, 0, 1, None, (10, 1))).unwrap());
    let t = TTL + LEASE;
    claimed(w.begin(&charged(2, 12, t, 1, None, (10, 1))).unwrap());
    // Now the old record is swept: its discharge belongs to the old epoch and is ignored.
    for _ in 0..8 {
        w.sweep(t).unwrap();
    }
    assert!(matches!(
        w.begin(&charged(3, 13, t + 1, 1, None, (10, 1))).unwrap(),
        Begin::QuotaExceeded { .. }
    ));
}

#[test]
fn a_quota_key_without_room_answers_full() {
    let b = Local::with_capacity(8);
    let w = b.worker(0);
    let foreign: Vec<QuotaCounter> = (0..u64::from(COUNTERS_PER_QUOTA_KEY))
        .map(|tag| QuotaCounter {
            tag: tag + 1_000,
            count: 1,
            since_ms: 0,
            soonest_ms: TTL,
            until_ms: TTL + LEASE,
        })
        .collect();
    b.data.poke("idem:v3:8:q:0", &format::encode_counters(&foreign));
    let r = w.begin(&charged(1, 11, 0, 1, None, (10, 10))).unwrap();
    assert_eq!(r, Begin::Full { retry_after_ms: TTL + LEASE });
    // Unquoted attempts are not affected, and counters that read as 0 give their room.
    assert!(matches!(w.begin(&attempt(1, 1, 12, 1)).unwrap(), Begin::Claimed(_)));
    claimed(w.begin(&charged(2, 13, TTL + LEASE, 1, None, (10, 10))).unwrap());
}

#[test]
fn a_namespace_of_the_previous_placement_is_retired_too() {
    // A v2 store (one bucket per key, `idem:v2:<buckets>:`) left records behind before the
    // upgrade; its roots are gone. The v3 sweeps empty it and drop it from the registry.
    let data = FakeSharedData::new();
    let old = "idem:v2:2:";
    let mut keys = Vec::new();
    for b in 0..2 {
        keys.push(format!("{old}b:{b}"));
        keys.push(format!("{old}q:{b}"));
        for p in 0..ENTRIES_PER_BUCKET {
            keys.push(format!("{old}s:{b}:{p}"));
        }
    }
    keys.push(format!("{old}sweep"));
    keys.push(format!("{old}ready"));
    for k in &keys {
        data.poke(k, b"old bytes");
    }
    data.poke(LAYOUTS_KEY, &format::encode_layouts(&[Layout { buckets: 2, beat_ms: 0, cursor: 0 }]));
    let store = LocalStore::open(&data, 64, [1; 32], 0).unwrap();
    let mut now = 0;
    for _ in 0..(RETIRE_AFTER_MS / 1_000 + 4) {
        now += 1_000;
        store.sweep_shard(now).unwrap();
    }
    for k in &keys {
        assert_eq!(data.get(k).unwrap().value, None, "{k}");
    }
    let layouts = format::decode_layouts(data.get(LAYOUTS_KEY).unwrap().bytes()).unwrap();
    assert_eq!(layouts.iter().map(|l| l.buckets).collect::<Vec<_>>(), vec![store.layout_id()]);
}

#[test]
fn a_retired_namespace_is_emptied_while_a_live_one_is_left_alone() {
    let data = FakeSharedData::new();
    let a = LocalStore::open(&data, 64, [1; 32], 0).unwrap();
    for n in 0..40 {
        let long = ClaimAttempt { ttl_ms: 1 << 40, ..charged(n, n + 1, 0, 1, Some(2), (100, 100)) };
        if let Begin::Claimed(c) = a.begin(&long).unwrap() {
            a.complete(&c, &Completion { ttl_ms: 1 << 40, ..done("a", 0) }).unwrap();
        }
    }
    let a_bytes = data.value_bytes();
    // A new config with another capacity; the old roots still run for a while.
    let b = LocalStore::open(&data, 8 * 100, [2; 32], 1_000).unwrap();
    let mut now = 1_000;
    for _ in 0..60 {
        now += 1_000;
        a.sweep_shard(now).unwrap();
        b.sweep_shard(now).unwrap();
    }
    assert!(data.value_bytes() >= a_bytes, "a beating namespace is never touched");
    assert_eq!(a.begin(&attempt(0, 1, 99, now)).unwrap(), Begin::Replay(snapshot("a")));
    // The old roots are gone: after RETIRE_AFTER_MS, B's sweeps empty A progressively.
    let keys = data.key_count();
    for _ in 0..(RETIRE_AFTER_MS / 1_000 + 8) {
        now += 1_000;
        b.sweep_shard(now).unwrap();
    }
    let prefix = prefix_of(64);
    assert_eq!(data.get(&fill_key_in(&prefix, 0)).unwrap().value, None);
    for bucket in 0..a.buckets() {
        assert_eq!(data.get(&bucket_key_in(&prefix, bucket)).unwrap().value, None);
        assert_eq!(data.get(&quota_key_in(&prefix, bucket)).unwrap().value, None);
        for p in 0..ENTRIES_PER_BUCKET {
            assert_eq!(data.get(&slot_key_in(&prefix, bucket, p)).unwrap().value, None);
        }
    }
    assert_eq!(data.key_count(), keys, "retiring empties values and creates nothing");
    let layouts = format::decode_layouts(data.get(LAYOUTS_KEY).unwrap().bytes()).unwrap();
    assert_eq!(layouts.iter().map(|l| l.buckets).collect::<Vec<_>>(), vec![b.layout_id()]);
    assert!(data.value_bytes() < 200, "{} bytes left", data.value_bytes());
}

fn keeping_tombstones(
    capacity: u32,
    room: u32,
    seed: u8,
    data: &FakeSharedData,
) -> LocalStore<&FakeSharedData> {
    LocalStore::open(data, capacity, [seed; 32], 0).unwrap().keeping_tombstones(room, 0).unwrap()
}

#[test]
fn a_store_full_of_tombstones_takes_every_new_key_and_the_oldest_tombstones_go_first() {
    use crate::store::conformance::{keeping, TOMBSTONE};
    // A room of 8 tombstones (one bucket): 20 keys complete one after the other, and each
    // leaves a tombstone; a ninth pushes out the oldest.
    let data = FakeSharedData::new();
    let w = keeping_tombstones(64, 8, 1, &data);
    for n in 0..20u64 {
        let c = claimed(w.begin(&keeping(n, 1, n + 1, n)).unwrap());
        assert_eq!(w.complete(&c, &done("x", n)).unwrap(), Settled::Done);
    }
    let after = 20 + TTL;
    assert!(after < TOMBSTONE);
    let standing: Vec<u64> = (0..20)
        .filter(|n| w.begin(&keeping(*n, 1, 100 + n, after)).unwrap() == Begin::Expired { status: 201 })
        .collect();
    // The newest eight stand; the oldest were pushed out, and their keys were new again (the
    // begins above claimed them).
    assert_eq!(standing, (12..20).collect::<Vec<_>>());
    // The room never took a record's: the store still takes new keys.
    assert!(matches!(w.begin(&keeping(1_000, 1, 1_000, after)).unwrap(), Begin::Claimed(_)));
}

#[test]
fn a_tombstone_room_survives_a_reload_and_an_unused_one_is_retired() {
    use crate::store::conformance::keeping;
    let data = FakeSharedData::new();
    let w = keeping_tombstones(64, 128, 1, &data);
    let c = claimed(w.begin(&keeping(1, 1, 11, 0)).unwrap());
    w.complete(&c, &done("one", 1)).unwrap();
    // A reload with the same room finds its tombstones (a second handle: another worker).
    let reloaded = keeping_tombstones(64, 128, 9, &data);
    assert_eq!(reloaded.begin(&keeping(1, 1, 12, 2 + TTL)).unwrap(), Begin::Expired { status: 201 });
    // A new room (`store.tombstones` changed): the old room, no longer beaten, is emptied.
    let old_keys: Vec<String> = (0..tombstones::buckets_for(128))
        .map(|b| tombstones::bucket_key_in(&tombstones::prefix_of(128), b).to_string())
        .collect();
    assert!(old_keys.iter().any(|k| data.get(k).unwrap().value.is_some_and(|v| !v.is_empty())));
    let changed = keeping_tombstones(64, 256, 9, &data);
    let mut now = 0;
    for _ in 0..(RETIRE_AFTER_MS / 1_000 + 20) {
        now += 1_000;
        changed.sweep_shard(now).unwrap();
    }
    for k in &old_keys {
        assert_eq!(data.get(k).unwrap().value, None, "{k}");
    }
    let rooms = format::decode_layouts(data.get(tombstones::LAYOUTS_KEY).unwrap().bytes()).unwrap();
    assert_eq!(rooms.iter().map(|l| l.buckets).collect::<Vec<_>>(), vec![256]);
    // The record registry never names a room.
    let layouts = format::decode_layouts(data.get(LAYOUTS_KEY).unwrap().bytes()).unwrap();
    assert_eq!(layouts.iter().map(|l| l.buckets).collect::<Vec<_>>(), vec![changed.layout_id()]);
}

#[test]
fn a_namespace_made_without_quotas_has_no_quota_keys_until_a_configuration_counts_them() {
    let data = FakeSharedData::new();
    let plain = LocalStore::open_for(&data, 800, [1; 32], 0, false).unwrap();
    let buckets = plain.buckets();
    // Every key but the quota keys, each set once (no read first: the namespace was new).
    let shards = buckets.div_ceil(layout::FILL_SHARD_BUCKETS);
    assert_eq!(plain.keys_created(), 2 + buckets * (1 + u32::from(ENTRIES_PER_BUCKET)) + shards + 1);
    assert!(!data.get(&quota_key_in(&plain.prefix, 0)).unwrap().exists());
    let c = claimed(plain.begin(&attempt(1, 1, 11, 0)).unwrap());
    plain.complete(&c, &done("kept", 1)).unwrap();
    // A configuration with quotas on the same namespace adds them, and keeps the records.
    let counted = LocalStore::open_for(&data, 800, [1; 32], 0, true).unwrap();
    assert_eq!(counted.keys_created(), buckets);
    assert!(data.get(&quota_key_in(&plain.prefix, buckets - 1)).unwrap().exists());
    assert_eq!(counted.begin(&attempt(1, 1, 12, 2)).unwrap(), Begin::Replay(snapshot("kept")));
    let quota = charged(2, 21, 2, 1, Some(1), (1, 1));
    assert!(matches!(counted.begin(&quota).unwrap(), Begin::Claimed(_)));
    assert!(matches!(
        counted.begin(&charged(3, 31, 2, 1, Some(1), (1, 1))).unwrap(),
        Begin::QuotaExceeded { .. }
    ));
    // Once whole, a namespace is never made again, with quotas or without.
    assert_eq!(LocalStore::open_for(&data, 800, [1; 32], 0, false).unwrap().keys_created(), 0);
    assert_eq!(LocalStore::open_for(&data, 800, [1; 32], 0, true).unwrap().keys_created(), 0);
}

/// Keys name records that outlive a module update (shared data stays across VM reloads), so
/// the fast key builder writes exactly what `format!` wrote before it.
#[test]
fn keys_are_spelled_as_format_spelled_them() {
    let prefix = prefix_of(100_000);
    for n in [0, 1, 9, 10, 99, 100, 4_095, 65_536, 999_999, 1_000_000, u32::MAX - 1, u32::MAX] {
        assert_eq!(bucket_key_in(&prefix, n), format!("{prefix}b:{n}"));
        assert_eq!(fill_key_in(&prefix, n), format!("{prefix}f:{n}"));
        assert_eq!(quota_key_in(&prefix, n), format!("{prefix}q:{n}"));
        for p in [0u8, 7, 9, 10, 255] {
            assert_eq!(slot_key_in(&prefix, n, p), format!("{prefix}s:{n}:{p}"));
        }
        let room = tombstones::prefix_of(128);
        assert_eq!(tombstones::bucket_key_in(&room, n), format!("{room}b:{n}"));
        // A name longer than the stack buffer is spelled the same, on the heap.
        for long in ["p".repeat(50), "p".repeat(63), "p".repeat(64), "p".repeat(200)] {
            assert_eq!(super::layout::key_in(&long, "s:", n, Some(255)), format!("{long}s:{n}:255"));
        }
    }
}
