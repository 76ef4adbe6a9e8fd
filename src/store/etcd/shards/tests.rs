use super::*;

fn scope(i: u64) -> ScopeId {
    // Spread as digests are.
    let mut s = [0u8; 32];
    for (n, chunk) in s.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&splitmix64(i * 4 + n as u64).to_le_bytes());
    }
    ScopeId(s)
}

fn seeds(clusters: &[&str]) -> Vec<u64> {
    clusters.iter().map(|c| seed(c)).collect()
}

#[test]
fn records_spread_evenly_over_the_shards() {
    let seeds = seeds(&["etcd-a", "etcd-b", "etcd-c"]);
    let mut per = [0usize; 3];
    for i in 0..30_000 {
        per[home(&seeds, &scope(i))] += 1;
    }
    for n in per {
        assert!((9_400..=10_600).contains(&n), "{per:?}");
    }
}

#[test]
fn a_shard_keeps_its_records_wherever_it_stands_in_the_list() {
    let abc = ["etcd-a", "etcd-b", "etcd-c"];
    let cab = ["etcd-c", "etcd-a", "etcd-b"];
    for i in 0..2_000 {
        let s = scope(i);
        assert_eq!(abc[home(&seeds(&abc), &s)], cab[home(&seeds(&cab), &s)]);
    }
}

#[test]
fn adding_a_shard_moves_only_the_records_it_wins() {
    let three = ["etcd-a", "etcd-b", "etcd-c"];
    let four = ["etcd-a", "etcd-b", "etcd-c", "etcd-d"];
    let (s3, s4) = (seeds(&three), seeds(&four));
    let mut moved = 0;
    for i in 0..20_000 {
        let s = scope(i);
        let (before, after) = (three[home(&s3, &s)], four[home(&s4, &s)]);
        if before != after {
            // Only ever to the new shard: nothing moves between the old ones.
            assert_eq!(after, "etcd-d");
            moved += 1;
        }
    }
    // About a quarter.
    assert!((4_600..=5_400).contains(&moved), "{moved}");
}

#[test]
fn one_shard_holds_everything() {
    let one = seeds(&["etcd"]);
    assert!((0..100).all(|i| home(&one, &scope(i)) == 0));
}

fn three_shards() -> EtcdShards {
    let shard = |cluster: &str| crate::config::etcd::EtcdShard {
        cluster: cluster.into(),
        authority: format!("{cluster}.example"),
        auth: None,
    };
    EtcdShards::new(&EtcdSettings {
        shards: vec![shard("etcd-a"), shard("etcd-b"), shard("etcd-c")],
        ..super::super::tests::settings(None)
    })
}

/// A claim attempt of `scope` (also the plan's tests').
pub(super) fn claim_attempt(scope: ScopeId) -> crate::store::ClaimAttempt {
    crate::store::ClaimAttempt {
        scope,
        fingerprint: crate::identity::fingerprint::Fingerprint([1; 32]),
        owner: 7,
        now_ms: 1_000,
        lease_ms: 1_000,
        ttl_ms: 60_000,
        quota: None,
        on_lease_end: crate::store::OnLeaseEnd::TakeOver,
        label: None,
        tombstone_ms: 0,
    }
}

fn attempt(scope: ScopeId) -> StoreOp {
    StoreOp::Begin(claim_attempt(scope))
}

fn first_call(started: Started) -> crate::store::remote::Request {
    match started {
        Started::Conversation(mut c) => match c.step(None, 1_000) {
            Next::Call(request) => request,
            other => panic!("{other:?}"),
        },
        Started::Answered(a) => panic!("answered at once: {a:?}"),
    }
}

#[test]
fn a_records_calls_go_to_its_home_shards_cluster_with_that_shards_authority() {
    let store = three_shards();
    let mut seen = [false; 3];
    for i in 0..30 {
        let s = scope(i);
        let request = first_call(store.start(attempt(s), &|| 1_000));
        let home = usize::from(store.home(&s));
        assert_eq!(request.shard, store.home(&s));
        let remote = store.remote_for(request.shard).expect("the shard is known");
        let cluster = ["etcd-a", "etcd-b", "etcd-c"][home];
        assert_eq!(
            (remote.cluster.as_str(), remote.authority.as_str()),
            (cluster, &*format!("{cluster}.example"))
        );
        seen[home] = true;
    }
    assert_eq!(seen, [true; 3]);
    assert!(store.remote_for(3).is_none());
}

