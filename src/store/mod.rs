//! The record store's operations and answers, as data (`StoreOp`, `StoreAnswer`), which every
//! backend carries out behind the one seam (`seam::Store`) and which the same conformance suite
//! (`store/conformance.rs`) holds every backend to: `local` (Envoy's shared data: one Envoy, all
//! its workers) and `etcd` (one etcd cluster, or several shards: a fleet of Envoys). The etcd
//! store is reached by callouts, so the filter drives it as `etcd::EtcdConversation`s; the tests
//! drive both through `RecordStore` (`testing`: one operation answered per call; etcd's through a
//! blocking driver, `etcd::blocking`), never with blocking I/O inside the filter.
//!
//! Contract, per scope (tenant, principal, method, path, key):
//! - at most one live record; `begin` either claims it for exactly one caller or reports what
//!   is there, atomically across every worker sharing the store;
//! - only the current owner's `complete`/`release` changes a processing record; a late call by
//!   an owner whose lease was taken over reports `Lost` and changes nothing;
//! - a completion by the current owner is never dropped, however busy the store is: once
//!   `complete` returns `Done`, every later `begin` sees the outcome until it expires;
//! - a live record (a completed one before its expiry, a processing one within its lease) is
//!   never evicted to make room: a full store answers `Full` (a store without a capacity bound,
//!   etcd, never does). A processing record whose lease
//!   ended without an outcome is abandoned and may give its place to a new record;
//! - a new record is charged to its tenant and principal, those the attempt names (quotas are
//!   opt-in; an attempt without a quota charges nothing): once an identity holds its bound of
//!   live records, `begin` answers `QuotaExceeded` instead of claiming; takeovers, replays,
//!   mismatches and in-flight answers are not charged;
//! - expired records read as absent and their space is reclaimed by `sweep` (etcd: by leases);
//! - a claim whose owner is still at work is kept by `renew`: its lease runs on from the
//!   renewal, so nobody takes it over, refuses it or looks it up meanwhile; a renewal of a claim
//!   that is no longer its owner's (settled, taken over, gone) changes nothing and says so.

#[cfg(feature = "testing")]
pub mod conformance;
pub mod etcd;
pub mod factory;
#[cfg(feature = "testing")]
pub mod fake;
pub mod local;
pub mod record;
pub mod remote;
pub mod seam;
pub mod shared_data;
pub mod tombstone;

pub use factory::open;

use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::store::record::{label_part, Entry, Label, Snapshot, State, STATUS_OUTCOME_UNKNOWN};
use crate::store::record::{LABEL_HOST_MAX, LABEL_TENANT_MAX};

/// What `begin` needs to know about the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimAttempt {
    pub scope: ScopeId,
    pub fingerprint: Fingerprint,
    /// Fresh token identifying this request's claim, unique among claims.
    pub owner: u64,
    pub now_ms: u64,
    pub lease_ms: u64,
    pub ttl_ms: u64,
    /// The quota a new record is charged to; None: no quota applies, and no counter is read
    /// or written.
    pub quota: Option<QuotaCharge>,
    /// What this begin makes of a processing record whose lease ended without an outcome (its
    /// owner died, its VM was reloaded, or its completion could not be written: whether its
    /// request reached the upstream is unknown). The engine maps the rule's policy to it
    /// (`engine::on_lease_end`); a store carries it out and decides nothing by the rule.
    pub on_lease_end: OnLeaseEnd,
    /// The route and key the record is about, kept with it for operators (the admin API). None:
    /// a record without one (tests).
    pub label: Option<Label>,
    /// How long a tombstone of the record stands after its completion (`routes[].tombstone_ttl`;
    /// 0: none). Not 0: a begin that finds no live record reads the scope's tombstone before it
    /// claims (`tombstone::Tombstone::answer`), and the claim carries it to the completion.
    pub tombstone_ms: u64,
}

