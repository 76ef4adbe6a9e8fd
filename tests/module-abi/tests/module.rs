//! The built module as Envoy runs it: `dist/idempotency_filter.wasm` (or `FILTER_WASM`) loaded
//! in an emulated Envoy 1.40 host (this crate's `src/`) and driven through the raw proxy-wasm
//! ABI only, so that the module's exports (`glue/abi.rs`) and its host calls (`glue/host.rs`),
//! which no native test compiles, are tested without an Envoy: what it asks of Envoy, what it
//! answers, what it writes into shared data. A missing module fails every test.
//!
//! C8: a new key is claimed and forwarded (the request body's callback answers Continue), the
//! client gets the upstream's answer, and the record is written to shared data.
//! C9: a retry is answered with `proxy_send_local_response`: the stored status and body byte
//! for byte (a NUL and non-UTF-8 bytes included), the stored headers and `idempotent-replayed:
//! true`; it does not continue, and nothing goes upstream.
//! C10: a retry while the key is in flight gets 409 `request-in-flight` from
//! `proxy_send_local_response`.
//! C13: on a `takeover` rule, a stream that ends without a response (an upstream reset, the
//! client gone) leaves its key in flight until its lease ends, then a retry is forwarded again.
//! C25: an owner that ends without an outcome leaves a claim that lasts until its lease's end.
//! A refused configuration (a mistyped field, or not JSON) makes `proxy_on_configure` answer
//! false with one critical line naming the field (or where the JSON breaks); an unknown context
//! id in a callback is logged or ignored, never a trap.

use module_abi::host::{prop_key, LocalResponse, LOG_CRITICAL};
use module_abi::{keyed_post, Envoy, CONTINUE, STOP};

const LOG_WARN: i32 = 3;

/// The local store, a rule per `unknown_outcome` that leaves a claim in flight or not.
const CONFIG: &str = r#"{"publish_outcome":true,"store":{"type":"local","capacity":64},"routes":[
    {"name":"orders","match":{"prefix":"/orders","methods":["POST"]},"require_key":true,"processing_timeout":"3s"},
    {"name":"jobs","match":{"prefix":"/jobs","methods":["POST"]},"require_key":true,"processing_timeout":"3s",
     "unknown_outcome":"takeover"}]}"#;

const BODY: &[u8] = br#"{"item":"book","qty":1}"#;
/// The upstream's answer, with bytes a text-only copy would lose or cut short.
const ANSWER: &[u8] = b"{\"id\":\"ord_1\"}\x00\xff\xfe\r\n tail";

fn started() -> Envoy {
    let mut envoy = Envoy::load_built();
    assert!(envoy.start(CONFIG), "configuration refused: {:?}", envoy.host().logs);
    envoy
}

/// A keyed POST on a new stream, headers then its whole body in one frame: the stream and the
/// answer of its body callback (None: Envoy never called it, the stream was answered).
fn post(envoy: &mut Envoy, path: &str, key: &str) -> (u32, Option<u32>) {
    let id = envoy.new_stream();
    // Held at its headers: the decision needs the body's fingerprint.
    assert_eq!(envoy.request_headers(id, &keyed_post(path, key), false), STOP);
    let body = envoy.request_body(id, BODY, true);
    (id, body)
}

/// The only local reply stream `id` got.
fn only_reply(envoy: &Envoy, id: u32) -> LocalResponse {
    match envoy.stream(id).local_responses.as_slice() {
        [reply] => reply.clone(),
        other => panic!("stream {id}: expected one local reply, got {other:?}"),
    }
}

/// A retry of `key` on `path` that is answered locally (never forwarded): the reply.
fn refused_retry(envoy: &mut Envoy, path: &str, key: &str) -> LocalResponse {
    let (id, action) = post(envoy, path, key);
    assert_eq!(action, Some(STOP), "a retry answered locally does not continue");
    assert!(envoy.stream(id).upstream.is_none(), "nothing of it goes upstream");
    let reply = only_reply(envoy, id);
    envoy.end_stream(id);
    reply
}

