//! The etcd backend: one store shared by a fleet of Envoys, reached through etcd's v3 JSON
//! gateway by HTTP callouts. This module is pure (no host calls, no sockets): `EtcdStore::start`
//! turns a `StoreOp` into an `Exchange`, a state machine that asks for HTTP calls
//! (`ExchangeStep::Call`) and is fed their answers until it is `Done`. The glue performs the
//! calls as Envoy callouts; `blocking` (tests only) performs them over std::net. It answers
//! exactly as the local store does (the conformance suite runs against a real etcd), except
//! that it has no capacity bound (never `Full`) and `sweep` has nothing to do.
//!
//! Data model (all keys under `prefix`, default `/idempotency/`; docs/ETCD.md has the sizing):
//! - `r/<scope hex>`: the record, its value the v2 record bytes (`record::encode_slot`; a claim
//!   is a processing entry without snapshot, read with `record::decode_record`). The entry's
//!   `expires_at_ms` decides whether the record exists: an expired record reads as absent even
//!   while etcd still holds it, so time is the caller's (virtual in tests) and etcd's lease only
//!   collects garbage. `Claim.locator` is the mod_revision of the claim's put: the record's last
//!   write while the claim holds it, so every ownership check is a compare on it.
//! - `q/t/<tenant tag>/<until>/<scope hex>` and `q/p/<principal tag>/<until>/<scope hex>`: one
//!   empty index key per charged record and identity (tag: first 8 bytes of the digest, 16 hex;
//!   `until`: 16 hex digits of when the record stops counting: a claim at the end of its lease,
//!   a completed record at its expiry). Keys sort by `until`, so an identity's live records are
//!   the range from `<until = now + 1>` to the end of its prefix; one range with `limit 1,
//!   keys_only` gives their count (etcd counts the whole range whatever the limit) and the one
//!   that stops counting first (the retry-after hint). Index keys carry the record's lease and
//!   are rewritten in the same transaction as the record.
//! - `l/<scope hex>`: a claim's lease key, its value the owner token, on a claim lease (below):
//!   it exists while the claim's processing lease runs by etcd's clock. A takeover needs it gone
//!   (or holding another owner) as well as the deadline passed by the caller's clock, so an
//!   Envoy whose clock runs ahead never takes over a running claim. A release deletes it; a
//!   completion leaves it to expire. A claim without one (an older build's) is judged by its
//!   deadline alone.
//! - Leases: records whose expiry falls in the same `LEASE_WINDOW_MS` window share one lease,
//!   granted by a worker the first time it writes into that window and cached (`EtcdStore`);
//!   its TTL runs to the window's end plus `LEASE_SLACK_S`, so a record's lease never ends before
//!   its `expires_at_ms`. A claim's record already expires at now + ttl (an abandoned claim must
//!   keep refusing another payload until then, as in the local store), so its lease covers the
//!   processing timeout and the ttl; a completion moves the record to the lease of its new
//!   expiry. A lease etcd no longer knows is granted again once per exchange. Claim leases: a
//!   worker puts the lease keys of the claims it makes within `claim_lease_reuse_ms` (max(1 s,
//!   lease / 10)) on one lease, whose TTL is the processing lease plus that window plus
//!   `CLAIM_LEASE_SLACK_S`, so each lease key outlives its claim's lease by etcd's clock.
//!
//! Operations (round trips; "+1" is a lease grant, once per worker and window):
//! - begin: 1 (the claim's puts name the record's lease and the lease key's claim lease, so
//!   they are known before the call; a worker lacking one first reads the record with the
//!   failure branch's ranges alone (`Stage::Probe`): a record answers there, an absent one costs
//!   that read +1 per lease to grant, once per worker and window): one txn guarded by
//!   create_revision(r/<scope>) == 0. Success (a new record): it puts the record, its index keys
//!   and its lease key, then ranges a charged attempt's live indexes (the reads of a txn see its
//!   earlier writes: the count includes the claim's own key, which `quota_refusal` leaves out;
//!   limit 2 so the retry-after hint skips it); over a bound, a third call deletes what the
//!   claim wrote, guarded by its revision (`undo`), and the begin answers `QuotaExceeded`.
//!   Failure (the record exists): it ranges the record and its lease key, never the quota, and
//!   the begin decides replay, not stored, mismatch or in flight from them; a takeover or a
//!   reuse of an expired record is a second txn guarded by mod_revision == observed that puts
//!   the record, its index keys and its lease key and deletes the replaced record's index keys
//!   (with a quota, the quota is read first in a txn guarded by the observed revision: +1). A
//!   lost guard starts again with the claim's txn, up to `TXN_ATTEMPTS` times (then
//!   `Contention`).
//! - complete: 1 (+1): `Claim::written` is the record the claim put, so a txn guarded by
//!   mod_revision == locator (while it holds, the record is exactly that put) rewrites the
//!   record with its outcome and moves its index keys without reading it; on a failed guard its
//!   failure branch reads the record: `Lost`, unless it holds this claim's owner with this
//!   outcome (an earlier try of the same completion landed: `Done`). The glue tries a failed
//!   settlement again. A claim without `written` (not made by this store) is read first (+1:
//!   ownership, mod_revision == locator, same owner, processing).
//! - release: 1: the same guarded txn deleting the record, its index keys and its lease key (a
//!   failed guard is `Lost`).
//! - With auth, +1 (`/v3/auth/authenticate`) on a worker's first call and whenever etcd refuses
//!   the token (invalid, or older than an auth change: `wire::Refused::InvalidToken`; then the
//!   call is sent again, once). One fetch per worker at a time (`TokenFetch`): an exchange that
//!   needs a token while another fetches it answers `ExchangeStep::AwaitToken` and is stepped
//!   again (with `None`) when `take_fetch_ended` says the fetch ended, or at the driver's next
//!   tick; it then sends its call with the token, or fails with the fetch's error (`TimedOut`
//!   once the fetch is past its deadline, `auth_timeout_ms`, without an answer).
//! - With `replay_cache` on, a begin of a scope whose completed, unexpired record this worker
//!   has read or written: 0, answered from `cache` (never a claim).
//!
//! Lease grants per second are independent of the request rate: at most one per worker per
//! window in use, i.e. about (workers x distinct ttls) / 10 s across the fleet's workers, plus
//! one claim lease per worker per claim-lease window while it makes claims; at any request
//! rate with one ttl, the default 30 s lease and 2 workers per Envoy, 10 Envoys grant about
//! 2 + 7 leases a second.
//!
//! etcd cannot compare a count in a guard, so a new claim counts in its own txn, after its
//! puts: etcd applies txns one at a time, so new claims never pass the bound, though one being
//! undone still counts for the others until its undo lands. A takeover or reuse with a quota
//! reads then writes: racing ones can overshoot the bound by their number.

pub mod base64;
#[cfg(feature = "testing")]
pub mod blocking;
pub mod cache;
mod wire;

use std::cell::RefCell;

