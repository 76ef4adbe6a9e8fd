//! The filter's own error replies: RFC 9457 `application/problem+json`, as data the glue sends.

use crate::key::KeyError;

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

    pub fn body(&self) -> Vec<u8> {
        let v = serde_json::json!({
            "type": format!("{TYPE_PREFIX}{}", self.kind.slug()),
            "title": self.kind.title(),
            "status": self.status,
            "detail": self.detail,
        });
        v.to_string().into_bytes()
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
mod tests {
    use super::*;

    #[test]
    fn body_is_rfc9457_json() {
        let p = Problem::new(Kind::PayloadMismatch, 422, "different body");
        let v: serde_json::Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(v["type"], "urn:idempotency-filter:payload-mismatch");
        assert_eq!(v["status"], 422);
        assert_eq!(v["detail"], "different body");
        assert!(v["title"].is_string());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let p = Problem::new(Kind::RequestInFlight, 409, "").retry_after_ms(1001);
        assert_eq!(p.retry_after_s, Some(2));
        assert_eq!(Problem::new(Kind::RequestInFlight, 409, "").retry_after_ms(0).retry_after_s, Some(1));
        assert!(p.response_headers().contains(&("retry-after", "2".to_string())));
    }
}
