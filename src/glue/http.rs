//! Per-request glue: gathers what the engine needs, acts on its decisions, captures the upstream
//! response, and settles the claim.

use super::host::{self, HostError};
use super::root::{PluginState, Resumed, WaitHandle};
use crate::config::{Concurrency, Rule};
use crate::engine::{self, Admission, Decision, HeaderFix, Pending, ReplayShape, Reply, RequestHead};
use crate::identity::fingerprint::Fingerprint;
use crate::metrics::Counter;
use crate::settlement::{plan_response, plan_unfinished, ResponsePlan, StreamReport};
use crate::store::record::{Snapshot, State};
use crate::store::{Claim, Completion, RecordStore, Settled};
use crate::wait::{self, Waiter};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::Cell;
use std::rc::Rc;

/// `response.code_details` of the filter's own replies, so logs tell them apart.
const DETAILS_REPLAY: &str = "idempotency_replay";
const DETAILS_PROBLEM: &str = "idempotency_problem";

enum Phase {
    /// Not (or no longer) our business.
    Idle,
    /// Protected request held until its body is complete.
    Collecting(Pending),
    /// We answered locally; our own reply comes back through the encode callbacks and must be
    /// left alone (never snapshotted), except that a replay's framing headers are put back to
    /// what the upstream sent (Envoy's local-reply path rewrites them).
    Answered { replay_shape: Option<ReplayShape> },
    /// Wait mode: held in the root's wait room until the original's outcome is known; the
    /// root resolves it (resume or answer) and leaves word in the handle.
    Waiting(WaitHandle),
    /// Forwarded with a claim; waiting for the response.
    Forwarded { claim: Claim, rule: Rc<Rule> },
    /// A real upstream answer worth keeping; its body is being copied as it streams by.
    Capturing(Capture),
}

struct Capture {
    claim: Claim,
    rule: Rc<Rule>,
    state: State,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    /// The body outgrew `max_response_bytes`: the outcome is kept without it.
    overflowed: bool,
}

pub struct Http {
    context_id: u32,
    plugin: Option<Rc<PluginState>>,
    phase: Phase,
    /// The rule of a request that went upstream under a claim, until its stream ends: the
    /// router's attempt count is only final in `on_log`.
    forwarded_rule: Option<Rc<Rule>>,
}

impl Http {
    pub fn new(context_id: u32, plugin: Option<Rc<PluginState>>) -> Http {
        Http { context_id, plugin, phase: Phase::Idle, forwarded_rule: None }
    }

    fn count(&self, counter: Counter) {
        if let Some(s) = &self.plugin {
            s.metrics.count(counter);
        }
    }

    fn reply(&mut self, reply: &Reply, details: &str) -> Action {
        self.phase = Phase::Answered { replay_shape: reply.replay_shape.clone() };
        if let Err(HostError(s)) = host::send_response(reply.status, details, &reply.headers, &reply.body) {
            log::warn!("#{} could not send the local reply (host status {s})", self.context_id);
        }
        Action::Pause
    }

    fn now_ms(&self) -> u64 {
        host::now_nanos().map(|n| n / 1_000_000).unwrap_or(0)
    }