/// A record as an operator sees it (the admin API): where it is, what it is about, and its
/// stored response when asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordView {
    pub scope: ScopeId,
    /// Backend-specific, as `Claim::locator`.
    pub locator: u64,
    /// As it stands: completed if its outcome is committed, whatever its bucket entry says.
    pub entry: Entry,
    /// None: written before records carried their label.
    pub label: Option<Label>,
    pub snapshot: Option<Snapshot>,
    /// The shard it was found on (`store.shards`; 0 for a store of one): a change is made
    /// there.
    pub shard: u8,
}

/// How an operator names a record: the tag the filter's logs and access logs print (the first
/// 6 bytes of its scope id, 12 hex digits), or the whole scope id (64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordId {
    Tag([u8; 6]),
    Scope(ScopeId),
}

impl RecordId {
    pub fn parse(hex: &str) -> Option<RecordId> {
        let bytes = crate::codec::unhex(hex)?;
        match bytes.len() {
            6 => bytes.try_into().ok().map(RecordId::Tag),
            32 => bytes.try_into().ok().map(|b| RecordId::Scope(ScopeId(b))),
            _ => None,
        }
    }

    pub fn names(&self, scope: &ScopeId) -> bool {
        match self {
            RecordId::Tag(tag) => scope.0.starts_with(tag),
            RecordId::Scope(s) => s == scope,
        }
    }
}

/// Which records an operator asks for (the admin API): one record (`id`), or a list filtered by
/// state, route, key, tenant and host, `limit` at most, resuming after `cursor` (a
/// `RecordPage::next` of the same backend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordQuery {
    pub id: Option<RecordId>,
    pub state: StateFilter,
    pub route: Option<String>,
    pub key: Option<String>,
    /// As the label keeps it (`Label::tenant`: the header's values joined by commas).
    pub tenant: Option<String>,
    /// Normalized as the scope is (lower case, without the default port).
    pub host: Option<String>,
    pub limit: usize,
    pub cursor: Option<String>,
    /// With their stored responses (a lookup); a list leaves them out.
    pub detail: bool,
    pub now_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateFilter {
    All,
    OutcomeUnknown,
    Processing,
    Completed,
}

impl StateFilter {
    pub fn admits(self, e: &Entry) -> bool {
        match self {
            StateFilter::All => true,
            StateFilter::OutcomeUnknown => e.outcome_unknown(),
            StateFilter::Processing => !e.is_completed(),
            StateFilter::Completed => e.is_completed() && !e.outcome_unknown(),
        }
    }
}

impl RecordQuery {
    /// A look at the one record of `scope` at `now_ms`, without its response: how it stands.
    pub fn of_scope(scope: ScopeId, now_ms: u64) -> RecordQuery {
        RecordQuery {
            id: Some(RecordId::Scope(scope)),
            state: StateFilter::All,
            route: None,
            key: None,
            tenant: None,
            host: None,
            limit: 1,
            cursor: None,
            detail: false,
            now_ms,
        }
    }

    /// The route, key, tenant and host filters, on a record's label (a record without one, or
    /// whose label does not name its scope, matches none). A tenant or host longer than a label
    /// keeps is compared as the label keeps it (`record::label_part`).
    pub fn admits_label(&self, label: Option<&Label>) -> bool {
        let matches =
            |wanted: &Option<String>, got: Option<&str>| wanted.as_deref().is_none_or(|w| got == Some(w));
        let kept = |wanted: &Option<String>, max: usize, got: Option<&str>| {
            wanted.as_deref().is_none_or(|w| got == Some(&*label_part(w, max)))
        };
        matches(&self.route, label.map(Label::route))
            && matches(&self.key, label.map(Label::key))
            && kept(&self.tenant, LABEL_TENANT_MAX, label.and_then(Label::tenant))
            && kept(&self.host, LABEL_HOST_MAX, label.and_then(Label::host))
    }
}

impl From<RecordQuery> for StoreOp {
    fn from(q: RecordQuery) -> StoreOp {
        StoreOp::Records(q)
    }
}

