//! A store across the network, as the glue carries it out: the conversation's callouts made
//! with `dispatch_http_call` and their answers read back. The conversation itself (its
//! vocabulary in `store::remote`, the etcd store's in `store::etcd::remote`) decides everything
//! else; the native tests script one of their own.
//!
//! What the glue decides here, and the store does not: a callout Envoy refused or that failed
//! (no `:status`) and a timeout (Envoy's synthesized 504) are failures of the store, handled by
//! the fail mode; the conversation is only fed real answers and Envoy's reports of a failure.

use super::{Host, HostError, BUFFER_HTTP_CALL_RESPONSE_BODY, MAP_HTTP_CALL_RESPONSE_HEADERS};
use crate::store::remote::{Answer, RemoteSettings, Request};

/// Envoy answers a callout that outlived its timeout with this synthesized status.
const TIMEOUT_STATUS: u16 = 504;

/// What became of a callout, read in `on_http_call_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Answered(Answer),
    /// Envoy's synthesized 504: no answer within `timeout_ms`. Whether the store acted is
    /// unknown.
    TimedOut,
}

/// Reads the callout's answer. A missing `:status` (Envoy's report of a reset or an answer over
/// its buffer limit) or an unreadable one is handed on as a failed callout, never guessed at.
pub fn read_answer<H: Host>(host: &H, body_size: usize) -> Outcome {
    let status = match host.header_value(MAP_HTTP_CALL_RESPONSE_HEADERS, ":status") {
        Ok(Some(v)) => std::str::from_utf8(&v).ok().and_then(|s| s.parse::<u16>().ok()),
        Ok(None) | Err(_) => None,
    };
    if status == Some(TIMEOUT_STATUS) {
        return Outcome::TimedOut;
    }
    let body = if body_size == 0 {
        Vec::new()
    } else {
        match host.buffer(BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size) {
            Ok(body) => body,
            Err(HostError(s)) => {
                log::warn!("cannot read the store's answer (host status {s})");
                return Outcome::Answered(Answer { status: None, body: Vec::new() });
            }
        }
    };
    Outcome::Answered(Answer { status, body })
}

/// Makes the call on the store's cluster; the token identifies its answer. Envoy refuses
/// (BadArgument) a cluster it does not know.
pub fn dispatch<H: Host>(host: &H, settings: &RemoteSettings, request: &Request) -> Result<u32, HostError> {
    let mut headers: Vec<(&str, &[u8])> = vec![
        (":method", b"POST"),
        (":path", request.path.as_bytes()),
        (":authority", settings.authority.as_bytes()),
        ("content-type", b"application/json"),
    ];
    if let Some(token) = &request.token {
        headers.push(("authorization", token.as_bytes()));
    }
    let timeout_ms = request.timeout_ms.unwrap_or(settings.timeout_ms);
    host.dispatch_http_call(&settings.cluster, &headers, &request.body, timeout_ms)
}
