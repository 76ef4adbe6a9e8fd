//! What the flow reads about its stream: the `StreamFacts` the worker answers (each method one
//! host call), and the reads the flow builds on Envoy's properties: response flags and whether
//! an upstream host was selected (`stream_report`), the router's attempt count, and the claims
//! of a token a JWT filter verified (`verified_claims`). Kept apart from `RequestFlow` so that
//! the property paths and what an absent or unreadable value means are in one place, and the
//! state machine only sees answers.

/// A host read that failed; the worker has logged the host's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreadable;

/// What the flow may read about its stream, and when it is. Each method is one host call in
/// the worker, but the request's headers: one read of the map serves both of their methods
/// within a callback. Absent values are `None`, failed reads are `Unreadable` where a decision
/// depends on telling the two apart.
pub trait StreamFacts {
    fn now_ms(&mut self) -> u64;
    /// A fresh claim owner token (unique per claim).
    fn owner_token(&mut self) -> u64;
    fn request_header(&mut self, name: &str) -> Option<Vec<u8>>;
    fn request_headers(&mut self) -> Result<Vec<(String, Vec<u8>)>, Unreadable>;
    fn request_body(&mut self, size: usize) -> Result<Vec<u8>, Unreadable>;
    fn response_headers(&mut self) -> Vec<(String, Vec<u8>)>;
    fn response_body(&mut self, size: usize) -> Result<Vec<u8>, Unreadable>;
    fn property(&mut self, path: &[&str]) -> Result<Option<Vec<u8>>, Unreadable>;
}

pub(super) fn property_string(facts: &mut dyn StreamFacts, path: &[&str]) -> Option<String> {
    facts.property(path).ok()?.map(|b| crate::host::pairs::text(&b).into_owned())
}

pub(super) fn property_u64(facts: &mut dyn StreamFacts, path: &[&str]) -> Option<u64> {
    let bytes = facts.property(path).ok()??;
    Some(u64::from_le_bytes(<[u8; 8]>::try_from(bytes.as_slice()).ok()?))
}

/// The router's attempts at the request so far: Envoy's `upstream.request_attempt_count`,
/// which its router sets as each attempt starts (`Filter::decodeHeaders`, `Filter::doRetry`),
/// so it is as final at the response headers as in `on_log`. Envoy 1.40 always answers it (0
/// before any attempt: `attemptCount().value_or(0)` in its CEL attributes; the attribute is in
/// every Envoy since 1.33, older than any this filter runs on), so an absent value is read as
/// 0. None when the read failed or is not a number: `ending::plan_unfinished` then releases
/// nothing on "never sent" grounds, since the count is the proof that no earlier attempt left.
pub(super) fn attempt_count(facts: &mut dyn StreamFacts) -> Option<u64> {
    match facts.property(&["upstream", "request_attempt_count"]) {
        Ok(None) => Some(0),
        Ok(Some(bytes)) => Some(u64::from_le_bytes(<[u8; 8]>::try_from(bytes.as_slice()).ok()?)),
        Err(Unreadable) => None,
    }
}

/// The request body bytes Envoy received from the client, read at the stream's end: Envoy's
/// `request.total_size` (bytes received plus the request header map's size, the sum of its
/// names' and values' lengths) less that header map. None when either is unreadable. Envoy
/// counts the bytes as they come off the connection, before any filter sees them, so a body
/// held back from the filter counts too.
pub(super) fn body_bytes_received(facts: &mut dyn StreamFacts) -> Option<u64> {
    let total = property_u64(facts, &["request", "total_size"])?;
    let headers = facts.request_headers().ok()?;
    let head: u64 = headers.iter().map(|(name, value)| (name.len() + value.len()) as u64).sum();
    Some(total.saturating_sub(head))
}

/// Response flags, and whether an upstream host was ever selected: an empty or absent
/// `upstream.address` says none was; a failed read says nothing, so it counts as selected.
pub(super) fn stream_report(facts: &mut dyn StreamFacts) -> (u64, bool) {
    let flags = property_u64(facts, &["response", "flags"]).unwrap_or(0);
    let upstream_selected = match facts.property(&["upstream", "address"]) {
        Ok(Some(address)) => !address.is_empty(),
        Ok(None) => false,
        Err(Unreadable) => true,
    };
    (flags, upstream_selected)
}

/// The configured claims of the token a JWT filter in front verified, from its dynamic metadata
/// (only a verified token fills it; a client cannot); a claim Envoy cannot hand over (a list, an
/// object) counts as missing. None when there is no verified payload at all: the request
/// carried no token, and the principal falls back to the principal headers. A payload without
/// any of the claims is still a payload (`engine::admit` refuses it, as it refuses one that
/// lacks some): only when no claim is found is the payload itself looked up, so a request with
/// a complete token costs no extra host call.
pub(super) fn verified_claims(
    facts: &mut dyn StreamFacts,
    payload: &str,
    claims: &[String],
) -> Option<Vec<Option<Vec<u8>>>> {
    const JWT_AUTHN: [&str; 3] = ["metadata", "filter_metadata", "envoy.filters.http.jwt_authn"];
    let values: Vec<Option<Vec<u8>>> = claims
        .iter()
        .map(|claim| {
            facts.property(&[JWT_AUTHN[0], JWT_AUTHN[1], JWT_AUTHN[2], payload, claim]).ok().flatten()
        })
        .collect();
    if values.iter().any(Option::is_some) {
        return Some(values);
    }
    // Envoy answers NotFound for a payload jwt_authn did not write; a payload it cannot
    // serialize (a map with numbers in it) is an error, so it is there.
    let present = !matches!(facts.property(&[JWT_AUTHN[0], JWT_AUTHN[1], JWT_AUTHN[2], payload]), Ok(None));
    present.then_some(values)
}
