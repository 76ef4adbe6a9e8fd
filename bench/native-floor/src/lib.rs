//! native-floor: one idempotency claim in an Envoy dynamic module (issue 49).
//!
//! The filter config (`filter_config`, a google.protobuf.StringValue) picks the mode:
//!   "claim" (or empty)  POST /orders* with an `idempotency-key`: hold the request until its body
//!                       is whole, fingerprint it (SHA-256 of method, path, body), compute the scope
//!                       id (SHA-256 of rule, authority, key), compare-and-swap a claim in the
//!                       process-wide store; new: go upstream, then buffer the answer's body and
//!                       store status + body (the snapshot); answered: a local reply of the stored
//!                       status and body (a replay); in flight: 409; another body: 422.
//!   "noop"              continue everywhere (the floor of the interface itself).
//!
//! No hook panics: a panic across the C boundary would abort Envoy. Every pointer from Envoy
//! is checked for null.

// The hooks are called by Envoy only; their one safety contract is stated above them.
#![allow(clippy::missing_safety_doc)]

mod abi;
mod store;

use abi::{
    header, send_response, whole_body, EnvoyBuffer, FilterEnvoyPtr, BODY_CONTINUE, BODY_STOP_ITERATION_AND_BUFFER,
    BODY_STOP_ITERATION_NO_BUFFER, HEADERS_CONTINUE, HEADERS_STOP_ITERATION, REQUEST_HEADER, RESPONSE_HEADER,
    TRAILERS_CONTINUE,
};
use sha2::{Digest, Sha256};
use std::ffi::{c_char, c_void};
use store::Claim;

/// ENVOY_DYNAMIC_MODULES_ABI_VERSION of Envoy 1.40.0 ("v0.2.0": the header at 0199da4a still says
/// "v0.1.0"; 1.40 logs "ABI version v0.2.0 matched" for this one). Envoy only
/// logs a warning on a mismatch; returning null would reject the module.
static ABI_VERSION: &[u8] = b"v0.2.0\0";

const RULE: &[u8] = b"orders";
const PREFIX: &[u8] = b"/orders";
const KEY_HEADER: &[u8] = b"idempotency-key";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Noop,
    Claim,
}

struct Config {
    mode: Mode,
}

/// The per-stream state of a claim.
#[derive(Default)]
struct Filter {
    /// The request is under the rule and has a key: it is held for its body.
    active: bool,
    method: Vec<u8>,
    path: Vec<u8>,
    authority: Vec<u8>,
    key: Vec<u8>,
    record_key: [u8; 32],
    fingerprint: [u8; 32],
    /// This stream holds the claim (a new key): its answer is to be stored.
    claimed: bool,
    stored: bool,
    status: u32,
}

/// What every no-op stream's module pointer points at (nothing is allocated per stream).
static NOOP_FILTER: u8 = 0;

fn noop_ptr() -> *const c_void {
    (&NOOP_FILTER as *const u8).cast()
}

/// The claim state behind a module pointer; None for null and for the no-op sentinel.
///
/// # Safety
/// `ptr` is null, the sentinel, or a pointer from `Box::into_raw` not yet destroyed; Envoy calls
/// one stream's hooks on one worker thread, one at a time.
unsafe fn filter<'a>(ptr: *const c_void) -> Option<&'a mut Filter> {
    if ptr.is_null() || ptr == noop_ptr() {
        None
    } else {
        Some(&mut *(ptr as *mut Filter))
    }
}

fn parse_status(v: &[u8]) -> u32 {
    let mut n: u32 = 0;
    for &b in v {
        if !b.is_ascii_digit() {
            return 0;
        }
        n = n.saturating_mul(10).saturating_add(u32::from(b - b'0'));
    }
    n
}

fn decimal(n: usize) -> Vec<u8> {
    n.to_string().into_bytes()
}

/// The claim, once the request body is whole. True: go on to the upstream; false: answered here.
fn claim(env: FilterEnvoyPtr, f: &mut Filter, body: &[u8]) -> bool {
    let mut h = Sha256::new();
    h.update(&f.method);
    h.update([0u8]);
    h.update(&f.path);
    h.update([0u8]);
    h.update(body);
    f.fingerprint = h.finalize().into();

    let mut s = Sha256::new();
    s.update(RULE);
    s.update([0u8]);
    s.update(&f.authority);
    s.update([0u8]);
    s.update(&f.key);
    f.record_key = s.finalize().into();

    match store::claim(f.record_key, f.fingerprint, body.len()) {
        Claim::New => {
            f.claimed = true;
            true
        }
        Claim::Replay { status, body, request_bytes } => {
            let bytes = decimal(request_bytes);
            send_response(
                env,
                status,
                &[
                    (b"content-type", b"application/json"),
                    (b"idempotent-replayed", b"true"),
                    (b"x-native-floor-request-bytes", &bytes),
                ],
                &body,
                b"native_floor_replay",
            );
            false
        }
        Claim::InFlight => {
            send_response(
                env,
                409,
                &[(b"content-type", b"application/json")],
                br#"{"error":"request in flight"}"#,
                b"native_floor_in_flight",
            );
            false
        }
        Claim::Mismatch => {
            send_response(
                env,
                422,
                &[(b"content-type", b"application/json")],
                br#"{"error":"key reused with another request"}"#,
                b"native_floor_mismatch",
            );
            false
        }
    }
}

