//! A stream's adapter: reads what the flow asks for, performs the steps it returns. Every decision
//! is `flow::RequestFlow`'s; what remains here is which host call carries out which step, and
//! how a failed host call is reported.

use super::admin::root::AdminStream;
use super::carry::{self, At};
use super::flows::FlowKey;
use super::plugin::PluginState;
use crate::host::pairs::HeaderMap;
use crate::host::{
    Host, HostError, BUFFER_REQUEST_BODY, BUFFER_RESPONSE_BODY, MAP_REQUEST_HEADERS, MAP_RESPONSE_HEADERS,
};
use crate::worker::flow::{said, Callback, Event, RequestFlow, StreamFacts, Unreadable, Verdict};
use std::rc::Rc;

/// The flow's reads, as host calls.
struct Facts<'p, H: Host> {
    plugin: &'p PluginState<H>,
    context_id: u32,
    /// Bytes at the start of Envoy's response buffer the flow has read already (held frames
    /// stay in the buffer, and each callback's size counts them all).
    response_start: usize,
    request_map: Option<Result<HeaderMap, Unreadable>>,
}

impl<H: Host> Facts<'_, H> {
    /// The request's header map, read once per callback: the rule match and the admission both
    /// read from it, so unprotected traffic costs this one host call.
    fn request_map(&mut self) -> Result<&HeaderMap, Unreadable> {
        if self.request_map.is_none() {
            let read = self.plugin.host.header_map(MAP_REQUEST_HEADERS);
            self.request_map = Some(self.logged("the request headers", read));
        }
        match &self.request_map {
            Some(Ok(map)) => Ok(map),
            _ => Err(Unreadable),
        }
    }

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
        self.plugin.owner_token(self.context_id)
    }
    fn request_header(&mut self, name: &str) -> Option<Vec<u8>> {
        self.request_map().ok()?.get(name).map(<[u8]>::to_vec)
    }
    fn request_headers(&mut self) -> Result<Vec<(String, Vec<u8>)>, Unreadable> {
        Ok(self.request_map()?.pairs())
    }
    fn request_body(&mut self, size: usize) -> Result<Vec<u8>, Unreadable> {
        self.logged("the request body", self.plugin.host.buffer(BUFFER_REQUEST_BODY, 0, size))
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

/// A stream's context, as the root created it for its plugin: a filter instance's (protected
/// traffic, and everything else that passes through) or an admin instance's (the admin API,
/// answered by the module itself). Envoy's callbacks are routed to the one it is. Nearly every
/// stream is a filter's: boxing it to shrink the rare admin stream would cost an allocation per
/// request.
#[allow(clippy::large_enum_variant)]
pub enum Http<H: Host> {
    Filter(FilterStream<H>),
    Admin(AdminStream<H>),
}

impl<H: Host> Http<H> {
    /// The context of a stream of this plugin: an admin instance's when its configuration has
    /// an `admin` section, else a filter's (without a configuration, nothing is ours).
    pub fn new(context_id: u32, plugin: Option<Rc<PluginState<H>>>) -> Http<H> {
        match plugin {
            Some(plugin) if plugin.config.admin.is_some() => {
                Http::Admin(AdminStream::new(context_id, plugin))
            }
            plugin => Http::Filter(FilterStream::new(context_id, plugin)),
        }
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Verdict {
        match self {
            Http::Filter(stream) => stream.on_request_headers(end_of_stream),
            Http::Admin(stream) => stream.on_request_headers(end_of_stream),
        }
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        match self {
            Http::Filter(stream) => stream.on_request_body(size, end_of_stream),
            Http::Admin(stream) => stream.on_request_body(size, end_of_stream),
        }
    }

    /// An admin request is answered by the module: nothing past its body is ours.
    pub fn on_request_trailers(&mut self) -> Verdict {
        match self {
            Http::Filter(stream) => stream.on_request_trailers(),
            Http::Admin(_) => Verdict::Continue,
        }
    }

    pub fn on_response_headers(&mut self, end_of_stream: bool) -> Verdict {
        match self {
            Http::Filter(stream) => stream.on_response_headers(end_of_stream),
            Http::Admin(_) => Verdict::Continue,
        }
    }

    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        match self {
            Http::Filter(stream) => stream.on_response_body(size, end_of_stream),
            Http::Admin(_) => Verdict::Continue,
        }
    }

    pub fn on_response_trailers(&mut self) -> Verdict {
        match self {
            Http::Filter(stream) => stream.on_response_trailers(),
            Http::Admin(_) => Verdict::Continue,
        }
    }

    pub fn on_log(&mut self) {
        if let Http::Filter(stream) = self {
            stream.on_log();
        }
    }

    /// True when the stream's later callbacks would do nothing (`FilterStream::inert`); an
    /// admin stream is kept until its answer is sent.
    pub fn inert(&self) -> bool {
        match self {
            Http::Filter(stream) => stream.inert(),
            Http::Admin(_) => false,
        }
    }
}

/// A filter instance's stream: what the worker keeps of it between callbacks. Its request's flow
/// is the worker's (`PluginState::flows`, under its context id).
pub struct FilterStream<H: Host> {
    context_id: u32,
    plugin: Option<Rc<PluginState<H>>>,
    /// Bytes of the response body held in Envoy's buffer (remote store, while capturing).
    response_held: usize,
}

impl<H: Host> FilterStream<H> {
    fn new(context_id: u32, plugin: Option<Rc<PluginState<H>>>) -> FilterStream<H> {
        FilterStream { context_id, plugin, response_held: 0 }
    }

    /// Runs one callback: its event goes to the stream's flow, and the executor carries out
    /// what the flow says. Without a configuration nothing is ours and the stream goes on; while
    /// the root holds the flow (its `begin` or lookup as callouts, its detached call, its wait)
    /// the request is paused, and the callback leaves the flow alone (None). One function for
    /// every callback, not one per callback: the module carries its code once.
    #[inline(never)]
    fn callback(&mut self, callback: Callback) -> Option<Verdict> {
        let Some(plugin) = self.plugin.clone() else { return Some(Verdict::Continue) };
        let mut facts = Facts {
            plugin: &plugin,
            context_id: self.context_id,
            response_start: self.response_held,
            request_map: None,
        };
        let event = |flow: &mut RequestFlow| {
            flow.handle(&plugin.config, Event::Stream { callback, facts: &mut facts })
        };
        let out = plugin.flows.of_stream(self.context_id, event)?;
        if out.steps.is_empty() {
            return Some(out.verdict);
        }
        let at = At::Stream { hold_response: callback.is_response() };
        Some(carry::carry_out(&plugin, FlowKey::stream(self.context_id), out, at).verdict)
    }

    fn on_request_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.callback(Callback::RequestHeaders { end_of_stream }).unwrap_or(Verdict::Continue)
    }

    /// True when the stream's later callbacks would do nothing: its request passed through at
    /// its headers and nothing of it is held or handed to the root. The module forgets such a
    /// stream (glue/abi.rs), so unprotected traffic, which a mesh-wide policy sends through the
    /// filter everywhere, costs its later callbacks nothing but Envoy's call into the module.
    fn inert(&self) -> bool {
        self.response_held == 0 && self.plugin.as_deref().is_none_or(|p| p.flows.inert(self.context_id))
    }

    fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        self.callback(Callback::RequestBody { size, end_of_stream }).unwrap_or(Verdict::Continue)
    }

    fn on_request_trailers(&mut self) -> Verdict {
        self.callback(Callback::RequestTrailers).unwrap_or(Verdict::Continue)
    }

    fn on_response_headers(&mut self, end_of_stream: bool) -> Verdict {
        self.callback(Callback::ResponseHeaders { end_of_stream }).unwrap_or(Verdict::Continue)
    }

    fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> Verdict {
        let verdict =
            self.callback(Callback::ResponseBody { size, end_of_stream }).unwrap_or(Verdict::Continue);
        // With a remote store the body is held while it is copied, and let go with the last
        // frame once the record is written (the root resumes it): a client that has the whole
        // response has a record a retry replays. Envoy's buffer holds at most
        // max_response_bytes (the flow stops copying past it, and then the body goes on).
        if verdict == Verdict::Continue && !end_of_stream && self.remote_capturing() {
            self.response_held = size;
            return Verdict::Pause;
        }
        self.response_held = 0;
        verdict
    }

    /// True when a remote store's record is being copied from this stream's response.
    fn remote_capturing(&self) -> bool {
        let Some(plugin) = self.plugin.as_deref() else { return false };
        plugin.store.remote().is_some()
            && plugin.flows.with(FlowKey::stream(self.context_id), |f| f.capturing()) == Some(true)
    }

    fn on_response_trailers(&mut self) -> Verdict {
        self.callback(Callback::ResponseTrailers).unwrap_or(Verdict::Continue)
    }

    fn on_log(&mut self) {
        let ended = self.callback(Callback::Log);
        // Its flow is the root's: a request held in the wait room stops being held (its
        // recheck, if under way, then finds its client gone).
        if let (Some(plugin), None) = (&self.plugin, ended) {
            if plugin.room.borrow_mut().leave(self.context_id).is_some() {
                said(self.context_id, "held request's client went away", None);
            }
        }
    }
}

/// The stream's context is gone: its flow ends with it, or once the root lets it go.
impl<H: Host> Drop for FilterStream<H> {
    fn drop(&mut self) {
        if let Some(plugin) = &self.plugin {
            plugin.flows.stream_ended(self.context_id);
        }
    }
}
