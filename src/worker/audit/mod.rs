//! The audit trail (`"audit": true`), pure: one JSON object per record a protected request
//! changed, and one per admin action, published as the stream's filter state
//! `wasm.idempotency.audit` for Envoy's own access logs to print (files, the gRPC access log
//! service, OpenTelemetry: whatever ships them already). A completed record's entry is its
//! archive: it outlives the record, as long as the logs are kept.
//!
//! What is audited: a completion with a stored status (`stored`, `response_not_stored`), an
//! unknown outcome written (`outcome_unknown`), a release (`released`), a takeover
//! (`taken_over`), a reconciliation (`reconciled_found`, `reconciled_not_found`). Never a replay
//! or a refusal: they change nothing. One host call per changed record, none when off.
//!
//! Every string in an entry is escaped here (`emit_string`): a key, a tenant or a route is the
//! caller's or the configuration's text, and an access log line must not be forged by it.

pub(crate) mod flow;

use crate::codec::hex;
use crate::engine::Pending;
use crate::identity::fingerprint::Fingerprint;
use crate::json::emit_string;
use crate::metrics::Counter;
use crate::store::record::State;

/// The filter state entry's name (Envoy prints it as `wasm.idempotency.audit`).
pub const AUDIT_PROPERTY: &str = "idempotency.audit";

/// Hex digits of the fingerprint an entry keeps: enough to tell payloads apart in an
/// investigation, without making the entry a copy of the record.
const FINGERPRINT_DIGITS: usize = 16;

/// What an entry says of one protected request's record, gathered when its body was whole (the
/// record's identity) and when the upstream answered (its status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    tag: String,
    route: String,
    tenant: Option<String>,
    key: String,
    fingerprint: String,
    /// When the claim was asked for.
    created_ms: u64,
    /// What the record was completed with, once known.
    pub(crate) outcome: Option<(State, u16)>,
}

impl AuditRecord {
    pub fn new(pending: &Pending, fingerprint: &Fingerprint, now_ms: u64) -> AuditRecord {
        let label = pending.label();
        let mut digits = hex(&fingerprint.0);
        digits.truncate(FINGERPRINT_DIGITS);
        AuditRecord {
            tag: pending.scope.log_tag(),
            route: label.route().to_string(),
            tenant: label.tenant().map(str::to_string),
            key: label.key().to_string(),
            fingerprint: digits,
            created_ms: now_ms,
            outcome: None,
        }
    }

    /// The entry for `counter`, if that outcome changed the record; at `now_ms`.
    pub fn entry(&self, counter: Counter, now_ms: impl FnOnce() -> u64) -> Option<Vec<u8>> {
        let completed = |(state, _): (State, u16)| state_name(state);
        let state = match counter {
            Counter::Stored | Counter::ResponseNotStored | Counter::ReconciledFound => {
                self.outcome.map_or("completed", completed)
            }
            Counter::OutcomeUnknown => "outcome_unknown",
            Counter::Released => "released",
            Counter::TakenOver | Counter::ReconciledNotFound => "processing",
            _ => return None,
        };
        let done = !matches!(counter, Counter::TakenOver | Counter::ReconciledNotFound);
        let mut e = AuditEntry::new(counter.name());
        e.text("record", Some(&self.tag));
        e.text("route", Some(&self.route));
        e.text("tenant", self.tenant.as_deref());
        e.text("key", Some(&self.key));
        e.text("state", Some(state));
        e.number("status", self.outcome.filter(|_| done).map(|(_, s)| u64::from(s)));
        e.text("fingerprint", Some(&self.fingerprint));
        e.number("created_ms", Some(self.created_ms));
        e.number("completed_ms", done.then(now_ms));
        Some(e.finish())
    }
}

pub fn state_name(state: State) -> &'static str {
    match state {
        State::Processing => "processing",
        State::Succeeded => "succeeded",
        State::FailedFinal => "failed_final",
    }
}

/// One JSON object, its members in the order written.
pub struct AuditEntry {
    out: Vec<u8>,
}

