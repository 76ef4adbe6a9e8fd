//! The host seam: every call the filter makes into Envoy, as the `Host` trait (each status a
//! `Result`, one clock), and Envoy's header maps as pairs (`pairs.rs`). The worker (`src/worker/`)
//! is written against it, so it compiles natively and `cargo test` drives its callbacks against a
//! fake host (`fake.rs`: shared data with Envoy's rules, records every call, injects failures);
//! the raw ABI behind it is `src/glue/` (wasm32 only).

pub mod pairs;

#[cfg(test)]
pub mod fake;

use crate::store::shared_data::SharedData;

/// A host call the host refused, with its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError(pub u32);

pub const MAP_REQUEST_HEADERS: u32 = 0;
pub const MAP_RESPONSE_HEADERS: u32 = 2;
pub const MAP_HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
pub const MAP_HTTP_CALL_RESPONSE_TRAILERS: u32 = 7;
pub const BUFFER_REQUEST_BODY: u32 = 0;
pub const BUFFER_RESPONSE_BODY: u32 = 1;
pub const BUFFER_HTTP_CALL_RESPONSE_BODY: u32 = 4;
pub const BUFFER_GRPC_RECEIVE: u32 = 5;
pub const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;

pub const LOG_TRACE: u32 = 0;
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;

/// The host calls the worker makes, each status as a `Result` (none may panic). Shared data comes
/// with it: the store and the wake registry live there.
pub trait Host: SharedData + Clone + 'static {
    /// The filter's one clock, in milliseconds. Never fails: what a failed clock read means is
    /// decided once, by the implementation.
    fn now_ms(&self) -> u64;
    fn log_level(&self) -> u32;
    /// A line that must reach the log whatever the log level (a refused configuration).
    fn log_critical(&self, message: &str);
    fn set_tick_period_ms(&self, ms: u32) -> Result<(), HostError>;
    fn buffer(&self, buffer_type: u32, start: usize, max: usize) -> Result<Vec<u8>, HostError>;
    /// A whole header map in one call, read in place (`pairs::HeaderMap`).
    fn header_map(&self, map_type: u32) -> Result<pairs::HeaderMap, HostError>;
    fn header_pairs(&self, map_type: u32) -> Result<Vec<(String, Vec<u8>)>, HostError> {
        Ok(self.header_map(map_type)?.pairs())
    }
    fn header_value(&self, map_type: u32, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    /// Sets a header (replacing every value it had).
    fn set_header(&self, map_type: u32, name: &str, value: &[u8]) -> Result<(), HostError>;
    fn remove_header(&self, map_type: u32, name: &str) -> Result<(), HostError>;
    /// A property by path parts (`["response", "code_details"]`). None when absent.
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError>;
    /// Sets the effective stream's filter state `wasm.<name>` (Envoy 1.40: a CelState of
    /// bytes, what `%FILTER_STATE(wasm.<name>:PLAIN)%` prints in an access log).
    fn set_property(&self, name: &str, value: &[u8]) -> Result<(), HostError>;
    fn send_response(
        &self,
        status: u16,
        details: &str,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) -> Result<(), HostError>;
    /// Resumes the held request of the effective context (see `set_effective_context`).
    fn resume_request(&self) -> Result<(), HostError>;
    /// Resumes the held response of the effective context.
    fn resume_response(&self) -> Result<(), HostError>;
    /// Makes later calls in this callback act on another context of this VM; fails (without
    /// harm) when that context is gone, e.g. its client went away.
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError>;
    fn register_queue(&self, name: &str) -> Result<u32, HostError>;
    /// The queue's id, or None when no VM of this vm_id registered that name.
    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, HostError>;
    fn enqueue(&self, queue_id: u32, message: &[u8]) -> Result<(), HostError>;
    /// The next message, None when the queue is empty.
    fn dequeue(&self, queue_id: u32) -> Result<Option<Vec<u8>>, HostError>;
    fn define_counter(&self, name: &str) -> Result<u32, HostError>;
    /// Defines the gauge `name` and sets it to `value` (two host calls): for a value set once,
    /// when a root starts (`build_info`), never per request.
    fn set_gauge(&self, name: &str, value: u64) -> Result<(), HostError>;
    /// Defines the gauge `name` and answers its id, for a gauge set again and again
    /// (`record_gauge`): define it once per VM, since every definition is an id of its own.
    fn define_gauge(&self, name: &str) -> Result<u32, HostError>;
    /// Sets a gauge `define_gauge` defined (one host call).
    fn record_gauge(&self, id: u32, value: u64) -> Result<(), HostError>;
    /// Starts an HTTP callout on `cluster`; its answer comes to `on_http_call_response` of the
    /// context that dispatched it, with this token. Refused (BadArgument) when the cluster is
    /// unknown or a pseudo-header is missing. `timeout_ms` 0 would mean none: never pass it.
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, HostError>;
    /// Opens a gRPC stream (`service` a serialized GrpcService); its messages and its end come
    /// to `on_grpc_receive` / `on_grpc_close` of the root context, with this token, whichever
    /// context is the effective one (proxy-wasm's grpc_stream, grpc_send and grpc_cancel all act
    /// on `root_context()`).
    fn open_grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(String, Vec<u8>)],
    ) -> Result<u32, HostError>;
    /// Sends one message on an open stream (Envoy adds the gRPC frame).
    fn send_grpc_message(&self, token: u32, message: &[u8]) -> Result<(), HostError>;
    /// Ends a stream from this side (Envoy still reports its close).
    fn cancel_grpc_stream(&self, token: u32) -> Result<(), HostError>;
    /// Adds to a counter in this worker's `MetricBatch`, not a host call: Envoy sees it at the
    /// next `flush_metrics` (the root's tick, at most 100 ms later; Prometheus scrapes at
    /// seconds), so a request's counters cost no crossing.
    fn increment(&self, metric: u32, by: i64);
    /// Hands the batch to Envoy: one `proxy_increment_metric` per counter that grew. A lost
    /// increment is not worth failing anything for: no result.
    fn flush_metrics(&self);
    /// Tells Envoy that this root, which answered `on_done` with false, has finished what it
    /// was carrying (`proxy_done`): Envoy deletes it after the current callback.
    fn done(&self) -> Result<(), HostError>;
}

