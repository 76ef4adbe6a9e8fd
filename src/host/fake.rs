//! A host for native tests of the worker: Envoy's shared data (the fake with its rules), header
//! maps, buffers and properties a test sets, queues and counters, a record of every call that
//! changes something, and failures injected per call.

use super::{Host, HostError, MAP_REQUEST_HEADERS};
use crate::store::fake::FakeSharedData;
use crate::store::shared_data::{Cas, Read, SharedData, SharedDataError};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostCall {
    SendResponse {
        context: u32,
        status: u16,
        details: String,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    },
    Resume {
        context: u32,
    },
    ResumeResponse {
        context: u32,
    },
    /// Filter state set on the effective context's stream.
    SetProperty {
        context: u32,
        name: String,
        value: String,
    },
    SetHeader {
        name: String,
        value: Vec<u8>,
    },
    RemoveHeader {
        name: String,
    },
    Critical(String),
    /// A callout, made while `context` was the effective context.
    Dispatch {
        context: u32,
        token: u32,
        cluster: String,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        timeout_ms: u32,
    },
    /// `proxy_done`: a root that had asked to wait is finished.
    Done,
    /// A gRPC stream opened (Envoy gives it to the root context, whichever context is the
    /// effective one: proxy-wasm's grpc_stream takes `root_context()`).
    GrpcStream {
        token: u32,
        service: Vec<u8>,
        method: String,
        metadata: Vec<(String, Vec<u8>)>,
    },
    GrpcSend {
        token: u32,
        message: Vec<u8>,
    },
    GrpcCancel {
        token: u32,
    },
}

#[derive(Default)]
pub struct Inner {
    pub(crate) data: FakeSharedData,
    pub now_ms: Cell<u64>,
    /// The root's tick period, as last set.
    pub tick_ms: Cell<u32>,
    pub config: RefCell<Vec<u8>>,
    pub request_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub request_body: RefCell<Vec<u8>>,
    pub response_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub response_body: RefCell<Vec<u8>>,
    pub properties: RefCell<HashMap<String, Vec<u8>>>,
    /// The message `on_grpc_receive` reads.
    pub grpc_message: RefCell<Vec<u8>>,
    /// The answer `on_http_call_response` reads (headers, body).
    pub call_response_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub call_response_trailers: RefCell<Vec<(String, Vec<u8>)>>,
    pub call_response_body: RefCell<Vec<u8>>,
    /// Clusters the fake Envoy knows; a callout elsewhere is refused with BadArgument.
    pub clusters: RefCell<Vec<String>>,
    tokens: Cell<u32>,
    /// Host calls (by method name) that fail with this status.
    pub failing: RefCell<HashMap<&'static str, u32>>,
    /// Streams that have ended: Envoy refuses them as the effective context (BadArgument).
    pub gone: RefCell<Vec<u32>>,
    pub calls: RefCell<Vec<HostCall>>,
    pub(crate) queues: RefCell<Vec<(String, VecDeque<Vec<u8>>)>>,
    metrics: RefCell<Vec<(String, i64)>>,
    /// Gauges by name, as last set.
    gauges: RefCell<Vec<(String, u64)>>,
    /// Gauges `define_gauge` defined, by id.
    gauge_ids: RefCell<Vec<String>>,
    /// `increment`s made (into the batch: what counting costs is in the flush).
    pub increments: Cell<u32>,
    batch: RefCell<super::MetricBatch>,
    pub(crate) effective: Cell<u32>,
    /// Host calls by method: (calls, bytes copied across the boundary either way). What a
    /// request costs in host calls is a property of the code, so tests can bound it exactly.
    pub tally: RefCell<std::collections::BTreeMap<&'static str, (u64, u64)>>,
}

#[derive(Clone, Default)]
pub struct FakeHost(pub Rc<Inner>);

impl FakeHost {
    fn note(&self, call: &'static str, bytes: usize) {
        let mut tally = self.0.tally.borrow_mut();
        let entry = tally.entry(call).or_default();
        entry.0 += 1;
        entry.1 += bytes as u64;
    }

