//! The SDK's context traits over the glue (wasm32 only): each callback forwards to `Root` or
//! `Http` and turns a `Verdict` into the SDK's `Action`. No decision lives here.

use super::host::{self, AbiHost, HostLogger};
use super::http::Http;
use super::root::Root;
use crate::flow::Verdict;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

static LOGGER: HostLogger = HostLogger;

proxy_wasm::main! {{
    // Our own logger and panic hook instead of the SDK's: both of its versions unwrap host calls.
    // No host calls here: Envoy refuses them while the module initializes.
    let _ = log::set_logger(&LOGGER);
    std::panic::set_hook(Box::new(|info| host::log(host::LOG_CRITICAL, &format!("{info}"))));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(SdkRoot(Root::new(context_id, AbiHost)))
    });
}}

fn action(verdict: Verdict) -> Action {
    match verdict {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

struct SdkRoot(Root<AbiHost>);

impl Context for SdkRoot {
    fn on_done(&mut self) -> bool {
        self.0.on_done()
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        self.0.on_http_call_response(token_id, body_size)
    }
}

impl RootContext for SdkRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.0.on_configure()
    }

    fn on_tick(&mut self) {
        self.0.on_tick()
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        self.0.on_queue_ready(queue_id)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(SdkHttp(self.0.http_context(context_id))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct SdkHttp(Http<AbiHost>);

// Streams dispatch no callouts (the root does, see glue/root.rs), so none is answered here.
impl Context for SdkHttp {}

impl HttpContext for SdkHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.0.on_request_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.0.on_request_body(body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.0.on_request_trailers())
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.0.on_response_headers(end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.0.on_response_body(body_size, end_of_stream))
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.0.on_response_trailers())
    }

    fn on_log(&mut self) {
        self.0.on_log()
    }
}
