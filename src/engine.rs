//! The decision engine: from a request's head and body to a decision, as data. Pure: the worker
//! hands it header values and bytes, a store and the time, and turns its answers into host calls.
//!
//! A protected request goes through two steps:
//! 1. `admit` (request headers): route rule, key, scope, early size check. Either the request is
//!    none of our business (pass through), is refused at once, or must be held until its body
//!    has arrived.
//! 2. at the end of the body (`flow::RequestFlow` carries the steps): `fingerprint_body`, then
//!    `claim_attempt` for one atomic `begin` on the store, whose answer `decision_of` turns into
//!    forward-with-claim, replay, wait, or a problem reply.

use crate::config::{Concurrency, Config, KeySource, Rule, ScopeHost, UnknownOutcome};
use crate::identity::canonical::MAX_DEPTH;
use crate::identity::fingerprint::{self, Fingerprint, FingerprintInput};
use crate::identity::key::{key_from_json, parse_key, IdempotencyKey, KeyError};
use crate::identity::scope::{
    cluster_host, jwt_principal_digest, normalize_authority, principal_digest, scope_id, tenant_digest,
    ScopeId, ScopeParts,
};
use crate::json::MemberOrder;
use crate::metrics::Counter;
use crate::problem::{Kind, Problem};
use crate::store::record::{Label, LabelScope, Snapshot};
use crate::store::{Begin, Claim, ClaimAttempt, OnLeaseEnd, QuotaCharge, StoreError};
use std::borrow::Cow;
use std::rc::Rc;

/// Header added to every replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Header carrying the original status when the original body was not stored.
pub const ORIGINAL_STATUS_HEADER: &str = "idempotent-original-status";

/// The request as the worker read it: lowercase header names (pseudo-headers included), raw values.
pub struct RequestHead<'a> {
    pub method: &'a str,
    /// `:path` as received, with the query.
    pub path: &'a str,
    pub headers: &'a [(String, Vec<u8>)],
    /// The values of `Config::jwt_principal`'s claims, in its order, from the payload a JWT
    /// filter in front verified; `None` when no verified payload exists for this request.
    pub verified_claims: Option<&'a [Option<Vec<u8>>]>,
    /// The upstream cluster Envoy routed the request to, read only for `scope_host: "cluster"`.
    pub cluster: Option<&'a [u8]>,
}

impl RequestHead<'_> {
    fn values(&self, name: &str) -> Vec<&[u8]> {
        self.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()).collect()
    }

    /// The first value of `name` (empty when absent), without collecting them all.
    fn first(&self, name: &str) -> &[u8] {
        self.headers.iter().find(|(n, _)| n == name).map_or(&[], |(_, v)| v.as_slice())
    }
}

/// A protected request waiting for its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The rule it matched, resolved once at admission: it holds for the request's whole life,
    /// even across a configuration update.
    pub rule: Rc<Rule>,
    /// For a key in the body (`KeySource::in_body`), set by `key_body` when the body is whole:
    /// nothing reads it before.
    pub scope: ScopeId,
    /// The rule's name and the Idempotency-Key, kept with the record for operators: built once
    /// here, so that every attempt of this request shares it (for a key in the body, by
    /// `key_body`).
    label: Label,
    /// What the scope is made of besides the key, kept only while the key is in the body.
    unkeyed: Option<Box<Unkeyed>>,
    /// Digest of the tenant's header values (None: no tenant header configured).
    tenant: Option<[u8; 32]>,
    principal: [u8; 32],
    method: String,
    path: String,
    query: Option<String>,
    fingerprint_headers: Vec<(String, Vec<Vec<u8>>)>,
    content_type: Option<String>,
}

/// The scope's parts a request with its key in its body keeps until the body is whole.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Unkeyed {
    authority: Vec<u8>,
    tenant: Option<Vec<Vec<u8>>>,
}

/// What the body said about a request whose key is in it (`key_body`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unprotected {
    /// No key, and the rule does not require one: forwarded without a claim, as a request
    /// without a key header is.
    PassThrough,
    Reject(Problem),
}

#[derive(Debug, Clone, PartialEq, Eq)]
// Made once per request and moved once into the flow: boxing the pending request would cost
// every protected request an allocation to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
pub enum Admission {
    PassThrough,
    Reject(Problem),
    Collect(Pending),
}

/// A complete reply the worker sends as is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// For a replay: the framing headers the stored response had, which Envoy's local-reply
    /// path may drop or invent; the worker restores them when the reply passes its own encode
    /// callback (`replay_header_fixes`).
    pub replay_shape: Option<ReplayShape>,
}

/// `response.code_details` of the filter's own replies, so logs tell them apart.
pub const DETAILS_REPLAY: &str = "idempotency_replay";
pub const DETAILS_PROBLEM: &str = "idempotency_problem";

/// The `response.code_details` of a reply counted as `counter`.
pub fn reply_details(counter: Counter) -> &'static str {
    if counter == Counter::Replayed {
        DETAILS_REPLAY
    } else {
        DETAILS_PROBLEM
    }
}

/// What a replay's `content-type` and `content-length` must be, as the upstream sent them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayShape {
    pub content_type: Option<Vec<u8>>,
    pub content_length: Option<Vec<u8>>,
}

/// A change the worker makes to a replay's headers on their way out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderFix {
    Set(&'static str, Vec<u8>),
    Remove(&'static str),
}

impl Reply {
    pub fn problem(p: &Problem) -> Reply {
        Reply {
            status: p.status,
            headers: p.response_headers().into_iter().map(|(n, v)| (n.to_string(), v.into_bytes())).collect(),
            body: p.body(),
            replay_shape: None,
        }
    }

    /// The stored response as a local reply. `content-length` is not handed to Envoy: its
    /// local-reply path computes it from the body (and drops it for an empty one), so a stored
    /// value only comes back through `replay_header_fixes` where the body cannot carry it
    /// (HEAD, 204). `replay_shape` is set only when Envoy's rules say the reply will need a
    /// fix, so a replay that needs none costs no read of its response headers.
    pub fn replay(s: Snapshot) -> Reply {
        let find = |name: &str| s.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let shape =
            ReplayShape { content_type: find("content-type"), content_length: find("content-length") };
        let (sent_type, sent_length) = local_reply_content_headers(&shape, &s.body);
        let needs_fix = !replay_header_fixes(&shape, sent_type.as_deref(), sent_length.as_deref()).is_empty();
        let mut headers: Vec<_> = s.headers.into_iter().filter(|(n, _)| n != "content-length").collect();
        headers.push((REPLAYED_HEADER.to_string(), b"true".to_vec()));
        Reply { status: s.status, headers, body: s.body, replay_shape: needs_fix.then_some(shape) }
    }
}

/// The `content-type` and `content-length` Envoy's local-reply path gives a reply carrying the
/// stored `content-type` (if any) and `body` (`Utility::prepareLocalReply`, Envoy 1.40): with a
/// body, the body's length and the given type, `text/plain` if none was given; without one,
/// neither. An HCM `local_reply_config` that rewrites replies is the operator's choice and
/// rewrites replays too (docs/CONTRACT.md, "Replays are faithful").
fn local_reply_content_headers(shape: &ReplayShape, body: &[u8]) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    if body.is_empty() {
        return (None, None);
    }
    let content_type = shape.content_type.clone().unwrap_or_else(|| b"text/plain".to_vec());
    (Some(content_type), Some(body.len().to_string().into_bytes()))
}

