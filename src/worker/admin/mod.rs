//! The admin API (C24): an operator inspects, releases and settles records. A filter instance
//! configured with `admin` and no `routes` serves it on its own listener; each request is
//! answered here, from the request's method, path, token and body, and the store's answers to
//! the operations it asks for (`Progress`), as a reply the worker sends. Pure: the worker carries
//! the operations out on either store; nothing here imports proxy-wasm.
//!
//! - `GET  /idempotency/records?state=&route=&key=&tenant=&host=&limit=&cursor=`   list
//! - `GET  /idempotency/records/{id}`                   one record, with its stored response
//! - `POST /idempotency/records/{id}/release[?force=true]`
//! - `POST /idempotency/records/{id}/resolve`           body: the upstream's real answer
//!
//! `{id}` is the record's tag (12 hex digits, the one logs and access logs print) or its whole
//! scope id (64).

pub(crate) mod root;
mod time;

use crate::codec::{base64, form_decode, hex};
use crate::config::AdminConfig;
use crate::engine::Reply;
use crate::identity::scope::ScopeId;
use crate::json::{emit_string, JsonValue, MemberOrder};
use crate::problem::{Kind, Problem};
use crate::store::record::{Label, Snapshot};
use crate::store::{Amendment, RecordId, RecordPage, RecordQuery, RecordView, Refusal, StateFilter};
use crate::store::{StoreAnswer, StoreError, StoreOp};
use crate::worker::audit::AuditEntry;
use sha2::{Digest, Sha256};

/// Records a list shows by default, and at most (`limit`).
pub const DEFAULT_LIMIT: usize = 100;
pub const MAX_LIMIT: usize = 1_000;
/// Largest resolve body: the answer it carries is stored like an upstream's.
pub const MAX_BODY: usize = 4 << 20;

pub struct AdminRequest<'a> {
    pub method: &'a str,
    /// With its query.
    pub path: &'a str,
    pub authorization: Option<&'a [u8]>,
    pub body: &'a [u8],
    pub now_ms: u64,
}

/// What an admin request did, for the log line and the counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Listed,
    LookedUp,
    Released,
    Resolved,
    /// Answered with a problem (bad request, unknown record, a state that does not allow it).
    Refused,
    Unauthorized,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Listed => "listed",
            Action::LookedUp => "looked_up",
            Action::Released => "released",
            Action::Resolved => "resolved",
            Action::Refused => "refused",
            Action::Unauthorized => "unauthorized",
        }
    }

    pub const ALL: [Action; 6] = [
        Action::Listed,
        Action::LookedUp,
        Action::Released,
        Action::Resolved,
        Action::Refused,
        Action::Unauthorized,
    ];
}

pub struct Answered {
    pub reply: Reply,
    pub action: Action,
    /// The record acted on (or looked up, or whose change was refused), for the audit line.
    pub record: Option<Subject>,
    /// Who: the first 8 hex digits of the SHA-256 of the token presented ("-" without one).
    pub who: String,
    /// A record released or resolved: waiters held for it are woken.
    pub changed: Option<ScopeId>,
}

/// A record as the audit line names it: its tag, and whose it is (route and tenant, when its
/// label says).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub tag: String,
    pub route: Option<String>,
    pub tenant: Option<String>,
    pub key: Option<String>,
    /// As the record stood when the request found it (`view_state`).
    pub state: &'static str,
}

impl Subject {
    fn of(view: &RecordView) -> Subject {
        let label = view.label.as_ref();
        Subject {
            tag: view.scope.log_tag(),
            route: label.map(|l| l.route().to_string()),
            tenant: label.and_then(Label::tenant).map(str::to_string),
            key: label.map(|l| l.key().to_string()),
            state: view_state(&view.entry),
        }
    }
}

