//! Per-request glue: reads what the flow asks for, performs the steps it returns. Every decision
//! is `flow::RequestFlow`'s; what remains here is which host call carries out which step, and
//! how a failed host call is reported.

use super::plugin::{PluginState, Store, WaitHandle};
use super::remote::{self, Answer, Conversation, Next, Outcome, RemoteStore};
use super::{
    Host, HostError, BUFFER_REQUEST_BODY, BUFFER_RESPONSE_BODY, MAP_REQUEST_HEADERS, MAP_RESPONSE_HEADERS,
};
use crate::engine::HeaderFix;
use crate::flow::{FailMode, Output, RequestFlow, Step, StreamFacts, Unreadable, Verdict};
use crate::store::{StoreAnswer, StoreError, StoreOp};
use crate::wait::Waiter;
use std::cell::Cell;
use std::collections::VecDeque;
use std::rc::Rc;

/// The flow's reads, as host calls.
struct Facts<'p, H: Host> {
    plugin: &'p PluginState<H>,
    context_id: u32,
    /// Bytes at the start of Envoy's response buffer the flow has read already (held frames
    /// stay in the buffer, and each callback's size counts them all).
    response_start: usize,
}

impl<H: Host> Facts<'_, H> {
    fn logged<T>(&self, what: &str, read: Result<T, HostError>) -> Result<T, Unreadable> {
        read.map_err(|HostError(s)| {
            log::warn!("#{} cannot read {what} (host status {s})", self.context_id);
            Unreadable
        })
    }
}

impl<H: Host> StreamFacts for Facts<'_, H> {
    fn now_ms(&mut self) -> u64 {
        self.plugin.host.now_ms()
    }
    fn owner_token(&mut self) -> u64 {
        self.plugin.owner_token(self.context_id, self.plugin.host.now_ms())
    }
    fn request_header(&mut self, name: &str) -> Option<Vec<u8>> {
        self.plugin.host.header_value(MAP_REQUEST_HEADERS, name).ok().flatten()
    }
    fn request_headers(&mut self) -> Result<Vec<(String, Vec<u8>)>, Unreadable> {
        self.logged("the request headers", self.plugin.host.header_pairs(MAP_REQUEST_HEADERS))
    }
    fn request_body(&mut self, size: usize) -> Result<Vec<u8>, Unreadable> {
        self.logged("the request body", self.plugin.host.buffer(BUFFER_REQUEST_BODY, 0, size))
    }
    fn response_header(&mut self, name: &str) -> Option<Vec<u8>> {
        self.plugin.host.header_value(MAP_RESPONSE_HEADERS, name).ok().flatten()
    }
    fn response_headers(&mut self) -> Vec<(String, Vec<u8>)> {
        self.plugin.host.header_pairs(MAP_RESPONSE_HEADERS).unwrap_or_default()
    }
    fn response_body(&mut self, size: usize) -> Result<Vec<u8>, Unreadable> {
        let start = self.response_start;
        let read = self.plugin.host.buffer(BUFFER_RESPONSE_BODY, start, size.saturating_sub(start));
        self.logged("the response body", read)
    }
    fn property(&mut self, path: &[&str]) -> Result<Option<Vec<u8>>, Unreadable> {
        self.plugin.host.property(path).map_err(|_| Unreadable)
    }
}

pub struct Http<H: Host> {
    context_id: u32,
    plugin: Option<Rc<PluginState<H>>>,
    flow: RequestFlow,
    /// Set while the request is held in the wait room: where the root leaves word.
    wait_handle: Option<WaitHandle>,
    /// The remote store's `begin` in progress: the token of its callout and the conversation
    /// its answer goes to. The request stays paused meanwhile.
    call: Option<(u32, Box<dyn Conversation>)>,
    /// Set during a response callback: a settlement handed to the root holds the response.
    hold_response: bool,
    /// Bytes of the response body held in Envoy's buffer (remote store, while capturing).
    response_held: usize,
}

impl<H: Host> Http<H> {
    pub fn new(context_id: u32, plugin: Option<Rc<PluginState<H>>>) -> Http<H> {
        Http {
            context_id,
            plugin,
            flow: RequestFlow::new(context_id),
            wait_handle: None,
            call: None,
            hold_response: false,
            response_held: 0,
        }
    }

