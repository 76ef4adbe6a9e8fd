//! What the root carries out for its streams, above its settlements (`settle.rs`): a paused
//! request's flow (its `begin` conversation, the steps its answer leads to, its lookups and the
//! lease-end lookups), a waiter's recheck (its flow's `begin` again, carried out the same way),
//! detached calls, and admin asks. The root's callbacks (`root.rs`) call in here; nothing here
//! calls them.

use super::admin;
use super::calls::{
    AdminAsk, AdminLater, DetachedCall, FlowHandle, HeldFlow, LeaseEndLookup, Lookup, RootAdmin, RootBegin,
    RootCall, RootLookup,
};
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
use crate::flow::{Output, RequestFlow, Step, Verdict};
use crate::identity::scope::ScopeId;
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
pub(super) fn recheck<H: Host>(plugin: &PluginState<H>, w: Waiter<HeldFlow>) {
    let context_id = w.context_id;
    let now_ms = plugin.host.now_ms();
    let owner = plugin.owner_token(context_id);
    // Watched records wake their waiters: those poll only as a fallback.
    let watched = plugin.store.watch(&w.scope).is_some_and(|watch| watch.is_live(&w.scope));
    let Some(HeldFlow { mut flow, handle }) = plugin.room.borrow_mut().start_check(Waiter { watched, ..w })
    else {
        return;
    };
    let Some(op) = flow.recheck(&plugin.config, now_ms, owner) else {
        log::warn!("#{context_id} a held request's flow was not waiting; let go");
        plugin.room.borrow_mut().leave(context_id);
        return;
    };
    match plugin.start(op) {
        Started::Answered(answer) => begin_answered(plugin, context_id, flow, handle, answer),
        Started::Conversation(conversation) => {
            converse_begin(plugin, Box::new(RootBegin { context_id, conversation, flow, handle }), None)
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
            let DetachedCall { context_id, mut flow, handle, .. } = *call;
            if plugin.host.set_effective_context(context_id).is_err() {
                flow.stream_gone();
            }
            let out = flow.detach_refused(&why);
            carry_out_in_root(plugin, context_id, flow, handle, out);
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
    let DetachedCall { context_id, claim, rule, mut flow, handle, .. } = call;
    log::debug!("#{context_id} detached call answered: key {}", claim.scope.log_tag());
    if host.set_effective_context(context_id).is_err() {
        flow.stream_gone();
    }
    let held_ms = plugin.store.held_past_lease_ms(rule.processing_timeout_ms);
    let out = flow.detached_answered(answer, now_ms, held_ms);
    carry_out_in_root(plugin, context_id, flow, handle, out);
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
            Err(error) => begin_failed(plugin, begin, error, Sent::No),
        },
        Next::Wait => plugin.calls.borrow_mut().parked.push(RootCall::Begin(begin)),
        Next::Done(StoreAnswer::Begun(Err(error @ (StoreError::Unavailable(_) | StoreError::TimedOut)))) => {
            begin_failed(plugin, begin, error, Sent::Yes)
        }
        Next::Done(answer) => {
            let RootBegin { context_id, flow, handle, .. } = *begin;
            begin_answered(plugin, context_id, flow, handle, answer);
        }
    }
}

/// The store answered a paused request's `begin` (or a waiter's recheck): what it means is
/// carried out for the request, if its stream is still there.
fn begin_answered<H: Host>(
    plugin: &PluginState<H>,
    context_id: u32,
    mut flow: RequestFlow,
    handle: FlowHandle,
    answer: StoreAnswer,
) {
    if !flow.headless() && !stream_there(plugin, context_id, &flow) {
        // The client went away while the store answered: nobody will forward the request, so a
        // claim it got is given back now instead of blocking retries until its lease ends.
        if let Some(settlement) = flow.answered_without_stream(&answer) {
            give_back(plugin, settlement);
        }
        return;
    }
    let out = flow.store_answered(&plugin.config, answer);
    carry_out_in_root(plugin, context_id, flow, handle, out);
}

