//! Reconciliation (`routes[].reconcile`), pure: the lookup that asks the upstream whether it
//! executed a request whose outcome the filter could not know, and what its answer means.
//!
//! Why it exists: an unknown outcome (Envoy's route timeout while the upstream still worked, a
//! reset after the request was sent, a client gone, a detached call past `upstream_timeout`, an
//! Envoy that died holding the claim) may not be executed twice, and without a lookup nobody can
//! tell the client what happened. A rule with `reconcile` keeps such a record in flight until its
//! lease ends (the upstream may still be working), and then a retry's lookup decides
//! (flow.rs, `Phase::Reconciling`):
//! - a final 2xx (not 202): it executed, and that answer becomes the record's outcome, replayed
//!   with `idempotent-reconciled: true` to this retry and every later one;
//! - 404: it never executed and never will: the retry executes, as a takeover of the record;
//! - anything else settles nothing: 503 `outcome-unknown` with `retry-after`.
//!
//! The lookup is a read: it writes nothing, so two lookups of one record may run on two Envoys at
//! once. Only acting on its answer takes the record over, atomically, as any takeover does.

use crate::codec::percent_encode;
use crate::config::{Reconcile, Rule};
use crate::engine;
use crate::engine::Pending;
use crate::identity::fingerprint::Fingerprint;
use crate::identity::key::parse_key;
use crate::store::record::{Snapshot, State};
use crate::store::{Claim, ClaimAttempt, Completion};
use std::rc::Rc;

mod flow;
mod gate;
pub(crate) mod root;
pub use gate::LookupGate;

/// Marks a replay whose response came from the upstream's lookup, not from the request's own
/// execution: the client can tell that the first attempt did execute.
pub const RECONCILED_HEADER: &str = "idempotent-reconciled";

/// The lookup as the worker makes it: a callout to `cluster` (None: the route's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupCall {
    pub cluster: Option<String>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub timeout_ms: u32,
}

/// What the lookup said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupAnswer {
    /// It executed, and answered `status`; `snapshot` is None when the answer is larger than the
    /// rule keeps (then the record keeps the status alone, as an inline answer would).
    Found { status: u16, snapshot: Option<Snapshot> },
    /// It never executed, and never will.
    NotFound,
    /// Nothing is settled: why, for the log.
    Failed(String),
}

/// The lookup for the request whose headers (as Envoy holds them) are `request`: `:method` and
/// `:path` from the rule's `reconcile`, with `{key}` the request's Idempotency-Key,
/// percent-encoded; the request's `:authority`; the key header; and the headers `reconcile`
/// copies (never a router control header: config refuses them). None when the request has no
/// usable key or `:authority` (it could not have been admitted).
pub fn lookup_call(rule: &Rule, reconcile: &Reconcile, request: &[(String, Vec<u8>)]) -> Option<LookupCall> {
    fn values<'r>(request: &'r [(String, Vec<u8>)], name: &'r str) -> impl Iterator<Item = &'r [u8]> + 'r {
        request.iter().filter(move |(n, _)| n == name).map(|(_, v)| v.as_slice())
    }
    let key_header = rule.key_header()?;
    let key_values: Vec<&[u8]> = values(request, key_header).collect();
    let key = parse_key(&key_values).ok()?;
    let authority = values(request, ":authority").next()?.to_vec();
    let path = reconcile.path.replace("{key}", &percent_encode(key.as_str()));
    let mut headers = vec![
        (":method".to_string(), reconcile.method.as_bytes().to_vec()),
        (":path".to_string(), path.into_bytes()),
        (":authority".to_string(), authority),
        (key_header.to_string(), key_values.first().map(|v| v.to_vec()).unwrap_or_default()),
    ];
    for name in reconcile.headers.iter().filter(|n| *n != key_header) {
        headers.extend(values(request, name).map(|v| (name.clone(), v.to_vec())));
    }
    let timeout_ms = u32::try_from(reconcile.timeout_ms).unwrap_or(u32::MAX);
    Some(LookupCall { cluster: reconcile.cluster.clone(), headers, timeout_ms })
}

/// The part of a request's head its lookup is made from (`lookup_call`): `:authority`, the key
/// header and the headers `reconcile` copies. Kept from admission: Envoy hands the filter the
/// request's head only while the request is being decoded (and again at its log).
pub fn lookup_request(
    rule: &Rule,
    reconcile: &Reconcile,
    request: &[(String, Vec<u8>)],
) -> Vec<(String, Vec<u8>)> {
    let key_header = rule.key_header().unwrap_or_default();
    request
        .iter()
        .filter(|(n, _)| n == ":authority" || n == key_header || reconcile.headers.contains(n))
        .cloned()
        .collect()
}

