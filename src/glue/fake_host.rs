//! A host for native tests of the glue: Envoy's shared data (the fake with its rules), header
//! maps, buffers and properties a test sets, queues and counters, a record of every call that
//! changes something, and failures injected per call.

use super::http::Http;
use super::root::Root;
use super::{Host, HostError, MAP_REQUEST_HEADERS};
use crate::flow::Verdict;
use crate::store::fake::FakeSharedData;
use crate::store::shared_data::{Cas, Read, SharedData, SharedDataError};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
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
}

#[derive(Default)]
pub struct Inner {
    data: FakeSharedData,
    pub now_ms: Cell<u64>,
    pub config: RefCell<Vec<u8>>,
    pub request_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub request_body: RefCell<Vec<u8>>,
    pub response_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub response_body: RefCell<Vec<u8>>,
    pub properties: RefCell<HashMap<String, Vec<u8>>>,
    /// The answer `on_http_call_response` reads (headers, body).
    pub call_response_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub call_response_body: RefCell<Vec<u8>>,
    /// Clusters the fake Envoy knows; a callout elsewhere is refused with BadArgument.
    pub clusters: RefCell<Vec<String>>,
    tokens: Cell<u32>,
    /// Host calls (by method name) that fail with this status.
    pub failing: RefCell<HashMap<&'static str, u32>>,
    /// Streams that have ended: Envoy refuses them as the effective context (BadArgument).
    pub gone: RefCell<Vec<u32>>,
    pub calls: RefCell<Vec<Call>>,
    queues: RefCell<Vec<(String, VecDeque<Vec<u8>>)>>,
    metrics: RefCell<Vec<(String, i64)>>,
    /// `increment`s made (into the batch: what counting costs is in the flush).
    pub increments: Cell<u32>,
    batch: RefCell<super::MetricBatch>,
    effective: Cell<u32>,
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

    /// A counter as Envoy shows it after the next flush (what was counted, flushed or not).
    pub fn counter(&self, name: &str) -> i64 {
        self.metric(&format!("idempotency.requests.{name}"), true)
    }

    /// A counter as Envoy shows it now: only what a flush handed over.
    pub fn flushed_counter(&self, name: &str) -> i64 {
        self.metric(&format!("idempotency.requests.{name}"), false)
    }

    /// A route rule's counter `idempotency.route.<rule>.requests.<outcome>`, flushed or not.
    pub fn route_counter(&self, rule: &str, name: &str) -> i64 {
        self.metric(&format!("idempotency.route.{rule}.requests.{name}"), true)
    }

    fn metric(&self, full: &str, with_pending: bool) -> i64 {
        let metrics = self.0.metrics.borrow();
        let Some(id) = metrics.iter().position(|(n, _)| n == full) else { return 0 };
        let pending = if with_pending { self.0.batch.borrow().pending(id as u32) } else { 0 };
        metrics[id].1 + pending
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
                Call::SendResponse { context, status, details, .. } => {
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
            _ => &self.0.response_headers,
        }
    }