/// Whether the stream of a paused request's flow is still there (and now the effective
/// context). A waiter's client that went away during its recheck also left the wait room;
/// a waiter whose stream is gone leaves it now.
fn stream_there<H: Host>(plugin: &PluginState<H>, context_id: u32, flow: &RequestFlow) -> bool {
    let present = plugin.host.set_effective_context(context_id).is_ok();
    if !flow.rechecking() {
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
    begin: Box<RootBegin>,
    error: StoreError,
    sent: Sent,
) {
    if sent == Sent::Yes && gives_back(plugin) {
        if let Some(settlement) =
            begin.conversation.unanswered_claim().and_then(|c| begin.flow.unanswered_claim(c))
        {
            give_back(plugin, settlement);
        }
    }
    if !begin.flow.headless() && !stream_there(plugin, begin.context_id, &begin.flow) {
        return; // its client went away, and no claim is known to exist
    }
    // A lease-end lookup acts on the record only through the store: nothing to forward.
    let mode = if begin.flow.headless() { OnStoreError::FailClosed } else { on_store_error(plugin) };
    if mode == OnStoreError::FailOpen && plugin.meter.bypass_log_due(plugin.host.now_ms()) {
        log::warn!("idempotency store unavailable ({error}): forwarding requests unprotected (fail_open)");
    }
    let RootBegin { context_id, mut flow, handle, .. } = *begin;
    let out = flow.store_failed(&plugin.config, error, mode);
    carry_out_in_root(plugin, context_id, flow, handle, out);
}

/// Where a flow's steps are carried out.
pub(super) enum At<'h> {
    /// In its stream's own callback. `hold_response`: a response callback, whose response waits
    /// for a settlement handed to the root.
    Stream { hold_response: bool },
    /// By the root, for a paused request whose flow goes back to its stream through this handle,
    /// or for a headless lease-end flow.
    Root(&'h FlowHandle),
}

/// What carrying out a flow's steps leaves for whoever holds the flow.
pub(super) struct Carried {
    pub(super) verdict: Verdict,
    /// The flow went on without its holder (its `begin` or lookup is the root's now, or it is
    /// parked in the wait room): a stream reads it back through this handle at its next
    /// callback. `flow` is a blank one meanwhile.
    pub(super) flow_went: Option<FlowHandle>,
    /// The root's local reply to a paused request, sent once its flow is back in its handle
    /// (`carry_out_in_root`), so that its stream knows the reply as ours when it passes.
    pub(super) reply: Option<(Reply, &'static str)>,
}

/// Carries out a flow's steps in order, whoever holds the flow: the one place steps become host
/// calls and store operations. What the store answers at once goes straight back to the flow,
/// and the verdict is the flow's last word; a `begin` or a lookup that goes on as callouts takes
/// the flow with it to the root (later steps, which no flow emits, are dropped and logged), and
/// a request held in the wait room takes it there once its steps are carried out.
pub(super) fn carry_out<H: Host>(
    plugin: &PluginState<H>,
    context_id: u32,
    flow: &mut RequestFlow,
    out: Output,
    at: At,
) -> Carried {
    let host = &plugin.host;
    let mut carried = Carried { verdict: out.verdict, flow_went: None, reply: None };
    let mut response_held = false;
    // The waiter to hold in the wait room, with the flow, once the steps are carried out.
    let mut parking: Option<Waiter<HeldFlow>> = None;
    let mut steps: VecDeque<Step> = out.steps.into();
    // The flow leaves with its `begin` or lookup; the root's flow goes back through its handle.
    let travel = |flow: &mut RequestFlow, steps: &VecDeque<Step>| {
        if !steps.is_empty() {
            log::warn!("#{context_id} {} step(s) after the flow left dropped", steps.len());
        }
        std::mem::replace(flow, RequestFlow::new(context_id))
    };
    while let Some(step) = steps.pop_front() {
        let more = match step {
            // A lease-end lookup's flow, or one whose stream went away: nothing to publish to or
            // answer.
            Step::Count(counter) if flow.streamless() => {
                plugin.meter.count(counter, flow.rule());
                None
            }
            Step::Count(counter) => {
                plugin.meter.count_for_stream(counter, flow.rule(), flow.scope());
                None
            }
            Step::Reply { .. } if flow.streamless() => None,
            Step::Reply { reply, details } if matches!(at, At::Root(_)) => {
                carried.reply = Some((reply, details));
                None
            }
            Step::Reply { reply, details } => {
                send_reply(plugin, context_id, &reply, details);
                None
            }
            Step::Store(op) => {
                let begin = matches!(op, StoreOp::Begin(_));
                match (plugin.start(op), &at) {
                    (Started::Answered(answer), _) => Some(flow.store_answered(&plugin.config, answer)),
                    // A settlement from a stream: the root settles it, since the stream may end
                    // before the store answers. In a response callback the response waits for
                    // it (the root resumes it).
                    (Started::Conversation(conversation), At::Stream { hold_response }) if !begin => {
                        if let Some(settlement) = flow.hand_off_settlement() {
                            let hold = *hold_response && carried.verdict == Verdict::Continue;
                            plugin.settle_from_root(conversation, settlement, hold);
                            response_held |= hold;
                        }
                        None
                    }
                    // The root carries it out, and answers or resumes the request; the flow
                    // goes with it and comes back at the stream's next callback.
                    (Started::Conversation(conversation), At::Stream { .. }) => {
                        let flow = travel(flow, &steps);
                        carried.flow_went = Some(plugin.begin_from_root(conversation, context_id, flow));
                        break;
                    }
                    // A detached request's outcome: the root's carrier writes it (tried again like
                    // any settlement), and the client's reply goes out once it is over.
                    (Started::Conversation(conversation), At::Root(handle)) if flow.settling_detached() => {
                        if let Some(settlement) = flow.hand_off_settlement() {
                            let flow = travel(flow, &steps);
                            let handle = Rc::clone(handle);
                            carried.flow_went = Some(Rc::clone(&handle));
                            let held = Box::new(HeldFlow { flow, handle });
                            settle_then_answer(plugin, conversation, settlement, Some(held));
                        }
                        break;
                    }
                    (Started::Conversation(conversation), At::Root(handle)) => {
                        let flow = travel(flow, &steps);
                        let handle = Rc::clone(handle);
                        carried.flow_went = Some(Rc::clone(&handle));
                        converse_begin(
                            plugin,
                            Box::new(RootBegin { context_id, conversation, flow, handle }),
                            None,
                        );
                        break;
                    }
                }
            }
            // Wait mode: the request stays paused in this worker's wait room.
            Step::Park(plan) => {
                let admitted = plugin.admit(context_id, &plan);
                let held = admitted.as_ref().map(|_| ()).map_err(|not_held| *not_held);
                parking = admitted.ok();
                Some(flow.parked(&plugin.config, held))
            }
            // A waiter's recheck found the original still processing: held again, until its
            // give-up time.
            Step::Repark { lease_remaining_ms } => {
                let now_ms = host.now_ms();
                let again = plugin.room.borrow_mut().end_check(context_id);
                parking = again.and_then(|w| w.again(now_ms, lease_remaining_ms));
                let held = if parking.is_some() { Ok(()) } else { Err(NotHeld::GaveUp) };
                Some(flow.parked(&plugin.config, held))
            }
            Step::Wake(scope) => {
                plugin.wakeups.broadcast(&scope);
                None
            }
            // Detached execution: the root makes the call, and the flow goes with it; its answer
            // is the flow's (`detached_answered`), which goes back to its stream before its reply.
            Step::Detach { claim, rule } => {
                // Its lease-end lookup may be built once its client left: the route's cluster now.
                if flow.wants_route_cluster() {
                    if let Some(cluster) = plugin.route_cluster() {
                        flow.keep_route_cluster(cluster);
                    }
                }
                match plugin.detach(context_id, claim, &rule) {
                    Ok(mut call) => {
                        let handle: FlowHandle = match &at {
                            At::Root(handle) => Rc::clone(handle),
                            At::Stream { .. } => Rc::new(std::cell::RefCell::new(None)),
                        };
                        call.flow = travel(flow, &steps);
                        call.handle = Rc::clone(&handle);
                        carried.flow_went = Some(handle);
                        plugin.hand_over_detached(call);
                        break;
                    }
                    Err(why) => Some(flow.detach_refused(&why)),
                }
            }
            // A lease-end lookup found its record unsettled: ask the upstream (unless a request
            // on this Envoy is asking already: it settles it, or its client retries).
            Step::Lookup { .. } if flow.headless() => {
                let lookup = start_lease_end_lookup(plugin, flow);
                let flow = travel(flow, &steps);
                let handle: FlowHandle = match &at {
                    At::Root(handle) => Rc::clone(handle),
                    At::Stream { .. } => Rc::new(std::cell::RefCell::new(None)),
                };
                carried.flow_went = Some(Rc::clone(&handle));
                if let Some(lookup) = lookup {
                    dispatch_lookup(plugin, Box::new(RootLookup { context_id, flow, handle, lookup }));
                }
                break;
            }
            // Reconciliation: the root makes the lookup and carries out what its answer means;
            // the flow goes with it and comes back at the stream's next callback.
            Step::Lookup { rule, request } => {
                match plugin.start_lookup(context_id, flow.scope().copied(), &rule, &request) {
                    Ok(lookup) => {
                        let flow = travel(flow, &steps);
                        match &at {
                            At::Stream { .. } => {
                                let handle: FlowHandle = Rc::new(std::cell::RefCell::new(None));
                                plugin.lookup_from_root(context_id, flow, &handle, lookup);
                                carried.flow_went = Some(handle);
                            }
                            // Already in the root: made at once.
                            At::Root(handle) => {
                                let handle = Rc::clone(handle);
                                carried.flow_went = Some(Rc::clone(&handle));
                                dispatch_lookup(
                                    plugin,
                                    Box::new(RootLookup { context_id, flow, handle, lookup }),
                                );
                            }
                        }
                        break;
                    }
                    Err(retry_after_ms) => Some(flow.lookup_refused(retry_after_ms)),
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
                None
            }
            Step::LetGo(owner) => {
                plugin.renewals.borrow_mut().let_go(owner);
                None
            }
            Step::LookUpAtLeaseEnd(later) => {
                if let Some(lookup) = plugin.lease_end_lookup(context_id, *later) {
                    plugin.look_up_at_lease_end(lookup);
                }
                None
            }
            Step::FixHeaders(fixes) => {
                for fix in fixes {
                    let result = match &fix {
                        HeaderFix::Set(name, value) => host.set_header(MAP_RESPONSE_HEADERS, name, value),
                        HeaderFix::Remove(name) => host.remove_header(MAP_RESPONSE_HEADERS, name),
                    };
                    if let Err(HostError(s)) = result {
                        log::warn!(
                            "#{context_id} could not restore a replayed header {fix:?} (host status {s})"
                        );
                    }
                }
                None
            }
            Step::RemoveRequestHeaders(names) => {
                for name in names {
                    if let Err(HostError(s)) = host.remove_header(MAP_REQUEST_HEADERS, &name) {
                        log::warn!(
                            "#{context_id} could not remove {name} from the request (host status {s})"
                        );
                    }
                }
                None
            }
            Step::LeaveWaitRoom => {
                plugin.room.borrow_mut().leave(context_id);
                None
            }
            Step::WarnRetried { rule, attempts } => {
                if plugin.first_retry_warning(&rule) {
                    log::warn!(
                        "route rule {rule}: Envoy sent a protected request upstream {attempts} times under one \
                         claim (route retry_policy, hedging or internal redirect); each attempt may execute: \
                         disable Envoy retries on routes this filter protects"
                    );
                }
                None
            }
            Step::ErrorHeaderPrefix { seen } => {
                plugin.meter.header_prefix_mismatch(&plugin.config.envoy_headers.prefix, &seen);
                None
            }
            Step::ErrorStopIterationMissing { rule, details, body_bytes } => {
                if plugin.meter.first_stop_iteration_error() {
                    log::error!("{}", stop_iteration_missing_line(&rule, details.as_deref(), body_bytes));
                }
                None
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
                None
            }
        };
        if let Some(more) = more {
            carried.verdict = more.verdict;
            steps.extend(more.steps);
        }
    }
    if response_held {
        carried.verdict = Verdict::Pause;
    }
    // Held: the flow waits in the room, and goes back to its stream through its handle.
    if let Some(w) = parking {
        let flow = travel(flow, &steps);
        let handle: FlowHandle = match &at {
            At::Root(handle) => Rc::clone(handle),
            At::Stream { .. } => Rc::new(std::cell::RefCell::new(None)),
        };
        let held = HeldFlow { flow, handle: Rc::clone(&handle) };
        plugin.room.borrow_mut().hold(Waiter { held: Some(held), ..w });
        carried.flow_went = Some(handle);
    }
    carried
}

/// Carries out what the flow decided for its paused request (the effective context is the
/// request's), then gives the flow back to its stream and answers or resumes it; unless the
/// flow went on with a conversation or a lookup of the root's, or back to the wait room.
fn carry_out_in_root<H: Host>(
    plugin: &PluginState<H>,
    context_id: u32,
    mut flow: RequestFlow,
    handle: FlowHandle,
    out: Output,
) {
    let carried = carry_out(plugin, context_id, &mut flow, out, At::Root(&handle));
    if carried.flow_went.is_none() {
        if flow.headless() {
            if flow.awaiting_lookup() {
                look_up_again_later(plugin, flow);
            }
            return;
        }
        *handle.borrow_mut() = Some(flow);
    }
    // After the flow is back: the reply passes its stream's encode callbacks as ours.
    if let Some((reply, details)) = carried.reply {
        send_reply(plugin, context_id, &reply, details);
    }
    if carried.flow_went.is_none() && carried.verdict == Verdict::Continue {
        if let Err(HostError(s)) = plugin.host.resume_request() {
            log::warn!(
                "#{context_id} could not resume the request (host status {s}); a claim it holds is given back"
            );
            // Nobody will forward it: nothing was sent upstream.
            let unused = handle.borrow_mut().as_mut().and_then(RequestFlow::not_resumed);
            if let Some(settlement) = unused {
                give_back(plugin, settlement);
            }
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
    let host = &plugin.host;
    let RootLookup { context_id, mut flow, handle, lookup } = call;
    if !flow.headless() && host.set_effective_context(context_id).is_err() {
        log::debug!("#{context_id} lookup of key {} answered after its client left", lookup.scope.log_tag());
        return;
    }
    let out = flow.lookup_answered(answer, host.now_ms());
    carry_out_in_root(plugin, context_id, flow, handle, out);
}

/// A lease-end lookup that settled nothing yet (the lookup failed, or the store still holds
/// the claim's lease by its own clock): asked again later, backing off, `LEASE_END_TRIES` times.
fn look_up_again_later<H: Host>(plugin: &PluginState<H>, mut flow: RequestFlow) {
    let tries = flow.lease_end_tried();
    let tag = flow.scope().map(ScopeId::log_tag).unwrap_or_default();
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
    for LeaseEndLookup { mut flow, .. } in due {
        let out = flow.lease_end_due(now_ms);
        let handle: FlowHandle = Rc::new(std::cell::RefCell::new(None));
        carry_out_in_root(plugin, 0, flow, handle, out);
    }
}

/// The lookup of a lease-end flow's record, through this Envoy's gate. None when a lookup of the
/// record is under way or was just made here: then a request is here for it.
fn start_lease_end_lookup<H: Host>(plugin: &PluginState<H>, flow: &RequestFlow) -> Option<Lookup> {
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
