//! Canonical JSON, version 1: the byte form a JSON request body is reduced to before it is
//! fingerprinted (see `docs/FINGERPRINT.md`, which is the normative description).
//!
//! A hand-written parser rather than serde_json because the contract needs things serde_json
//! does not give: the exact source text of every number (no float round trip, so `1` and `1.0`
//! stay different payloads), rejection of duplicate member names instead of silently keeping
//! one, and a hard nesting bound so hostile input cannot exhaust the Wasm stack.
//!
//! Soundness argument: the output is itself JSON that denotes exactly the parsed value (numbers
//! verbatim, strings fully unescaped then re-escaped one fixed way, members in one fixed order),
//! so two inputs that denote different values can only produce the same output through the
//! caller's ignore pointers.
//!
//! Any change to what this module emits changes fingerprints of stored records, so it is a
//! breaking change that needs a new canonical form version.

use std::borrow::Cow;
use std::fmt;

/// Maximum nesting of arrays and objects: a document with 64 nested containers is accepted,
/// one with 65 is rejected. Also bounds the recursion of the parser, the remover and the writer.
pub const MAX_DEPTH: usize = 64;

const BOM: &[u8] = b"\xEF\xBB\xBF";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CanonicalError {
    /// The body is not valid UTF-8 (RFC 8259 section 8.1 requires it).
    InvalidUtf8,
    /// The body starts with a UTF-8 byte order mark, which RFC 8259 forbids senders to add.
    ByteOrderMark,
    /// The body is empty or only whitespace.
    Empty,
    /// The input does not follow the JSON grammar; `offset` is the byte where that was noticed.
    Syntax { offset: usize },
    /// An object has two members whose names are equal after unescaping.
    DuplicateMember,
    /// Arrays and objects are nested more than `MAX_DEPTH` levels deep.
    TooDeep,
    /// A `\uXXXX` escape denotes a UTF-16 surrogate that is not part of a valid pair.
    LoneSurrogate,
    /// Something other than whitespace follows the single top-level value.
    TrailingData,
}

impl fmt::Display for CanonicalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidUtf8 => f.write_str("body is not valid UTF-8"),
            Self::ByteOrderMark => f.write_str("body starts with a UTF-8 byte order mark"),
            Self::Empty => f.write_str("body is empty or only whitespace"),
            Self::Syntax { offset } => write!(f, "JSON syntax error at byte {offset}"),
            Self::DuplicateMember => f.write_str("object has duplicate member names"),
            Self::TooDeep => write!(f, "JSON nested deeper than {MAX_DEPTH} levels"),
            Self::LoneSurrogate => f.write_str("string escape holds an unpaired UTF-16 surrogate"),
            Self::TrailingData => f.write_str("data after the top-level JSON value"),
        }
    }
}

impl std::error::Error for CanonicalError {}

/// Borrows from the input where it can (numbers, strings without escapes): the tree is already
/// several times the size of the body, so avoiding an allocation per scalar matters in Wasm.
#[derive(Debug)]
enum Value<'a> {
    Null,
    Bool(bool),
    /// Exact source text, already checked against the RFC 8259 number grammar.
    Number(&'a str),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// No duplicates, checked when the object is parsed. Sorted by name bytes when parsed for
    /// canonicalization; in document order when parsed for [`parse`].
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
    /// Tombstone for an ignored member or element. Marking instead of deleting keeps array
    /// indices stable, so every ignore pointer addresses the document as it was received,
    /// whatever the order of the pointers.
    Removed,
}

/// Appends the canonical form of `body` to `out`, with the values addressed by `ignore` removed.
///
/// Each entry of `ignore` is a JSON Pointer (RFC 6901) already split into decoded reference tokens
/// (`~1` -> `/`, `~0` -> `~`); a pointer that does not resolve is a no-op.
///
/// # Errors
///
/// Any input that is not exactly one RFC 8259 JSON text within the limits of canonical form v1;
/// `out` is left untouched then.
pub fn canonicalize(body: &[u8], ignore: &[Vec<String>], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    let mut root = parse_document(body, false)?;
    for pointer in ignore {
        remove(&mut root, pointer);
    }
    out.reserve(body.len());
    emit(&root, out);
    Ok(())
}

/// A JSON document as read by [`parse`], for modules that need to look inside JSON (the plugin
/// configuration) rather than fingerprint it. Borrows from the input where it can, like the
/// canonical tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonValue<'a> {
    Null,
    Bool(bool),
    /// Exact source text, already checked against the RFC 8259 number grammar: the caller
    /// decides which numbers it accepts, with no float round trip in between.
    Number(&'a str),
    String(Cow<'a, str>),
    Array(Vec<JsonValue<'a>>),
    /// Members in document order, so callers can report the first offending one; names are
    /// unique, since a duplicate is a parse error.
    Object(Vec<(Cow<'a, str>, JsonValue<'a>)>),
}

impl<'a> JsonValue<'a> {
    /// The member called `name`, or `None` when absent or when this is not an object.
    pub fn get(&self, name: &str) -> Option<&JsonValue<'a>> {
        match self {
            JsonValue::Object(members) => members.iter().find(|(n, _)| n == name).map(|(_, v)| v),
            _ => None,
        }
    }
}

/// Parses one JSON text under exactly the rules of canonical form v1 (UTF-8 only, no byte order
/// mark, no duplicate member names, at most `MAX_DEPTH` levels, no trailing data), keeping the
/// members of each object in document order.
///
/// # Errors
///
/// The same as [`canonicalize`] for the same input.
pub fn parse(bytes: &[u8]) -> Result<JsonValue<'_>, CanonicalError> {
    parse_document(bytes, true).map(into_public)
}