    /// The callouts made so far.
    pub fn dispatches(&self) -> Vec<Call> {
        self.0.calls.borrow().iter().filter(|c| matches!(c, Call::Dispatch { .. })).cloned().collect()
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
        self.0.calls.borrow_mut().push(Call::Critical(message.to_string()));
    }
    fn set_tick_period_ms(&self, _ms: u32) -> Result<(), HostError> {
        self.fails("set_tick_period_ms")
    }
    fn buffer(&self, buffer_type: u32, start: usize, max: usize) -> Result<Vec<u8>, HostError> {
        self.fails("buffer")?;
        self.note("buffer", max.min(1 << 20));
        let source = match buffer_type {
            super::BUFFER_PLUGIN_CONFIGURATION => self.0.config.borrow().clone(),
            super::BUFFER_REQUEST_BODY => self.0.request_body.borrow().clone(),
            super::BUFFER_HTTP_CALL_RESPONSE_BODY => self.0.call_response_body.borrow().clone(),
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
        self.0.calls.borrow_mut().push(Call::SetHeader { name: name.to_string(), value: value.to_vec() });
        Ok(())
    }
    fn remove_header(&self, map_type: u32, name: &str) -> Result<(), HostError> {
        self.fails("remove_header")?;
        self.note("remove_header", name.len());
        self.map(map_type).borrow_mut().retain(|(n, _)| n != name);
        self.0.calls.borrow_mut().push(Call::RemoveHeader { name: name.to_string() });
        Ok(())
    }
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        self.fails("property")?;
        self.note("property", path.iter().map(|p| p.len() + 1).sum());
        Ok(self.0.properties.borrow().get(&path.join(".")).cloned())
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
        self.0.calls.borrow_mut().push(Call::SendResponse {
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
        self.0.calls.borrow_mut().push(Call::Resume { context: self.0.effective.get() });
        Ok(())
    }
    fn resume_response(&self) -> Result<(), HostError> {
        self.fails("resume_response")?;
        self.0.calls.borrow_mut().push(Call::ResumeResponse { context: self.0.effective.get() });
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
        self.0.calls.borrow_mut().push(Call::Dispatch {
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
    fn done(&self) -> Result<(), HostError> {
        self.fails("done")?;
        self.0.calls.borrow_mut().push(Call::Done);
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

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
        {"name":"orders","match":{"prefix":"/orders"},"require_key":true},
        {"name":"waits","match":{"prefix":"/wait"},"require_key":true,"concurrent":"wait"}]}"#;

    // Budgets (issue 20). A new key placed in its primary bucket; one placed in its secondary
    // (a few percent of keys) reads that bucket and confirms the primary: two calls more.
    // Without a quota its counter is neither read nor written.
    const NEW_KEY_HOST_CALLS: u64 = 20;
    const NEW_KEY_HOST_CALLS_WITHOUT_QUOTA: u64 = 18;
    const SECOND_BUCKET_HOST_CALLS: u64 = 2;
    const REPLAY_HOST_CALLS: u64 = 7;
    // What the no-op Wasm filter makes is none: an unprotected request may cost one (`:path`).
    const PASS_THROUGH_HOST_CALLS: u64 = 1;

    fn host() -> FakeHost {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
        h.0.now_ms.set(1_000);
        h
    }

    fn root(h: &FakeHost) -> Root<FakeHost> {
        let mut root = Root::new(1, h.clone());
        assert!(root.on_configure());
        root
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    /// A POST with a key, headers and body in the host, the whole body at once.
    fn post(h: &FakeHost, http: &mut Http<FakeHost>, path: &str, key: &str) -> Verdict {
        *h.0.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", path),
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ]);
        *h.0.request_body.borrow_mut() = b"{}".to_vec();
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        http.on_request_body(2, true)
    }

    /// An upstream's answer as the filter sees it: with the header Envoy's router adds.
    fn upstream_answers(h: &FakeHost, status: &str, body: &[u8]) {
        *h.0.response_headers.borrow_mut() = pairs(&[
            (":status", status),
            ("content-type", "application/json"),
            ("x-envoy-upstream-service-time", "1"),
        ]);
        *h.0.response_body.borrow_mut() = body.to_vec();
        h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
    }

    /// Traffic no rule protects crosses the filter everywhere a mesh-wide policy applies it: it
    /// costs the `:path` read its rule match needs, and nothing else, not even its counter
    /// (counted in Wasm, handed to Envoy with the others at the root's next tick).
    #[test]
    fn an_unprotected_request_costs_one_host_call() {
        let h = host();
        let mut root = root(&h);
        for (n, (method, path)) in
            [("GET", "/orders"), ("POST", "/elsewhere"), ("GET", "/health?x=1")].into_iter().enumerate()
        {
            let _ = h.take_tally();
            let mut http = root.http_context(2 + n as u32);
            *h.0.request_headers.borrow_mut() = pairs(&[(":method", method), (":path", path)]);
            *h.0.request_body.borrow_mut() = b"{}".to_vec();
            assert_eq!(http.on_request_headers(false), Verdict::Continue);
            assert_eq!(http.on_request_body(2, true), Verdict::Continue);
            upstream_answers(&h, "200", b"ok");
            assert_eq!(http.on_response_headers(false), Verdict::Continue);
            assert_eq!(http.on_response_body(2, true), Verdict::Continue);
            http.on_log();
            let tally = h.take_tally();
            let calls: u64 = tally.values().map(|(c, _)| c).sum();
            assert!(calls <= PASS_THROUGH_HOST_CALLS, "{method} {path}: {tally:?}");
        }
        // The three are in Envoy's counter after the tick, as one increment.
        assert_eq!(h.flushed_counter("passed_through"), 0);
        root.on_tick();
        assert_eq!(h.flushed_counter("passed_through"), 3);
        assert_eq!(h.take_tally().get("increment_metric").map(|(c, _)| *c), Some(1));
    }

    #[test]
    fn a_refused_configuration_is_logged_in_one_line() {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = br#"{"routes":[]}"#.to_vec();
        assert!(!Root::new(1, h.clone()).on_configure());
        assert!(matches!(h.0.calls.borrow().as_slice(), [Call::Critical(m)] if m.contains("routes")));
    }

    #[test]
    fn without_a_configuration_every_stream_goes_on_untouched() {
        let h = FakeHost::default();
        let root = Root::new(1, h.clone());
        let mut http = root.http_context(2);
        *h.0.request_headers.borrow_mut() = pairs(&[(":method", "POST"), (":path", "/orders")]);
        assert_eq!(http.on_request_headers(false), Verdict::Continue);
        assert_eq!(http.on_request_body(2, true), Verdict::Continue);
        assert_eq!(http.on_response_headers(true), Verdict::Continue);
        http.on_log();
        assert!(h.0.calls.borrow().is_empty());
    }

    #[test]
    fn a_replay_gets_its_stored_content_type_back() {
        let h = host();
        let root = root(&h);
        let mut first = root.http_context(2);
        assert_eq!(post(&h, &mut first, "/orders", "k"), Verdict::Continue);
        upstream_answers(&h, "201", b"");
        assert_eq!(first.on_response_headers(false), Verdict::Continue);
        assert_eq!(first.on_response_body(0, true), Verdict::Continue);
        first.on_log();
        assert_eq!((h.counter("claimed"), h.counter("stored")), (1, 1));

        let mut retry = root.http_context(3);
        assert_eq!(post(&h, &mut retry, "/orders", "k"), Verdict::Pause);
        assert_eq!(h.replies(), vec![(0, 201, "idempotency_replay".to_string())]);
        // Envoy's local-reply path dropped the stored content-type of an empty body.
        *h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
        assert_eq!(retry.on_response_headers(false), Verdict::Continue);
        assert!(h
            .0
            .calls
            .borrow()
            .contains(&Call::SetHeader { name: "content-type".into(), value: b"application/json".to_vec() }));

        // With a body Envoy keeps the type it was given: the replay's headers are not even read.
        let mut first = root.http_context(4);
        assert_eq!(post(&h, &mut first, "/orders", "j"), Verdict::Continue);
        upstream_answers(&h, "201", b"{\"id\":1}");
        first.on_response_headers(false);
        first.on_response_body(8, true);
        first.on_log();
        let mut retry = root.http_context(5);
        assert_eq!(post(&h, &mut retry, "/orders", "j"), Verdict::Pause);
        let _ = h.take_tally();
        assert_eq!(retry.on_response_headers(false), Verdict::Continue);
        assert!(h.take_tally().is_empty());
    }

    /// What a new key and a replay cost in host calls, with the bench's request (1 KiB JSON
    /// each way): counted exactly, since the number of crossings is a property of the code (time
    /// is measured by `make bench`). Bounded for every key of many, so no path grows with the
    /// store's content. `--nocapture` prints the table; under callgrind
    /// (release test binary) this is the glue's instruction profile.
    #[test]
    fn host_calls_per_new_key_and_per_replay() {
        // With a caller quota (as `make bench` configures one, as large as the store): its
        // counter is read and written for every new key.
        host_calls_per_new_key_and_per_replay_with(
            br#"{"store":{"type":"local","capacity":100000},
            "quota":{"per_tenant":100000,"per_principal":100000},
            "routes":[{"name":"orders","match":{"prefix":"/orders","methods":["POST"]},"require_key":true}]}"#,
            NEW_KEY_HOST_CALLS,
        );
    }

    /// Quotas are opt-in: without `quota` a new key touches no quota counter (issue 18, item 5:
    /// two host calls fewer than with one).
    #[test]
    fn host_calls_per_new_key_and_per_replay_without_a_quota() {
        host_calls_per_new_key_and_per_replay_with(
            br#"{"store":{"type":"local","capacity":100000},
            "routes":[{"name":"orders","match":{"prefix":"/orders","methods":["POST"]},"require_key":true}]}"#,
            NEW_KEY_HOST_CALLS_WITHOUT_QUOTA,
        );
    }

    fn host_calls_per_new_key_and_per_replay_with(config: &[u8], new_key_bound: u64) {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = config.to_vec();
        h.0.now_ms.set(1_000);
        let root = root(&h);
        let body = format!("{{\"item\":\"book\",\"qty\":1,\"pad\":\"{}\"}}", "x".repeat(995));
        let answer = vec![b'7'; 1024];
        let total =
            |t: &std::collections::BTreeMap<&str, (u64, u64)>| t.values().map(|(c, _)| c).sum::<u64>();
        let (mut most, mut sum, mut within) = ((0, 0), (0, 0), 0u32);
        let keys: u32 = std::env::var("HOST_CALL_KEYS").ok().and_then(|n| n.parse().ok()).unwrap_or(2000);
        for n in 0..keys {
            let key = format!("key-{n}");
            let _ = h.take_tally();
            let context = 2 * n + 2;
            let mut first = root.http_context(context);
            *h.0.request_headers.borrow_mut() = pairs(&[
                (":method", "POST"),
                (":path", "/orders"),
                (":authority", "shop.example"),
                ("idempotency-key", &key),
                ("content-type", "application/json"),
                ("user-agent", "loadgen"),
            ]);
            *h.0.request_body.borrow_mut() = body.clone().into_bytes();
            assert_eq!(first.on_request_headers(false), Verdict::Pause);
            assert_eq!(first.on_request_body(body.len(), true), Verdict::Continue);
            upstream_answers(&h, "201", &answer);
            h.0.properties.borrow_mut().insert("upstream.address".into(), b"10.0.0.1:80".to_vec());
            assert_eq!(first.on_response_headers(false), Verdict::Continue);
            assert_eq!(first.on_response_body(answer.len(), true), Verdict::Continue);
            first.on_log();
            let new_key = h.take_tally();
            let mut retry = root.http_context(context + 1);
            assert_eq!(retry.on_request_headers(false), Verdict::Pause);
            assert_eq!(retry.on_request_body(body.len(), true), Verdict::Pause);
            *h.0.response_headers.borrow_mut() =
                pairs(&[(":status", "201"), ("content-type", "application/json")]);
            assert_eq!(retry.on_response_headers(false), Verdict::Continue);
            retry.on_log();
            let replay = h.take_tally();
            let costs = (total(&new_key), total(&replay));
            if n == 0 {
                for (what, t) in [("new key", &new_key), ("replay", &replay)] {
                    println!("{what}: {} host calls", total(t));
                    for (call, (n, bytes)) in t {
                        println!("  {call:<24} {n:>3} calls {bytes:>6} bytes");
                    }
                }
            }
            // Nothing grows with the store.
            assert!(costs.0 <= new_key_bound + SECOND_BUCKET_HOST_CALLS, "key {n}: {new_key:?}");
            assert!(costs.1 <= REPLAY_HOST_CALLS, "key {n}: {replay:?}");
            most = (most.0.max(costs.0), most.1.max(costs.1));
            sum = (sum.0 + costs.0, sum.1 + costs.1);
            within += u32::from(costs.0 <= new_key_bound);
        }
        // The budget itself holds for the keys placed in their primary bucket: nearly all.
        assert!(within * 10 >= keys * 9, "{within} of {keys} new keys within {new_key_bound} host calls");
        let keys_f = f64::from(keys);
        println!(
            "{keys} keys: new key {:.2} host calls on average (most {}), replay {:.2} (most {})",
            sum.0 as f64 / keys_f,
            most.0,
            sum.1 as f64 / keys_f,
            most.1
        );
        assert_eq!((h.counter("claimed"), h.counter("replayed")), (i64::from(keys), i64::from(keys)));
    }

    #[test]
    fn an_unreadable_request_body_is_a_503() {
        let h = host();
        let root = root(&h);
        let mut http = root.http_context(2);
        h.fail("buffer", 2);
        assert_eq!(post(&h, &mut http, "/orders", "k"), Verdict::Pause);
        assert_eq!(h.replies(), vec![(0, 503, "idempotency_problem".to_string())]);
        assert_eq!(h.counter("store_error"), 1);
    }

    #[test]
    fn no_upstream_host_releases_the_claim_and_a_cut_body_keeps_the_outcome_without_it() {
        let h = host();
        let root = root(&h);
        let mut http = root.http_context(2);
        post(&h, &mut http, "/orders", "k");
        // A direct response: upstream.address is empty.
        *h.0.response_headers.borrow_mut() = pairs(&[(":status", "200")]);
        h.0.properties.borrow_mut().insert("response.code_details".into(), b"direct_response".to_vec());
        h.0.properties.borrow_mut().insert("upstream.address".into(), Vec::new());
        http.on_response_headers(true);
        assert_eq!(h.counter("released"), 1);
        // Released: the retry executes.
        let mut again = root.http_context(3);
        assert_eq!(post(&h, &mut again, "/orders", "k"), Verdict::Continue);
        upstream_answers(&h, "201", b"abcdef");
        again.on_response_headers(false);
        again.on_response_body(3, false);
        again.on_log(); // the upstream reset mid-body
        assert_eq!(h.counter("response_not_stored"), 1);
        let mut late = root.http_context(4);
        post(&h, &mut late, "/orders", "k");
        assert_eq!(h.replies().last().map(|r| r.1), Some(410));
    }

    #[test]
    fn the_router_retry_warning_is_claimed_once_per_rule_by_one_worker() {
        let h = host();
        let _ = root(&h);
        let keys = h.0.data.key_count();
        let (worker1, worker2) = (
            crate::glue::plugin::PluginState::configure_with(h.clone(), 1, None).unwrap(),
            crate::glue::plugin::PluginState::configure_with(h.clone(), 2, None).unwrap(),
        );
        assert!(worker1.first_retry_warning("orders"));
        assert!(!worker2.first_retry_warning("orders"));
        assert!(!worker1.first_retry_warning("orders"));
        assert!(worker2.first_retry_warning("waits"));
        // Every flag existed before traffic: asking created no data key.
        assert_eq!(h.0.data.key_count(), keys);
        assert!(!worker1.first_retry_warning("no-such-rule"));
        assert_eq!(h.0.data.key_count(), keys);
    }

    #[test]
    fn a_request_ended_before_its_body_is_counted_each_time_and_logged_once_a_minute() {
        let h = host();
        let root = root(&h);
        let plugin = crate::glue::plugin::PluginState::configure_with(h.clone(), 1, None).unwrap();
        assert!(plugin.body_never_received_log_due(1_000));
        assert!(!plugin.body_never_received_log_due(60_999));
        assert!(plugin.body_never_received_log_due(61_000));
        // Through the stream's callbacks: held at its headers, ended without a body frame.
        for n in 0..3 {
            let mut http = root.http_context(2 + n);
            *h.0.request_headers.borrow_mut() =
                pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
            assert_eq!(http.on_request_headers(false), Verdict::Pause);
            http.on_log();
        }
        assert_eq!((h.counter("body_never_received"), h.counter("claimed")), (3, 0));
    }

    /// The original (context 2) and a duplicate held in wait mode (context 3).
    fn original_and_waiter(h: &FakeHost, root: &Root<FakeHost>) -> (Http<FakeHost>, Http<FakeHost>) {
        let mut original = root.http_context(2);
        assert_eq!(post(h, &mut original, "/wait", "w"), Verdict::Continue);
        let mut waiter = root.http_context(3);
        assert_eq!(post(h, &mut waiter, "/wait", "w"), Verdict::Pause);
        assert_eq!(h.counter("waiting"), 1);
        (original, waiter)
    }

    #[test]
    fn a_woken_waiter_is_answered_with_the_replay() {
        let h = host();
        let mut root = root(&h);
        let (mut original, mut waiter) = original_and_waiter(&h, &root);
        upstream_answers(&h, "201", b"ok");
        original.on_response_headers(false);
        original.on_response_body(2, true);
        root.on_queue_ready(0);
        assert_eq!(h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
        assert_eq!(h.counter("replayed"), 1);
        // The replay passes the waiter's encode callbacks: not captured as an upstream answer.
        assert_eq!(waiter.on_response_headers(true), Verdict::Continue);
        assert_eq!(h.counter("stored"), 1);
    }

    #[test]
    fn a_waiter_whose_client_left_gets_nothing() {
        let h = host();
        let mut root = root(&h);
        let (mut original, _waiter) = original_and_waiter(&h, &root);
        upstream_answers(&h, "201", b"ok");
        original.on_response_headers(false);
        original.on_response_body(2, true);
        h.fail("set_effective_context", 1);
        root.on_queue_ready(0);
        assert!(h.replies().is_empty());
        assert_eq!(h.counter("replayed"), 0);
    }

    #[test]
    fn a_waiter_that_cannot_be_resumed_releases_its_claim() {
        let h = host();
        let mut root = root(&h);
        let (mut original, _waiter) = original_and_waiter(&h, &root);
        // The upstream answers 503: released, so the waiter becomes the owner.
        upstream_answers(&h, "503", b"");
        original.on_response_headers(true);
        assert_eq!(h.counter("released"), 1);
        h.fail("resume_request", 1);
        root.on_queue_ready(0);
        assert_eq!(h.counter("claimed"), 2);
        // Its claim was released: the next request claims instead of being told to wait.
        let mut next = root.http_context(4);
        assert_eq!(post(&h, &mut next, "/wait", "w"), Verdict::Continue);
        assert_eq!(h.counter("claimed"), 3);
    }

    #[test]
    fn trailers_end_the_request_body_and_the_captured_response() {
        let h = host();
        let mut root = root(&h);
        let mut http = root.http_context(2);
        *h.0.request_headers.borrow_mut() =
            pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "t")]);
        *h.0.request_body.borrow_mut() = b"x".to_vec();
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        assert_eq!(http.on_request_body(1, false), Verdict::Pause);
        assert_eq!(http.on_request_trailers(), Verdict::Continue);
        upstream_answers(&h, "200", b"ok");
        http.on_response_headers(false);
        http.on_response_body(2, false);
        assert_eq!(http.on_response_trailers(), Verdict::Continue);
        assert_eq!(h.counter("stored"), 1);
        // The root that goes away stops advertising its wake-up queue.
        let registry = crate::wait::wake::Registry::new(h.clone());
        root.on_tick();
        assert_eq!(registry.live(1_000).unwrap().len(), 1);
        assert!(root.on_done());
        assert!(registry.live(1_000).unwrap().is_empty());
    }

    #[test]
    fn the_tick_sweeps_and_gives_up_on_waiters_after_their_timeout() {
        let h = host();
        let mut root = root(&h);
        let (_original, _waiter) = original_and_waiter(&h, &root);
        h.0.now_ms.set(1_000 + 10_001);
        root.on_tick();
        assert_eq!(h.replies(), vec![(3, 409, "idempotency_problem".to_string())]);
        assert_eq!(h.counter("wait_timed_out"), 1);
    }

    #[test]
    fn outcomes_are_counted_per_route_rule_too_for_one_more_increment_each() {
        let h = host();
        let root = root(&h);
        // Defined at configure time, none on the request path: the outcomes over every rule,
        // the same per rule (orders, waits), and the sweep counter.
        let defined = crate::metrics::Counter::ALL.len() * 3 + 1;
        assert_eq!(h.metrics_defined(), defined);
        let mut first = root.http_context(2);
        assert_eq!(post(&h, &mut first, "/orders", "k"), Verdict::Continue);
        upstream_answers(&h, "201", b"{}");
        first.on_response_headers(false);
        first.on_response_body(2, true);
        first.on_log();
        assert_eq!((h.route_counter("orders", "claimed"), h.route_counter("orders", "stored")), (1, 1));

        let before = h.0.increments.get();
        let mut retry = root.http_context(3);
        assert_eq!(post(&h, &mut retry, "/orders", "k"), Verdict::Pause);
        assert_eq!(h.0.increments.get() - before, 2, "one over every rule, one for the rule");
        assert_eq!((h.counter("replayed"), h.route_counter("orders", "replayed")), (1, 1));
        assert_eq!(h.route_counter("waits", "replayed"), 0);

        let mut mismatch = root.http_context(4);
        *h.0.request_headers.borrow_mut() =
            pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
        *h.0.request_body.borrow_mut() = b"{\"other\":1}".to_vec();
        assert_eq!(mismatch.on_request_headers(false), Verdict::Pause);
        assert_eq!(mismatch.on_request_body(11, true), Verdict::Pause);
        assert_eq!((h.counter("mismatch"), h.route_counter("orders", "mismatch")), (1, 1));

        // No rule matched: counted over every rule only, for one increment.
        let before = h.0.increments.get();
        let mut elsewhere = root.http_context(5);
        *h.0.request_headers.borrow_mut() = pairs(&[(":method", "POST"), (":path", "/elsewhere")]);
        assert_eq!(elsewhere.on_request_headers(false), Verdict::Continue);
        assert_eq!((h.counter("passed_through"), h.0.increments.get() - before), (1, 1));
        assert_eq!(h.metrics_defined(), defined);
    }

    #[test]
    fn a_waiters_outcome_is_counted_under_its_rule_by_the_root() {
        let h = host();
        let mut root = root(&h);
        let (mut original, _waiter) = original_and_waiter(&h, &root);
        assert_eq!(h.route_counter("waits", "waiting"), 1);
        upstream_answers(&h, "201", b"ok");
        original.on_response_headers(false);
        original.on_response_body(2, true);
        root.on_queue_ready(0);
        assert_eq!(h.route_counter("waits", "replayed"), 1);
        assert_eq!(h.route_counter("orders", "replayed"), 0);
    }
}

