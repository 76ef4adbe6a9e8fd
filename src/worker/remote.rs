//! A store across the network, as the worker carries it out: the conversation's callouts made
//! with `dispatch_http_call` and their answers read back. The conversation itself (its
//! vocabulary in `store::remote`, the etcd store's in `store::etcd::remote`) decides everything
//! else; the native tests script one of their own.
//!
//! What the worker decides here, and the store does not: a callout Envoy refused or that failed
//! (no `:status`) and a timeout (Envoy's synthesized 504) are failures of the store, handled by
//! the fail mode; the conversation is only fed real answers and Envoy's reports of a failure.

use crate::codec::percent_decode;
use crate::config::etcd::Protocol;
use crate::host::{
    Host, HostError, BUFFER_HTTP_CALL_RESPONSE_BODY, MAP_HTTP_CALL_RESPONSE_HEADERS,
    MAP_HTTP_CALL_RESPONSE_TRAILERS,
};
use crate::store::remote::{Answer, GrpcStatus, RemoteSettings, Request};
use crate::store::StoreError;

/// Envoy answers a callout that outlived its timeout with this synthesized status.
const TIMEOUT_STATUS: u16 = 504;

/// Envoy's own message when it gives up on a gRPC callout (its 504 in gRPC form).
const TIMEOUT_MESSAGE: &str = "upstream request timeout";

fn header<H: Host>(host: &H, map: u32, name: &str) -> Option<String> {
    match host.header_value(map, name) {
        Ok(Some(v)) => String::from_utf8(v).ok(),
        Ok(None) | Err(_) => None,
    }
}

/// A gRPC answer's status: in the trailers, or in the headers of a trailers-only answer (errors,
/// and Envoy's own answers to a gRPC call). `grpc-message` is percent-encoded.
fn grpc_status<H: Host>(host: &H) -> Option<GrpcStatus> {
    let (map, code) = match header(host, MAP_HTTP_CALL_RESPONSE_TRAILERS, "grpc-status") {
        Some(code) => (MAP_HTTP_CALL_RESPONSE_TRAILERS, code),
        None => {
            (MAP_HTTP_CALL_RESPONSE_HEADERS, header(host, MAP_HTTP_CALL_RESPONSE_HEADERS, "grpc-status")?)
        }
    };
    let code = code.parse().ok()?;
    let message = header(host, map, "grpc-message").map(|m| percent_decode(&m)).unwrap_or_default();
    Some(GrpcStatus { code, message })
}

/// Reads the callout's answer. A missing `:status` (Envoy's report of a reset or an answer over
/// its buffer limit) or an unreadable one is handed on as a failed callout, never guessed at.
/// Envoy's synthesized 504 (no answer within the call's timeout) is `TimedOut`: whether the
/// store acted is unknown. Any other answer Envoy made itself (a 503 for a refused connection,
/// in gRPC form `grpc-status: 14`) lacks the router's `service_time` header (the
/// configuration's `<envoy_header_prefix>-upstream-service-time`), which every
/// answer from the store carries: it is marked `from_envoy`, so that its message says that
/// Envoy could not reach the store, not that the store answered.
pub fn read_answer<H: Host>(
    host: &H,
    body_size: usize,
    protocol: Protocol,
    service_time: &str,
) -> Result<Answer, StoreError> {
    let status = header(host, MAP_HTTP_CALL_RESPONSE_HEADERS, ":status").and_then(|s| s.parse::<u16>().ok());
    if status == Some(TIMEOUT_STATUS) {
        return Err(StoreError::TimedOut);
    }
    let grpc = match protocol {
        Protocol::Json => None,
        Protocol::Grpc => grpc_status(host),
    };
    if grpc.as_ref().is_some_and(|g| g.code != 0 && g.message == TIMEOUT_MESSAGE) {
        return Err(StoreError::TimedOut);
    }
    let body = if body_size == 0 {
        Vec::new()
    } else {
        match host.buffer(BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size) {
            Ok(body) => body,
            Err(HostError(s)) => {
                log::warn!("cannot read the store's answer (host status {s})");
                return Ok(Answer::default());
            }
        }
    };
    let mut answer = Answer { status, body, grpc, from_envoy: false };
    // Only for an answer that failed (one more host call): whose it is, for what its message says.
    if status.is_some() && !answer.succeeded() {
        answer.from_envoy =
            matches!(host.header_value(MAP_HTTP_CALL_RESPONSE_HEADERS, service_time), Ok(None));
    }
    Ok(answer)
}

/// Makes the call on the store's cluster; the token identifies its answer. Envoy refuses
/// (BadArgument) a cluster it does not know.
pub fn dispatch<H: Host>(host: &H, settings: &RemoteSettings, request: &Request) -> Result<u32, HostError> {
    let mut headers: Vec<(&str, &[u8])> = vec![
        (":method", b"POST"),
        (":path", request.path.as_bytes()),
        (":authority", settings.authority.as_bytes()),
    ];
    let token_header = match settings.protocol {
        Protocol::Json => {
            headers.push(("content-type", b"application/json"));
            "authorization"
        }
        Protocol::Grpc => {
            headers.extend([("content-type", &b"application/grpc"[..]), ("te", b"trailers")]);
            // etcd reads its auth token from the call's `token` metadata.
            "token"
        }
    };
    if let Some(token) = &request.token {
        headers.push((token_header, token.as_bytes()));
    }
    let timeout_ms = request.timeout_ms.unwrap_or(settings.timeout_ms);
    host.dispatch_http_call(&settings.cluster, &headers, &request.body, timeout_ms)
}

/// The answer to a callout of the root's that is not the store's (a detached call, a lookup):
/// its status (None: Envoy's failure report, no `:status`), headers and body. None when it
/// cannot be read.
pub type CalloutAnswer = (Option<u16>, Vec<(String, Vec<u8>)>, Vec<u8>);

pub fn callout_answer<H: Host>(host: &H, body_size: usize) -> Option<CalloutAnswer> {
    let status = match host.header_value(MAP_HTTP_CALL_RESPONSE_HEADERS, ":status") {
        Ok(Some(v)) => std::str::from_utf8(&v).ok().and_then(|s| s.parse::<u16>().ok()),
        Ok(None) | Err(_) => None,
    };
    let headers = host.header_pairs(MAP_HTTP_CALL_RESPONSE_HEADERS).ok()?;
    let body = if body_size == 0 {
        Vec::new()
    } else {
        host.buffer(BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size).ok()?
    };
    Some((status, headers, body))
}