/// A new key on `path`, executed by the upstream with a 201 and `ANSWER`, to the stream's end.
fn executed(envoy: &mut Envoy, path: &str, key: &str) {
    let (id, action) = post(envoy, path, key);
    assert_eq!(action, Some(CONTINUE));
    let answers = envoy.upstream_responds(id, 201, &[("content-type", "application/octet-stream")], ANSWER);
    assert_eq!(answers, (CONTINUE, Some(CONTINUE)));
    envoy.end_stream(id);
}

fn assert_clean(envoy: &Envoy) {
    assert!(envoy.host().violations.is_empty(), "{:?}", envoy.host().violations);
}

#[test]
fn a_new_key_is_claimed_forwarded_and_its_answer_stored() {
    let mut envoy = started();
    let before = envoy.host().shared_writes.len();
    let (id, action) = post(&mut envoy, "/orders", "order-1");
    assert_eq!(action, Some(CONTINUE));
    let stream = envoy.stream(id);
    assert!(stream.local_responses.is_empty());
    // Headers and body reached the upstream as the client sent them.
    let (headers, body) = stream.upstream.clone().expect("forwarded");
    assert_eq!(body, BODY);
    assert!(headers.contains(&("idempotency-key".to_string(), b"order-1".to_vec())));
    // The claim is a shared-data write.
    let claimed = envoy.host().shared_writes.len();
    assert!(claimed > before, "no claim written");

    let answers = envoy.upstream_responds(id, 201, &[("content-type", "application/octet-stream")], ANSWER);
    assert_eq!(answers, (CONTINUE, Some(CONTINUE)));
    let client = envoy.stream(id).client.clone().expect("answered");
    assert_eq!((client.status(), client.body.as_slice()), (Some(201), ANSWER));
    assert_eq!(client.header("idempotent-replayed"), None);
    envoy.end_stream(id);

    // The record holds the answer: a value written since the claim carries its bytes.
    let host = envoy.host();
    let stored = host.shared_writes[claimed..]
        .iter()
        .filter_map(|key| host.shared.get(key))
        .any(|(value, _)| value.windows(ANSWER.len()).any(|w| w == ANSWER));
    assert!(stored, "no shared-data value holds the answer");
    // Counted, and handed to Envoy at the root's next tick.
    envoy.tick();
    assert_eq!(envoy.host().metric("idempotency.route.orders.requests_total.claimed"), 1);
    assert_eq!(envoy.host().metric("idempotency.route.orders.requests_total.stored"), 1);
    assert_clean(&envoy);
}