/// The glue with a store across the network: callouts for `begin` from the stream, settlements
/// from the root, and every way a callout can fail.
#[cfg(test)]
mod remote_tests {
    use super::*;
    use crate::flow::FailMode;
    use crate::glue::remote::{Answer, Conversation, Next, RemoteSettings, RemoteStore, Request};
    use crate::store::{Begin, Claim, Settled, StoreAnswer, StoreError, StoreOp};

    const CONFIG: &str = r#"{"routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#;

    /// A store that claims on a 200 answer to its one call and settles on a 200 answer to its
    /// one call; anything else is Unavailable (as the etcd exchanges map them).
    struct Scripted(RemoteSettings, Rc<RefCell<Vec<StoreOp>>>);

    struct OneCall(StoreOp);

    impl Conversation for OneCall {
        fn into_op(self: Box<Self>) -> StoreOp {
            self.0
        }
        fn step(&mut self, answer: Option<Answer>, _now_ms: u64) -> Next {
            let Some(answer) = answer else {
                return Next::Call(Request {
                    path: "/v3/kv/txn",
                    body: b"{}".to_vec(),
                    token: None,
                    timeout_ms: None,
                });
            };
            let ok = answer.status == Some(200);
            let error = || StoreError::Unavailable(format!("answer {:?}", answer.status));
            Next::Done(match &self.0 {
                StoreOp::Begin(a) => StoreAnswer::Begun(if ok {
                    Ok(Begin::Claimed(Claim { scope: a.scope, owner: a.owner, locator: 7, written: None }))
                } else {
                    Err(error())
                }),
                _ => StoreAnswer::Settled(if ok { Ok(Settled::Done) } else { Err(error()) }),
            })
        }
    }

    impl RemoteStore for Scripted {
        fn settings(&self) -> &RemoteSettings {
            &self.0
        }
        fn start(&self, op: StoreOp) -> Box<dyn Conversation> {
            self.1.borrow_mut().push(op.clone());
            Box::new(OneCall(op))
        }
    }

    fn host() -> FakeHost {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
        h.0.now_ms.set(1_000);
        h.0.clusters.borrow_mut().push("etcd".into());
        h
    }

    fn root(h: &FakeHost, cluster: &str, on_error: FailMode) -> Root<FakeHost> {
        root_with_ops(h, cluster, on_error).0
    }

    /// The root, and every operation its store was asked to start.
    fn root_with_ops(
        h: &FakeHost,
        cluster: &str,
        on_error: FailMode,
    ) -> (Root<FakeHost>, Rc<RefCell<Vec<StoreOp>>>) {
        let mut root = Root::new(1, h.clone());
        let settings = RemoteSettings { cluster: cluster.into(), timeout_ms: 250, on_error };
        let ops = Rc::new(RefCell::new(Vec::new()));
        assert!(root.on_configure_with(Some(Box::new(Scripted(settings, Rc::clone(&ops))))));
        (root, ops)
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    fn post(h: &FakeHost, http: &mut Http<FakeHost>) -> Verdict {
        *h.0.request_headers.borrow_mut() =
            pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
        *h.0.request_body.borrow_mut() = b"{}".to_vec();
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        http.on_request_body(2, true)
    }

    /// What the next `on_http_call_response` reads: a status (None: Envoy's failure report,
    /// no `:status`) and a body.
    fn store_answers(h: &FakeHost, status: Option<&str>, body: &[u8]) {
        *h.0.call_response_headers.borrow_mut() =
            status.map(|s| pairs(&[(":status", s)])).unwrap_or_default();
        *h.0.call_response_body.borrow_mut() = body.to_vec();
    }

    fn last_token(h: &FakeHost) -> u32 {
        match h.dispatches().last() {
            Some(Call::Dispatch { token, .. }) => *token,
            _ => panic!("no callout"),
        }
    }

    fn resumed(h: &FakeHost) -> usize {
        h.0.calls.borrow().iter().filter(|c| matches!(c, Call::Resume { .. })).count()
    }

    type Sent = (u16, Vec<(String, Vec<u8>)>, Vec<u8>);

    fn problem_reply(h: &FakeHost) -> Sent {
        h.0.calls
            .borrow()
            .iter()
            .rev()
            .find_map(|c| match c {
                Call::SendResponse { status, headers, body, .. } => {
                    Some((*status, headers.clone(), body.clone()))
                }
                _ => None,
            })
            .expect("a reply")
    }

    fn assert_store_unavailable(h: &FakeHost) {
        let (status, headers, body) = problem_reply(h);
        assert_eq!(status, 503);
        assert!(headers.iter().any(|(n, _)| n == "retry-after"), "{headers:?}");
        assert!(String::from_utf8_lossy(&body).contains("store-unavailable"));
        assert_eq!(resumed(h), 0, "nothing may be forwarded");
        assert_eq!(h.counter("store_error"), 1);
    }

    /// A protected POST up to its `begin`, which the root starts from its queue callback (the
    /// root's own context is the effective one there); returns the callout's token.
    fn begin(h: &FakeHost, root: &mut Root<FakeHost>, http: &mut Http<FakeHost>) -> Option<u32> {
        assert_eq!(post(h, http), Verdict::Pause);
        let before = h.dispatches().len();
        h.0.effective.set(1);
        root.on_queue_ready(0);
        (h.dispatches().len() > before).then(|| last_token(h))
    }

    #[test]
    fn begin_is_the_roots_callout_while_the_request_stays_paused_and_its_answer_resumes_it() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let mut http = root.http_context(2);
        assert_eq!(post(&h, &mut http), Verdict::Pause);
        assert!(h.dispatches().is_empty(), "not from the stream's callback");
        h.0.effective.set(1);
        root.on_queue_ready(0);
        let dispatches = h.dispatches();
        let [Call::Dispatch { context: 1, token, cluster, headers, timeout_ms: 250, .. }] =
            dispatches.as_slice()
        else {
            panic!("{dispatches:?}")
        };
        assert_eq!(cluster, "etcd");
        for pseudo in [":method", ":path", ":authority"] {
            assert!(headers.iter().any(|(n, _)| n == pseudo));
        }
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(*token, 2);
        assert_eq!(h.0.calls.borrow().last(), Some(&Call::Resume { context: 2 }));
        assert_eq!(h.counter("claimed"), 1);
        // The stream has its flow back: the response is captured and completed.
        *h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
        h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
        assert_eq!(http.on_response_headers(true), Verdict::Pause);
    }

