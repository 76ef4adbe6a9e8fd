//! Who a record belongs to. A record is found only by the exact (tenant, principal, authority,
//! method, path, key) it was created under, so two callers can never see each other's responses
//! even when they pick the same key, and two virtual hosts behind one filter configuration never
//! share records.
//!
//! Stability contract (scope v2): the scope id is SHA-256 over the length-prefixed fields below,
//! behind the domain tag. Records hold scope ids, so changing this encoding orphans every stored
//! record (retries would execute again): bump the tag and the store namespace together.
//! v2 (from v1): the authority joined the scope, and the tenant is the list of its header values,
//! each length-prefixed, so one header `a,b` and two headers `a` and `b` are different tenants.

use crate::codec::hex;
use sha2::{Digest, Sha256};
use std::borrow::Cow;

const SCOPE_TAG: &[u8] = b"idempotency-filter/scope/v2\0";
const PRINCIPAL_TAG: &[u8] = b"idempotency-filter/principal/v1\0";
/// A principal from verified claims is a different kind of identity from one made of header
/// values: the tags keep the two from ever colliding.
const JWT_PRINCIPAL_TAG: &[u8] = b"idempotency-filter/principal/jwt/v1\0";
const TENANT_TAG: &[u8] = b"idempotency-filter/tenant/v1\0";

/// 32-byte identity of a record.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct ScopeId(pub [u8; 32]);

impl ScopeId {
    /// Short hex prefix: enough to correlate log lines, never the raw key or principal.
    pub fn log_tag(&self) -> String {
        hex(&self.0[..6])
    }

    /// Stable 64-bit hash for bucket placement.
    pub fn placement(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[24..32]);
        u64::from_le_bytes(b)
    }
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// Hash of the caller's credentials: the values of every configured principal header, in config
/// order. A request without any of them is the anonymous principal, which is one principal: all
/// anonymous callers share their records.
pub fn principal_digest(headers: &[(&str, Vec<&[u8]>)]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(PRINCIPAL_TAG);
    h.update((headers.len() as u64).to_be_bytes());
    for (name, values) in headers {
        field(&mut h, name.as_bytes());
        h.update((values.len() as u64).to_be_bytes());
        for v in values {
            field(&mut h, v);
        }
    }
    h.finalize().into()
}

/// Hash of the caller's verified claims (a JWT filter in front checked the token), in config
/// order; an absent claim is distinct from an empty one.
pub fn jwt_principal_digest(claims: &[(&str, Option<&[u8]>)]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(JWT_PRINCIPAL_TAG);
    h.update((claims.len() as u64).to_be_bytes());
    for (name, value) in claims {
        field(&mut h, name.as_bytes());
        match value {
            None => h.update([0u8]),
            Some(v) => {
                h.update([1u8]);
                field(&mut h, v);
            }
        }
    }
    h.finalize().into()
}

/// Digest of a tenant (its header values, in order): what quotas count records against.
pub fn tenant_digest(values: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(TENANT_TAG);
    h.update((values.len() as u64).to_be_bytes());
    for v in values {
        field(&mut h, v);
    }
    h.finalize().into()
}

/// A cluster's name as the host part of a scope (`scope_host: "cluster"`): behind a prefix no
/// authority can hold (a space), so that a cluster's scope is never a host's of the same name.
pub fn cluster_host(cluster: &[u8]) -> Vec<u8> {
    [&b"cluster "[..], cluster].concat()
}

