//! The only code that talks to Envoy (wasm32 only). Raw proxy-wasm ABI calls, each status turned
//! into a `Result`: the SDK's own wrappers `panic!` on any status they did not expect and unwrap
//! UTF-8 in header maps, and a panic kills the VM for every request on the worker. `AbiHost`
//! offers them to the rest of the glue as the `Host` trait.

use crate::host::pairs::{encode_pairs, HeaderMap};
use crate::host::{Host, HostError, MetricBatch, LOG_DEBUG, LOG_ERROR, LOG_INFO, LOG_WARN};

/// Always logged, whatever the level: a refused configuration, a panic.
pub const LOG_CRITICAL: u32 = 5;
use crate::store::shared_data::{Cas, Read, SharedData, SharedDataError};
use std::cell::{Cell, RefCell};
use std::ptr::{null, null_mut};

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const CAS_MISMATCH: u32 = 8;

const METRIC_COUNTER: u32 = 0;
const METRIC_GAUGE: u32 = 1;
const STREAM_HTTP_REQUEST: u32 = 0;
const STREAM_HTTP_RESPONSE: u32 = 1;
const EMPTY: u32 = 7;

extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_log_level(return_level: *mut u32) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_register_shared_queue(name_data: *const u8, name_size: usize, return_id: *mut u32) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id_data: *const u8,
        vm_id_size: usize,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_done() -> u32;
    fn proxy_http_call(
        upstream_data: *const u8,
        upstream_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        body_data: *const u8,
        body_size: usize,
        trailers_data: *const u8,
        trailers_size: usize,
        timeout_ms: u32,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_grpc_stream(
        service_data: *const u8,
        service_size: usize,
        service_name_data: *const u8,
        service_name_size: usize,
        method_data: *const u8,
        method_size: usize,
        metadata_data: *const u8,
        metadata_size: usize,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_grpc_send(token: u32, message_data: *const u8, message_size: usize, end_stream: u32) -> u32;
    fn proxy_grpc_cancel(token: u32) -> u32;
}

fn check(status: u32) -> Result<(), HostError> {
    if status == OK {
        Ok(())
    } else {
        Err(HostError(status))
    }
}

/// Takes ownership of a buffer the host allocated through `proxy_on_memory_allocate`.
///
/// # Safety
/// `data`/`size` must come from a successful host call that returned an allocation.
// SAFETY: on success a host call that returns bytes writes into its out-pointers either null (no
// data: None here) or a buffer it got from `proxy_on_memory_allocate` (glue/abi.rs) for exactly
// `size` bytes and filled: a boxed slice of `size` bytes, align 1, which is the allocation of a
// `Vec<u8>` of length and capacity `size` (a dangling, non-null pointer for 0). Nothing else
// owns it: the host only returns it, so the Vec frees it once, and never a pointer twice, since
// each caller takes what one call wrote.
unsafe fn take(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        Some(Vec::from_raw_parts(data, size, size))
    }
}

pub fn log(level: u32, message: &str) {
    // A logging failure has nowhere to be reported; ignoring it is the only total choice.
    // SAFETY: the host reads `message.len()` bytes at its pointer during the call only, and the
    // borrowed `&str` outlives the call.
    let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
}

fn log_level() -> u32 {
    let mut level = LOG_INFO;
    // SAFETY: `level` is a live, aligned u32 on this frame, which the host writes on success
    // only; on an error it keeps its default.
    match unsafe { proxy_get_log_level(&mut level) } {
        OK => level,
        _ => LOG_INFO,
    }
}

fn now_nanos() -> Result<u64, HostError> {
    let mut t = 0u64;
    // SAFETY: `t` is a live, aligned u64 on this frame, which the host writes on success only
    // (an error is returned, and `t` not read).
    check(unsafe { proxy_get_current_time_nanoseconds(&mut t) })?;
    Ok(t)
}

thread_local! {
    /// The last time the host told; the VM is single-threaded, this is one cell.
    static LAST_NOW_MS: Cell<u64> = const { Cell::new(0) };
}