    #[test]
    fn a_missing_cluster_refuses_the_callout_and_fails_closed_with_503() {
        let h = host();
        let mut root = root(&h, "no-such-cluster", FailMode::Closed);
        let mut http = root.http_context(2);
        assert_eq!(begin(&h, &mut root, &mut http), None);
        assert_store_unavailable(&h);
        assert_eq!(h.replies()[0].0, 2, "the reply goes to the request, not the root");
    }

    #[test]
    fn an_answer_without_status_fails_closed() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let mut http = root.http_context(2);
        let token = begin(&h, &mut root, &mut http).expect("a callout");
        store_answers(&h, None, b"");
        root.on_http_call_response(token, 0);
        assert_store_unavailable(&h);
    }

    #[test]
    fn a_timeout_fails_closed_and_a_late_answer_is_ignored() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let mut http = root.http_context(2);
        let token = begin(&h, &mut root, &mut http).expect("a callout");
        store_answers(&h, Some("504"), b"upstream request timeout");
        root.on_http_call_response(token, 24);
        assert_store_unavailable(&h);
        let calls = h.0.calls.borrow().len();
        // A second answer for the same token, or one for a token nobody awaits: nothing happens.
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(token, 2);
        root.on_http_call_response(token + 41, 2);
        assert_eq!(h.0.calls.borrow().len(), calls);
        assert_eq!((h.counter("claimed"), h.counter("store_error")), (0, 1));
    }

    #[test]
    fn fail_open_forwards_unprotected_and_counts_every_bypass() {
        let h = host();
        let mut root = root(&h, "no-such-cluster", FailMode::Open);
        for id in [2, 3] {
            let mut http = root.http_context(id);
            begin(&h, &mut root, &mut http);
        }
        assert_eq!(resumed(&h), 2);
        assert_eq!((h.counter("store_bypassed"), h.counter("store_error")), (2, 0));
        assert!(h.replies().is_empty());
        // A timeout resumes the paused request.
        let h = host();
        let mut root = self::root(&h, "etcd", FailMode::Open);
        let mut timed_out = root.http_context(4);
        let token = begin(&h, &mut root, &mut timed_out).expect("a callout");
        store_answers(&h, Some("504"), b"");
        root.on_http_call_response(token, 0);
        assert_eq!(h.0.calls.borrow().last(), Some(&Call::Resume { context: 4 }));
        assert_eq!((h.counter("store_bypassed"), h.counter("store_error")), (1, 0));
        assert!(h.replies().is_empty());
    }

    #[test]
    fn a_claim_answered_after_the_client_left_is_released_at_once() {
        let h = host();
        let (mut root, ops) = root_with_ops(&h, "etcd", FailMode::Closed);
        let mut http = root.http_context(2);
        let token = begin(&h, &mut root, &mut http).expect("a callout");
        http.on_log(); // the client went away while the request was paused
        drop(http);
        h.fail("set_effective_context", 2);
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(token, 2);
        assert!(matches!(ops.borrow().last(), Some(StoreOp::Release(_))), "{:?}", ops.borrow());
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!((h.counter("claimed"), h.counter("released")), (0, 1));
        assert!(!h
            .0
            .calls
            .borrow()
            .iter()
            .any(|c| matches!(c, Call::Resume { .. } | Call::SendResponse { .. })));
    }

    /// A stream whose `begin` was answered with a claim, its response headers in.
    fn forwarded(h: &FakeHost, root: &mut Root<FakeHost>, id: u32, status: &str) -> Http<FakeHost> {
        let mut http = root.http_context(id);
        let token = begin(h, root, &mut http).expect("a callout");
        store_answers(h, Some("200"), b"{}");
        root.on_http_call_response(token, 2);
        *h.0.response_headers.borrow_mut() = pairs(&[(":status", status)]);
        h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
        http
    }

    #[test]
    fn the_root_counts_a_remote_requests_outcomes_under_its_rule() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let mut http = forwarded(&h, &mut root, 2, "201");
        assert_eq!((h.counter("claimed"), h.route_counter("orders", "claimed")), (1, 1));
        *h.0.response_body.borrow_mut() = b"{}".to_vec();
        http.on_response_headers(false);
        assert_eq!(http.on_response_body(2, true), Verdict::Pause);
        h.0.effective.set(1);
        root.on_queue_ready(0);
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!((h.counter("stored"), h.route_counter("orders", "stored")), (1, 1));
    }

    #[test]
    fn the_body_is_held_while_copied_and_each_frame_read_once() {
        let h = host();
        let (mut root, ops) = root_with_ops(&h, "etcd", FailMode::Closed);
        let mut http = forwarded(&h, &mut root, 2, "201");
        // Envoy's buffer keeps held frames: each callback's size counts them all.
        *h.0.response_body.borrow_mut() = b"abcdef".to_vec();
        assert_eq!(http.on_response_headers(false), Verdict::Continue);
        assert_eq!(http.on_response_body(3, false), Verdict::Pause);
        assert_eq!(http.on_response_body(6, false), Verdict::Pause);
        assert_eq!(http.on_response_body(6, true), Verdict::Pause);
        h.0.effective.set(1);
        root.on_queue_ready(0);
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!(h.0.calls.borrow().last(), Some(&Call::ResumeResponse { context: 2 }));
        let ops = ops.borrow();
        let Some(StoreOp::Complete { completion, .. }) = ops.last() else { panic!("{ops:?}") };
        let snapshot = completion.snapshot.as_ref().expect("kept with its body");
        assert_eq!(snapshot.body, b"abcdef");
    }

    #[test]
    fn the_completion_is_dispatched_by_the_root_and_survives_the_end_of_its_stream() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let mut http = forwarded(&h, &mut root, 2, "201");
        *h.0.response_body.borrow_mut() = b"{}".to_vec();
        assert_eq!(http.on_response_headers(false), Verdict::Continue);
        // The end of the response waits for the record to be written.
        assert_eq!(http.on_response_body(2, true), Verdict::Pause);
        // Not dispatched by the stream: handed to the root, which is woken through its queue.
        let dispatched = h.dispatches().len();
        h.0.effective.set(1);
        root.on_queue_ready(0);
        assert_eq!(h.dispatches().len(), dispatched + 1);
        assert!(matches!(h.dispatches().last(), Some(Call::Dispatch { context: 1, .. })));
        assert_eq!(h.counter("stored"), 0);
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!(h.counter("stored"), 1);
        assert_eq!(h.0.calls.borrow().last(), Some(&Call::ResumeResponse { context: 2 }));

        // The stream is gone before the store answers (its client left): the root still
        // counts the outcome, and resumes nothing.
        let mut gone = forwarded(&h, &mut root, 3, "201");
        gone.on_response_headers(false);
        assert_eq!(gone.on_response_body(2, true), Verdict::Pause);
        gone.on_log();
        drop(gone);
        root.on_queue_ready(0);
        h.fail("set_effective_context", 2);
        let calls = h.0.calls.borrow().len();
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!(h.counter("stored"), 2);
        assert_eq!(h.0.calls.borrow().len(), calls, "nothing resumed");
    }

    #[test]
    fn without_a_queue_the_tick_starts_what_streams_hand_over() {
        let h = host();
        h.fail("register_queue", 1);
        let mut root = root(&h, "etcd", FailMode::Closed);
        let mut http = root.http_context(2);
        assert_eq!(post(&h, &mut http), Verdict::Pause);
        assert!(h.dispatches().is_empty());
        root.on_tick();
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!(resumed(&h), 1);
        // A failed release goes on at once, and is tried again at a later tick.
        *h.0.response_headers.borrow_mut() = pairs(&[(":status", "500")]);
        h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
        assert_eq!(http.on_response_headers(true), Verdict::Pause);
        root.on_tick();
        store_answers(&h, None, b"");
        root.on_http_call_response(last_token(&h), 0);
        assert!(matches!(h.0.calls.borrow().last(), Some(Call::ResumeResponse { .. })));
        let dispatched = h.dispatches().len();
        h.0.now_ms.set(h.0.now_ms.get() + 100);
        root.on_tick();
        assert_eq!(h.dispatches().len(), dispatched + 1);
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!((h.counter("released"), h.counter("store_error")), (1, 0));
    }

    /// A forwarded request whose 201 has come back whole: its completion is the root's
    /// callout now (returned: its token).
    fn completing(h: &FakeHost, root: &mut Root<FakeHost>, id: u32) -> (Http<FakeHost>, u32) {
        let mut http = forwarded(h, root, id, "201");
        *h.0.response_body.borrow_mut() = b"{}".to_vec();
        http.on_response_headers(false);
        assert_eq!(http.on_response_body(2, true), Verdict::Pause);
        h.0.effective.set(1);
        root.on_queue_ready(0);
        (http, last_token(h))
    }

    fn at(h: &FakeHost, root: &mut Root<FakeHost>, now_ms: u64) {
        h.0.now_ms.set(now_ms);
        root.on_tick();
    }

    #[test]
    fn a_completion_the_store_failed_is_tried_again_with_backoff_until_it_lands() {
        let h = host();
        let (mut root, ops) = root_with_ops(&h, "etcd", FailMode::Closed);
        let (_http, token) = completing(&h, &mut root, 2);
        // Envoy timed the callout out: the client gets its response now, nothing is counted.
        store_answers(&h, Some("504"), b"upstream request timeout");
        root.on_http_call_response(token, 24);
        assert_eq!(h.0.calls.borrow().last(), Some(&Call::ResumeResponse { context: 2 }));
        assert_eq!((h.counter("stored"), h.counter("store_error")), (0, 0));
        // Tried again after 100 ms, then 200 ms, as a new conversation of the same completion.
        let dispatched = h.dispatches().len();
        at(&h, &mut root, 1_050);
        assert_eq!(h.dispatches().len(), dispatched, "not due yet");
        at(&h, &mut root, 1_100);
        assert_eq!(h.dispatches().len(), dispatched + 1);
        store_answers(&h, None, b"");
        root.on_http_call_response(last_token(&h), 0);
        at(&h, &mut root, 1_250);
        assert_eq!(h.dispatches().len(), dispatched + 1, "backoff doubled");
        at(&h, &mut root, 1_300);
        assert_eq!(h.dispatches().len(), dispatched + 2);
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(last_token(&h), 2);
        assert_eq!((h.counter("stored"), h.counter("settlement_abandoned")), (1, 0));
        let completions: Vec<StoreOp> =
            ops.borrow().iter().filter(|op| matches!(op, StoreOp::Complete { .. })).cloned().collect();
        assert_eq!(completions.len(), 3);
        assert!(completions.iter().all(|op| *op == completions[0]), "the same completion each time");
        // Nothing left to try.
        at(&h, &mut root, 10_000);
        assert_eq!(h.dispatches().len(), dispatched + 2);
        assert_eq!(h.0.calls.borrow().iter().filter(|c| matches!(c, Call::ResumeResponse { .. })).count(), 1);
    }

    #[test]
    fn a_completion_is_abandoned_and_counted_once_the_lease_has_passed() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let (_http, token) = completing(&h, &mut root, 2);
        store_answers(&h, None, b"");
        root.on_http_call_response(token, 0);
        let mut now = 1_000;
        let mut tries = 1;
        // The rule's processing_timeout is the default 30 s.
        while now < 40_000 {
            now += 100;
            let before = h.dispatches().len();
            at(&h, &mut root, now);
            if h.dispatches().len() > before {
                tries += 1;
                store_answers(&h, None, b"");
                root.on_http_call_response(last_token(&h), 0);
            }
        }
        assert_eq!(h.counter("settlement_abandoned"), 1);
        assert_eq!(h.route_counter("orders", "settlement_abandoned"), 1);
        assert_eq!((h.counter("stored"), h.counter("store_error")), (0, 0));
        // 100, 200, 400, 800, 1600, then every 2 s until 30 s after the first failure.
        assert!((15..=20).contains(&tries), "{tries} tries");
    }

    #[test]
    fn a_retired_root_finishes_its_completions_before_it_tells_envoy_it_is_done() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        let (http, token) = completing(&h, &mut root, 2);
        drop(http);
        h.fail("set_effective_context", 2);
        // The configuration is replaced: Envoy must wait for the completion in flight.
        assert!(!root.on_done());
        assert!(!h.0.calls.borrow().contains(&Call::Done));
        at(&h, &mut root, 1_500);
        assert!(!h.0.calls.borrow().contains(&Call::Done));
        store_answers(&h, Some("200"), b"{}");
        root.on_http_call_response(token, 2);
        assert_eq!(h.counter("stored"), 1);
        assert_eq!(h.0.calls.borrow().iter().filter(|c| **c == Call::Done).count(), 1);
        // A root with nothing under way goes at once.
        let h = host();
        let mut idle = root_with_ops(&h, "etcd", FailMode::Closed).0;
        assert!(idle.on_done());
        assert!(!h.0.calls.borrow().contains(&Call::Done));
    }

    #[test]
    fn a_retired_root_counts_what_it_abandons_at_its_bound() {
        let h = host();
        let mut root = root(&h, "etcd", FailMode::Closed);
        // A completion whose answer never comes back to the root.
        let _ = completing(&h, &mut root, 2);
        assert!(!root.on_done());
        // The bound: the longest processing_timeout (30 s) and two tries of 4 calls of 250 ms.
        at(&h, &mut root, 1_000 + 31_999);
        assert!(!h.0.calls.borrow().contains(&Call::Done));
        assert_eq!(h.counter("settlement_abandoned"), 0);
        at(&h, &mut root, 1_000 + 32_000);
        assert_eq!(h.0.calls.borrow().iter().filter(|c| **c == Call::Done).count(), 1);
        assert_eq!(h.counter("settlement_abandoned"), 1);
        assert_eq!(h.route_counter("orders", "settlement_abandoned"), 1);
        // Said once.
        at(&h, &mut root, 40_000);
        assert_eq!(h.0.calls.borrow().iter().filter(|c| **c == Call::Done).count(), 1);
    }
}

