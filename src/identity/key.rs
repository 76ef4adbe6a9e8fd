//! The Idempotency-Key header: which values are keys, and which are refused.
//!
//! The IETF draft (draft-ietf-httpapi-idempotency-key-header) defines the value as a structured
//! field string (`"8e03978e-..."`), while real clients send it bare (stripe-node:
//! `stripe-node-retry-<uuid>`). Both forms name the same key, so `"abc"` and `abc` are one key.
//! A rule may read its key from elsewhere (`routes[].key`): the same bounds hold.

use crate::json::JsonValue;

/// Longest accepted key, in characters (after unquoting).
pub const MAX_KEY_LEN: usize = 255;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    Missing,
    Repeated,
    Empty,
    TooLong,
    /// A byte outside visible ASCII (space, tab, DEL, control, non-ASCII).
    BadCharacter,
    /// Starts with `"` but is not a well-formed structured-field string.
    MalformedQuoted,
    /// A JSON key (`routes[].key.json`) that is neither a string nor an integer.
    NotText,
}

impl KeyError {
    pub fn detail(self) -> &'static str {
        match self {
            KeyError::Missing => "this endpoint requires an Idempotency-Key header",
            KeyError::Repeated => "the Idempotency-Key header must appear exactly once",
            KeyError::Empty => "the Idempotency-Key header is empty",
            KeyError::TooLong => "the Idempotency-Key is longer than 255 characters",
            KeyError::BadCharacter => {
                "the Idempotency-Key may only contain visible ASCII characters (0x21-0x7E)"
            }
            KeyError::MalformedQuoted => {
                "the Idempotency-Key starts with a quote but is not a valid quoted string"
            }
            KeyError::NotText => "the Idempotency-Key must be a string or an integer",
        }
    }

    /// The detail for a key read from a rule's own `place` (`in the header x-request-id`, `at
    /// /order_id in the JSON body`): the configuration's words, never the request's.
    pub fn detail_at(self, place: &str) -> String {
        let what = match self {
            KeyError::Missing => return format!("this endpoint requires an idempotency key {place}"),
            KeyError::Repeated => "must appear exactly once",
            KeyError::Empty => "is empty",
            KeyError::TooLong => "is longer than 255 characters",
            KeyError::BadCharacter => "may only contain visible ASCII characters (0x21-0x7E)",
            KeyError::MalformedQuoted => "starts with a quote but is not a valid quoted string",
            KeyError::NotText => "must be a string or an integer",
        };
        format!("the idempotency key {place} {what}")
    }
}

/// The key at a rule's JSON Pointer in the body (`routes[].key.json`): a string of 1 to 255
/// visible ASCII characters, taken as it is (no quoted form: JSON already quotes it), or an
/// integer, as written (`42` and `"42"` are one key: a client that sends both sends one
/// intent, which must not execute twice). Absent or `null` is a missing key.
pub fn key_from_json(value: Option<&JsonValue>) -> Result<IdempotencyKey, KeyError> {
    let text: &str = match value {
        None | Some(JsonValue::Null) => return Err(KeyError::Missing),
        Some(JsonValue::String(s)) => s,
        Some(JsonValue::Number(n)) if is_integer(n) => n,
        Some(_) => return Err(KeyError::NotText),
    };
    checked(text.as_bytes().to_vec())
}

/// `-?[0-9]+`: the JSON grammar already refused leading zeros.
fn is_integer(n: &str) -> bool {
    let digits = n.strip_prefix('-').unwrap_or(n);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Reads the key from every value the request carried for the key header (in arrival order).
pub fn parse_key(values: &[&[u8]]) -> Result<IdempotencyKey, KeyError> {
    let raw = match values {
        [] => return Err(KeyError::Missing),
        [one] => *one,
        _ => return Err(KeyError::Repeated),
    };
    let key = match raw.first() {
        Some(b'"') => unquote(raw)?,
        _ => raw.to_vec(),
    };
    checked(key)
}

/// A key's bytes, unquoted: 1 to `MAX_KEY_LEN` visible ASCII characters.
fn checked(key: Vec<u8>) -> Result<IdempotencyKey, KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::BadCharacter);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    // All bytes are ASCII, so this cannot fail; the fallback keeps the function total.
    String::from_utf8(key).map(IdempotencyKey).map_err(|_| KeyError::BadCharacter)
}