/// The authority as a scope part, so that every spelling of one host is one scope: the host
/// lower-cased (host names are case-insensitive) and without the trailing dot of a fully
/// qualified name (`api.example.` is `api.example`), the port without leading zeros, and no port
/// when it is empty or the scheme's default (`A.Example.:0080` is `a.example` over http). An
/// IPv6 host keeps its brackets (`[::1]:080` is `[::1]:80`). Something that is not
/// `host[:digits]` (no host, colons outside brackets, a port that is not digits) keeps the rule
/// every build had: lower-cased, without a `:<default port>` suffix.
///
/// Records hold the scope id, so the normal form of an authority never changes: what an earlier
/// build made of a spelling that already was normal is what this one makes of it
/// (`normal_spellings_keep_their_scope_id`). Borrowed when the authority is already normal (the
/// common case): no allocation.
pub fn normalize_authority<'a>(authority: &'a [u8], scheme: &[u8]) -> Cow<'a, [u8]> {
    let default_port: &[u8] = if scheme.eq_ignore_ascii_case(b"https") { b"443" } else { b"80" };
    let Some((spelled_host, spelled_port)) = host_and_port(authority) else {
        return Cow::Owned(legacy_authority(authority, default_port));
    };
    let host = match spelled_host.iter().rposition(|b| *b != b'.') {
        Some(last) => spelled_host.get(..=last).unwrap_or(spelled_host),
        // Only dots: not a name, kept as spelled.
        None => spelled_host,
    };
    let port = spelled_port.and_then(|p| {
        let digits = p.iter().position(|b| *b != b'0').and_then(|first| p.get(first..));
        // All zeros is port 0; an empty port is no port (RFC 3986, 6.2.3).
        let digits = digits.or_else(|| p.get(p.len().checked_sub(1)?..))?;
        (digits != default_port).then_some(digits)
    });
    let lower = !host.iter().any(u8::is_ascii_uppercase);
    match port {
        Some(p) if lower && host.len() == spelled_host.len() && Some(p) == spelled_port => {
            Cow::Borrowed(authority)
        }
        None if lower => Cow::Borrowed(host),
        _ => {
            let mut out = Vec::with_capacity(host.len() + port.map_or(0, |p| p.len() + 1));
            out.extend(host.iter().map(u8::to_ascii_lowercase));
            if let Some(p) = port {
                out.push(b':');
                out.extend_from_slice(p);
            }
            Cow::Owned(out)
        }
    }
}

/// `host[:port]` with a non-empty host and a port of digits (maybe none): the host (an IPv6 one
/// with its brackets) and the port after its colon. None for any other shape.
fn host_and_port(authority: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let (host, rest) = if authority.first() == Some(&b'[') {
        let end = authority.iter().position(|b| *b == b']')?;
        authority.split_at(end + 1)
    } else {
        match authority.iter().position(|b| *b == b':') {
            Some(colon) => authority.split_at(colon),
            None => (authority, &b""[..]),
        }
    };
    if host.is_empty() {
        return None;
    }
    match rest.split_first() {
        None => Some((host, None)),
        Some((b':', port)) if port.iter().all(u8::is_ascii_digit) => Some((host, Some(port))),
        Some(_) => None,
    }
}

/// What every build made of an authority: lower-cased, without a `:<default port>` suffix after
/// something (not `:80` alone).
fn legacy_authority(authority: &[u8], default_port: &[u8]) -> Vec<u8> {
    let mut lower = authority.to_ascii_lowercase();
    let cut = lower.len().saturating_sub(default_port.len() + 1);
    if cut > 0 && lower.get(cut) == Some(&b':') && lower.get(cut + 1..) == Some(default_port) {
        lower.truncate(cut);
    }
    lower
}

pub struct ScopeParts<'a> {
    /// The tenant header's values; `None` when no tenant header is configured.
    pub tenant: Option<&'a [&'a [u8]]>,
    pub principal: [u8; 32],
    /// Normalized (`normalize_authority`).
    pub authority: &'a [u8],
    pub method: &'a str,
    pub path: &'a str,
    pub key: &'a str,
}