/// Wait mode with a store across the network: waiters poll it (the root's callouts) with
/// backoff, are woken by this Envoy's completions, and resolve like local waiters.
#[cfg(test)]
mod remote_wait_tests {
    use super::*;
    use crate::flow::FailMode;
    use crate::glue::remote::{Answer, Conversation, Next, RemoteSettings, RemoteStore, Request};
    use crate::store::record::Snapshot;
    use crate::store::{Begin, Claim, Settled, StoreAnswer, StoreError, StoreOp};

    const CONFIG: &str = r#"{"routes":[{"name":"w","match":{"prefix":"/orders"},"require_key":true,
        "concurrent":"wait","wait_timeout":"2s","processing_timeout":"30s"}]}"#;

    type Begins = Rc<RefCell<VecDeque<Begin>>>;

    /// Each operation is one call; a 200 answers a `begin` with the next scripted `Begin`
    /// (a claim when none is left), a settlement with Done; anything else is Unavailable.
    struct Scripted {
        settings: RemoteSettings,
        ops: Rc<RefCell<Vec<StoreOp>>>,
        begins: Begins,
    }

    struct OneCall(StoreOp, Begins);

    impl Conversation for OneCall {
        fn into_op(self: Box<Self>) -> StoreOp {
            self.0
        }
        fn step(&mut self, answer: Option<Answer>, _now_ms: u64) -> Next {
            let Some(answer) = answer else {
                return Next::Call(Request {
                    path: "/v3/kv/txn",
                    body: b"{}".to_vec(),
                    token: None,
                    timeout_ms: None,
                });
            };
            let error = StoreError::Unavailable(format!("answer {:?}", answer.status));
            let ok = answer.status == Some(200);
            Next::Done(match &self.0 {
                StoreOp::Begin(a) if ok => {
                    StoreAnswer::Begun(Ok(self.1.borrow_mut().pop_front().unwrap_or(Begin::Claimed(Claim {
                        scope: a.scope,
                        owner: a.owner,
                        locator: 7,
                        written: None,
                    }))))
                }
                StoreOp::Begin(_) => StoreAnswer::Begun(Err(error)),
                _ if ok => StoreAnswer::Settled(Ok(Settled::Done)),
                _ => StoreAnswer::Settled(Err(error)),
            })
        }
    }

    impl RemoteStore for Scripted {
        fn settings(&self) -> &RemoteSettings {
            &self.settings
        }
        fn start(&self, op: StoreOp) -> Box<dyn Conversation> {
            self.ops.borrow_mut().push(op.clone());
            Box::new(OneCall(op, Rc::clone(&self.begins)))
        }
    }

    struct Rig {
        h: FakeHost,
        root: Root<FakeHost>,
        ops: Rc<RefCell<Vec<StoreOp>>>,
        begins: Begins,
    }

    const IN_FLIGHT: Begin = Begin::InFlight { retry_after_ms: 30_000 };

    fn rig(on_error: FailMode) -> Rig {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
        h.0.now_ms.set(1_000);
        h.0.clusters.borrow_mut().push("etcd".into());
        let mut root = Root::new(1, h.clone());
        let settings = RemoteSettings { cluster: "etcd".into(), timeout_ms: 250, on_error };
        let ops = Rc::new(RefCell::new(Vec::new()));
        let begins: Begins = Rc::new(RefCell::new(VecDeque::new()));
        let store = Scripted { settings, ops: Rc::clone(&ops), begins: Rc::clone(&begins) };
        assert!(root.on_configure_with(Some(Box::new(store))));
        root.on_tick(); // advertises the wake queue, as Envoy's first tick does
        Rig { h, root, ops, begins }
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    fn last_token(h: &FakeHost) -> u32 {
        match h.dispatches().last() {
            Some(Call::Dispatch { token, .. }) => *token,
            _ => panic!("no callout"),
        }
    }

    fn answer(r: &mut Rig, status: Option<&str>) {
        *r.h.0.call_response_headers.borrow_mut() =
            status.map(|s| pairs(&[(":status", s)])).unwrap_or_default();
        *r.h.0.call_response_body.borrow_mut() = b"{}".to_vec();
        let token = last_token(&r.h);
        r.root.on_http_call_response(token, 2);
    }

    /// A protected POST whose `begin` the root makes; the store answers it with `begun`.
    fn request(r: &mut Rig, id: u32, begun: Option<Begin>) -> Http<FakeHost> {
        let mut http = r.root.http_context(id);
        *r.h.0.request_headers.borrow_mut() =
            pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", "k")]);
        *r.h.0.request_body.borrow_mut() = b"{}".to_vec();
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        assert_eq!(http.on_request_body(2, true), Verdict::Pause);
        r.h.0.effective.set(1);
        r.root.on_queue_ready(0);
        r.begins.borrow_mut().extend(begun);
        answer(r, Some("200"));
        http
    }

    /// The original (context 2, forwarded) and a duplicate held waiting (context 3).
    fn original_and_waiter(r: &mut Rig) -> (Http<FakeHost>, Http<FakeHost>) {
        pair(r, 2, 3)
    }

    fn pair(r: &mut Rig, original: u32, waiter: u32) -> (Http<FakeHost>, Http<FakeHost>) {
        let counts = |r: &Rig| (r.h.counter("claimed"), r.h.counter("waiting"), r.h.replies().len());
        let (claimed, waiting, replies) = counts(r);
        let o = request(r, original, None);
        let w = request(r, waiter, Some(IN_FLIGHT));
        assert_eq!(counts(r), (claimed + 1, waiting + 1, replies));
        (o, w)
    }

    fn begins_started(r: &Rig) -> usize {
        r.ops.borrow().iter().filter(|op| matches!(op, StoreOp::Begin(_))).count()
    }

    /// Ticks at `at_ms`; true when a recheck was dispatched.
    fn tick_at(r: &mut Rig, at_ms: u64) -> bool {
        let before = begins_started(r);
        r.h.0.now_ms.set(at_ms);
        r.root.on_tick();
        begins_started(r) > before
    }

    fn resumes(h: &FakeHost, context: u32) -> usize {
        h.0.calls.borrow().iter().filter(|c| **c == Call::Resume { context }).count()
    }

    fn replay() -> Begin {
        Begin::Replay(Snapshot { status: 201, headers: vec![], body: b"done".to_vec() })
    }

    #[test]
    fn a_remote_waiter_polls_with_backoff_and_gets_the_replay() {
        let mut r = rig(FailMode::Closed);
        let (_original, mut waiter) = original_and_waiter(&mut r);
        // Polls 50 ms after parking, then 100, 200, 400, 800 ms after each answer (the tick
        // checks every 100 ms in Envoy; here it is driven at the exact times).
        let mut at = 1_000;
        for gap in [50, 100, 200, 400, 800] {
            assert!(!tick_at(&mut r, at + gap - 1), "not before {}", at + gap);
            assert!(tick_at(&mut r, at + gap), "at {}", at + gap);
            // While its recheck is in flight the waiter is not due again.
            assert!(!tick_at(&mut r, at + gap + 5_000 - 1_000 * 4));
            r.h.0.now_ms.set(at + gap);
            r.begins.borrow_mut().push_back(IN_FLIGHT);
            answer(&mut r, Some("200"));
            at += gap;
        }
        assert_eq!(at, 2_550);
        // The original completes (elsewhere): the next poll replays it to the waiter.
        assert!(!tick_at(&mut r, 2_999), "the give-up time caps the backoff");
        assert!(tick_at(&mut r, 3_000));
        r.begins.borrow_mut().push_back(replay());
        answer(&mut r, Some("200"));
        assert_eq!(r.h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
        assert_eq!(r.h.counter("replayed"), 1);
        // The replay passes the waiter's encode callbacks: not captured as an upstream answer.
        *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
        assert_eq!(waiter.on_response_headers(true), Verdict::Continue);
        let settlements = r.ops.borrow().iter().filter(|op| !matches!(op, StoreOp::Begin(_))).count();
        assert_eq!(settlements, 0);
    }

    #[test]
    fn a_remote_waiter_that_finds_the_record_released_becomes_the_owner() {
        let mut r = rig(FailMode::Closed);
        let (_original, mut waiter) = original_and_waiter(&mut r);
        assert!(tick_at(&mut r, 1_050));
        answer(&mut r, Some("200")); // nothing scripted: the recheck claims
        assert_eq!(resumes(&r.h, 3), 1);
        assert_eq!(r.h.counter("claimed"), 2);
        assert!(r.h.replies().is_empty());
        // It is forwarded with its claim: its response is stored by the root.
        *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
        r.h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
        *r.h.0.response_body.borrow_mut() = b"{}".to_vec();
        assert_eq!(waiter.on_response_headers(false), Verdict::Continue);
        assert_eq!(waiter.on_response_body(2, true), Verdict::Pause);
        r.root.on_queue_ready(0);
        assert!(matches!(r.ops.borrow().last(), Some(StoreOp::Complete { .. })));
    }

    #[test]
    fn a_remote_waiter_gets_409_at_its_wait_timeout() {
        let mut r = rig(FailMode::Closed);
        let (_original, _waiter) = original_and_waiter(&mut r);
        assert!(tick_at(&mut r, 3_000));
        r.begins.borrow_mut().push_back(IN_FLIGHT);
        answer(&mut r, Some("200"));
        assert_eq!(r.h.replies(), vec![(3, 409, "idempotency_problem".to_string())]);
        assert_eq!(r.h.counter("wait_timed_out"), 1);
        assert!(!tick_at(&mut r, 10_000), "answered: no longer held");
    }

    #[test]
    fn a_remote_waiter_whose_client_left_releases_the_claim_its_recheck_got() {
        let mut r = rig(FailMode::Closed);
        let (_original, mut waiter) = original_and_waiter(&mut r);
        assert!(tick_at(&mut r, 1_050));
        waiter.on_log(); // the client left while the recheck was in flight
        drop(waiter);
        answer(&mut r, Some("200")); // the recheck claims
        assert!(matches!(r.ops.borrow().last(), Some(StoreOp::Release(_))), "{:?}", r.ops.borrow());
        answer(&mut r, Some("200"));
        assert_eq!(r.h.counter("released"), 1);
        assert_eq!(resumes(&r.h, 3), 0);
        assert!(r.h.replies().is_empty());
        // A client that left before its poll is not polled for.
        let (_original, mut waiter) = pair(&mut r, 4, 5);
        waiter.on_log();
        assert!(!tick_at(&mut r, 5_000));
    }

    #[test]
    fn a_store_failure_during_a_recheck_fails_closed_with_503() {
        let mut r = rig(FailMode::Closed);
        let (_original, _waiter) = original_and_waiter(&mut r);
        assert!(tick_at(&mut r, 1_050));
        answer(&mut r, None); // no :status: the callout failed
        let replies = r.h.replies();
        assert_eq!(replies.len(), 1);
        assert_eq!((replies[0].0, replies[0].1), (3, 503));
        assert_eq!(r.h.counter("store_error"), 1);
        assert_eq!(resumes(&r.h, 3), 0);
        // A refused callout is the same failure.
        let (_o, _w) = pair(&mut r, 4, 5);
        r.h.fail("dispatch_http_call", 1);
        r.h.0.now_ms.set(1_200);
        r.root.on_tick();
        assert_eq!(r.h.replies().last().map(|x| (x.0, x.1)), Some((5, 503)));
        assert_eq!(r.h.counter("store_error"), 2);
    }

    #[test]
    fn a_store_failure_during_a_recheck_fails_open_unprotected_and_counted() {
        let mut r = rig(FailMode::Open);
        let (_original, mut waiter) = original_and_waiter(&mut r);
        assert!(tick_at(&mut r, 1_050));
        answer(&mut r, Some("504")); // Envoy's timeout
        assert_eq!(resumes(&r.h, 3), 1);
        assert_eq!(r.h.counter("store_bypassed"), 1);
        assert!(r.h.replies().is_empty());
        // Forwarded without a claim: its response settles nothing.
        let ops = r.ops.borrow().len();
        *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
        r.h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
        assert_eq!(waiter.on_response_headers(true), Verdict::Continue);
        r.root.on_queue_ready(0);
        assert_eq!(r.ops.borrow().len(), ops);
    }

    #[test]
    fn a_completion_on_this_envoy_wakes_its_waiters_at_once() {
        let mut r = rig(FailMode::Closed);
        let (mut original, _waiter) = original_and_waiter(&mut r);
        // A poll is in flight when the original completes here.
        assert!(tick_at(&mut r, 1_050));
        let poll = last_token(&r.h);
        *r.h.0.response_headers.borrow_mut() = pairs(&[(":status", "201")]);
        r.h.0.properties.borrow_mut().insert("response.code_details".into(), b"via_upstream".to_vec());
        *r.h.0.response_body.borrow_mut() = b"{}".to_vec();
        original.on_response_headers(false);
        assert_eq!(original.on_response_body(2, true), Verdict::Pause);
        r.root.on_queue_ready(0); // starts the completion
        answer(&mut r, Some("200")); // the completion is written: wakes this Envoy's waiters
        assert_eq!(r.h.counter("stored"), 1);
        let before = begins_started(&r);
        r.root.on_queue_ready(0);
        assert_eq!(begins_started(&r), before, "its recheck is still in flight: marked woken");
        // That poll read the record before the completion: it looks again at once.
        *r.h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "200")]);
        r.begins.borrow_mut().push_back(IN_FLIGHT);
        r.root.on_http_call_response(poll, 2);
        assert!(tick_at(&mut r, 1_050));
        r.begins.borrow_mut().push_back(replay());
        answer(&mut r, Some("200"));
        assert_eq!(r.h.replies(), vec![(3, 201, "idempotency_replay".to_string())]);
        // Woken while not checking: rechecked from the queue callback itself.
        let (mut original, _waiter) = pair(&mut r, 4, 5);
        original.on_response_headers(false);
        assert_eq!(original.on_response_body(2, true), Verdict::Pause);
        r.root.on_queue_ready(0);
        answer(&mut r, Some("200"));
        let before = begins_started(&r);
        r.root.on_queue_ready(0);
        assert_eq!(begins_started(&r), before + 1, "rechecked on the wake-up, before its poll time");
    }
}

