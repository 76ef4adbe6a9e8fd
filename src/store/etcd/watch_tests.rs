// Test code: a failed expectation is the test's failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

fn scope(n: u8) -> ScopeId {
    ScopeId([n; 32])
}

/// A WatchResponse as etcd encodes it: its header, then the fields proto3 writes (none at 0).
fn response(id: i64, created: bool, canceled: bool, events: usize) -> Vec<u8> {
    let mut out = vec![0x0a, 0x02, 0x18, 0x05];
    if id != 0 {
        out.extend_from_slice(&[0x10, id as u8]);
    }
    if created {
        out.extend_from_slice(&[0x18, 0x01]);
    }
    if canceled {
        out.extend_from_slice(&[0x20, 0x01]);
    }
    for _ in 0..events {
        // An event: a put (type 0, left out) of key "k".
        out.extend_from_slice(&[0x5a, 0x05, 0x12, 0x03, 0x0a, 0x01, b'k']);
    }
    out
}

#[test]
fn a_watch_is_created_when_the_stream_opens_and_its_events_wake_its_record() {
    let mut w = Watches::default();
    assert!(!w.should_open(0), "nothing to watch");
    assert_eq!(w.want(scope(1), || b"/idem/r/01".to_vec()), None, "no stream yet");
    assert!(w.should_open(0));
    let creates = w.opened(7);
    assert_eq!(creates, vec![wire::watch_create(b"/idem/r/01")]);
    assert_eq!(w.token(), Some(7));
    assert!(!w.is_live(&scope(1)), "not confirmed yet");
    // The first watch of a stream gets id 0 (left out on the wire). Created, its record is
    // looked at once more: a change before the watch began made no event.
    assert_eq!(w.received(&response(0, true, false, 0)).unwrap().wake, vec![scope(1)]);
    assert!(w.is_live(&scope(1)));
    // Asked again: already watched.
    assert_eq!(w.want(scope(1), || b"/idem/r/01".to_vec()), None);
    // A second record on the open stream: its create goes at once, answered in order.
    assert_eq!(w.want(scope(2), || b"/idem/r/02".to_vec()), Some(wire::watch_create(b"/idem/r/02")));
    w.received(&response(1, true, false, 0)).unwrap();
    let got = w.received(&response(1, false, false, 2)).unwrap();
    assert_eq!(got.wake, vec![scope(2)]);
    let got = w.received(&response(0, false, false, 1)).unwrap();
    assert_eq!(got.wake, vec![scope(1)]);
}

#[test]
fn a_closed_stream_wakes_every_watched_record_and_reopens_with_backoff() {
    let mut w = Watches::default();
    w.want(scope(1), || b"a".to_vec());
    w.opened(3);
    w.received(&response(0, true, false, 0)).unwrap();
    let mut woken = w.closed(1_000);
    woken.sort_by_key(|s| s.0);
    assert_eq!(woken, vec![scope(1)]);
    assert!(!w.is_live(&scope(1)));
    assert_eq!(w.token(), None);
    assert!(!w.should_open(1_999));
    assert!(w.should_open(2_000));
    // Refused again: the wait doubles.
    w.refused(2_000);
    assert!(!w.should_open(3_999));
    assert!(w.should_open(4_000));
    // Reopened, the same watches are asked for again.
    assert_eq!(w.opened(5), vec![wire::watch_create(b"a")]);
}

#[test]
fn watches_nobody_waits_on_are_canceled_and_etcd_may_drop_one() {
    let mut w = Watches::default();
    w.want(scope(1), || b"a".to_vec());
    w.want(scope(2), || b"b".to_vec());
    let creates = w.opened(1);
    assert_eq!(creates.len(), 2);
    w.received(&response(0, true, false, 0)).unwrap();
    w.received(&response(1, true, false, 0)).unwrap();
    // Created in the order asked (the stream opened with both): find which id is whose.
    let first = w.watched.iter().find(|x| x.scope == scope(1)).and_then(|x| x.id).unwrap();
    let cancels = w.tidy(|s| *s != scope(1));
    assert_eq!(cancels, vec![wire::watch_cancel(first)]);
    assert_eq!(w.len(), 1);
    // etcd ends the other on its own (a compaction): its waiters look again.
    let other = 1 - first;
    let got = w.received(&response(other, false, true, 0)).unwrap();
    assert_eq!(got.dropped, vec![scope(2)]);
    assert!(w.is_empty());
}