    /// Host calls made so far (calls, bytes) in total, and the tally cleared.
    pub fn take_tally(&self) -> std::collections::BTreeMap<&'static str, (u64, u64)> {
        std::mem::take(&mut *self.0.tally.borrow_mut())
    }

    fn fails(&self, call: &'static str) -> Result<(), HostError> {
        match self.0.failing.borrow().get(call) {
            Some(status) => Err(HostError(*status)),
            None => Ok(()),
        }
    }

    pub fn fail(&self, call: &'static str, status: u32) {
        self.0.failing.borrow_mut().insert(call, status);
    }

    /// An outcome over every rule, as Envoy shows it after the next flush (what was counted,
    /// flushed or not): the sum of the rules' counters, as PromQL's `sum by (outcome)`, plus,
    /// for `passed_through`, the requests no rule matched.
    pub fn counter(&self, name: &str) -> i64 {
        self.outcome_sum(name, true)
    }

    /// The same as Envoy shows it now: only what a flush handed over.
    pub fn flushed_counter(&self, name: &str) -> i64 {
        self.outcome_sum(name, false)
    }

    fn outcome_sum(&self, name: &str, with_pending: bool) -> i64 {
        let tail = format!(".requests_total.{name}");
        // Each root defines its own ids; `metric` reads a name's first one, as before.
        let mut names: Vec<String> = self.0.metrics.borrow().iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        names.dedup();
        let mut sum: i64 = names
            .iter()
            .filter(|n| n.starts_with("idempotency.route.") && n.ends_with(&tail))
            .map(|n| self.metric(n, with_pending))
            .sum();
        if name == "passed_through" {
            sum += self.metric(crate::metrics::UNMATCHED_METRIC, with_pending);
        }
        sum
    }

    /// A route rule's counter `idempotency.route.<rule>.requests_total.<outcome>`, flushed or
    /// not.
    pub fn route_counter(&self, rule: &str, name: &str) -> i64 {
        self.metric(&format!("idempotency.route.{rule}.requests_total.{name}"), true)
    }

    /// A counter of no rule (`metrics::*_METRIC`), flushed or not; `None` while undefined.
    pub fn plain_counter(&self, full: &str) -> Option<i64> {
        let defined = self.0.metrics.borrow().iter().any(|(n, _)| n == full);
        defined.then(|| self.metric(full, true))
    }

    fn metric(&self, full: &str, with_pending: bool) -> i64 {
        let metrics = self.0.metrics.borrow();
        let Some(id) = metrics.iter().position(|(n, _)| n == full) else { return 0 };
        let pending = if with_pending { self.0.batch.borrow().pending(id as u32) } else { 0 };
        metrics[id].1 + pending
    }

    /// A gauge as last set; `None` while undefined.
    pub fn gauge(&self, name: &str) -> Option<u64> {
        self.0.gauges.borrow().iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    /// Metrics defined so far.
    pub fn metrics_defined(&self) -> usize {
        self.0.metrics.borrow().len()
    }

    pub fn replies(&self) -> Vec<(u32, u16, String)> {
        self.0
            .calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                HostCall::SendResponse { context, status, details, .. } => {
                    Some((*context, *status, details.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Sets the map Envoy would show (pseudo-headers included).
    fn map(&self, map_type: u32) -> &RefCell<Vec<(String, Vec<u8>)>> {
        match map_type {
            MAP_REQUEST_HEADERS => &self.0.request_headers,
            super::MAP_HTTP_CALL_RESPONSE_HEADERS => &self.0.call_response_headers,
            super::MAP_HTTP_CALL_RESPONSE_TRAILERS => &self.0.call_response_trailers,
            _ => &self.0.response_headers,
        }
    }

    /// The callouts made so far.
    pub fn dispatches(&self) -> Vec<HostCall> {
        self.0.calls.borrow().iter().filter(|c| matches!(c, HostCall::Dispatch { .. })).cloned().collect()
    }
}

impl SharedData for FakeHost {
    fn get(&self, data_key: &str) -> Result<Read, SharedDataError> {
        let read = self.0.data.get(data_key);
        self.note(
            "get_shared_data",
            data_key.len() + read.as_ref().map_or(0, |r| r.value.as_ref().map_or(0, Vec::len)),
        );
        read
    }
    fn set(&self, data_key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), SharedDataError> {
        self.note("set_shared_data", data_key.len() + value.len());
        self.0.data.set(data_key, value, cas)
    }
}

impl Host for FakeHost {
    fn now_ms(&self) -> u64 {
        self.note("now_ms", 0);
        self.0.now_ms.get()
    }
    fn log_level(&self) -> u32 {
        super::LOG_INFO
    }
    fn log_critical(&self, message: &str) {
        self.0.calls.borrow_mut().push(HostCall::Critical(message.to_string()));
    }
    fn set_tick_period_ms(&self, ms: u32) -> Result<(), HostError> {
        self.fails("set_tick_period_ms")?;
        self.0.tick_ms.set(ms);
        Ok(())
    }
    fn buffer(&self, buffer_type: u32, start: usize, max: usize) -> Result<Vec<u8>, HostError> {
        self.fails("buffer")?;
        self.note("buffer", max.min(1 << 20));
        let source = match buffer_type {
            super::BUFFER_PLUGIN_CONFIGURATION => self.0.config.borrow().clone(),
            super::BUFFER_REQUEST_BODY => self.0.request_body.borrow().clone(),
            super::BUFFER_HTTP_CALL_RESPONSE_BODY => self.0.call_response_body.borrow().clone(),
            super::BUFFER_GRPC_RECEIVE => self.0.grpc_message.borrow().clone(),
            _ => self.0.response_body.borrow().clone(),
        };
        Ok(source.into_iter().skip(start).take(max).collect())
    }
    fn header_map(&self, map_type: u32) -> Result<super::pairs::HeaderMap, HostError> {
        self.fails("header_pairs")?;
        let map = self.map(map_type).borrow().clone();
        self.note("header_pairs", map.iter().map(|(n, v)| n.len() + v.len()).sum());
        Ok(super::pairs::HeaderMap::from_pairs(&map))
    }
    fn header_value(&self, map_type: u32, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.fails("header_value")?;
        self.note("header_value", name.len());
        Ok(self.map(map_type).borrow().iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()))
    }
    fn set_header(&self, map_type: u32, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.fails("set_header")?;
        self.note("set_header", name.len() + value.len());
        let mut map = self.map(map_type).borrow_mut();
        map.retain(|(n, _)| n != name);
        map.push((name.to_string(), value.to_vec()));
        self.0.calls.borrow_mut().push(HostCall::SetHeader { name: name.to_string(), value: value.to_vec() });
        Ok(())
    }
    fn remove_header(&self, map_type: u32, name: &str) -> Result<(), HostError> {
        self.fails("remove_header")?;
        self.note("remove_header", name.len());
        self.map(map_type).borrow_mut().retain(|(n, _)| n != name);
        self.0.calls.borrow_mut().push(HostCall::RemoveHeader { name: name.to_string() });
        Ok(())
    }
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        self.fails("property")?;
        self.note("property", path.iter().map(|p| p.len() + 1).sum());
        Ok(self.0.properties.borrow().get(&path.join(".")).cloned())
    }
    fn set_property(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.fails("set_property")?;
        self.note("set_property", name.len() + value.len());
        let context = self.0.effective.get();
        self.0.calls.borrow_mut().push(HostCall::SetProperty {
            context,
            name: name.to_string(),
            value: String::from_utf8_lossy(value).into_owned(),
        });
        Ok(())
    }
    fn send_response(
        &self,
        status: u16,
        details: &str,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) -> Result<(), HostError> {
        self.fails("send_response")?;
        self.note(
            "send_response",
            body.len() + headers.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>(),
        );
        self.0.calls.borrow_mut().push(HostCall::SendResponse {
            context: self.0.effective.get(),
            status,
            details: details.to_string(),
            headers: headers.to_vec(),
            body: body.to_vec(),
        });
        Ok(())
    }
    fn resume_request(&self) -> Result<(), HostError> {
        self.fails("resume_request")?;
        self.note("resume_request", 0);
        self.0.calls.borrow_mut().push(HostCall::Resume { context: self.0.effective.get() });
        Ok(())
    }
    fn resume_response(&self) -> Result<(), HostError> {
        self.fails("resume_response")?;
        self.0.calls.borrow_mut().push(HostCall::ResumeResponse { context: self.0.effective.get() });
        Ok(())
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        self.fails("set_effective_context")?;
        if self.0.gone.borrow().contains(&context_id) {
            return Err(HostError(2));
        }
        self.note("set_effective_context", 0);
        self.0.effective.set(context_id);
        Ok(())
    }
    fn register_queue(&self, name: &str) -> Result<u32, HostError> {
        self.fails("register_queue")?;
        let mut queues = self.0.queues.borrow_mut();
        queues.push((name.to_string(), VecDeque::new()));
        Ok(queues.len() as u32 - 1)
    }
    fn resolve_queue(&self, name: &str) -> Result<Option<u32>, HostError> {
        Ok(self.0.queues.borrow().iter().position(|(n, _)| n == name).map(|i| i as u32))
    }
    fn enqueue(&self, queue_id: u32, message: &[u8]) -> Result<(), HostError> {
        let mut queues = self.0.queues.borrow_mut();
        let (_, q) = queues.get_mut(queue_id as usize).ok_or(HostError(1))?;
        q.push_back(message.to_vec());
        Ok(())
    }
    fn dequeue(&self, queue_id: u32) -> Result<Option<Vec<u8>>, HostError> {
        let mut queues = self.0.queues.borrow_mut();
        let (_, q) = queues.get_mut(queue_id as usize).ok_or(HostError(1))?;
        Ok(q.pop_front())
    }
    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        let mut metrics = self.0.metrics.borrow_mut();
        metrics.push((name.to_string(), 0));
        Ok(metrics.len() as u32 - 1)
    }
    fn define_gauge(&self, name: &str) -> Result<u32, HostError> {
        self.fails("define_gauge")?;
        // Not tallied, as `define_counter`: both run once, at configure.
        let mut defined = self.0.gauge_ids.borrow_mut();
        defined.push(name.to_string());
        Ok(defined.len() as u32 - 1)
    }
    fn record_gauge(&self, id: u32, value: u64) -> Result<(), HostError> {
        self.note("record_metric", 0);
        let name = self.0.gauge_ids.borrow().get(id as usize).cloned().ok_or(HostError(1))?;
        let mut gauges = self.0.gauges.borrow_mut();
        match gauges.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = value,
            None => gauges.push((name, value)),
        }
        Ok(())
    }
    fn set_gauge(&self, name: &str, value: u64) -> Result<(), HostError> {
        self.fails("set_gauge")?;
        self.note("define_metric", name.len());
        self.note("record_metric", 0);
        let mut gauges = self.0.gauges.borrow_mut();
        match gauges.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = value,
            None => gauges.push((name.to_string(), value)),
        }
        Ok(())
    }
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, HostError> {
        self.fails("dispatch_http_call")?;
        let has = |name: &str| headers.iter().any(|(n, _)| *n == name);
        // Envoy's rules: a known cluster, the three pseudo-headers, else BadArgument.
        let known = self.0.clusters.borrow().iter().any(|c| c == cluster);
        if !(known && has(":method") && has(":path") && has(":authority")) {
            return Err(HostError(2));
        }
        let token = self.0.tokens.get() + 1;
        self.0.tokens.set(token);
        self.0.calls.borrow_mut().push(HostCall::Dispatch {
            context: self.0.effective.get(),
            token,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v).into_owned()))
                .collect(),
            body: body.to_vec(),
            timeout_ms,
        });
        Ok(token)
    }
    fn open_grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(String, Vec<u8>)],
    ) -> Result<u32, HostError> {
        self.fails("grpc_stream")?;
        let token = self.0.tokens.get() + 1;
        self.0.tokens.set(token);
        self.0.calls.borrow_mut().push(HostCall::GrpcStream {
            token,
            service: service.to_vec(),
            method: format!("{service_name}/{method}"),
            metadata: metadata.to_vec(),
        });
        Ok(token)
    }
    fn send_grpc_message(&self, token: u32, message: &[u8]) -> Result<(), HostError> {
        self.fails("grpc_send")?;
        self.0.calls.borrow_mut().push(HostCall::GrpcSend { token, message: message.to_vec() });
        Ok(())
    }
    fn cancel_grpc_stream(&self, token: u32) -> Result<(), HostError> {
        self.fails("grpc_cancel")?;
        self.0.calls.borrow_mut().push(HostCall::GrpcCancel { token });
        Ok(())
    }
    fn done(&self) -> Result<(), HostError> {
        self.fails("done")?;
        self.0.calls.borrow_mut().push(HostCall::Done);
        Ok(())
    }
    fn increment(&self, metric: u32, by: i64) {
        self.0.increments.set(self.0.increments.get() + 1);
        self.0.batch.borrow_mut().add(metric, by);
    }
    fn flush_metrics(&self) {
        let batch = self.0.batch.borrow_mut().take();
        for (metric, by) in batch {
            self.note("increment_metric", 0);
            if let Some((_, v)) = self.0.metrics.borrow_mut().get_mut(metric as usize) {
                *v += by;
            }
        }
    }
}