use crate::config::etcd::ETCD_MAX_REQUEST_BYTES;
use crate::store::record::{
    self, Entry, SlotValue, State, FLAG_BODY_NOT_STORED, FLAG_PRINCIPAL_CHARGED, FLAG_TENANT_CHARGED,
};
use crate::store::{
    completed_answer, Begin, Claim, ClaimAttempt, Completion, Settled, StoreAnswer, StoreError, StoreOp,
};
use cache::ReplayCache;
use wire::{Guard, Refused, TxnOp};

/// The store's settings are the configuration's `store` section, defined (with their defaults
/// and the size limits that follow from etcd's) in `config::etcd`, where `parse` builds them.
pub use crate::config::etcd::{EtcdAuth, EtcdSettings, OnStoreError};

/// Room kept for keys and framing when checking an encoded record against etcd's limit.
const TXN_FRAMING_BYTES: u64 = 4 * 1024;

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
    /// `token` is Some; give up on it after `timeout_ms`.
    Call {
        path: &'static str,
        body: Vec<u8>,
        token: Option<String>,
        timeout_ms: u64,
    },
    /// Waiting for this worker's token, which another exchange is fetching: step again with
    /// `None` when `EtcdStore::take_fetch_ended` says a fetch ended, and at least every so often
    /// (a fetch whose callout failed without an answer is over at its deadline; the exchange
    /// then fails by itself).
    AwaitToken,
    Done(StoreAnswer),
}

/// Records whose expiry falls in the same window share one etcd lease, which ends after the
/// window: a worker grants one lease per window in use, never one per request.
pub const LEASE_WINDOW_MS: u64 = 10_000;
/// Added to every lease's TTL: covers the time between the grant and the puts that use it.
const LEASE_SLACK_S: u64 = 2;
/// Leases a worker keeps: one per window in use (claims and completions of each ttl in use).
const CACHED_LEASES: usize = 16;
/// Transactions lost to other writers before `begin` gives up (`Contention`).
const TXN_ATTEMPTS: u8 = 3;
/// Upper bound of a retry-after hint (as the local store).
const RETRY_CAP_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy)]
struct CachedLease {
    window_end_ms: u64,
    id: i64,
}

/// A lease for the lease keys of claims with one processing lease length, granted when this
/// worker asked at `granted_at_ms` (its clock), used for claims made within
/// `claim_lease_reuse_ms` of that.
#[derive(Debug, Clone, Copy)]
struct ClaimLease {
    lease_ms: u64,
    granted_at_ms: u64,
    id: i64,
}

/// How long a worker puts new claims' lease keys on one claim lease: a lease key outlives its
/// claim's processing lease by up to this (and `CLAIM_LEASE_SLACK_S`), so a takeover of an
/// abandoned claim comes at most that much later; a longer reuse means fewer grants.
fn claim_lease_reuse_ms(lease_ms: u64) -> u64 {
    (lease_ms / 10).max(1_000)
}

/// The TTL of a claim lease: every claim put on it within the reuse window keeps its lease key
/// for at least its processing lease, by etcd's clock.
fn claim_lease_ttl_s(lease_ms: u64) -> u64 {
    lease_ms
        .saturating_add(claim_lease_reuse_ms(lease_ms))
        .div_ceil(1_000)
        .saturating_add(CLAIM_LEASE_SLACK_S)
}

/// Covers the grant's round trip: the reuse window counts from before the lease was granted.
const CLAIM_LEASE_SLACK_S: u64 = 1;
/// The retry-after hint for a claim whose lease key lives on past its deadline by this
/// worker's clock (a clock ahead of the owner's).
const LIVE_CLAIM_RETRY_MS: u64 = 1_000;

/// Per worker (one per root context): the leases granted per expiry window and the auth token.
/// Workers never share them (each has its own), so the cells are only touched by one thread.
pub struct EtcdStore {
    settings: EtcdSettings,
    leases: RefCell<Vec<CachedLease>>,
    claim_leases: RefCell<Vec<ClaimLease>>,
    token: RefCell<Option<String>>,
    fetch: RefCell<TokenFetch>,
    replay: Option<RefCell<ReplayCache>>,
}

/// The worker's token fetch: at most one at a time, whatever the number of exchanges that need
/// a token (each authenticate is a bcrypt check and a Raft write on etcd).
#[derive(Debug, Clone, Default)]
struct TokenFetch {
    /// Fetches started so far: the number of the current or last one.
    started: u64,
    /// Fetch `started` is in flight until this deadline (its callout's timeout): an exchange
    /// waiting for it gives up then, and the next one that needs a token fetches anew.
    in_flight_until_ms: Option<u64>,
    /// The last fetch that failed (or outlived its deadline), and why: exchanges that waited for
    /// it fail with the same error.
    failed: Option<(u64, StoreError)>,
    /// A fetch ended since the driver last asked (`take_fetch_ended`).
    ended: bool,
}

impl TokenFetch {
    /// Fetch `started` is over without a token.
    fn fail(&mut self, error: StoreError) {
        self.failed = Some((self.started, error));
        self.in_flight_until_ms = None;
        self.ended = true;
    }
}

/// The token is a credential: formatted as present or absent only.
impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("settings", &self.settings)
            .field("leases", &self.leases.borrow().len())
            .field("token", &self.token.borrow().as_ref().map(|_| "<redacted>"))
            .field("replay_cache", &self.replay.as_ref().map(|c| c.borrow().len()))
            .finish()
    }
}

/// The end of the lease window a record expiring at `expires_at_ms` belongs to: strictly after
/// its expiry, so the record's lease never ends before the record does.
fn window_end(expires_at_ms: u64) -> u64 {
    (expires_at_ms / LEASE_WINDOW_MS).saturating_add(1).saturating_mul(LEASE_WINDOW_MS)
}

impl EtcdStore {
    pub fn new(settings: EtcdSettings) -> EtcdStore {
        let replay = settings.replay_cache.map(|s| RefCell::new(ReplayCache::new(s)));
        EtcdStore {
            settings,
            leases: RefCell::new(Vec::new()),
            claim_leases: RefCell::new(Vec::new()),
            token: RefCell::new(None),
            fetch: RefCell::new(TokenFetch::default()),
            replay,
        }
    }

    pub fn settings(&self) -> &EtcdSettings {
        &self.settings
    }

    /// Starts one store operation; drive it with `Exchange::step`.
    pub fn start(&self, op: StoreOp) -> Exchange {
        Exchange {
            op,
            stage: Stage::Start,
            pending: None,
            fetching: None,
            awaiting: None,
            sent_token: None,
            reauthenticated: false,
            lease_regranted: false,
            attempts: 0,
            write: None,
            pending_claim: None,
            refusal: None,
            probed: false,
        }
    }

    /// True once after a token fetch ended (a token, or a failure): the driver steps the
    /// exchanges that answered `AwaitToken` again.
    pub fn take_fetch_ended(&self) -> bool {
        std::mem::take(&mut self.fetch.borrow_mut().ended)
    }

    /// (records, bytes) in this worker's replay cache; None when it is off.
    pub fn replay_cache_usage(&self) -> Option<(usize, u64)> {
        self.replay.as_ref().map(|c| {
            let c = c.borrow();
            (c.len(), c.bytes())
        })
    }