#[test]
fn a_retry_is_answered_with_the_stored_answer_byte_for_byte() {
    let mut envoy = started();
    executed(&mut envoy, "/orders", "order-2");

    let (id, action) = post(&mut envoy, "/orders", "order-2");
    assert_eq!(action, Some(STOP), "a replay does not continue");
    assert!(envoy.stream(id).upstream.is_none(), "a replay sends nothing upstream");
    let reply = only_reply(&envoy, id);
    assert_eq!(reply.status, 201);
    assert_eq!(reply.body, ANSWER);
    assert_eq!(reply.header("idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(reply.header("content-type"), Some(&b"application/octet-stream"[..]));
    // What the client got, after the reply came back through the module's encode callbacks.
    let client = envoy.stream(id).client.clone().expect("answered");
    assert_eq!((client.status(), client.body.as_slice()), (Some(201), ANSWER));
    assert_eq!(client.header("idempotent-replayed"), Some(&b"true"[..]));
    // The outcome is published for the access log (filter state).
    let outcome = envoy.stream(id).filter_state.get("idempotency.outcome").cloned().unwrap_or_default();
    assert!(outcome.starts_with(b"replayed"), "{:?}", String::from_utf8_lossy(&outcome));
    envoy.end_stream(id);
    envoy.tick();
    assert_eq!(envoy.host().metric("idempotency.route.orders.requests_total.replayed"), 1);
    assert_clean(&envoy);
}

#[test]
fn a_stream_that_ends_without_a_response_leaves_its_key_in_flight_on_a_takeover_rule() {
    let mut envoy = started();
    // Ways a forwarded request ends with no response while the upstream may have executed it.
    let ends: [(&str, &str, u64); 2] = [
        ("reset", "upstream_reset_before_response_started{connection_termination}", 0x40),
        ("gone", "downstream_remote_disconnect", 0x4000),
    ];
    for (key, details, flags) in ends {
        let (id, action) = post(&mut envoy, "/jobs", key);
        assert_eq!(action, Some(CONTINUE));
        envoy.set_property(id, &["response", "code_details"], details.as_bytes());
        envoy.set_property(id, &["response", "flags"], &flags.to_le_bytes());
        envoy.end_stream(id);

        let reply = refused_retry(&mut envoy, "/jobs", key);
        assert_eq!(reply.status, 409, "{key}: {reply:?}");
        assert_eq!(reply.header("content-type"), Some(&b"application/problem+json"[..]));
        assert!(reply.header("retry-after").is_some());
        assert!(String::from_utf8_lossy(&reply.body).contains("request-in-flight"));
    }
    // A reset that proves the request never left lets the key go: its retry executes. So the
    // module read what Envoy reported, through the property path it asked for.
    let (id, _) = post(&mut envoy, "/jobs", "refused");
    envoy.set_property(
        id,
        &["response", "code_details"],
        b"upstream_reset_before_response_started{remote_connection_failure}",
    );
    envoy.set_property(id, &["response", "flags"], &0x20u64.to_le_bytes());
    envoy.end_stream(id);
    let (retry, action) = post(&mut envoy, "/jobs", "refused");
    assert_eq!(action, Some(CONTINUE));
    envoy.upstream_responds(retry, 201, &[], ANSWER);
    envoy.end_stream(retry);

    // The lease (processing_timeout, 3 s) ends by Envoy's clock: a retry takes the key over.
    envoy.advance_ms(3_001);
    let (id, action) = post(&mut envoy, "/jobs", "reset");
    assert_eq!(action, Some(CONTINUE), "{:?}", envoy.stream(id).local_responses);
    assert!(envoy.stream(id).upstream.is_some());
    envoy.upstream_responds(id, 201, &[], ANSWER);
    envoy.end_stream(id);
    envoy.tick();
    assert_eq!(envoy.host().metric("idempotency.route.jobs.requests_total.kept_unknown"), 2);
    assert_eq!(envoy.host().metric("idempotency.route.jobs.requests_total.taken_over"), 1);
    assert_clean(&envoy);
}

#[test]
fn a_refused_configuration_is_one_critical_line_naming_the_field() {
    let cases = [
        (
            r#"{"store":{"type":"local","capacity":"many"},"routes":[{"name":"o","match":{"prefix":"/"}}]}"#,
            "field `store.capacity`",
        ),
        (r#"{"routes":[{"name":"o","match":{"prefix":"/"},"ttl":"soon"}]}"#, "field `routes[0].ttl`"),
        // Not JSON at all: the line says where it stops being JSON.
        (r#"{"routes":[{"name":"o","match":{"prefix":"/"}}"#, "not valid JSON: syntax error at byte 46"),
    ];
    for (config, field) in cases {
        let mut envoy = Envoy::load_built();
        assert!(!envoy.start(config), "{config} accepted");
        let critical = envoy.host().logs_at(LOG_CRITICAL);
        assert_eq!(critical.len(), 1, "{critical:?}");
        assert!(critical[0].contains(field), "{field:?} not in {:?}", critical[0]);
        // Nothing is served from a refused configuration: a stream passes untouched.
        let id = envoy.new_stream();
        assert_eq!(envoy.request_headers(id, &keyed_post("/orders", "k"), false), CONTINUE);
        assert!(envoy.stream(id).local_responses.is_empty());
        assert_clean(&envoy);
    }
}

#[test]
fn an_unknown_context_id_is_logged_or_ignored_never_a_trap() {
    let mut envoy = started();
    let unknown = 4_000;
    // Root callbacks for a root that does not exist: each answered with a harmless default,
    // each logged with the id.
    let root_calls: [(&str, Vec<u32>, Option<u32>); 7] = [
        ("proxy_on_vm_start", vec![unknown, 0], Some(1)),
        ("proxy_on_configure", vec![unknown, 0], Some(0)),
        ("proxy_on_tick", vec![unknown], None),
        ("proxy_on_queue_ready", vec![unknown, 1], None),
        ("proxy_on_http_call_response", vec![unknown, 7, 0, 0, 0], None),
        ("proxy_on_grpc_receive", vec![unknown, 7, 0], None),
        ("proxy_on_grpc_close", vec![unknown, 7, 0], None),
    ];
    for (name, args, answer) in root_calls {
        let warnings = envoy.host().logs_at(LOG_WARN).len();
        let got = envoy.call(unknown, name, &args).unwrap_or_else(|e| panic!("{name} trapped: {e}"));
        assert_eq!(got, answer, "{name}");
        let logged = envoy.host().logs_at(LOG_WARN);
        assert_eq!(logged.len(), warnings + 1, "{name}: {logged:?}");
        assert!(logged[warnings].contains(&unknown.to_string()), "{name}: {:?}", logged[warnings]);
    }
    // A stream whose root is unknown is not created (logged); callbacks of a stream the module
    // does not hold (never created, or forgotten at its headers) go on untouched, unlogged: the
    // module forgets unprotected streams on purpose.
    let warnings = envoy.host().logs_at(LOG_WARN).len();
    assert_eq!(envoy.call(unknown + 1, "proxy_on_context_create", &[unknown + 1, unknown]).unwrap(), None);
    assert_eq!(envoy.host().logs_at(LOG_WARN).len(), warnings + 1);
    for id in [unknown + 1, unknown + 2] {
        for (name, args) in [
            ("proxy_on_request_headers", vec![id, 3, 0]),
            ("proxy_on_request_body", vec![id, 10, 1]),
            ("proxy_on_request_trailers", vec![id, 0]),
            ("proxy_on_response_headers", vec![id, 3, 0]),
            ("proxy_on_response_body", vec![id, 10, 1]),
            ("proxy_on_response_trailers", vec![id, 0]),
        ] {
            let got = envoy.call(id, name, &args).unwrap_or_else(|e| panic!("{name} trapped: {e}"));
            assert_eq!(got, Some(CONTINUE), "{name}");
        }
        assert_eq!(envoy.call(id, "proxy_on_log", &[id]).unwrap(), None);
        assert_eq!(envoy.call(id, "proxy_on_done", &[id]).unwrap(), Some(1));
        assert_eq!(envoy.call(id, "proxy_on_delete", &[id]).unwrap(), None);
    }
    // The VM is alive and serves as before.
    executed(&mut envoy, "/orders", "after-unknown-ids");
    assert_eq!(refused_retry(&mut envoy, "/orders", "after-unknown-ids").status, 201);
    assert!(!envoy.host().logs.iter().any(|(_, m)| m.contains("panicked")));
    assert_clean(&envoy);
}

#[test]
fn the_module_loads_as_envoy_loads_it() {
    let envoy = Envoy::load_built();
    // `_initialize` made no host call (Envoy refuses them before any context exists), and
    // every import the module has is one Envoy 1.40 gives (else `load_built` failed, naming it).
    assert_clean(&envoy);
    assert!(envoy.host().logs.is_empty(), "{:?}", envoy.host().logs);
    // The property path encoding the module uses: parts joined by NUL, as Envoy reads them.
    assert_eq!(prop_key(&["response", "code_details"]), "response\0code_details");
}
