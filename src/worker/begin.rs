//! The root's `begin` for a paused request (its first on a remote store, or a waiter's look at
//! its record again): the conversation's callouts, and what its answer means for the request,
//! posted to its flow (`PluginState::post`); or, if the request's client left meanwhile, the
//! claim it got given back at once.

use super::calls::RootBegin;
use super::flows::RootHold;
use super::plugin::PluginState;
use super::settle::{give_back, gives_back, on_store_error, step, Sent, Stepped};
use crate::config::etcd::OnStoreError;
use crate::host::Host;
use crate::store::remote::Answer;
use crate::store::{StoreAnswer, StoreError};
use crate::worker::flow::Event;

/// Takes a paused request's `begin` one step: its next callout, or the answer for its flow.
pub(super) fn converse_begin<H: Host>(
    plugin: &PluginState<H>,
    begin: Box<RootBegin>,
    answer: Option<Answer>,
) {
    match step(plugin, begin, answer) {
        Stepped::Kept => {}
        Stepped::Failed(begin, error) => begin_failed(plugin, *begin, error, Sent::No),
        Stepped::Done(
            begin,
            StoreAnswer::Begun(Err(error @ (StoreError::Unavailable(_) | StoreError::TimedOut))),
        ) => begin_failed(plugin, *begin, error, Sent::Yes),
        Stepped::Done(begin, answer) => begin_answered(plugin, begin.flow, answer),
    }
}

/// The store answered a paused request's `begin` (or a waiter's recheck): what it means is
/// carried out for the request, if its stream is still there.
pub(super) fn begin_answered<H: Host>(plugin: &PluginState<H>, flow: RootHold, answer: StoreAnswer) {
    if !stream_there(plugin, &flow) {
        // The client went away while the store answered: nobody will forward the request, so a
        // claim it got is given back now instead of blocking retries until its lease ends.
        if let Some(settlement) = flow.with(|f| f.answered_without_stream(&answer)).flatten() {
            give_back(plugin, settlement);
        }
        return;
    }
    plugin.post(flow, Event::StoreAnswered(answer));
}

/// Whether the stream of a paused request's flow is still there (and now the effective
/// context); a lease-end lookup's, which has none, always is. A waiter's client that went away
/// during its recheck also left the wait room; a waiter whose stream is gone leaves it now.
fn stream_there<H: Host>(plugin: &PluginState<H>, flow: &RootHold) -> bool {
    let (headless, rechecking) = flow.with(|f| (f.headless(), f.rechecking())).unwrap_or((false, false));
    if headless {
        return true;
    }
    let context_id = flow.context_id();
    let present = plugin.host.set_effective_context(context_id).is_ok();
    if !rechecking {
        return present;
    }
    let held = plugin.room.borrow().checking(context_id);
    if held && !present {
        plugin.room.borrow_mut().leave(context_id);
    }
    held && present
}

/// The store could not be used for a paused request's `begin`: the store's fail mode decides
/// (a fail-open bypass is logged at most once a second per worker; it is counted every time).
/// A claim the store may hold although its answer was lost (`Sent::Yes`) is given back first.
pub(super) fn begin_failed<H: Host>(
    plugin: &PluginState<H>,
    begin: RootBegin,
    error: StoreError,
    sent: Sent,
) {
    let RootBegin { conversation, flow } = begin;
    if sent == Sent::Yes && gives_back(plugin) {
        let claim = conversation.unanswered_claim();
        if let Some(settlement) = claim.and_then(|c| flow.with(|f| f.unanswered_claim(c)).flatten()) {
            give_back(plugin, settlement);
        }
    }
    if !stream_there(plugin, &flow) {
        return; // its client went away, and no claim is known to exist
    }
    // A lease-end lookup acts on the record only through the store: nothing to forward.
    let headless = flow.with(|f| f.headless()).unwrap_or(false);
    let mode = if headless { OnStoreError::FailClosed } else { on_store_error(plugin) };
    if mode == OnStoreError::FailOpen && plugin.meter.bypass_log_due(plugin.host.now_ms()) {
        log::warn!("idempotency store unavailable ({error}): forwarding requests unprotected (fail_open)");
    }
    plugin.post(flow, Event::StoreFailed { error, mode });
}
