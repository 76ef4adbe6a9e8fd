//! The built module under an emulated Envoy 1.40: the `.wasm` that `make build` writes, loaded
//! in wasmi (a WebAssembly interpreter in plain Rust) and driven through its raw proxy-wasm ABI
//! only, the way Envoy drives it: `_initialize`, then a root context (`proxy_on_context_create`,
//! `proxy_on_vm_start`, `proxy_on_configure`), then per stream its context, request headers and
//! body, response headers and body, `proxy_on_log`, `proxy_on_done`, `proxy_on_delete`.
//!
//! `host.rs` is the host (Envoy's imports, with its rules); this file is the driver (Envoy's
//! side of each callback: what it hands over before, what it does with the answer after,
//! including the work it defers until a VM call returns: local replies, which go back through
//! the module's own encode callbacks, and resumed streams). Nothing here knows the module's
//! internals: tests see what Envoy would see.

pub mod host;
mod imports;
pub mod wire;

use host::{After, Callback, ClientResponse, Host, Stream};
use std::path::PathBuf;
use wasmi::{Config, Engine, Error, Instance, Module, Store, Val};
use wire::Pairs;

/// `proxy_on_request_headers` and friends: go on with the stream.
pub const CONTINUE: u32 = 0;
/// Stop iteration (headers held; with a body callback, buffer it).
pub const STOP: u32 = 1;

/// The module the tests run: `FILTER_WASM` (relative to the repository root unless absolute),
/// by default the one `make build` writes.
pub fn module_path() -> PathBuf {
    let name = std::env::var("FILTER_WASM").unwrap_or_else(|_| "dist/idempotency_filter.wasm".to_string());
    let path = PathBuf::from(name);
    if path.is_absolute() {
        return path;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// The module's bytes. A missing module fails the test that asked (never a skip): a green run
/// must have run the module.
pub fn module_bytes() -> Vec<u8> {
    let path = module_path();
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!("cannot read the module {} ({e}): run `make build` first, or set FILTER_WASM", path.display())
    })
}

/// The head of a keyed JSON POST to `path` on `shop.example`, as the tests and
/// `examples/fuel.rs` send it.
pub fn keyed_post<'a>(path: &'a str, key: &'a str) -> [(&'a str, &'a str); 5] {
    [
        (":method", "POST"),
        (":path", path),
        (":authority", "shop.example"),
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ]
}

/// One VM: the module instantiated against the emulated host, with one root context (id 1)
/// once `start` ran.
pub struct Envoy {
    store: Store<Host>,
    instance: Instance,
    pub root: u32,
    next_context: u32,
    /// Fuel each export used, by name (`load_metered`).
    pub fuel_by_export: std::collections::BTreeMap<String, u64>,
}

impl Envoy {
    /// Loads the module as Envoy does: validated, linked against Envoy's imports (an import
    /// this host lacks fails here, by name), its ABI version checked, then `_initialize` (a
    /// reactor) or `_start`.
    pub fn load(wasm: &[u8]) -> Result<Envoy, Error> {
        Envoy::load_on(Engine::default(), wasm)
    }

    /// `load`, with the module's instructions counted (wasmi's fuel: about one unit per
    /// instruction, charged for a whole block as it is entered, so code a branch skips inside
    /// the block counts too; the host's own work, Envoy's side of each call, is not counted).
    /// For `examples/fuel.rs`: what a path costs in the module, free of the machine's noise,
    /// which hides a few percent of CPU.
    pub fn load_metered(wasm: &[u8]) -> Result<Envoy, Error> {
        let mut config = Config::default();
        config.consume_fuel(true);
        Envoy::load_on(Engine::new(&config), wasm)
    }

    /// Fuel left (see `load_metered`); 0 on an engine that does not count.
    pub fn fuel(&self) -> u64 {
        self.store.get_fuel().unwrap_or(0)
    }