    fn cached_answer(&self, a: &ClaimAttempt) -> Option<Begin> {
        self.replay.as_ref()?.borrow_mut().answer(&a.scope, &a.fingerprint, a.now_ms)
    }

    fn keep_completed(&self, entry: Entry, snapshot: Option<&record::Snapshot>, now_ms: u64) {
        if let Some(cache) = &self.replay {
            cache.borrow_mut().keep(entry, snapshot, now_ms);
        }
    }

    fn lease_for(&self, window_end_ms: u64, now_ms: u64) -> Option<i64> {
        let mut leases = self.leases.borrow_mut();
        leases.retain(|l| l.window_end_ms > now_ms);
        leases.iter().find(|l| l.window_end_ms == window_end_ms).map(|l| l.id)
    }

    fn remember_lease(&self, window_end_ms: u64, id: i64) {
        let mut leases = self.leases.borrow_mut();
        leases.retain(|l| l.window_end_ms != window_end_ms);
        if leases.len() >= CACHED_LEASES {
            // The soonest window is the one least likely to be asked for again.
            if let Some(i) = leases.iter().enumerate().min_by_key(|(_, l)| l.window_end_ms).map(|(i, _)| i) {
                leases.swap_remove(i);
            }
        }
        leases.push(CachedLease { window_end_ms, id });
    }

    fn forget_lease(&self, id: i64) {
        self.leases.borrow_mut().retain(|l| l.id != id);
        self.claim_leases.borrow_mut().retain(|l| l.id != id);
    }

    fn claim_lease_for(&self, lease_ms: u64, now_ms: u64) -> Option<i64> {
        let mut leases = self.claim_leases.borrow_mut();
        // A clock that went back is no reason to keep using a lease: it may be near its end.
        leases.retain(|l| {
            now_ms >= l.granted_at_ms
                && now_ms < l.granted_at_ms.saturating_add(claim_lease_reuse_ms(l.lease_ms))
        });
        leases.iter().find(|l| l.lease_ms == lease_ms).map(|l| l.id)
    }

    fn remember_claim_lease(&self, lease_ms: u64, granted_at_ms: u64, id: i64) {
        let mut leases = self.claim_leases.borrow_mut();
        leases.retain(|l| l.lease_ms != lease_ms);
        if leases.len() >= CACHED_LEASES {
            leases.remove(0);
        }
        leases.push(ClaimLease { lease_ms, granted_at_ms, id });
    }

    fn token(&self) -> Option<String> {
        self.token.borrow().clone()
    }

    fn key(&self, parts: &[&str]) -> Vec<u8> {
        let mut key = self.settings.prefix.clone().into_bytes();
        for p in parts {
            key.extend_from_slice(p.as_bytes());
        }
        key
    }

    /// `<prefix>r/<scope hex>`: the record.
    fn record_key(&self, scope: &crate::identity::scope::ScopeId) -> Vec<u8> {
        self.key(&["r/", &hex(&scope.0)])
    }

    /// `<prefix>l/<scope hex>`: a claim's lease key, on a claim lease: it exists while the
    /// claim's processing lease runs by etcd's clock, whatever the Envoys' clocks say. Its value
    /// is the claim's owner token.
    fn lease_key(&self, scope: &crate::identity::scope::ScopeId) -> Vec<u8> {
        self.key(&["l/", &hex(&scope.0)])
    }

    /// `<prefix>q/<t|p>/<tag hex16>/`: one identity's quota index; below it one key per record
    /// counted, `<until hex16>/<scope hex>`, where `until` is when the record stops counting.
    /// Keys sort by `until`, so the live ones are a range starting at now.
    fn index_prefix(&self, tenant: bool, tag: u64) -> Vec<u8> {
        self.key(&["q/", if tenant { "t/" } else { "p/" }, &format!("{tag:016x}/")])
    }

    fn index_keys(&self, e: &Entry) -> Vec<Vec<u8>> {
        let until = counts_until(e);
        let mut keys = Vec::new();
        for (flag, tenant, tag) in
            [(FLAG_TENANT_CHARGED, true, e.tenant_tag), (FLAG_PRINCIPAL_CHARGED, false, e.principal_tag)]
        {
            if e.flags & flag != 0 {
                let mut key = self.index_prefix(tenant, tag);
                key.extend_from_slice(format!("{until:016x}/{}", hex(&e.scope.0)).as_bytes());
                keys.push(key);
            }
        }
        keys
    }

    /// The live part of an identity's index at `now_ms`: keys whose `until` is after now.
    fn live_index(&self, tenant: bool, tag: u64, now_ms: u64) -> TxnOp {
        let prefix = self.index_prefix(tenant, tag);
        let mut key = prefix.clone();
        key.extend_from_slice(format!("{:016x}", now_ms.saturating_add(1)).as_bytes());
        let mut range_end = prefix;
        // '/' + 1: the first key after every key under the prefix.
        if let Some(last) = range_end.last_mut() {
            *last = b'0';
        }
        TxnOp::Range { key, range_end: Some(range_end), limit: 2, keys_only: true }
    }
}

/// When a record stops counting against its quota: a claim at the end of its lease (an abandoned
/// claim must not lock its client out for the ttl, as the local store's sweep discharges it), a
/// completed record at its expiry.
fn counts_until(e: &Entry) -> u64 {
    if e.is_completed() {
        e.expires_at_ms
    } else {
        e.lease_deadline_ms.min(e.expires_at_ms)
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0F)]));
    }
    out
}

/// A quota tag: the first 8 bytes of the identity's digest. A collision (2^-64 per pair) merges
/// two identities' quotas, nothing worse; the tag keeps the digest itself out of etcd's keys.
fn tag_of(digest: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// Where an exchange is: which answer it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Start,
    /// begin: a new claim over its quota, being deleted (guarded by the claim's revision).
    Undo,
    /// begin without the leases a claim needs: the record and its lease key if it exists
    /// (nothing if it is absent), read before granting them.
    Probe,
    /// begin of an existing record that will be claimed (takeover, reuse) with a quota: the
    /// quota indexes, read while the record is unchanged.
    QuotaRead,
    /// complete/release: the record, to check ownership and find its index keys.
    SettleRead,
    LeaseGrant,
    /// The guarded write.
    Write,
    Finished,
}

/// A guarded write waiting for its lease (or sent).
#[derive(Debug, Clone)]
struct Write {
    guard: Guard,
    /// The record to put and its encoded value (None: delete it, a release).
    record: Option<(Entry, Vec<u8>)>,
    /// Index keys to delete (the replaced record's).
    stale_index: Vec<Vec<u8>>,
    lease: i64,
    window_end_ms: u64,
    /// A claim: its processing lease length, for its lease key's claim lease (0: not yet
    /// known), asked for at `grant_sent_ms`.
    claim_lease_ms: Option<u64>,
    claim_lease: i64,
    grant_sent_ms: u64,
    /// What a successful write means.
    won: Won,
}