/// How a replay's headers, as Envoy's local-reply path prepared them (`sent_content_type`,
/// `sent_content_length`), must change to be the stored ones again. Envoy drops
/// `content-type` from a reply with an empty body and adds `text/plain` to a body without one
/// (`Utility::prepareLocalReply`), and never keeps a `content-length` without a body.
pub fn replay_header_fixes(
    shape: &ReplayShape,
    sent_content_type: Option<&[u8]>,
    sent_content_length: Option<&[u8]>,
) -> Vec<HeaderFix> {
    let mut fixes = Vec::new();
    match (&shape.content_type, sent_content_type) {
        (Some(want), got) if got != Some(want.as_slice()) => {
            fixes.push(HeaderFix::Set("content-type", want.clone()))
        }
        (None, Some(_)) => fixes.push(HeaderFix::Remove("content-type")),
        _ => {}
    }
    if let (Some(want), None) = (&shape.content_length, sent_content_length) {
        fixes.push(HeaderFix::Set("content-length", want.clone()));
    }
    fixes
}

/// What the store's answer to a `begin` means for the request: its first, or a waiter's look at
/// its record again (`flow::RequestFlow::recheck`). The one enum of a waiter's fate too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Forward upstream; the claim must later be completed or released.
    Forward { claim: Claim, counter: Counter },
    /// Answer locally (replay or problem) without calling the upstream.
    Respond { reply: Reply, counter: Counter },
    /// Wait mode: the original is processing; hold this request (wait.rs), or hold a waiter
    /// again until its give-up time.
    Wait { lease_remaining_ms: u64 },
}

fn split_path(path: &str) -> (&str, Option<&str>) {
    match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    }
}

fn first_str(values: &[&[u8]]) -> Option<String> {
    values.first().map(|v| crate::host::pairs::text(v).into_owned())
}

/// Step 1, at request headers.
pub fn admit(cfg: &Config, head: &RequestHead) -> Admission {
    let (path, query) = split_path(head.path);
    let Some(rule) = cfg.rule_for(head.method, path) else {
        return Admission::PassThrough;
    };
    let key = match &rule.key {
        KeySource::Header { name, own } => match parse_key(&head.values(name)) {
            Ok(key) => Some(key),
            Err(KeyError::Missing) if !rule.require_key => return Admission::PassThrough,
            Err(e) if *own => {
                return Admission::Reject(key_problem(e, &format!("in the header {name}"), cfg))
            }
            Err(e) => return Admission::Reject(Problem::for_key_error(e, cfg.problem_statuses.invalid_key)),
        },
        KeySource::Json { .. } | KeySource::Fingerprint => None,
    };
    if let Some(problem) = content_length_problem(rule, head) {
        return Admission::Reject(problem);
    }
    if is_grpc(head) {
        return Admission::Reject(grpc_refused());
    }
    let tenant_values = cfg.tenant_header.as_ref().map(|h| head.values(h));
    let principal = match principal(cfg, head) {
        Ok(principal) => principal,
        Err(problem) => return Admission::Reject(problem),
    };
    let authority = match (cfg.scope_host, head.cluster) {
        (ScopeHost::None, _) => Cow::Borrowed(&[][..]),
        (ScopeHost::Cluster, Some(cluster)) => Cow::Owned(cluster_host(cluster)),
        // Routed to no cluster (Envoy answers it itself: nothing executes), or the default.
        _ => normalize_authority(head.first(":authority"), head.first(":scheme")),
    };
    let parts = KeyedParts {
        tenant: tenant_values.as_deref(),
        principal,
        authority: &authority,
        method: head.method,
        path,
    };
    let (scope, label, unkeyed) = match &key {
        Some(key) => {
            let (scope, label) = parts.keyed(rule, key);
            (scope, label, None)
        }
        // Placeholders until the body gives the key (`key_body`).
        None => (
            ScopeId::default(),
            parts.label(rule, ""),
            Some(Box::new(Unkeyed {
                authority: authority.to_vec(),
                tenant: tenant_values.as_ref().map(|vs| vs.iter().map(|v| v.to_vec()).collect()),
            })),
        ),
    };
    Admission::Collect(Pending {
        rule: Rc::clone(rule),
        scope,
        label,
        unkeyed,
        tenant: tenant_values.as_deref().map(tenant_digest),
        principal,
        method: head.method.to_string(),
        path: path.to_string(),
        query: query.map(str::to_string),
        fingerprint_headers: rule
            .fingerprint_headers
            .iter()
            .map(|h| (h.clone(), head.values(h).into_iter().map(<[u8]>::to_vec).collect()))
            .collect(),
        content_type: first_str(&head.values("content-type")),
    })
}

/// A key error from a rule's own source: its place named, the configured status.
fn key_problem(e: KeyError, place: &str, cfg: &Config) -> Problem {
    let kind = if e == KeyError::Missing { Kind::MissingKey } else { Kind::InvalidKey };
    Problem::new(kind, cfg.problem_statuses.invalid_key, e.detail_at(place))
}

/// What a record's scope holds besides its key.
struct KeyedParts<'a> {
    tenant: Option<&'a [&'a [u8]]>,
    principal: [u8; 32],
    authority: &'a [u8],
    method: &'a str,
    path: &'a str,
}

impl KeyedParts<'_> {
    fn keyed(&self, rule: &Rule, key: &IdempotencyKey) -> (ScopeId, Label) {
        let scope = scope_id(&ScopeParts {
            tenant: self.tenant,
            principal: self.principal,
            authority: self.authority,
            method: self.method,
            path: self.path,
            key: &scope_key(&rule.key, key.as_str()),
        });
        (scope, self.label(rule, key.as_str()))
    }

    fn label(&self, rule: &Rule, key: &str) -> Label {
        Label::scoped(
            &rule.name,
            key,
            &LabelScope {
                method: self.method,
                host: self.authority,
                path: self.path,
                tenant: self.tenant,
                principal: &self.principal,
            },
        )
    }
}

/// The key as the scope holds it: `key_header`'s as it is (every build's scope before
/// `routes[].key`), any other source's named before it. A key never holds a space, so no key
/// from one source is ever another's: the header value "42" and the body value 42 are two
/// records.
fn scope_key<'k>(source: &KeySource, key: &'k str) -> Cow<'k, str> {
    match source {
        KeySource::Header { own: false, .. } => Cow::Borrowed(key),
        KeySource::Header { name, own: true } => Cow::Owned(format!("header {name} {key}")),
        KeySource::Json { pointer, .. } => Cow::Owned(format!("json {pointer} {key}")),
        KeySource::Fingerprint => Cow::Owned(format!("fingerprint {key}")),
    }
}

