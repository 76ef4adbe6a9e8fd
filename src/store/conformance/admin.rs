//! The contract's operator side (`StoreOp::Records` and `Amend`, the admin API), run
//! against every backend by `conformance_suite!` like the rest of the suite.

// A failing assertion is the suite's job; it never runs inside Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use crate::identity::scope::ScopeId;
use crate::store::record::{Snapshot, State};
use crate::store::{
    Amendment, Begin, ClaimAttempt, OnLeaseEnd, RecordId, RecordQuery, RecordStore, RecordView, Refusal,
    Settled, StateFilter,
};

fn query(now_ms: u64, state: StateFilter) -> RecordQuery {
    RecordQuery {
        id: None,
        state,
        route: None,
        key: None,
        tenant: None,
        host: None,
        limit: 100,
        cursor: None,
        detail: false,
        now_ms,
    }
}

fn listed(w: &dyn RecordStore, now_ms: u64, state: StateFilter) -> Vec<RecordView> {
    w.records(&query(now_ms, state)).unwrap().views
}

/// The one record of scope `n`, looked up by its scope id with its response, as an operator does.
pub fn only(w: &dyn RecordStore, n: u64, now_ms: u64) -> RecordView {
    let q =
        RecordQuery { id: Some(RecordId::Scope(scope(n))), detail: true, ..query(now_ms, StateFilter::All) };
    let mut found = w.records(&q).unwrap().views;
    assert_eq!(found.len(), 1, "{found:?}");
    found.remove(0)
}

fn refusing(n: u64, owner: u64, now_ms: u64) -> ClaimAttempt {
    ClaimAttempt { on_lease_end: OnLeaseEnd::MarkUnknown, ..attempt(n, 1, owner, now_ms) }
}

/// An operator lists records (by state, route and key, a page at a time) and looks one up by its
/// tag or scope: each with the route and key its claim recorded, and a lookup with its response.
pub fn records_are_listed_with_their_route_key_and_claim_time<B: Backend>() {
    let b = B::with_capacity(64);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    let c = claimed(w.begin(&attempt(1, 1, 11, 5)).unwrap());
    w.complete(&c, &done("one", 6)).unwrap();
    claimed(w.begin(&attempt(2, 1, 12, 7)).unwrap());
    // A claim whose lease ended, then a refuse retry: outcome unknown.
    claimed(w.begin(&attempt(3, 1, 13, 8)).unwrap());
    b.let_claim_leases_end();
    assert_eq!(w.begin(&refusing(3, 14, 8 + LEASE)).unwrap(), Begin::OutcomeUnknown);

    let now = 8 + LEASE;
    let mut seen: Vec<(String, String, bool, u16)> = listed(&admin, now, StateFilter::All)
        .iter()
        .map(|v| {
            let l = v.label.clone().unwrap();
            (l.route().to_string(), l.key().to_string(), v.entry.is_completed(), v.entry.status)
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("orders".into(), "key-1".into(), true, 201),
            ("orders".into(), "key-2".into(), false, 0),
            ("orders".into(), "key-3".into(), true, 0),
        ]
    );
    assert_eq!(only(&admin, 1, now).label.unwrap().created_at_ms, 5);
    assert_eq!(only(&admin, 2, now).label.unwrap().created_at_ms, 7);
    let unknown = listed(&admin, now, StateFilter::OutcomeUnknown);
    assert_eq!(unknown.iter().map(|v| v.scope).collect::<Vec<_>>(), vec![scope(3)]);
    assert_eq!(
        listed(&admin, now, StateFilter::Processing).iter().map(|v| v.scope).collect::<Vec<_>>(),
        vec![scope(2)]
    );
    assert_eq!(
        listed(&admin, now, StateFilter::Completed).iter().map(|v| v.scope).collect::<Vec<_>>(),
        vec![scope(1)]
    );
    // By key, and by route.
    let by_key = RecordQuery { key: Some("key-2".into()), ..query(now, StateFilter::All) };
    assert_eq!(
        admin.records(&by_key).unwrap().views.iter().map(|v| v.scope).collect::<Vec<_>>(),
        vec![scope(2)]
    );
    let other_route = RecordQuery { route: Some("refunds".into()), ..query(now, StateFilter::All) };
    assert!(admin.records(&other_route).unwrap().views.is_empty());
    // Found by tag as by scope, with the stored response.
    let tag =
        RecordQuery { id: RecordId::parse(&scope(1).log_tag()), detail: true, ..query(9, StateFilter::All) };
    let by_tag = admin.records(&tag).unwrap().views;
    assert_eq!(by_tag.len(), 1);
    assert_eq!(by_tag[0].snapshot, Some(snapshot("one")));
    assert_eq!(only(&admin, 1, 9).snapshot, Some(snapshot("one")));
    // Expired records are not there.
    assert!(listed(&admin, 6 + TTL, StateFilter::All).iter().all(|v| v.scope != scope(1)));
}