impl Answered {
    /// The admin request's audit entry, published on its own stream for the admin listener's
    /// access log (always: an operator's action is never unaudited): what was done to which
    /// record, whose it is, its state before and after, which token (a digest prefix, never the
    /// token's), from where (`peer`), and the request (`method`, `path` without its query).
    pub fn audit_entry(&self, method: &str, path: &str, peer: Option<&str>) -> Vec<u8> {
        let r = self.record.as_ref();
        let after = match self.action {
            Action::Released => Some("released"),
            Action::Resolved => Some("completed"),
            Action::LookedUp | Action::Refused => r.map(|r| r.state),
            Action::Listed | Action::Unauthorized => None,
        };
        let token = (self.who != "-").then(|| format!("sha256:{}", self.who));
        let mut e = AuditEntry::new("admin");
        e.text("action", Some(self.action.name()));
        e.text("record", r.map(|r| r.tag.as_str()));
        e.text("route", r.and_then(|r| r.route.as_deref()));
        e.text("tenant", r.and_then(|r| r.tenant.as_deref()));
        e.text("key", r.and_then(|r| r.key.as_deref()));
        e.text("state_before", r.map(|r| r.state));
        e.text("state_after", after);
        e.text("token", token.as_deref());
        e.text("peer", peer);
        e.text("request", Some(&format!("{method} {path}")));
        e.number("status", Some(u64::from(self.reply.status)));
        e.finish()
    }
}

/// A record's state as the admin API names it.
fn view_state(e: &crate::store::record::Entry) -> &'static str {
    if e.outcome_unknown() {
        "outcome_unknown"
    } else if e.is_completed() {
        "completed"
    } else {
        "processing"
    }
}

/// Where an admin request is: answered, or waiting for the store to answer `StoreOp` (the local
/// store at once; etcd through the root's callouts), which `AdminTask::answered` then takes on.
pub enum Progress {
    Done(Answered),
    Ask(AdminTask, StoreOp),
    /// As `Ask`, in a later callback: the store paused a long scan at its bound of work for one
    /// call (`RecordPage::paused`), and this goes on from there. The worker serves its requests
    /// in between (the worker's root asks at its next tick).
    Later(AdminTask, StoreOp),
}

/// An admin request waiting for the store.
pub struct AdminTask {
    who: String,
    wants: Wants,
}

enum Wants {
    /// The records a list asked for (`query`), and those found so far by a scan the store paused.
    List { query: RecordQuery, got: Vec<RecordView> },
    /// The record an id names (`query`: found so far, `found`), then what to do with it.
    One { id: String, then: Option<Amendment>, query: RecordQuery, found: Vec<RecordView> },
    /// The change to this record is done (or refused).
    Amended { record: Subject, scope: ScopeId, action: Action },
}

pub fn start(cfg: &AdminConfig, req: &AdminRequest) -> Progress {
    // Which token acted, for the audit line: the first 8 hex digits of its SHA-256, never of the
    // token itself. A prefix of a secret is part of it (every reader of the log would hold 32
    // of its bits, and shorten a search for the rest); a prefix of its digest tells tokens apart
    // and gives away nothing, and matches the first digits of the `token_sha256` configured.
    let who =
        req.authorization.and_then(bearer).map_or_else(|| "-".to_string(), |t| hex(&Sha256::digest(t)[..4]));
    if let Some(expected) = &cfg.token_sha256 {
        let presented = req.authorization.and_then(bearer).map(Sha256::digest);
        if !presented.is_some_and(|p| constant_time_eq(&p, expected)) {
            let mut p = Problem::new(
                Kind::AdminUnauthorized,
                401,
                "present the admin token as authorization: Bearer <token>",
            );
            p.headers.push(("www-authenticate", "Bearer".to_string()));
            return refusal(who, p, None);
        }
    }
    match route(req) {
        Ok((wants, op)) => Progress::Ask(AdminTask { who, wants }, op),
        Err(p) => refusal(who, p, None),
    }
}

fn refusal(who: String, p: Problem, record: Option<Subject>) -> Progress {
    let action = if p.kind == Kind::AdminUnauthorized { Action::Unauthorized } else { Action::Refused };
    Progress::Done(Answered { reply: problem_reply(&p), action, record, who, changed: None })
}