/// The real etcd store (`glue/etcd.rs`) with auth, on the fake host: a worker's streams share
/// one token fetch.
#[cfg(test)]
mod etcd_auth_tests {
    use super::*;

    const CONFIG: &str = r#"{"store":{"type":"etcd","cluster":"etcd","auth":{"username":"idem","password":"pw"}},
        "routes":[{"name":"orders","match":{"prefix":"/orders"},"require_key":true}]}"#;
    const AUTHENTICATE: &str = "/v3/auth/authenticate";

    fn rig(config: &str) -> (FakeHost, Root<FakeHost>) {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = config.as_bytes().to_vec();
        h.0.now_ms.set(1_000);
        h.0.clusters.borrow_mut().push("etcd".into());
        let mut root = Root::new(1, h.clone());
        assert!(root.on_configure());
        (h, root)
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    /// `n` protected POSTs, paused for their `begin`, which the root then starts.
    fn posts(h: &FakeHost, root: &mut Root<FakeHost>, ids: std::ops::Range<u32>) -> Vec<Http<FakeHost>> {
        let streams = ids
            .map(|id| {
                let mut http = root.http_context(id);
                let key = format!("k{id}");
                *h.0.request_headers.borrow_mut() =
                    pairs(&[(":method", "POST"), (":path", "/orders"), ("idempotency-key", &key)]);
                *h.0.request_body.borrow_mut() = b"{}".to_vec();
                assert_eq!(http.on_request_headers(false), Verdict::Pause);
                assert_eq!(http.on_request_body(2, true), Verdict::Pause);
                http
            })
            .collect();
        h.0.effective.set(1);
        root.on_queue_ready(0);
        streams
    }

    /// (token, :path) of every callout made so far.
    fn callouts(h: &FakeHost) -> Vec<(u32, String)> {
        h.dispatches()
            .into_iter()
            .filter_map(|c| match c {
                Call::Dispatch { token, headers, .. } => {
                    headers.into_iter().find(|(n, _)| n == ":path").map(|(_, p)| (token, p))
                }
                _ => None,
            })
            .collect()
    }

    fn fetches(h: &FakeHost) -> usize {
        callouts(h).iter().filter(|(_, p)| p == AUTHENTICATE).count()
    }

    fn answer(h: &FakeHost, root: &mut Root<FakeHost>, token: u32, status: &str, body: &str) {
        *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", status)]);
        *h.0.call_response_body.borrow_mut() = body.as_bytes().to_vec();
        h.0.effective.set(1);
        root.on_http_call_response(token, body.len());
    }

    fn timeouts(h: &FakeHost) -> Vec<u32> {
        h.dispatches()
            .into_iter()
            .filter_map(|c| match c {
                Call::Dispatch { timeout_ms, .. } => Some(timeout_ms),
                _ => None,
            })
            .collect()
    }

    fn replies_503(h: &FakeHost) -> Vec<u32> {
        h.0.calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                Call::SendResponse { context, status: 503, .. } => Some(*context),
                _ => None,
            })
            .collect()
    }

    const TOKEN: &str = r#"{"header":{"revision":"6"},"token":"tok.1"}"#;

    #[test]
    fn streams_without_a_token_share_one_fetch() {
        let (h, mut root) = rig(CONFIG);
        let _streams = posts(&h, &mut root, 2..6);
        assert_eq!(fetches(&h), 1, "{:?}", callouts(&h));
        // The fetch has its own timeout (store.auth.timeout, 2 s by default).
        assert_eq!(timeouts(&h), vec![2_000]);
        // Its answer sends every waiting stream's read, each with the token, on the store's
        // timeout (a fresh worker has no lease for a claim's puts yet: it reads first).
        let (token, _) = callouts(&h)[0].clone();
        answer(&h, &mut root, token, "200", TOKEN);
        let reads: Vec<_> = callouts(&h)[1..].to_vec();
        assert_eq!(reads.len(), 4, "{reads:?}");
        assert!(reads.iter().all(|(_, p)| p == "/v3/kv/txn"), "{reads:?}");
        assert_eq!(timeouts(&h)[1..], [250, 250, 250, 250]);
        assert!(h.dispatches()[1..].iter().all(|c| matches!(c, Call::Dispatch { headers, .. }
            if headers.iter().any(|(n, v)| n == "authorization" && v == "tok.1"))));
        assert_eq!(fetches(&h), 1);
    }

    #[test]
    fn a_fetch_that_times_out_fails_every_waiting_stream_by_its_fail_mode() {
        let (h, mut root) = rig(CONFIG);
        let _streams = posts(&h, &mut root, 2..6);
        let (token, _) = callouts(&h)[0].clone();
        // Envoy gives up on the fetch after its 2 s: its stream fails closed at once...
        h.0.now_ms.set(3_000);
        answer(&h, &mut root, token, "504", "upstream request timeout");
        assert_eq!(replies_503(&h), vec![2]);
        // ...and the waiting ones at the next tick (the fetch's deadline has passed).
        h.0.effective.set(1);
        root.on_tick();
        let mut failed = replies_503(&h);
        failed.sort_unstable();
        assert_eq!(failed, vec![2, 3, 4, 5]);
        assert_eq!(h.counter("store_error"), 4);
        assert_eq!(fetches(&h), 1, "no stream fetched on its own");
        assert_eq!(h.dispatches().len(), 1, "nothing sent without a token");
    }

    const REFUSED: &str = r#"{"error":"etcdserver: authentication failed, invalid user ID or password","message":"etcdserver: authentication failed, invalid user ID or password","code":3}"#;

    #[test]
    fn a_refused_fetch_fails_the_waiting_streams_at_once_and_nothing_stays_parked() {
        let (h, mut root) = rig(CONFIG);
        let _streams = posts(&h, &mut root, 2..5);
        let (token, _) = callouts(&h)[0].clone();
        answer(&h, &mut root, token, "400", REFUSED);
        let mut failed = replies_503(&h);
        failed.sort_unstable();
        assert_eq!(failed, vec![2, 3, 4]);
        // Nothing waits any more: a tick sends and answers nothing, and a new stream fetches
        // anew.
        let calls = h.0.calls.borrow().len();
        h.0.effective.set(1);
        root.on_tick();
        assert_eq!(h.0.calls.borrow().len(), calls);
        let _later = posts(&h, &mut root, 6..7);
        assert_eq!(fetches(&h), 2);
    }

    #[test]
    fn streams_that_left_while_waiting_end_with_nothing_held() {
        let (h, mut root) = rig(CONFIG);
        let streams = posts(&h, &mut root, 2..5);
        let (token, _) = callouts(&h)[0].clone();
        for mut s in streams {
            s.on_log();
        }
        // Envoy refuses the contexts of streams that are gone.
        h.fail("set_effective_context", 2);
        let calls = h.0.calls.borrow().len();
        answer(&h, &mut root, token, "400", REFUSED);
        h.0.now_ms.set(10_000);
        root.on_tick();
        assert_eq!(h.0.calls.borrow().len(), calls, "no reply, no callout for streams that left");
        // And the next stream, present, fetches anew and is answered.
        h.0.failing.borrow_mut().clear();
        let _later = posts(&h, &mut root, 6..7);
        assert_eq!(fetches(&h), 2);
    }
}

