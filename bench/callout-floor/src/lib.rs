//! The callout floor (bench/callout_floor.py): a proxy-wasm filter that answers every request
//! with one gRPC call to etcd, as a replay on the etcd store must, and does nothing else. It
//! holds the request for its body (a replay needs the body for its fingerprint), then sends
//! etcd's KV/Range for the key its plugin configuration names on the `etcd` cluster, reads the
//! answer's `:status`, `grpc-status` and body (the reads a replay makes), and answers 201 with
//! the body's last 1 KiB. Whatever Envoy spends here is the least a one-round-trip replay can
//! cost; the idempotency filter's own work comes on top. Configured `local`, it answers the same
//! way without the callout (1 KiB of `x`): the least a replay from the local store can cost.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloorRoot { request: Rc::new(Vec::new()) }) });
}}

/// The idempotency filter's default callout timeout on the bench's etcd store.
const TIMEOUT: Duration = Duration::from_millis(250);
const ANSWER_BYTES: usize = 1024;

struct FloorRoot {
    /// The gRPC message (KV/Range of the configured key), built once; empty: answer locally.
    request: Rc<Vec<u8>>,
}

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let key = self.get_plugin_configuration().unwrap_or_default();
        if key == b"local" {
            return true;
        }
        if key.is_empty() || key.len() > 127 {
            return false;
        }
        // RangeRequest { key = 1 }, in a gRPC frame (not compressed, 4-byte big-endian length).
        let mut message = vec![0x0a, key.len() as u8];
        message.extend_from_slice(&key);
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
        frame.extend_from_slice(&message);
        self.request = Rc::new(frame);
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FloorHttp { request: Rc::clone(&self.request) }))
    }
}

struct FloorHttp {
    request: Rc<Vec<u8>>,
}

impl FloorHttp {
    fn call_etcd(&mut self) {
        if self.request.is_empty() {
            self.send_http_response(
                201,
                vec![("content-type", "application/json")],
                Some(&[b'x'; ANSWER_BYTES]),
            );
            return;
        }
        let headers = vec![
            (":method", "POST"),
            (":path", "/etcdserverpb.KV/Range"),
            (":authority", "etcd"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ];
        if self.dispatch_http_call("etcd", headers, Some(&self.request), vec![], TIMEOUT).is_err() {
            self.send_http_response(503, vec![], Some(b"callout refused\n"));
        }
    }
}

impl Context for FloorHttp {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let status = self.get_http_call_response_header(":status");
        let grpc = self.get_http_call_response_trailer("grpc-status");
        let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
        if status.as_deref() != Some("200") || grpc.as_deref() != Some("0") || body.len() < ANSWER_BYTES {
            self.send_http_response(502, vec![], Some(b"etcd did not answer with the key\n"));
            return;
        }
        let answer = &body[body.len() - ANSWER_BYTES..];
        self.send_http_response(201, vec![("content-type", "application/json")], Some(answer));
    }
}

impl HttpContext for FloorHttp {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.call_etcd();
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.call_etcd();
        }
        Action::Pause
    }
}