    fn load_on(engine: Engine, wasm: &[u8]) -> Result<Envoy, Error> {
        let module = Module::new(&engine, wasm)?;
        let mut store = Store::new(&engine, Host::new());
        // Fails (and is not needed) on an engine that does not count fuel.
        let _ = store.set_fuel(u64::MAX / 2);
        let linker = imports::linker(&engine)?;
        let instance = linker.instantiate_and_start(&mut store, &module)?;
        let versions = ["proxy_abi_version_0_2_1", "proxy_abi_version_0_2_0", "proxy_abi_version_0_1_0"];
        if !versions.iter().any(|v| instance.get_func(&store, v).is_some()) {
            return Err(Error::new("the module exports no proxy_abi_version_* Envoy knows"));
        }
        let memory = instance.get_memory(&store, "memory").ok_or_else(|| Error::new("no memory export"))?;
        // proxy-wasm-cpp-host prefers `malloc`, then the ABI's own allocator.
        let malloc = instance
            .get_typed_func::<i32, i32>(&store, "malloc")
            .or_else(|_| instance.get_typed_func::<i32, i32>(&store, "proxy_on_memory_allocate"))?;
        store.data_mut().memory = Some(memory);
        store.data_mut().malloc = Some(malloc);
        let mut envoy =
            Envoy { store, instance, root: 0, next_context: 1, fuel_by_export: Default::default() };
        envoy.store.data_mut().initializing = true;
        let start = ["_initialize", "_start"]
            .into_iter()
            .find(|f| envoy.instance.get_func(&envoy.store, f).is_some());
        if let Some(start) = start {
            envoy.call(0, start, &[])?;
        }
        envoy.store.data_mut().initializing = false;
        Ok(envoy)
    }

    /// `load` of the module `module_bytes` names; panics (with the reason) when it fails.
    pub fn load_built() -> Envoy {
        Envoy::load(&module_bytes()).unwrap_or_else(|e| panic!("Envoy would not load the module: {e}"))
    }

    pub fn host(&self) -> &Host {
        self.store.data()
    }

    pub fn host_mut(&mut self) -> &mut Host {
        self.store.data_mut()
    }

    pub fn stream(&self, id: u32) -> &Stream {
        self.host().streams.get(&id).unwrap_or_else(|| panic!("no stream {id}"))
    }

    pub fn stream_mut(&mut self, id: u32) -> &mut Stream {
        self.host_mut().streams.get_mut(&id).unwrap_or_else(|| panic!("no stream {id}"))
    }

    /// Sets one of Envoy's properties of stream `id` (strings as bytes, numbers as 8 bytes LE).
    pub fn set_property(&mut self, id: u32, path: &[&str], value: &[u8]) {
        self.stream_mut(id).properties.insert(host::prop_key(path), value.to_vec());
    }

    pub fn advance_ms(&mut self, ms: u64) {
        self.host_mut().now_ns += ms * 1_000_000;
    }

    /// Calls an export as Envoy does: on entry the effective context is the callback's own
    /// (`context`); its result, if it has one. Missing callbacks are not called (None). Envoy's
    /// deferred work is not done here (`settle`).
    pub fn call(&mut self, context: u32, name: &str, args: &[u32]) -> Result<Option<u32>, Error> {
        let Some(func) = self.instance.get_func(&self.store, name) else { return Ok(None) };
        let args: Vec<Val> = args.iter().map(|a| Val::I32(*a as i32)).collect();
        let mut results = vec![Val::I32(0); func.ty(&self.store).results().len()];
        let saved = std::mem::replace(&mut self.store.data_mut().effective, context);
        let fuel = self.fuel();
        let outcome = func.call(&mut self.store, &args, &mut results);
        let used = fuel.saturating_sub(self.fuel());
        *self.fuel_by_export.entry(name.to_string()).or_default() += used;
        self.store.data_mut().effective = saved;
        outcome?;
        Ok(results.first().and_then(Val::i32).map(|r| r as u32))
    }

    /// `call`, then Envoy's deferred work; a trap fails the test, with the module's last lines.
    pub fn callback(&mut self, context: u32, name: &str, args: &[u32]) -> Option<u32> {
        let result = self.call(context, name, args).unwrap_or_else(|e| self.trapped(name, e));
        self.settle();
        result
    }

