//! The root's settlements, the bottom layer of its work: a claim's completion or release carried
//! out for a stream that may be gone (answered at once, or a store conversation tried again
//! with backoff), the store calls every conversation makes, and the reply or held response that
//! goes out once a settlement is written. Calls nothing above it (`carry.rs`, `root.rs`).

use super::calls::{Conversing, RootCall, RootSettlement};
use super::flows::RootHold;
use super::plugin::{CalloutOf, PluginState};
use super::remote;
use super::unsettled::note::note_counted;
use crate::config::etcd::OnStoreError;
use crate::engine::Reply;
use crate::host::{Host, HostError};
use crate::metrics::Counter;
use crate::store::remote::{Answer, Conversation, Next, Request};
use crate::store::seam::Started;
use crate::store::{Settled, StoreAnswer, StoreError, StoreOp};
use crate::worker::flow::{retry_window_end, RequestFlow, Retry, Settlement};

/// Settlements being tried again past which a claim whose answer was lost is no longer given
/// back: so many failing means the store is struggling (slow, or failing every call), and
/// give-backs tried again with backoff would add to its load. The claim then waits for its
/// lease, as any abandoned claim.
const GIVE_BACK_WHILE_RETRYING_AT_MOST: usize = 256;

pub(super) fn gives_back<H: Host>(plugin: &PluginState<H>) -> bool {
    let retrying = plugin.calls.borrow().retrying.len();
    if retrying >= GIVE_BACK_WHILE_RETRYING_AT_MOST {
        log::debug!(
            "{retrying} settlements being tried again: a claim whose answer was lost is left to its lease"
        );
        return false;
    }
    true
}

/// Whether a failed store operation's last call reached Envoy (so etcd may have applied it), or
/// Envoy refused to make it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    Yes,
    No,
}

/// Releases `settlement`'s claim from the root: finished at once where the store answers at
/// once, else as a conversation tried again like any settlement.
pub(super) fn give_back<H: Host>(plugin: &PluginState<H>, settlement: Settlement) {
    match plugin.start(StoreOp::Release(settlement.claim)) {
        Started::Answered(answer) => settled_at_once(plugin, &settlement, answer.into_settled()),
        Started::Conversation(conversation) => settle_then_answer(plugin, conversation, settlement, None),
    }
}

/// Carries out a settlement's conversation from the root, tried again like any settlement;
/// `then_answer`'s reply goes out once it is over.
pub(super) fn settle_then_answer<H: Host>(
    plugin: &PluginState<H>,
    conversation: Box<dyn Conversation>,
    settlement: Settlement,
    then_answer: Option<RootHold>,
) {
    let call = RootSettlement { conversation, settlement, holds_response: false, retry: None, then_answer };
    converse(plugin, Box::new(call), None);
}

/// A settlement the store answered at once: counted, and its record's waiters woken. Not tried
/// again: a store that answers in place fails only where a second try fails too.
fn settled_at_once<H: Host>(
    plugin: &PluginState<H>,
    settlement: &Settlement,
    settled: Result<Settled, StoreError>,
) {
    plugin.renewals.borrow_mut().let_go(settlement.claim.owner);
    let (counter, wake) = settlement.result(settled);
    if let Some(scope) = wake {
        plugin.wakeups.broadcast(&scope);
    }
    plugin.meter.count(counter, Some(&settlement.rule));
    note_counted(plugin, counter, &settlement.rule, &settlement.claim.scope);
}

/// Makes a store conversation's call. Envoy's refusal (an unknown cluster, a full queue) is the
/// store's failure, and nothing was sent.
pub(super) fn call_store<H: Host>(plugin: &PluginState<H>, request: &Request) -> Result<u32, StoreError> {
    let Some(settings) = plugin.store.remote_for(request.shard) else {
        return Err(StoreError::Unavailable(format!(
            "a call to shard {}, which the store lacks",
            request.shard
        )));
    };
    match remote::dispatch(&plugin.host, settings, request) {
        Ok(token) => {
            if request.shard != 0 {
                plugin.calls.borrow_mut().shard_of.push((token, request.shard));
            }
            Ok(token)
        }
        Err(HostError(s)) => {
            plugin.meter.count_call_failed(request.shard);
            let why = plugin.callout_refused(CalloutOf::Store, &settings.cluster, s);
            Err(StoreError::Unavailable(why))
        }
    }
}

/// What a failed store means for a request: the remote store's fail mode (an in-place store
/// fails closed).
pub(super) fn on_store_error<H: Host>(plugin: &PluginState<H>) -> OnStoreError {
    plugin.store.remote().map_or(OnStoreError::FailClosed, |r| r.on_error)
}

