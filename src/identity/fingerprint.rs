//! Request fingerprint, version 1: what "the same payload" means for an Idempotency-Key.
//! A retry whose fingerprint differs from the stored one is refused with 422.
//!
//! The stored records hold these digests, so the encoding below is a compatibility contract
//! (described normatively in `docs/FINGERPRINT.md` and pinned by the golden tests): changing
//! anything that alters a digest needs a new version, otherwise every in-flight retry would be
//! refused until its record expires.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::identity::canonical::canonicalize;

/// Kept in step with `DOMAIN_TAG` (a test checks it), so a record can say which encoding made its
/// digest.
pub const FINGERPRINT_VERSION: u8 = 1;

/// Separates these digests from any other SHA-256 use, and preimages of different fingerprint
/// versions from each other.
const DOMAIN_TAG: &[u8] = b"idempotency-filter/fingerprint/v1\0";

const MODE_JSON: u8 = b'J';
const MODE_RAW: u8 = b'R';

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lowercase hex, 64 characters.
    #[must_use]
    pub fn to_hex(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::codec::hex(&self.0))
    }
}

pub struct FingerprintInput<'a> {
    pub method: &'a str,
    /// Without the query.
    pub path: &'a str,
    /// `None`: no `?` in the request target; `Some("")`: a bare `?`.
    pub query: Option<&'a str>,
    /// The rule's fingerprint headers in config order: (lowercase name, all values in arrival
    /// order). An empty vector means the header was absent.
    pub headers: &'a [(&'a str, Vec<&'a [u8]>)],
    pub content_type: Option<&'a str>,
    pub body: &'a [u8],
}

/// How the body entered the fingerprint; returned for logs and metrics.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BodyMode {
    /// Canonical JSON v1 of the body, with the ignored fields removed.
    Json,
    /// The body bytes exactly as received.
    Raw,
}

impl BodyMode {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Raw => "raw",
        }
    }
}

/// Fingerprint v1 of a request. `ignore_json_fields` (decoded JSON Pointers) only matters when the
/// body is hashed as canonical JSON; a raw body is hashed whole.
#[must_use]
pub fn fingerprint(input: &FingerprintInput, ignore_json_fields: &[Vec<String>]) -> (Fingerprint, BodyMode) {
    let mut hasher = Sha256::new();
    let mode = encode(input, ignore_json_fields, &mut hasher);
    (Fingerprint(hasher.finalize().into()), mode)
}

/// `application/json`, or any `application/*+json` structured-syntax type (RFC 6839), e.g.
/// `application/merge-patch+json`. Parameters after `;` are ignored; case-insensitive.
#[must_use]
pub fn is_json_media_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim_matches([' ', '\t']);
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    if !kind.eq_ignore_ascii_case("application") || !is_token(subtype) {
        return false;
    }
    if subtype.eq_ignore_ascii_case("json") {
        return true;
    }
    // A suffix alone (`application/+json`) names no type.
    subtype.len() > 5
        && subtype.get(subtype.len() - 5..).is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"))
}

/// RFC 9110 token; keeps `application/json extra` and similar garbage out of JSON mode.
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Where the preimage goes: the hasher in production, a buffer in tests that pin the layout.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Lengths and counts: u32 big-endian. 0xFFFF_FFFF is reserved as an escape to a following
/// u64 so that the encoding stays prefix-free for any length without a panic path; it cannot
/// occur on wasm32, where no slice reaches 4 GiB.
fn put_len(sink: &mut impl Sink, len: usize) {
    match u32::try_from(len) {
        Ok(n) if n != u32::MAX => sink.put(&n.to_be_bytes()),
        _ => {
            sink.put(&u32::MAX.to_be_bytes());
            sink.put(&u64::try_from(len).unwrap_or(u64::MAX).to_be_bytes());
        }
    }
}

fn put_field(sink: &mut impl Sink, bytes: &[u8]) {
    put_len(sink, bytes.len());
    sink.put(bytes);
}