/// The records a query found, and where a list goes on (None: nothing more to scan).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordPage {
    pub views: Vec<RecordView>,
    pub next: Option<String>,
    /// The store stopped at its bound of work for one call (the local store's `SCAN_READS`),
    /// not at the query's `limit`: the same query with `next` as its cursor (and the rest of its
    /// limit) goes on where it stopped, a tag's look-up too. Its caller (the admin API) asks
    /// again in a later callback, so that the worker serves requests in between.
    pub paused: bool,
}

/// What an operator does to a record they looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Amendment {
    /// Deleted, so the next request with its key executes (a completed one only with `force`).
    Release { force: bool },
    /// Settled with the upstream's real answer, which every retry then replays.
    Resolve(Snapshot),
}

impl Amendment {
    /// Why this cannot be done to `e` as it stands at `now_ms`, if it cannot: a claim within its
    /// lease may be executing right now, and so may the request of an unknown outcome recorded
    /// within its claim's lease (on a `refuse` rule the record is completed the moment its route
    /// times out, while the upstream may still be at work): such a record is not released, since
    /// its retry would execute beside it (resolving it, with what the upstream said, executes
    /// nothing). A known outcome is never replaced (a release of one needs `force`, which lifts
    /// nothing else). The lease is the one a takeover waits for: renewed while its owner is at
    /// work (C25), and on etcd kept by its lease key past that (`needs_claim_ended`).
    pub fn refusal(&self, e: &Entry, now_ms: u64) -> Option<Refusal> {
        if self.needs_claim_ended(e) && now_ms < e.lease_deadline_ms {
            return Some(Refusal::Live { lease_ends_at_ms: e.lease_deadline_ms });
        }
        let force = matches!(self, Amendment::Release { force: true });
        (e.is_completed() && !e.outcome_unknown() && !force).then_some(Refusal::Completed)
    }

    /// Whether this change must find the record's claim ended first (by its deadline, and on
    /// etcd by its lease key: the store's own clock): any change of a claim, and a release of an
    /// unknown outcome, whose request may still be at work. A known outcome's request answered.
    pub fn needs_claim_ended(&self, e: &Entry) -> bool {
        !e.is_completed() || (e.outcome_unknown() && matches!(self, Amendment::Release { .. }))
    }

    /// The completion a resolve writes: the record's own expiry kept.
    pub fn completion(outcome: Snapshot, e: &Entry, now_ms: u64) -> Completion {
        Completion {
            state: if outcome.status < 400 { State::Succeeded } else { State::FailedFinal },
            status: outcome.status,
            snapshot: Some(outcome),
            now_ms,
            ttl_ms: e.expires_at_ms.saturating_sub(now_ms),
        }
    }
}

/// Why an operator's release or resolve changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A claim within its lease: its request may be executing right now.
    Live { lease_ends_at_ms: u64 },
    /// Completed with a known outcome (a release needs `force`; a resolve never applies).
    Completed,
    /// Its owner settled it between the operator's look and the change.
    SettledMeanwhile,
    /// Not there any more (expired, released, replaced).
    Gone,
}

/// What a begin does with a processing record whose lease ended without an outcome, as its
/// `ClaimAttempt` says: the stores carry it out, the engine chose it (`engine::on_lease_end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLeaseEnd {
    /// Take the record over (`Begin::TookOver`): the request is forwarded again.
    TakeOver,
    /// Complete the record as outcome unknown (`Completion::outcome_unknown`, at the begin's
    /// time; on etcd guarded by the revision read) and answer `Begin::OutcomeUnknown`, so it is
    /// never forwarded again until its ttl ends, whoever asks: such a request must not execute
    /// twice because the first attempt's Envoy died before it could record what happened.
    MarkUnknown,
    /// Write nothing and answer `Begin::Unsettled`: the caller finds out what happened first
    /// (the upstream's lookup), then asks again as a takeover (`ClaimAttempt::after_lookup`).
    Report,
}