impl AdminTask {
    /// Takes the store's answer on: the reply, or the change to make to the record it found.
    pub fn answered(self, answer: StoreAnswer, now_ms: u64) -> Progress {
        let AdminTask { who, wants } = self;
        let done = |reply: Reply, action: Action, record: Option<Subject>, changed: Option<ScopeId>| {
            Progress::Done(Answered { reply, action, record, who: who.clone(), changed })
        };
        let step = match (wants, answer) {
            (Wants::List { query, mut got }, StoreAnswer::Records(Ok(page))) => {
                got.extend(page.views);
                if page.paused {
                    // The rest of the list, from where the store stopped.
                    let rest = RecordQuery {
                        cursor: page.next,
                        limit: query.limit.saturating_sub(got.len()).max(1),
                        ..query.clone()
                    };
                    return Progress::Later(
                        AdminTask { who, wants: Wants::List { query, got } },
                        rest.into(),
                    );
                }
                let page = RecordPage { views: got, next: page.next, paused: false };
                Ok(done(list_reply(&page, now_ms), Action::Listed, None, None))
            }
            (Wants::List { .. }, StoreAnswer::Records(Err(e))) => Err(e),
            (Wants::One { id, then, query, mut found }, StoreAnswer::Records(Ok(page))) if page.paused => {
                found.extend(page.views);
                let rest = RecordQuery { cursor: page.next, ..query.clone() };
                return Progress::Later(
                    AdminTask { who, wants: Wants::One { id, then, query, found } },
                    rest.into(),
                );
            }
            (Wants::One { id, then, mut found, .. }, StoreAnswer::Records(page)) => match page.map(|p| {
                found.extend(p.views);
                only(&id, found)
            }) {
                Ok(Ok(view)) => Ok(match then {
                    None => done(
                        json_reply(200, &view_json(&view, true, now_ms)),
                        Action::LookedUp,
                        Some(Subject::of(&view)),
                        None,
                    ),
                    Some(change) => {
                        let action = if matches!(change, Amendment::Release { .. }) {
                            Action::Released
                        } else {
                            Action::Resolved
                        };
                        let wants = Wants::Amended { record: Subject::of(&view), scope: view.scope, action };
                        let op = StoreOp::Amend { view: Box::new(view), change, now_ms };
                        return Progress::Ask(AdminTask { who, wants }, op);
                    }
                }),
                Ok(Err(p)) => return refusal(who, p, None),
                Err(e) => Err(e),
            },
            (Wants::Amended { record, scope, action }, StoreAnswer::Amended(done_or_not)) => {
                match done_or_not {
                    Ok(Ok(())) => {
                        let verb = if action == Action::Released { "released" } else { "resolved" };
                        let body = format!("{{\"{verb}\":\"{}\"}}", record.tag);
                        Ok(done(json_reply(200, body.as_bytes()), action, Some(record), Some(scope)))
                    }
                    Ok(Err(r)) => return refusal(who, refused(r), Some(record)),
                    Err(e) => return refusal(who, unavailable(e), Some(record)),
                }
            }
            (_, other) => Err(other.unexpected()),
        };
        step.unwrap_or_else(|e| refusal(who, unavailable(e), None))
    }
}