impl AuditEntry {
    /// `{"event": <event>` ...
    pub fn new(event: &str) -> AuditEntry {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"{\"event\":");
        emit_string(event, &mut out);
        AuditEntry { out }
    }

    fn name(&mut self, name: &str) {
        self.out.push(b',');
        emit_string(name, &mut self.out);
        self.out.push(b':');
    }

    /// A string member; `null` when there is none.
    pub fn text(&mut self, name: &str, value: Option<&str>) {
        self.name(name);
        match value {
            Some(v) => emit_string(v, &mut self.out),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    pub fn number(&mut self, name: &str, value: Option<u64>) {
        self.name(name);
        match value {
            Some(v) => self.out.extend_from_slice(v.to_string().as_bytes()),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.out.push(b'}');
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use crate::engine::{admit, fingerprint_body, Admission, RequestHead};

    fn pending(key: &str, tenant: &str) -> Pending {
        let cfg =
            parse(br#"{"tenant_header":"x-tenant","routes":[{"name":"pay","match":{"prefix":"/pay"}}]}"#)
                .unwrap();
        let headers: Vec<(String, Vec<u8>)> = [
            (":authority", "api"),
            ("idempotency-key", key),
            ("x-tenant", tenant),
            ("content-type", "application/json"),
        ]
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
        let head = RequestHead {
            method: "POST",
            path: "/pay",
            headers: &headers,
            verified_claims: None,
            cluster: None,
        };
        match admit(&cfg, &head) {
            Admission::Collect(p) => p,
            other => panic!("{other:?}"),
        }
    }

    /// Each member as text (a string's content, a number's digits, `null`), in order.
    fn parsed(line: &[u8]) -> Vec<(String, String)> {
        let doc = crate::json::read(line, 4, crate::json::MemberOrder::Document).unwrap();
        let crate::json::JsonValue::Object(members) = doc else { panic!("not an object") };
        members
            .into_iter()
            .map(|(n, v)| {
                let text = match v {
                    crate::json::JsonValue::String(s) => s.into_owned(),
                    crate::json::JsonValue::Number(n) => n.to_string(),
                    crate::json::JsonValue::Null => "null".to_string(),
                    other => panic!("{other:?}"),
                };
                (n.into_owned(), text)
            })
            .collect()
    }

    fn get<'e>(e: &'e [(String, String)], name: &str) -> &'e str {
        e.iter().find(|(n, _)| n == name).map_or("absent", |(_, v)| v.as_str())
    }

    #[test]
    fn a_completion_says_whose_record_what_it_became_and_when() {
        let p = pending("k-1", "acme");
        let fp = fingerprint_body(&p, b"{}").unwrap();
        let mut record = AuditRecord::new(&p, &fp, 1_000);
        record.outcome = Some((State::Succeeded, 201));
        let e = parsed(&record.entry(Counter::Stored, || 1_250).unwrap());
        let names: Vec<&str> = e.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "event",
                "record",
                "route",
                "tenant",
                "key",
                "state",
                "status",
                "fingerprint",
                "created_ms",
                "completed_ms"
            ]
        );
        assert_eq!(get(&e, "event"), "stored");
        assert_eq!(get(&e, "record"), p.scope.log_tag());
        assert_eq!((get(&e, "route"), get(&e, "tenant"), get(&e, "key")), ("pay", "acme", "k-1"));
        assert_eq!((get(&e, "state"), get(&e, "status")), ("succeeded", "201"));
        assert_eq!(get(&e, "fingerprint"), &fp.to_hex()[..16]);
        assert_eq!((get(&e, "created_ms"), get(&e, "completed_ms")), ("1000", "1250"));
        // A takeover is not a completion.
        let t = parsed(&record.entry(Counter::TakenOver, || 2_000).unwrap());
        assert_eq!(
            (get(&t, "state"), get(&t, "status"), get(&t, "completed_ms")),
            ("processing", "null", "null")
        );
        assert_eq!(get(&parsed(&record.entry(Counter::Released, || 9).unwrap()), "state"), "released");
    }

    #[test]
    fn only_outcomes_that_change_a_record_are_audited() {
        let p = pending("k", "t");
        let record = AuditRecord::new(&p, &fingerprint_body(&p, b"").unwrap(), 0);
        for counter in Counter::ALL {
            let audited = record.entry(counter, || 1).is_some();
            let changes = matches!(
                counter,
                Counter::Stored
                    | Counter::ResponseNotStored
                    | Counter::OutcomeUnknown
                    | Counter::Released
                    | Counter::TakenOver
                    | Counter::ReconciledFound
                    | Counter::ReconciledNotFound
            );
            assert_eq!(audited, changes, "{}", counter.name());
        }
    }

    #[test]
    fn a_hostile_key_or_tenant_cannot_forge_the_line() {
        let p = pending(r#"a"},"event":"released"#, "t\",\"x\":\"");
        let record = AuditRecord::new(&p, &fingerprint_body(&p, b"").unwrap(), 0);
        let line = record.entry(Counter::Stored, || 1).unwrap();
        assert!(!line.contains(&b'\n'));
        let e = parsed(&line);
        assert_eq!(e.len(), 10);
        assert_eq!((get(&e, "event"), get(&e, "key")), ("stored", r#"a"},"event":"released"#));
        assert_eq!(get(&e, "tenant"), "t\",\"x\":\"");
    }
}