/// Two tenants that use one key own two records (two scopes): a list by the key shows both,
/// each naming its tenant, host, method, path and caller, so an operator settles the right
/// customer's; `tenant=` (and `host=`) narrow it to one.
pub fn two_tenants_records_of_one_key_are_listed_each_with_its_scope<B: Backend>() {
    let b = B::with_capacity(64);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    for (n, tenant) in [(1, "acme"), (2, "globex")] {
        let a =
            ClaimAttempt { label: Some(label_in(Some(tenant), "shared-key")), ..attempt(n, 1, n + 10, 5) };
        claimed(w.begin(&a).unwrap());
    }
    // And one without a tenant header (another filter configuration on the same store).
    let a = ClaimAttempt { label: Some(label_in(None, "shared-key")), ..attempt(3, 1, 13, 5) };
    claimed(w.begin(&a).unwrap());
    let by_key = RecordQuery { key: Some("shared-key".into()), ..query(6, StateFilter::All) };
    let mut seen: Vec<(Option<String>, [u8; 32])> = admin
        .records(&by_key)
        .unwrap()
        .views
        .iter()
        .map(|v| {
            let l = v.label.as_ref().unwrap();
            let scope = (l.host(), l.method(), l.path(), l.principal());
            assert_eq!(scope, (Some("api.example"), Some("POST"), Some("/orders"), Some([7; 4])), "{v:?}");
            (l.tenant().map(str::to_string), v.scope.0)
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![(None, scope(3).0), (Some("acme".into()), scope(1).0), (Some("globex".into()), scope(2).0)]
    );
    let one = |tenant: &str| {
        let q = RecordQuery { tenant: Some(tenant.into()), ..by_key.clone() };
        admin.records(&q).unwrap().views.iter().map(|v| v.scope).collect::<Vec<_>>()
    };
    assert_eq!(one("acme"), vec![scope(1)]);
    assert_eq!(one("globex"), vec![scope(2)]);
    assert!(one("initech").is_empty());
    let host = |host: &str| {
        let q = RecordQuery { host: Some(host.into()), ..by_key.clone() };
        admin.records(&q).unwrap().views.len()
    };
    assert_eq!((host("api.example"), host("other.example")), (3, 0));
}

/// A list of more records than its limit comes in pages: each page's cursor starts the next,
/// and the pages hold every record once.
pub fn a_long_list_comes_in_pages_that_hold_every_record_once<B: Backend>() {
    let b = B::with_capacity(256);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    for n in 0..40 {
        claimed(w.begin(&attempt(n, 1, n + 100, 1)).unwrap());
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    for _ in 0..10 {
        let q = RecordQuery { limit: 7, cursor: cursor.clone(), ..query(2, StateFilter::All) };
        let page = admin.records(&q).unwrap();
        assert!(page.views.len() <= 7);
        seen.extend(page.views.iter().map(|v| v.scope));
        cursor = page.next;
        if cursor.is_none() {
            break;
        }
    }
    assert!(cursor.is_none(), "still more after 10 pages");
    let mut want: Vec<[u8; 32]> = (0..40).map(|n| scope(n).0).collect();
    let mut seen: Vec<[u8; 32]> = seen.iter().map(|s: &ScopeId| s.0).collect();
    want.sort();
    seen.sort();
    assert_eq!(seen, want);
}

/// Release frees a key whose outcome is unknown or whose lease ended, so that its next request
/// executes; it refuses a live claim (its request may be executing) and a known outcome
/// without `force`.
pub fn release_frees_a_key_whose_outcome_is_unknown_or_whose_lease_ended<B: Backend>() {
    let b = B::with_capacity(64);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    let release = |force| Amendment::Release { force };
    let live = claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    claimed(w.begin(&attempt(2, 1, 21, 0)).unwrap());
    let v = only(&admin, 1, 1);
    assert_eq!(admin.amend(&v, &release(true), 1).unwrap(), Err(Refusal::Live { lease_ends_at_ms: LEASE }));
    // Its lease ended (on etcd, its lease key too, as a takeover waits for it): released; the
    // owner's late completion finds nothing, the next executes.
    b.let_claim_leases_end();
    assert_eq!(admin.amend(&only(&admin, 1, LEASE), &release(false), LEASE).unwrap(), Ok(()));
    assert_eq!(w.complete(&live, &done("late", LEASE + 1)).unwrap(), Settled::Lost);
    assert!(matches!(w.begin(&attempt(1, 1, 12, LEASE + 2)).unwrap(), Begin::Claimed(_)));
    // Outcome unknown once its lease ended: released without force.
    assert_eq!(w.begin(&refusing(2, 22, LEASE)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(admin.amend(&only(&admin, 2, LEASE), &release(false), LEASE).unwrap(), Ok(()));
    assert!(matches!(w.begin(&refusing(2, 23, LEASE + 1)).unwrap(), Begin::Claimed(_)));
    // A known outcome only with force.
    let c = claimed(w.begin(&attempt(3, 1, 31, 0)).unwrap());
    w.complete(&c, &done("three", 1)).unwrap();
    assert_eq!(admin.amend(&only(&admin, 3, 2), &release(false), 2).unwrap(), Err(Refusal::Completed));
    assert_eq!(w.begin(&attempt(3, 1, 32, 3)).unwrap(), Begin::Replay(snapshot("three")));
    assert_eq!(admin.amend(&only(&admin, 3, 4), &release(true), 4).unwrap(), Ok(()));
    // Asked by a worker that has not replayed it: a worker with a replay cache (etcd's
    // `store.replay_cache`) that holds the record keeps replaying it until it expires (C24).
    let fresh = through_ops(&b, 2);
    assert!(matches!(fresh.begin(&attempt(3, 1, 33, 5)).unwrap(), Begin::Claimed(_)));
    // A stale view of a record that changed since: refused, so the operator looks again.
    let stale = admin.amend(&v, &release(true), 2 * LEASE).unwrap();
    assert!(matches!(stale, Err(Refusal::Gone | Refusal::SettledMeanwhile)), "{stale:?}");
}

/// Resolve settles an unknown outcome or a lease-ended claim with the upstream's real answer,
/// which every retry then replays; a known outcome and a live claim are refused, and the
/// owner's completion after it is lost.
pub fn resolve_settles_an_unknown_outcome_and_every_retry_replays_it<B: Backend>() {
    let b = B::with_capacity(64);
    let (w, admin) = (through_ops(&b, 0), through_ops(&b, 1));
    let answer = snapshot("settled by hand");
    let resolve = |s: &Snapshot| Amendment::Resolve(s.clone());
    claimed(w.begin(&attempt(1, 1, 11, 0)).unwrap());
    let late = claimed(w.begin(&attempt(2, 1, 21, 0)).unwrap());
    let live = only(&admin, 2, 1);
    assert_eq!(
        admin.amend(&live, &resolve(&answer), 1).unwrap(),
        Err(Refusal::Live { lease_ends_at_ms: LEASE })
    );
    b.let_claim_leases_end();
    // Outcome unknown.
    assert_eq!(w.begin(&refusing(1, 12, LEASE)).unwrap(), Begin::OutcomeUnknown);
    assert_eq!(admin.amend(&only(&admin, 1, LEASE), &resolve(&answer), LEASE).unwrap(), Ok(()));
    for now in [LEASE + 1, LEASE + 2] {
        assert_eq!(w.begin(&refusing(1, now, now)).unwrap(), Begin::Replay(answer.clone()));
    }
    let settled = only(&admin, 1, LEASE + 3);
    assert_eq!((settled.entry.state, settled.entry.status), (State::Succeeded, 201));
    assert_eq!(settled.label.as_ref().unwrap().key(), "key-1");
    // Not twice: it is a known outcome now.
    assert_eq!(
        admin.amend(&settled, &resolve(&snapshot("again")), LEASE + 3).unwrap(),
        Err(Refusal::Completed)
    );
    // A lease-ended claim, whose owner then completes too late (with the same status).
    assert_eq!(admin.amend(&only(&admin, 2, LEASE), &resolve(&answer), LEASE).unwrap(), Ok(()));
    assert_eq!(w.complete(&late, &done("late", LEASE + 1)).unwrap(), Settled::Lost);
    assert_eq!(w.begin(&attempt(2, 1, 22, LEASE + 2)).unwrap(), Begin::Replay(answer));
}
