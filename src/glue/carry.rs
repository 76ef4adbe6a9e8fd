//! What the root carries out for its streams, above its settlements (`settle.rs`): a paused
//! request's flow (its `begin` conversation, the steps its answer leads to, its lookups and the
//! lease-end lookups), a waiter's recheck (its flow's `begin` again, carried out the same way),
//! detached calls, and admin asks. The root's callbacks (`root.rs`) call in here; nothing here
//! calls them.

use super::admin;
use super::calls::{
    AdminAsk, AdminLater, DetachedCall, LeaseEndLookup, Lookup, RootAdmin, RootBegin, RootCall, RootLookup,
};
use super::flows::{FlowKey, RootHold};
use super::plugin::{CalloutOf, PluginState};
use super::renew::converse_renewal;
use super::settle::{
    call_store, converse, give_back, gives_back, on_store_error, send_reply, settle_then_answer, Sent,
};
use super::{
    Host, HostError, BUFFER_HTTP_CALL_RESPONSE_BODY, MAP_HTTP_CALL_RESPONSE_HEADERS, MAP_REQUEST_HEADERS,
    MAP_RESPONSE_HEADERS,
};
use crate::admin::Progress;
use crate::config::etcd::OnStoreError;
use crate::detached;
use crate::engine::{HeaderFix, Reply};
use crate::flow::{Event, Output, RequestFlow, Step, Verdict};
use crate::reconcile::{self, LookupAnswer};
use crate::store::remote::{Answer, Next};
use crate::store::seam::Started;
use crate::store::{StoreAnswer, StoreError, StoreOp};
use crate::wait::{NotHeld, Waiter};
use std::collections::VecDeque;
use std::rc::Rc;

/// Looks at a waiter's record again: its flow asks a fresh `begin`, and the store's answer is
/// carried out as any paused request's (`begin_answered`): at once when the store answers at
/// once, else when its callouts are answered, the waiter held in the room meanwhile (its
/// flow travels with the conversation).
pub(super) fn recheck<H: Host>(plugin: &PluginState<H>, w: Waiter<RootHold>) {
    let context_id = w.context_id;
    let now_ms = plugin.host.now_ms();
    let owner = plugin.owner_token(context_id);
    // Watched records wake their waiters: those poll only as a fallback.
    let watched = plugin.store.watch(&w.scope).is_some_and(|watch| watch.is_live(&w.scope));
    let Some(flow) = plugin.room.borrow_mut().start_check(Waiter { watched, ..w }) else {
        return;
    };
    let Some(op) = flow.with(|f| f.recheck(&plugin.config, now_ms, owner)).flatten() else {
        log::warn!("#{context_id} a held request's flow was not waiting; let go");
        plugin.room.borrow_mut().leave(context_id);
        return;
    };
    match plugin.start(op) {
        Started::Answered(answer) => begin_answered(plugin, flow, answer),
        Started::Conversation(conversation) => {
            converse_begin(plugin, Box::new(RootBegin { conversation, flow }), None)
        }
    }
}

/// Once a second: ends the watches no waiter of this worker needs any more, and opens the
/// watch stream again when it is due.
pub(super) fn tend_watch<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    for watch in plugin.store.watches() {
        let cancels = {
            let room = plugin.room.borrow();
            watch.tidy(&|scope| room.waits_on(scope))
        };
        plugin.send_watch(watch, &cancels, now_ms);
        plugin.open_watch(watch, now_ms);
    }
}

/// Starts what streams handed over since the root last ran; from here on the root owns their
/// callouts, so their answers come whether or not the stream is still there.
pub(super) fn take_on_handed_over<H: Host>(plugin: &PluginState<H>) {
    let queued = std::mem::take(&mut plugin.calls.borrow_mut().queued);
    for call in queued {
        take_on(plugin, call);
    }
}

/// Makes a detached call from the root, so that it outlives the client's stream.
fn dispatch_detached<H: Host>(plugin: &PluginState<H>, mut call: Box<DetachedCall>) {
    let host = &plugin.host;
    let headers: Vec<(&str, &[u8])> = call.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    match host.dispatch_http_call(&call.cluster, &headers, &call.body, call.timeout_ms) {
        Ok(token) => {
            // Envoy has its copy; the worker holds the answer next.
            call.body = Vec::new();
            plugin.calls.borrow_mut().in_flight.insert(token, RootCall::Detached(call));
        }
        Err(HostError(s)) => {
            let why = plugin.callout_refused(CalloutOf::Detached(&call.rule), &call.cluster, s);
            plugin.detached_done();
            plugin.release_claim(call.context_id, call.claim, &call.rule);
            let DetachedCall { context_id, flow, .. } = *call;
            if plugin.host.set_effective_context(context_id).is_err() {
                flow.with(RequestFlow::stream_gone);
            }
            handle_in_root(plugin, flow, Event::DetachRefused(why));
        }
    }
}