/// Recursion is bounded by `MAX_DEPTH`, which the parser enforced on the way in.
fn into_public(value: Value<'_>) -> JsonValue<'_> {
    match value {
        Value::Bool(b) => JsonValue::Bool(b),
        Value::Number(text) => JsonValue::Number(text),
        Value::String(s) => JsonValue::String(s),
        Value::Array(items) => JsonValue::Array(items.into_iter().map(into_public).collect()),
        Value::Object(members) => {
            JsonValue::Object(members.into_iter().map(|(name, v)| (name, into_public(v))).collect())
        }
        // Only ignore pointers create tombstones, and `parse` applies none.
        Value::Null | Value::Removed => JsonValue::Null,
    }
}

/// `keep_order`: leave object members in document order instead of sorting them for output.
fn parse_document(body: &[u8], keep_order: bool) -> Result<Value<'_>, CanonicalError> {
    if body.starts_with(BOM) {
        return Err(CanonicalError::ByteOrderMark);
    }
    // Validating once up front lets the parser scan bytes: every position it cuts at is an ASCII
    // delimiter, hence a char boundary of `text`.
    let Ok(text) = std::str::from_utf8(body) else {
        return Err(CanonicalError::InvalidUtf8);
    };
    let mut parser = Parser { text, bytes: body, pos: 0, keep_order };
    parser.skip_ws();
    if parser.peek().is_none() {
        return Err(CanonicalError::Empty);
    }
    let root = parser.parse_value(0)?;
    parser.skip_ws();
    if parser.pos != body.len() {
        return Err(CanonicalError::TrailingData);
    }
    Ok(root)
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    keep_order: bool,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn syntax(&self) -> CanonicalError {
        CanonicalError::Syntax { offset: self.pos }
    }

    /// Never fails for the ASCII-delimited ranges the parser asks for; checked all the same.
    fn slice(&self, start: usize, end: usize) -> Result<&'a str, CanonicalError> {
        self.text.get(start..end).ok_or(CanonicalError::Syntax { offset: start })
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Result<(), CanonicalError> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.syntax())
        }
    }

    /// `depth` is the number of containers enclosing this value; recursion happens only when
    /// entering a container, which is refused beyond `MAX_DEPTH`, so the stack stays bounded.
    fn parse_value(&mut self, depth: usize) -> Result<Value<'a>, CanonicalError> {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.parse_object(depth + 1),
            Some(b'[') => self.parse_array(depth + 1),
            Some(b'"') => Ok(Value::String(self.parse_string()?)),
            Some(b't') => self.literal(b"true", Value::Bool(true)),
            Some(b'f') => self.literal(b"false", Value::Bool(false)),
            Some(b'n') => self.literal(b"null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.parse_number(),
            _ => Err(self.syntax()),
        }
    }

    fn literal(&mut self, text: &[u8], value: Value<'a>) -> Result<Value<'a>, CanonicalError> {
        let end = self.pos + text.len();
        if self.bytes.get(self.pos..end) == Some(text) {
            self.pos = end;
            Ok(value)
        } else {
            Err(self.syntax())
        }
    }

    fn parse_array(&mut self, depth: usize) -> Result<Value<'a>, CanonicalError> {
        if depth > MAX_DEPTH {
            return Err(CanonicalError::TooDeep);
        }
        self.eat(b'[')?;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.parse_value(depth)?);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.syntax()),
            }
        }
    }

    fn parse_object(&mut self, depth: usize) -> Result<Value<'a>, CanonicalError> {
        if depth > MAX_DEPTH {
            return Err(CanonicalError::TooDeep);
        }
        self.eat(b'{')?;
        let mut members: Vec<(Cow<'a, str>, Value<'a>)> = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.syntax());
            }
            let name = self.parse_string()?;
            self.skip_ws();
            self.eat(b':')?;
            let value = self.parse_value(depth)?;
            members.push((name, value));
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.syntax()),
            }
        }
        // Sorting first turns duplicate detection into one linear pass (no quadratic scan),
        // and the sort is needed for the output anyway. Unstable is fine: equal names are an
        // error, so no two elements compare equal in an accepted object.
        let duplicate = if self.keep_order {
            // Sorting a separate list of names keeps the members themselves in document order.
            let mut names: Vec<&[u8]> = members.iter().map(|(name, _)| name.as_bytes()).collect();
            names.sort_unstable();
            names.windows(2).any(|pair| matches!(pair, [a, b] if a == b))
        } else {
            members.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            members.windows(2).any(|pair| match pair {
                [a, b] => a.0 == b.0,
                _ => false,
            })
        };
        if duplicate {
            return Err(CanonicalError::DuplicateMember);
        }
        Ok(Value::Object(members))
    }

    fn parse_number(&mut self) -> Result<Value<'a>, CanonicalError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                // `01` is not a JSON number; report it as such rather than as trailing data.
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.syntax());
                }
            }
            Some(b'1'..=b'9') => self.skip_digits(),
            _ => return Err(self.syntax()),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            self.require_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.require_digits()?;
        }
        Ok(Value::Number(self.slice(start, self.pos)?))
    }

    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn require_digits(&mut self) -> Result<(), CanonicalError> {
        match self.peek() {
            Some(b'0'..=b'9') => {
                self.skip_digits();
                Ok(())
            }
            _ => Err(self.syntax()),
        }
    }

    /// Called on the opening quote; returns the unescaped string.
    fn parse_string(&mut self) -> Result<Cow<'a, str>, CanonicalError> {
        self.eat(b'"')?;
        let start = self.pos;
        self.skip_plain();
        if self.peek() == Some(b'"') {
            let plain = self.slice(start, self.pos)?;
            self.pos += 1;
            return Ok(Cow::Borrowed(plain));
        }
        let mut buf = String::from(self.slice(start, self.pos)?);
        loop {
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(Cow::Owned(buf));
                }
                Some(b'\\') => {
                    self.pos += 1;
                    buf.push(self.parse_escape()?);
                }
                // Unterminated string, or a raw control character (RFC 8259 section 7).
                _ => return Err(self.syntax()),
            }
            let run = self.pos;
            self.skip_plain();
            buf.push_str(self.slice(run, self.pos)?);
        }
    }

    fn skip_plain(&mut self) {
        while let Some(b) = self.peek() {
            if b == b'"' || b == b'\\' || b < 0x20 {
                break;
            }
            self.pos += 1;
        }
    }

    /// Called just after the backslash.
    fn parse_escape(&mut self) -> Result<char, CanonicalError> {
        let simple = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                return self.parse_unicode_escape();
            }
            _ => return Err(self.syntax()),
        };
        self.pos += 1;
        Ok(simple)
    }

    /// Called just after `\u`; consumes a second `\uXXXX` when the first is a high surrogate.
    fn parse_unicode_escape(&mut self) -> Result<char, CanonicalError> {
        let first = self.hex4()?;
        let scalar = match first {
            0xD800..=0xDBFF => {
                if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return Err(CanonicalError::LoneSurrogate);
                }
                self.pos += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(CanonicalError::LoneSurrogate);
                }
                0x10000 + ((u32::from(first) - 0xD800) << 10) + (u32::from(second) - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(CanonicalError::LoneSurrogate),
            other => u32::from(other),
        };
        char::from_u32(scalar).ok_or(CanonicalError::LoneSurrogate)
    }

    fn hex4(&mut self) -> Result<u16, CanonicalError> {
        let mut value: u16 = 0;
        for _ in 0..4 {
            let digit = match self.peek() {
                Some(b @ b'0'..=b'9') => b - b'0',
                Some(b @ b'a'..=b'f') => b - b'a' + 10,
                Some(b @ b'A'..=b'F') => b - b'A' + 10,
                _ => return Err(self.syntax()),
            };
            value = (value << 4) | u16::from(digit);
            self.pos += 1;
        }
        Ok(value)
    }
}