    fn callback_with(&mut self, context: u32, name: &str, args: &[u32], callback: Callback) -> Option<u32> {
        self.host_mut().callback = callback;
        let result = self.call(context, name, args).unwrap_or_else(|e| self.trapped(name, e));
        self.host_mut().callback = Callback::Plain;
        self.settle();
        result
    }

    fn trapped(&self, name: &str, error: Error) -> ! {
        let last: Vec<_> = self.host().logs.iter().rev().take(5).collect();
        panic!("{name} trapped: {error}; the module's last log lines: {last:?}")
    }

    /// The root context (id 1), started with `configuration` as Envoy starts a plugin: created,
    /// `proxy_on_vm_start` with an empty VM configuration, `proxy_on_configure`. What it answered.
    pub fn start(&mut self, configuration: &str) -> bool {
        let root = self.next_id();
        self.root = root;
        self.host_mut().roots.insert(root, host::RootContext::default());
        self.callback(root, "proxy_on_context_create", &[root, 0]);
        let started =
            self.callback_with(root, "proxy_on_vm_start", &[root, 0], Callback::VmStart(Vec::new()));
        assert_eq!(started, Some(1), "proxy_on_vm_start refused");
        let config = configuration.as_bytes().to_vec();
        let size = config.len() as u32;
        self.callback_with(root, "proxy_on_configure", &[root, size], Callback::Configure(config)) == Some(1)
    }

    fn next_id(&mut self) -> u32 {
        let id = self.next_context;
        self.next_context += 1;
        id
    }

    /// A new HTTP stream on the root: its context id. Envoy always answers the router's
    /// attempt count (0 before any attempt).
    pub fn new_stream(&mut self) -> u32 {
        let id = self.next_id();
        let root = self.root;
        let mut stream = Stream { root, ..Stream::default() };
        stream
            .properties
            .insert(host::prop_key(&["upstream", "request_attempt_count"]), 0u64.to_le_bytes().to_vec());
        self.host_mut().streams.insert(id, stream);
        self.callback(id, "proxy_on_context_create", &[id, root]);
        id
    }

    /// The client's request headers arrive: `proxy_on_request_headers`, its answer.
    pub fn request_headers(&mut self, id: u32, headers: &[(&str, &str)], end_of_stream: bool) -> u32 {
        let stream = self.stream_mut(id);
        stream.request_headers = wire::pairs(headers);
        stream.request_headers_live = true;
        let n = headers.len() as u32;
        let action = self.call(id, "proxy_on_request_headers", &[id, n, u32::from(end_of_stream)]);
        let action =
            action.unwrap_or_else(|e| self.trapped("proxy_on_request_headers", e)).unwrap_or(CONTINUE);
        if action == CONTINUE {
            // Envoy lets go of the map: later reads of it are refused until on_log.
            self.stream_mut(id).request_headers_live = false;
        }
        self.settle();
        if action == CONTINUE && end_of_stream {
            self.forward(id);
        }
        action
    }

    /// A frame of the request body arrives (Envoy buffers it while the module says Stop):
    /// `proxy_on_request_body` with the size buffered so far, its answer. None when Envoy would
    /// not call: the stream was answered already.
    pub fn request_body(&mut self, id: u32, chunk: &[u8], end_of_stream: bool) -> Option<u32> {
        if self.stream(id).replied {
            return None;
        }
        let stream = self.stream_mut(id);
        stream.request_body.extend_from_slice(chunk);
        let size = stream.request_body.len() as u32;
        let action = self.call(id, "proxy_on_request_body", &[id, size, u32::from(end_of_stream)]);
        let action = action.unwrap_or_else(|e| self.trapped("proxy_on_request_body", e)).unwrap_or(CONTINUE);
        self.settle();
        if action == CONTINUE && !self.stream(id).replied && end_of_stream {
            self.forward(id);
        }
        Some(action)
    }

