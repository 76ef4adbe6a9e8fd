//! Hand-written bindings to the few parts of Envoy's dynamic-modules ABI this module uses,
//! written from the signatures in `source/extensions/dynamic_modules/abi/abi.h` (read at
//! 0199da4a, just before v1.40.0). Every callback below is checked against the symbols the
//! Envoy 1.40.0 binary exports (`nm -D --defined-only envoy`): Envoy dlopens modules with
//! RTLD_NOW, so a name it lacks fails at load.
//!
//! C enums are `int`-sized on x86_64 Linux: they cross as `u32` here.

use std::ffi::c_void;

/// `envoy_dynamic_module_type_http_filter_envoy_ptr`
pub type FilterEnvoyPtr = *mut c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: EnvoyBuffer = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };

    /// The bytes, valid until the end of the current event hook.
    ///
    /// # Safety
    /// `ptr` must point at `length` readable bytes (or be null).
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr, self.length)
        }
    }
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: bytes.as_ptr(), length: bytes.len() }
    }
}

/// `envoy_dynamic_module_type_module_http_header`
#[repr(C)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl ModuleHttpHeader {
    pub fn of(key: &[u8], value: &[u8]) -> ModuleHttpHeader {
        ModuleHttpHeader {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

// envoy_dynamic_module_type_http_header_type
pub const REQUEST_HEADER: u32 = 0;
pub const RESPONSE_HEADER: u32 = 2;

// envoy_dynamic_module_type_http_body_type
pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const BUFFERED_REQUEST_BODY: u32 = 1;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;
pub const BUFFERED_RESPONSE_BODY: u32 = 3;

// envoy_dynamic_module_type_on_http_filter_request_headers_status (and response_headers_status)
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;

// envoy_dynamic_module_type_on_http_filter_{request,response}_body_status
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
pub const BODY_STOP_ITERATION_NO_BUFFER: u32 = 3;

// envoy_dynamic_module_type_on_http_filter_{request,response}_trailers_status
pub const TRAILERS_CONTINUE: u32 = 0;

extern "C" {
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: u32,
    ) -> usize;

    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: u32,
        result_buffer_vector: *mut EnvoyBuffer,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter_envoy_ptr: FilterEnvoyPtr,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_received_buffered_response_body(
        filter_envoy_ptr: FilterEnvoyPtr,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy_ptr: FilterEnvoyPtr,
        status_code: u32,
        headers_vector: *mut ModuleHttpHeader,
        headers_vector_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
}

/// One value of a header (the first), copied; None if absent.
pub fn header(filter: FilterEnvoyPtr, header_type: u32, key: &[u8]) -> Option<Vec<u8>> {
    if filter.is_null() {
        return None;
    }
    let mut out = EnvoyBuffer::EMPTY;
    let mut count: usize = 0;
    // SAFETY: filter is Envoy's live filter pointer for this hook; out and count are valid.
    let ok = unsafe {
        envoy_dynamic_module_callback_http_get_header(
            filter,
            header_type,
            ModuleBuffer::of(key),
            &mut out,
            0,
            &mut count,
        )
    };
    if !ok || count == 0 || out.ptr.is_null() {
        return None;
    }
    // SAFETY: Envoy filled out with a buffer valid until the end of this hook.
    Some(unsafe { out.as_slice() }.to_vec())
}

/// Appends the chunks of one body (`body_type`) to `into`; false if Envoy has no such body.
pub fn append_body(filter: FilterEnvoyPtr, body_type: u32, into: &mut Vec<u8>) -> bool {
    if filter.is_null() {
        return false;
    }
    // SAFETY: filter is Envoy's live filter pointer for this hook.
    let n = unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(filter, body_type) };
    if n == 0 {
        return false;
    }
    let mut chunks = vec![EnvoyBuffer::EMPTY; n];
    // SAFETY: chunks has room for the n buffers Envoy reported.
    let ok = unsafe { envoy_dynamic_module_callback_http_get_body_chunks(filter, body_type, chunks.as_mut_ptr()) };
    if !ok {
        return false;
    }
    for c in &chunks {
        // SAFETY: each buffer is valid until the end of this hook.
        into.extend_from_slice(unsafe { c.as_slice() });
    }
    true
}

/// The whole body of a direction at its end of stream: what was buffered by earlier
/// StopIterationAndBuffer answers plus the chunk of this call (unless the chunk of this call
/// is that buffer itself, which Envoy says through `received_buffered_*_body`).
pub fn whole_body(filter: FilterEnvoyPtr, request: bool) -> Vec<u8> {
    let mut body = Vec::with_capacity(1024);
    if filter.is_null() {
        return body;
    }
    let (received, buffered) = if request {
        (RECEIVED_REQUEST_BODY, BUFFERED_REQUEST_BODY)
    } else {
        (RECEIVED_RESPONSE_BODY, BUFFERED_RESPONSE_BODY)
    };
    // SAFETY: filter is Envoy's live filter pointer for this hook.
    let received_is_buffered = unsafe {
        if request {
            envoy_dynamic_module_callback_http_received_buffered_request_body(filter)
        } else {
            envoy_dynamic_module_callback_http_received_buffered_response_body(filter)
        }
    };
    if !received_is_buffered {
        append_body(filter, buffered, &mut body);
    }
    append_body(filter, received, &mut body);
    body
}

/// A local reply.
pub fn send_response(filter: FilterEnvoyPtr, status: u32, headers: &[(&[u8], &[u8])], body: &[u8], details: &[u8]) {
    if filter.is_null() {
        return;
    }
    let mut hv: Vec<ModuleHttpHeader> = headers.iter().map(|(k, v)| ModuleHttpHeader::of(k, v)).collect();
    // SAFETY: every pointer refers to bytes that outlive this call.
    unsafe {
        envoy_dynamic_module_callback_http_send_response(
            filter,
            status,
            hv.as_mut_ptr(),
            hv.len(),
            ModuleBuffer::of(body),
            ModuleBuffer::of(details),
        )
    }
}