/// RFC 6901 array index: `0` or a decimal without leading zeros. `-` (past the end) and
/// anything else never addresses an element, so such a pointer is a no-op.
fn array_index(token: &str) -> Option<usize> {
    let bytes = token.as_bytes();
    let canonical = match bytes {
        [b'0'] => true,
        [b'1'..=b'9', rest @ ..] => rest.iter().all(u8::is_ascii_digit),
        _ => false,
    };
    if canonical {
        token.parse().ok()
    } else {
        None
    }
}

fn child_mut<'v, 'a>(node: &'v mut Value<'a>, token: &str) -> Option<&'v mut Value<'a>> {
    match node {
        Value::Object(members) => {
            let i = members.binary_search_by(|(name, _)| name.as_bytes().cmp(token.as_bytes())).ok()?;
            members.get_mut(i).map(|(_, v)| v)
        }
        Value::Array(items) => items.get_mut(array_index(token)?),
        _ => None,
    }
}

/// Marks the value at `pointer` as removed. Iterative, so pointer length does not matter. The
/// empty pointer (the whole document) is a no-op: there would be nothing left to fingerprint,
/// and treating the entire body as irrelevant is not what an ignore list is for.
fn remove(root: &mut Value<'_>, pointer: &[String]) {
    let Some((last, parents)) = pointer.split_last() else {
        return;
    };
    let mut node = root;
    for token in parents {
        match child_mut(node, token) {
            Some(child) => node = child,
            None => return,
        }
    }
    if let Some(target) = child_mut(node, last) {
        *target = Value::Removed;
    }
}

fn emit(value: &Value<'_>, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(text) => out.extend_from_slice(text.as_bytes()),
        Value::String(s) => emit_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            let mut first = true;
            for item in items.iter().filter(|v| !matches!(v, Value::Removed)) {
                if !first {
                    out.push(b',');
                }
                first = false;
                emit(item, out);
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            let mut first = true;
            for (name, member) in members.iter().filter(|(_, v)| !matches!(v, Value::Removed)) {
                if !first {
                    out.push(b',');
                }
                first = false;
                emit_string(name, out);
                out.push(b':');
                emit(member, out);
            }
            out.push(b'}');
        }
        // Only reachable for the root, which `remove` never marks.
        Value::Removed => {}
    }
}