fn look(cursor: Option<&str>, limit: usize) -> StoreOp {
    StoreOp::Records(RecordQuery {
        id: None,
        state: crate::store::StateFilter::All,
        route: None,
        key: None,
        tenant: None,
        host: None,
        limit,
        cursor: cursor.map(str::to_string),
        detail: false,
        now_ms: 1_000,
    })
}

/// Steps a look, answering every call with an empty page: the shards it asked, and its answer.
fn look_through_empty_shards(store: &EtcdShards, op: StoreOp) -> (Vec<u8>, StoreAnswer) {
    let empty = br#"{"header":{"revision":"5"},"succeeded":true,"responses":[{"response_range":{"header":{"revision":"5"}}}]}"#;
    let mut conversation = match store.start(op, &|| 1_000) {
        Started::Conversation(c) => c,
        Started::Answered(a) => return (Vec::new(), a),
    };
    let (mut asked, mut answer) = (Vec::new(), None);
    loop {
        match conversation.step(answer.take(), 1_000) {
            Next::Call(request) => {
                asked.push(request.shard);
                answer =
                    Some(Answer { status: Some(200), body: empty.to_vec(), grpc: None, from_envoy: false });
            }
            Next::Done(done) => return (asked, done),
            Next::Wait => panic!("nothing to wait for"),
        }
    }
}

#[test]
fn a_list_reads_every_shard_in_turn_and_its_cursor_resumes_on_the_shard_it_names() {
    let store = three_shards();
    let (asked, answer) = look_through_empty_shards(&store, look(None, 10));
    assert_eq!(asked, [0, 1, 2]);
    assert_eq!(answer, StoreAnswer::Records(Ok(RecordPage::default())));
    let (asked, _) = look_through_empty_shards(&store, look(Some("1s"), 10));
    assert_eq!(asked, [1, 2]);
    let (asked, _) = look_through_empty_shards(&store, look(Some(&format!("2s{}", "ab".repeat(32))), 10));
    assert_eq!(asked, [2]);
    // A cursor no list of this store gave names no shard: refused, nothing asked.
    for bad in ["3s", "s", "x", "1", "-1s", "99999999999999999999s"] {
        let (asked, answer) = look_through_empty_shards(&store, look(Some(bad), 10));
        assert!(asked.is_empty(), "{bad}");
        assert!(matches!(answer, StoreAnswer::Records(Err(StoreError::Corrupt(_)))), "{bad}: {answer:?}");
    }
}

#[test]
fn a_record_named_by_its_scope_is_looked_up_on_its_home_shard_only() {
    let store = three_shards();
    let s = scope(5);
    let op = StoreOp::Records(RecordQuery {
        id: Some(RecordId::Scope(s)),
        ..match look(None, 10) {
            StoreOp::Records(q) => q,
            _ => unreachable!(),
        }
    });
    let (asked, _) = look_through_empty_shards(&store, op);
    assert_eq!(asked, [store.home(&s)]);
}

#[test]
fn while_the_list_changes_a_begin_asks_its_records_old_home_first_and_a_record_that_stays_only_its_home() {
    let shard = |cluster: &str| crate::config::etcd::EtcdShard {
        cluster: cluster.into(),
        authority: "etcd".into(),
        auth: None,
    };
    let settings = EtcdSettings {
        shards: vec![shard("etcd-a"), shard("etcd-b"), shard("etcd-c")],
        previous_shards: vec![shard("etcd-a"), shard("etcd-b")],
        ..super::super::tests::settings(None)
    };
    let store = EtcdShards::new(&settings);
    let before = EtcdShards::new(&EtcdSettings {
        shards: settings.previous_shards.clone(),
        previous_shards: Vec::new(),
        ..settings.clone()
    });
    let (mut moving, mut staying) = (0, 0);
    for i in 0..60 {
        let s = scope(i);
        let request = first_call(store.start(attempt(s), &|| 1_000));
        // Both stores number etcd-a and etcd-b alike (the current list first).
        match store.old_home(&s) {
            Some(old) => {
                moving += 1;
                assert_eq!(old, before.home(&s));
                assert_eq!(store.home(&s), 2, "only to the new shard");
                assert_eq!(request.shard, old);
            }
            None => {
                staying += 1;
                assert_eq!(store.home(&s), before.home(&s));
                assert_eq!(request.shard, store.home(&s));
            }
        }
    }
    assert!(moving > 5 && staying > 20, "{moving} {staying}");
}