/// What the request asks for, as the first store operation.
fn route(req: &AdminRequest) -> Result<(Wants, StoreOp), Problem> {
    let (path, query) = req.path.split_once('?').unwrap_or((req.path, ""));
    let rest = path
        .strip_prefix("/idempotency/records")
        .ok_or_else(|| not_found(format!("{path} is not an admin path: /idempotency/records...")))?;
    let parts: Vec<&str> = rest.split('/').filter(|p| !p.is_empty()).collect();
    let one = |id: &str, then: Option<Amendment>| -> Result<(Wants, StoreOp), Problem> {
        let rid = RecordId::parse(id).ok_or_else(|| {
            bad(format!("{id:?} is not a record id: its tag (12 hex digits) or scope id (64)"))
        })?;
        let q = RecordQuery {
            id: Some(rid),
            state: StateFilter::All,
            route: None,
            key: None,
            tenant: None,
            host: None,
            limit: MAX_LIMIT,
            cursor: None,
            detail: then.is_none(),
            now_ms: req.now_ms,
        };
        Ok((Wants::One { id: id.to_string(), then, query: q.clone(), found: Vec::new() }, q.into()))
    };
    match (req.method, parts.as_slice()) {
        ("GET", []) => {
            let q = list_query(query, req.now_ms)?;
            Ok((Wants::List { query: q.clone(), got: Vec::new() }, q.into()))
        }
        ("GET", [id]) => one(id, None),
        ("POST", [id, "release"]) => {
            let force = query_param(query, "force").is_some_and(|v| v == "true");
            one(id, Some(Amendment::Release { force }))
        }
        ("POST", [id, "resolve"]) => one(id, Some(Amendment::Resolve(resolution(req.body)?))),
        (_, [] | [_] | [_, "release" | "resolve"]) => {
            let mut p =
                Problem::new(Kind::AdminBadRequest, 405, format!("{} is not allowed on {path}", req.method));
            p.headers.push(("allow", if parts.len() == 2 { "POST" } else { "GET" }.to_string()));
            Err(p)
        }
        _ => Err(not_found(format!("{path} is not an admin path"))),
    }
}

fn list_query(query: &str, now_ms: u64) -> Result<RecordQuery, Problem> {
    let state = match query_param(query, "state").as_deref().unwrap_or("all") {
        "all" => StateFilter::All,
        "outcome_unknown" => StateFilter::OutcomeUnknown,
        "processing" => StateFilter::Processing,
        "completed" => StateFilter::Completed,
        other => {
            return Err(bad(format!("state={other}: expected outcome_unknown, processing, completed or all")))
        }
    };
    let limit = match query_param(query, "limit") {
        None => DEFAULT_LIMIT,
        Some(n) => match n.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => return Err(bad(format!("limit={n}: expected 1 to {MAX_LIMIT}"))),
        },
    };
    let cursor = query_param(query, "cursor").filter(|c| !c.is_empty());
    if let Some(c) = &cursor {
        // 64 hex digits, after a shard's number and an `s` on a store in shards.
        if c.len() > 72 || !c.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(bad(format!("cursor={c}: not one a list gave (its \"next\")")));
        }
    }
    Ok(RecordQuery {
        id: None,
        state,
        route: query_param(query, "route"),
        key: query_param(query, "key"),
        tenant: query_param(query, "tenant"),
        // As the scope keeps it: lower case, without the default port.
        host: query_param(query, "host").map(|h| h.to_ascii_lowercase()),
        limit,
        cursor,
        detail: false,
        now_ms,
    })
}

fn list_reply(page: &RecordPage, now_ms: u64) -> Reply {
    let mut out = b"{\"records\":[".to_vec();
    for (i, v) in page.views.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&view_json(v, false, now_ms));
    }
    out.extend_from_slice(b"],\"truncated\":");
    out.extend_from_slice(if page.next.is_some() { b"true" } else { b"false" });
    if let Some(next) = &page.next {
        out.extend_from_slice(b",\"next\":");
        emit_string(next, &mut out);
    }
    out.push(b'}');
    json_reply(200, &out)
}

/// The one record an id names.
fn only(id: &str, mut found: Vec<RecordView>) -> Result<RecordView, Problem> {
    match found.len() {
        0 => Err(not_found(format!("no live record {id}"))),
        1 => Ok(found.remove(0)),
        n => {
            let ids: Vec<String> = found.iter().map(|v| hex(&v.scope.0)).collect();
            Err(Problem::new(
                Kind::RecordConflict,
                409,
                format!("{n} records have the tag {id}: name one by its scope id ({})", ids.join(", ")),
            ))
        }
    }
}

fn refused(r: Refusal) -> Problem {
    match r {
        Refusal::Live { lease_ends_at_ms } => Problem::new(
            Kind::RecordConflict,
            409,
            format!(
                "its request may still be at work upstream: its claim's lease runs until {} at the earliest \
                 (later while its Envoy still renews it); ask again after it",
                time::rfc3339(lease_ends_at_ms)
            ),
        ),
        Refusal::Completed => Problem::new(
            Kind::RecordConflict,
            409,
            "completed with a known outcome: every retry replays it (release it with ?force=true to let the key execute again)",
        ),
        Refusal::SettledMeanwhile => {
            Problem::new(Kind::RecordConflict, 409, "it changed meanwhile (its request settled it, or another operator): look it up again")
        }
        Refusal::Gone => not_found("the record is gone (expired, released or replaced)".to_string()),
    }
}