#[test]
fn a_create_etcd_refuses_or_nobody_waits_for_any_more_ends_cleanly() {
    let mut w = Watches::default();
    w.want(scope(1), || b"a".to_vec());
    w.opened(1);
    // Refused at creation (permission denied, a stale token): dropped, polled, and the
    // stream is to be opened again.
    let got = w.received(&response(0, true, true, 0)).unwrap();
    assert_eq!(got.dropped, vec![scope(1)]);
    assert!(got.refused);
    assert!(w.is_empty());
    // Tidied while its create was under way: canceled once created.
    w.want(scope(2), || b"b".to_vec());
    assert!(w.tidy(|_| false).is_empty());
    w.received(&response(4, true, false, 0)).unwrap();
    assert_eq!(w.tidy(|_| false), vec![wire::watch_cancel(4)]);
    // An event on a watch nobody knows wakes nothing.
    assert_eq!(w.received(&response(9, false, false, 1)).unwrap(), WatchNews::default());
}

#[test]
fn hostile_messages_are_refused_never_a_panic() {
    let mut w = Watches::default();
    w.want(scope(1), || b"a".to_vec());
    w.opened(1);
    // A creation nobody asked for, a message without header, garbage.
    w.received(&response(0, true, false, 0)).unwrap();
    assert!(w.received(&response(1, true, false, 0)).is_err());
    assert!(w.received(&[0x10, 0x01]).is_err());
    let mut seed = 7u64;
    for len in 0..2_000 {
        let bytes: Vec<u8> = (0..len % 40)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 56) as u8
            })
            .collect();
        let _ = w.received(&bytes);
    }
}

#[test]
fn the_bound_keeps_a_worker_from_holding_unbounded_watches() {
    let mut w = Watches::default();
    w.opened(1);
    for n in 0..MAX_WATCHES {
        let scope = ScopeId([
            (n % 256) as u8,
            (n / 256) as u8,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            1,
        ]);
        assert!(w.want(scope, || vec![1]).is_some());
    }
    assert_eq!(w.want(scope(9), || vec![2]), None);
    assert_eq!(w.len(), MAX_WATCHES);
}

#[test]
fn the_stream_carries_the_workers_token_and_waits_for_one() {
    use crate::config::etcd::{EtcdAuth, EtcdSettings, Protocol};
    let settings = |auth| EtcdSettings { protocol: Protocol::Grpc, ..super::super::tests::settings(auth) };
    let open = RecordWatch::new(Rc::new(EtcdStore::new(settings(None))), "etcd");
    assert_eq!(open.metadata(), Some(vec![]));
    let auth = EtcdAuth { username: "idem".into(), password: "pw".into() };
    let store = Rc::new(EtcdStore::new(settings(Some(auth))));
    let watch = RecordWatch::new(Rc::clone(&store), "etcd");
    assert_eq!(watch.metadata(), None, "no token yet: the waiters poll");
    *store.token.borrow_mut() = Some("tok.1".into());
    assert_eq!(watch.metadata(), Some(vec![("token".to_string(), b"tok.1".to_vec())]));
    // The record's key under the store's prefix; the service names the cluster.
    assert_eq!(watch.target().1, "etcdserverpb.Watch");
    let create = watch.want(&scope(1)).is_none();
    assert!(create, "no stream yet");
    assert_eq!(watch.opened(1), vec![wire::watch_create(&store.record_key(&scope(1)))]);
}
