//! The executor (raft-rs's `advance`): the one place a flow's steps become host calls, store
//! operations and the root's work. A stream's callback runs it on what its flow said
//! (`carry_out`, `At::Stream`); the root runs it on what its flows said of the events its work
//! brought them (`drain`, at the end of each of the root's callbacks). Neither feeds the flow in
//! the middle of its steps, and the root's work never re-enters it: a callout's answer, a
//! refusal or a lease-end lookup's time is handed to the flow where it comes, and what the flow
//! says is posted (`PluginState::post`) and drained here.

use super::begin::converse_begin;
use super::calls::{RootBegin, RootLookup};
use super::flows::{FlowKey, RootHold};
use super::plugin::PluginState;
use super::reconcile::root::{dispatch_lookup, look_up_again_later, start_lease_end_lookup};
use super::settle::{give_back, send_reply, settle_then_answer};
use super::unsettled;
use crate::engine::{HeaderFix, Reply};
use crate::host::{Host, HostError, MAP_REQUEST_HEADERS, MAP_RESPONSE_HEADERS};
use crate::store::seam::Started;
use crate::store::{StoreAnswer, StoreOp};
use crate::worker::flow::{Event, Output, RequestFlow, Step, Verdict};
use crate::worker::wait::{NotHeld, Waiter};
use std::collections::VecDeque;

/// Where a flow's steps are carried out.
pub(super) enum At {
    /// In its stream's own callback. `hold_response`: a response callback, whose response waits
    /// for a settlement handed to the root.
    Stream { hold_response: bool },
    /// By the root, which holds the flow (a paused request's, or a headless lease-end lookup's).
    Root(RootHold),
}