/// What the lookup's answer means. `status` None: Envoy gave no answer (no connection, the
/// call's timeout, a reset). 202 says "accepted, not final", and every status outside 2xx but
/// 404 (a 409 or 425 "still processing", a 5xx) says nothing final either.
pub fn answer_of(
    rule: &Rule,
    status: Option<u16>,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
) -> LookupAnswer {
    match status {
        Some(404) => LookupAnswer::NotFound,
        Some(s @ 200..=299) if s != 202 => {
            let snapshot = (body.len() as u64 <= rule.max_response_bytes).then(|| {
                let mut headers = engine::snapshot_headers(headers, &rule.replay_exclude_headers);
                headers.retain(|(n, _)| n != RECONCILED_HEADER);
                headers.push((RECONCILED_HEADER.to_string(), b"true".to_vec()));
                Snapshot { status: s, headers, body }
            });
            LookupAnswer::Found { status: s, snapshot }
        }
        Some(s) => LookupAnswer::Failed(format!("the lookup answered {s}, which settles nothing")),
        None => LookupAnswer::Failed("the lookup got no answer (no connection, or its timeout)".into()),
    }
}

/// What the root needs to look a record up when its lease ends, with no request waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaterLookup {
    pub pending: Pending,
    pub fingerprint: Fingerprint,
    /// The request's head as the lookup needs it (`reconcile::lookup_request`).
    pub request: Vec<(String, Vec<u8>)>,
    /// When the claim's lease ends.
    pub due_ms: u64,
    /// The route's cluster, kept for a lookup built when it can no longer be read (a detached
    /// request's client gone: `RequestFlow::keep_route_cluster`).
    pub route_cluster: Option<String>,
    /// The claim's owner token: while its owner held it, its lease ran on (`renewal`), and the
    /// lookup is due when the lease it last renewed ends.
    pub owner: u64,
}

/// What the upstream's lookup answered for an executed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub status: u16,
    pub snapshot: Option<Snapshot>,
}

impl Found {
    /// What writing it as the record's outcome asks the store (at `now_ms`, kept `ttl_ms`).
    pub fn completion(&self, now_ms: u64, ttl_ms: u64) -> Completion {
        Completion {
            state: State::Succeeded,
            status: self.status,
            snapshot: self.snapshot.clone(),
            now_ms,
            ttl_ms,
        }
    }
}

/// A lease-end lookup's call (built while its stream was there) and what acting on its answer
/// asks the store; `tries`: lookups made that settled nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEnd {
    pub cluster: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub timeout_ms: u32,
    pub attempt: ClaimAttempt,
    pub tries: u32,
}

/// The root's own lookup of a record whose lease ended after an unknown outcome it saw
/// (`Step::LookUpAtLeaseEnd`): no stream and no client, so nothing to answer and nothing to
/// forward; it settles the record through the store or leaves it for a retry's lookup. Its
/// transitions are the flow's part (`flow.rs`); a flow in the table carries it as its one phase
/// (`RequestFlow::lease_end`), so the root's executor holds it like any other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEndLookup {
    /// The stream it came from, for the log.
    context_id: u32,
    /// The record's rule and scope, as the request that saw the unknown outcome was admitted.
    pending: Pending,
    /// The lookup's call, the attempt acting on its answer asks the store, and the tries made.
    call: LeaseEnd,
    state: LeaseEndState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LeaseEndState {
    /// Waiting for its time: first, or again after a lookup that settled nothing.
    Due,
    /// Asking the store whether the record is still unsettled (`attempt`), or taking over one
    /// the upstream never executed (then released).
    Asking { attempt: ClaimAttempt },
    /// The upstream's lookup is under way; `attempt` is what was asked of the store.
    LookingUp { attempt: ClaimAttempt },
    /// The upstream executed it: taking the record over to write `found` as its outcome.
    Adopting { now_ms: u64, found: Found },
    /// Writing `found` under the record's `claim`.
    Writing { claim: Claim, found: Found },
    /// Releasing a record the upstream never executed, so that the client's retry executes.
    Releasing { claim: Claim },
    /// Settled, or left to a retry's lookup.
    Done,
}

impl LeaseEndLookup {
    pub fn new(context_id: u32, later: LaterLookup, call: LeaseEnd) -> LeaseEndLookup {
        LeaseEndLookup { context_id, pending: later.pending, call, state: LeaseEndState::Due }
    }

    /// Its call, and its rule.
    pub fn call(&self) -> (&LeaseEnd, &Rc<Rule>) {
        (&self.call, &self.pending.rule)
    }

    /// True while the upstream's lookup is to be asked (or asked again).
    pub fn awaiting_lookup(&self) -> bool {
        matches!(self.state, LeaseEndState::Due | LeaseEndState::LookingUp { .. })
    }