fn encode(input: &FingerprintInput, ignore_json_fields: &[Vec<String>], sink: &mut impl Sink) -> BodyMode {
    sink.put(DOMAIN_TAG);
    put_field(sink, input.method.as_bytes());
    put_field(sink, input.path.as_bytes());
    match input.query {
        None => sink.put(&[0]),
        Some(query) => {
            sink.put(&[1]);
            put_field(sink, query.as_bytes());
        }
    }
    put_len(sink, input.headers.len());
    for (name, values) in input.headers {
        put_field(sink, name.as_bytes());
        put_len(sink, values.len());
        for value in values {
            put_field(sink, value);
        }
    }

    let mut canonical = Vec::new();
    let json = input.content_type.is_some_and(is_json_media_type)
        && canonicalize(input.body, ignore_json_fields, &mut canonical).is_ok();
    // Malformed JSON still gets a defined fingerprint: the raw bytes under a different mode tag,
    // so it can equal neither a JSON-mode fingerprint nor one of a differently malformed body.
    let (mode, tag, body) = if json {
        (BodyMode::Json, MODE_JSON, canonical.as_slice())
    } else {
        (BodyMode::Raw, MODE_RAW, input.body)
    };
    sink.put(&[tag]);
    put_field(sink, body);
    mode
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a failing unwrap is a failing test
mod tests {
    use super::*;

    const JSON: Option<&str> = Some("application/json");

    fn input<'a>(body: &'a [u8], content_type: Option<&'a str>) -> FingerprintInput<'a> {
        FingerprintInput {
            method: "POST",
            path: "/v1/payments",
            query: None,
            headers: &[],
            content_type,
            body,
        }
    }

    fn fp(i: &FingerprintInput) -> Fingerprint {
        fingerprint(i, &[]).0
    }

    fn mode(i: &FingerprintInput) -> BodyMode {
        fingerprint(i, &[]).1
    }

    fn pointers(list: &[&[&str]]) -> Vec<Vec<String>> {
        list.iter().map(|p| p.iter().map(|t| (*t).to_owned()).collect()).collect()
    }

    #[test]
    fn json_bodies_compare_as_values() {
        let a = input(br#"{"amount":100,"currency":"EUR"}"#, JSON);
        let b = input(
            b"{ \"currency\" : \"\\u0045UR\",\n  \"amount\" : 100 }",
            Some("Application/JSON; charset=utf-8"),
        );
        assert_eq!(fingerprint(&a, &[]), fingerprint(&b, &[]));
        assert_eq!(mode(&a), BodyMode::Json);
    }

    #[test]
    fn json_numbers_are_compared_as_text() {
        let one = fp(&input(br#"{"n":1}"#, JSON));
        assert_ne!(one, fp(&input(br#"{"n":1.0}"#, JSON)));
        assert_ne!(one, fp(&input(br#"{"n":1e0}"#, JSON)));
        assert_ne!(
            fp(&input(br#"{"n":18446744073709551617}"#, JSON)),
            fp(&input(br#"{"n":18446744073709551618}"#, JSON))
        );
    }

    #[test]
    fn non_json_content_types_hash_the_raw_bytes() {
        let a = input(br#"{"a":1}"#, Some("text/plain"));
        let b = input(br#"{ "a":1}"#, Some("text/plain"));
        assert_ne!(fp(&a), fp(&b));
        assert_eq!(mode(&a), BodyMode::Raw);
        assert_eq!(fp(&input(br#"{"a":1}"#, JSON)), fp(&input(br#"{ "a":1}"#, JSON)));
        assert_eq!(mode(&input(br#"{"a":1}"#, None)), BodyMode::Raw);
    }

    #[test]
    fn same_bytes_differ_between_modes() {
        // `{"a":1}` is already canonical, so only the mode tag tells the two apart.
        assert_ne!(fp(&input(br#"{"a":1}"#, JSON)), fp(&input(br#"{"a":1}"#, Some("text/plain"))));
    }

    #[test]
    fn empty_body_under_json_content_type_is_raw() {
        let empty_json = input(b"", JSON);
        assert_eq!(mode(&empty_json), BodyMode::Raw);
        // Content type is not itself hashed, only the mode it selects.
        assert_eq!(fp(&empty_json), fp(&input(b"", None)));
    }

    #[test]
    fn malformed_json_falls_back_to_raw() {
        for body in [&br#"{"a":1,"a":2}"#[..], b"{\"a\":", b"\xff", b"{} {}", br#""\ud800""#] {
            let i = input(body, JSON);
            assert_eq!(mode(&i), BodyMode::Raw);
            assert_eq!(fp(&i), fp(&input(body, Some("text/plain"))));
        }
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(mode(&input(deep.as_bytes(), JSON)), BodyMode::Raw);
    }

    #[test]
    fn ignored_fields_apply_in_json_mode_only() {
        let ignore = pointers(&[&["meta", "sent_at"], &["items", "0", "ts"]]);
        let a = br#"{"meta":{"sent_at":"10:00"},"items":[{"ts":1,"v":1}]}"#;
        let b = br#"{"meta":{"sent_at":"10:05"},"items":[{"ts":2,"v":1}]}"#;
        assert_eq!(fingerprint(&input(a, JSON), &ignore), fingerprint(&input(b, JSON), &ignore));
        assert_ne!(fp(&input(a, JSON)), fp(&input(b, JSON)));
        let text = Some("text/plain");
        assert_ne!(fingerprint(&input(a, text), &ignore).0, fingerprint(&input(b, text), &ignore).0);
        // Unrelated fields still count.
        let c = br#"{"meta":{"sent_at":"10:05"},"items":[{"ts":2,"v":2}]}"#;
        assert_ne!(fingerprint(&input(a, JSON), &ignore).0, fingerprint(&input(c, JSON), &ignore).0);
    }

    #[test]
    fn header_absence_emptiness_and_multiplicity_differ() {
        let variants: [Vec<&[u8]>; 6] = [
            vec![],
            vec![&b""[..]],
            vec![&b"a"[..], &b"b"[..]],
            vec![&b"a,b"[..]],
            vec![&b"b"[..], &b"a"[..]],
            vec![&b"a"[..]],
        ];
        let mut seen = Vec::new();
        for values in variants {
            let headers = [("x-api-version", values)];
            let i = FingerprintInput { headers: &headers, ..input(b"", None) };
            let f = fp(&i);
            assert!(!seen.contains(&f), "{:?}", headers);
            seen.push(f);
        }
        let none: [(&str, Vec<&[u8]>); 0] = [];
        assert!(!seen.contains(&fp(&FingerprintInput { headers: &none, ..input(b"", None) })));
    }

    #[test]
    fn header_boundaries_are_unambiguous() {
        let a = [("x", vec![&b"yz"[..]]), ("w", vec![])];
        let b = [("xy", vec![&b"z"[..]]), ("w", vec![])];
        let c = [("x", vec![&b"y"[..], &b"z"[..]]), ("w", vec![])];
        let d = [("w", vec![]), ("x", vec![&b"yz"[..]])];
        let fps: Vec<Fingerprint> = [&a[..], &b, &c, &d]
            .iter()
            .map(|h| fp(&FingerprintInput { headers: h, ..input(b"", None) }))
            .collect();
        for (i, x) in fps.iter().enumerate() {
            for y in fps.iter().skip(i + 1) {
                assert_ne!(x, y);
            }
        }
    }

    #[test]
    fn query_presence_and_order_matter() {
        let none = fp(&input(b"", None));
        let bare = fp(&FingerprintInput { query: Some(""), ..input(b"", None) });
        assert_ne!(none, bare);
        let ab = fp(&FingerprintInput { query: Some("a=1&b=2"), ..input(b"", None) });
        let ba = fp(&FingerprintInput { query: Some("b=2&a=1"), ..input(b"", None) });
        let encoded = fp(&FingerprintInput { query: Some("a=%31&b=2"), ..input(b"", None) });
        assert_ne!(ab, ba);
        assert_ne!(ab, encoded);
    }

    #[test]
    fn method_and_path_matter_and_do_not_bleed_into_each_other() {
        let base = fp(&input(b"", None));
        assert_ne!(base, fp(&FingerprintInput { method: "PUT", ..input(b"", None) }));
        assert_ne!(base, fp(&FingerprintInput { method: "post", ..input(b"", None) }));
        assert_ne!(base, fp(&FingerprintInput { path: "/v1/payments/", ..input(b"", None) }));
        assert_ne!(
            fp(&FingerprintInput { method: "GE", path: "T/x", ..input(b"", None) }),
            fp(&FingerprintInput { method: "GET", path: "/x", ..input(b"", None) })
        );
        // A path ending in '?'-free text vs the same characters moved into the query.
        assert_ne!(
            fp(&FingerprintInput { path: "/a", query: Some("b"), ..input(b"", None) }),
            fp(&FingerprintInput { path: "/a?b", query: None, ..input(b"", None) })
        );
    }

    #[test]
    fn body_matters() {
        assert_ne!(fp(&input(b"a", None)), fp(&input(b"b", None)));
        assert_ne!(fp(&input(b"", None)), fp(&input(b"\0", None)));
    }

    #[test]
    fn preimage_layout() {
        let headers = [("x-a", vec![&b"1"[..], &b""[..]]), ("x-b", vec![])];
        let i = FingerprintInput {
            method: "PUT",
            path: "/p",
            query: Some("q"),
            headers: &headers,
            content_type: Some("application/json"),
            body: b" { \"b\":1, \"a\":2 } ",
        };
        let mut pre = Vec::new();
        assert_eq!(encode(&i, &[], &mut pre), BodyMode::Json);
        let mut expected = b"idempotency-filter/fingerprint/v1\0".to_vec();
        expected.extend_from_slice(b"\0\0\0\x03PUT");
        expected.extend_from_slice(b"\0\0\0\x02/p");
        expected.extend_from_slice(b"\x01\0\0\0\x01q");
        expected.extend_from_slice(b"\0\0\0\x02");
        expected.extend_from_slice(b"\0\0\0\x03x-a\0\0\0\x02\0\0\0\x011\0\0\0\0");
        expected.extend_from_slice(b"\0\0\0\x03x-b\0\0\0\0");
        expected.extend_from_slice(b"J\0\0\0\x0d{\"a\":2,\"b\":1}");
        assert_eq!(pre, expected);
        assert_eq!(fp(&i).0, <[u8; 32]>::from(Sha256::digest(&expected)));
    }

    #[test]
    fn oversized_lengths_use_the_escape() {
        let mut small = Vec::new();
        put_len(&mut small, 0xFFFF_FFFE);
        assert_eq!(small, [0xFF, 0xFF, 0xFF, 0xFE]);
        if let Ok(big) = usize::try_from(0xFFFF_FFFF_u64) {
            let mut out = Vec::new();
            put_len(&mut out, big);
            assert_eq!(out, [0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]);
        }
    }

    #[test]
    fn json_media_types() {
        for yes in [
            "application/json",
            "APPLICATION/JSON",
            " application/json ; charset=utf-8",
            "application/json;charset=UTF-8",
            "application/merge-patch+json",
            "application/problem+JSON",
            "application/vnd.api+json; ext=bulk",
        ] {
            assert!(is_json_media_type(yes), "{yes}");
        }
        for no in [
            "",
            "json",
            "text/json",
            "text/plain",
            "application/jsonx",
            "application/x-json5",
            "application/+json",
            "application/json-seq",
            "application/json5",
            "application/xml",
            "application/ json",
            "application/json extra",
            "multipart/form-data",
            "*/*",
        ] {
            assert!(!is_json_media_type(no), "{no}");
        }
    }

    #[test]
    fn hex_is_lowercase_and_complete() {
        let mut bytes = [0u8; 32];
        bytes[0] = 0xAB;
        bytes[31] = 0x0F;
        let hex = Fingerprint(bytes).to_hex();
        assert_eq!(hex.len(), 64);
        assert!(hex.starts_with("ab00"));
        assert!(hex.ends_with("000f"));
        assert_eq!(BodyMode::Json.as_str(), "json");
    }

    #[test]
    fn version_constant_matches_domain_tag() {
        let marker = format!("/v{FINGERPRINT_VERSION}\0");
        assert!(DOMAIN_TAG.ends_with(marker.as_bytes()));
    }

    /// The stability contract: these digests must never change within fingerprint v1.
    #[test]
    fn golden_vectors() {
        let plain = FingerprintInput {
            method: "POST",
            path: "/v1/payments",
            query: None,
            headers: &[],
            content_type: Some("application/json"),
            body: br#"{"amount":1000,"currency":"EUR","customer":{"id":"cus_42","name":"Zo\u00eb"}}"#,
        };
        let headers = [
            ("x-api-version", vec![&b"2024-06-01"[..]]),
            ("x-tenant", vec![]),
            ("accept-language", vec![&b"de"[..], &b"en;q=0.5"[..]]),
        ];
        let ignore = pointers(&[&["meta", "sent_at"], &["items", "1"]]);
        let with_headers = FingerprintInput {
            method: "PATCH",
            path: "/v1/orders/77",
            query: Some("expand=items&dry_run="),
            headers: &headers,
            content_type: Some("application/merge-patch+json; charset=utf-8"),
            body: b"{\"items\":[{\"sku\":\"A\",\"qty\":1.0},{\"sku\":\"B\"}],\"meta\":{\"sent_at\":\"2024-06-01T10:00:00Z\",\"note\":\"\\ud83d\\ude00 \\\"hi\\\"\\n\"},\"n\":18446744073709551617}",
        };
        let raw = FingerprintInput {
            method: "PUT",
            path: "/files/report.csv",
            query: Some(""),
            headers: &[("content-type", vec![&b"text/csv"[..]])],
            content_type: Some("text/csv"),
            body: b"a,b\r\n1,2\r\n",
        };
        let cases = [
            (
                fingerprint(&plain, &[]),
                BodyMode::Json,
                "f4070fbbeceae719ff21e51c30ff3bdb01e08dd6c4b1c03ec09114bc723bb3ad",
            ),
            (
                fingerprint(&with_headers, &ignore),
                BodyMode::Json,
                "0a3d15b1a12e9967aaf4a6448635434f6a604b89e73762bb79c64ba2334c73e4",
            ),
            (
                fingerprint(&raw, &[]),
                BodyMode::Raw,
                "acd5f844f662fab193f8dfaa46ca860bec780d19cff1898bba7edc53c6b246f1",
            ),
        ];
        for ((f, m), expected_mode, expected_hex) in cases {
            assert_eq!(m, expected_mode);
            assert_eq!(f.to_hex(), expected_hex);
        }
    }
}