/// The answer to a callout of the root's that is not the store's (a detached call, a lookup):
/// its status (None: Envoy's failure report, no `:status`), headers and body. None when it
/// cannot be read.
type CalloutAnswer = (Option<u16>, Vec<(String, Vec<u8>)>, Vec<u8>);

fn callout_answer<H: Host>(host: &H, body_size: usize) -> Option<CalloutAnswer> {
    let status = match host.header_value(MAP_HTTP_CALL_RESPONSE_HEADERS, ":status") {
        Ok(Some(v)) => std::str::from_utf8(&v).ok().and_then(|s| s.parse::<u16>().ok()),
        Ok(None) | Err(_) => None,
    };
    let headers = host.header_pairs(MAP_HTTP_CALL_RESPONSE_HEADERS).ok()?;
    let body = if body_size == 0 {
        Vec::new()
    } else {
        host.buffer(BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size).ok()?
    };
    Some((status, headers, body))
}

/// A detached call's answer goes to the request's flow, which says what it means for the record
/// (as an inline upstream answer would) and for its client, if still there: its steps are
/// carried out as any flow's the root holds (with a remote store, the reply once the record is
/// written).
pub(super) fn detached_answered<H: Host>(plugin: &PluginState<H>, call: DetachedCall, body_size: usize) {
    let host = &plugin.host;
    plugin.detached_done();
    let now_ms = host.now_ms();
    let answer = match callout_answer(host, body_size) {
        Some((status, headers, body)) => {
            let envoy = &plugin.config.envoy_headers;
            // Asked only of an answer without our mark (a local reply, or a prefix mismatch).
            if !envoy.from_upstream(&headers) {
                if let Some(seen) = envoy.foreign_service_time(&headers) {
                    plugin.meter.header_prefix_mismatch(&plugin.config.envoy_headers.prefix, seen);
                }
            }
            detached::answer_of(envoy, status, headers, body)
        }
        // An answer that cannot be read: what it said is unknown.
        None => detached::CallAnswer::Unknown { timed_out: false },
    };
    let DetachedCall { context_id, claim, rule, flow, .. } = call;
    log::debug!("#{context_id} detached call answered: key {}", claim.scope.log_tag());
    if host.set_effective_context(context_id).is_err() {
        flow.with(RequestFlow::stream_gone);
    }
    let held_ms = plugin.store.held_past_lease_ms(rule.processing_timeout_ms);
    handle_in_root(plugin, flow, Event::DetachedAnswered { answer, now_ms, held_ms });
}

/// Steps again every conversation that was waiting (for the etcd token): each goes on, waits
/// on, or ends with the wait's failure through its ordinary path (a stream's fail mode, a
/// settlement counted, a client that left: nothing held).
pub(super) fn resume_parked<H: Host>(plugin: &PluginState<H>) {
    let parked = std::mem::take(&mut plugin.calls.borrow_mut().parked);
    for call in parked {
        take_on(plugin, call);
    }
}

/// Takes a call handed over (or parked) one step: a store conversation's next step, or a
/// detached call or a lookup made (neither waits for the store's token).
fn take_on<H: Host>(plugin: &PluginState<H>, call: RootCall) {
    match call {
        RootCall::Begin(begin) => converse_begin(plugin, begin, None),
        RootCall::Settle(settle) => converse(plugin, settle, None),
        RootCall::Admin(call) => converse_admin(plugin, call, None),
        RootCall::Detached(call) => dispatch_detached(plugin, call),
        RootCall::Lookup(call) => dispatch_lookup(plugin, call),
        RootCall::Renew(call) => converse_renewal(plugin, call, None),
    }
}

