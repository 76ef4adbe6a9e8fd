//! The module's exports (wasm32 only): Envoy's proxy-wasm callbacks, routed to `Root` and `Http`
//! by context id. No decision lives here.
//!
//! Why not the SDK's dispatcher: it `panic!`s on any context id or callout token it does not
//! know and unwraps `set_effective_context`, and a panic kills the VM for every request on the
//! worker; it also made up a tenth of the module. Here an unknown id is logged and ignored, and a
//! callback that arrives while its table is busy (a re-entrant call) is answered with a
//! harmless default instead of a `RefCell` panic.

use super::host::{self, AbiHost, HostLogger};
use crate::worker::flow::Verdict;
use crate::worker::flows::ContextIds;
use crate::worker::http::Http;
use crate::worker::root::Root;
use std::cell::RefCell;
use std::collections::HashMap;

const ACTION_CONTINUE: u32 = 0;
const ACTION_PAUSE: u32 = 1;

static LOGGER: HostLogger = HostLogger;

thread_local! {
    // Roots and streams apart: a root callback resumes streams, and Envoy may run their next
    // callbacks before it returns.
    static ROOTS: RefCell<Vec<Root<AbiHost>>> = const { RefCell::new(Vec::new()) };
    static STREAMS: RefCell<HashMap<u32, Http<AbiHost>, ContextIds>> =
        const { RefCell::new(HashMap::with_hasher(ContextIds)) };
}

extern "C" {
    fn __wasm_call_ctors();
}

/// The reactor's entry point, run once when the VM starts: constructors, then our own logger
/// and panic hook. No host calls here: Envoy refuses them while the module initializes.
#[no_mangle]
pub extern "C" fn _initialize() {
    // SAFETY: the reactor's constructors, run once, before anything else in the module.
    unsafe { __wasm_call_ctors() };
    let _ = log::set_logger(&LOGGER);
    std::panic::set_hook(Box::new(|info| host::log(host::LOG_CRITICAL, &format!("{info}"))));
}

/// Tells Envoy which ABI the module speaks.
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Where Envoy copies what a host call returns; `host::take` gives it back to Rust as a
/// `Vec<u8>` of exactly this length and capacity.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    // Not zeroed: Envoy overwrites all of it (a 1 MiB body would otherwise be written twice).
    let mut buffer: Vec<std::mem::MaybeUninit<u8>> = Vec::with_capacity(size);
    // SAFETY: MaybeUninit<u8> needs no initialization, and the capacity is `size`.
    unsafe { buffer.set_len(size) };
    Box::into_raw(buffer.into_boxed_slice()).cast::<u8>()
}

fn with_root<T>(context_id: u32, default: T, f: impl FnOnce(&mut Root<AbiHost>) -> T) -> T {
    ROOTS.with(|roots| match roots.try_borrow_mut() {
        Ok(mut roots) => match roots.iter_mut().find(|r| r.context_id() == context_id) {
            Some(root) => f(root),
            None => {
                log::warn!("callback for unknown root context {context_id}; ignored");
                default
            }
        },
        Err(_) => {
            log::warn!("re-entrant callback for root context {context_id}; ignored");
            default
        }
    })
}