    /// The request goes upstream, headers and the body Envoy holds; the router's first attempt
    /// and its upstream host are properties from now on.
    fn forward(&mut self, id: u32) {
        let stream = self.stream_mut(id);
        if stream.upstream.is_some() || stream.replied {
            return;
        }
        let body = std::mem::take(&mut stream.request_body);
        stream.upstream = Some((stream.request_headers.clone(), body));
        stream
            .properties
            .insert(host::prop_key(&["upstream", "request_attempt_count"]), 1u64.to_le_bytes().to_vec());
        stream.properties.insert(host::prop_key(&["upstream", "address"]), b"127.0.0.1:8080".to_vec());
    }

    /// The upstream answers a forwarded request: response headers, then the whole body in one
    /// frame (none when empty). The answers of `proxy_on_response_headers` and
    /// `proxy_on_response_body` (None: not called).
    pub fn upstream_responds(
        &mut self,
        id: u32,
        status: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u32, Option<u32>) {
        assert!(self.stream(id).upstream.is_some(), "stream {id}: nothing went upstream to answer");
        self.set_property(id, &["response", "code"], &u64::from(status).to_le_bytes());
        self.set_property(id, &["response", "code_details"], b"via_upstream");
        self.set_property(id, &["response", "flags"], &0u64.to_le_bytes());
        let mut map = vec![(":status".to_string(), status.to_string().into_bytes())];
        map.extend(wire::pairs(headers));
        map.push(("x-envoy-upstream-service-time".to_string(), b"1".to_vec()));
        self.respond(id, map, body.to_vec())
    }

    /// A response (the upstream's or a local reply) through the module's encode callbacks.
    fn respond(&mut self, id: u32, headers: Pairs, body: Vec<u8>) -> (u32, Option<u32>) {
        let stream = self.stream_mut(id);
        let n = headers.len() as u32;
        stream.response_headers = headers;
        stream.response_headers_live = true;
        stream.client = Some(ClientResponse::default());
        let eos = body.is_empty();
        let action = self.call(id, "proxy_on_response_headers", &[id, n, u32::from(eos)]);
        let action =
            action.unwrap_or_else(|e| self.trapped("proxy_on_response_headers", e)).unwrap_or(CONTINUE);
        if action == CONTINUE {
            self.let_go_response(id);
            self.stream_mut(id).response_headers_live = false;
        }
        self.settle();
        if eos {
            return (action, None);
        }
        let stream = self.stream_mut(id);
        stream.response_body.extend_from_slice(&body);
        let size = stream.response_body.len() as u32;
        let body_action = self.call(id, "proxy_on_response_body", &[id, size, 1]);
        let body_action =
            body_action.unwrap_or_else(|e| self.trapped("proxy_on_response_body", e)).unwrap_or(CONTINUE);
        if body_action == CONTINUE {
            self.let_go_response(id);
        }
        self.settle();
        (action, Some(body_action))
    }

    /// What Envoy holds of the response goes to the client: the headers (as the module left
    /// them) the first time, and the body buffered so far.
    fn let_go_response(&mut self, id: u32) {
        let stream = self.stream_mut(id);
        let body = std::mem::take(&mut stream.response_body);
        let headers = stream.response_headers.clone();
        let client = stream.client.get_or_insert_with(ClientResponse::default);
        if client.headers.is_empty() {
            client.headers = headers;
        }
        client.body.extend_from_slice(&body);
    }

    /// The stream ends as Envoy ends every stream: `proxy_on_log` (the maps readable, as for an
    /// access log), `proxy_on_done`, `proxy_on_delete`; the context is gone after.
    pub fn end_stream(&mut self, id: u32) {
        self.stream_mut(id).logging = true;
        self.callback(id, "proxy_on_log", &[id]);
        self.stream_mut(id).logging = false;
        self.callback(id, "proxy_on_done", &[id]);
        self.callback(id, "proxy_on_delete", &[id]);
        self.host_mut().streams.remove(&id);
    }