/// Appends `s` as a JSON string literal: `"` and `\\` escaped, control characters as `\u00xx`,
/// everything else verbatim. Public so other JSON the filter writes uses the same tested escaping;
/// for canonical output it is part of the v1 contract and must not change.
pub fn emit_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    // Runs that need no escaping (nearly all of a typical body) are copied in one go.
    let mut run_start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x00..=0x1F => b"\\u00",
            // Bytes >= 0x80 belong to multi-byte UTF-8 sequences and are copied as they are.
            _ => continue,
        };
        out.extend_from_slice(bytes.get(run_start..i).unwrap_or_default());
        out.extend_from_slice(escaped);
        if b < 0x20 {
            out.push(hex_digit(b >> 4));
            out.push(hex_digit(b & 0x0F));
        }
        run_start = i + 1;
    }
    out.extend_from_slice(bytes.get(run_start..).unwrap_or_default());
    out.push(b'"');
}

fn hex_digit(nibble: u8) -> u8 {
    if nibble < 10 {
        b'0' + nibble
    } else {
        b'a' + (nibble - 10)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)] // a failing unwrap is a failing test
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn canon(body: &str) -> Result<String, CanonicalError> {
        canon_ignoring(body, &[])
    }

    fn canon_ignoring(body: &str, ignore: &[&[&str]]) -> Result<String, CanonicalError> {
        let pointers: Vec<Vec<String>> =
            ignore.iter().map(|p| p.iter().map(|t| (*t).to_owned()).collect()).collect();
        let mut out = Vec::new();
        canonicalize(body.as_bytes(), &pointers, &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = canon(r#"{"b":1,"a":{"y":[1,2],"x":null}}"#).unwrap();
        let b = canon(" \r\n\t{ \"a\" : { \"x\" : null , \"y\" : [ 1 , 2 ] } ,\n \"b\" : 1 }\n ").unwrap();
        assert_eq!(a, b);
        assert_eq!(a, r#"{"a":{"x":null,"y":[1,2]},"b":1}"#);
    }

    #[test]
    fn members_sorted_by_utf8_bytes() {
        // UTF-16 order would put U+FF5E before U+1F600; UTF-8 byte order puts it after.
        assert_eq!(
            canon("{\"\u{1F600}\":1,\"\u{FF5E}\":2,\"B\":3,\"a\":4,\"\":5}").unwrap(),
            "{\"\":5,\"B\":3,\"a\":4,\"\u{FF5E}\":2,\"\u{1F600}\":1}"
        );
    }

    #[test]
    fn array_order_matters() {
        assert_ne!(canon("[1,2]").unwrap(), canon("[2,1]").unwrap());
    }

    #[test]
    fn escapes_are_equivalent_to_raw_characters() {
        assert_eq!(canon(r#""\u0041""#).unwrap(), canon(r#""A""#).unwrap());
        assert_eq!(canon(r#""\/""#).unwrap(), "\"/\"");
        assert_eq!(canon(r#""\u00e9\u00E9""#).unwrap(), "\"éé\"");
        assert_eq!(canon(r#""\ud83d\ude00""#).unwrap(), "\"\u{1F600}\"");
        assert_eq!(canon(r#""\uD83D\uDE00""#).unwrap(), canon("\"\u{1F600}\"").unwrap());
        assert_eq!(canon(r#"{"\u0061":1}"#).unwrap(), canon(r#"{"a":1}"#).unwrap());
    }

    #[test]
    fn strings_are_re_escaped_one_way() {
        assert_eq!(
            canon(r#""q\"b\\s\b\f\n\r\t\u0000\u001F\u007f""#).unwrap(),
            "\"q\\\"b\\\\s\\u0008\\u000c\\u000a\\u000d\\u0009\\u0000\\u001f\u{7f}\""
        );
        assert_eq!(canon(r#""\u0022""#).unwrap(), canon(r#""\"""#).unwrap());
        assert_ne!(canon(r#""a\\u0041""#).unwrap(), canon(r#""aA""#).unwrap());
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        let texts = [
            "1",
            "1.0",
            "1e0",
            "1E0",
            "1e+0",
            "10e-1",
            "-0",
            "0",
            "18446744073709551616",
            "18446744073709551617",
            "18446744073709551618",
            "-1.5E-300",
        ];
        let mut seen = std::collections::BTreeSet::new();
        for t in texts {
            let c = canon(&format!("[ {t} ]")).unwrap();
            assert_eq!(c, format!("[{t}]"));
            assert!(seen.insert(c), "{t} collided");
        }
    }

    #[test]
    fn malformed_numbers_are_rejected() {
        for bad in [
            "01",
            "-01",
            "1.",
            ".5",
            "+1",
            "-",
            "1e",
            "1e+",
            "1.e5",
            "0x10",
            "NaN",
            "Infinity",
            "-Infinity",
            "1_000",
            "[01]",
            "[1.]",
            "[-]",
            "{\"a\":00}",
        ] {
            let r = canon(bad);
            assert!(
                matches!(r, Err(CanonicalError::Syntax { .. } | CanonicalError::TrailingData)),
                "{bad}: {r:?}"
            );
        }
        assert_eq!(canon("01"), Err(CanonicalError::Syntax { offset: 1 }));
    }

    #[test]
    fn literals() {
        assert_eq!(canon(" [true,false,null] ").unwrap(), "[true,false,null]");
        for bad in ["tru", "True", "nul", "[fals]", "nil"] {
            assert!(matches!(canon(bad), Err(CanonicalError::Syntax { .. })), "{bad}");
        }
    }

    #[test]
    fn duplicate_members_are_rejected() {
        assert_eq!(canon(r#"{"a":1,"a":1}"#), Err(CanonicalError::DuplicateMember));
        assert_eq!(canon(r#"{"a":1,"\u0061":2}"#), Err(CanonicalError::DuplicateMember));
        assert_eq!(canon(r#"{"x":[{"b":1,"c":2,"b":3}]}"#), Err(CanonicalError::DuplicateMember));
        // Same name in different objects is fine.
        assert!(canon(r#"{"a":{"a":1},"b":{"a":2}}"#).is_ok());
    }

    #[test]
    fn duplicates_are_rejected_even_under_an_ignored_path() {
        let r = canon_ignoring(r#"{"meta":{"t":1,"t":2}}"#, &[&["meta", "t"]]);
        assert_eq!(r, Err(CanonicalError::DuplicateMember));
    }

    #[test]
    fn ignore_nested_members_and_array_elements() {
        let body = r#"{"meta":{"sent_at":"2024","id":7},"items":[{"ts":1,"v":"a"},{"ts":2,"v":"b"}],"a/b":1,"m~n":2,"k":3}"#;
        let out =
            canon_ignoring(body, &[&["meta", "sent_at"], &["items", "0", "ts"], &["a/b"], &["m~n"]]).unwrap();
        assert_eq!(out, r#"{"items":[{"v":"a"},{"ts":2,"v":"b"}],"k":3,"meta":{"id":7}}"#);

        let other = r#"{"k":3,"a/b":99,"m~n":[1],"items":[{"v":"a","ts":999},{"v":"b","ts":2}],"meta":{"id":7,"sent_at":"2025"}}"#;
        let out2 = canon_ignoring(other, &[&["meta", "sent_at"], &["items", "0", "ts"], &["a/b"], &["m~n"]])
            .unwrap();
        assert_eq!(out, out2);
    }

    #[test]
    fn removed_array_elements_shift_and_pointers_address_the_received_document() {
        let body = r#"{"items":["a","b","c","d"]}"#;
        assert_eq!(canon_ignoring(body, &[&["items", "1"]]).unwrap(), r#"{"items":["a","c","d"]}"#);
        // Both pointers refer to the original indices, whatever their order.
        let expected = r#"{"items":["a","d"]}"#;
        assert_eq!(canon_ignoring(body, &[&["items", "1"], &["items", "2"]]).unwrap(), expected);
        assert_eq!(canon_ignoring(body, &[&["items", "2"], &["items", "1"]]).unwrap(), expected);
        // A removed element is indistinguishable from one that was never sent.
        assert_eq!(canon_ignoring(r#"[0,1]"#, &[&["0"]]).unwrap(), canon(r#"[1]"#).unwrap());
        assert_eq!(canon_ignoring(r#"[0]"#, &[&["0"]]).unwrap(), "[]");
        assert_eq!(canon_ignoring(r#"{"a":1}"#, &[&["a"]]).unwrap(), "{}");
        assert_eq!(canon_ignoring(r#"{"a":1,"b":2,"c":3}"#, &[&["b"]]).unwrap(), r#"{"a":1,"c":3}"#);
        // A pointer below a removed value is a no-op.
        assert_eq!(canon_ignoring(r#"[{"a":1},2]"#, &[&["0"], &["0", "a"]]).unwrap(), "[2]");
    }

    #[test]
    fn unresolvable_pointers_are_no_ops() {
        let body = r#"{"items":[{"ts":1}],"n":5,"s":"x"}"#;
        let plain = canon(body).unwrap();
        let cases: [&[&str]; 11] = [
            &["missing"],
            &["items", "1"],
            &["items", "01"],
            &["items", "-"],
            &["items", "+0"],
            &["items", " 0"],
            &["items", "99999999999999999999999999"],
            &["n", "0"],
            &["s", "x"],
            &["items", "0", "ts", "deeper"],
            &[],
        ];
        for pointer in cases {
            assert_eq!(canon_ignoring(body, &[pointer]).unwrap(), plain, "{pointer:?}");
        }
        // On an object, "0" is a member name, not an index.
        assert_eq!(canon_ignoring(r#"{"0":1,"1":2}"#, &[&["0"]]).unwrap(), r#"{"1":2}"#);
    }

    fn nested(depth: usize, open: &str, close: &str) -> String {
        format!("{}1{}", open.repeat(depth), close.repeat(depth))
    }

    #[test]
    fn depth_limit_is_exact() {
        assert!(canon(&nested(MAX_DEPTH, "[", "]")).is_ok());
        assert_eq!(canon(&nested(MAX_DEPTH + 1, "[", "]")), Err(CanonicalError::TooDeep));
        assert!(canon(&nested(MAX_DEPTH, "{\"a\":", "}")).is_ok());
        assert_eq!(canon(&nested(MAX_DEPTH + 1, "{\"a\":", "}")), Err(CanonicalError::TooDeep));
        assert_eq!(
            canon(&format!("{}{{}}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH))),
            Err(CanonicalError::TooDeep)
        );
    }

    #[test]
    fn very_deep_input_fails_fast_without_overflowing_the_stack() {
        let start = Instant::now();
        for (open, close) in [("[", "]"), ("{\"a\":", "}"), ("[{\"k\":", "}]")] {
            assert_eq!(canon(&nested(10_000, open, close)), Err(CanonicalError::TooDeep));
            // Unterminated too: the depth error must come before any need to see the end.
            assert_eq!(canon(&open.repeat(10_000)), Err(CanonicalError::TooDeep));
        }
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn wide_input_is_not_quadratic() {
        let n = 200_000;
        let members: Vec<String> = (0..n).rev().map(|i| format!("\"k{i}\":{i}")).collect();
        let body = format!("{{{}}}", members.join(","));
        let array = format!("[{}]", vec!["\"\\u00e9x\""; n].join(","));
        let start = Instant::now();
        assert!(canon(&body).is_ok());
        assert!(canon(&array).is_ok());
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn invalid_utf8_is_rejected() {
        let mut out = Vec::new();
        for bad in [
            &b"\"\xff\""[..],
            b"\"\xc0\x80\"",
            b"\"\xe2\x82\"",
            b"\"\xed\xa0\x80\"", // UTF-8 encoded surrogate
            b"{\"a\":1}\xff",
        ] {
            assert_eq!(canonicalize(bad, &[], &mut out), Err(CanonicalError::InvalidUtf8));
        }
        assert!(out.is_empty());
    }

    #[test]
    fn bom_is_rejected() {
        let mut out = Vec::new();
        assert_eq!(canonicalize(b"\xEF\xBB\xBF{}", &[], &mut out), Err(CanonicalError::ByteOrderMark));
    }

    #[test]
    fn lone_surrogates_are_rejected() {
        for bad in [
            r#""\ud800""#,
            r#""\udc00""#,
            r#""\ud83dx""#,
            r#""\ud83d\u0041""#,
            r#""\ud83d\ud83d""#,
            r#""\ude00\ud83d""#,
            r#"{"\ud800":1}"#,
        ] {
            assert_eq!(canon(bad), Err(CanonicalError::LoneSurrogate), "{bad}");
        }
        assert!(matches!(canon(r#""\ud83d\u00""#), Err(CanonicalError::Syntax { .. })));
    }

    #[test]
    fn string_syntax_errors() {
        for bad in [
            "\"a\nb\"",
            "\"tab\there\"",
            "\"\u{1}\"",
            "\"unterminated",
            r#""\x41""#,
            r#""\u12""#,
            r#""\u12g4""#,
            r#""\"#,
            "{a:1}",
            "{'a':1}",
            r#"{"a" 1}"#,
            r#"{"a":1,}"#,
            "[1,]",
            "[,1]",
            "[1 2]",
            "{\"a\":1",
            "[",
        ] {
            assert!(matches!(canon(bad), Err(CanonicalError::Syntax { .. })), "{bad:?}");
        }
    }

    #[test]
    fn only_json_whitespace_is_allowed() {
        assert!(matches!(canon("\u{c}{}"), Err(CanonicalError::Syntax { offset: 0 })));
        assert!(matches!(canon("{}\u{a0}"), Err(CanonicalError::TrailingData)));
        assert!(matches!(canon("[1,\u{b}2]"), Err(CanonicalError::Syntax { .. })));
    }

    #[test]
    fn trailing_data_is_rejected() {
        for bad in ["{} {}", "1 2", "nulll", "{}x", "[]]", "\"a\"\"b\"", "0 0"] {
            assert_eq!(canon(bad), Err(CanonicalError::TrailingData), "{bad}");
        }
    }

    #[test]
    fn empty_input() {
        assert_eq!(canon(""), Err(CanonicalError::Empty));
        assert_eq!(canon(" \r\n\t"), Err(CanonicalError::Empty));
    }

    #[test]
    fn scalars_at_top_level() {
        assert_eq!(canon(" 12 ").unwrap(), "12");
        assert_eq!(canon(" \"\\u0041\" ").unwrap(), "\"A\"");
        assert_eq!(canon("null").unwrap(), "null");
    }

    #[test]
    fn output_is_appended_and_untouched_on_error() {
        let mut out = b"prefix".to_vec();
        canonicalize(b"{ }", &[], &mut out).unwrap();
        assert_eq!(out, b"prefix{}");
        assert!(canonicalize(b"{\"a\":1,\"a\":2}", &[], &mut out).is_err());
        assert_eq!(out, b"prefix{}");
    }

    #[test]
    fn errors_display() {
        assert_eq!(CanonicalError::Syntax { offset: 3 }.to_string(), "JSON syntax error at byte 3");
        assert!(CanonicalError::TooDeep.to_string().contains("64"));
    }

    // ---- parse: the public tree for other modules ----

    fn s(text: &str) -> JsonValue<'static> {
        JsonValue::String(Cow::Owned(text.to_owned()))
    }

    #[test]
    fn parse_keeps_document_order_and_exact_numbers() {
        let v = parse(br#" {"b":[1.0,-0,1e3,true,null],"a":{"y":"\u0041\n","x":false}} "#).unwrap();
        let expected = JsonValue::Object(vec![
            (
                "b".into(),
                JsonValue::Array(vec![
                    JsonValue::Number("1.0"),
                    JsonValue::Number("-0"),
                    JsonValue::Number("1e3"),
                    JsonValue::Bool(true),
                    JsonValue::Null,
                ]),
            ),
            (
                "a".into(),
                JsonValue::Object(vec![("y".into(), s("A\n")), ("x".into(), JsonValue::Bool(false))]),
            ),
        ]);
        assert_eq!(v, expected);
        assert_eq!(v.get("a").and_then(|a| a.get("x")), Some(&JsonValue::Bool(false)));
        assert_eq!(v.get("missing"), None);
        assert_eq!(JsonValue::Null.get("a"), None);
    }

    #[test]
    fn parse_borrows_plain_strings() {
        let v = parse(br#"["plain","esc\"aped"]"#).unwrap();
        let JsonValue::Array(items) = v else { unreachable!() };
        assert!(matches!(&items[0], JsonValue::String(Cow::Borrowed("plain"))));
        assert!(matches!(&items[1], JsonValue::String(Cow::Owned(o)) if o == "esc\"aped"));
    }

    #[test]
    fn parse_rejects_exactly_what_canonicalize_rejects() {
        let deep = nested(MAX_DEPTH + 1, "[", "]");
        let ok_deep = nested(MAX_DEPTH, "{\"a\":", "}");
        let inputs: [&[u8]; 16] = [
            b"",
            b" \t",
            b"\xEF\xBB\xBF{}",
            b"\"\xff\"",
            b"{\"a\":1,\"a\":2}",
            br#"{"x":[{"b":1,"c":2,"\u0062":3}]}"#,
            br#"{"a":{"a":1},"b":{"a":2}}"#,
            b"[1,]",
            b"01",
            b"{} {}",
            br#""\ud800""#,
            deep.as_bytes(),
            ok_deep.as_bytes(),
            b"[1.5e-3,\"\\u0000\",{}]",
            b"{\"a\":1",
            b"tru",
        ];
        for input in inputs {
            let mut out = Vec::new();
            let canonical = canonicalize(input, &[], &mut out);
            assert_eq!(parse(input).map(|_| ()), canonical, "{:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(parse(b"{\"a\":1,\"a\":2}"), Err(CanonicalError::DuplicateMember));
        assert_eq!(parse(b"[1,]"), Err(CanonicalError::Syntax { offset: 3 }));
    }

    #[test]
    fn parse_finds_duplicates_among_many_members_in_any_order() {
        let mut members: Vec<String> = (0..1000).map(|i| format!("\"k{i}\":{i}")).collect();
        assert!(parse(format!("{{{}}}", members.join(",")).as_bytes()).is_ok());
        members.push("\"k500\":0".to_owned());
        members.rotate_right(1);
        assert_eq!(
            parse(format!("{{{}}}", members.join(",")).as_bytes()),
            Err(CanonicalError::DuplicateMember)
        );
    }

    #[test]
    fn emit_string_escapes_quote_backslash_and_controls() {
        let mut out = Vec::new();
        emit_string("a\"\\\u{1}\u{1f} é/", &mut out);
        assert_eq!(out, "\"a\\\"\\\\\\u0001\\u001f é/\"".as_bytes());
    }

    // ---- property-style tests with a self-contained deterministic generator ----

    /// Knuth's MMIX LCG; the high bits are used because the low ones have short periods.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u32 {
            self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) as u32
        }
        fn below(&mut self, n: u32) -> u32 {
            self.next() % n
        }
        fn chance(&mut self, percent: u32) -> bool {
            self.below(100) < percent
        }
    }

    #[derive(Clone, Debug)]
    enum Gen {
        Null,
        Bool(bool),
        Num(String),
        Str(String),
        Arr(Vec<Gen>),
        Obj(Vec<(String, Gen)>),
    }

    const NUMBERS: [&str; 10] =
        ["0", "-0", "1", "1.0", "1e0", "-12.5E+3", "18446744073709551617", "3.14159", "7e-9", "42"];
    const CHARS: [char; 12] =
        ['a', 'Z', ' ', '"', '\\', '/', '\n', '\u{1}', 'é', '\u{7f}', '\u{FF5E}', '\u{1F600}'];

    fn gen_string(rng: &mut Lcg) -> String {
        (0..rng.below(6)).map(|_| CHARS[rng.below(CHARS.len() as u32) as usize]).collect()
    }

    fn gen_value(rng: &mut Lcg, depth: usize) -> Gen {
        let kinds = if depth >= 4 { 4 } else { 6 };
        match rng.below(kinds) {
            0 => Gen::Null,
            1 => Gen::Bool(rng.chance(50)),
            2 => Gen::Num(NUMBERS[rng.below(NUMBERS.len() as u32) as usize].to_owned()),
            3 => Gen::Str(gen_string(rng)),
            4 => Gen::Arr((0..rng.below(4)).map(|_| gen_value(rng, depth + 1)).collect()),
            _ => Gen::Obj(
                (0..rng.below(4))
                    // The index suffix keeps names unique within one object.
                    .map(|i| (format!("{}{i}", gen_string(rng)), gen_value(rng, depth + 1)))
                    .collect(),
            ),
        }
    }

    fn ws(rng: &mut Lcg, out: &mut String) {
        for _ in 0..rng.below(3) {
            out.push([' ', '\t', '\n', '\r'][rng.below(4) as usize]);
        }
    }

    /// Serializes with random whitespace, random member order and random choice of escapes.
    fn write_random(v: &Gen, rng: &mut Lcg, out: &mut String) {
        ws(rng, out);
        match v {
            Gen::Null => out.push_str("null"),
            Gen::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Gen::Num(t) => out.push_str(t),
            Gen::Str(s) => write_str_random(s, rng, out),
            Gen::Arr(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_random(item, rng, out);
                }
                ws(rng, out);
                out.push(']');
            }
            Gen::Obj(members) => {
                let mut order: Vec<&(String, Gen)> = members.iter().collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i as u32 + 1) as usize);
                }
                out.push('{');
                for (i, (name, value)) in order.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    write_str_random(name, rng, out);
                    ws(rng, out);
                    out.push(':');
                    write_random(value, rng, out);
                }
                ws(rng, out);
                out.push('}');
            }
        }
        ws(rng, out);
    }

    fn write_str_random(s: &str, rng: &mut Lcg, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let must_escape = c == '"' || c == '\\' || (c as u32) < 0x20;
            if must_escape || rng.chance(30) {
                let short = match c {
                    '"' => Some("\\\""),
                    '\\' => Some("\\\\"),
                    '/' => Some("\\/"),
                    '\n' => Some("\\n"),
                    _ => None,
                };
                match short {
                    Some(e) if rng.chance(50) => out.push_str(e),
                    _ => {
                        let mut units = [0u16; 2];
                        for u in c.encode_utf16(&mut units) {
                            if rng.chance(50) {
                                out.push_str(&format!("\\u{u:04x}"));
                            } else {
                                out.push_str(&format!("\\u{u:04X}"));
                            }
                        }
                    }
                }
            } else {
                out.push(c);
            }
        }
        out.push('"');
    }

    /// Changes exactly one leaf to a different value; returns false when there is no leaf.
    fn mutate(v: &mut Gen, rng: &mut Lcg) -> bool {
        match v {
            Gen::Null => *v = Gen::Bool(false),
            Gen::Bool(b) => *b = !*b,
            // Appending a digit to "0" or "-0" would make an invalid number.
            Gen::Num(t) if t == "0" || t == "-0" => *t = "1".to_owned(),
            Gen::Num(t) => t.push('0'),
            Gen::Str(s) => s.push(CHARS[rng.below(CHARS.len() as u32) as usize]),
            Gen::Arr(items) => {
                if items.is_empty() {
                    items.push(Gen::Null);
                } else {
                    let i = rng.below(items.len() as u32) as usize;
                    return mutate(&mut items[i], rng);
                }
            }
            Gen::Obj(members) => {
                if members.is_empty() {
                    members.push(("new".to_owned(), Gen::Null));
                } else {
                    let i = rng.below(members.len() as u32) as usize;
                    if rng.chance(20) {
                        members[i].0.push('~');
                    } else {
                        return mutate(&mut members[i].1, rng);
                    }
                }
            }
        }
        true
    }

    fn canon_bytes(s: &str) -> Vec<u8> {
        let mut out = Vec::new();
        canonicalize(s.as_bytes(), &[], &mut out).unwrap();
        out
    }

    #[test]
    fn random_serializations_of_one_value_agree() {
        let mut rng = Lcg(0x1D3A_F00D);
        for _ in 0..2_000 {
            let value = gen_value(&mut rng, 0);
            let mut first = String::new();
            write_random(&value, &mut rng, &mut first);
            let reference = canon_bytes(&first);
            for _ in 0..3 {
                let mut other = String::new();
                write_random(&value, &mut rng, &mut other);
                assert_eq!(canon_bytes(&other), reference, "{first} vs {other}");
            }
            // Canonical output is a fixed point: it is valid JSON denoting the same value.
            assert_eq!(canon_bytes(std::str::from_utf8(&reference).unwrap()), reference);
        }
    }

    #[test]
    fn mutated_values_canonicalize_differently() {
        let mut rng = Lcg(0xBAD_5EED);
        for _ in 0..2_000 {
            let value = gen_value(&mut rng, 0);
            let mut changed = value.clone();
            assert!(mutate(&mut changed, &mut rng));
            let mut a = String::new();
            write_random(&value, &mut rng, &mut a);
            let mut b = String::new();
            write_random(&changed, &mut rng, &mut b);
            assert_ne!(canon_bytes(&a), canon_bytes(&b), "{a} vs {b}");
        }
    }
}
