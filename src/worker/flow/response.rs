//! The response side of a request's flow: what its head, body and end mean for the record (as
//! `ending.rs` plans it), the capture of the body, and the settlement (`complete` or `release`)
//! that writes it, carried out by the flow itself or handed to whoever outlives the stream.

use super::facts::{attempt_count, body_bytes_received, property_string, stream_report};
use super::{Capture, Output, Phase, RequestFlow, Step, StreamFacts, Unreadable};
use crate::config::{Concurrency, Config, Rule};
use crate::ending::{plan_response, plan_unfinished, ResponsePlan, StreamReport, VIA_UPSTREAM};
use crate::engine::{self};
use crate::identity::scope::ScopeId;
use crate::metrics::Counter;
use crate::store::record::Snapshot;
use crate::store::{Claim, Completion, Settled, StoreError, StoreOp};
use std::rc::Rc;

/// First wait before a settlement is started again, doubled after each failure up to
/// `RETRY_MAX_BACKOFF_MS`.
pub const RETRY_FIRST_BACKOFF_MS: u64 = 100;
pub const RETRY_MAX_BACKOFF_MS: u64 = 2_000;

/// When a settlement the store could not take (unreachable, too slow) is started again, and
/// when its carrier stops trying. Starting one again is safe: both of its writes are guarded
/// by the claim's revision, so a try that finds the claim taken over changes nothing (`Lost`),
/// and one that finds its own earlier write landed is done (`store::etcd`).
///
/// It is tried until its claim's lease ended one `processing_timeout` ago (`retry_window_end`),
/// and never longer: a claim's lease key outlives at least that, by etcd's clock
/// (`store::etcd::leases`), so no other Envoy takes over the record of a request that was
/// answered within its lease while its completion is still being tried: a client answered 201
/// is never executed a second time because the store was briefly out of reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Retry {
    pub due_ms: u64,
    pub backoff_ms: u64,
    pub give_up_at_ms: u64,
}

/// The end of a settlement's tries: its claim's lease end (as the claim wrote it, by the
/// owner's clock) plus `processing_timeout`. A claim whose written record is not known (a
/// store that settles at once, which never retries) counts from the first failure instead.
pub fn retry_window_end(claim: &Claim, now_ms: u64, processing_timeout_ms: u64) -> u64 {
    claim.written.map_or(now_ms, |e| e.lease_deadline_ms).saturating_add(processing_timeout_ms)
}

impl Retry {
    /// After the first failure at `now_ms`, tried until `give_up_at_ms`; None: that is past.
    pub fn first_within(now_ms: u64, give_up_at_ms: u64) -> Option<Retry> {
        let due_ms = now_ms.saturating_add(RETRY_FIRST_BACKOFF_MS);
        (due_ms < give_up_at_ms).then_some(Retry {
            due_ms,
            backoff_ms: RETRY_FIRST_BACKOFF_MS,
            give_up_at_ms,
        })
    }

    /// The same tries, until `give_up_at_ms` if that is later (its claim was renewed meanwhile).
    pub fn within(self, give_up_at_ms: u64) -> Retry {
        Retry { give_up_at_ms: self.give_up_at_ms.max(give_up_at_ms), ..self }
    }

    /// After another failure at `now_ms`; None: give up.
    pub fn next(self, now_ms: u64) -> Option<Retry> {
        let backoff_ms = self.backoff_ms.saturating_mul(2).min(RETRY_MAX_BACKOFF_MS);
        let due_ms = now_ms.saturating_add(backoff_ms);
        (due_ms < self.give_up_at_ms).then_some(Retry { due_ms, backoff_ms, ..self })
    }
}

/// A `complete` or `release` the flow handed over to be settled by someone who outlives the
/// stream (the root, for a store across the network); `answered` says what its answer
/// means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub context_id: u32,
    pub claim: Claim,
    pub rule: Rc<Rule>,
    pub done: Counter,
}

impl Settlement {
    /// What the store's answer to this settlement means, whoever carried it out (the flow
    /// itself, or the root for a stream that may be gone): the counter (`done`, or lost, or a
    /// store error), and the record whose waiters to wake when it now has an outcome.
    pub fn result(&self, settled: Result<Settled, StoreError>) -> (Counter, Option<ScopeId>) {
        let (counter, wake) = match settled {
            // Waiters elsewhere may be able to proceed now that this record has an outcome.
            Ok(Settled::Done) => (
                self.done,
                matches!(self.rule.concurrency, Concurrency::Wait { .. }).then_some(self.claim.scope),
            ),
            Ok(Settled::Lost) => (Counter::CompletionLost, None),
            Err(e) => {
                log::warn!("#{} settling the claim failed: {e}", self.context_id);
                (Counter::StoreError, None)
            }
        };
        super::said(self.context_id, counter.name(), Some(&self.claim.scope));
        (counter, wake)
    }