impl Write {
    fn new(guard: Guard, record: Option<(Entry, Vec<u8>)>, stale_index: Vec<Vec<u8>>, won: Won) -> Write {
        Write {
            guard,
            record,
            stale_index,
            lease: 0,
            window_end_ms: 0,
            claim_lease_ms: None,
            claim_lease: 0,
            grant_sent_ms: 0,
            won,
        }
    }
}

/// How a begin will claim an existing or absent record, once its quota is known.
#[derive(Debug, Clone, Copy)]
struct PendingClaim {
    guard: Guard,
    /// The record the claim replaces (its index keys are deleted).
    replaced: Option<Entry>,
    won: Won,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Won {
    Claimed,
    TookOver,
    Settled,
}

/// One `StoreOp` carried out as a sequence of HTTP calls to etcd's JSON gateway. Pure state
/// machine: the caller performs each `Call` and feeds its answer back.
#[derive(Debug)]
pub struct Exchange {
    op: StoreOp,
    stage: Stage,
    /// The last call made for the operation itself, sent again after a re-authentication.
    pending: Option<(&'static str, Vec<u8>)>,
    /// The number of the worker's token fetch this exchange is making (its answer is due).
    fetching: Option<u64>,
    /// The number of the token fetch this exchange waits for (another exchange makes it).
    awaiting: Option<u64>,
    /// The token the pending call was sent with: a refusal replaces the worker's token only
    /// when it is still this one (several exchanges refused at once fetch one token).
    sent_token: Option<String>,
    reauthenticated: bool,
    lease_regranted: bool,
    attempts: u8,
    write: Option<Write>,
    pending_claim: Option<PendingClaim>,
    /// The quota's answer to a new claim that turned out over its bound, given once the claim
    /// is undone.
    refusal: Option<Begin>,
    /// The record was found absent by a `Probe`: grant the leases and claim.
    probed: bool,
}

/// What the exchange does next, inside `step`.
enum Next {
    Call(&'static str, Vec<u8>, Stage),
    Begun(Begin),
    Settled(Settled),
}

impl Exchange {
    /// The operation this exchange carries out (to start it again).
    pub fn into_op(self) -> StoreOp {
        self.op
    }

    /// First call with `answer: None`; afterwards with the answer to the last `Call`.
    pub fn step(&mut self, store: &EtcdStore, answer: Option<HttpAnswer>, now_ms: u64) -> ExchangeStep {
        match self.advance(store, answer, now_ms) {
            Ok(step) => step,
            Err(error) => self.finish(Err(error)),
        }
    }

    fn finish(&mut self, outcome: Result<Next, StoreError>) -> ExchangeStep {
        self.stage = Stage::Finished;
        let error = match outcome {
            Ok(Next::Begun(b)) => return ExchangeStep::Done(StoreAnswer::Begun(Ok(b))),
            Ok(Next::Settled(s)) => return ExchangeStep::Done(StoreAnswer::Settled(Ok(s))),
            Ok(Next::Call(..)) => unusable("a call where an answer was due"),
            Err(e) => e,
        };
        ExchangeStep::Done(match self.op {
            StoreOp::Begin(_) => StoreAnswer::Begun(Err(error)),
            StoreOp::Complete { .. } | StoreOp::Release(_) => StoreAnswer::Settled(Err(error)),
        })
    }

    fn advance(
        &mut self,
        store: &EtcdStore,
        answer: Option<HttpAnswer>,
        now_ms: u64,
    ) -> Result<ExchangeStep, StoreError> {
        if self.awaiting.is_some() {
            if answer.is_some() {
                return Err(unusable("an answer while waiting for a token"));
            }
            return self.token_awaited(store, now_ms);
        }
        let next = match (self.stage, answer) {
            (Stage::Start, None) => self.first(store, now_ms)?,
            (Stage::Start, Some(_)) => return Err(unusable("an answer before any call")),
            (Stage::Finished, _) => return Err(unusable("the exchange had already finished")),
            (_, None) => return Err(unusable("no answer to the last call")),
            (stage, Some(answer)) => {
                if let Some(number) = self.fetching {
                    return self.authenticated(store, number, &answer);
                }
                match wire::body(answer.status, &answer.body) {
                    Err(Refused::InvalidToken(_))
                        if store.settings.auth.is_some() && !self.reauthenticated =>
                    {
                        // Tokens expire, die with an etcd restart and go stale with any auth
                        // change (wire::Refused::InvalidToken): one fresh token, once. Only the
                        // first exchange refused with this token drops it; the others take the
                        // new one or wait for its fetch.
                        self.reauthenticated = true;
                        {
                            let mut token = store.token.borrow_mut();
                            if *token == self.sent_token {
                                *token = None;
                            }
                        }
                        return self.send(store, now_ms);
                    }
                    Err(Refused::LeaseNotFound) if stage == Stage::Write && !self.lease_regranted => {
                        self.lease_regranted = true;
                        match self.write.as_mut() {
                            Some(w) => {
                                // Either lease may be the one etcd no longer knows.
                                store.forget_lease(w.lease);
                                store.forget_lease(w.claim_lease);
                                (w.lease, w.claim_lease) = (0, 0);
                                self.lease_or_write(store, now_ms)?
                            }
                            None => return Err(unusable("a write without its plan")),
                        }
                    }
                    Err(refused) => return Err(refused.into_error()),
                    Ok(body) => match stage {
                        Stage::Probe => {
                            let txn = wire::read_txn(&body).map_err(Refused::into_error)?;
                            if txn.succeeded {
                                // Absent: the leases, then the claim's transaction (which may
                                // still find a record written meanwhile).
                                self.probed = true;
                                let StoreOp::Begin(a) = self.op else { return Err(unusable("not a begin")) };
                                self.new_claim(store, &a, now_ms)?
                            } else {
                                self.existing(store, &txn, now_ms)?
                            }
                        }
                        Stage::Undo => {
                            // Whether the guard held or not (a claim over its quota is nobody's
                            // to keep), the begin answers with the quota's refusal.
                            wire::read_txn(&body).map_err(Refused::into_error)?;
                            let refusal =
                                self.refusal.take().ok_or_else(|| unusable("an undo without its refusal"))?;
                            Next::Begun(refusal)
                        }
                        Stage::SettleRead => {
                            let range = wire::read_range(&body).map_err(Refused::into_error)?;
                            self.settle_read(store, &range, now_ms)?
                        }
                        Stage::QuotaRead => {
                            let txn = wire::read_txn(&body).map_err(Refused::into_error)?;
                            self.quota_read(store, &txn, now_ms)?
                        }
                        Stage::LeaseGrant => {
                            let id = wire::read_lease_id(&body).map_err(Refused::into_error)?;
                            let Some(w) = self.write.as_mut() else {
                                return Err(unusable("a lease without a write"));
                            };
                            // `lease_or_write` asks for the record's lease first.
                            if w.record.is_some() && w.lease == 0 {
                                store.remember_lease(w.window_end_ms, id);
                                w.lease = id;
                            } else if let Some(lease_ms) = w.claim_lease_ms {
                                store.remember_claim_lease(lease_ms, w.grant_sent_ms, id);
                                w.claim_lease = id;
                            }
                            self.lease_or_write(store, now_ms)?
                        }
                        Stage::Write => {
                            let txn = wire::read_txn(&body).map_err(Refused::into_error)?;
                            self.written(store, &txn, now_ms)?
                        }
                        Stage::Start | Stage::Finished => return Err(unusable("no call was made")),
                    },
                }
            }
        };
        match next {
            Next::Call(path, body, stage) => self.call(store, path, body, stage, now_ms),
            done => Ok(self.finish(Ok(done))),
        }
    }