pub fn scope_id(p: &ScopeParts) -> ScopeId {
    let mut h = Sha256::new();
    h.update(SCOPE_TAG);
    match p.tenant {
        None => h.update([0u8]),
        Some(values) => {
            h.update([1u8]);
            h.update((values.len() as u64).to_be_bytes());
            for v in values {
                field(&mut h, v);
            }
        }
    }
    h.update(p.principal);
    field(&mut h, p.authority);
    field(&mut h, p.method.as_bytes());
    field(&mut h, p.path.as_bytes());
    field(&mut h, p.key.as_bytes());
    ScopeId(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACME: &[&[u8]] = &[b"acme"];

    fn base() -> ScopeParts<'static> {
        ScopeParts {
            tenant: Some(ACME),
            principal: principal_digest(&[("authorization", vec![b"Bearer a"])]),
            authority: b"api.example",
            method: "POST",
            path: "/orders",
            key: "k1",
        }
    }

    #[test]
    fn every_part_separates_scopes() {
        let a = scope_id(&base());
        let variants = [
            ScopeParts { tenant: Some(&[b"other"]), ..base() },
            ScopeParts { tenant: Some(&[]), ..base() },
            ScopeParts { authority: b"other.example", ..base() },
            ScopeParts { tenant: None, ..base() },
            ScopeParts { principal: principal_digest(&[("authorization", vec![b"Bearer b"])]), ..base() },
            ScopeParts { method: "PATCH", ..base() },
            ScopeParts { path: "/orders/1", ..base() },
            ScopeParts { key: "k2", ..base() },
        ];
        for v in variants {
            assert_ne!(scope_id(&v), a);
        }
        assert_eq!(scope_id(&base()), a);
    }

    #[test]
    fn field_boundaries_cannot_be_shifted() {
        let a = scope_id(&ScopeParts { path: "/ab", key: "c", ..base() });
        let b = scope_id(&ScopeParts { path: "/a", key: "bc", ..base() });
        assert_ne!(a, b);
    }

    #[test]
    fn tenant_values_are_encoded_one_by_one() {
        let joined = scope_id(&ScopeParts { tenant: Some(&[b"a,b"]), ..base() });
        let two = scope_id(&ScopeParts { tenant: Some(&[b"a", b"b"]), ..base() });
        let shifted = scope_id(&ScopeParts { tenant: Some(&[b"a", b",b"]), ..base() });
        assert_ne!(joined, two);
        assert_ne!(two, shifted);
        assert_ne!(tenant_digest(&[b"a,b"]), tenant_digest(&[b"a", b"b"]));
    }

    fn norm(authority: &str, scheme: &str) -> String {
        String::from_utf8_lossy(&normalize_authority(authority.as_bytes(), scheme.as_bytes())).into_owned()
    }

    #[test]
    fn authority_is_lowercased_without_the_default_port() {
        assert_eq!(norm("A.Example:80", "http"), "a.example");
        assert_eq!(norm("a.example:443", "https"), "a.example");
        assert_eq!(norm("a.example:443", "http"), "a.example:443");
        assert_eq!(norm("a.example:8080", "http"), "a.example:8080");
        assert_eq!(norm("[::1]:80", "http"), "[::1]");
        assert_eq!(norm(":80", "http"), ":80");
    }

    /// C8: the absolute form of a name (its trailing dot) and a port spelled with leading zeros
    /// or left empty name the same host as the plain spelling, as the default port already did.
    #[test]
    fn every_spelling_of_a_host_is_one_scope() {
        for (spelled, scheme, normal) in [
            ("api.example.", "http", "api.example"),
            ("API.Example.", "http", "api.example"),
            ("api.example:0080", "http", "api.example"),
            ("api.example:080", "http", "api.example"),
            ("api.example.:443", "https", "api.example"),
            ("api.example.:0443", "https", "api.example"),
            ("api.example:", "http", "api.example"),
            ("api.example.:", "https", "api.example"),
            ("api.example:08443", "https", "api.example:8443"),
            ("api.example.:8443", "https", "api.example:8443"),
            ("api.example:00", "http", "api.example:0"),
            ("api.example..", "http", "api.example"),
            ("[::1]:080", "http", "[::1]"),
            ("[::1]:08080", "http", "[::1]:8080"),
            ("[::1]:", "http", "[::1]"),
            ("[::A]:0443", "https", "[::a]"),
            ("10.0.0.1.:80", "http", "10.0.0.1"),
        ] {
            assert_eq!(norm(spelled, scheme), normal, "{spelled} over {scheme}");
        }
        // Still another host or another port.
        assert_eq!(norm("api.example:8080", "http"), "api.example:8080");
        assert_eq!(norm("api.example:443", "http"), "api.example:443");
        assert_eq!(norm("api.example.com", "http"), "api.example.com");
        // Dots alone are no name: kept as spelled (without the default port).
        assert_eq!(norm(".", "http"), ".");
        assert_eq!(norm("..:80", "http"), "..");
    }

    /// An authority already normal is used in place: admission allocates nothing for it.
    #[test]
    fn a_normal_authority_is_borrowed() {
        for (authority, scheme) in
            [("api.example", "http"), ("api.example:8080", "http"), ("[::1]:8443", "https"), ("a:80", "http")]
        {
            assert!(
                matches!(normalize_authority(authority.as_bytes(), scheme.as_bytes()), Cow::Borrowed(_)),
                "{authority}"
            );
        }
        assert!(matches!(normalize_authority(b"API.example", b"http"), Cow::Owned(_)));
    }

    /// Records hold scope ids: a spelling that already was normal keeps the id it had (computed
    /// outside this code, Python hashlib over the documented layout), so stored records replay
    /// after an upgrade.
    #[test]
    fn normal_spellings_keep_their_scope_id() {
        for (authority, scheme, id) in [
            ("api.example", "http", "ade9334b1a6c746326da10a255b080bdd29735ed6c00073f28494a176784e639"),
            ("API.Example:80", "http", "ade9334b1a6c746326da10a255b080bdd29735ed6c00073f28494a176784e639"),
            ("api.example:443", "https", "ade9334b1a6c746326da10a255b080bdd29735ed6c00073f28494a176784e639"),
            ("api.example:8443", "http", "9824f9b6f4e09541d59746bba537ef6b6f84e8f6d02d02f0b28758f1bd454543"),
            ("[::1]:8080", "http", "86a3b5f8a23f6a757a776effc18865444937c748c080d84a6266bf80797f76c6"),
            ("10.0.0.1", "https", "e12d3e4e1c0f97e15f7e13f86508bc3074de067dcce58a846919e7c2b5ce6e4a"),
            ("api.example:0", "http", "9f4deb3352221670fee37dfaecf18513967c97c2db634d210783d634702ccf88"),
        ] {
            let normal = normalize_authority(authority.as_bytes(), scheme.as_bytes());
            let got = scope_id(&ScopeParts {
                tenant: Some(ACME),
                principal: principal_digest(&[("authorization", vec![b"Bearer a"])]),
                authority: &normal,
                method: "POST",
                path: "/orders",
                key: "k",
            });
            assert_eq!(hex(&got.0), id, "{authority} over {scheme}");
        }
    }

    /// Every authority whose form under the earlier rule is normal now normalizes to that form,
    /// so no record made under it is orphaned; and a `host[:port]` normalizes once for all.
    /// Exhaustive over short authorities of the characters that matter.
    #[test]
    fn the_normal_form_of_every_earlier_scope_is_kept() {
        // The rule of every build before this one, verbatim.
        fn earlier(authority: &[u8], scheme: &[u8]) -> Vec<u8> {
            let lower = authority.to_ascii_lowercase();
            let default_port: &[u8] = match scheme.to_ascii_lowercase().as_slice() {
                b"https" => b":443",
                _ => b":80",
            };
            match lower.strip_suffix(default_port) {
                Some(host) if !host.is_empty() => host.to_vec(),
                _ => lower,
            }
        }
        const ALPHABET: &[u8] = b"aA.:08[]4";
        let mut spelled = vec![Vec::new()];
        let mut checked = 0;
        for _ in 0..6 {
            let mut longer = Vec::new();
            for s in &spelled {
                for c in ALPHABET {
                    let mut t = s.clone();
                    t.push(*c);
                    longer.push(t);
                }
            }
            for s in &longer {
                for scheme in [&b"http"[..], b"https"] {
                    let before = earlier(s, scheme);
                    let now = normalize_authority(s, scheme);
                    if normalize_authority(&before, scheme).as_ref() == before.as_slice() {
                        assert_eq!(now.as_ref(), before.as_slice(), "{:?}", String::from_utf8_lossy(s));
                        checked += 1;
                    }
                    if host_and_port(s).is_some() {
                        assert_eq!(normalize_authority(&now, scheme).as_ref(), now.as_ref());
                    }
                }
            }
            spelled = longer;
        }
        assert!(checked > 100_000, "{checked}");
    }

    #[test]
    fn jwt_principals_never_collide_with_header_principals() {
        let jwt = jwt_principal_digest(&[("iss", Some(b"i")), ("sub", Some(b"u1"))]);
        assert_ne!(jwt, jwt_principal_digest(&[("iss", Some(b"i")), ("sub", Some(b"u2"))]));
        assert_ne!(jwt, jwt_principal_digest(&[("iss", Some(b"i")), ("sub", None)]));
        assert_ne!(jwt_principal_digest(&[("sub", Some(b""))]), jwt_principal_digest(&[("sub", None)]));
        assert_ne!(jwt, principal_digest(&[("iss", vec![b"i"]), ("sub", vec![b"u1"])]));
    }

    #[test]
    fn absent_principal_header_differs_from_empty_value() {
        let absent = principal_digest(&[("authorization", vec![])]);
        let empty = principal_digest(&[("authorization", vec![b""])]);
        assert_ne!(absent, empty);
        assert_eq!(absent, principal_digest(&[("authorization", vec![])]));
    }

    #[test]
    fn golden_scope_v2() {
        // Pins the scope encoding: records are found by this id, so a change here orphans every
        // stored record. If this fails, bump the tag and the store namespace, then update. The
        // expected value was computed outside this code (Python hashlib over the documented
        // layout).
        let id = scope_id(&ScopeParts {
            tenant: Some(ACME),
            principal: principal_digest(&[("authorization", vec![b"Bearer a"])]),
            authority: b"api.example",
            method: "POST",
            path: "/orders",
            key: "k",
        });
        assert_eq!(hex(&id.0), "ade9334b1a6c746326da10a255b080bdd29735ed6c00073f28494a176784e639");
    }
}