/// RFC 8941 sf-string: `"` *( unescaped / `\"` / `\\` ) `"`, printable ASCII inside.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let inner = match raw {
        [b'"', inner @ .., b'"'] if raw.len() >= 2 => inner,
        _ => return Err(KeyError::MalformedQuoted),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::MalformedQuoted),
            },
            b'"' => return Err(KeyError::MalformedQuoted),
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::BadCharacter),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &str) -> Result<String, KeyError> {
        parse_key(&[v.as_bytes()]).map(|k| k.as_str().to_string())
    }

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(key("abc-123"), Ok("abc-123".into()));
        assert_eq!(key("\"abc-123\""), Ok("abc-123".into()));
        assert_eq!(
            key("stripe-node-retry-8e03978e-40d5-43e8-bc93-6894a57f9324"),
            Ok("stripe-node-retry-8e03978e-40d5-43e8-bc93-6894a57f9324".into())
        );
    }

    #[test]
    fn quoted_escapes_unescape() {
        assert_eq!(key(r#""a\"b\\c""#), Ok(r#"a"b\c"#.into()));
    }

    #[test]
    fn refused_values() {
        let cases: &[(&[u8], KeyError)] = &[
            (b"", KeyError::Empty),
            (b"\"\"", KeyError::Empty),
            (b"a b", KeyError::BadCharacter),
            (b"a\tb", KeyError::BadCharacter),
            (b"a\x7fb", KeyError::BadCharacter),
            (b"caf\xc3\xa9", KeyError::BadCharacter),
            (b"a\x00b", KeyError::BadCharacter),
            (b"\"abc", KeyError::MalformedQuoted),
            (b"\"", KeyError::MalformedQuoted),
            (b"\"a\"b\"", KeyError::MalformedQuoted),
            (b"\"a\\x\"", KeyError::MalformedQuoted),
            (b"\"a b\"", KeyError::BadCharacter),
        ];
        for (raw, want) in cases {
            assert_eq!(parse_key(&[raw]), Err(*want), "{:?}", String::from_utf8_lossy(raw));
        }
    }

    #[test]
    fn json_keys_are_strings_or_integers_with_the_header_bounds() {
        use crate::json::{read, MemberOrder};
        let at = |body: &str| {
            let v = read(body.as_bytes(), 8, MemberOrder::Document).unwrap();
            key_from_json(v.get("k")).map(|k| k.as_str().to_string())
        };
        assert_eq!(at(r#"{"k":"ord-1"}"#), Ok("ord-1".into()));
        assert_eq!(at(r#"{"k":42}"#), Ok("42".into()));
        assert_eq!(at(r#"{"k":-7}"#), Ok("-7".into()));
        // 42 and "42" are one intent.
        assert_eq!(at(r#"{"k":"42"}"#), at(r#"{"k":42}"#));
        // A JSON string is never a structured-field string: its quotes are its own.
        assert_eq!(at(r#"{"k":"\"a\""}"#), Ok("\"a\"".into()));
        assert_eq!(at(r#"{"x":1}"#), Err(KeyError::Missing));
        assert_eq!(at(r#"{"k":null}"#), Err(KeyError::Missing));
        assert_eq!(at(r#"{"k":""}"#), Err(KeyError::Empty));
        assert_eq!(at(r#"{"k":"a b"}"#), Err(KeyError::BadCharacter));
        assert_eq!(at(r#"{"k":"caf\u00e9"}"#), Err(KeyError::BadCharacter));
        assert_eq!(at(&format!(r#"{{"k":"{}"}}"#, "k".repeat(256))), Err(KeyError::TooLong));
        assert_eq!(at(&format!(r#"{{"k":"{}"}}"#, "k".repeat(255))).map(|k| k.len()), Ok(255));
        for other in [r#"{"k":1.5}"#, r#"{"k":1e3}"#, r#"{"k":true}"#, r#"{"k":{}}"#, r#"{"k":[1]}"#] {
            assert_eq!(at(other), Err(KeyError::NotText), "{other}");
        }
    }

    #[test]
    fn a_rule_s_own_place_is_named_in_its_details() {
        assert_eq!(
            KeyError::Missing.detail_at("in the header x-request-id"),
            "this endpoint requires an idempotency key in the header x-request-id"
        );
        assert_eq!(
            KeyError::NotText.detail_at("at /order_id in the JSON body"),
            "the idempotency key at /order_id in the JSON body must be a string or an integer"
        );
    }

    #[test]
    fn length_limits() {
        assert!(key(&"k".repeat(255)).is_ok());
        assert_eq!(key(&"k".repeat(256)), Err(KeyError::TooLong));
        assert_eq!(key(&format!("\"{}\"", "k".repeat(256))), Err(KeyError::TooLong));
        assert_eq!(key("k"), Ok("k".into()));
    }

    #[test]
    fn missing_and_repeated() {
        assert_eq!(parse_key(&[]), Err(KeyError::Missing));
        assert_eq!(parse_key(&[b"a", b"a"]), Err(KeyError::Repeated));
    }
}