/// For a rule whose key is in the body (`KeySource::in_body`), the whole body's key: its scope
/// and label are set here. `fingerprint` is the request's, already computed: with
/// `KeySource::Fingerprint` it is the key. A body that is not JSON or lacks the field has no key.
pub fn key_body(
    cfg: &Config,
    pending: &mut Pending,
    body: &[u8],
    fingerprint: &Fingerprint,
) -> Result<(), Unprotected> {
    let Some(unkeyed) = pending.unkeyed.take() else { return Ok(()) };
    let rule = Rc::clone(&pending.rule);
    let key = match &rule.key {
        KeySource::Json { pointer, tokens } => {
            let doc = crate::json::read(body, MAX_DEPTH, MemberOrder::Document);
            match key_from_json(doc.as_ref().ok().and_then(|d| d.at(tokens))) {
                Ok(key) => key,
                Err(KeyError::Missing) if !rule.require_key => return Err(Unprotected::PassThrough),
                Err(e) => {
                    return Err(Unprotected::Reject(key_problem(
                        e,
                        &format!("at {pointer} in the JSON body"),
                        cfg,
                    )))
                }
            }
        }
        KeySource::Fingerprint => match parse_key(&[fingerprint.to_hex().as_bytes()]) {
            Ok(key) => key,
            Err(_) => return Err(Unprotected::PassThrough),
        },
        KeySource::Header { .. } => return Ok(()),
    };
    let tenant: Option<Vec<&[u8]>> = unkeyed.tenant.as_ref().map(|vs| vs.iter().map(Vec::as_slice).collect());
    let parts = KeyedParts {
        tenant: tenant.as_deref(),
        principal: pending.principal,
        authority: &unkeyed.authority,
        method: &pending.method,
        path: &pending.path,
    };
    let (scope, label) = parts.keyed(&rule, &key);
    pending.scope = scope;
    pending.label = label;
    Ok(())
}

/// The caller: the verified claims when a JWT filter in front verified a token (stable across
/// token refreshes), otherwise the configured principal headers' values. A verified payload
/// must carry every configured claim: callers whose tokens lack one (say `sub`) could not be
/// told apart, and would replay each other's answers. Such a request is refused, not given the
/// principal headers' identity, which the operator chose not to trust by configuring claims.
fn principal(cfg: &Config, head: &RequestHead) -> Result<[u8; 32], Problem> {
    if let (Some(jwt), Some(values)) = (&cfg.jwt_principal, head.verified_claims) {
        let missing: Vec<&str> = jwt
            .claims
            .iter()
            .enumerate()
            .filter(|(i, _)| values.get(*i).is_none_or(Option::is_none))
            .map(|(_, name)| name.as_str())
            .collect();
        if !missing.is_empty() {
            return Err(principal_incomplete(&missing));
        }
        let claims: Vec<(&str, Option<&[u8]>)> =
            jwt.claims.iter().zip(values).map(|(name, v)| (name.as_str(), v.as_deref())).collect();
        return Ok(jwt_principal_digest(&claims));
    }
    let principal_headers: Vec<(&str, Vec<&[u8]>)> =
        cfg.principal_headers.iter().map(|h| (h.as_str(), head.values(h))).collect();
    Ok(principal_digest(&principal_headers))
}

/// 403: the caller is authenticated, but its token cannot name it. The claim names come from
/// the configuration, never from the request.
fn principal_incomplete(missing: &[&str]) -> Problem {
    Problem::new(
        Kind::PrincipalIncomplete,
        403,
        format!(
            "the verified token lacks the claim(s) {} that identify the caller for idempotency \
             (principal.claims); the request was not executed",
            missing.join(", ")
        ),
    )
}

/// gRPC requests are recognised the way Envoy's local-reply path recognises them: by
/// content-type, so exactly the requests whose replies Envoy would rewrite are refused.
fn is_grpc(head: &RequestHead) -> bool {
    head.values("content-type")
        .first()
        .is_some_and(|v| v.len() >= 16 && v[..16].eq_ignore_ascii_case(b"application/grpc"))
}

/// gRPC status UNIMPLEMENTED, set explicitly: Envoy keeps a `grpc-status` the reply carries
/// instead of deriving one from the HTTP status.
const GRPC_UNIMPLEMENTED: &str = "12";

fn grpc_refused() -> Problem {
    let mut p = Problem::new(
        Kind::GrpcNotSupported,
        415,
        "gRPC calls cannot be protected by the idempotency filter: Envoy would rewrite their replays; \
         exclude this route or method from the filter's rules",
    );
    p.headers.push(("grpc-status", GRPC_UNIMPLEMENTED.to_string()));
    p
}

fn content_length_problem(rule: &Rule, head: &RequestHead) -> Option<Problem> {
    let declared = head
        .values("content-length")
        .first()
        .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<u64>().ok())?;
    (declared > rule.max_request_bytes).then(|| too_large(rule))
}

pub fn too_large(rule: &Rule) -> Problem {
    Problem::new(
        Kind::RequestTooLarge,
        413,
        format!("the request body exceeds {} bytes, the limit for this endpoint", rule.max_request_bytes),
    )
}

impl Pending {
    /// The record's label: route, key and scope as operators see them.
    pub fn label(&self) -> &Label {
        &self.label
    }

    pub fn fingerprint(&self, body: &[u8]) -> Fingerprint {
        let header_values: Vec<(&str, Vec<&[u8]>)> = self
            .fingerprint_headers
            .iter()
            .map(|(n, vs)| (n.as_str(), vs.iter().map(Vec::as_slice).collect()))
            .collect();
        let input = FingerprintInput {
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            headers: &header_values,
            content_type: self.content_type.as_deref(),
            body,
        };
        fingerprint::fingerprint(&input, &self.rule.ignore_json_fields).0
    }
}

/// The request's fingerprint, computed once: a waiter keeps only these 32 bytes and is
/// rechecked with them, never with its body again.
pub fn fingerprint_body(pending: &Pending, body: &[u8]) -> Result<Fingerprint, Problem> {
    if body.len() as u64 > pending.rule.max_request_bytes {
        return Err(too_large(&pending.rule));
    }
    Ok(pending.fingerprint(body))
}

/// What `begin` is asked for this request: its scope and fingerprint, a fresh owner, the rule's
/// lease and ttl, and the quota a new record is charged to: only the identities with a
/// configured bound (the tenant's only with a tenant header); none at all without `quota`, so
/// no quota counter is read or written.
pub fn claim_attempt(
    cfg: &Config,
    pending: &Pending,
    fingerprint: Fingerprint,
    now_ms: u64,
    owner: u64,
) -> ClaimAttempt {
    let rule = &pending.rule;
    ClaimAttempt {
        scope: pending.scope,
        fingerprint,
        owner,
        now_ms,
        lease_ms: rule.processing_timeout_ms,
        ttl_ms: rule.ttl_ms,
        quota: quota_charge(cfg, pending),
        on_lease_end: on_lease_end(rule.unknown_outcome),
        label: Some(pending.label.clone()),
        tombstone_ms: rule.tombstone_ms,
    }
}

/// What the stores do with a claim whose lease ended without an outcome, by a rule's
/// `unknown_outcome`: the one place the policy becomes the stores' instruction.
pub fn on_lease_end(policy: UnknownOutcome) -> OnLeaseEnd {
    match policy {
        UnknownOutcome::Takeover => OnLeaseEnd::TakeOver,
        UnknownOutcome::Refuse => OnLeaseEnd::MarkUnknown,
        UnknownOutcome::Reconcile => OnLeaseEnd::Report,
    }
}

fn quota_charge(cfg: &Config, pending: &Pending) -> Option<QuotaCharge> {
    let tenant = pending.tenant.filter(|_| cfg.quota.per_tenant.is_some());
    let principal = cfg.quota.per_principal.map(|_| pending.principal);
    (tenant.is_some() || principal.is_some()).then(|| QuotaCharge {
        tenant,
        principal,
        per_tenant: cfg.quota.per_tenant.unwrap_or(u32::MAX),
        per_principal: cfg.quota.per_principal.unwrap_or(u32::MAX),
    })
}