    /// `result` as the flow's steps: the wake-up first, then the count; the claim is no longer
    /// held, whatever the store said.
    pub fn answered(&self, settled: Result<Settled, StoreError>) -> Vec<Step> {
        let (counter, wake) = self.result(settled);
        wake.map(Step::Wake)
            .into_iter()
            .chain([Step::Count(counter), Step::LetGo(self.claim.owner)])
            .collect()
    }
}

/// `first`, then `then`: `then` itself when there is nothing before it (almost always), so the
/// usual response allocates nothing more for it.
fn joined(mut first: Vec<Step>, then: Vec<Step>) -> Vec<Step> {
    if first.is_empty() {
        return then;
    }
    first.extend(then);
    first
}

impl RequestFlow {
    /// Response headers.
    pub fn response_headers(
        &mut self,
        cfg: &Config,
        facts: &mut dyn StreamFacts,
        end_of_stream: bool,
    ) -> Output {
        if let Phase::Answered { replay_shape: Some(shape) } = &self.phase {
            // One read of the map, not one per header (each read is a round trip into the module).
            let sent = facts.response_headers();
            let sent_value = |name: &str| sent.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
            let (content_type, content_length) = (sent_value("content-type"), sent_value("content-length"));
            let fixes =
                engine::replay_header_fixes(shape, content_type.as_deref(), content_length.as_deref());
            let steps = if fixes.is_empty() { Vec::new() } else { vec![Step::FixHeaders(fixes)] };
            return Output::go(steps);
        }
        let Phase::Forwarded { claim, rule } = &self.phase else { return Output::go(Vec::new()) };
        let (claim, rule) = (*claim, Rc::clone(rule));
        let sent = facts.response_headers();
        let status = sent
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, s)| std::str::from_utf8(s).ok()?.parse::<u16>().ok());
        let mut steps = Vec::new();
        let details = if cfg.envoy_headers.from_upstream(&sent) {
            Some(VIA_UPSTREAM.to_string())
        } else {
            // Another prefix's mark instead of ours: Envoy's header_prefix is not the configured
            // one (a scan of headers at hand, on a path that makes a host call next anyway).
            if let Some(seen) = cfg.envoy_headers.foreign_service_time(&sent) {
                steps.push(Step::ErrorHeaderPrefix { seen: seen.to_owned() });
            }
            // Envoy's headers suppressed, or a local reply: Envoy says which.
            property_string(facts, &["response", "code_details"])
        };
        // A real upstream answer needs no flags; only local replies are classified by them.
        let (flags, upstream_selected) =
            if details.as_deref() == Some(VIA_UPSTREAM) { (0, true) } else { stream_report(facts) };
        let report = StreamReport { details: details.as_deref(), flags, upstream_selected };
        // The attempt count only where a release on "never sent" grounds is decided (a host call).
        match plan_response(&rule, status, report, || attempt_count(facts)) {
            ResponsePlan::Capture { state, status } => {
                let headers = engine::snapshot_headers(sent, &rule.replay_exclude_headers);
                self.phase = Phase::Capturing(Capture {
                    claim,
                    rule,
                    state,
                    status,
                    headers,
                    body: Vec::new(),
                    overflowed: false,
                });
                let then = if end_of_stream { self.finish_capture(facts) } else { Vec::new() };
                Output::go(joined(steps, then))
            }
            plan => {
                let then = self.settle(plan, claim, rule, facts);
                Output::go(joined(steps, then))
            }
        }
    }

    /// A response body frame of `size` bytes: copied as it streams by, never held.
    pub fn response_body(&mut self, facts: &mut dyn StreamFacts, size: usize, end_of_stream: bool) -> Output {
        let Phase::Capturing(c) = &mut self.phase else { return Output::go(Vec::new()) };
        if !c.overflowed && size > 0 {
            match facts.response_body(size) {
                Ok(chunk) if (c.body.len() + chunk.len()) as u64 <= c.rule.max_response_bytes => {
                    c.body.extend_from_slice(&chunk)
                }
                Ok(_) | Err(Unreadable) => {
                    c.overflowed = true;
                    c.body = Vec::new();
                }
            }
        }
        let steps = if end_of_stream { self.finish_capture(facts) } else { Vec::new() };
        Output::go(steps)
    }

    /// Response trailers: with them the last body frame never says end of stream.
    pub fn response_trailers(&mut self, facts: &mut dyn StreamFacts) -> Output {
        Output::go(self.finish_capture(facts))
    }

    /// The stream is over (Envoy's `on_log`), however it ended.
    pub fn stream_ended(&mut self, facts: &mut dyn StreamFacts) -> Output {
        let mut steps = Vec::new();
        // Read once for every request that went upstream under a claim (final now), and used by
        // an unfinished one's plan below too. None: not forwarded, so not read.
        let attempts = self.forwarded_rule.take().map(|rule| {
            let attempts = attempt_count(facts);
            if let Some(attempts) = attempts.filter(|n| *n > 1) {
                steps.push(Step::Count(Counter::UpstreamRetried));
                steps.push(Step::WarnRetried { rule: rule.name.clone(), attempts });
            }
            attempts
        });
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Forwarded { claim, rule } => {
                let details = property_string(facts, &["response", "code_details"]);
                let (flags, upstream_selected) = stream_report(facts);
                let plan = plan_unfinished(
                    &rule,
                    StreamReport { details: details.as_deref(), flags, upstream_selected },
                    || attempts.unwrap_or_else(|| attempt_count(facts)),
                );
                log::debug!("#{} stream ended unfinished ({details:?}, flags {flags:#x})", self.context_id);
                steps.extend(self.settle(plan, claim, rule, facts));
            }
            Phase::Capturing(c) => {
                // The upstream answered with a status worth keeping, so it executed; only its
                // body never arrived whole (upstream reset mid-body, client gone). Keep the
                // outcome without the body: a retry gets 410, never a second execution.
                super::said(self.context_id, "upstream answer cut mid-body: kept without its body", None);
                self.phase = Phase::Capturing(Capture { overflowed: true, body: Vec::new(), ..c });
                steps.extend(self.finish_capture(facts));
            }
            Phase::Waiting => {
                // The client left while held: nothing was claimed, just stop holding it.
                super::said(self.context_id, "held request's client went away", None);
                steps.push(Step::LeaveWaitRoom);
            }
            Phase::Collecting(pending) if !self.body_seen => {
                // Nothing was claimed. Either the client left before sending a byte of its body,
                // or Envoy never hands bodies to the filter (its pause at the headers without
                // allow_on_headers_stop_iteration stops the whole stream until it times out).
                // Envoy's own count of the bytes it received tells the two apart: a body that
                // reached Envoy and never the filter was kept from it.
                let details = property_string(facts, &["response", "code_details"]);
                let body_bytes = body_bytes_received(facts);
                log::debug!(
                    "#{} ended before any of its body arrived ({details:?}, {body_bytes:?} body bytes at Envoy)",
                    self.context_id
                );
                steps.push(Step::Count(Counter::BodyNeverReceived));
                let rule = pending.rule.name.clone();
                steps.push(match body_bytes {
                    Some(body_bytes) if body_bytes > 0 => {
                        Step::ErrorStopIterationMissing { rule, details, body_bytes }
                    }
                    _ => Step::WarnBodyNeverReceived { rule, details },
                });
            }
            phase => self.phase = phase,
        }
        Output::go(steps)
    }

    pub(super) fn settle(
        &mut self,
        plan: ResponsePlan,
        claim: Claim,
        rule: Rc<Rule>,
        facts: &mut dyn StreamFacts,
    ) -> Vec<Step> {
        let what = match plan {
            ResponsePlan::Capture { .. } => "capturing the answer of",
            ResponsePlan::Release => "releasing",
            ResponsePlan::Keep => "keeping in flight",
            ResponsePlan::CompleteUnknown => "completing as outcome unknown",
        };
        super::said(self.context_id, what, Some(&claim.scope));
        match plan {
            ResponsePlan::CompleteUnknown => {
                // Written like any completion (the local store at once, a remote one by the
                // root), and counted when the store has taken it.
                let completion = Completion::outcome_unknown(facts.now_ms(), rule.ttl_ms);
                self.phase = Phase::Settling { claim, rule, done: Counter::OutcomeUnknown };
                vec![Step::Store(StoreOp::Complete { claim, completion })]
            }
            ResponsePlan::Release => {
                self.phase = Phase::Settling { claim, rule, done: Counter::Released };
                vec![Step::Store(StoreOp::Release(claim))]
            }
            ResponsePlan::Keep => {
                self.phase = Phase::Idle;
                // The owner ended without an outcome: its claim ends where its last lease does.
                // With `reconcile` the record waits for the lookup, and until then this is what
                // it is: an unknown outcome.
                if rule.reconcile.is_none() {
                    return vec![Step::Count(Counter::KeptUnknown), Step::LetGo(claim.owner)];
                }
                let mut steps = vec![Step::Count(Counter::OutcomeUnknown)];
                steps.extend(self.later.take().map(Step::LookUpAtLeaseEnd));
                steps.push(Step::LetGo(claim.owner));
                steps
            }
            ResponsePlan::Capture { .. } => {
                self.phase = Phase::Idle;
                Vec::new()
            }
        }
    }

    pub(super) fn finish_capture(&mut self, facts: &mut dyn StreamFacts) -> Vec<Step> {
        let Phase::Capturing(c) = std::mem::replace(&mut self.phase, Phase::Idle) else { return Vec::new() };
        let snapshot =
            (!c.overflowed).then_some(Snapshot { status: c.status, headers: c.headers, body: c.body });
        let completion = Completion {
            state: c.state,
            status: c.status,
            snapshot,
            now_ms: facts.now_ms(),
            ttl_ms: c.rule.ttl_ms,
        };
        let done = if c.overflowed { Counter::ResponseNotStored } else { Counter::Stored };
        self.audit_outcome(c.state, c.status);
        self.phase = Phase::Settling { claim: c.claim, rule: c.rule, done };
        vec![Step::Store(StoreOp::Complete { claim: c.claim, completion })]
    }
}