impl OnLeaseEnd {
    /// Whether a claim made under this instruction may lose its place once its lease ended
    /// (the local store's eviction for room): only when a begin would take it over anyway; an
    /// evicted claim's retry finds no record and executes again.
    pub fn may_evict(self) -> bool {
        match self {
            OnLeaseEnd::TakeOver => true,
            OnLeaseEnd::MarkUnknown | OnLeaseEnd::Report => false,
        }
    }
}

impl ClaimAttempt {
    /// `tombstone_ms` as its claim carries it: whole seconds, rounded up (a tombstone stands at
    /// most a second longer than asked).
    pub fn tombstone_s(&self) -> u32 {
        u32::try_from(self.tombstone_ms.div_ceil(1_000)).unwrap_or(u32::MAX)
    }

    /// The attempt a request makes once the upstream's lookup answered for an `Unsettled`
    /// record: it takes the lease-ended record over (to complete it with the lookup's answer,
    /// or to execute when the upstream never did), at a time of its own.
    pub fn after_lookup(self, now_ms: u64) -> ClaimAttempt {
        ClaimAttempt { on_lease_end: OnLeaseEnd::TakeOver, now_ms, ..self }
    }

    /// The processing record this attempt's claim writes (no outcome yet), at bucket
    /// `position` (the local store's; 0 elsewhere), with the flags and quota tags the store
    /// decided.
    pub fn processing_entry(&self, position: u8, flags: u8, tenant_tag: u64, principal_tag: u64) -> Entry {
        Entry {
            position,
            state: State::Processing,
            flags,
            status: 0,
            scope: self.scope,
            fingerprint: self.fingerprint,
            owner: self.owner,
            lease_deadline_ms: self.now_ms.saturating_add(self.lease_ms),
            expires_at_ms: self.now_ms.saturating_add(self.ttl_ms),
            charged_at_ms: self.now_ms,
            tenant_tag,
            principal_tag,
        }
    }
}

/// Who a new record counts against, and their bounds on live records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaCharge {
    /// Unkeyed SHA-256 of the tenant; None: no tenant quota (no tenant header, or no
    /// `quota.per_tenant`), so `per_tenant` is not used.
    pub tenant: Option<[u8; 32]>,
    /// Unkeyed SHA-256 of the principal (`scope::principal_digest`); None: no caller quota (no
    /// `quota.per_principal`), so `per_principal` is not used.
    pub principal: Option<[u8; 32]>,
    pub per_tenant: u32,
    pub per_principal: u32,
}

/// A held claim: the right to execute and then complete or release the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub scope: ScopeId,
    pub owner: u64,
    /// Backend-specific locator of the record (bucket and position for the local store).
    pub locator: u64,
    /// The record as the claim wrote it, when the store needs it to settle the claim without
    /// reading it first (etcd: a completion's or release's single guarded transaction rewrites
    /// or deletes it and its quota index keys). None: the store reads the record (the local
    /// store always does).
    pub written: Option<Entry>,
    /// The shard the claim is on (`store.shards`; 0 for a store of one).
    pub shard: u8,
    /// While the record's shard changes (`store.previous_shards`), the same claim on its old
    /// home: settled there too, so that Envoys still reading the old home see its outcome.
    pub old_home: Option<ShardClaim>,
    /// Its attempt's `tombstone_ms` in whole seconds, rounded up (`ClaimAttempt::tombstone_s`):
    /// the tombstone its completion leaves (0: none). Seconds in 32 bits (136 years) keep a
    /// claim, and so every store answer that carries one, within what the executor copies.
    pub tombstone_s: u32,
}

impl Claim {
    /// How long the tombstone its completion leaves stands (0: none).
    pub fn tombstone_ms(&self) -> u64 {
        u64::from(self.tombstone_s).saturating_mul(1_000)
    }
}

