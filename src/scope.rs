//! Who a record belongs to. A record is found only by the exact (tenant, principal, method,
//! path, key) it was created under, so two callers can never see each other's responses even
//! when they pick the same key.
//!
//! Stability contract (scope v1): the scope id is SHA-256 over the length-prefixed fields below,
//! behind the domain tag. Records hold scope ids, so changing this encoding orphans every stored
//! record (retries would execute again): bump the tag and the store namespace together.

use sha2::{Digest, Sha256};

const SCOPE_TAG: &[u8] = b"idempotency-filter/scope/v1\0";
const PRINCIPAL_TAG: &[u8] = b"idempotency-filter/principal/v1\0";

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

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
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

pub struct ScopeParts<'a> {
    pub tenant: Option<&'a [u8]>,
    pub principal: [u8; 32],
    pub method: &'a str,
    pub path: &'a str,
    pub key: &'a str,
}

pub fn scope_id(p: &ScopeParts) -> ScopeId {
    let mut h = Sha256::new();
    h.update(SCOPE_TAG);
    match p.tenant {
        None => h.update([0u8]),
        Some(t) => {
            h.update([1u8]);
            field(&mut h, t);
        }
    }
    h.update(p.principal);
    field(&mut h, p.method.as_bytes());
    field(&mut h, p.path.as_bytes());
    field(&mut h, p.key.as_bytes());
    ScopeId(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> ScopeParts<'static> {
        ScopeParts {
            tenant: Some(b"acme"),
            principal: principal_digest(&[("authorization", vec![b"Bearer a"])]),
            method: "POST",
            path: "/orders",
            key: "k1",
        }
    }

    #[test]
    fn every_part_separates_scopes() {
        let a = scope_id(&base());
        let variants = [
            ScopeParts { tenant: Some(b"other"), ..base() },
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
    fn absent_principal_header_differs_from_empty_value() {
        let absent = principal_digest(&[("authorization", vec![])]);
        let empty = principal_digest(&[("authorization", vec![b""])]);
        assert_ne!(absent, empty);
        assert_eq!(absent, principal_digest(&[("authorization", vec![])]));
    }

    #[test]
    fn golden_scope_v1() {
        // Pins the scope encoding: records are found by this id, so a change here orphans every
        // stored record. If this fails, bump the tag and the store namespace, then update.
        let id = scope_id(&ScopeParts {
            tenant: Some(b"acme"),
            principal: principal_digest(&[("authorization", vec![b"Bearer a"])]),
            method: "POST",
            path: "/orders",
            key: "k",
        });
        assert_eq!(hex(&id.0), "3a2910dd763a83a96d95acac77f78d42cca0c89c2453ff38da5b1145fb338933");
    }
}