/// What the store's answer to `begin` means for the request.
pub fn decision_of(cfg: &Config, pending: &Pending, begun: Result<Begin, StoreError>) -> Decision {
    let rule = &pending.rule;
    let statuses = cfg.problem_statuses;
    match begun {
        Ok(Begin::Claimed(claim)) => Decision::Forward { claim, counter: Counter::Claimed },
        Ok(Begin::TookOver(claim)) => Decision::Forward { claim, counter: Counter::TakenOver },
        Ok(Begin::Replay(snapshot)) => Decision::Respond { reply: Reply::replay(snapshot), counter: Counter::Replayed },
        Ok(Begin::NotStored { status }) => {
            let mut p = Problem::new(
                Kind::ResponseNotStored,
                410,
                format!(
                    "the request with this Idempotency-Key was executed (upstream status {status}), but its \
                     response was not kept (larger than the filter keeps, or cut off before its end), so it cannot \
                     be replayed; it will not be executed again"
                ),
            );
            p.headers.push((ORIGINAL_STATUS_HEADER, status.to_string()));
            respond_problem(p)
        }
        // The way out: the status says what happened; the resource itself is the upstream's to
        // show (its own lookup), as it is once a record is forgotten.
        Ok(Begin::Expired { status }) => {
            let mut p = Problem::new(
                Kind::ResultExpired,
                410,
                format!(
                    "the request with this Idempotency-Key was executed (upstream status {status}); its response \
                     is no longer kept (the record's ttl ended) but the key is remembered: it will not be executed \
                     again. Ask the API for the resource itself"
                ),
            );
            p.headers.push((ORIGINAL_STATUS_HEADER, status.to_string()));
            respond_problem(p)
        }
        Ok(Begin::OutcomeUnknown) => respond_problem(outcome_unknown()),
        // Only a request that asks the upstream's lookup settles such a record (flow.rs). A
        // waiter stays held until it settles (the lookup of the Envoy that saw the unknown
        // outcome, or another request's) or its wait_timeout ends; it looks again within a second.
        Ok(Begin::Unsettled) => match rule.concurrency {
            Concurrency::Wait { .. } => Decision::Wait { lease_remaining_ms: LOOKUP_SPACING_MS },
            Concurrency::Reject => respond_problem(unsettled(LOOKUP_SPACING_MS)),
        },
        Ok(Begin::Mismatch) => respond_problem(Problem::new(
            Kind::PayloadMismatch,
            statuses.mismatch,
            "this Idempotency-Key was already used with a different request (method, path, query, headers or body)",
        )),
        Ok(Begin::InFlight { retry_after_ms }) => match rule.concurrency {
            Concurrency::Wait { .. } => Decision::Wait { lease_remaining_ms: retry_after_ms },
            Concurrency::Reject => {
                Decision::Respond { reply: in_flight_reply(cfg, retry_after_ms), counter: Counter::InFlight }
            }
        },
        Ok(Begin::Full { retry_after_ms }) => respond_problem(
            Problem::new(Kind::StoreFull, 503, "no room for a new idempotency record; retry later")
                .retry_after_ms(retry_after_ms),
        ),
        Ok(Begin::QuotaExceeded { retry_after_ms, tenant }) => {
            let who = if tenant { "this tenant" } else { "this caller" };
            respond_problem(
                Problem::new(
                    Kind::QuotaExceeded,
                    429,
                    format!("{who} holds as many live idempotency records as allowed; retry when some expire"),
                )
                .retry_after_ms(retry_after_ms),
            )
        }
        Err(e) => {
            log::warn!("idempotency store error for {}: {e}", pending.scope.log_tag());
            match e {
                StoreError::Corrupt(_) => respond_problem(record_unreadable()),
                _ => respond_problem(store_unavailable()),
            }
        }
    }
}

/// 502 for a retry of a record completed as "outcome unknown" (`unknown_outcome: "refuse"`).
/// 502 because the gateway has no valid answer from the upstream to give, and did not send the
/// request again; no `retry-after`, since retrying with this key never gets another answer.
pub fn outcome_unknown() -> Problem {
    Problem::new(
        Kind::OutcomeUnknown,
        502,
        "the request first sent with this Idempotency-Key may have executed, but its outcome is unknown (the \
         upstream timed out or the connection was lost); it will not be executed again with this key. Reconcile \
         with the upstream (check whether it took effect), then send a new Idempotency-Key if it must run",
    )
}

/// Lookups for one record are at least this far apart on one worker (`routes[].reconcile`).
pub const LOOKUP_SPACING_MS: u64 = 1_000;

/// 503 with `retry-after` for a retry of a record whose outcome is unknown and whose lookup
/// settled nothing yet (it failed, or another is under way): the next retry asks again.
pub fn unsettled(retry_after_ms: u64) -> Problem {
    Problem::new(
        Kind::OutcomeUnknown,
        503,
        "the request first sent with this Idempotency-Key may have executed, and the upstream could not yet \
         say whether it did; retry with the same Idempotency-Key later: it is never executed twice",
    )
    .retry_after_ms(retry_after_ms)
}

/// 503 with `retry-after`: the store failed or did not answer in time. Fail closed: nothing
/// executes without a claim.
pub fn store_unavailable() -> Problem {
    Problem::new(Kind::StoreUnavailable, 503, "the idempotency store could not be used; retry later")
        .retry_after_ms(1000)
}

/// 503 for a record this build cannot read (a newer build's, in a rollback, or damaged): left
/// as it is, never overwritten, and nothing executed. `retry-after`: an Envoy of the newer build
/// reads it.
pub fn record_unreadable() -> Problem {
    Problem::new(
        Kind::StoreUnavailable,
        503,
        "the record of this Idempotency-Key is in a form this build of the filter cannot read (written by a \
         newer build, or damaged); it was left as it is and the request was not executed; retry later",
    )
    .retry_after_ms(1000)
}

/// 409 (or the configured status) with `retry-after`: the original is still processing.
pub fn in_flight_reply(cfg: &Config, retry_after_ms: u64) -> Reply {
    let p = Problem::new(
        Kind::RequestInFlight,
        cfg.problem_statuses.in_flight,
        "a request with this Idempotency-Key is still being processed; retry later",
    )
    .retry_after_ms(retry_after_ms);
    Reply::problem(&p)
}

pub fn respond_problem(p: Problem) -> Decision {
    Decision::Respond { reply: Reply::problem(&p), counter: Counter::of_problem(p.kind) }
}

/// Headers that belong to one connection hop and never to a stored response (RFC 9110 7.6.1).
/// `content-length` is kept: a replay's body carries its own length, but a HEAD or 204 answer's
/// stored value is restored from it (`Reply::replay`). An operator's resolve may not give them
/// (the admin API).
pub const NOT_STORED_HEADERS: &[&str] =
    &["connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"];