    /// One period of the root's timer passes: the clock moves by it and `proxy_on_tick` runs.
    pub fn tick(&mut self) {
        let root = self.root;
        let period = self.host().roots.get(&root).map_or(0, |r| r.tick_ms);
        assert!(period > 0, "the root set no tick period");
        self.advance_ms(u64::from(period));
        self.callback(root, "proxy_on_tick", &[root]);
    }

    /// The answer to callout `token` arrives at the root that made it
    /// (`proxy_on_http_call_response`, its maps and body readable during the call).
    pub fn answer_http_call(
        &mut self,
        token: u32,
        headers: &[(&str, &str)],
        body: &[u8],
        trailers: &[(&str, &str)],
    ) {
        let call = self.host().http_calls.iter().find(|c| c.token == token).cloned();
        let call = call.unwrap_or_else(|| panic!("no callout {token}"));
        let (headers, trailers) = (wire::pairs(headers), wire::pairs(trailers));
        let args = [call.root, token, headers.len() as u32, body.len() as u32, trailers.len() as u32];
        let answer = Callback::HttpCallResponse { headers, body: body.to_vec(), trailers };
        self.callback_with(call.root, "proxy_on_http_call_response", &args, answer);
    }

    /// A message on gRPC stream `token` arrives at the root (`proxy_on_grpc_receive`).
    pub fn grpc_receive(&mut self, token: u32, message: &[u8]) {
        let root = self.root;
        let args = [root, token, message.len() as u32];
        self.callback_with(root, "proxy_on_grpc_receive", &args, Callback::GrpcReceive(message.to_vec()));
    }

    /// Envoy's work after a VM call, until none is left: local replies (through the module's
    /// encode callbacks), resumed requests and responses, then the queue owners told of what
    /// was enqueued (Envoy posts that to the owner's dispatcher: after the call, never inside).
    pub fn settle(&mut self) {
        for _ in 0..10_000 {
            if let Some(after) = self.host_mut().after.pop_front() {
                self.deferred(after);
            } else if let Some((owner, token)) = self.host_mut().queue_ready.pop_front() {
                if self.host().roots.contains_key(&owner) {
                    self.callback(owner, "proxy_on_queue_ready", &[owner, token]);
                }
            } else {
                return;
            }
        }
        panic!("Envoy's deferred work never ended: the module keeps asking for more");
    }

    fn deferred(&mut self, after: After) {
        match after {
            After::LocalReply(id) => {
                let Some(stream) = self.host_mut().streams.get_mut(&id) else { return };
                let Some(reply) = stream.local_responses.last().cloned() else { return };
                if stream.replied {
                    self.host_mut().violations.push(format!("stream {id}: a second local reply"));
                    return;
                }
                // The request goes no further; its held map stays the stream's, as in Envoy.
                stream.replied = true;
                self.set_property(id, &["response", "code"], &u64::from(reply.status).to_le_bytes());
                self.set_property(id, &["response", "code_details"], reply.details.as_bytes());
                self.set_property(id, &["response", "flags"], &0u64.to_le_bytes());
                // Envoy's local reply (Utility::prepareLocalReply): its status and the module's
                // headers; a body gets its length, and text/plain unless the module set a type;
                // an empty body loses any content-type.
                let mut headers = vec![(":status".to_string(), reply.status.to_string().into_bytes())];
                headers.extend(reply.headers.iter().map(|(n, v)| (n.to_ascii_lowercase(), v.clone())));
                if reply.body.is_empty() {
                    headers.retain(|(n, _)| n != "content-type");
                } else {
                    headers.push(("content-length".to_string(), reply.body.len().to_string().into_bytes()));
                    if !headers.iter().any(|(n, _)| n == "content-type") {
                        headers.push(("content-type".to_string(), b"text/plain".to_vec()));
                    }
                }
                self.respond(id, headers, reply.body);
            }
            After::ContinueRequest(id) => {
                if self.host().streams.contains_key(&id) {
                    self.forward(id);
                }
            }
            After::ContinueResponse(id) => {
                if self.host().streams.contains_key(&id) {
                    self.let_go_response(id);
                    self.stream_mut(id).response_headers_live = false;
                }
            }
        }
    }
}