impl Claim {
    /// What renews this claim (`StoreOp::Renew`): its record on its shard, and while its
    /// shard changes its part on its old home too, each renewed on its own shard.
    pub fn renewals(&self) -> impl Iterator<Item = Renewal> + '_ {
        let home = Renewal { scope: self.scope, owner: self.owner, locator: self.locator, shard: self.shard };
        let old = self.old_home.map(|o| Renewal { locator: o.locator, shard: o.shard, ..home });
        std::iter::once(home).chain(old)
    }
}

/// A claim's part on another shard: where. Settled there as a claim whose record is read
/// first (`Claim::written` None): a change of shards is rare and short, and the claim stays
/// small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardClaim {
    pub shard: u8,
    pub locator: u64,
}

/// One claim its owner is still working on (its request is waiting for the upstream's answer, or
/// its completion is under way), to be kept for another lease (`StoreOp::Renew`): where its
/// record is, as the claim knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    pub scope: ScopeId,
    pub owner: u64,
    /// As `Claim::locator` (on `shard`; a moving claim's old home is a `Renewal` of its own).
    pub locator: u64,
    pub shard: u8,
}

/// What a renewal found of one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Its lease now runs another lease from the renewal.
    Renewed,
    /// No longer a claim, and no other's: its owner settled it (a completion or release that
    /// landed before the renewal did), or it is gone. Nothing more to renew, nothing wrong.
    Settled,
    /// Another owner's now: it was taken over after a lease that ended before it could be
    /// renewed, and a retry may have executed beside its owner.
    TakenOver,
}

/// Claims one `Renew` carries at most: etcd refuses a transaction with more than
/// `--max-txn-ops` (128 by default) compares or operations, and a renewal is one transaction.
pub const MAX_RENEWALS: usize = 64;

/// Claims of one shard and one processing lease (`MAX_RENEWALS` at most), kept for another
/// `lease_ms` from `now_ms` (never past their record's expiry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Renew {
    pub claims: Vec<Renewal>,
    pub lease_ms: u64,
    pub now_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// No live record existed; the caller owns a new one and must forward.
    Claimed(Claim),
    /// A processing record's lease had expired; the caller now owns it and must forward.
    TookOver(Claim),
    /// A completed record with the same fingerprint.
    Replay(Snapshot),
    /// Completed, but the response was too large to keep; it must not execute again.
    NotStored { status: u16 },
    /// No live record, but the tombstone of one completed with `status` and this fingerprint
    /// (`routes[].tombstone_ttl`): its response expired; it must not execute again.
    Expired { status: u16 },
    /// A processing record whose lease ended without an outcome, asked for by an attempt that
    /// says `OnLeaseEnd::Report` (a rule that reconciles): nothing was written. The upstream's lookup
    /// decides; the request then asks again as a takeover (`ClaimAttempt::after_lookup`).
    Unsettled,
    /// Completed as "outcome unknown" (`Completion::outcome_unknown`): the upstream may have
    /// executed and nobody knows its answer; it must not execute again.
    OutcomeUnknown,
    /// A live record with a different fingerprint.
    Mismatch,
    /// The original is still being processed; its lease ends in `retry_after_ms`.
    InFlight { retry_after_ms: u64 },
    /// No room for a new record without evicting a live one.
    Full { retry_after_ms: u64 },
    /// The tenant (`tenant: true`) or else the principal already holds its bound of live
    /// records; `retry_after_ms` hints when one of them may have stopped counting.
    QuotaExceeded { retry_after_ms: u64, tenant: bool },
}

/// How a forwarded request ended, for `complete`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub state: State,
    pub status: u16,
    /// None when the body is not kept (over `max_response_bytes`, or the response was cut after
    /// the upstream's status was seen): the outcome is kept without it and never re-executed.
    pub snapshot: Option<Snapshot>,
    pub now_ms: u64,
    pub ttl_ms: u64,
}