    fn on_headers(&mut self, plugin: &PluginState, end_of_stream: bool) -> Action {
        // Match the route on two small reads first: unprotected traffic never pays for a copy
        // of the whole header map.
        let method =
            host::header_value(host::MAP_REQUEST_HEADERS, ":method").ok().flatten().unwrap_or_default();
        let path = host::header_value(host::MAP_REQUEST_HEADERS, ":path").ok().flatten().unwrap_or_default();
        let method = String::from_utf8_lossy(&method);
        let path = String::from_utf8_lossy(&path);
        let path_only = path.split('?').next().unwrap_or_default();
        if plugin.config.rule_for(&method, path_only).is_none() {
            self.count(Counter::PassedThrough);
            return Action::Continue;
        }
        let headers = match host::header_pairs(host::MAP_REQUEST_HEADERS) {
            Ok(h) => h,
            Err(HostError(s)) => {
                log::warn!(
                    "#{} cannot read request headers (host status {s}); passing through",
                    self.context_id
                );
                self.count(Counter::PassedThrough);
                return Action::Continue;
            }
        };
        let verified_claims =
            plugin.config.jwt_principal.as_ref().and_then(|jwt| verified_claims(&jwt.payload, &jwt.claims));
        let head = RequestHead {
            method: &method,
            path: &path,
            headers: &headers,
            verified_claims: verified_claims.as_deref(),
        };
        match engine::admit(&plugin.config, &head) {
            Admission::PassThrough => {
                self.count(Counter::PassedThrough);
                Action::Continue
            }
            Admission::Reject(problem) => {
                self.count(Counter::of_problem(problem.kind));
                log::debug!("#{} refused at headers: {}", self.context_id, problem.kind.slug());
                self.reply(&Reply::problem(&problem), DETAILS_PROBLEM)
            }
            Admission::Collect(pending) => {
                if end_of_stream {
                    self.decide(plugin, &pending, &[])
                } else {
                    self.phase = Phase::Collecting(pending);
                    Action::Pause
                }
            }
        }
    }

    fn decide(&mut self, plugin: &PluginState, pending: &Pending, body: &[u8]) -> Action {
        let fingerprint = match engine::fingerprint_body(pending, body) {
            Ok(fingerprint) => fingerprint,
            Err(problem) => {
                self.count(Counter::of_problem(problem.kind));
                return self.reply(&Reply::problem(&problem), DETAILS_PROBLEM);
            }
        };
        let now_nanos = host::now_nanos().unwrap_or(0);
        let owner = plugin.owner_token(self.context_id, now_nanos);
        let decision = engine::decide_fingerprinted(
            &plugin.config,
            pending,
            fingerprint,
            &plugin.store,
            now_nanos / 1_000_000,
            owner,
        );
        match decision {
            Decision::Forward { claim, counter } => {
                self.count(counter);
                log::debug!("#{} {} key {}", self.context_id, counter.name(), pending.scope.log_tag());
                self.phase = Phase::Forwarded { claim, rule: Rc::clone(&pending.rule) };
                self.forwarded_rule = Some(Rc::clone(&pending.rule));
                Action::Continue
            }
            Decision::Respond { reply, counter } => {
                self.count(counter);
                log::debug!("#{} {} key {}", self.context_id, counter.name(), pending.scope.log_tag());
                let details = if counter == Counter::Replayed { DETAILS_REPLAY } else { DETAILS_PROBLEM };
                self.reply(&reply, details)
            }
            Decision::Wait { lease_remaining_ms } => {
                self.park(plugin, pending, fingerprint, now_nanos / 1_000_000, lease_remaining_ms)
            }
        }
    }

    fn park(
        &mut self,
        plugin: &PluginState,
        pending: &Pending,
        fingerprint: Fingerprint,
        now_ms: u64,
        lease_remaining_ms: u64,
    ) -> Action {
        let give_up_at_ms = wait::give_up_at(pending, now_ms);
        let handle: WaitHandle = Rc::new(Cell::new(None));
        let recheck_at_ms = if plugin.ensure_advertised(now_ms) {
            now_ms
        } else {
            wait::first_recheck(now_ms, lease_remaining_ms, give_up_at_ms)
        };
        let waiter = Waiter {
            context_id: self.context_id,
            pending: pending.clone(),
            fingerprint,
            give_up_at_ms,
            recheck_at_ms,
            handle: handle.clone(),
        };
        let parked = plugin.room.borrow_mut().park(waiter);
        match parked {
            Ok(()) => {
                self.count(Counter::Waiting);
                log::debug!("#{} waiting for key {}", self.context_id, pending.scope.log_tag());
                self.phase = Phase::Waiting(handle);
                Action::Pause
            }
            Err(refused) => {
                self.count(Counter::WaitRefused);
                log::debug!(
                    "#{} not held ({refused:?} bound) for key {}",
                    self.context_id,
                    pending.scope.log_tag()
                );
                self.reply(&engine::in_flight_reply(&plugin.config, lease_remaining_ms), DETAILS_PROBLEM)
            }
        }
    }