/// Follows Envoy's log level for the wasm component, so that debug lines are not even formatted
/// unless someone asked for them.
pub fn log_filter(host_level: u32) -> log::LevelFilter {
    match host_level {
        LOG_TRACE => log::LevelFilter::Trace,
        LOG_DEBUG => log::LevelFilter::Debug,
        LOG_INFO => log::LevelFilter::Info,
        LOG_WARN => log::LevelFilter::Warn,
        LOG_ERROR => log::LevelFilter::Error,
        _ => log::LevelFilter::Off,
    }
}

/// Counter increments not yet handed to Envoy, by metric id. A worker touches a handful of
/// counters between two ticks, so a short list searched in order is all it needs.
#[derive(Debug, Default)]
pub struct MetricBatch(Vec<(u32, i64)>);

impl MetricBatch {
    pub fn add(&mut self, metric: u32, by: i64) {
        if by <= 0 {
            // Counters only grow, and Envoy is never asked to add 0.
            return;
        }
        match self.0.iter_mut().find(|(id, _)| *id == metric) {
            Some((_, sum)) => *sum = sum.saturating_add(by),
            None => self.0.push((metric, by)),
        }
    }

    /// What to hand to Envoy, each counter once; the batch starts again empty.
    pub fn take(&mut self) -> Vec<(u32, i64)> {
        std::mem::take(&mut self.0)
    }

    /// What is waiting for `metric`.
    #[cfg(test)]
    pub fn pending(&self, metric: u32) -> i64 {
        self.0.iter().find(|(id, _)| *id == metric).map_or(0, |(_, sum)| *sum)
    }
}