    /// A lookup settled nothing once more: how often now.
    pub fn tried(&mut self) -> u32 {
        self.call.tries = self.call.tries.saturating_add(1);
        self.call.tries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse, Config};

    fn cfg(reconcile: &str) -> Config {
        let json = format!(
            r#"{{"tenant_header":"x-tenant","routes":[{{"name":"pay","match":{{"prefix":"/pay"}},
            "max_response_bytes":16,"replay_exclude_headers":["set-cookie"],"reconcile":{reconcile}}}]}}"#
        );
        parse(json.as_bytes()).unwrap()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn the_lookup_carries_the_encoded_key_and_only_the_callers_identity() {
        let c = cfg(r#"{"path":"/payments/by-key/{key}"}"#);
        let reconcile = c.rules[0].reconcile.as_ref().unwrap();
        let request = pairs(&[
            (":method", "POST"),
            (":path", "/pay/42?x=1"),
            (":authority", "api.example"),
            ("idempotency-key", "a/b+%?"),
            ("authorization", "Bearer t"),
            ("x-tenant", "acme"),
            ("x-envoy-retry-on", "5xx"),
            ("content-type", "application/json"),
        ]);
        let call = lookup_call(&c.rules[0], reconcile, &request).unwrap();
        assert_eq!(call.cluster, None);
        assert_eq!(call.timeout_ms, 2_000);
        assert_eq!(
            call.headers,
            pairs(&[
                (":method", "GET"),
                (":path", "/payments/by-key/a%2Fb%2B%25%3F"),
                (":authority", "api.example"),
                ("idempotency-key", "a/b+%?"),
                ("authorization", "Bearer t"),
                ("x-tenant", "acme"),
            ])
        );
        // A quoted key is the same key: its unquoted form goes in the path.
        let quoted = pairs(&[(":authority", "h"), ("idempotency-key", "\"k1\"")]);
        let call = lookup_call(&c.rules[0], reconcile, &quoted).unwrap();
        assert_eq!(call.headers[1].1, b"/payments/by-key/k1".to_vec());
        // No key, or no authority: no lookup.
        assert_eq!(lookup_call(&c.rules[0], reconcile, &pairs(&[(":authority", "h")])), None);
        assert_eq!(lookup_call(&c.rules[0], reconcile, &pairs(&[("idempotency-key", "k")])), None);
    }

    #[test]
    fn a_rule_s_own_key_header_is_the_lookup_s_key() {
        let json = r#"{"routes":[{"name":"pay","match":{"prefix":"/pay"},"key":{"header":"x-request-id"},
            "reconcile":{"path":"/p/{key}"}}]}"#;
        let c = parse(json.as_bytes()).unwrap();
        let (rule, reconcile) = (&c.rules[0], c.rules[0].reconcile.as_ref().unwrap());
        let request = pairs(&[(":authority", "h"), ("idempotency-key", "other"), ("x-request-id", "r1")]);
        let kept = lookup_request(rule, reconcile, &request);
        assert_eq!(kept, pairs(&[(":authority", "h"), ("x-request-id", "r1")]));
        let call = lookup_call(rule, reconcile, &kept).unwrap();
        assert_eq!(call.headers[1].1, b"/p/r1".to_vec());
        assert_eq!(call.headers[3], ("x-request-id".to_string(), b"r1".to_vec()));
    }

    #[test]
    fn only_a_final_2xx_is_found_and_only_404_is_not_found() {
        let c = cfg(r#"{"path":"/p/{key}"}"#);
        let rule = &c.rules[0];
        // An upstream's own marker is not taken for the filter's.
        let headers = pairs(&[
            ("content-type", "application/json"),
            ("set-cookie", "s=1"),
            ("connection", "close"),
            (RECONCILED_HEADER, "false"),
        ]);
        let found = answer_of(rule, Some(201), headers.clone(), b"{\"id\":1}".to_vec());
        let snapshot = Snapshot {
            status: 201,
            headers: pairs(&[("content-type", "application/json"), (RECONCILED_HEADER, "true")]),
            body: b"{\"id\":1}".to_vec(),
        };
        assert_eq!(found, LookupAnswer::Found { status: 201, snapshot: Some(snapshot) });
        // Larger than max_response_bytes: the status alone.
        let big = answer_of(rule, Some(200), headers.clone(), vec![b'x'; 17]);
        assert_eq!(big, LookupAnswer::Found { status: 200, snapshot: None });
        assert_eq!(answer_of(rule, Some(404), headers.clone(), Vec::new()), LookupAnswer::NotFound);
        for status in [Some(202), Some(409), Some(425), Some(500), Some(503), Some(504), Some(301), None] {
            let answer = answer_of(rule, status, headers.clone(), Vec::new());
            assert!(matches!(answer, LookupAnswer::Failed(_)), "{status:?}: {answer:?}");
        }
    }
}