    /// A held request the root has resolved continues in the phase the root chose.
    fn take_resumed(&mut self) {
        if let Phase::Waiting(handle) = &self.phase {
            match handle.take() {
                Some(Resumed::Forwarded { claim, rule }) => {
                    self.forwarded_rule = Some(Rc::clone(&rule));
                    self.phase = Phase::Forwarded { claim, rule };
                }
                Some(Resumed::Answered { replay_shape }) => self.phase = Phase::Answered { replay_shape },
                None => {}
            }
        }
    }

    /// Puts a replay's `content-type` and `content-length` back to the stored ones.
    fn restore_replay_headers(&self, shape: &ReplayShape) {
        let sent = |name| host::header_value(host::MAP_RESPONSE_HEADERS, name).ok().flatten();
        let (content_type, content_length) = (sent("content-type"), sent("content-length"));
        for fix in engine::replay_header_fixes(shape, content_type.as_deref(), content_length.as_deref()) {
            let result = match &fix {
                HeaderFix::Set(name, value) => host::set_header(host::MAP_RESPONSE_HEADERS, name, value),
                HeaderFix::Remove(name) => host::remove_header(host::MAP_RESPONSE_HEADERS, name),
            };
            if let Err(HostError(s)) = result {
                log::warn!(
                    "#{} could not restore a replayed header {fix:?} (host status {s})",
                    self.context_id
                );
            }
        }
    }

    /// Response flags, and whether an upstream host was ever selected; read only when the
    /// answer is not a real upstream one, the only case where they matter.
    fn stream_report() -> (u64, bool) {
        let flags = host::property_u64(&["response", "flags"]).unwrap_or(0);
        let upstream_selected = match host::property(&["upstream", "address"]) {
            Ok(Some(address)) => !address.is_empty(),
            Ok(None) => false,
            Err(_) => true,
        };
        (flags, upstream_selected)
    }

    /// Waiters elsewhere may be able to proceed now that this record has an outcome.
    fn wake_waiters(&self, plugin: &PluginState, rule: &Rule, claim: &Claim) {
        if matches!(rule.concurrency, Concurrency::Wait { .. }) {
            plugin.broadcast(&claim.scope);
        }
    }