impl Completion {
    /// The record of a forwarded request whose outcome cannot be known (a timeout, a reset
    /// after the request was sent, a client gone while the upstream worked), completed at once
    /// with `unknown_outcome: "refuse"`: every retry until the ttl ends is refused, never
    /// executed. Written as FAILED_FINAL, status 0, without a body (`record` module docs), so
    /// every store writes it as it writes any outcome kept without its body.
    pub fn outcome_unknown(now_ms: u64, ttl_ms: u64) -> Completion {
        Completion {
            state: State::FailedFinal,
            status: STATUS_OUTCOME_UNKNOWN,
            snapshot: None,
            now_ms,
            ttl_ms,
        }
    }
}

/// What `begin` answers for a live completed record with the request's fingerprint: its
/// replay, or (no body kept) "not stored", or "outcome unknown". `snapshot` is the record's,
/// if it was read (a record with a body but no snapshot at hand is the caller's business).
pub fn completed_answer(entry: &Entry, snapshot: Option<Snapshot>) -> Option<Begin> {
    if entry.outcome_unknown() {
        return Some(Begin::OutcomeUnknown);
    }
    if !entry.body_stored() {
        return Some(Begin::NotStored { status: entry.status });
    }
    snapshot.map(Begin::Replay)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Done,
    /// The claim was no longer ours (taken over or expired): nothing was changed.
    Lost,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Every CAS attempt lost to other writers (`begin` and `release` only: `complete` does not
    /// give up while the caller owns the record).
    Contention,
    /// The store cannot be used (host error, missing pre-created key).
    Unavailable(String),
    /// Stored bytes this build cannot read; they are left alone, not overwritten.
    Corrupt(String),
    /// No answer came in time (a store across the network). Whether the operation happened is
    /// unknown, so it is handled as a failure: fail closed.
    TimedOut,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Contention => write!(f, "store contention: CAS retries exhausted"),
            StoreError::Unavailable(m) => write!(f, "store unavailable: {m}"),
            StoreError::Corrupt(m) => write!(f, "store holds unreadable data: {m}"),
            StoreError::TimedOut => write!(f, "store did not answer in time"),
        }
    }
}

/// (`testing`) The store's operations one at a time, each answered before the call returns: the
/// adapter through which the conformance suite, the model checkers and the engine's and flow's
/// tests drive every backend (the local store as it is, etcd through a blocking driver:
/// `etcd/blocking.rs`). The filter speaks only the seam (`seam::Store`), where an operation is
/// started and answered in place or as a conversation.
#[cfg(feature = "testing")]
pub trait RecordStore {
    fn begin(&self, attempt: &ClaimAttempt) -> Result<Begin, StoreError>;
    fn complete(&self, claim: &Claim, completion: &Completion) -> Result<Settled, StoreError>;
    fn release(&self, claim: &Claim) -> Result<Settled, StoreError>;
    /// Reclaims expired records in the next part of the store, and whatever housekeeping the
    /// backend needs (called about once a second by every live root); returns how many records
    /// were removed.
    fn sweep(&self, now_ms: u64) -> Result<u32, StoreError>;
    /// An operator's look at records (the admin API; never on a request's path).
    fn records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError>;
    /// Keeps each claim of `renew` for another lease: per claim, in order, what it found (a claim
    /// that is no longer its owner's is left as it is: whoever settled or took it over decides).
    fn renew(&self, renew: &Renew) -> Result<Vec<Kept>, StoreError>;
    /// An operator's change to a record `records` showed, as it stood then (`view`): refused if
    /// it no longer may be done, or if the record changed meanwhile.
    fn amend(
        &self,
        view: &RecordView,
        change: &Amendment,
        now_ms: u64,
    ) -> Result<Result<(), Refusal>, StoreError>;
}

