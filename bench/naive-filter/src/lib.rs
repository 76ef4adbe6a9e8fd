//! Naive idempotency filter, the yardstick of issue 11 (`bench/run.py` scenario 6). It does
//! exactly this and nothing more:
//! - hold a request that has an `idempotency-key` until its whole body is in;
//! - SHA-256 of the raw body;
//! - one shared-data read and one CAS write of a small claim (the digest) under the raw key;
//! - forward;
//! - buffer the response body and, at its end, write the whole response (status, headers, body)
//!   to shared data under the same key.
//!
//! A key already present (a retry, or a lost CAS race) is answered 409 without a replay: the
//! benchmark sends only new keys here, and a replay path would be work the yardstick must not do.
//! Records are never removed: a naive store grows for as long as the Envoy runs.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use sha2::{Digest, Sha256};

const KEY_HEADER: &str = "idempotency-key";

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(NaiveRoot) });
}}

struct NaiveRoot;

impl Context for NaiveRoot {}

impl RootContext for NaiveRoot {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(NaiveHttp::default()))
    }
}

#[derive(Default)]
struct NaiveHttp {
    /// The raw idempotency key of a request that carries one (None: pass everything through).
    key: Option<String>,
    /// Whether this request's claim was written (only then is its response stored).
    claimed: bool,
    status: String,
    headers: Vec<(String, String)>,
}

impl NaiveHttp {
    /// Hash the body, read the key, CAS-write the claim; false when the request was answered 409.
    fn claim(&mut self, body: &[u8]) -> bool {
        let Some(key) = self.key.clone() else {
            return true;
        };
        let digest = Sha256::digest(body);
        let (existing, cas) = self.get_shared_data(&key);
        if existing.is_some() || self.set_shared_data(&key, Some(digest.as_slice()), cas).is_err() {
            self.send_http_response(409, vec![("content-type", "text/plain")], Some(b"key in use\n"));
            return false;
        }
        self.claimed = true;
        true
    }

    /// The stored response: status line, then `name: value` lines, a blank line, the body.
    fn record(&self, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(body.len() + 256);
        out.extend_from_slice(self.status.as_bytes());
        out.push(b'\n');
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
        out.extend_from_slice(body);
        out
    }

    fn store(&self, body: &[u8]) {
        if let (true, Some(key)) = (self.claimed, self.key.as_deref()) {
            // Best effort, like a naive filter: a failed write leaves the claim behind.
            let _ = self.set_shared_data(key, Some(&self.record(body)), None);
        }
    }
}

impl Context for NaiveHttp {}

impl HttpContext for NaiveHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.key = self.get_http_request_header(KEY_HEADER);
        if self.key.is_none() {
            return Action::Continue;
        }
        if end_of_stream {
            return if self.claim(b"") { Action::Continue } else { Action::Pause };
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.key.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause; // buffered by Envoy until the whole body is in
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        if self.claim(&body) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if !self.claimed {
            return Action::Continue;
        }
        self.headers = self.get_http_response_headers();
        self.status = self
            .headers
            .iter()
            .find(|(name, _)| name == ":status")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        if end_of_stream {
            self.store(b"");
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.claimed {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause; // buffered by Envoy until the whole body is in
        }
        let body = self.get_http_response_body(0, body_size).unwrap_or_default();
        self.store(&body);
        Action::Continue
    }
}