    /// The whole request body is in Envoy's buffer (end of stream, or trailers follow it).
    fn on_body_complete(&mut self, plugin: &PluginState, size: usize) -> Action {
        let Phase::Collecting(pending) = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return Action::Continue;
        };
        match host::buffer(host::BUFFER_REQUEST_BODY, 0, size) {
            Ok(body) => self.decide(plugin, &pending, &body),
            Err(HostError(s)) => {
                log::warn!("#{} cannot read the request body (host status {s})", self.context_id);
                let problem = crate::problem::Problem::new(
                    crate::problem::Kind::StoreUnavailable,
                    503,
                    "the request body could not be read; retry later",
                )
                .retry_after_ms(1000);
                self.count(Counter::StoreError);
                self.reply(&Reply::problem(&problem), DETAILS_PROBLEM)
            }
        }
    }

    fn settle(&mut self, plugin: &PluginState, plan: ResponsePlan, claim: Claim, rule: &Rule) {
        match plan {
            ResponsePlan::Release => {
                let counter = match plugin.store.release(&claim) {
                    Ok(Settled::Done) => {
                        self.wake_waiters(plugin, rule, &claim);
                        Counter::Released
                    }
                    Ok(Settled::Lost) => Counter::CompletionLost,
                    Err(e) => {
                        log::warn!("#{} release failed: {e}", self.context_id);
                        Counter::StoreError
                    }
                };
                self.count(counter);
            }
            ResponsePlan::Keep => self.count(Counter::KeptUnknown),
            ResponsePlan::Capture { .. } => {}
        }
        log::debug!("#{} settled {:?} key {}", self.context_id, plan, claim.scope.log_tag());
    }

    fn finish_capture(&mut self, plugin: &PluginState) {
        let Phase::Capturing(c) = std::mem::replace(&mut self.phase, Phase::Idle) else { return };
        let snapshot =
            (!c.overflowed).then_some(Snapshot { status: c.status, headers: c.headers, body: c.body });
        let completion = Completion {
            state: c.state,
            status: c.status,
            snapshot,
            now_ms: self.now_ms(),
            ttl_ms: c.rule.ttl_ms,
        };
        let settled = plugin.store.complete(&c.claim, &completion);
        if settled == Ok(Settled::Done) {
            self.wake_waiters(plugin, &c.rule, &c.claim);
        }
        let counter = match settled {
            Ok(Settled::Done) if c.overflowed => Counter::ResponseNotStored,
            Ok(Settled::Done) => Counter::Stored,
            Ok(Settled::Lost) => Counter::CompletionLost,
            Err(e) => {
                log::warn!("#{} storing the response failed: {e}", self.context_id);
                Counter::StoreError
            }
        };
        self.count(counter);
        log::debug!("#{} {} key {}", self.context_id, counter.name(), c.claim.scope.log_tag());
    }
}

impl Http {
    /// Envoy's router may send one claimed request upstream several times (route retry policy,
    /// hedging, internal redirects): each attempt may execute. Count it, and say so once per
    /// rule for the whole Envoy, so that an operator can remove the retry policy.
    fn note_upstream_attempts(&self, plugin: &PluginState, r: &Rule) {
        let attempts = host::property_u64(&["upstream", "request_attempt_count"]).unwrap_or(0);
        if attempts <= 1 {
            return;
        }
        self.count(Counter::UpstreamRetried);
        if plugin.first_retry_warning(&r.name) {
            log::warn!(
                "route rule {}: Envoy sent a protected request upstream {attempts} times under one \
                 claim (route retry_policy, hedging or internal redirect); each attempt may execute: \
                 disable Envoy retries on routes this filter protects",
                r.name
            );
        }
    }
}