/// Sends the effective context's stream a local reply.
pub(super) fn send_reply<H: Host>(plugin: &PluginState<H>, context_id: u32, reply: &Reply, details: &str) {
    if let Err(HostError(s)) = plugin.host.send_response(reply.status, details, &reply.headers, &reply.body) {
        log::warn!("#{context_id} could not send the local reply (host status {s})");
    }
}

/// A detached request's flow, once its record is written: given back to its stream, then its
/// reply sent if its client is still there (its stream then knows the reply as ours, and does
/// not take it for an upstream answer).
fn answer_written<H: Host>(plugin: &PluginState<H>, context_id: u32, flow: RootHold) {
    let reply = flow.with(RequestFlow::written).flatten();
    let present = plugin.host.set_effective_context(context_id).is_ok();
    drop(flow);
    match reply {
        Some((reply, details)) if present => send_reply(plugin, context_id, &reply, details),
        // Its client went away: the outcome is recorded, nobody to tell.
        _ => {}
    }
}

/// Where one step left a conversation the root carries.
pub(super) enum Stepped<C> {
    /// Its callout is in flight, or it waits for what another conversation fetches (the etcd
    /// token): the root keeps the call.
    Kept,
    /// Its callout could not be made: nothing was sent.
    Failed(Box<C>, StoreError),
    /// It is over, with the store's answer.
    Done(Box<C>, StoreAnswer),
}

/// Takes a conversation the root carries (a begin, a settlement, an admin ask, a renewal) one
/// step: its next callout made and the call kept under its token, the call parked while it
/// waits, or its end.
pub(super) fn step<H: Host, C: Conversing>(
    plugin: &PluginState<H>,
    mut call: Box<C>,
    answer: Option<Answer>,
) -> Stepped<C> {
    match call.conversation().step(answer, plugin.host.now_ms()) {
        Next::Call(request) => match call_store(plugin, &request) {
            Ok(token) => {
                plugin.calls.borrow_mut().in_flight.insert(token, call.into_call());
                Stepped::Kept
            }
            Err(error) => Stepped::Failed(call, error),
        },
        Next::Wait => {
            plugin.calls.borrow_mut().parked.push(call.into_call());
            Stepped::Kept
        }
        Next::Done(answer) => Stepped::Done(call, answer),
    }
}

/// Takes a settlement's conversation one step: its next callout, or its end.
pub(super) fn converse<H: Host>(plugin: &PluginState<H>, call: Box<RootSettlement>, answer: Option<Answer>) {
    match step(plugin, call, answer) {
        Stepped::Kept => {}
        Stepped::Failed(call, error) => finish_settlement(plugin, call, Err(error)),
        Stepped::Done(call, answer) => finish_settlement(plugin, call, answer.into_settled()),
    }
}

/// Starts again the settlements whose store failed and that are due.
pub(super) fn retry_settlements<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    let due = plugin.calls.borrow_mut().due(now_ms);
    for call in due {
        let RootSettlement { conversation, settlement, holds_response, retry, then_answer } = call;
        match plugin.start(conversation.into_op()) {
            Started::Answered(answer) => {
                let context_id = settlement.context_id;
                settled_at_once(plugin, &settlement, answer.into_settled());
                resume_after_settling(plugin, context_id, holds_response, then_answer);
            }
            Started::Conversation(conversation) => {
                let call = RootSettlement { conversation, settlement, holds_response, retry, then_answer };
                converse(plugin, Box::new(call), None);
            }
        }
    }
}

/// Counts and logs what a retired root leaves unfinished past its bound (Envoy cancels the
/// callouts when it deletes the root).
pub(super) fn abandon<H: Host>(plugin: &PluginState<H>) {
    let left = plugin.calls.borrow_mut().drain_all();
    let mut settlements = 0;
    for call in &left {
        match call {
            RootCall::Settle(settle) => {
                settlements += 1;
                plugin.meter.count(Counter::SettlementAbandoned, Some(&settle.settlement.rule));
            }
            // Envoy cancels the call with the root: its outcome is unknown, and its record
            // stays in flight until its lease ends.
            RootCall::Detached(call) => {
                settlements += 1;
                plugin.detached_done();
                plugin.meter.count(Counter::SettlementAbandoned, Some(&call.rule));
            }
            // A lookup writes nothing: its record stays as it was, for the next retry's lookup. A
            // renewal left undone leaves its claims to end with their leases.
            RootCall::Begin(_)
            | RootCall::Lookup(_)
            | RootCall::Admin(_)
            | RootCall::Renew(_)
            | RootCall::Recheck(_) => {}
        }
    }
    log::warn!(
        "retired root gave up on {} store operation(s) after {} ms, {settlements} of them completions or \
         releases (settlement_abandoned): their records stay in flight until their leases end",
        left.len(),
        plugin.retirement_bound_ms()
    );
}

