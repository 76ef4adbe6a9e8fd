//! The etcd backend: one store shared by a fleet of Envoys, reached through etcd's v3 JSON
//! gateway by HTTP callouts. This module is pure (no host calls, no sockets): `EtcdStore::start`
//! turns a `StoreOp` into an `Exchange`, a state machine that asks for HTTP calls
//! (`ExchangeStep::Call`) and is fed their answers until it is `Done`. The glue performs the
//! calls as Envoy callouts; `blocking` (tests only) performs them over std::net.

#[cfg(feature = "testing")]
pub mod blocking;

use crate::store::{StoreAnswer, StoreError, StoreOp};

/// What to do when etcd cannot be used (unreachable, erroring, too slow).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Refuse the request (503 store-unavailable): the guarantee is never silently dropped.
    #[default]
    FailClosed,
    /// Forward the request unprotected, counted and logged.
    FailOpen,
}

/// Credentials for `/v3/auth/authenticate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    pub username: String,
    pub password: String,
}

/// The etcd store's configuration (`store.type: "etcd"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    /// Envoy cluster name pointing at etcd's client URLs.
    pub cluster: String,
    /// Key prefix every key of this store lives under.
    pub prefix: String,
    /// Per callout.
    pub timeout_ms: u64,
    pub on_error: OnStoreError,
    pub auth: Option<EtcdAuth>,
}

pub const DEFAULT_PREFIX: &str = "/idempotency/";
pub const DEFAULT_TIMEOUT_MS: u64 = 250;

/// An answer to a callout. `status` None: the callout failed (reset, response over the buffer
/// limit) and no HTTP status exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAnswer {
    pub status: Option<u16>,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExchangeStep {
    /// POST `body` (JSON) to `path` on the etcd cluster; send `authorization: <token>` when
    /// `token` is Some.
    Call {
        path: &'static str,
        body: Vec<u8>,
        token: Option<String>,
    },
    Done(StoreAnswer),
}

/// Per worker (one per root context): the lease cache and the auth token.
#[derive(Debug)]
pub struct EtcdStore {
    settings: EtcdSettings,
}

impl EtcdStore {
    pub fn new(settings: EtcdSettings) -> EtcdStore {
        EtcdStore { settings }
    }

    pub fn settings(&self) -> &EtcdSettings {
        &self.settings
    }

    /// Starts one store operation; drive it with `Exchange::step`.
    pub fn start(&self, op: StoreOp) -> Exchange {
        Exchange { op }
    }
}

/// One `StoreOp` carried out as a sequence of HTTP calls to etcd's JSON gateway.
#[derive(Debug)]
pub struct Exchange {
    op: StoreOp,
}

impl Exchange {
    /// First call with `answer: None`; afterwards with the answer to the last `Call`.
    pub fn step(&mut self, _store: &EtcdStore, _answer: Option<HttpAnswer>, _now_ms: u64) -> ExchangeStep {
        let error = StoreError::Unavailable("not yet".into());
        ExchangeStep::Done(match self.op {
            StoreOp::Begin(_) => StoreAnswer::Begun(Err(error)),
            StoreOp::Complete { .. } | StoreOp::Release(_) => StoreAnswer::Settled(Err(error)),
        })
    }
}