/// The configured claims of the token a JWT filter in front verified, from its dynamic metadata
/// (only a verified token fills it; a client cannot). None when no claim is there at all: the
/// request carried no verified token, and the principal falls back to the principal headers.
fn verified_claims(payload: &str, claims: &[String]) -> Option<Vec<Option<Vec<u8>>>> {
    let values: Vec<Option<Vec<u8>>> = claims
        .iter()
        .map(|claim| {
            host::property(&["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", payload, claim])
                .ok()
                .flatten()
        })
        .collect();
    values.iter().any(Option::is_some).then_some(values)
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else { return Action::Continue };
        self.on_headers(&plugin, end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else { return Action::Continue };
        let rule = match &self.phase {
            Phase::Collecting(p) => Some(Rc::clone(&p.rule)),
            Phase::Answered { .. } => return Action::Pause,
            _ => return Action::Continue,
        };
        // Refuse as soon as the buffered body outgrows the limit, not at its end.
        if let Some(rule) = rule.filter(|r| body_size as u64 > r.max_request_bytes) {
            self.count(Counter::TooLarge);
            return self.reply(&Reply::problem(&engine::too_large(&rule)), DETAILS_PROBLEM);
        }
        if end_of_stream {
            self.on_body_complete(&plugin, body_size)
        } else {
            Action::Pause
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(plugin) = self.plugin.clone() else { return Action::Continue };
        match self.phase {
            Phase::Collecting(_) => self.on_body_complete(&plugin, usize::MAX),
            Phase::Answered { .. } => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else { return Action::Continue };
        self.take_resumed();
        if let Phase::Answered { replay_shape: Some(shape) } = &self.phase {
            self.restore_replay_headers(shape);
            return Action::Continue;
        }
        let Phase::Forwarded { claim, rule } = &self.phase else { return Action::Continue };
        let (claim, rule) = (*claim, Rc::clone(rule));
        let rule_cfg = &rule;
        let status = host::header_value(host::MAP_RESPONSE_HEADERS, ":status")
            .ok()
            .flatten()
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok());
        let details = host::property_string(&["response", "code_details"]);
        // A real upstream answer needs no flags; only local replies are classified by them.
        let (flags, upstream_selected) = if details.as_deref() == Some(crate::settlement::VIA_UPSTREAM) {
            (0, true)
        } else {
            Self::stream_report()
        };
        let report = StreamReport { details: details.as_deref(), flags, upstream_selected };
        match plan_response(rule_cfg, status, report) {
            ResponsePlan::Capture { state, status } => {
                let headers = host::header_pairs(host::MAP_RESPONSE_HEADERS).unwrap_or_default();
                let headers = engine::snapshot_headers(headers, &rule_cfg.replay_exclude_headers);
                self.phase = Phase::Capturing(Capture {
                    claim,
                    rule,
                    state,
                    status,
                    headers,
                    body: Vec::new(),
                    overflowed: false,
                });
                if end_of_stream {
                    self.finish_capture(&plugin);
                }
            }
            plan => {
                self.phase = Phase::Idle;
                self.settle(&plugin, plan, claim, &rule);
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else { return Action::Continue };
        self.take_resumed();
        if let Phase::Capturing(c) = &mut self.phase {
            let limit = c.rule.max_response_bytes;
            if !c.overflowed && body_size > 0 {
                // The body streams through untouched; we keep a copy of each chunk as it passes.
                match host::buffer(host::BUFFER_RESPONSE_BODY, 0, body_size) {
                    Ok(chunk) if (c.body.len() + chunk.len()) as u64 <= limit => {
                        c.body.extend_from_slice(&chunk)
                    }
                    Ok(_) => {
                        c.overflowed = true;
                        c.body = Vec::new();
                    }
                    Err(HostError(s)) => {
                        log::warn!("#{} cannot read the response body (host status {s})", self.context_id);
                        c.overflowed = true;
                        c.body = Vec::new();
                    }
                }
            }
            if end_of_stream {
                self.finish_capture(&plugin);
            }
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(plugin) = self.plugin.clone() else { return Action::Continue };
        // With trailers the last body frame never says end of stream.
        self.finish_capture(&plugin);
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(plugin) = self.plugin.clone() else { return };
        self.take_resumed();
        if let Some(rule) = self.forwarded_rule.take() {
            self.note_upstream_attempts(&plugin, &rule);
        }
        let (claim, rule) = match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Forwarded { claim, rule } => (claim, rule),
            Phase::Capturing(c) => {
                // The upstream answered with a status worth keeping, so it executed; only its
                // body never arrived whole (upstream reset mid-body, client gone). Keep the
                // outcome without the body: a retry gets 410, never a second execution.
                let cut = Capture { overflowed: true, body: Vec::new(), ..c };
                log::debug!("#{} upstream answer cut mid-body: kept without its body", self.context_id);
                self.phase = Phase::Capturing(cut);
                self.finish_capture(&plugin);
                return;
            }
            Phase::Waiting(_) => {
                // The client left while held: nothing was claimed, just stop holding it.
                plugin.room.borrow_mut().leave(self.context_id);
                log::debug!("#{} held request's client went away", self.context_id);
                return;
            }
            _ => return,
        };
        let details = host::property_string(&["response", "code_details"]);
        let (flags, upstream_selected) = Self::stream_report();
        let plan = plan_unfinished(StreamReport { details: details.as_deref(), flags, upstream_selected });
        log::debug!("#{} stream ended unfinished ({details:?}, flags {flags:#x})", self.context_id);
        self.settle(&plugin, plan, claim, &rule);
    }
}