/// One conversation with the store, as data: the engine says what to perform, the worker performs
/// it (the local store at once on shared data; a remote store as a callout while the request
/// stays paused) and hands back the `StoreAnswer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreOp {
    Begin(ClaimAttempt),
    Complete {
        claim: Claim,
        completion: Completion,
    },
    Release(Claim),
    /// Claims whose owners are still at work, kept for another lease.
    Renew(Renew),
    /// The admin API's: a look at records, then a change to one of them.
    Records(RecordQuery),
    Amend {
        view: Box<RecordView>,
        change: Amendment,
        now_ms: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAnswer {
    Begun(Result<Begin, StoreError>),
    Settled(Result<Settled, StoreError>),
    /// Per claim of the `Renew`, in order: kept, or why not.
    Renewed(Result<Vec<Kept>, StoreError>),
    Records(Result<RecordPage, StoreError>),
    Amended(Result<Result<(), Refusal>, StoreError>),
}

impl StoreAnswer {
    /// The answer `op` gets when the store could not be used for it.
    pub fn failed(op: &StoreOp, error: StoreError) -> StoreAnswer {
        match op {
            StoreOp::Begin(_) => StoreAnswer::Begun(Err(error)),
            StoreOp::Complete { .. } | StoreOp::Release(_) => StoreAnswer::Settled(Err(error)),
            StoreOp::Renew(_) => StoreAnswer::Renewed(Err(error)),
            StoreOp::Records(_) => StoreAnswer::Records(Err(error)),
            StoreOp::Amend { .. } => StoreAnswer::Amended(Err(error)),
        }
    }

    /// A begin's answer; any other kind is an error (`unexpected`).
    #[cfg(feature = "testing")]
    pub fn into_begun(self) -> Result<Begin, StoreError> {
        match self {
            StoreAnswer::Begun(begun) => begun,
            other => Err(other.unexpected()),
        }
    }

    /// A settlement's answer; any other kind is an error.
    pub fn into_settled(self) -> Result<Settled, StoreError> {
        match self {
            StoreAnswer::Settled(settled) => settled,
            other => Err(other.unexpected()),
        }
    }

    /// A renewal's answer; any other kind is an error.
    pub fn into_renewed(self) -> Result<Vec<Kept>, StoreError> {
        match self {
            StoreAnswer::Renewed(kept) => kept,
            other => Err(other.unexpected()),
        }
    }

    /// A list's answer; any other kind is an error.
    #[cfg(feature = "testing")]
    pub fn into_records(self) -> Result<RecordPage, StoreError> {
        match self {
            StoreAnswer::Records(page) => page,
            other => Err(other.unexpected()),
        }
    }

    /// An amendment's answer; any other kind is an error.
    #[cfg(feature = "testing")]
    pub fn into_amended(self) -> Result<Result<(), Refusal>, StoreError> {
        match self {
            StoreAnswer::Amended(done) => done,
            other => Err(other.unexpected()),
        }
    }

    /// The error of a caller that got this answer to an operation of another kind. It names the
    /// kind only: the answer may hold a stored response, which has no place in a log line.
    pub fn unexpected(&self) -> StoreError {
        let kind = match self {
            StoreAnswer::Begun(_) => "a begin's",
            StoreAnswer::Settled(_) => "a settlement's",
            StoreAnswer::Renewed(_) => "a renewal's",
            StoreAnswer::Records(_) => "a list's",
            StoreAnswer::Amended(_) => "an amendment's",
        };
        StoreError::Unavailable(format!("the store gave {kind} answer to another operation"))
    }
}

#[cfg(feature = "testing")]
impl StoreOp {
    /// Performs the operation through the test adapter.
    pub fn perform(&self, store: &dyn RecordStore) -> StoreAnswer {
        match self {
            StoreOp::Begin(attempt) => StoreAnswer::Begun(store.begin(attempt)),
            StoreOp::Complete { claim, completion } => {
                StoreAnswer::Settled(store.complete(claim, completion))
            }
            StoreOp::Release(claim) => StoreAnswer::Settled(store.release(claim)),
            StoreOp::Renew(renew) => StoreAnswer::Renewed(store.renew(renew)),
            StoreOp::Records(query) => StoreAnswer::Records(store.records(query)),
            StoreOp::Amend { view, change, now_ms } => {
                StoreAnswer::Amended(store.amend(view, change, *now_ms))
            }
        }
    }
}