// ------------------------------------------------------------------------------------------
// Event hooks (names and signatures from abi.h; Envoy 1.40 rejects a config whose module lacks
// any of the required ones, so the ones this module has no use for are here too, doing nothing).
// They are `unsafe`: Envoy must pass the pointers it made (or null), as abi.h promises.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _filter_config_envoy_ptr: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    // SAFETY: Envoy passes a buffer valid for this call.
    let mode = match unsafe { config.as_slice() } {
        b"" | b"claim" => Mode::Claim,
        b"noop" => Mode::Noop,
        _ => return std::ptr::null(), // rejects the config
    };
    Box::into_raw(Box::new(Config { mode })) as *const c_void
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(filter_config_ptr: *const c_void) {
    if !filter_config_ptr.is_null() {
        // SAFETY: made by Box::into_raw in config_new; Envoy destroys it once.
        drop(unsafe { Box::from_raw(filter_config_ptr as *mut Config) });
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    filter_config_ptr: *const c_void,
    _filter_envoy_ptr: FilterEnvoyPtr,
) -> *const c_void {
    if filter_config_ptr.is_null() {
        return noop_ptr();
    }
    // SAFETY: a Config from config_new, alive while filters are made from it.
    let cfg = unsafe { &*(filter_config_ptr as *const Config) };
    match cfg.mode {
        Mode::Noop => noop_ptr(),
        Mode::Claim => Box::into_raw(Box::<Filter>::default()) as *const c_void,
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    env: FilterEnvoyPtr,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: see `filter`.
    let Some(f) = (unsafe { filter(module) }) else { return HEADERS_CONTINUE };
    let Some(key) = header(env, REQUEST_HEADER, KEY_HEADER) else { return HEADERS_CONTINUE };
    let method = header(env, REQUEST_HEADER, b":method").unwrap_or_default();
    let path = header(env, REQUEST_HEADER, b":path").unwrap_or_default();
    if method != b"POST" || !path.starts_with(PREFIX) {
        return HEADERS_CONTINUE;
    }
    f.authority = header(env, REQUEST_HEADER, b":authority").unwrap_or_default();
    f.method = method;
    f.path = path;
    f.key = key;
    f.active = true;
    if end_of_stream {
        return if claim(env, f, &[]) { HEADERS_CONTINUE } else { HEADERS_STOP_ITERATION };
    }
    HEADERS_STOP_ITERATION
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    env: FilterEnvoyPtr,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: see `filter`.
    let Some(f) = (unsafe { filter(module) }) else { return BODY_CONTINUE };
    if !f.active || f.claimed {
        return BODY_CONTINUE;
    }
    if !end_of_stream {
        return BODY_STOP_ITERATION_AND_BUFFER;
    }
    let body = whole_body(env, true);
    if claim(env, f, &body) {
        BODY_CONTINUE
    } else {
        BODY_STOP_ITERATION_NO_BUFFER
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_env: FilterEnvoyPtr, _module: *const c_void) -> u32 {
    TRAILERS_CONTINUE
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    env: FilterEnvoyPtr,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: see `filter`.
    let Some(f) = (unsafe { filter(module) }) else { return HEADERS_CONTINUE };
    if !f.claimed {
        return HEADERS_CONTINUE;
    }
    f.status = header(env, RESPONSE_HEADER, b":status").map_or(0, |v| parse_status(&v));
    if end_of_stream {
        f.stored = store::complete(&f.record_key, &f.fingerprint, f.status, Vec::new());
    }
    HEADERS_CONTINUE
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    env: FilterEnvoyPtr,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: see `filter`.
    let Some(f) = (unsafe { filter(module) }) else { return BODY_CONTINUE };
    if !f.claimed || f.stored {
        return BODY_CONTINUE;
    }
    if !end_of_stream {
        return BODY_STOP_ITERATION_AND_BUFFER;
    }
    let body = whole_body(env, false);
    f.stored = store::complete(&f.record_key, &f.fingerprint, f.status, body);
    BODY_CONTINUE
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(_env: FilterEnvoyPtr, _module: *const c_void) -> u32 {
    TRAILERS_CONTINUE
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_env: FilterEnvoyPtr, module: *const c_void) {
    // SAFETY: see `filter`.
    if let Some(f) = unsafe { filter(module) } {
        if f.claimed && !f.stored {
            store::release(&f.record_key, &f.fingerprint);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: *const c_void) {
    if !module.is_null() && module != noop_ptr() {
        // SAFETY: made by Box::into_raw in filter_new; Envoy destroys it once.
        drop(unsafe { Box::from_raw(module as *mut Filter) });
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
    _callout_id: u64,
    _result: u32,
    _headers: *mut c_void,
    _headers_size: usize,
    _body_chunks: *mut EnvoyBuffer,
    _body_chunks_size: usize,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
    _stream_id: u64,
    _headers: *mut c_void,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
    _stream_id: u64,
    _trailers: *mut c_void,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
    _stream_id: u64,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
    _stream_id: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_env: FilterEnvoyPtr, _module: *const c_void, _event_id: u64) {}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
) {
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _env: FilterEnvoyPtr,
    _module: *const c_void,
) {
}