    /// Sends a call for the operation, authenticating first when there is no token yet.
    fn call(
        &mut self,
        store: &EtcdStore,
        path: &'static str,
        body: Vec<u8>,
        stage: Stage,
        now_ms: u64,
    ) -> Result<ExchangeStep, StoreError> {
        self.stage = stage;
        self.pending = Some((path, body));
        self.send(store, now_ms)
    }

    /// The pending call with the worker's token; without one, after the worker's token fetch:
    /// this exchange makes it, or waits for the one in flight.
    fn send(&mut self, store: &EtcdStore, now_ms: u64) -> Result<ExchangeStep, StoreError> {
        if store.settings.auth.is_none() || store.token.borrow().is_some() {
            return self.resend(store);
        }
        let waiting = {
            let mut fetch = store.fetch.borrow_mut();
            match fetch.in_flight_until_ms {
                Some(deadline_ms) if now_ms < deadline_ms => Some(fetch.started),
                // One whose answer never came in time (its callout failed or timed out, and
                // its exchange ended without it): over, and a new fetch.
                Some(_) => {
                    fetch.fail(StoreError::TimedOut);
                    None
                }
                None => None,
            }
        };
        match waiting {
            Some(number) => {
                self.awaiting = Some(number);
                Ok(ExchangeStep::AwaitToken)
            }
            None => Ok(self.authenticate(store, now_ms)),
        }
    }

    /// Stepped again while waiting for fetch number `awaiting`: on with the token it brought,
    /// on waiting while it is in flight, or the fetch's failure (a fetch past its deadline
    /// timed out).
    fn token_awaited(&mut self, store: &EtcdStore, now_ms: u64) -> Result<ExchangeStep, StoreError> {
        let Some(number) = self.awaiting.take() else { return Err(unusable("not waiting for a token")) };
        if store.token.borrow().as_ref().is_some_and(|t| Some(t) != self.sent_token.as_ref()) {
            return self.resend(store);
        }
        let mut fetch = store.fetch.borrow_mut();
        if let Some((failed, error)) = &fetch.failed {
            if *failed >= number {
                return Err(error.clone());
            }
        }
        match fetch.in_flight_until_ms {
            // Its own, or a later one (its token was refused before this exchange took it).
            Some(deadline_ms) if now_ms < deadline_ms => {
                self.awaiting = Some(fetch.started);
                Ok(ExchangeStep::AwaitToken)
            }
            // Its answer never came in time (the callout failed or timed out and was not handed
            // to its exchange): over, for everyone waiting.
            Some(_) => {
                fetch.fail(StoreError::TimedOut);
                Err(StoreError::TimedOut)
            }
            None => Err(unusable("the token fetch ended without a token")),
        }
    }

    /// The operation's last call, with the current token.
    fn resend(&mut self, store: &EtcdStore) -> Result<ExchangeStep, StoreError> {
        let (path, body) = self.pending.clone().ok_or_else(|| unusable("no call to send"))?;
        let token = store.token();
        self.sent_token.clone_from(&token);
        Ok(ExchangeStep::Call { path, body, token, timeout_ms: store.settings.timeout_ms })
    }

    /// Starts the worker's token fetch: the others that need a token wait for it.
    fn authenticate(&mut self, store: &EtcdStore, now_ms: u64) -> ExchangeStep {
        let timeout_ms = store.settings.auth_timeout_ms;
        let number = {
            let mut fetch = store.fetch.borrow_mut();
            fetch.started = fetch.started.wrapping_add(1);
            fetch.in_flight_until_ms = Some(now_ms.saturating_add(timeout_ms));
            fetch.started
        };
        self.fetching = Some(number);
        let body = match &store.settings.auth {
            Some(a) => wire::authenticate(&a.username, &a.password),
            None => Vec::new(),
        };
        ExchangeStep::Call { path: wire::AUTHENTICATE, body, token: None, timeout_ms }
    }

    /// The answer to the fetch this exchange made: the worker's token (and this exchange's
    /// call sent with it), or the failure every exchange waiting for it gets too.
    fn authenticated(
        &mut self,
        store: &EtcdStore,
        number: u64,
        answer: &HttpAnswer,
    ) -> Result<ExchangeStep, StoreError> {
        self.fetching = None;
        let token = wire::body(answer.status, &answer.body).and_then(|body| wire::read_token(&body)).map_err(
            |refused| match refused {
                Refused::Unusable(m) => StoreError::Unavailable(format!("authenticate: {m}")),
                other => other.into_error(),
            },
        );
        {
            let mut fetch = store.fetch.borrow_mut();
            // A later fetch (this one outlived its deadline) is not this one's to end.
            if fetch.started == number {
                match &token {
                    Ok(_) => fetch.in_flight_until_ms = None,
                    Err(error) => fetch.fail(error.clone()),
                }
            }
            // Whoever waits for a token takes this one.
            fetch.ended = true;
        }
        *store.token.borrow_mut() = Some(token?);
        self.resend(store)
    }