fn with_stream(context_id: u32, f: impl FnOnce(&mut Http<AbiHost>) -> Verdict) -> u32 {
    let verdict = STREAMS.with(|streams| match streams.try_borrow_mut() {
        Ok(mut streams) => streams.get_mut(&context_id).map(f),
        Err(_) => None,
    });
    match verdict {
        Some(Verdict::Pause) => ACTION_PAUSE,
        // An unknown stream is not ours to hold.
        Some(Verdict::Continue) | None => ACTION_CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent_context_id: u32) {
    if parent_context_id == 0 {
        ROOTS.with(|roots| match roots.try_borrow_mut() {
            Ok(mut roots) => roots.push(Root::new(context_id, AbiHost)),
            Err(_) => log::warn!("root context {context_id} created re-entrantly; ignored"),
        });
        return;
    }
    let Some(http) = with_root(parent_context_id, None, |root| Some(root.http_context(context_id))) else {
        return;
    };
    STREAMS.with(|streams| match streams.try_borrow_mut() {
        Ok(mut streams) => {
            streams.insert(context_id, http);
        }
        Err(_) => log::warn!("stream {context_id} created re-entrantly; ignored"),
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(context_id: u32, _vm_configuration_size: usize) -> u32 {
    u32::from(with_root(context_id, true, |root| root.on_vm_start()))
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(context_id: u32, _plugin_configuration_size: usize) -> u32 {
    u32::from(with_root(context_id, false, |root| root.on_configure()))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(context_id: u32) {
    with_root(context_id, (), |root| root.on_tick())
}

#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(context_id: u32, queue_id: u32) {
    with_root(context_id, (), |root| root.on_queue_ready(queue_id))
}

/// Only roots dispatch callouts (see glue/root.rs), and Envoy answers the context that made one.
#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    context_id: u32,
    token: u32,
    _num_headers: usize,
    body_size: usize,
    _num_trailers: usize,
) {
    with_root(context_id, (), |root| root.on_http_call_response(token, body_size))
}

/// Only roots open gRPC streams (the etcd watch, glue/root.rs): the same routing.
#[no_mangle]
pub extern "C" fn proxy_on_grpc_receive_initial_metadata(_context_id: u32, _token: u32, _num_headers: usize) {
}

#[no_mangle]
pub extern "C" fn proxy_on_grpc_receive(context_id: u32, token: u32, message_size: usize) {
    with_root(context_id, (), |root| root.on_grpc_receive(token, message_size))
}

#[no_mangle]
pub extern "C" fn proxy_on_grpc_receive_trailing_metadata(
    _context_id: u32,
    _token: u32,
    _num_trailers: usize,
) {
}

#[no_mangle]
pub extern "C" fn proxy_on_grpc_close(context_id: u32, token: u32, status_code: u32) {
    with_root(context_id, (), |root| root.on_grpc_close(token, status_code))
}

/// A stream whose request passed through is forgotten here (`Http::inert`): its later callbacks
/// find no stream and go on at once, as an unknown stream's do.
#[no_mangle]
pub extern "C" fn proxy_on_request_headers(context_id: u32, _num_headers: usize, end_of_stream: u32) -> u32 {
    let mut inert = false;
    let action = with_stream(context_id, |http| {
        let verdict = http.on_request_headers(end_of_stream != 0);
        inert = verdict == Verdict::Continue && http.inert();
        verdict
    });
    if inert {
        STREAMS.with(|streams| {
            if let Ok(mut streams) = streams.try_borrow_mut() {
                streams.remove(&context_id);
            }
        });
    }
    action
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(context_id: u32, body_size: usize, end_of_stream: u32) -> u32 {
    with_stream(context_id, |http| http.on_request_body(body_size, end_of_stream != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _num_trailers: usize) -> u32 {
    with_stream(context_id, |http| http.on_request_trailers())
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(context_id: u32, _num_headers: usize, end_of_stream: u32) -> u32 {
    with_stream(context_id, |http| http.on_response_headers(end_of_stream != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(context_id: u32, body_size: usize, end_of_stream: u32) -> u32 {
    with_stream(context_id, |http| http.on_response_body(body_size, end_of_stream != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(context_id: u32, _num_trailers: usize) -> u32 {
    with_stream(context_id, |http| http.on_response_trailers())
}

#[no_mangle]
pub extern "C" fn proxy_on_log(context_id: u32) {
    with_stream(context_id, |http| {
        http.on_log();
        Verdict::Continue
    });
}

/// A stream is done at once, and so is one the module forgot at its request headers; a root may
/// ask Envoy to wait (its callouts in flight).
#[no_mangle]
pub extern "C" fn proxy_on_done(context_id: u32) -> u32 {
    let is_root = ROOTS
        .with(|r| r.try_borrow().map(|r| r.iter().any(|r| r.context_id() == context_id)).unwrap_or(false));
    if !is_root {
        return 1;
    }
    u32::from(with_root(context_id, true, |root| root.on_done()))
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    let removed = STREAMS.with(|s| s.try_borrow_mut().map(|mut s| s.remove(&context_id)).ok().flatten());
    if removed.is_some() {
        return;
    }
    ROOTS.with(|roots| {
        if let Ok(mut roots) = roots.try_borrow_mut() {
            roots.retain(|r| r.context_id() != context_id);
        }
    });
}
