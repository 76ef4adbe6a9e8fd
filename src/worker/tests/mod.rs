//! The worker's test suite: Envoy's callbacks (`Root`, `Http`) driven against the fake host
//! (`host/fake.rs`), which records every host call that changes something and injects
//! failures per call. One file per subject, each saying what its tests prove; here, what they
//! share: a host configured with the local store and two rules (`orders`, and `waits` in wait
//! mode), a keyed POST and an upstream's answer on it, and readers of the calls made.

mod admin;
mod audit;
mod build_info;
mod costs;
mod detached;
mod detached_model;
mod etcd_auth;
mod etcd_messages;
mod flows;
mod key_sources;
mod local;
mod reconcile;
mod remote;
mod remote_grpc;
mod remote_wait;
mod renewal;
mod shadow;
mod shards;
mod tombstones;
mod unknown_cluster;
mod unsettled;
mod wait;

use super::http::Http;
use super::root::Root;
use crate::host::fake::{FakeHost, HostCall};
use crate::identity::scope::ScopeId;
use crate::store::etcd::watch::RecordWatch;
use crate::store::remote::{Answer, Conversation, Next, RemoteSettings, Request};
use crate::store::seam::{Started, Store, Watch};
use crate::store::{Begin, Claim, Settled, StoreAnswer, StoreError, StoreOp};
use crate::worker::flow::Verdict;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
    {"name":"orders","match":{"prefix":"/orders"},"require_key":true},
    {"name":"waits","match":{"prefix":"/wait"},"require_key":true,"concurrent":"wait"}]}"#;

thread_local! {
    static LOGGED: RefCell<Vec<(log::Level, String)>> = const { RefCell::new(Vec::new()) };
}

/// Keeps the `log` lines (info and above) of the thread that wrote them: each test runs on a
/// thread of its own, so a test reads its own lines only.
struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Info
    }
    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            LOGGED.with(|l| l.borrow_mut().push((record.level(), record.args().to_string())));
        }
    }
    fn flush(&self) {}
}

static CAPTURE: Capture = Capture;

/// From here on, this thread's log lines are kept for `logged` (the worker logs through the `log`
/// facade; in Envoy `glue/host.rs` routes it to Envoy's log).
fn capture_logs() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        let _ = log::set_logger(&CAPTURE);
    });
    log::set_max_level(log::LevelFilter::Info);
    LOGGED.with(|l| l.borrow_mut().clear());
}

/// This thread's log lines at `level` since `capture_logs`.
fn logged(level: log::Level) -> Vec<String> {
    LOGGED.with(|l| l.borrow().iter().filter(|(lv, _)| *lv == level).map(|(_, m)| m.clone()).collect())
}

fn host() -> FakeHost {
    host_with(CONFIG)
}

/// A host configured with `config`, its clock at 1 s.
fn host_with(config: &str) -> FakeHost {
    let h = FakeHost::default();
    *h.0.config.borrow_mut() = config.as_bytes().to_vec();
    h.0.now_ms.set(1_000);
    h
}

fn root(h: &FakeHost) -> Root<FakeHost> {
    let mut root = Root::new(1, h.clone());
    assert!(root.on_configure());
    root
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
}

/// A POST with a key, headers and body in the host, the whole body at once.
fn post(h: &FakeHost, http: &mut Http<FakeHost>, path: &str, key: &str) -> Verdict {
    *h.0.request_headers.borrow_mut() = pairs(&[
        (":method", "POST"),
        (":path", path),
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ]);
    *h.0.request_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(http.on_request_headers(false), Verdict::Pause);
    http.on_request_body(2, true)
}

/// An upstream's answer as the filter sees it: with the header Envoy's router adds.
fn upstream_answers(h: &FakeHost, status: &str, body: &[u8]) {
    *h.0.response_headers.borrow_mut() = pairs(&[
        (":status", status),
        ("content-type", "application/json"),
        ("x-envoy-upstream-service-time", "1"),
    ]);
    *h.0.response_body.borrow_mut() = body.to_vec();
    h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
}

/// A keyed POST on `context` that the upstream answers 201 with `body`, to the end of its
/// stream: the record of `key` is stored (the local store settles at once).
fn executed(h: &FakeHost, root: &Root<FakeHost>, context: u32, key: &str, body: &[u8]) {
    let mut first = root.http_context(context);
    assert_eq!(post(h, &mut first, "/orders", key), Verdict::Continue);
    upstream_answers(h, "201", body);
    assert_eq!(first.on_response_headers(false), Verdict::Continue);
    assert_eq!(first.on_response_body(body.len(), true), Verdict::Continue);
    first.on_log();
}

/// The original (context 2) and a duplicate held in wait mode (context 3).
fn original_and_waiter(h: &FakeHost, root: &Root<FakeHost>) -> (Http<FakeHost>, Http<FakeHost>) {
    let mut original = root.http_context(2);
    assert_eq!(post(h, &mut original, "/wait", "w"), Verdict::Continue);
    let mut waiter = root.http_context(3);
    assert_eq!(post(h, &mut waiter, "/wait", "w"), Verdict::Pause);
    assert_eq!(h.counter("waiting"), 1);
    (original, waiter)
}