/// The one clock of the filter. A failed read answers the last time read instead of 0: time 0
/// would make every lease look long expired and let a retry take over a live claim.
fn now_ms() -> u64 {
    match now_nanos() {
        Ok(nanos) => {
            let ms = nanos / 1_000_000;
            LAST_NOW_MS.with(|last| last.set(ms));
            ms
        }
        Err(e) => {
            log::warn!("host clock unreadable (status {}); using the last time read", e.0);
            LAST_NOW_MS.with(Cell::get)
        }
    }
}

fn set_tick_period_ms(ms: u32) -> Result<(), HostError> {
    // SAFETY: a plain integer; no memory changes hands.
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

fn buffer(buffer_type: u32, start: usize, max: usize) -> Result<Vec<u8>, HostError> {
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: `data` and `size` are live out-pointers on this frame; the host writes them on
    // success only (and copies at most `max` bytes into memory it allocates itself).
    match unsafe { proxy_get_buffer_bytes(buffer_type, start, max, &mut data, &mut size) } {
        // SAFETY: on OK, `data`/`size` are what the host wrote: null, or its allocation (`take`).
        OK => Ok(unsafe { take(data, size) }.unwrap_or_default()),
        NOT_FOUND => Ok(Vec::new()),
        s => Err(HostError(s)),
    }
}

/// All pairs of a header map, values as raw bytes (they need not be UTF-8).
fn header_map(map_type: u32) -> Result<HeaderMap, HostError> {
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: `data` and `size` are live out-pointers on this frame, written by the host on
    // success only.
    check(unsafe { proxy_get_header_map_pairs(map_type, &mut data, &mut size) })?;
    // SAFETY: reached on OK only (`?` above): `data`/`size` are null, or the host's allocation
    // of the serialized map (`take`).
    let Some(bytes) = (unsafe { take(data, size) }) else { return Ok(HeaderMap::default()) };
    HeaderMap::from_bytes(bytes).ok_or(HostError(u32::MAX))
}

fn header_value(map_type: u32, name: &str) -> Result<Option<Vec<u8>>, HostError> {
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: the host reads `name.len()` bytes of the borrowed name during the call only, and
    // writes the out-pointers `data` and `size` (live on this frame) on success only.
    match unsafe { proxy_get_header_map_value(map_type, name.as_ptr(), name.len(), &mut data, &mut size) } {
        // SAFETY: on OK, `data`/`size` are what the host wrote: null, or its allocation (`take`).
        OK => Ok(unsafe { take(data, size) }),
        NOT_FOUND => Ok(None),
        s => Err(HostError(s)),
    }
}

/// Sets a header (replacing every value it had).
fn set_header(map_type: u32, name: &str, value: &[u8]) -> Result<(), HostError> {
    // SAFETY: two pointer/length pairs of borrowed bytes, which the host copies during the call
    // and never keeps; both borrows outlive the call.
    check(unsafe {
        proxy_replace_header_map_value(map_type, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

fn remove_header(map_type: u32, name: &str) -> Result<(), HostError> {
    // SAFETY: the host reads `name.len()` bytes of the borrowed name during the call only.
    check(unsafe { proxy_remove_header_map_value(map_type, name.as_ptr(), name.len()) })
}

/// A property by path parts (`["response", "code_details"]`). None when absent.
fn property(path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
    let serialized = path.join("\0");
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: the host reads the serialized path (owned here, alive past the call) during the
    // call only, and writes the out-pointers `data` and `size` (live on this frame) on success.
    match unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) } {
        // SAFETY: on OK, `data`/`size` are what the host wrote: null, or its allocation (`take`).
        OK => Ok(unsafe { take(data, size) }),
        NOT_FOUND => Ok(None),
        s => Err(HostError(s)),
    }
}

fn set_property(name: &str, value: &[u8]) -> Result<(), HostError> {
    // SAFETY: two pointer/length pairs of borrowed bytes, which the host copies during the call
    // and never keeps.
    check(unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) })
}

fn send_response(
    status: u16,
    details: &str,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> Result<(), HostError> {
    let map = encode_pairs(headers);
    // SAFETY: the details, the body (null with length 0 when empty, as the ABI spells "none")
    // and the serialized header map are pointer/length pairs alive past the call, which the host
    // copies into its reply during the call; -1 is "no gRPC status".
    check(unsafe {
        proxy_send_local_response(
            u32::from(status),
            details.as_ptr(),
            details.len(),
            if body.is_empty() { null() } else { body.as_ptr() },
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    })
}

/// Resumes the held request of the effective context (see `set_effective_context`).
fn resume_request() -> Result<(), HostError> {
    // SAFETY: a plain integer; no memory changes hands (the host refuses a context not paused).
    check(unsafe { proxy_continue_stream(STREAM_HTTP_REQUEST) })
}

/// Resumes the held response of the effective context.
fn resume_response() -> Result<(), HostError> {
    // SAFETY: a plain integer; no memory changes hands (the host refuses a context not paused).
    check(unsafe { proxy_continue_stream(STREAM_HTTP_RESPONSE) })
}

/// Makes later calls in this callback act on another context of this VM; fails (without harm)
/// when that context is gone, e.g. its client went away.
fn set_effective_context(context_id: u32) -> Result<(), HostError> {
    // SAFETY: a plain integer; the host looks the id up and answers an error for one it does
    // not know, changing nothing.
    check(unsafe { proxy_set_effective_context(context_id) })
}

fn register_queue(name: &str) -> Result<u32, HostError> {
    let mut id = 0u32;
    // SAFETY: the host reads the borrowed name during the call only, and writes `id` (a live,
    // aligned u32 on this frame) on success only.
    check(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// The queue's id, or None when no VM of this vm_id registered that name.
fn resolve_queue(name: &str) -> Result<Option<u32>, HostError> {
    let mut id = 0u32;
    // An empty vm_id means this plugin's own vm_id.
    // SAFETY: the vm_id is null with length 0 (nothing to read), the name a borrowed slice the
    // host reads during the call only; it writes `id` (live on this frame) on success only.
    match unsafe { proxy_resolve_shared_queue(null(), 0, name.as_ptr(), name.len(), &mut id) } {
        OK => Ok(Some(id)),
        NOT_FOUND => Ok(None),
        s => Err(HostError(s)),
    }
}

fn enqueue(queue_id: u32, message: &[u8]) -> Result<(), HostError> {
    // SAFETY: the host copies the borrowed message into the queue during the call and never
    // keeps the pointer.
    check(unsafe { proxy_enqueue_shared_queue(queue_id, message.as_ptr(), message.len()) })
}

/// The next message, None when the queue is empty.
fn dequeue(queue_id: u32) -> Result<Option<Vec<u8>>, HostError> {
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: `data` and `size` are live out-pointers on this frame, written by the host when it
    // hands a message over (OK) and left alone on EMPTY or an error.
    match unsafe { proxy_dequeue_shared_queue(queue_id, &mut data, &mut size) } {
        // SAFETY: on OK, `data`/`size` are what the host wrote: null, or its allocation (`take`).
        OK => Ok(Some(unsafe { take(data, size) }.unwrap_or_default())),
        EMPTY => Ok(None),
        s => Err(HostError(s)),
    }
}

fn define_counter(name: &str) -> Result<u32, HostError> {
    let mut id = 0u32;
    // SAFETY: the host reads the borrowed name during the call only, and writes `id` (a live,
    // aligned u32 on this frame) on success only.
    check(unsafe { proxy_define_metric(METRIC_COUNTER, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

fn define_gauge(name: &str) -> Result<u32, HostError> {
    let mut id = 0u32;
    // SAFETY: the host reads the borrowed name during the call only, and writes `id` (a live,
    // aligned u32 on this frame) on success only.
    check(unsafe { proxy_define_metric(METRIC_GAUGE, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

fn set_gauge(name: &str, value: u64) -> Result<(), HostError> {
    let mut id = 0u32;
    // SAFETY: the host reads the borrowed name during the call only, and writes `id` (a live,
    // aligned u32 on this frame) on success only.
    check(unsafe { proxy_define_metric(METRIC_GAUGE, name.as_ptr(), name.len(), &mut id) })?;
    // SAFETY: plain integers; the host refuses an id it does not know.
    check(unsafe { proxy_record_metric(id, value) })
}

thread_local! {
    // One VM per worker thread: this is the worker's batch, whichever root flushes it (metric
    // ids belong to the VM, not to a root).
    static METRICS: RefCell<MetricBatch> = RefCell::new(MetricBatch::default());
}

fn flush_metrics() {
    let batch = METRICS.with(|m| m.try_borrow_mut().map(|mut m| m.take()).unwrap_or_default());
    for (metric, by) in batch {
        // A lost increment is not worth failing anything for.
        // SAFETY: plain integers; the host refuses an id it does not know.
        let _ = unsafe { proxy_increment_metric(metric, by) };
    }
}

/// Answered through `proxy_on_http_call_response` of the calling context (glue/abi.rs). Envoy
/// refuses with BadArgument an unknown cluster or a missing pseudo-header.
fn dispatch_http_call(
    cluster: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
    timeout_ms: u32,
) -> Result<u32, HostError> {
    let pairs: Vec<(String, Vec<u8>)> = headers.iter().map(|(n, v)| ((*n).to_string(), v.to_vec())).collect();
    let headers = encode_pairs(&pairs);
    let mut token = 0u32;
    // SAFETY: the cluster name, the serialized headers and the body are pointer/length pairs
    // alive past the call, which the host copies into its request during the call; the trailers
    // are null with length 0 (none). `token` is a live u32 on this frame, written on success.
    let status = unsafe {
        proxy_http_call(
            cluster.as_ptr(),
            cluster.len(),
            headers.as_ptr(),
            headers.len(),
            body.as_ptr(),
            body.len(),
            null(),
            0,
            timeout_ms,
            &mut token,
        )
    };
    check(status).map(|()| token)
}

/// Answered through `proxy_on_grpc_receive` / `proxy_on_grpc_close` of the calling context.
fn open_grpc_stream(
    service: &[u8],
    service_name: &str,
    method: &str,
    metadata: &[(String, Vec<u8>)],
) -> Result<u32, HostError> {
    let metadata = encode_pairs(metadata);
    let mut token = 0u32;
    // SAFETY: the service, service name, method and serialized metadata are pointer/length pairs
    // alive past the call, which the host copies during the call; `token` is a live u32 on this
    // frame, written on success.
    let status = unsafe {
        proxy_grpc_stream(
            service.as_ptr(),
            service.len(),
            service_name.as_ptr(),
            service_name.len(),
            method.as_ptr(),
            method.len(),
            metadata.as_ptr(),
            metadata.len(),
            &mut token,
        )
    };
    check(status).map(|()| token)
}

/// Envoy, through the raw ABI; its shared data is this plugin's vm_id's.
#[derive(Debug, Clone, Copy, Default)]
pub struct AbiHost;

impl Host for AbiHost {
    fn now_ms(&self) -> u64 {
        now_ms()
    }
    fn log_level(&self) -> u32 {
        log_level()
    }
    fn log_critical(&self, message: &str) {
        log(LOG_CRITICAL, message)
    }
    fn set_tick_period_ms(&self, ms: u32) -> Result<(), HostError> {
        set_tick_period_ms(ms)
    }
    fn done(&self) -> Result<(), HostError> {
        // SAFETY: no arguments and no memory; the host acts on the calling root context.
        check(unsafe { proxy_done() })
    }
    fn buffer(&self, buffer_type: u32, start: usize, max: usize) -> Result<Vec<u8>, HostError> {
        buffer(buffer_type, start, max)
    }
    fn header_map(&self, map_type: u32) -> Result<HeaderMap, HostError> {
        header_map(map_type)
    }
    fn header_value(&self, map_type: u32, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        header_value(map_type, name)
    }
    fn set_header(&self, map_type: u32, name: &str, value: &[u8]) -> Result<(), HostError> {
        set_header(map_type, name, value)
    }
    fn remove_header(&self, map_type: u32, name: &str) -> Result<(), HostError> {
        remove_header(map_type, name)
    }
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        property(path)
    }
    fn set_property(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        set_property(name, value)
    }
    fn send_response(
        &self,
        status: u16,
        details: &str,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) -> Result<(), HostError> {
        send_response(status, details, headers, body)
    }
    fn resume_request(&self) -> Result<(), HostError> {
        resume_request()
    }
    fn resume_response(&self) -> Result<(), HostError> {
        resume_response()
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        set_effective_context(context_id)
    }
    fn register_queue(&self, name: &str) -> Result<u32, HostError> {
        register_queue(name)
    }
    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, HostError> {
        resolve_queue(name)
    }
    fn enqueue(&self, queue_id: u32, message: &[u8]) -> Result<(), HostError> {
        enqueue(queue_id, message)
    }
    fn dequeue(&self, queue_id: u32) -> Result<Option<Vec<u8>>, HostError> {
        dequeue(queue_id)
    }
    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        define_counter(name)
    }
    fn set_gauge(&self, name: &str, value: u64) -> Result<(), HostError> {
        set_gauge(name, value)
    }
    fn define_gauge(&self, name: &str) -> Result<u32, HostError> {
        define_gauge(name)
    }
    fn record_gauge(&self, id: u32, value: u64) -> Result<(), HostError> {
        // SAFETY: plain integers; the host refuses an id it does not know.
        check(unsafe { proxy_record_metric(id, value) })
    }
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, HostError> {
        dispatch_http_call(cluster, headers, body, timeout_ms)
    }
    fn open_grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(String, Vec<u8>)],
    ) -> Result<u32, HostError> {
        open_grpc_stream(service, service_name, method, metadata)
    }
    fn send_grpc_message(&self, token: u32, message: &[u8]) -> Result<(), HostError> {
        // SAFETY: the host copies the borrowed message onto the stream during the call and never
        // keeps the pointer; an unknown token is refused.
        check(unsafe { proxy_grpc_send(token, message.as_ptr(), message.len(), 0) })
    }
    fn cancel_grpc_stream(&self, token: u32) -> Result<(), HostError> {
        // SAFETY: a plain integer; an unknown token is refused.
        check(unsafe { proxy_grpc_cancel(token) })
    }
    fn increment(&self, metric: u32, by: i64) {
        METRICS.with(|m| {
            if let Ok(mut m) = m.try_borrow_mut() {
                m.add(metric, by)
            }
        })
    }
    fn flush_metrics(&self) {
        flush_metrics()
    }
}

impl SharedData for AbiHost {
    fn get(&self, data_key: &str) -> Result<Read, SharedDataError> {
        let mut data = null_mut();
        let mut size = 0usize;
        let mut cas = 0u32;
        // SAFETY: the host reads the borrowed key during the call only, and writes the three
        // out-pointers (`data`, `size`, `cas`, live on this frame) on success only.
        match unsafe {
            proxy_get_shared_data(data_key.as_ptr(), data_key.len(), &mut data, &mut size, &mut cas)
        } {
            // SAFETY: on OK, `data`/`size` are what the host wrote: null, or its allocation of
            // a copy of the value (`take`).
            OK => Ok(Read { value: unsafe { take(data, size) }, cas: (cas != 0).then_some(cas as Cas) }),
            NOT_FOUND => Ok(Read::default()),
            s => Err(SharedDataError::Host(s)),
        }
    }

    fn set(&self, data_key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), SharedDataError> {
        let ptr = if value.is_empty() { null() } else { value.as_ptr() };
        // SAFETY: the key and the value (null with length 0 when empty) are borrowed
        // pointer/length pairs the host copies into shared data during the call and never keeps.
        match unsafe {
            proxy_set_shared_data(data_key.as_ptr(), data_key.len(), ptr, value.len(), cas.unwrap_or(0))
        } {
            OK => Ok(()),
            CAS_MISMATCH => Err(SharedDataError::CasMismatch),
            s => Err(SharedDataError::Host(s)),
        }
    }
}

/// Routes the `log` facade (used by the engine) to Envoy's log.
pub struct HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }
    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace | log::Level::Debug => LOG_DEBUG,
            log::Level::Info => LOG_INFO,
            log::Level::Warn => LOG_WARN,
            log::Level::Error => LOG_ERROR,
        };
        log(level, &record.args().to_string());
    }
    fn flush(&self) {}
}