/// Detached execution (`execution: "detached"`): the root makes the call, records its answer
/// like an upstream answer, and answers the client if it is still there.
#[cfg(test)]
mod detached_tests {
    use super::*;

    const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"max_detached_calls":2,"routes":[
        {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
         "processing_timeout":"10s","upstream_timeout":"4s"}]}"#;

    fn host() -> FakeHost {
        let h = FakeHost::default();
        *h.0.config.borrow_mut() = CONFIG.as_bytes().to_vec();
        h.0.now_ms.set(1_000);
        h.0.clusters.borrow_mut().push("orders".into());
        h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
        h
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    fn root(h: &FakeHost) -> Root<FakeHost> {
        let mut root = Root::new(1, h.clone());
        assert!(root.on_configure());
        root
    }

    /// A protected POST of `key`, held; the root then makes its call (returned: the callout).
    fn posted(h: &FakeHost, root: &mut Root<FakeHost>, id: u32, key: &str) -> (Http<FakeHost>, Option<Call>) {
        let mut http = root.http_context(id);
        // Envoy runs a stream's callbacks with its own context the effective one.
        h.0.effective.set(id);
        *h.0.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", "/pay?x=1"),
            (":authority", "shop.example"),
            ("idempotency-key", key),
            ("content-type", "application/json"),
            ("content-length", "2"),
        ]);
        *h.0.request_body.borrow_mut() = b"{}".to_vec();
        assert_eq!(http.on_request_headers(false), Verdict::Pause);
        assert_eq!(http.on_request_body(2, true), Verdict::Pause, "held: the root carries it");
        let before = h.dispatches().len();
        h.0.effective.set(1);
        root.on_queue_ready(0);
        let call = (h.dispatches().len() > before).then(|| h.dispatches().last().cloned()).flatten();
        (http, call)
    }

    /// The upstream's answer, as Envoy's router hands it over (with its service time).
    fn answers(h: &FakeHost, status: &str, body: &[u8]) {
        *h.0.call_response_headers.borrow_mut() = pairs(&[
            (":status", status),
            ("content-type", "application/json"),
            ("x-order", "7"),
            ("x-envoy-upstream-service-time", "3"),
        ]);
        *h.0.call_response_body.borrow_mut() = body.to_vec();
    }

    /// Envoy's own 504 when `upstream_timeout` passed.
    fn times_out(h: &FakeHost) {
        *h.0.call_response_headers.borrow_mut() =
            pairs(&[(":status", "504"), ("content-type", "text/plain")]);
        *h.0.call_response_body.borrow_mut() = b"upstream request timeout".to_vec();
    }

    fn token(call: &Option<Call>) -> u32 {
        match call {
            Some(Call::Dispatch { token, .. }) => *token,
            other => panic!("no callout: {other:?}"),
        }
    }

    type Sent = (u16, Vec<(String, Vec<u8>)>, Vec<u8>);

    fn sent_to(h: &FakeHost, context: u32) -> Vec<Sent> {
        h.0.calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                Call::SendResponse { context: c, status, headers, body, .. } if *c == context => {
                    Some((*status, headers.clone(), body.clone()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_root_makes_the_call_records_the_answer_and_sends_it_as_the_first_response() {
        let h = host();
        let mut root = root(&h);
        let (mut http, call) = posted(&h, &mut root, 2, "k1");
        let Some(Call::Dispatch { context: 1, cluster, headers, body, timeout_ms: 4_000, .. }) = &call else {
            panic!("{call:?}")
        };
        assert_eq!(cluster, "orders");
        assert_eq!(body, b"{}");
        let h_of = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(
            (h_of(":method"), h_of(":path"), h_of(":authority")),
            (Some("POST"), Some("/pay?x=1"), Some("shop.example"))
        );
        assert_eq!(h_of("idempotency-key"), Some("k1"));
        assert_eq!(h_of("content-length"), None, "Envoy sets it from the body");
        assert_eq!(h.counter("claimed"), 1);
        answers(&h, "201", b"{\"id\":1}");
        root.on_http_call_response(token(&call), 8);
        assert_eq!(h.counter("stored"), 1);
        let sent = sent_to(&h, 2);
        let [(201, headers, body)] = sent.as_slice() else { panic!("{sent:?}") };
        assert_eq!(body, b"{\"id\":1}");
        assert!(headers.iter().any(|(n, v)| n == "x-order" && v == b"7"));
        assert!(!headers.iter().any(|(n, _)| n == crate::engine::REPLAYED_HEADER || n == ":status"));
        // Our own reply comes back through the encode callbacks: not an upstream answer.
        *h.0.response_headers.borrow_mut() =
            pairs(&[(":status", "201"), ("content-type", "application/json")]);
        assert_eq!(http.on_response_headers(false), Verdict::Continue);
        assert_eq!(http.on_response_body(8, true), Verdict::Continue);
        http.on_log();
        assert_eq!(h.counter("stored"), 1);
        // A retry is the replay.
        let (_, none) = posted(&h, &mut root, 3, "k1");
        assert!(none.is_none());
        let replay = sent_to(&h, 3);
        assert!(matches!(replay.as_slice(), [(201, headers, body)]
            if body == b"{\"id\":1}" && headers.iter().any(|(n, _)| n == crate::engine::REPLAYED_HEADER)));
    }

    #[test]
    fn a_client_gone_before_the_answer_still_has_its_answer_recorded() {
        let h = host();
        let mut root = root(&h);
        let (mut http, call) = posted(&h, &mut root, 2, "k2");
        http.on_log();
        drop(http);
        h.fail("set_effective_context", 2);
        answers(&h, "201", b"{}");
        root.on_http_call_response(token(&call), 2);
        assert_eq!(h.counter("stored"), 1);
        assert!(sent_to(&h, 2).is_empty(), "nobody to answer");
        h.0.failing.borrow_mut().clear();
        let (_, none) = posted(&h, &mut root, 3, "k2");
        assert!(none.is_none(), "the retry is not executed again");
        assert!(matches!(sent_to(&h, 3).as_slice(), [(201, _, _)]));
    }

    #[test]
    fn upstream_timeout_is_an_unknown_outcome_a_5xx_and_the_claim_stays() {
        let h = host();
        let mut root = root(&h);
        let (_http, call) = posted(&h, &mut root, 2, "k3");
        h.0.now_ms.set(1_000 + 4_000);
        times_out(&h);
        root.on_http_call_response(token(&call), 24);
        assert_eq!((h.counter("kept_unknown"), h.counter("stored")), (1, 0));
        let sent = sent_to(&h, 2);
        assert!(
            matches!(sent.as_slice(), [(504, _, body)] if String::from_utf8_lossy(body).contains("outcome-unknown"))
        );
        // A retry at once gets 409, never a second execution.
        let (_, none) = posted(&h, &mut root, 3, "k3");
        assert!(none.is_none());
        assert!(matches!(sent_to(&h, 3).as_slice(), [(409, _, _)]));
        // An upstream's own 504, sooner than the timeout, is its answer (released, by default).
        let (_, call) = posted(&h, &mut root, 4, "k4");
        answers(&h, "504", b"busy");
        root.on_http_call_response(token(&call), 4);
        assert_eq!(h.counter("released"), 1);
        assert!(matches!(sent_to(&h, 4).as_slice(), [(504, _, body)] if body == b"busy"));
    }

    #[test]
    fn past_max_detached_calls_a_new_key_gets_503_and_its_claim_back() {
        let h = host();
        let mut root = root(&h);
        let (_a, first) = posted(&h, &mut root, 2, "a");
        let (_b, second) = posted(&h, &mut root, 3, "b");
        assert!(first.is_some() && second.is_some());
        let (_c, third) = posted(&h, &mut root, 4, "c");
        assert!(third.is_none());
        assert!(matches!(sent_to(&h, 4).as_slice(), [(503, headers, body)]
            if String::from_utf8_lossy(body).contains("detached-capacity") && headers.iter().any(|(n, _)| n == "retry-after")));
        assert_eq!((h.counter("detached_refused"), h.counter("released")), (1, 1));
        // Once a call is over, the key executes (its claim was given back).
        answers(&h, "201", b"{}");
        root.on_http_call_response(token(&first), 2);
        let (_c, again) = posted(&h, &mut root, 5, "c");
        assert!(again.is_some());
        // An unknown cluster: Envoy refuses the call; 503, and the claim is given back.
        h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"nowhere".to_vec());
        let (_d, refused) = posted(&h, &mut root, 6, "d");
        assert!(refused.is_none());
        assert!(matches!(sent_to(&h, 6).as_slice(), [(503, _, _)]));
        assert_eq!((h.counter("detached_refused"), h.counter("released")), (2, 2));
    }
}

/// Issue 19: over every order of the events around one key's detached call (its client leaves,
/// the call's answer, a retry, the lease's end) followed by a last retry, the key executes
/// once, and every retry that comes after the answer gets the replay. The host guarantees the
/// answer (or its timeout) comes before the lease ends (`upstream_timeout` < `processing_timeout`),
/// so the lease's end is ordered after the answer.
#[cfg(test)]
mod detached_model {
    use super::*;

    const CONFIG: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
        {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
         "processing_timeout":"10s","upstream_timeout":"4s"}]}"#;
    /// The same route with `unknown_outcome: "refuse"`: then no answer at all (Envoy's timeout)
    /// never executes twice either.
    const REFUSE: &str = r#"{"store":{"type":"local","capacity":64},"routes":[
        {"name":"pay","match":{"prefix":"/pay"},"require_key":true,"execution":"detached",
         "processing_timeout":"10s","upstream_timeout":"4s","unknown_outcome":"refuse"}]}"#;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Event {
        ClientGone,
        Answer,
        Retry,
        LeaseEnd,
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    /// A POST of the key on a new stream `id`; the root then runs what it was handed.
    fn post(h: &FakeHost, root: &mut Root<FakeHost>, id: u32) -> Http<FakeHost> {
        let mut http = root.http_context(id);
        h.0.effective.set(id);
        *h.0.request_headers.borrow_mut() =
            pairs(&[(":method", "POST"), (":path", "/pay"), (":authority", "a"), ("idempotency-key", "k")]);
        *h.0.request_body.borrow_mut() = b"{}".to_vec();
        http.on_request_headers(false);
        http.on_request_body(2, true);
        h.0.effective.set(1);
        root.on_queue_ready(0);
        http
    }

    fn replies_to(h: &FakeHost, id: u32) -> Vec<(u16, bool)> {
        h.0.calls
            .borrow()
            .iter()
            .filter_map(|c| match c {
                Call::SendResponse { context, status, headers, .. } if *context == id => {
                    Some((*status, headers.iter().any(|(n, _)| n == crate::engine::REPLAYED_HEADER)))
                }
                _ => None,
            })
            .collect()
    }

    fn permutations(items: &[Event]) -> Vec<Vec<Event>> {
        if items.len() <= 1 {
            return vec![items.to_vec()];
        }
        let mut out = Vec::new();
        for i in 0..items.len() {
            let mut rest = items.to_vec();
            let first = rest.remove(i);
            for mut tail in permutations(&rest) {
                tail.insert(0, first);
                out.push(tail);
            }
        }
        out
    }

    #[test]
    fn no_order_of_events_executes_a_key_twice() {
        let orders =
            permutations(&[Event::ClientGone, Event::Answer, Event::Retry, Event::Retry, Event::LeaseEnd]);
        let mut checked = 0;
        for order in orders {
            let answer_at = order.iter().position(|e| *e == Event::Answer).unwrap_or(0);
            if order.iter().position(|e| *e == Event::LeaseEnd) < Some(answer_at) {
                continue; // the host answers (or times out) before the lease ends
            }
            for (config, status) in [(CONFIG, "201"), (CONFIG, "422"), (REFUSE, "201"), (REFUSE, "timeout")] {
                let h = FakeHost::default();
                *h.0.config.borrow_mut() = config.as_bytes().to_vec();
                h.0.now_ms.set(1_000);
                h.0.clusters.borrow_mut().push("orders".into());
                h.0.properties.borrow_mut().insert("xds.cluster_name".into(), b"orders".to_vec());
                let mut root = Root::new(1, h.clone());
                assert!(root.on_configure());
                let mut streams = vec![post(&h, &mut root, 2)];
                let mut next_id = 3;
                let mut answered = false;
                let mut retries_after_answer = Vec::new();
                for event in &order {
                    match event {
                        Event::ClientGone => {
                            h.0.effective.set(2);
                            streams[0].on_log();
                            h.0.gone.borrow_mut().push(2);
                        }
                        Event::Answer => {
                            let token = h.dispatches().iter().find_map(|c| match c {
                                Call::Dispatch { token, .. } => Some(*token),
                                _ => None,
                            });
                            if status == "timeout" {
                                // Envoy's own 504: no answer from the upstream.
                                *h.0.call_response_headers.borrow_mut() = pairs(&[(":status", "504")]);
                                *h.0.call_response_body.borrow_mut() = b"upstream request timeout".to_vec();
                            } else {
                                *h.0.call_response_headers.borrow_mut() =
                                    pairs(&[(":status", status), ("x-envoy-upstream-service-time", "1")]);
                                *h.0.call_response_body.borrow_mut() = b"{}".to_vec();
                            }
                            h.0.now_ms.set(h.0.now_ms.get() + 50);
                            root.on_http_call_response(token.unwrap_or(0), 2);
                            answered = true;
                        }
                        Event::Retry => {
                            streams.push(post(&h, &mut root, next_id));
                            if answered {
                                retries_after_answer.push(next_id);
                            }
                            next_id += 1;
                        }
                        Event::LeaseEnd => {
                            h.0.now_ms.set(h.0.now_ms.get() + 10_001);
                            root.on_tick();
                        }
                    }
                }
                let last = next_id;
                streams.push(post(&h, &mut root, last));
                retries_after_answer.push(last);
                let executions = h.dispatches().len();
                assert_eq!(executions, 1, "{order:?} {status}: executed {executions} times");
                for id in retries_after_answer {
                    // The replay, or for an unknown outcome on a refuse rule its 502.
                    let expected = match status.parse::<u16>() {
                        Ok(s) => (s, true),
                        Err(_) => (502, false),
                    };
                    assert_eq!(replies_to(&h, id), vec![expected], "{order:?} {status}: retry #{id}");
                }
                checked += 1;
            }
        }
        assert!(checked >= 200, "{checked} orders");
    }
}