    /// Runs one callback: without a configuration nothing is ours and the stream goes on.
    /// `response`: a response callback, whose stream may be held until a settlement is written.
    fn callback(
        &mut self,
        response: bool,
        event: impl FnOnce(&mut RequestFlow, &PluginState<H>, &mut Facts<H>) -> Output,
    ) -> Verdict {
        let Some(plugin) = self.plugin.clone() else { return Verdict::Continue };
        if let Some(resumed) = self.wait_handle.as_ref().and_then(|h| h.take()) {
            self.wait_handle = None;
            self.flow.resumed(resumed);
        }
        let mut facts =
            Facts { plugin: &plugin, context_id: self.context_id, response_start: self.response_held };
        let out = event(&mut self.flow, &plugin, &mut facts);
        self.hold_response = response;
        let verdict = self.perform(&plugin, out);
        self.hold_response = false;
        verdict
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.callback(false, |flow, p, facts| flow.request_headers(&p.config, facts, end_of_stream))
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        self.callback(false, |flow, p, facts| flow.request_body(&p.config, facts, size, end_of_stream))
    }

    pub fn on_request_trailers(&mut self) -> Verdict {
        self.callback(false, |flow, p, facts| flow.request_trailers(&p.config, facts))
    }

    pub fn on_response_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.callback(true, |flow, _, facts| flow.response_headers(facts, end_of_stream))
    }

    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        let verdict = self.callback(true, |flow, _, facts| flow.response_body(facts, size, end_of_stream));
        // With a remote store the body is held while it is copied, and let go with the last
        // frame once the record is written (the root resumes it): a client that has the whole
        // response has a record a retry replays. Envoy's buffer holds at most
        // max_response_bytes (the flow stops copying past it, and then the body goes on).
        let remote = matches!(self.plugin.as_deref().map(|p| &p.store), Some(Store::Remote(_)));
        if remote && verdict == Verdict::Continue && !end_of_stream && self.flow.capturing() {
            self.response_held = size;
            return Verdict::Pause;
        }
        self.response_held = 0;
        verdict
    }

    pub fn on_response_trailers(&mut self) -> Verdict {
        self.callback(true, |flow, _, facts| flow.response_trailers(facts))
    }

    pub fn on_log(&mut self) {
        self.callback(false, |flow, _, facts| flow.stream_ended(facts));
    }

    /// The answer to a callout this context dispatched (the remote store's `begin`). A token
    /// that is not the one awaited (a late answer after the request was answered) is ignored.
    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        let Some(plugin) = self.plugin.clone() else { return };
        let Store::Remote(store) = &plugin.store else { return };
        let Some((awaited, conversation)) = self.call.take() else {
            log::debug!("#{} ignored a callout answer nobody was waiting for", self.context_id);
            return;
        };
        if awaited != token {
            log::debug!("#{} ignored the answer to callout {token}", self.context_id);
            self.call = Some((awaited, conversation));
            return;
        }
        let out = match remote::read_answer(&plugin.host, body_size) {
            Outcome::TimedOut => Some(self.store_failed(&plugin, store.as_ref(), StoreError::TimedOut)),
            Outcome::Answered(answer) => self.converse(&plugin, store.as_ref(), conversation, Some(answer)),
        };
        if let Some(out) = out {
            if self.perform(&plugin, out) == Verdict::Continue {
                if let Err(HostError(s)) = plugin.host.resume_request() {
                    log::warn!("#{} could not resume the request (host status {s})", self.context_id);
                }
            }
        }
    }

    /// Takes a conversation with the remote store one step: a callout (the request stays
    /// paused; no output yet) or the store's answer for the flow.
    fn converse(
        &mut self,
        plugin: &PluginState<H>,
        store: &dyn RemoteStore,
        mut conversation: Box<dyn Conversation>,
        answer: Option<Answer>,
    ) -> Option<Output> {
        match conversation.step(answer, plugin.host.now_ms()) {
            Next::Call(request) => match remote::dispatch(&plugin.host, store.settings(), &request) {
                Ok(token) => {
                    self.call = Some((token, conversation));
                    None
                }
                Err(HostError(s)) => {
                    log::warn!(
                        "#{} callout to cluster {} refused (host status {s})",
                        self.context_id,
                        store.settings().cluster
                    );
                    let error = StoreError::Unavailable(format!("callout refused (host status {s})"));
                    Some(self.store_failed(plugin, store, error))
                }
            },
            Next::Done(StoreAnswer::Begun(Err(
                error @ (StoreError::Unavailable(_) | StoreError::TimedOut),
            ))) => Some(self.store_failed(plugin, store, error)),
            Next::Done(answer) => Some(self.flow.store_answered(&plugin.config, answer)),
        }
    }

    /// The remote store could not be used: the store's fail mode decides (a fail-open bypass is
    /// logged at most once a second per worker; it is counted every time).
    fn store_failed(
        &mut self,
        plugin: &PluginState<H>,
        store: &dyn RemoteStore,
        error: StoreError,
    ) -> Output {
        let mode = store.settings().on_error;
        if mode == FailMode::Open && plugin.bypass_log_due(plugin.host.now_ms()) {
            log::warn!(
                "idempotency store unavailable ({error}): forwarding requests unprotected (fail_open)"
            );
        }
        self.flow.store_failed(&plugin.config, error, mode)
    }

    /// Carries out the steps in order. The local store answers at once, so a store step's answer
    /// goes straight back to the flow, and the verdict is the flow's last word.
    fn perform(&mut self, plugin: &PluginState<H>, out: Output) -> Verdict {
        let host = &plugin.host;
        let mut verdict = out.verdict;
        let mut held = false;
        let mut steps: VecDeque<Step> = out.steps.into();
        while let Some(step) = steps.pop_front() {
            let more = match step {
                Step::Count(counter) => {
                    plugin.count(counter);
                    None
                }
                Step::Reply { reply, details } => {
                    if let Err(HostError(s)) =
                        host.send_response(reply.status, details, &reply.headers, &reply.body)
                    {
                        log::warn!("#{} could not send the local reply (host status {s})", self.context_id);
                    }
                    None
                }
                Step::Store(op) => match &plugin.store {
                    Store::Local(_) => Some(self.flow.store_answered(&plugin.config, plugin.perform(&op))),
                    Store::Remote(store) => match op {
                        StoreOp::Begin(_) => {
                            let conversation = store.start(op);
                            self.converse(plugin, store.as_ref(), conversation, None)
                        }
                        // Settled by the root: the stream may end before the store answers. In a
                        // response callback the response waits for it (the root resumes it).
                        op => {
                            if let Some(settlement) = self.flow.hand_off_settlement() {
                                let hold = self.hold_response && verdict == Verdict::Continue;
                                plugin.settle_from_root(store.as_ref(), op, settlement, hold);
                                if hold {
                                    held = true;
                                }
                            }
                            None
                        }
                    },
                },
                Step::Park(plan) => {
                    let handle: WaitHandle = Rc::new(Cell::new(None));
                    let recheck_at_ms = plan.recheck_at_ms(plugin.ensure_advertised(plan.now_ms));
                    let waiter = Waiter {
                        context_id: self.context_id,
                        pending: plan.pending,
                        fingerprint: plan.fingerprint,
                        give_up_at_ms: plan.give_up_at_ms,
                        recheck_at_ms,
                        handle: Rc::clone(&handle),
                    };
                    let admitted = plugin.room.borrow_mut().park(waiter);
                    if admitted.is_ok() {
                        self.wait_handle = Some(handle);
                    }
                    Some(self.flow.parked(&plugin.config, admitted))
                }
                Step::Wake(scope) => {
                    plugin.broadcast(&scope);
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
                                "#{} could not restore a replayed header {fix:?} (host status {s})",
                                self.context_id
                            );
                        }
                    }
                    None
                }
                Step::LeaveWaitRoom => {
                    plugin.room.borrow_mut().leave(self.context_id);
                    self.wait_handle = None;
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
            };
            if let Some(more) = more {
                verdict = more.verdict;
                steps.extend(more.steps);
            }
        }
        if held {
            Verdict::Pause
        } else {
            verdict
        }
    }
}