/// Takes an admin request's store operation one step: its next callout, or the store's answer
/// for the request's task, which replies (if its stream is still there) or asks again.
pub(super) fn converse_admin<H: Host>(
    plugin: &PluginState<H>,
    mut call: Box<RootAdmin>,
    answer: Option<Answer>,
) {
    match call.conversation.step(answer, plugin.host.now_ms()) {
        Next::Call(request) => match call_store(plugin, &request) {
            Ok(token) => {
                plugin.calls.borrow_mut().in_flight.insert(token, RootCall::Admin(call));
            }
            Err(error) => admin_failed(plugin, call, error),
        },
        Next::Wait => plugin.calls.borrow_mut().parked.push(RootCall::Admin(call)),
        Next::Done(answer) => admin_answered(plugin, *call, answer),
    }
}

pub(super) fn admin_failed<H: Host>(plugin: &PluginState<H>, call: Box<RootAdmin>, error: StoreError) {
    let answer = StoreAnswer::failed(&call.ask.op, error);
    admin_answered(plugin, *call, answer);
}

fn admin_answered<H: Host>(plugin: &PluginState<H>, call: RootAdmin, answer: StoreAnswer) {
    if plugin.host.set_effective_context(call.context_id).is_err() {
        // The operator's client left: a change already made stands, and is logged by nobody.
        log::info!("admin #{}: the client left before the store answered", call.context_id);
        return;
    }
    let RootAdmin { context_id, ask, .. } = call;
    let progress = ask.task.answered(answer, plugin.host.now_ms());
    admin_handed_off(plugin, context_id, admin::advance(plugin, ask.line, progress));
}

/// Where the root takes an admin request on that did not end in its callback.
fn admin_handed_off<H: Host>(plugin: &PluginState<H>, context_id: u32, handoff: Option<admin::Handoff>) {
    match handoff {
        None => {}
        Some(admin::Handoff::Conversation(ask, conversation)) => {
            converse_admin(plugin, Box::new(RootAdmin { context_id, conversation, ask }), None)
        }
        Some(admin::Handoff::Later(ask)) => {
            plugin.calls.borrow_mut().admin_later.push(AdminLater { context_id, ask });
        }
    }
}

/// At the root's tick: the admin requests whose store paused a scan ask again, each one bounded
/// part more (`store::local::admin::SCAN_READS`), or are answered; one whose client left is
/// dropped (a look changes nothing).
pub(super) fn continue_admin<H: Host>(plugin: &PluginState<H>) {
    let later = std::mem::take(&mut plugin.calls.borrow_mut().admin_later);
    for AdminLater { context_id, ask } in later {
        if plugin.host.set_effective_context(context_id).is_err() {
            log::info!("admin #{context_id}: the client left before its list was read");
            continue;
        }
        let AdminAsk { task, op, line } = ask;
        admin_handed_off(plugin, context_id, admin::advance(plugin, line, Progress::Ask(task, op)));
    }
}

/// Takes a paused request's `begin` one step: its next callout, or the answer for its flow.
pub(super) fn converse_begin<H: Host>(
    plugin: &PluginState<H>,
    mut begin: Box<RootBegin>,
    answer: Option<Answer>,
) {
    match begin.conversation.step(answer, plugin.host.now_ms()) {
        Next::Call(request) => match call_store(plugin, &request) {
            Ok(token) => {
                plugin.calls.borrow_mut().in_flight.insert(token, RootCall::Begin(begin));
            }
            Err(error) => begin_failed(plugin, *begin, error, Sent::No),
        },
        Next::Wait => plugin.calls.borrow_mut().parked.push(RootCall::Begin(begin)),
        Next::Done(StoreAnswer::Begun(Err(error @ (StoreError::Unavailable(_) | StoreError::TimedOut)))) => {
            begin_failed(plugin, *begin, error, Sent::Yes)
        }
        Next::Done(answer) => begin_answered(plugin, begin.flow, answer),
    }
}