    fn first(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Next, StoreError> {
        match &self.op {
            StoreOp::Begin(a) => match store.cached_answer(a) {
                // A completed record this worker saw and that has not expired: it cannot have
                // changed (cache.rs), so etcd would answer the same.
                Some(answer) => Ok(Next::Begun(answer)),
                None => {
                    let a = *a;
                    self.new_claim(store, &a, now_ms)
                }
            },
            StoreOp::Complete { claim, completion } => {
                if completion.state == State::Processing {
                    return Err(StoreError::Corrupt("a completion must carry an outcome state".into()));
                }
                self.settle_or_read(store, *claim, now_ms)
            }
            StoreOp::Release(claim) => self.settle_or_read(store, *claim, now_ms),
        }
    }

    /// A settlement of a claim whose record is known (`Claim::written`, as this store's begin
    /// wrote it) is one transaction guarded by the claim's revision: while it holds, the record
    /// is exactly that write. Otherwise the record is read first.
    fn settle_or_read(&mut self, store: &EtcdStore, claim: Claim, now_ms: u64) -> Result<Next, StoreError> {
        match (claim.written, i64::try_from(claim.locator)) {
            (Some(e), Ok(revision))
                if e.owner == claim.owner && e.scope == claim.scope && !e.is_completed() =>
            {
                self.settle(store, e, Guard::ModRevision(revision), now_ms)
            }
            _ => Ok(Next::Call(wire::RANGE, wire::range(&store.record_key(&claim.scope)), Stage::SettleRead)),
        }
    }

    /// The claim of a new record, in one transaction guarded by "the record is absent": if it
    /// is, it puts the record, its index keys and its lease key (and reads a charged attempt's
    /// live indexes, the new keys included: `claimed_new`); if not, it reads the record and
    /// its lease key (`existing`), so that a replay, a mismatch or a 409 is one round trip and
    /// never reads the quota. The leases the puts name are granted first when this worker has
    /// none for them yet.
    fn new_claim(&mut self, store: &EtcdStore, a: &ClaimAttempt, now_ms: u64) -> Result<Next, StoreError> {
        let entry = charged_entry(a);
        let leases_known = store.lease_for(window_end(entry.expires_at_ms), now_ms).is_some()
            && store.claim_lease_for(a.lease_ms, now_ms).is_some();
        if !leases_known && !self.probed {
            // A grant is due (once per worker and window): read first, so that a begin
            // answered by an existing record (a replay) never waits for grants. The claim's
            // transaction follows the grants only for an absent record.
            let record = store.record_key(&a.scope);
            let existing = [
                TxnOp::Range { key: record.clone(), range_end: None, limit: 0, keys_only: false },
                TxnOp::Range { key: store.lease_key(&a.scope), range_end: None, limit: 0, keys_only: false },
            ];
            let body = wire::txn(Some((&record, Guard::Absent)), &[], &existing);
            return Ok(Next::Call(wire::TXN, body, Stage::Probe));
        }
        let value = record::encode_slot(&SlotValue { entry, snapshot: None });
        let mut write = Write::new(Guard::Absent, Some((entry, value)), Vec::new(), Won::Claimed);
        write.claim_lease_ms = Some(a.lease_ms);
        self.plan(write, store, now_ms)
    }

    /// A new claim's transaction found the record (its failure branch: the record, then its
    /// lease key): decide as a read of it.
    fn existing(
        &mut self,
        store: &EtcdStore,
        txn: &wire::TxnAnswer,
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        let StoreOp::Begin(a) = self.op.clone() else { return Err(unusable("not a begin")) };
        let mut ranges = txn.ranges.iter();
        let Some(kv) = ranges.next().and_then(|found| found.kvs.first()) else {
            return Err(unusable("etcd's answer lacks the record read"));
        };
        let lease_key_owner =
            ranges.next().and_then(|found| found.kvs.first()).and_then(|kv| owner_of(&kv.value));
        let existing = decode(&kv.value)?;
        let e = existing.entry;
        if e.scope != a.scope {
            return Err(StoreError::Corrupt("a record under another scope's key".into()));
        }
        let now = a.now_ms;
        // Kept for the next begins of this scope (completed and live only; any fingerprint:
        // the cache answers a mismatch as etcd would).
        store.keep_completed(e, existing.snapshot.as_ref(), now);
        // The claim's lease key lives while its processing lease runs by etcd's clock: an Envoy
        // whose clock runs ahead of the owner's must not take it over early. (A claim written
        // without one, by an older build, is judged by its deadline alone.)
        let lease_running = !e.is_completed() && lease_key_owner == Some(e.owner);
        let guard = Guard::ModRevision(kv.mod_revision);
        let pending = if e.is_expired(now) && !lease_running {
            // Expired: absent, whatever etcd still holds until the lease collects it.
            PendingClaim { guard, replaced: Some(e), won: Won::Claimed }
        } else if e.fingerprint != a.fingerprint {
            return Ok(Next::Begun(Begin::Mismatch));
        } else if e.is_completed() {
            let answer = completed_answer(&e, existing.snapshot);
            return Ok(Next::Begun(answer.unwrap_or(Begin::NotStored { status: e.status })));
        } else if now < e.lease_deadline_ms {
            return Ok(Next::Begun(Begin::InFlight { retry_after_ms: e.lease_deadline_ms - now }));
        } else if lease_running {
            return Ok(Next::Begun(Begin::InFlight { retry_after_ms: LIVE_CLAIM_RETRY_MS }));
        } else {
            // The lease ended without an outcome: take the record over.
            PendingClaim { guard, replaced: Some(e), won: Won::TookOver }
        };
        if a.quota.is_none() {
            return self.claim(store, &a, pending, &[], now_ms);
        }
        // The quota is read only now that a claim is to be made, guarded by the revision just
        // read (the rare path: a third round trip).
        self.pending_claim = Some(pending);
        let body = wire::txn(Some((&store.record_key(&a.scope), guard)), &quota_reads(store, &a), &[]);
        Ok(Next::Call(wire::TXN, body, Stage::QuotaRead))
    }

    fn quota_read(
        &mut self,
        store: &EtcdStore,
        txn: &wire::TxnAnswer,
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        let StoreOp::Begin(a) = self.op.clone() else { return Err(unusable("not a begin")) };
        let pending = self.pending_claim.take().ok_or_else(|| unusable("a quota read without its claim"))?;
        if !txn.succeeded {
            // The record changed since it was read: look again, as after a lost write.
            return self.read_again(store, &a, now_ms);
        }
        self.claim(store, &a, pending, &txn.ranges, now_ms)
    }

    fn read_again(&mut self, store: &EtcdStore, a: &ClaimAttempt, now_ms: u64) -> Result<Next, StoreError> {
        self.attempts += 1;
        if self.attempts >= TXN_ATTEMPTS {
            return Err(StoreError::Contention);
        }
        self.write = None;
        self.new_claim(store, a, now_ms)
    }

    /// Plans the guarded write that claims the record, unless a quota (its live index ranges,
    /// in `quota_reads` order) refuses it.
    fn claim(
        &mut self,
        store: &EtcdStore,
        a: &ClaimAttempt,
        pending: PendingClaim,
        quota: &[wire::RangeAnswer],
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        let entry = charged_entry(a);
        // A takeover (whose claim stopped counting when its lease ended, exactly when a
        // takeover becomes possible) or a reuse: charged, within the bounds.
        if let Some(refusal) = quota_refusal(a, quota, None)? {
            return Ok(Next::Begun(refusal));
        }
        let stale_index = pending.replaced.map(|old| store.index_keys(&old)).unwrap_or_default();
        let value = record::encode_slot(&SlotValue { entry, snapshot: None });
        let mut write = Write::new(pending.guard, Some((entry, value)), stale_index, pending.won);
        write.claim_lease_ms = Some(a.lease_ms);
        self.plan(write, store, now_ms)
    }

    fn settle_read(
        &mut self,
        store: &EtcdStore,
        found: &wire::RangeAnswer,
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        let claim: Claim = match &self.op {
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => *claim,
            StoreOp::Begin(_) => return Err(unusable("not a settlement")),
        };
        // The claim's put is the record's last write while the claim holds it: any other
        // revision means it was taken over, completed, released or replaced.
        let Some(kv) = found.kvs.first() else { return Ok(Next::Settled(Settled::Lost)) };
        if u64::try_from(kv.mod_revision).ok() != Some(claim.locator) {
            // A completion sent again (the glue retries one whose answer never came) may find
            // its own earlier write.
            let landed = holds_own_outcome(&self.op, &kv.value);
            return Ok(Next::Settled(if landed { Settled::Done } else { Settled::Lost }));
        }
        let current = decode(&kv.value)?.entry;
        if current.owner != claim.owner || current.scope != claim.scope || current.is_completed() {
            return Ok(Next::Settled(Settled::Lost));
        }
        self.settle(store, current, Guard::ModRevision(kv.mod_revision), now_ms)
    }

    /// The guarded write that settles the claim whose record is `current` (while `guard`
    /// holds): its outcome and the index keys moved to its expiry, or its deletion.
    fn settle(
        &mut self,
        store: &EtcdStore,
        current: Entry,
        guard: Guard,
        now_ms: u64,
    ) -> Result<Next, StoreError> {
        let stale_index = store.index_keys(&current);
        let write = match &self.op {
            StoreOp::Complete { completion, .. } => {
                let Completion { state, status, snapshot, now_ms: at, ttl_ms } = completion;
                let mut done = current;
                done.state = *state;
                done.status = *status;
                done.expires_at_ms = at.saturating_add(*ttl_ms);
                // encode_slot sets FLAG_BODY_NOT_STORED from the snapshot's presence.
                let mut value = record::encode_slot(&SlotValue { entry: done, snapshot: snapshot.clone() });
                if value.len() as u64 + TXN_FRAMING_BYTES > ETCD_MAX_REQUEST_BYTES {
                    // Headers beyond what the configuration's sizing assumed: etcd would refuse
                    // the whole write and the outcome would be lost (a retry would execute
                    // again). Keep the outcome without its body instead, as for any response
                    // too large to keep.
                    log::debug!(
                        "completion of {} too large for etcd: kept without its body",
                        current.scope.log_tag()
                    );
                    value = record::encode_slot(&SlotValue { entry: done, snapshot: None });
                }
                Write::new(guard, Some((done, value)), stale_index, Won::Settled)
            }
            _ => Write::new(guard, None, stale_index, Won::Settled),
        };
        self.plan(write, store, now_ms)
    }

    fn plan(&mut self, write: Write, store: &EtcdStore, now_ms: u64) -> Result<Next, StoreError> {
        self.write = Some(write);
        self.lease_or_write(store, now_ms)
    }

    /// Finds the leases the write needs (its record's, for its expiry window; a claim's lease
    /// key's, for its processing lease), granting one this worker does not have yet, then
    /// makes the write.
    fn lease_or_write(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Next, StoreError> {
        let Some(w) = self.write.as_mut() else { return Err(unusable("no write planned")) };
        if let Some((entry, _)) = &w.record {
            if w.lease == 0 {
                w.window_end_ms = window_end(entry.expires_at_ms);
                match store.lease_for(w.window_end_ms, now_ms) {
                    Some(id) => w.lease = id,
                    None => {
                        let ttl_s = w
                            .window_end_ms
                            .saturating_sub(now_ms)
                            .div_ceil(1_000)
                            .saturating_add(LEASE_SLACK_S);
                        return Ok(Next::Call(
                            wire::LEASE_GRANT,
                            wire::lease_grant(ttl_s),
                            Stage::LeaseGrant,
                        ));
                    }
                }
            }
        }
        if let (Some(lease_ms), 0) = (w.claim_lease_ms, w.claim_lease) {
            match store.claim_lease_for(lease_ms, now_ms) {
                Some(id) => w.claim_lease = id,
                None => {
                    w.grant_sent_ms = now_ms;
                    let ttl_s = claim_lease_ttl_s(lease_ms);
                    return Ok(Next::Call(wire::LEASE_GRANT, wire::lease_grant(ttl_s), Stage::LeaseGrant));
                }
            }
        }
        self.write_call(store)
    }

    fn write_call(&self, store: &EtcdStore) -> Result<Next, StoreError> {
        let Some(w) = &self.write else { return Err(unusable("no write planned")) };
        let scope = match &self.op {
            StoreOp::Begin(a) => a.scope,
            StoreOp::Complete { claim, .. } | StoreOp::Release(claim) => claim.scope,
        };
        let key = store.record_key(&scope);
        let fresh_index = w.record.as_ref().map(|(entry, _)| store.index_keys(entry)).unwrap_or_default();
        // etcd refuses a transaction that names one key twice; a stale key that is also fresh
        // (same `until`) is simply put again.
        let mut ops: Vec<TxnOp> = w
            .stale_index
            .iter()
            .filter(|k| !fresh_index.contains(k))
            .map(|k| TxnOp::Delete { key: k.clone() })
            .collect();
        match &w.record {
            Some((entry, value)) => {
                ops.push(TxnOp::Put { key: key.clone(), value: value.clone(), lease: w.lease });
                for index in fresh_index {
                    // Index keys carry the record's lease: they disappear with it.
                    ops.push(TxnOp::Put { key: index, value: Vec::new(), lease: w.lease });
                }
                if w.claim_lease != 0 {
                    let value = entry.owner.to_be_bytes().to_vec();
                    ops.push(TxnOp::Put { key: store.lease_key(&scope), value, lease: w.claim_lease });
                }
            }
            None => {
                ops.push(TxnOp::Delete { key: key.clone() });
                ops.push(TxnOp::Delete { key: store.lease_key(&scope) });
            }
        }
        // A completion whose guard fails reads the record in the same call: an earlier try's
        // write may have landed after this try's read (`holds_own_outcome`).
        let on_failure = match (&self.op, w.guard) {
            (StoreOp::Complete { .. }, _) => {
                vec![TxnOp::Range { key: key.clone(), range_end: None, limit: 0, keys_only: false }]
            }
            // A new claim that finds the record reads it and its lease key instead.
            (StoreOp::Begin(_), Guard::Absent) => vec![
                TxnOp::Range { key: key.clone(), range_end: None, limit: 0, keys_only: false },
                TxnOp::Range { key: store.lease_key(&scope), range_end: None, limit: 0, keys_only: false },
            ],
            _ => Vec::new(),
        };
        if let (StoreOp::Begin(a), Guard::Absent) = (&self.op, w.guard) {
            // After the puts: the count includes the new index keys (a transaction's reads see
            // its earlier writes), the first two keys hold the soonest other one.
            ops.extend(quota_reads(store, a));
        }
        Ok(Next::Call(wire::TXN, wire::txn(Some((&key, w.guard)), &ops, &on_failure), Stage::Write))
    }

    fn written(&mut self, store: &EtcdStore, txn: &wire::TxnAnswer, now_ms: u64) -> Result<Next, StoreError> {
        let Some(w) = self.write.clone() else { return Err(unusable("no write planned")) };
        match (&self.op, txn.succeeded, w.won) {
            (StoreOp::Begin(a), true, won) => {
                let locator = u64::try_from(txn.revision).map_err(|_| unusable("a negative revision"))?;
                let written = w.record.as_ref().map(|(entry, _)| *entry);
                if let (Guard::Absent, Some(entry)) = (w.guard, written) {
                    let own = store.index_keys(&entry);
                    if let Some(refusal) = quota_refusal(a, &txn.ranges, Some((&entry, &own)))? {
                        // Over the bound: the claim is undone while it is still this write
                        // (the rare path: a third round trip).
                        return Ok(self.undo(store, entry, txn.revision, refusal));
                    }
                }
                let claim = Claim { scope: a.scope, owner: a.owner, locator, written };
                Ok(Next::Begun(if won == Won::TookOver {
                    Begin::TookOver(claim)
                } else {
                    Begin::Claimed(claim)
                }))
            }
            (StoreOp::Begin(_), false, _) if w.guard == Guard::Absent => {
                // The record exists: the failure branch read it.
                self.existing(store, txn, now_ms)
            }
            (StoreOp::Begin(a), false, _) => {
                // Another worker wrote the record between our read and our write: look again.
                let a = *a;
                self.read_again(store, &a, now_ms)
            }
            (StoreOp::Complete { completion, .. }, true, _) => {
                // The record as this write left it in etcd, read back from the bytes written
                // (the body may have been dropped to fit), so a replay here needs no round trip.
                if let Some((_, value)) = &w.record {
                    if store.replay.is_some() {
                        if let Ok(written) = record::decode_record(value) {
                            store.keep_completed(written.entry, written.snapshot.as_ref(), completion.now_ms);
                        }
                    }
                }
                Ok(Next::Settled(Settled::Done))
            }
            (_, true, _) => Ok(Next::Settled(Settled::Done)),
            // The claim's revision moved between our read and our write: no longer ours,
            // unless what moved it was an earlier try of this same completion.
            (op, false, _) => {
                let landed = txn
                    .ranges
                    .first()
                    .and_then(|r| r.kvs.first())
                    .is_some_and(|kv| holds_own_outcome(op, &kv.value));
                Ok(Next::Settled(if landed { Settled::Done } else { Settled::Lost }))
            }
        }
    }
}

impl Exchange {
    /// Deletes a new claim found over its quota (record, index keys, lease key), guarded by its
    /// revision; the begin then answers `refusal`.
    fn undo(&mut self, store: &EtcdStore, entry: Entry, revision: i64, refusal: Begin) -> Next {
        let key = store.record_key(&entry.scope);
        let mut ops: Vec<TxnOp> =
            store.index_keys(&entry).into_iter().map(|k| TxnOp::Delete { key: k }).collect();
        ops.push(TxnOp::Delete { key: key.clone() });
        ops.push(TxnOp::Delete { key: store.lease_key(&entry.scope) });
        self.refusal = Some(refusal);
        Next::Call(wire::TXN, wire::txn(Some((&key, Guard::ModRevision(revision))), &ops, &[]), Stage::Undo)
    }
}

/// The processing record a claim of `a` writes, charged to the identities its quota names.
fn charged_entry(a: &ClaimAttempt) -> Entry {
    // A claim read from etcd is a record without a body (`record::decode_record`).
    let (mut flags, mut tenant_tag, mut principal_tag) = (FLAG_BODY_NOT_STORED, 0, 0);
    if let Some(q) = &a.quota {
        if let Some(t) = &q.tenant {
            flags |= FLAG_TENANT_CHARGED;
            tenant_tag = tag_of(t);
        }
        if let Some(p) = &q.principal {
            flags |= FLAG_PRINCIPAL_CHARGED;
            principal_tag = tag_of(p);
        }
    }
    a.processing_entry(0, flags, tenant_tag, principal_tag)
}

/// The quota's refusal of a claim of `a`, given its live index ranges (in `quota_reads`
/// order), or None when there is room. `own`: the claim's record and index keys when the
/// ranges were read after putting them (they count, but not against themselves).
fn quota_refusal(
    a: &ClaimAttempt,
    live: &[wire::RangeAnswer],
    own: Option<(&Entry, &[Vec<u8>])>,
) -> Result<Option<Begin>, StoreError> {
    let Some(q) = &a.quota else { return Ok(None) };
    let mut ranges = live.iter();
    for (present, bound, tenant) in
        [(q.tenant.is_some(), q.per_tenant, true), (q.principal.is_some(), q.per_principal, false)]
    {
        if !present {
            continue;
        }
        let what = if tenant { "tenant" } else { "principal" };
        let range =
            ranges.next().ok_or_else(|| unusable(&format!("etcd's answer lacks the {what} index")))?;
        let mut others = range.clone();
        if let Some((entry, keys)) = own {
            // The claim's own key is in the live range when it counts after now.
            if counts_until(entry) > a.now_ms {
                others.count = others.count.saturating_sub(1);
            }
            others.kvs.retain(|kv| !keys.contains(&kv.key));
        }
        if let Some(refusal) = refusal(&others, bound, a.now_ms, tenant) {
            return Ok(Some(refusal));
        }
    }
    Ok(None)
}

/// True when `value` is the record as `op`, a completion, writes it: this claim's owner token
/// with this outcome. Owner tokens are unique per claim, so nobody else wrote it: the write of
/// an earlier try of the same completion landed.
fn holds_own_outcome(op: &StoreOp, value: &[u8]) -> bool {
    let StoreOp::Complete { claim, completion } = op else { return false };
    let Ok(current) = record::decode_record(value) else { return false };
    let e = current.entry;
    e.owner == claim.owner
        && e.scope == claim.scope
        && e.state == completion.state
        && e.status == completion.status
}

fn unusable(why: &str) -> StoreError {
    StoreError::Unavailable(why.into())
}

fn decode(bytes: &[u8]) -> Result<SlotValue, StoreError> {
    // Bytes this build cannot read are reported, never overwritten: a newer build's record is
    // still somebody's guarantee.
    record::decode_record(bytes).map_err(|e| StoreError::Corrupt(format!("etcd record: {e:?}")))
}

/// A charged attempt's quota reads: its tenant's live index (if it has a tenant), then its
/// principal's.
fn quota_reads(store: &EtcdStore, a: &ClaimAttempt) -> Vec<TxnOp> {
    let mut reads = Vec::new();
    if let Some(q) = &a.quota {
        if let Some(t) = &q.tenant {
            reads.push(store.live_index(true, tag_of(t), a.now_ms));
        }
        if let Some(p) = &q.principal {
            reads.push(store.live_index(false, tag_of(p), a.now_ms));
        }
    }
    reads
}

/// The owner token a lease key holds.
fn owner_of(value: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(value).ok().map(u64::from_be_bytes)
}

/// The quota answer for an identity whose live index is `live`, or None when there is room.
fn refusal(live: &wire::RangeAnswer, bound: u32, now_ms: u64, tenant: bool) -> Option<Begin> {
    if live.count < i64::from(bound) {
        return None;
    }
    // The first live key is the one that stops counting first (keys sort by `until`).
    let soonest = live.kvs.first().and_then(|kv| {
        let text = std::str::from_utf8(&kv.key).ok()?;
        let mut parts = text.rsplit('/');
        parts.next()?;
        u64::from_str_radix(parts.next()?, 16).ok()
    });
    let retry_after_ms = match soonest {
        Some(until) if bound > 0 => until.saturating_sub(now_ms).clamp(1, RETRY_CAP_MS),
        _ => RETRY_CAP_MS,
    };
    Some(Begin::QuotaExceeded { retry_after_ms, tenant })
}
#[cfg(test)]
mod tests;
