//! The filter's own error replies: RFC 9457 `application/problem+json`, as data the worker sends.

use crate::identity::key::KeyError;
use crate::json::emit_string;

/// Problem type URIs: stable identifiers clients may branch on (documented in the README).
pub const TYPE_PREFIX: &str = "urn:idempotency-filter:";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    MissingKey,
    InvalidKey,
    PayloadMismatch,
    RequestInFlight,
    RequestTooLarge,
    StoreFull,
    StoreUnavailable,
    ResponseNotStored,
    ResultExpired,
    QuotaExceeded,
    GrpcNotSupported,
    PrincipalIncomplete,
    OutcomeUnknown,
    DetachedCapacity,
    AdminUnauthorized,
    AdminBadRequest,
    RecordNotFound,
    RecordConflict,
}

impl Kind {
    pub fn slug(self) -> &'static str {
        match self {
            Kind::MissingKey => "missing-key",
            Kind::InvalidKey => "invalid-key",
            Kind::PayloadMismatch => "payload-mismatch",
            Kind::RequestInFlight => "request-in-flight",
            Kind::RequestTooLarge => "request-too-large",
            Kind::StoreFull => "store-full",
            Kind::StoreUnavailable => "store-unavailable",
            Kind::ResponseNotStored => "response-not-stored",
            Kind::ResultExpired => "result-expired",
            Kind::QuotaExceeded => "quota-exceeded",
            Kind::GrpcNotSupported => "grpc-not-supported",
            Kind::PrincipalIncomplete => "principal-incomplete",
            Kind::OutcomeUnknown => "outcome-unknown",
            Kind::DetachedCapacity => "detached-capacity",
            Kind::AdminUnauthorized => "admin-unauthorized",
            Kind::AdminBadRequest => "admin-bad-request",
            Kind::RecordNotFound => "record-not-found",
            Kind::RecordConflict => "record-conflict",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Kind::MissingKey => "Idempotency-Key is missing",
            Kind::InvalidKey => "Idempotency-Key is invalid",
            Kind::PayloadMismatch => "Idempotency-Key reused with a different request",
            Kind::RequestInFlight => "A request with this Idempotency-Key is being processed",
            Kind::RequestTooLarge => "Request body too large",
            Kind::StoreFull => "Idempotency store is full",
            Kind::StoreUnavailable => "Idempotency store unavailable",
            Kind::ResponseNotStored => "Original response was not stored",
            Kind::ResultExpired => "Original response has expired",
            Kind::QuotaExceeded => "Too many live idempotency records",
            Kind::GrpcNotSupported => "gRPC calls cannot be protected",
            Kind::PrincipalIncomplete => "Verified token lacks the claims that identify the caller",
            Kind::OutcomeUnknown => "Outcome of the original request is unknown",
            Kind::DetachedCapacity => "Too many detached calls in flight",
            Kind::AdminUnauthorized => "The admin API needs its bearer token",
            Kind::AdminBadRequest => "The admin request is malformed",
            Kind::RecordNotFound => "No such record",
            Kind::RecordConflict => "The record is not in a state that allows this",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub kind: Kind,
    pub status: u16,
    pub detail: String,
    /// Seconds for a `retry-after` header.
    pub retry_after_s: Option<u64>,
    /// Extra response headers (lowercase names).
    pub headers: Vec<(&'static str, String)>,
}

impl Problem {
    pub fn new(kind: Kind, status: u16, detail: impl Into<String>) -> Self {
        Problem { kind, status, detail: detail.into(), retry_after_s: None, headers: Vec::new() }
    }

    pub fn for_key_error(e: KeyError, status: u16) -> Self {
        let kind = if e == KeyError::Missing { Kind::MissingKey } else { Kind::InvalidKey };
        Problem::new(kind, status, e.detail())
    }

    pub fn retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_s = Some(ms.div_ceil(1000).max(1));
        self
    }

    /// Written by hand: four fixed members do not justify a JSON library in the Wasm module.
    /// Members in the order serde_json used to emit them, so replies keep their bytes (only
    /// control characters in a detail are escaped differently, as `\u00xx`).
    pub fn body(&self) -> Vec<u8> {
        let slug = self.kind.slug();
        let title = self.kind.title();
        let fixed = title.len() + TYPE_PREFIX.len() + slug.len() + 64;
        let mut out = Vec::with_capacity(fixed + self.detail.len());
        out.extend_from_slice(b"{\"detail\":");
        emit_string(&self.detail, &mut out);
        out.extend_from_slice(b",\"status\":");
        out.extend_from_slice(self.status.to_string().as_bytes());
        out.extend_from_slice(b",\"title\":");
        emit_string(title, &mut out);
        // Slug and prefix need no escaping, so the URI is written without building it first.
        out.extend_from_slice(b",\"type\":\"");
        out.extend_from_slice(TYPE_PREFIX.as_bytes());
        out.extend_from_slice(slug.as_bytes());
        out.extend_from_slice(b"\"}");
        out
    }

    /// Response headers for the reply, `content-type` first.
    pub fn response_headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![("content-type", "application/problem+json".to_string())];
        if let Some(s) = self.retry_after_s {
            h.push(("retry-after", s.to_string()));
        }
        h.extend(self.headers.iter().cloned());
        h
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a failing unwrap is a failing test
mod tests {
    use super::*;
    use crate::json::{read, JsonError, JsonValue, MemberOrder};

    fn parse(body: &[u8]) -> Result<JsonValue<'_>, JsonError> {
        read(body, 4, MemberOrder::Document)
    }

    fn string(s: &str) -> JsonValue<'static> {
        JsonValue::String(s.to_owned().into())
    }