/// The answer a resolve writes: `{"status": 201, "headers": [["name", "value"]], "body": "..."}`
/// (or `"body_base64"`).
fn resolution(body: &[u8]) -> Result<Snapshot, Problem> {
    if body.len() > MAX_BODY {
        return Err(bad(format!("the body is over {MAX_BODY} bytes")));
    }
    let doc = crate::json::read(body, 4, MemberOrder::Document).map_err(|e| bad(format!("the body: {e}")))?;
    if let JsonValue::Object(members) = &doc {
        if let Some((name, _)) =
            members.iter().find(|(n, _)| !matches!(n.as_ref(), "status" | "headers" | "body" | "body_base64"))
        {
            return Err(bad(format!(
                "unknown member {name:?}: expected status, headers, body or body_base64"
            )));
        }
    } else {
        return Err(bad("the body must be a JSON object".to_string()));
    }
    let status = match doc.get("status") {
        Some(JsonValue::Number(n)) => n.parse::<u16>().ok().filter(|s| (200..600).contains(s)),
        _ => None,
    }
    .ok_or_else(|| {
        bad("status: expected a final HTTP status from 200 to 599 (a 1xx is no answer to replay)".to_string())
    })?;
    let mut headers = Vec::new();
    match doc.get("headers") {
        None => {}
        Some(JsonValue::Array(items)) => {
            for item in items {
                let JsonValue::Array(pair) = item else { return Err(bad(HEADER_SHAPE.to_string())) };
                let [JsonValue::String(n), JsonValue::String(v)] = pair.as_slice() else {
                    return Err(bad(HEADER_SHAPE.to_string()));
                };
                let name = n.to_ascii_lowercase();
                if name.is_empty() || !name.bytes().all(is_token_byte) {
                    return Err(bad(format!(
                        "header name {n:?} is not one a response may carry (a token: letters, digits, !#$%&'*+-.^_`|~)"
                    )));
                }
                if crate::engine::NOT_STORED_HEADERS.contains(&name.as_str())
                    || name.starts_with("proxy-")
                    || name == "content-length"
                {
                    return Err(bad(format!(
                        "header {name:?} belongs to a connection or frames the message: the replay sets its own"
                    )));
                }
                // Replayed as given: a CR or LF would end the header on an HTTP/1.1 connection and
                // start whatever follows as more headers or a second response (response
                // splitting); a NUL or another control byte is no field content either (RFC 9110
                // 5.5). A tab is.
                if v.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
                    return Err(bad(format!(
                        "header {name:?}: its value holds a control character (CR, LF, NUL...), which would split the replayed response"
                    )));
                }
                headers.push((name, v.as_bytes().to_vec()));
            }
        }
        Some(_) => return Err(bad(HEADER_SHAPE.to_string())),
    }
    let body = match (doc.get("body"), doc.get("body_base64")) {
        (Some(JsonValue::String(s)), None) => s.as_bytes().to_vec(),
        (None, Some(JsonValue::String(s))) => {
            base64::decode(s).ok_or_else(|| bad("body_base64 is not base64".to_string()))?
        }
        (None, None) => Vec::new(),
        _ => return Err(bad("body: a string, or body_base64: a base64 string, not both".to_string())),
    };
    if matches!(status, 204 | 304) && !body.is_empty() {
        return Err(bad(format!(
            "status {status} carries no body (RFC 9110 15.3.5, 15.4.5): leave body out"
        )));
    }
    Ok(Snapshot { status, headers, body })
}

/// RFC 9110 5.6.2 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

const HEADER_SHAPE: &str = "headers: expected [[\"name\", \"value\"], ...]";

/// Headers whose values an operator's view does not show: credentials.
const REDACTED: [&str; 3] = ["authorization", "cookie", "set-cookie"];