/// Counts what became of a settlement and wakes its record's waiters, as its stream would have.
/// A store that could not be used (unreachable, too slow) is tried again with backoff
/// (`Retry`), and the held response goes on meanwhile: the client is not kept waiting for the
/// store to recover (a retry of its own finds the record in flight, never executes).
pub(super) fn finish_settlement<H: Host>(
    plugin: &PluginState<H>,
    mut call: Box<RootSettlement>,
    settled: Result<Settled, StoreError>,
) {
    let owner = call.settlement.claim.owner;
    if let Err(error @ (StoreError::Unavailable(_) | StoreError::TimedOut)) = &settled {
        let now_ms = plugin.host.now_ms();
        // The claim is still its owner's while the completion is tried, and renewed meanwhile
        // (`renewal`): its tries run until one `processing_timeout` past the lease it last
        // renewed, which its lease key outlives (etcd).
        let lease_ms = call.settlement.rule.processing_timeout_ms;
        let window_ms = retry_window_end(&call.settlement.claim, now_ms, lease_ms)
            .max(plugin.renewals.borrow().lease_end(owner).map_or(0, |end| end.saturating_add(lease_ms)));
        let retry = match call.retry {
            None => Retry::first_within(now_ms, window_ms),
            Some(retry) => retry.within(window_ms).next(now_ms),
        };
        resume_held_response(plugin, &mut call);
        let (context_id, scope) = (call.settlement.context_id, call.settlement.claim.scope);
        match retry {
            Some(retry) => {
                log::debug!(
                    "#{context_id} settling key {} failed ({error}); trying again in {} ms",
                    scope.log_tag(),
                    retry.due_ms.saturating_sub(now_ms)
                );
                call.retry = Some(retry);
                plugin.calls.borrow_mut().retrying.push(*call);
            }
            None => {
                log::warn!(
                    "#{context_id} gave up settling key {} ({error}) after {} ms of tries (settlement_abandoned): \
                     its record stays in flight until its lease ends",
                    scope.log_tag(),
                    call.settlement.rule.processing_timeout_ms
                );
                plugin.renewals.borrow_mut().let_go(owner);
                plugin.meter.count(Counter::SettlementAbandoned, Some(&call.settlement.rule));
            }
        }
        return;
    }
    plugin.renewals.borrow_mut().let_go(owner);
    let (counter, wake) = call.settlement.result(settled);
    if let Some(scope) = wake {
        plugin.wakeups.broadcast(&scope);
    }
    plugin.meter.count(counter, Some(&call.settlement.rule));
    note_counted(plugin, counter, &call.settlement.rule, &call.settlement.claim.scope);
    // A held response's stream is still there: its access log can say how it ended.
    if call.holds_response && plugin.host.set_effective_context(call.settlement.context_id).is_ok() {
        plugin.meter.publish(counter, Some(&call.settlement.rule), Some(&call.settlement.claim.scope));
        let context_id = call.settlement.context_id;
        let entry = plugin.flows.of_stream(context_id, |f| f.audit_entry(counter, || plugin.host.now_ms()));
        if let Some(entry) = entry.flatten() {
            plugin.meter.audit(&entry);
        }
    }
    resume_held_response(plugin, &mut call);
}

/// Whatever the store answered: the response is the upstream's and goes on, once. A stream
/// that is gone refuses the effective context, and nothing is held for it.
fn resume_held_response<H: Host>(plugin: &PluginState<H>, call: &mut RootSettlement) {
    let (holds, then_answer) = (std::mem::take(&mut call.holds_response), call.then_answer.take());
    resume_after_settling(plugin, call.settlement.context_id, holds, then_answer);
}

/// A settled stream's reply goes out (a detached call's), or its held response goes on.
fn resume_after_settling<H: Host>(
    plugin: &PluginState<H>,
    context_id: u32,
    holds_response: bool,
    then_answer: Option<RootHold>,
) {
    if let Some(flow) = then_answer {
        answer_written(plugin, context_id, flow);
    }
    if holds_response && plugin.host.set_effective_context(context_id).is_ok() {
        if let Err(HostError(s)) = plugin.host.resume_response() {
            log::warn!("#{context_id} could not resume the response (host status {s})");
        }
    }
}