    #[test]
    fn body_is_rfc9457_json() {
        let p = Problem::new(Kind::PayloadMismatch, 422, "different body");
        let body = p.body();
        let v = parse(&body).unwrap();
        assert_eq!(v.get("type"), Some(&string("urn:idempotency-filter:payload-mismatch")));
        assert_eq!(v.get("status"), Some(&JsonValue::Number("422")));
        assert_eq!(v.get("detail"), Some(&string("different body")));
        assert!(matches!(v.get("title"), Some(JsonValue::String(_))));
        let JsonValue::Object(members) = &v else { unreachable!("{v:?}") };
        assert_eq!(members.len(), 4);
    }

    #[test]
    fn body_matches_the_previous_serde_json_output() {
        let p = Problem::new(Kind::StoreFull, 503, "try later");
        assert_eq!(
            String::from_utf8(p.body()).unwrap(),
            r#"{"detail":"try later","status":503,"title":"Idempotency store is full","type":"urn:idempotency-filter:store-full"}"#
        );
    }

    #[test]
    fn every_kind_yields_valid_json() {
        let kinds = [
            Kind::MissingKey,
            Kind::InvalidKey,
            Kind::PayloadMismatch,
            Kind::RequestInFlight,
            Kind::RequestTooLarge,
            Kind::StoreFull,
            Kind::StoreUnavailable,
            Kind::ResponseNotStored,
            Kind::ResultExpired,
            Kind::QuotaExceeded,
            Kind::GrpcNotSupported,
            Kind::PrincipalIncomplete,
            Kind::OutcomeUnknown,
            Kind::DetachedCapacity,
        ];
        for kind in kinds {
            let body = Problem::new(kind, 400, "").body();
            let v = parse(&body).unwrap();
            assert_eq!(v.get("title"), Some(&string(kind.title())), "{kind:?}");
            assert_eq!(v.get("type"), Some(&string(&format!("{TYPE_PREFIX}{}", kind.slug()))));
        }
    }

    #[test]
    fn detail_is_escaped() {
        let detail = "q\"b\\s/\n\r\t\u{0}\u{1f}\u{7f} é \u{1F600} </script>";
        let body = Problem::new(Kind::InvalidKey, 400, detail).body();
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(!text.bytes().any(|b| b < 0x20), "{text}");
        assert!(text.contains(r#"q\"b\\s/\u000a\u000d\u0009\u0000\u001f"#), "{text}");
        assert_eq!(parse(&body).unwrap().get("detail"), Some(&string(detail)));
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let p = Problem::new(Kind::RequestInFlight, 409, "").retry_after_ms(1001);
        assert_eq!(p.retry_after_s, Some(2));
        assert_eq!(Problem::new(Kind::RequestInFlight, 409, "").retry_after_ms(0).retry_after_s, Some(1));
        assert!(p.response_headers().contains(&("retry-after", "2".to_string())));
    }
}