/// The response headers a snapshot keeps: all but hop-by-hop ones and the rule's exclusions.
pub fn snapshot_headers(headers: Vec<(String, Vec<u8>)>, excluded: &[String]) -> Vec<(String, Vec<u8>)> {
    let named_by_connection: Vec<String> = headers
        .iter()
        .filter(|(n, _)| n == "connection")
        .flat_map(|(_, v)| {
            String::from_utf8_lossy(v).split(',').map(|t| t.trim().to_ascii_lowercase()).collect::<Vec<_>>()
        })
        .collect();
    headers
        .into_iter()
        .filter(|(n, _)| {
            !n.starts_with(':')
                && !n.starts_with("proxy-")
                && !NOT_STORED_HEADERS.contains(&n.as_str())
                && !named_by_connection.iter().any(|c| c == n)
                && !excluded.iter().any(|x| x == n)
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::RecordStore;

    /// The whole decision for a request whose body is known, against a store that answers at
    /// once: what `flow::RequestFlow` does in steps, in one call for these unit tests.
    pub(crate) fn decide(
        cfg: &Config,
        pending: &Pending,
        body: &[u8],
        store: &dyn RecordStore,
        now_ms: u64,
        owner: u64,
    ) -> Decision {
        match fingerprint_body(pending, body) {
            Ok(fingerprint) => decision_of(
                cfg,
                pending,
                store.begin(&claim_attempt(cfg, pending, fingerprint, now_ms, owner)),
            ),
            Err(problem) => respond_problem(problem),
        }
    }
    use crate::config::{parse, Quota};
    use crate::identity::scope::tenant_digest;
    use crate::store::fake::FakeSharedData;
    use crate::store::local::LocalStore;
    use crate::store::record::State;
    use crate::store::Completion;

    const CONFIG: &str = r#"{
        "tenant_header": "x-tenant-id",
        "problem_statuses": {"mismatch": 409},
        "store": {"type": "local", "capacity": 64},
        "routes": [
          {"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]}, "require_key": true,
           "max_request_bytes": 100, "fingerprint": {"headers": ["x-api-version"], "ignore_json_fields": ["/sent_at"]}},
          {"name": "optional", "match": {"exact": "/carts"}}
        ]}"#;

    fn cfg() -> Config {
        parse(CONFIG.as_bytes()).unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    fn admit_with(method: &str, path: &str, pairs: &[(&str, &str)]) -> Admission {
        let h = headers(pairs);
        admit(&cfg(), &RequestHead { method, path, headers: &h, verified_claims: None, cluster: None })
    }

    fn pending(pairs: &[(&str, &str)]) -> Pending {
        match admit_with("POST", "/orders?x=1", pairs) {
            Admission::Collect(p) => p,
            other => panic!("{other:?}"),
        }
    }

    fn problem_kind(a: Admission) -> Kind {
        match a {
            Admission::Reject(p) => p.kind,
            other => panic!("{other:?}"),
        }
    }

    /// The body of the reply `decision_of` gives for a store's answer, as text.
    fn answered_with(begun: Result<Begin, StoreError>) -> (u16, String) {
        let p = pending(&[("idempotency-key", "k")]);
        match decision_of(&cfg(), &p, begun) {
            Decision::Respond { reply, .. } => {
                (reply.status, String::from_utf8_lossy(&reply.body).into_owned())
            }
            other => panic!("{other:?}"),
        }
    }

    /// C15: a kept status whose body is not (too large, or cut mid-body) says both ways it can
    /// happen, not only one of them.
    #[test]
    fn a_record_without_its_body_says_it_was_not_kept() {
        let (status, body) = answered_with(Ok(Begin::NotStored { status: 201 }));
        assert_eq!(status, 410);
        assert!(
            body.contains(
                "was executed (upstream status 201), but its response was not kept (larger than the filter keeps, \
                 or cut off before its end), so it cannot be replayed; it will not be executed again"
            ),
            "{body}"
        );
    }

    /// A record this build cannot read (a newer build's, in a rollback) is said to be that, not
    /// a store that could not be used.
    #[test]
    fn a_record_this_build_cannot_read_is_said_to_be_one() {
        let unreadable =
            StoreError::Corrupt("etcd record: format version 5, written by a newer build".into());
        let (status, body) = answered_with(Err(unreadable));
        assert_eq!(status, 503);
        assert!(
            body.contains(
                "in a form this build of the filter cannot read (written by a newer build, or damaged); \
                               it was left as it is and the request was not executed"
            ),
            "{body}"
        );
        let (status, body) = answered_with(Err(StoreError::TimedOut));
        assert_eq!((status, body.contains("could not be used")), (503, true), "{body}");
    }

    #[test]
    fn unmatched_requests_pass_through_even_with_a_bad_key() {
        assert_eq!(admit_with("GET", "/orders", &[("idempotency-key", "a b")]), Admission::PassThrough);
        assert_eq!(admit_with("POST", "/users", &[]), Admission::PassThrough);
        assert_eq!(admit_with("POST", "/carts/1", &[]), Admission::PassThrough);
    }

    #[test]
    fn missing_key_depends_on_require_key() {
        assert_eq!(problem_kind(admit_with("POST", "/orders", &[])), Kind::MissingKey);
        assert_eq!(admit_with("POST", "/carts", &[]), Admission::PassThrough);
        assert_eq!(problem_kind(admit_with("POST", "/carts", &[("idempotency-key", "")])), Kind::InvalidKey);
    }

    #[test]
    fn key_problems_use_the_configured_status() {
        let cfg = parse(br#"{"problem_statuses":{"invalid_key":422},"routes":[{"name":"a","match":{"prefix":"/"},"require_key":true}]}"#).unwrap();
        let h = headers(&[]);
        match admit(
            &cfg,
            &RequestHead { method: "POST", path: "/", headers: &h, verified_claims: None, cluster: None },
        ) {
            Admission::Reject(p) => assert_eq!(p.status, 422),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn declared_oversized_body_is_refused_before_reading_it() {
        let a = admit_with("POST", "/orders", &[("idempotency-key", "k"), ("content-length", "101")]);
        assert_eq!(problem_kind(a), Kind::RequestTooLarge);
        assert!(matches!(
            admit_with("POST", "/orders", &[("idempotency-key", "k"), ("content-length", "100")]),
            Admission::Collect(_)
        ));
    }

    #[test]
    fn scope_separates_principals_tenants_paths_and_quoting_does_not() {
        let base = pending(&[("idempotency-key", "k"), ("authorization", "a")]);
        assert_eq!(base.scope, pending(&[("idempotency-key", "\"k\""), ("authorization", "a")]).scope);
        assert_ne!(base.scope, pending(&[("idempotency-key", "k"), ("authorization", "b")]).scope);
        assert_ne!(base.scope, pending(&[("idempotency-key", "k")]).scope);
        assert_ne!(
            base.scope,
            pending(&[("idempotency-key", "k"), ("authorization", "a"), ("x-tenant-id", "t")]).scope
        );
        let other_path =
            match admit_with("POST", "/orders/2", &[("idempotency-key", "k"), ("authorization", "a")]) {
                Admission::Collect(p) => p,
                other => panic!("{other:?}"),
            };
        assert_ne!(base.scope, other_path.scope);
        // The query is not part of the scope (it is part of the fingerprint).
        let other_query =
            match admit_with("POST", "/orders?x=2", &[("idempotency-key", "k"), ("authorization", "a")]) {
                Admission::Collect(p) => p,
                other => panic!("{other:?}"),
            };
        assert_eq!(base.scope, other_query.scope);
    }

    /// A local store of 64 records over the shared-data fake, for engine and flow tests.
    pub(crate) struct World {
        data: FakeSharedData,
    }

    impl World {
        pub(crate) fn new() -> World {
            let w = World { data: FakeSharedData::new() };
            LocalStore::new(&w.data, 64).create_keys(true).unwrap();
            w
        }
        pub(crate) fn store(&self) -> LocalStore<&FakeSharedData> {
            LocalStore::new(&self.data, 64)
        }
        fn decide(&self, p: &Pending, body: &[u8], now: u64, owner: u64) -> Decision {
            decide(&cfg(), p, body, &self.store(), now, owner)
        }
    }

    fn forward(d: Decision) -> Claim {
        match d {
            Decision::Forward { claim, .. } => claim,
            other => panic!("{other:?}"),
        }
    }

    fn reply(d: Decision) -> (Reply, Counter) {
        match d {
            Decision::Respond { reply, counter } => (reply, counter),
            other => panic!("{other:?}"),
        }
    }

    fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a [u8]> {
        r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    #[test]
    fn first_request_claims_then_retries_replay_the_stored_response() {
        let w = World::new();
        let p = pending(&[("idempotency-key", "k"), ("content-type", "application/json")]);
        let claim = forward(w.decide(&p, br#"{"a":1,"sent_at":"t1"}"#, 0, 1));
        let snapshot = Snapshot {
            status: 201,
            headers: vec![("x-id".into(), b"7".to_vec())],
            body: b"{\"id\":7}".to_vec(),
        };
        let completion = Completion {
            state: State::Succeeded,
            status: 201,
            snapshot: Some(snapshot),
            now_ms: 5,
            ttl_ms: 1000,
        };
        w.store().complete(&claim, &completion).unwrap();
        // Same JSON, other member order and whitespace, ignored field changed: a replay.
        let (r, counter) = reply(w.decide(&p, br#"{ "sent_at":"t2", "a": 1 }"#, 6, 2));
        assert_eq!(counter, Counter::Replayed);
        assert_eq!((r.status, r.body.as_slice()), (201, &b"{\"id\":7}"[..]));
        assert_eq!(header(&r, "x-id"), Some(&b"7"[..]));
        assert_eq!(header(&r, REPLAYED_HEADER), Some(&b"true"[..]));
    }

    #[test]
    fn an_outcome_unknown_record_is_refused_with_502_and_never_executed() {
        let w = World::new();
        let p = pending(&[("idempotency-key", "k")]);
        let claim = forward(w.decide(&p, b"x", 0, 1));
        w.store().complete(&claim, &Completion::outcome_unknown(5, 1000)).unwrap();
        for now in [6, 1004] {
            let (r, counter) = reply(w.decide(&p, b"x", now, 2));
            assert_eq!((r.status, counter), (502, Counter::UnknownRefused), "at {now}");
            assert_eq!(header(&r, "content-type"), Some(&b"application/problem+json"[..]));
            // Retrying with this key never gets another answer: no retry-after.
            assert_eq!(header(&r, "retry-after"), None);
            let body = String::from_utf8_lossy(&r.body);
            assert!(body.contains("\"type\":\"urn:idempotency-filter:outcome-unknown\""), "{body}");
            assert!(body.contains("Reconcile with the upstream"), "{body}");
        }
        let (_, counter) = reply(w.decide(&p, b"other", 7, 3));
        assert_eq!(counter, Counter::Mismatch);
        // After the ttl the key is free again.
        assert!(matches!(w.decide(&p, b"x", 1005, 4), Decision::Forward { counter: Counter::Claimed, .. }));
    }

    #[test]
    fn a_different_payload_is_refused_with_the_configured_status() {
        let w = World::new();
        let p = pending(&[("idempotency-key", "k")]);
        forward(w.decide(&p, b"one", 0, 1));
        let (r, counter) = reply(w.decide(&p, b"two", 1, 2));
        assert_eq!((r.status, counter), (409, Counter::Mismatch));
        let header_changed = pending(&[("idempotency-key", "k"), ("x-api-version", "2")]);
        assert_eq!(reply(w.decide(&header_changed, b"one", 2, 3)).1, Counter::Mismatch);
        let query_changed = match admit_with("POST", "/orders?x=2", &[("idempotency-key", "k")]) {
            Admission::Collect(p) => p,
            other => panic!("{other:?}"),
        };
        assert_eq!(reply(w.decide(&query_changed, b"one", 3, 4)).1, Counter::Mismatch);
    }

    #[test]
    fn in_flight_duplicates_get_409_with_retry_after() {
        let w = World::new();
        let p = pending(&[("idempotency-key", "k")]);
        forward(w.decide(&p, b"x", 0, 1));
        let (r, counter) = reply(w.decide(&p, b"x", 2_500, 2));
        assert_eq!((r.status, counter), (409, Counter::InFlight));
        assert_eq!(header(&r, "retry-after"), Some(&b"28"[..]));
        assert_eq!(header(&r, "content-type"), Some(&b"application/problem+json"[..]));
    }

    #[test]
    fn an_expired_lease_is_an_unknown_outcome_unless_the_rule_takes_it_over() {
        // The default: the claim's Envoy never said how it went, so it may have executed.
        let w = World::new();
        let p = pending(&[("idempotency-key", "k")]);
        forward(w.decide(&p, b"x", 0, 1));
        let (r, counter) = reply(w.decide(&p, b"x", 30_000, 2));
        assert_eq!((r.status, counter), (502, Counter::UnknownRefused));
        // A rule where a repeat is harmless says so, and the retry executes again.
        let w = World::new();
        let mut p = pending(&[("idempotency-key", "k")]);
        p.rule =
            Rc::new(Rule { unknown_outcome: crate::config::UnknownOutcome::Takeover, ..(*p.rule).clone() });
        forward(w.decide(&p, b"x", 0, 1));
        match w.decide(&p, b"x", 30_000, 2) {
            Decision::Forward { counter, .. } => assert_eq!(counter, Counter::TakenOver),
            other => panic!("{other:?}"),
        }
    }

    /// The rule's policy reaches the stores as one instruction each, and only a takeover lets
    /// the local store evict an abandoned claim for room.
    #[test]
    fn each_unknown_outcome_policy_is_one_instruction_to_the_stores() {
        use crate::config::UnknownOutcome;
        for (policy, instruction, evicts) in [
            (UnknownOutcome::Takeover, OnLeaseEnd::TakeOver, true),
            (UnknownOutcome::Refuse, OnLeaseEnd::MarkUnknown, false),
            (UnknownOutcome::Reconcile, OnLeaseEnd::Report, false),
        ] {
            assert_eq!(on_lease_end(policy), instruction, "{policy:?}");
            assert_eq!(instruction.may_evict(), evicts, "{policy:?}");
        }
        let p = pending(&[("idempotency-key", "k")]);
        let attempt = claim_attempt(&cfg(), &p, Fingerprint([0; 32]), 0, 1);
        assert_eq!(attempt.on_lease_end, OnLeaseEnd::MarkUnknown);
        assert_eq!(attempt.after_lookup(5).on_lease_end, OnLeaseEnd::TakeOver);
    }

    #[test]
    fn an_oversized_body_is_refused_and_claims_nothing() {
        let w = World::new();
        let p = pending(&[("idempotency-key", "k")]);
        let (r, counter) = reply(w.decide(&p, &[b'x'; 101], 0, 1));
        assert_eq!((r.status, counter), (413, Counter::TooLarge));
        forward(w.decide(&p, b"small", 1, 2));
    }

    #[test]
    fn a_response_that_was_too_large_is_never_executed_again() {
        let w = World::new();
        let p = pending(&[("idempotency-key", "k")]);
        let claim = forward(w.decide(&p, b"x", 0, 1));
        let completion =
            Completion { state: State::Succeeded, status: 200, snapshot: None, now_ms: 1, ttl_ms: 1000 };
        w.store().complete(&claim, &completion).unwrap();
        let (r, counter) = reply(w.decide(&p, b"x", 2, 2));
        assert_eq!((r.status, counter), (410, Counter::NotReplayable));
        assert_eq!(header(&r, ORIGINAL_STATUS_HEADER), Some(&b"200"[..]));
    }

    #[test]
    fn store_trouble_fails_closed_with_503() {
        let data = FakeSharedData::new(); // layout never created
        let p = pending(&[("idempotency-key", "k")]);
        let (r, counter) = reply(decide(&cfg(), &p, b"x", &LocalStore::new(&data, 64), 0, 1));
        assert_eq!((r.status, counter), (503, Counter::StoreError));
        assert!(header(&r, "retry-after").is_some());
    }

    #[test]
    fn snapshots_drop_hop_by_hop_and_connection_named_headers() {
        let kept = snapshot_headers(
            headers(&[
                (":status", "201"),
                ("content-type", "application/json"),
                ("connection", "keep-alive, x-hop"),
                ("keep-alive", "timeout=5"),
                ("transfer-encoding", "chunked"),
                ("te", "trailers"),
                ("trailer", "x-checksum"),
                ("upgrade", "h2c"),
                ("proxy-authenticate", "Basic"),
                ("x-hop", "1"),
                ("content-length", "12"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2"),
            ]),
            &[],
        );
        assert_eq!(
            kept,
            headers(&[
                ("content-type", "application/json"),
                ("content-length", "12"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2")
            ])
        );
        let without_cookies = snapshot_headers(kept, &["set-cookie".to_string()]);
        assert_eq!(
            without_cookies,
            headers(&[("content-type", "application/json"), ("content-length", "12")])
        );
    }

    #[test]
    fn grpc_calls_on_protected_routes_are_refused_with_an_explicit_grpc_status() {
        let a = admit_with(
            "POST",
            "/orders",
            &[("idempotency-key", "k"), ("content-type", "application/grpc+proto")],
        );
        match a {
            Admission::Reject(p) => {
                assert_eq!((p.kind, p.status), (Kind::GrpcNotSupported, 415));
                assert!(p.response_headers().contains(&("grpc-status", "12".to_string())));
            }
            other => panic!("{other:?}"),
        }
        // Not protected (no key, not required): not our business.
        assert_eq!(
            admit_with("POST", "/carts", &[("content-type", "application/grpc")]),
            Admission::PassThrough
        );
        assert!(matches!(
            admit_with(
                "POST",
                "/orders",
                &[("idempotency-key", "k"), ("content-type", "application/grpc-web")]
            ),
            Admission::Reject(_)
        ));
        assert!(matches!(
            admit_with("POST", "/orders", &[("idempotency-key", "k"), ("content-type", "application/json")]),
            Admission::Collect(_)
        ));
    }

    #[test]
    fn the_authority_is_part_of_the_scope() {
        let at = |authority: &str| {
            pending(&[("idempotency-key", "k"), (":authority", authority), (":scheme", "http")]).scope
        };
        assert_ne!(at("a.example"), at("b.example"));
        assert_eq!(at("a.example"), at("A.Example:80"));
        assert_ne!(at("a.example"), at("a.example:8080"));
    }

    /// A mesh's service answers to many names; `scope_host` says which makes the
    /// record: the authority as written (normalized), the cluster Envoy routed to, or none.
    #[test]
    fn scope_host_names_the_service_by_its_authority_its_cluster_or_not_at_all() {
        let scope = |mode: &str, authority: &str, cluster: Option<&str>| {
            let cfg = parse(
                format!(r#"{{"scope_host":"{mode}","routes":[{{"name":"a","match":{{"prefix":"/"}}}}]}}"#)
                    .as_bytes(),
            )
            .unwrap();
            let h = headers(&[("idempotency-key", "k"), (":authority", authority), (":scheme", "http")]);
            let head = RequestHead {
                method: "POST",
                path: "/pay",
                headers: &h,
                verified_claims: None,
                cluster: cluster.map(str::as_bytes),
            };
            match admit(&cfg, &head) {
                Admission::Collect(p) => (p.scope, p.label.host().map(str::to_string)),
                other => panic!("{other:?}"),
            }
        };
        let long = "payments.prod.svc.cluster.local:8080";
        // The default: one record per spelling of the host, as every build before the field.
        assert_ne!(
            scope("authority", "payments", Some("payments")).0,
            scope("authority", long, Some("payments")).0
        );
        assert_eq!(scope("authority", "payments", None), scope("authority", "Payments:80", None));
        // One cluster, one record, whatever the name; two clusters, two records.
        assert_eq!(
            scope("cluster", "payments", Some("outbound|8080||payments")).0,
            scope("cluster", long, Some("outbound|8080||payments")).0
        );
        assert_ne!(scope("cluster", "payments", Some("a")).0, scope("cluster", "payments", Some("b")).0);
        // A cluster's scope is never a host's of the same name, and the label says which it is.
        assert_ne!(scope("cluster", "x", Some("payments")).0, scope("authority", "payments", None).0);
        assert_eq!(scope("cluster", "x", Some("payments")).1.as_deref(), Some("cluster payments"));
        // Routed to no cluster (Envoy answers it itself): the authority, as by default.
        assert_eq!(scope("cluster", "payments", None), scope("authority", "payments", None));
        // No host: every name is one API.
        assert_eq!(scope("none", "payments", Some("a")).0, scope("none", long, Some("b")).0);
    }

    #[test]
    fn repeated_tenant_headers_are_not_one_joined_header() {
        let joined = pending(&[("idempotency-key", "k"), ("x-tenant-id", "a,b")]);
        let two = pending(&[("idempotency-key", "k"), ("x-tenant-id", "a"), ("x-tenant-id", "b")]);
        assert_ne!(joined.scope, two.scope);
        assert_ne!(joined.tenant, two.tenant);
        assert_eq!(pending(&[("idempotency-key", "k")]).tenant, Some(tenant_digest(&[])));
    }

    #[test]
    fn verified_claims_name_the_caller_across_token_refreshes() {
        let cfg = parse(
            br#"{"principal":{"jwt_payload":"jwt","claims":["iss","sub"]},
            "routes":[{"name":"a","match":{"prefix":"/"}}]}"#,
        )
        .unwrap();
        let scope = |auth: &str, claims: Option<&[Option<Vec<u8>>]>| {
            let h = headers(&[("idempotency-key", "k"), ("authorization", auth)]);
            match admit(
                &cfg,
                &RequestHead {
                    method: "POST",
                    path: "/",
                    headers: &h,
                    verified_claims: claims,
                    cluster: None,
                },
            ) {
                Admission::Collect(p) => p,
                other => panic!("{other:?}"),
            }
        };
        let u1 = [Some(b"iss".to_vec()), Some(b"u1".to_vec())];
        let u2 = [Some(b"iss".to_vec()), Some(b"u2".to_vec())];
        let first = scope("Bearer token-1", Some(&u1));
        assert_eq!(first.scope, scope("Bearer token-1-refreshed", Some(&u1)).scope);
        assert_eq!(first.principal, scope("Bearer token-1-refreshed", Some(&u1)).principal);
        assert_ne!(first.scope, scope("Bearer token-1", Some(&u2)).scope);
        // No verified payload: the raw header is the principal, and it never equals a JWT one.
        let unverified = scope("Bearer token-1", None);
        assert_ne!(first.scope, unverified.scope);
        assert_ne!(unverified.scope, scope("Bearer token-2", None).scope);
    }

    #[test]
    fn a_verified_payload_lacking_a_configured_claim_is_refused_not_merged() {
        // Issue 18, item 4: tokens with iss but no sub were one principal (iss, <absent>), so
        // their callers replayed each other's answers.
        let cfg = parse(
            br#"{"principal":{"jwt_payload":"jwt","claims":["iss","sub"]},
            "routes":[{"name":"a","match":{"prefix":"/"}}]}"#,
        )
        .unwrap();
        let admit_claims = |auth: &str, claims: &[Option<Vec<u8>>]| {
            let h = headers(&[("idempotency-key", "k"), ("authorization", auth)]);
            admit(
                &cfg,
                &RequestHead {
                    method: "POST",
                    path: "/",
                    headers: &h,
                    verified_claims: Some(claims),
                    cluster: None,
                },
            )
        };
        let no_sub = [Some(b"iss".to_vec()), None];
        let neither: [Option<Vec<u8>>; 2] = [None, None];
        let short = [Some(b"iss".to_vec())];
        for (claims, missing) in [(&no_sub[..], "sub"), (&neither[..], "iss, sub"), (&short[..], "sub")] {
            for auth in ["Bearer alice", "Bearer bob"] {
                match admit_claims(auth, claims) {
                    Admission::Reject(p) => {
                        assert_eq!((p.kind, p.status), (Kind::PrincipalIncomplete, 403));
                        assert!(p.detail.contains(missing), "{}", p.detail);
                        assert_eq!(Counter::of_problem(p.kind), Counter::PrincipalIncomplete);
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        // An empty claim is a claim (the scope tells it from an absent one).
        let empty_sub = [Some(b"iss".to_vec()), Some(Vec::new())];
        assert!(matches!(admit_claims("Bearer alice", &empty_sub), Admission::Collect(_)));
    }

    #[test]
    fn replay_headers_are_put_back_as_stored() {
        let shape = |ct: Option<&str>, cl: Option<&str>| ReplayShape {
            content_type: ct.map(|v| v.as_bytes().to_vec()),
            content_length: cl.map(|v| v.as_bytes().to_vec()),
        };
        // Empty body: Envoy dropped content-type (and content-length for a HEAD answer).
        assert_eq!(
            replay_header_fixes(&shape(Some("application/json"), Some("42")), None, None),
            vec![
                HeaderFix::Set("content-type", b"application/json".to_vec()),
                HeaderFix::Set("content-length", b"42".to_vec())
            ]
        );
        // A body without content-type: Envoy invented text/plain.
        assert_eq!(
            replay_header_fixes(&shape(None, None), Some(b"text/plain"), Some(b"3")),
            vec![HeaderFix::Remove("content-type")]
        );
        // Nothing rewritten: nothing to fix.
        assert!(replay_header_fixes(&shape(Some("a/b"), Some("3")), Some(b"a/b"), Some(b"3")).is_empty());
        let r = Reply::replay(Snapshot {
            status: 200,
            headers: headers(&[("content-type", "a/b"), ("content-length", "3"), ("x", "1")]),
            body: b"abc".to_vec(),
        });
        assert!(r.headers.iter().all(|(n, _)| n != "content-length"), "{:?}", r.headers);
        // Envoy keeps a given type and sets the body's length: nothing to fix, nothing to read.
        assert_eq!(r.replay_shape, None);
        // The three replies Envoy rewrites carry what they must become.
        let replay = |h: &[(&str, &str)], body: &[u8]| {
            Reply::replay(Snapshot { status: 200, headers: headers(h), body: body.to_vec() }).replay_shape
        };
        assert_eq!(replay(&[("content-type", "a/b")], b""), Some(shape(Some("a/b"), None)));
        assert_eq!(replay(&[("content-length", "9")], b""), Some(shape(None, Some("9"))));
        assert_eq!(replay(&[], b"abc"), Some(shape(None, None)));
        assert_eq!(replay(&[], b""), None);
    }

    #[test]
    fn an_attempt_is_charged_only_to_the_configured_quotas() {
        // Issue 18, item 5: quotas are opt-in. Without `quota` the attempt carries none, so the
        // store reads and writes no quota counter; with one bound, only that identity is charged.
        let p = pending(&[("idempotency-key", "k"), ("x-tenant-id", "acme")]);
        let with = |quota: Quota| {
            let mut c = cfg();
            c.quota = quota;
            claim_attempt(&c, &p, Fingerprint([1; 32]), 0, 1).quota
        };
        assert_eq!(cfg().quota, Quota::default());
        assert_eq!(with(Quota::default()), None);
        let principal_only = with(Quota { per_tenant: None, per_principal: Some(5) }).unwrap();
        assert_eq!((principal_only.tenant, principal_only.principal), (None, Some(p.principal)));
        assert_eq!(principal_only.per_principal, 5);
        let tenant_only = with(Quota { per_tenant: Some(7), per_principal: None }).unwrap();
        assert_eq!((tenant_only.tenant, tenant_only.principal), (p.tenant, None));
        assert_eq!(tenant_only.per_tenant, 7);
        // A tenant bound without a tenant header has nobody to charge.
        let mut no_tenant = cfg();
        no_tenant.tenant_header = None;
        no_tenant.quota = Quota { per_tenant: Some(7), per_principal: None };
        let h = headers(&[("idempotency-key", "k")]);
        let Admission::Collect(q) = admit(
            &no_tenant,
            &RequestHead {
                method: "POST",
                path: "/orders",
                headers: &h,
                verified_claims: None,
                cluster: None,
            },
        ) else {
            unreachable!()
        };
        assert_eq!(claim_attempt(&no_tenant, &q, Fingerprint([1; 32]), 0, 1).quota, None);
    }

    #[test]
    fn a_quota_refusal_is_a_429_with_retry_after() {
        struct AtQuota;
        impl RecordStore for AtQuota {
            fn begin(&self, _: &ClaimAttempt) -> Result<Begin, crate::store::StoreError> {
                Ok(Begin::QuotaExceeded { retry_after_ms: 2_500, tenant: true })
            }
            fn complete(
                &self,
                _: &Claim,
                _: &Completion,
            ) -> Result<crate::store::Settled, crate::store::StoreError> {
                unreachable!()
            }
            fn release(&self, _: &Claim) -> Result<crate::store::Settled, crate::store::StoreError> {
                unreachable!()
            }
            fn sweep(&self, _: u64) -> Result<u32, crate::store::StoreError> {
                unreachable!()
            }
            fn renew(
                &self,
                _: &crate::store::Renew,
            ) -> Result<Vec<crate::store::Kept>, crate::store::StoreError> {
                unreachable!()
            }
            fn records(
                &self,
                _: &crate::store::RecordQuery,
            ) -> Result<crate::store::RecordPage, crate::store::StoreError> {
                unreachable!()
            }
            fn amend(
                &self,
                _: &crate::store::RecordView,
                _: &crate::store::Amendment,
                _: u64,
            ) -> Result<Result<(), crate::store::Refusal>, crate::store::StoreError> {
                unreachable!()
            }
        }
        let p = pending(&[("idempotency-key", "k")]);
        let (r, counter) = reply(decide(&cfg(), &p, b"x", &AtQuota, 0, 1));
        assert_eq!((r.status, counter), (429, Counter::QuotaExceeded));
        assert_eq!(header(&r, "retry-after"), Some(&b"3"[..]));
        assert!(String::from_utf8_lossy(&r.body).contains("quota-exceeded"));
    }
}