/// What carrying out a flow's steps leaves for whoever holds the flow.
pub(super) struct Carried {
    pub(super) verdict: Verdict,
    /// The root's hold on the flow, when the root carried out its steps and no work of the
    /// root's took the hold on (a conversation, a lookup, a detached call, the wait room).
    pub(super) hold: Option<RootHold>,
    /// The root's local reply to a paused request, sent once the root lets its flow go
    /// (`carry_out_in_root`), so that its stream knows the reply as ours when it passes.
    pub(super) reply: Option<(Reply, &'static str)>,
}

/// The hold the root's work on a flow takes: the executor's own (the root carries the flow's
/// steps out), or a new one on a stream's flow.
fn take_hold<H: Host>(plugin: &PluginState<H>, key: FlowKey, hold: &mut Option<RootHold>) -> RootHold {
    hold.take().unwrap_or_else(|| RootHold::of(&plugin.flows, key))
}

/// The executor (raft-rs's `advance`): carries out a flow's steps in order, the one place steps
/// become host calls and store operations, whoever runs it (a stream's callback, or the root).
/// The flow stays in the worker's table (`flows.rs`) and is asked only between steps: what the
/// store answers at once, and what a step's refusal means, are `Event`s fed to the flow once
/// every step before them is carried out; the verdict is the flow's last word. The root's work
/// (a `begin` or a lookup as callouts, a detached call, the wait room) takes a hold on the flow,
/// which the stream's callbacks then leave alone until the root lets it go.
pub(super) fn carry_out<H: Host>(plugin: &PluginState<H>, key: FlowKey, out: Output, at: At) -> Carried {
    let (hold_response, at_root, hold) = match at {
        At::Stream { hold_response } => (hold_response, false, None),
        At::Root(hold) => (false, true, Some(hold)),
    };
    let mut run = Run {
        key,
        at_root,
        hold_response,
        hold,
        verdict: out.verdict,
        reply: None,
        response_held: false,
        parking: None,
        answers: Vec::new(),
    };
    let mut steps: VecDeque<Step> = out.steps.into();
    loop {
        if let Some(step) = steps.pop_front() {
            advance(plugin, &mut run, step);
            continue;
        }
        // Every step is carried out: the next answer, if any, is the flow's.
        if run.answers.is_empty() {
            break;
        }
        if let Some(more) = feed(plugin, key, run.answers.remove(0)) {
            run.verdict = more.verdict;
            steps.extend(more.steps);
        }
    }
    if run.response_held {
        run.verdict = Verdict::Pause;
    }
    // Held: the flow waits in the room, and goes back to its stream when the wait is over.
    if let Some(w) = run.parking.take() {
        let held = take_hold(plugin, key, &mut run.hold);
        plugin.room.borrow_mut().hold(Waiter { held: Some(held), ..w });
    }
    Carried { verdict: run.verdict, hold: run.hold, reply: run.reply }
}

/// What the executor keeps while it carries out one flow's steps.
struct Run {
    key: FlowKey,
    /// The root carries them out (else the flow's stream, in its callback).
    at_root: bool,
    /// A response callback, whose response waits for a settlement handed to the root.
    hold_response: bool,
    /// The root's hold on the flow, until its work takes it on.
    hold: Option<RootHold>,
    verdict: Verdict,
    reply: Option<(Reply, &'static str)>,
    response_held: bool,
    /// The waiter to hold in the wait room, with the flow, once the steps are carried out.
    parking: Option<Waiter<RootHold>>,
    /// What the steps were answered at once, for the flow once every step is carried out.
    answers: Vec<AtOnce>,
}

/// An answer a step got at once (the store's, the wait room's, a refusal), fed to the flow as
/// its `Event` after the steps before it.
enum AtOnce {
    Store(StoreAnswer),
    Parked(Result<(), NotHeld>),
    DetachRefused(String),
    LookupRefused(u64),
}

/// Feeds the flow one answer. Each arm names its event, so the flow's entry folds to the one
/// transition it asks for.
fn feed<H: Host>(plugin: &PluginState<H>, key: FlowKey, answer: AtOnce) -> Option<Output> {
    let cfg = &plugin.config;
    plugin.flows.with(key, |f| match answer {
        AtOnce::Store(answer) => f.handle(cfg, Event::StoreAnswered(answer)),
        AtOnce::Parked(held) => f.handle(cfg, Event::Parked(held)),
        AtOnce::DetachRefused(why) => f.handle(cfg, Event::DetachRefused(why)),
        AtOnce::LookupRefused(retry_after_ms) => f.handle(cfg, Event::LookupRefused { retry_after_ms }),
    })
}

/// Carries out one step (raft-rs's `advance`): host calls, store operations, the root's work.
#[inline(never)]
fn advance<H: Host>(plugin: &PluginState<H>, run: &mut Run, step: Step) {
    let host = &plugin.host;
    let key = run.key;
    let context_id = key.context_id();
    let flow = |f: &mut dyn FnMut(&mut RequestFlow)| plugin.flows.with(key, |flow| f(flow));
    match step {
        Step::Count(counter) => {
            // An unknown outcome (the rare path): its record noted for the unsettled records
            // gauge. Told by the counter alone first, so every other count (a claim, a replay,
            // a stored answer) skips the flow table.
            if unsettled::standing_after(counter, false).is_some() {
                let unsettled = plugin.flows.with(key, |f| Some((*f.scope()?, f.rule()?.clone())));
                if let Some((scope, rule)) = unsettled.flatten() {
                    unsettled::note::note_counted(plugin, counter, &rule, &scope);
                }
            }
            // A lease-end lookup's flow, or one whose stream went away: nothing to publish to.
            flow(&mut |f| match f.streamless() {
                true => plugin.meter.count(counter, f.rule()),
                false => {
                    plugin.meter.count_for_stream(counter, f.rule(), f.scope());
                    if let Some(entry) = f.audit_entry(counter, || host.now_ms()) {
                        plugin.meter.audit(&entry);
                    }
                }
            });
        }
        Step::Reply { reply: r, details } => {
            let streamless = plugin.flows.with(key, |f| f.streamless()).unwrap_or(true);
            match (streamless, run.at_root) {
                (true, _) => {}
                (false, true) => run.reply = Some((r, details)),
                (false, false) => send_reply(plugin, context_id, &r, details),
            }
        }
        Step::Store(op) => {
            let begin = matches!(op, StoreOp::Begin(_));
            match (plugin.start(op), run.at_root) {
                (Started::Answered(answer), _) => run.answers.push(AtOnce::Store(answer)),
                // A settlement from a stream: the root settles it, since the stream may end
                // before the store answers. In a response callback the response waits for
                // it (the root resumes it).
                (Started::Conversation(conversation), false) if !begin => {
                    if let Some(settlement) =
                        plugin.flows.with(key, RequestFlow::hand_off_settlement).flatten()
                    {
                        let held = run.hold_response && run.verdict == Verdict::Continue;
                        plugin.settle_from_root(conversation, settlement, held);
                        run.response_held |= held;
                    }
                }
                // The root carries it out, and answers or resumes the request.
                (Started::Conversation(conversation), false) => {
                    plugin.begin_from_root(conversation, take_hold(plugin, key, &mut run.hold));
                }
                // A detached request's outcome: the root's carrier writes it (tried again like
                // any settlement), and the client's reply goes out once it is over.
                (Started::Conversation(conversation), true)
                    if plugin.flows.with(key, |f| f.settling_detached()) == Some(true) =>
                {
                    if let Some(settlement) =
                        plugin.flows.with(key, RequestFlow::hand_off_settlement).flatten()
                    {
                        let then_answer = Some(take_hold(plugin, key, &mut run.hold));
                        settle_then_answer(plugin, conversation, settlement, then_answer);
                    }
                }
                (Started::Conversation(conversation), true) => {
                    let flow = take_hold(plugin, key, &mut run.hold);
                    converse_begin(plugin, Box::new(RootBegin { conversation, flow }), None);
                }
            }
        }
        // Wait mode: the request stays paused in this worker's wait room.
        Step::Park(plan) => {
            let admitted = plugin.admit(context_id, &plan);
            let held = admitted.as_ref().map(|_| ()).map_err(|not_held| *not_held);
            run.parking = admitted.ok();
            run.answers.push(AtOnce::Parked(held));
        }
        // A waiter's recheck found the original still processing: held again, until its
        // give-up time.
        Step::Repark { lease_remaining_ms } => {
            let now_ms = host.now_ms();
            let again = plugin.room.borrow_mut().end_check(context_id);
            run.parking = again.and_then(|w| w.again(now_ms, lease_remaining_ms));
            let held = if run.parking.is_some() { Ok(()) } else { Err(NotHeld::GaveUp) };
            run.answers.push(AtOnce::Parked(held));
        }
        Step::Wake(scope) => plugin.wakeups.broadcast(&scope),
        // Detached execution: the root makes the call, holding the flow; its answer is the
        // flow's (`Event::DetachedAnswered`).
        Step::Detach { claim, rule } => {
            // Its lease-end lookup may be built once its client left: the route's cluster now.
            if plugin.flows.with(key, |f| f.wants_route_cluster()) == Some(true) {
                if let Some(cluster) = plugin.route_cluster() {
                    flow(&mut |f| f.keep_route_cluster(cluster.clone()));
                }
            }
            match plugin.detach(claim, &rule, take_hold(plugin, key, &mut run.hold)) {
                Ok(call) => plugin.hand_over_detached(call),
                Err((why, given_back)) => {
                    if run.at_root {
                        run.hold = Some(given_back);
                    }
                    run.answers.push(AtOnce::DetachRefused(why));
                }
            }
        }
        // A lease-end lookup found its record unsettled: ask the upstream (unless a request
        // on this Envoy is asking already: it settles it, or its client retries, and this
        // flow ends here).
        Step::Lookup { .. } if plugin.flows.with(key, |f| f.headless()) == Some(true) => {
            let lookup = start_lease_end_lookup(plugin, key);
            let flow = take_hold(plugin, key, &mut run.hold);
            if let Some(lookup) = lookup {
                dispatch_lookup(plugin, Box::new(RootLookup { flow, lookup }));
            }
        }
        // Reconciliation: the root makes the lookup and carries out what its answer means.
        Step::Lookup { rule, request } => {
            let scope = plugin.flows.with(key, |f| f.scope().copied()).flatten();
            match plugin.start_lookup(context_id, scope, &rule, &request) {
                Ok(lookup) => {
                    let flow = take_hold(plugin, key, &mut run.hold);
                    match run.at_root {
                        false => plugin.lookup_from_root(flow, lookup),
                        // Already in the root: made at once.
                        true => dispatch_lookup(plugin, Box::new(RootLookup { flow, lookup })),
                    }
                }
                Err(retry_after_ms) => run.answers.push(AtOnce::LookupRefused(retry_after_ms)),
            }
        }
        // The owner holds its claim: renewed by the root while it is at work.
        Step::Hold(hold) => {
            if !plugin.renewals.borrow_mut().hold(hold) && plugin.meter.held_full_log_due(host.now_ms()) {
                log::warn!(
                    "this worker already keeps {} claims alive: key {}'s ends with its lease",
                    crate::renewal::MAX_HELD,
                    hold.claim.scope.log_tag()
                );
            }
        }
        Step::LetGo(owner) => {
            plugin.renewals.borrow_mut().let_go(owner);
        }
        Step::LookUpAtLeaseEnd(later) => {
            if let Some(lookup) = plugin.lease_end_lookup(context_id, *later) {
                plugin.look_up_at_lease_end(lookup);
            }
        }
        Step::FixHeaders(fixes) => {
            for fix in fixes {
                let (name, result) = match &fix {
                    HeaderFix::Set(name, value) => (name, host.set_header(MAP_RESPONSE_HEADERS, name, value)),
                    HeaderFix::Remove(name) => (name, host.remove_header(MAP_RESPONSE_HEADERS, name)),
                };
                if let Err(HostError(s)) = result {
                    log::warn!(
                        "#{context_id} could not restore the replayed header {name} (host status {s})"
                    );
                }
            }
        }
        Step::RemoveRequestHeaders(names) => {
            for name in names {
                if let Err(HostError(s)) = host.remove_header(MAP_REQUEST_HEADERS, &name) {
                    log::warn!("#{context_id} could not remove {name} from the request (host status {s})");
                }
            }
        }
        Step::LeaveWaitRoom => {
            plugin.room.borrow_mut().leave(context_id);
        }
        Step::WarnRetried { rule, attempts } => {
            if plugin.first_retry_warning(&rule) {
                log::warn!(
                    "route rule {rule}: Envoy sent a protected request upstream {attempts} times under one \
                     claim (route retry_policy, hedging or internal redirect); each attempt may execute: \
                     disable Envoy retries on routes this filter protects"
                );
            }
        }
        Step::ErrorHeaderPrefix { seen } => {
            plugin.meter.header_prefix_mismatch(&plugin.config.envoy_headers.prefix, &seen);
        }
        Step::ErrorStopIterationMissing { rule, details, body_bytes } => {
            if plugin.meter.first_stop_iteration_error() {
                log::error!("{}", stop_iteration_missing_line(&rule, details.as_deref(), body_bytes));
            }
        }
        Step::WarnBodyNeverReceived { rule, details } => {
            if plugin.meter.body_never_received_log_due(host.now_ms()) {
                log::warn!(
                    "route rule {rule}: a request held for its body ended before any of it arrived \
                     ({}); nothing was claimed or forwarded. If every protected request with a body \
                     does this (counter body_never_received), the Wasm filter's config lacks \
                     allow_on_headers_stop_iteration: true",
                    details.as_deref().unwrap_or("no response details")
                );
            }
        }
    }
}

/// Carries out what the flows the root holds said of what its work brought them
/// (`PluginState::post`), oldest first, each in its stream's context (a stream gone meanwhile
/// hears nothing). Called at the end of each of the root's callbacks; what those steps post in
/// turn is carried out in the same loop.
pub(super) fn drain<H: Host>(plugin: &PluginState<H>) {
    loop {
        let posted = plugin.take_posted();
        if posted.is_empty() {
            return;
        }
        for (flow, out) in posted {
            let headless = flow.with(|f| f.headless()).unwrap_or(false);
            if !headless && plugin.host.set_effective_context(flow.context_id()).is_err() {
                flow.with(RequestFlow::stream_gone);
            }
            carry_out_in_root(plugin, flow, out);
        }
    }
}

/// Carries out what the flow decided for its paused request (the effective context is the
/// request's), then lets the flow go back to its stream and answers or resumes it; unless the
/// root's work on it goes on (a conversation, a lookup, the wait room), or a lease-end lookup
/// is to be asked again later.
fn carry_out_in_root<H: Host>(plugin: &PluginState<H>, flow: RootHold, out: Output) {
    let key = flow.key();
    let context_id = key.context_id();
    let carried = carry_out(plugin, key, out, At::Root(flow));
    let went_on = carried.hold.is_none();
    if let Some(hold) = carried.hold {
        if hold.with(|f| f.headless()) == Some(true) {
            if hold.with(|f| f.awaiting_lookup()) == Some(true) {
                look_up_again_later(plugin, hold);
            }
            return;
        }
        // Resumed while the root still holds it, so that its flow is there to give back a
        // claim if Envoy cannot resume the request.
        if carried.verdict == Verdict::Continue && carried.reply.is_none() {
            resume(plugin, key);
        }
    }
    // After the flow is back: the reply passes its stream's encode callbacks as ours.
    if let Some((reply, details)) = carried.reply {
        send_reply(plugin, context_id, &reply, details);
        if !went_on && carried.verdict == Verdict::Continue {
            resume(plugin, key);
        }
    }
}

/// Resumes a paused request; if Envoy cannot, nobody will forward it (nothing was sent
/// upstream), so a claim it holds is given back.
fn resume<H: Host>(plugin: &PluginState<H>, key: FlowKey) {
    if let Err(HostError(s)) = plugin.host.resume_request() {
        let context_id = key.context_id();
        log::warn!(
            "#{context_id} could not resume the request (host status {s}); a claim it holds is given back"
        );
        if let Some(settlement) = plugin.flows.with(key, RequestFlow::not_resumed).flatten() {
            give_back(plugin, settlement);
        }
    }
}

/// The error line for a worker whose Envoy keeps request bodies from the filter: what happened,
/// what it does to traffic, the setting that is missing and where it can be set.
pub fn stop_iteration_missing_line(rule: &str, details: Option<&str>, body_bytes: u64) -> String {
    format!(
        "route rule {rule}: {body_bytes} bytes of a protected request's body reached Envoy but never this \
         filter ({}): the Wasm filter's config lacks allow_on_headers_stop_iteration: true (or the \
         control plane dropped it), so every protected request with a body hangs until Envoy's timeout \
         (504) and none is forwarded (counter body_never_received). Set it in the Wasm filter's config; \
         on Istio the EnvoyFilter form needs Istio >= 1.28 (1.27 drops the field without an error, 1.26 \
         and older ship an Envoy without it), and a WasmPlugin cannot set it. Logged once per worker.",
        details.unwrap_or("no response details")
    )
}
