//! Per-request glue: reads what the flow asks for, performs the steps it returns. Every decision
//! is `flow::RequestFlow`'s; what remains here is which host call carries out which step, and
//! how a failed host call is reported.

use super::plugin::{PluginState, WaitHandle};
use super::{
    Host, HostError, BUFFER_REQUEST_BODY, BUFFER_RESPONSE_BODY, MAP_REQUEST_HEADERS, MAP_RESPONSE_HEADERS,
};
use crate::engine::HeaderFix;
use crate::flow::{Output, RequestFlow, Step, StreamFacts, Unreadable, Verdict};
use crate::wait::Waiter;
use std::cell::Cell;
use std::collections::VecDeque;
use std::rc::Rc;

/// The flow's reads, as host calls.
struct Facts<'p, H: Host> {
    plugin: &'p PluginState<H>,
    context_id: u32,
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
        self.logged("the response body", self.plugin.host.buffer(BUFFER_RESPONSE_BODY, 0, size))
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
}

impl<H: Host> Http<H> {
    pub fn new(context_id: u32, plugin: Option<Rc<PluginState<H>>>) -> Http<H> {
        Http { context_id, plugin, flow: RequestFlow::new(context_id), wait_handle: None }
    }

    /// Runs one callback: without a configuration nothing is ours and the stream goes on.
    fn callback(
        &mut self,
        event: impl FnOnce(&mut RequestFlow, &PluginState<H>, &mut Facts<H>) -> Output,
    ) -> Verdict {
        let Some(plugin) = self.plugin.clone() else { return Verdict::Continue };
        if let Some(resumed) = self.wait_handle.as_ref().and_then(|h| h.take()) {
            self.wait_handle = None;
            self.flow.resumed(resumed);
        }
        let mut facts = Facts { plugin: &plugin, context_id: self.context_id };
        let out = event(&mut self.flow, &plugin, &mut facts);
        self.perform(&plugin, out)
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.callback(|flow, p, facts| flow.request_headers(&p.config, facts, end_of_stream))
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        self.callback(|flow, p, facts| flow.request_body(&p.config, facts, size, end_of_stream))
    }

    pub fn on_request_trailers(&mut self) -> Verdict {
        self.callback(|flow, p, facts| flow.request_trailers(&p.config, facts))
    }

    pub fn on_response_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.callback(|flow, _, facts| flow.response_headers(facts, end_of_stream))
    }

    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        self.callback(|flow, _, facts| flow.response_body(facts, size, end_of_stream))
    }

    pub fn on_response_trailers(&mut self) -> Verdict {
        self.callback(|flow, _, facts| flow.response_trailers(facts))
    }

    pub fn on_log(&mut self) {
        self.callback(|flow, _, facts| flow.stream_ended(facts));
    }

    /// Carries out the steps in order. The local store answers at once, so a store step's answer
    /// goes straight back to the flow, and the verdict is the flow's last word.
    fn perform(&mut self, plugin: &PluginState<H>, out: Output) -> Verdict {
        let host = &plugin.host;
        let mut verdict = out.verdict;
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
                Step::Store(op) => Some(self.flow.store_answered(&plugin.config, plugin.perform(&op))),
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
        verdict
    }
}