/// Every value the filter set as the filter state `name` (`idempotency.outcome`,
/// `idempotency.audit`), in order, whatever the stream.
fn filter_states(h: &FakeHost, name: &str) -> Vec<String> {
    h.0.calls
        .borrow()
        .iter()
        .filter_map(|c| match c {
            HostCall::SetProperty { name: n, value, .. } if n == name => Some(value.clone()),
            _ => None,
        })
        .collect()
}

type Sent = (u16, Vec<(String, Vec<u8>)>, Vec<u8>);

/// Every local reply sent on stream `context`, in order.
pub(super) fn sent_to(h: &FakeHost, context: u32) -> Vec<Sent> {
    h.0.calls
        .borrow()
        .iter()
        .filter_map(|c| match c {
            HostCall::SendResponse { context: c, status, headers, body, .. } if *c == context => {
                Some((*status, headers.clone(), body.clone()))
            }
            _ => None,
        })
        .collect()
}

fn last_token(h: &FakeHost) -> u32 {
    match h.dispatches().last() {
        Some(HostCall::Dispatch { token, .. }) => *token,
        _ => panic!("no callout"),
    }
}

/// A store across the network for the remote tests, scripted: one call per operation.
pub(super) type Begins = Rc<RefCell<VecDeque<Begin>>>;

/// Each operation is one call; a 200 answers a `begin` with the next scripted `Begin`
/// (a claim when none is left), a settlement with Done, a renewal with every claim kept;
/// anything else is Unavailable.
pub(super) struct Scripted {
    pub(super) settings: RemoteSettings,
    pub(super) ops: Rc<RefCell<Vec<StoreOp>>>,
    pub(super) begins: Begins,
    /// A record watch, as the etcd store has over gRPC.
    pub(super) watch: Option<RecordWatch>,
}

/// A begin's call is its claim: once sent, it may have landed until a 200 says how it went.
struct OneCall(StoreOp, Begins, bool);

impl Conversation for OneCall {
    fn into_op(self: Box<Self>) -> StoreOp {
        self.0
    }
    fn unanswered_claim(&self) -> Option<Claim> {
        match &self.0 {
            StoreOp::Begin(a) if self.2 => Some(Claim {
                scope: a.scope,
                owner: a.owner,
                locator: 0,
                written: None,
                shard: 0,
                old_home: None,
                tombstone_s: 0,
            }),
            _ => None,
        }
    }
    fn step(&mut self, answer: Option<Answer>, _now_ms: u64) -> Next {
        let Some(answer) = answer else {
            self.2 = true;
            return Next::Call(Request {
                path: "/v3/kv/txn",
                body: b"{}".to_vec(),
                token: None,
                timeout_ms: None,
                shard: 0,
            });
        };
        let error = StoreError::Unavailable(format!("answer {:?}", answer.status));
        let ok = answer.status == Some(200);
        self.2 = !ok;
        Next::Done(match &self.0 {
            StoreOp::Begin(a) if ok => {
                StoreAnswer::Begun(Ok(self.1.borrow_mut().pop_front().unwrap_or(Begin::Claimed(Claim {
                    scope: a.scope,
                    owner: a.owner,
                    locator: 7,
                    // As etcd's claim carries the record it wrote: its lease's end bounds the
                    // completion's retries (`flow::Retry`).
                    written: Some(a.processing_entry(0, 0, 0, 0)),
                    shard: 0,
                    old_home: None,
                    tombstone_s: 0,
                }))))
            }
            StoreOp::Begin(_) => StoreAnswer::Begun(Err(error)),
            // A renewal keeps every claim it carries.
            StoreOp::Renew(r) if ok => {
                StoreAnswer::Renewed(Ok(vec![crate::store::Kept::Renewed; r.claims.len()]))
            }
            StoreOp::Renew(_) => StoreAnswer::Renewed(Err(error)),
            _ if ok => StoreAnswer::Settled(Ok(Settled::Done)),
            _ => StoreAnswer::Settled(Err(error)),
        })
    }
}

impl Store for Scripted {
    fn remote_for(&self, shard: u8) -> Option<&RemoteSettings> {
        (shard == 0).then_some(&self.settings)
    }
    /// As etcd's: a claim is held through its completion's retry window, one lease more.
    fn held_past_lease_ms(&self, lease_ms: u64) -> u64 {
        lease_ms
    }
    fn watch(&self, _scope: &ScopeId) -> Option<&dyn Watch> {
        self.watch.as_ref().map(|w| w as &dyn Watch)
    }
    fn watches(&self) -> Vec<&dyn Watch> {
        self.watch.iter().map(|w| w as &dyn Watch).collect()
    }
    fn start(&self, op: StoreOp, now: &dyn Fn() -> u64) -> Started {
        self.ops.borrow_mut().push(op.clone());
        Started::first_step(Box::new(OneCall(op, Rc::clone(&self.begins), false)), now())
    }
}
