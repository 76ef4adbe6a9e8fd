//! No-op proxy-wasm HTTP filter: a root context and an HTTP context that implement nothing,
//! so every callback takes the SDK's default (`Action::Continue`). Used by `bench/run.py` as
//! scenario 2, "Envoy with a Wasm filter that does nothing".

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(NoopRoot) });
}}

struct NoopRoot;

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(NoopHttp))
    }
}

struct NoopHttp;

impl Context for NoopHttp {}

// Every callback keeps its default: Action::Continue.
impl HttpContext for NoopHttp {}