fn view_json(v: &RecordView, detail: bool, now_ms: u64) -> Vec<u8> {
    let e = &v.entry;
    let mut out = b"{\"tag\":".to_vec();
    emit_string(&v.scope.log_tag(), &mut out);
    out.extend_from_slice(b",\"id\":");
    emit_string(&hex(&v.scope.0), &mut out);
    // What the record is about, and whose: two customers may use one key (their records are
    // two, in two scopes), and these tell them apart. Null where the record's label does not
    // say (written before records named their scope, or no tenant header).
    let l = v.label.as_ref();
    let principal = l.and_then(Label::principal).map(|p| hex(&p));
    for (name, value) in [
        ("route", l.map(Label::route)),
        ("key", l.map(Label::key)),
        ("tenant", l.and_then(Label::tenant)),
        ("host", l.and_then(Label::host)),
        ("method", l.and_then(Label::method)),
        ("path", l.and_then(Label::path)),
        ("principal", principal.as_deref()),
    ] {
        out.extend_from_slice(format!(",\"{name}\":").as_bytes());
        match value {
            Some(s) => emit_string(s, &mut out),
            None => out.extend_from_slice(b"null"),
        }
    }
    let state = view_state(e);
    out.extend_from_slice(format!(",\"state\":\"{state}\"").as_bytes());
    if e.is_completed() && !e.outcome_unknown() {
        out.extend_from_slice(format!(",\"status\":{}", e.status).as_bytes());
    }
    if let Some(l) = &v.label {
        out.extend_from_slice(format!(",\"created_at\":\"{}\"", time::rfc3339(l.created_at_ms)).as_bytes());
    }
    out.extend_from_slice(format!(",\"expires_at\":\"{}\"", time::rfc3339(e.expires_at_ms)).as_bytes());
    if !e.is_completed() {
        out.extend_from_slice(
            format!(",\"lease_ends_at\":\"{}\"", time::rfc3339(e.lease_deadline_ms)).as_bytes(),
        );
        out.extend_from_slice(format!(",\"lease_ended\":{}", now_ms >= e.lease_deadline_ms).as_bytes());
    }
    if detail {
        if let Some(s) = &v.snapshot {
            out.extend_from_slice(
                format!(",\"response\":{{\"status\":{},\"headers\":[", s.status).as_bytes(),
            );
            for (i, (name, value)) in s.headers.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.push(b'[');
                emit_string(name, &mut out);
                out.push(b',');
                let shown = if REDACTED.contains(&name.as_str()) {
                    "[redacted]".to_string()
                } else {
                    String::from_utf8_lossy(value).into_owned()
                };
                emit_string(&shown, &mut out);
                out.push(b']');
            }
            out.extend_from_slice(format!("],\"body_bytes\":{}}}", s.body.len()).as_bytes());
        }
    }
    out.push(b'}');
    out
}

fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
        (n == name).then(|| form_decode(v))
    })
}

fn bearer(value: &[u8]) -> Option<&[u8]> {
    let v = std::str::from_utf8(value).ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim().as_bytes())
}

/// Equal in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn json_reply(status: u16, body: &[u8]) -> Reply {
    Reply {
        status,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("cache-control".into(), b"no-store".to_vec()),
        ],
        body: body.to_vec(),
        replay_shape: None,
    }
}

fn problem_reply(p: &Problem) -> Reply {
    let mut headers: Vec<(String, Vec<u8>)> =
        p.response_headers().into_iter().map(|(n, v)| (n.to_string(), v.into_bytes())).collect();
    headers.push(("cache-control".into(), b"no-store".to_vec()));
    Reply { status: p.status, headers, body: p.body(), replay_shape: None }
}

fn bad(detail: String) -> Problem {
    Problem::new(Kind::AdminBadRequest, 400, detail)
}

fn not_found(detail: String) -> Problem {
    Problem::new(Kind::RecordNotFound, 404, detail)
}

fn unavailable(e: StoreError) -> Problem {
    Problem::new(Kind::StoreUnavailable, 503, format!("the store: {e}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