/// The store answered a paused request's `begin` (or a waiter's recheck): what it means is
/// carried out for the request, if its stream is still there.
fn begin_answered<H: Host>(plugin: &PluginState<H>, flow: RootHold, answer: StoreAnswer) {
    if !stream_there(plugin, &flow) {
        // The client went away while the store answered: nobody will forward the request, so a
        // claim it got is given back now instead of blocking retries until its lease ends.
        if let Some(settlement) = flow.with(|f| f.answered_without_stream(&answer)).flatten() {
            give_back(plugin, settlement);
        }
        return;
    }
    handle_in_root(plugin, flow, Event::StoreAnswered(answer));
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
    handle_in_root(plugin, flow, Event::StoreFailed { error, mode });
}

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
        answers: VecDeque::new(),
    };
    let mut steps: VecDeque<Step> = out.steps.into();
    loop {
        if let Some(step) = steps.pop_front() {
            advance(plugin, &mut run, step);
            continue;
        }
        // Every step is carried out: the next answer, if any, is the flow's.
        let Some(answer) = run.answers.pop_front() else { break };
        if let Some(more) = feed(plugin, key, answer) {
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
    answers: VecDeque<Answered>,
}

/// An answer a step got at once (the store's, the wait room's, a refusal), fed to the flow as
/// its `Event` after the steps before it.
enum Answered {
    Store(StoreAnswer),
    Parked(Result<(), NotHeld>),
    DetachRefused(String),
    LookupRefused(u64),
}

/// Feeds the flow one answer. Each arm names its event, so the flow's entry folds to the one
/// transition it asks for.
#[inline(never)]
fn feed<H: Host>(plugin: &PluginState<H>, key: FlowKey, answer: Answered) -> Option<Output> {
    let cfg = &plugin.config;
    plugin.flows.with(key, |f| match answer {
        Answered::Store(answer) => f.handle(cfg, Event::StoreAnswered(answer)),
        Answered::Parked(held) => f.handle(cfg, Event::Parked(held)),
        Answered::DetachRefused(why) => f.handle(cfg, Event::DetachRefused(why)),
        Answered::LookupRefused(retry_after_ms) => f.handle(cfg, Event::LookupRefused { retry_after_ms }),
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
            // A lease-end lookup's flow, or one whose stream went away: nothing to publish to.
            flow(&mut |f| match f.streamless() {
                true => plugin.meter.count(counter, f.rule()),
                false => plugin.meter.count_for_stream(counter, f.rule(), f.scope()),
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
                (Started::Answered(answer), _) => run.answers.push_back(Answered::Store(answer)),
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
            run.answers.push_back(Answered::Parked(held));
        }
        // A waiter's recheck found the original still processing: held again, until its
        // give-up time.
        Step::Repark { lease_remaining_ms } => {
            let now_ms = host.now_ms();
            let again = plugin.room.borrow_mut().end_check(context_id);
            run.parking = again.and_then(|w| w.again(now_ms, lease_remaining_ms));
            let held = if run.parking.is_some() { Ok(()) } else { Err(NotHeld::GaveUp) };
            run.answers.push_back(Answered::Parked(held));
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
                    run.answers.push_back(Answered::DetachRefused(why));
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
                Err(retry_after_ms) => run.answers.push_back(Answered::LookupRefused(retry_after_ms)),
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
                let result = match &fix {
                    HeaderFix::Set(name, value) => host.set_header(MAP_RESPONSE_HEADERS, name, value),
                    HeaderFix::Remove(name) => host.remove_header(MAP_RESPONSE_HEADERS, name),
                };
                if let Err(HostError(s)) = result {
                    log::warn!("#{context_id} could not restore a replayed header {fix:?} (host status {s})");
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

/// An event the root brings a flow it holds (a store's answer, a lookup's, a detached call's,
/// a refusal): the flow's steps for it carried out by the root. Inlined where it is called, so
/// that the flow's entry folds to the one transition each caller's event asks for.
#[inline(always)]
fn handle_in_root<H: Host>(plugin: &PluginState<H>, flow: RootHold, event: Event) {
    match flow.with(|f| f.handle(&plugin.config, event)) {
        Some(out) => carry_out_in_root(plugin, flow, out),
        None => log::warn!("#{} the flow the root held is gone; an event was dropped", flow.context_id()),
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

/// Makes a paused request's lookup from the root, so that its answer comes whether or not the
/// stream is still there (a stream's callouts end with it).
fn dispatch_lookup<H: Host>(plugin: &PluginState<H>, call: Box<RootLookup>) {
    let l = &call.lookup;
    let headers: Vec<(&str, &[u8])> = l.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    match plugin.host.dispatch_http_call(&l.cluster, &headers, &[], l.timeout_ms) {
        Ok(token) => {
            plugin.calls.borrow_mut().in_flight.insert(token, RootCall::Lookup(call));
        }
        Err(HostError(s)) => {
            let why = plugin.callout_refused(CalloutOf::Lookup(&l.rule), &l.cluster, s);
            plugin.lookups.finished(&call.lookup.scope, call.lookup.started_ms, plugin.host.now_ms());
            answer_lookup(plugin, *call, LookupAnswer::Failed(why));
        }
    }
}

/// The lookup's answer, read from the callout's.
pub(super) fn lookup_answered<H: Host>(plugin: &PluginState<H>, call: RootLookup, body_size: usize) {
    let host = &plugin.host;
    plugin.lookups.finished(&call.lookup.scope, call.lookup.started_ms, host.now_ms());
    let answer = match callout_answer(host, body_size) {
        Some((status, headers, body)) => reconcile::answer_of(&call.lookup.rule, status, headers, body),
        None => LookupAnswer::Failed("the lookup's answer could not be read".into()),
    };
    answer_lookup(plugin, call, answer);
}

/// Lease-end lookups tried this often settle nothing, then the record waits for a retry's.
const LEASE_END_TRIES: u32 = 8;

/// The longest pause between two tries of a lease-end lookup (from 2 s, doubling).
const LEASE_END_BACKOFF_MAX_MS: u64 = 60_000;

/// What the lookup's answer means, carried out for the request that asked (if it is still
/// there: a lookup writes nothing, so a client that left leaves the record as it was, for its
/// retry's lookup), or for a lease-end lookup.
fn answer_lookup<H: Host>(plugin: &PluginState<H>, call: RootLookup, answer: LookupAnswer) {
    let RootLookup { flow, lookup } = call;
    let headless = flow.with(|f| f.headless()).unwrap_or(false);
    let context_id = flow.context_id();
    if !headless && plugin.host.set_effective_context(context_id).is_err() {
        log::debug!("#{context_id} lookup of key {} answered after its client left", lookup.scope.log_tag());
        return;
    }
    let now_ms = plugin.host.now_ms();
    handle_in_root(plugin, flow, Event::LookupAnswered { answer, now_ms });
}

/// A lease-end lookup that settled nothing yet (the lookup failed, or the store still holds
/// the claim's lease by its own clock): asked again later, backing off, `LEASE_END_TRIES` times.
fn look_up_again_later<H: Host>(plugin: &PluginState<H>, flow: RootHold) {
    let tries = flow.with(RequestFlow::lease_end_tried).unwrap_or(LEASE_END_TRIES);
    let tag = flow.with(|f| f.scope().map(|s| s.log_tag())).flatten().unwrap_or_default();
    if tries >= LEASE_END_TRIES {
        log::warn!("lookup of key {tag} settled nothing {tries} times; its record waits for a retry");
        return;
    }
    let backoff_ms = (1_000u64 << tries.min(16)).min(LEASE_END_BACKOFF_MAX_MS);
    let due_ms = plugin.host.now_ms().saturating_add(backoff_ms);
    log::debug!("lookup of key {tag} asked again in {backoff_ms} ms");
    plugin.look_up_at_lease_end(LeaseEndLookup { due_ms, flow });
}

/// Starts the lease-end lookups that are due: each asks the store first, and looks its record
/// up only if it is still unsettled.
pub(super) fn start_lease_end_lookups<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    let due: Vec<LeaseEndLookup> = {
        let mut queue = plugin.lease_end_lookups.borrow_mut();
        if !queue.iter().any(|l| l.due_ms <= now_ms) {
            return;
        }
        let (due, later) = std::mem::take(&mut *queue).into_iter().partition(|l| l.due_ms <= now_ms);
        *queue = later;
        due
    };
    for LeaseEndLookup { flow, .. } in due {
        handle_in_root(plugin, flow, Event::LeaseEndDue { now_ms });
    }
}

/// The lookup of a lease-end flow's record, through this Envoy's gate. None when a lookup of the
/// record is under way or was just made here: then a request is here for it.
fn start_lease_end_lookup<H: Host>(plugin: &PluginState<H>, key: FlowKey) -> Option<Lookup> {
    plugin.flows.with(key, |flow| lease_end_lookup(plugin, flow)).flatten()
}

fn lease_end_lookup<H: Host>(plugin: &PluginState<H>, flow: &RequestFlow) -> Option<Lookup> {
    let (call, rule) = flow.lease_end_call()?;
    let scope = flow.scope().copied()?;
    let now_ms = plugin.host.now_ms();
    if plugin.lookups.start(&scope, now_ms, u64::from(call.timeout_ms)).is_err() {
        log::debug!("lease-end lookup of key {} left to the request already asking", scope.log_tag());
        return None;
    }
    Some(Lookup {
        scope,
        started_ms: now_ms,
        rule: Rc::clone(rule),
        cluster: call.cluster.clone(),
        headers: call.headers.clone(),
        timeout_ms: call.timeout_ms,
    })
}
