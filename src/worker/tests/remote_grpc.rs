//! The worker's side of `store.protocol: "grpc"`: a call goes out with gRPC's headers (the token as
//! etcd's `token` metadata, never `authorization`), and an answer's gRPC status is read from its
//! trailers, or from the headers of a trailers-only answer, which is how etcd's errors and
//! Envoy's own answers (a timeout among them) come.

use super::pairs;
use crate::config::etcd::{OnStoreError, Protocol};
use crate::host::fake::{FakeHost, HostCall};
use crate::store::remote::{Answer, GrpcStatus, RemoteSettings, Request};
use crate::store::StoreError;
use crate::worker::remote::{dispatch, read_answer};

fn settings(protocol: Protocol) -> RemoteSettings {
    RemoteSettings {
        cluster: "etcd".into(),
        authority: "etcd".into(),
        timeout_ms: 250,
        on_error: OnStoreError::FailClosed,
        protocol,
    }
}

fn sent_headers(protocol: Protocol) -> Vec<(String, String)> {
    let h = FakeHost::default();
    h.0.clusters.borrow_mut().push("etcd".into());
    let request = Request {
        path: "/etcdserverpb.KV/Txn",
        body: vec![0; 5],
        token: Some("tok".into()),
        timeout_ms: None,
        shard: 0,
    };
    dispatch(&h, &settings(protocol), &request).expect("dispatched");
    match h.dispatches().pop() {
        Some(HostCall::Dispatch { headers, timeout_ms, .. }) => {
            assert_eq!(timeout_ms, 250);
            headers
        }
        _ => unreachable!("one dispatch"),
    }
}

#[test]
fn a_grpc_call_carries_grpc_headers_and_the_token_as_metadata() {
    let grpc = sent_headers(Protocol::Grpc);
    let get = |headers: &[(String, String)], name: &str| {
        headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    };
    assert_eq!(get(&grpc, "content-type").as_deref(), Some("application/grpc"));
    assert_eq!(get(&grpc, "te").as_deref(), Some("trailers"));
    assert_eq!(get(&grpc, "token").as_deref(), Some("tok"));
    assert_eq!(get(&grpc, "authorization"), None);
    let json = sent_headers(Protocol::Json);
    assert_eq!(get(&json, "content-type").as_deref(), Some("application/json"));
    assert_eq!(get(&json, "authorization").as_deref(), Some("tok"));
    assert_eq!((get(&json, "te"), get(&json, "token")), (None, None));
}

fn answer(
    headers: &[(&str, &str)],
    trailers: &[(&str, &str)],
    protocol: Protocol,
) -> Result<Answer, StoreError> {
    let h = FakeHost::default();
    *h.0.call_response_headers.borrow_mut() = pairs(headers);
    *h.0.call_response_trailers.borrow_mut() = pairs(trailers);
    *h.0.call_response_body.borrow_mut() = b"\0\0\0\0\0".to_vec();
    read_answer(&h, 5, protocol, "x-envoy-upstream-service-time")
}

fn grpc(code: u32, message: &str) -> Option<GrpcStatus> {
    Some(GrpcStatus { code, message: message.into() })
}

#[test]
fn a_grpc_status_is_read_from_the_trailers_or_a_trailers_only_answer() {
    let ok = answer(&[(":status", "200")], &[("grpc-status", "0")], Protocol::Grpc);
    assert_eq!(ok, Ok(Answer { status: Some(200), body: vec![0; 5], grpc: grpc(0, ""), from_envoy: false }));
    // etcd's errors come trailers-only; grpc-message is percent-encoded.
    let refused = answer(
        &[
            (":status", "200"),
            ("x-envoy-upstream-service-time", "1"),
            ("grpc-status", "16"),
            ("grpc-message", "etcdserver: invalid auth token%21"),
        ],
        &[],
        Protocol::Grpc,
    );
    let Ok(refused) = refused else { unreachable!("an answer") };
    assert_eq!((refused.grpc, refused.from_envoy), (grpc(16, "etcdserver: invalid auth token!"), false));
    // The stream ended without a status: nothing to read it from.
    let Ok(cut) = answer(&[(":status", "200")], &[], Protocol::Grpc) else { unreachable!() };
    assert_eq!(cut.grpc, None);
    // JSON reads no gRPC status, whatever the answer carries.
    let Ok(json) = answer(&[(":status", "200")], &[("grpc-status", "0")], Protocol::Json) else {
        unreachable!()
    };
    assert_eq!(json.grpc, None);
}

#[test]
fn envoys_timeout_is_a_timeout_in_either_form() {
    // Envoy gives up on a gRPC call with a trailers-only UNAVAILABLE carrying its 504's text.
    let grpc_form = answer(
        &[(":status", "200"), ("grpc-status", "14"), ("grpc-message", "upstream request timeout")],
        &[],
        Protocol::Grpc,
    );
    assert_eq!(grpc_form, Err(StoreError::TimedOut));
    assert_eq!(answer(&[(":status", "504")], &[], Protocol::Grpc), Err(StoreError::TimedOut));
    // Another UNAVAILABLE (no healthy member) is etcd unusable, not a timeout.
    let unavailable = answer(
        &[(":status", "200"), ("grpc-status", "14"), ("grpc-message", "no healthy upstream")],
        &[],
        Protocol::Grpc,
    );
    assert!(matches!(
        unavailable,
        Ok(Answer { grpc: Some(GrpcStatus { code: 14, .. }), from_envoy: true, .. })
    ));
}
