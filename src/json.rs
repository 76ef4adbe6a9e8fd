//! The strict JSON reader every part of the filter shares (plugin configuration, problem
//! bodies, request bodies for their canonical form) and the one string escaper it writes with.
//!
//! Hand-written rather than serde_json because its callers need what serde_json does not give:
//! the exact source text of every number (no float round trip, so `1` and `1.0` stay apart),
//! rejection of duplicate member names instead of silently keeping one, and a nesting bound the
//! caller chooses, so hostile input cannot exhaust the Wasm stack. The bound is a parameter on
//! purpose: the canonical form's limit is part of the fingerprint contract and the configuration's
//! is part of what Envoy accepts; neither may move the other.

use crate::codec::{hex_digit, hex_value};
use std::borrow::Cow;
use std::fmt;

const BOM: &[u8] = b"\xEF\xBB\xBF";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonError {
    /// The input is not valid UTF-8 (RFC 8259 section 8.1 requires it).
    InvalidUtf8,
    /// The input starts with a UTF-8 byte order mark, which RFC 8259 forbids senders to add.
    ByteOrderMark,
    /// The input is empty or only whitespace.
    Empty,
    /// The input does not follow the JSON grammar; `offset` is the byte where that was noticed.
    Syntax { offset: usize },
    /// An object has two members whose names are equal after unescaping.
    DuplicateMember,
    /// Arrays and objects are nested more than `limit` levels deep.
    TooDeep { limit: usize },
    /// A `\uXXXX` escape denotes a UTF-16 surrogate that is not part of a valid pair.
    LoneSurrogate,
    /// Something other than whitespace follows the single top-level value.
    TrailingData,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidUtf8 => f.write_str("body is not valid UTF-8"),
            Self::ByteOrderMark => f.write_str("body starts with a UTF-8 byte order mark"),
            Self::Empty => f.write_str("body is empty or only whitespace"),
            Self::Syntax { offset } => write!(f, "JSON syntax error at byte {offset}"),
            Self::DuplicateMember => f.write_str("object has duplicate member names"),
            Self::TooDeep { limit } => write!(f, "JSON nested deeper than {limit} levels"),
            Self::LoneSurrogate => f.write_str("string escape holds an unpaired UTF-16 surrogate"),
            Self::TrailingData => f.write_str("data after the top-level JSON value"),
        }
    }
}

impl std::error::Error for JsonError {}

/// Borrows from the input where it can (numbers, strings without escapes): a tree is already
/// several times the size of its text, so avoiding an allocation per scalar matters in Wasm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonValue<'a> {
    Null,
    Bool(bool),
    /// Exact source text, already checked against the RFC 8259 number grammar: the caller
    /// decides which numbers it accepts, with no float round trip in between.
    Number(&'a str),
    String(Cow<'a, str>),
    Array(Vec<JsonValue<'a>>),
    /// Names are unique (a duplicate is an error), in the `MemberOrder` the caller asked for.
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

    /// The value an RFC 6901 pointer names, given as its reference tokens (unescaped): a
    /// member by name, an array element by its index (`0`, or digits without a leading zero).
    pub fn at(&self, tokens: &[String]) -> Option<&JsonValue<'a>> {
        tokens.iter().try_fold(self, |value, token| match value {
            JsonValue::Object(_) => value.get(token),
            JsonValue::Array(items) => {
                let index_like = token == "0"
                    || (!token.starts_with('0')
                        && !token.is_empty()
                        && token.bytes().all(|b| b.is_ascii_digit()));
                if index_like {
                    token.parse::<usize>().ok().and_then(|i| items.get(i))
                } else {
                    None
                }
            }
            _ => None,
        })
    }
}

/// How object members are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberOrder {
    /// As written, so a caller can report the first offending member.
    Document,
    /// Sorted by the UTF-8 bytes of their names (what the canonical form emits, and what lets
    /// a lookup binary-search).
    ByName,
}

/// Reads exactly one JSON text: UTF-8 only, no byte order mark, no duplicate member names, at
/// most `max_depth` nested arrays and objects, nothing but whitespace after the value.
///
/// # Errors
///
/// The first rule the input breaks.
pub fn read(bytes: &[u8], max_depth: usize, order: MemberOrder) -> Result<JsonValue<'_>, JsonError> {
    if bytes.starts_with(BOM) {
        return Err(JsonError::ByteOrderMark);
    }
    // Validating once up front lets the parser scan bytes: every position it cuts at is an ASCII
    // delimiter, hence a char boundary of `text`.
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Err(JsonError::InvalidUtf8);
    };
    let mut parser = Parser { text, bytes, pos: 0, max_depth, order };
    parser.skip_ws();
    if parser.peek().is_none() {
        return Err(JsonError::Empty);
    }
    let root = parser.parse_value(0)?;
    parser.skip_ws();
    if parser.pos != bytes.len() {
        return Err(JsonError::TrailingData);
    }
    Ok(root)
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    max_depth: usize,
    order: MemberOrder,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn syntax(&self) -> JsonError {
        JsonError::Syntax { offset: self.pos }
    }

    /// Never fails for the ASCII-delimited ranges the parser asks for; checked all the same.
    fn slice(&self, start: usize, end: usize) -> Result<&'a str, JsonError> {
        self.text.get(start..end).ok_or(JsonError::Syntax { offset: start })
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Result<(), JsonError> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.syntax())
        }
    }

    /// `depth` is the number of containers enclosing this value; recursion happens only when
    /// entering a container, which is refused beyond `max_depth`, so the stack stays bounded.
    fn parse_value(&mut self, depth: usize) -> Result<JsonValue<'a>, JsonError> {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.parse_object(depth + 1),
            Some(b'[') => self.parse_array(depth + 1),
            Some(b'"') => Ok(JsonValue::String(self.parse_string()?)),
            Some(b't') => self.literal(b"true", JsonValue::Bool(true)),
            Some(b'f') => self.literal(b"false", JsonValue::Bool(false)),
            Some(b'n') => self.literal(b"null", JsonValue::Null),
            Some(b'-' | b'0'..=b'9') => self.parse_number(),
            _ => Err(self.syntax()),
        }
    }

    fn literal(&mut self, text: &[u8], value: JsonValue<'a>) -> Result<JsonValue<'a>, JsonError> {
        let end = self.pos + text.len();
        if self.bytes.get(self.pos..end) == Some(text) {
            self.pos = end;
            Ok(value)
        } else {
            Err(self.syntax())
        }
    }

    fn parse_array(&mut self, depth: usize) -> Result<JsonValue<'a>, JsonError> {
        if depth > self.max_depth {
            return Err(JsonError::TooDeep { limit: self.max_depth });
        }
        self.eat(b'[')?;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(JsonValue::Array(items));
        }
        loop {
            items.push(self.parse_value(depth)?);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(JsonValue::Array(items));
                }
                _ => return Err(self.syntax()),
            }
        }
    }

    fn parse_object(&mut self, depth: usize) -> Result<JsonValue<'a>, JsonError> {
        if depth > self.max_depth {
            return Err(JsonError::TooDeep { limit: self.max_depth });
        }
        self.eat(b'{')?;
        let mut members: Vec<(Cow<'a, str>, JsonValue<'a>)> = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(JsonValue::Object(members));
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
        // Sorting first turns duplicate detection into one linear pass (no quadratic scan).
        // Unstable is fine: equal names are an error, so no two elements compare equal in an
        // accepted object.
        let duplicate = if self.order == MemberOrder::Document {
            // Sorting a separate list of names keeps the members themselves in document order.
            let mut names: Vec<&[u8]> = members.iter().map(|(name, _)| name.as_bytes()).collect();
            crate::sort::heap_by(&mut names, |a, b| a < b);
            names.windows(2).any(|pair| matches!(pair, [a, b] if a == b))
        } else {
            // The caller wants the sorted order anyway: sort the members themselves, once.
            crate::sort::heap_by(&mut members, |a, b| a.0.as_bytes() < b.0.as_bytes());
            members.windows(2).any(|pair| match pair {
                [a, b] => a.0 == b.0,
                _ => false,
            })
        };
        if duplicate {
            return Err(JsonError::DuplicateMember);
        }
        Ok(JsonValue::Object(members))
    }

    fn parse_number(&mut self) -> Result<JsonValue<'a>, JsonError> {
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
        Ok(JsonValue::Number(self.slice(start, self.pos)?))
    }

    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn require_digits(&mut self) -> Result<(), JsonError> {
        match self.peek() {
            Some(b'0'..=b'9') => {
                self.skip_digits();
                Ok(())
            }
            _ => Err(self.syntax()),
        }
    }

    /// Called on the opening quote; returns the unescaped string.
    fn parse_string(&mut self) -> Result<Cow<'a, str>, JsonError> {
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
        self.pos += plain_len(self.bytes.get(self.pos..).unwrap_or_default());
    }

    /// Called just after the backslash.
    fn parse_escape(&mut self) -> Result<char, JsonError> {
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
    fn parse_unicode_escape(&mut self) -> Result<char, JsonError> {
        let first = self.hex4()?;
        let scalar = match first {
            0xD800..=0xDBFF => {
                if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return Err(JsonError::LoneSurrogate);
                }
                self.pos += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(JsonError::LoneSurrogate);
                }
                0x10000 + ((u32::from(first) - 0xD800) << 10) + (u32::from(second) - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(JsonError::LoneSurrogate),
            other => u32::from(other),
        };
        char::from_u32(scalar).ok_or(JsonError::LoneSurrogate)
    }

    fn hex4(&mut self) -> Result<u16, JsonError> {
        let mut value: u16 = 0;
        for _ in 0..4 {
            let Some(digit) = self.peek().and_then(hex_value) else { return Err(self.syntax()) };
            value = (value << 4) | u16::from(digit);
            self.pos += 1;
        }
        Ok(value)
    }
}

/// Appends `s` as a JSON string literal: `"` and `\\` escaped, control characters as `\u00xx`,
/// everything else verbatim. One escaping for all JSON the filter writes; canonical form v1
/// (`identity::canonical`) emits its strings with it, so it must not change.
pub fn emit_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let mut rest = s.as_bytes();
    loop {
        // Runs that need no escaping (nearly all of a typical body) are copied in one go.
        let run = plain_len(rest);
        let (plain, tail) = rest.split_at(run.min(rest.len()));
        out.extend_from_slice(plain);
        let Some((&b, after)) = tail.split_first() else { break };
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            _ => out.extend_from_slice(&[b'\\', b'u', b'0', b'0', hex_digit(b >> 4), hex_digit(b & 0x0F)]),
        }
        rest = after;
    }
    out.push(b'"');
}

/// How many leading bytes of `bytes` a JSON string holds as they are: all but `"`, `\\` and
/// the control characters below 0x20 (bytes >= 0x80, parts of multi-byte UTF-8, included). Both
/// the reader and the writer spend most of a typical body here, so it looks at eight bytes per
/// step: a byte of a word is zero exactly when subtracting 1 from it borrows into its high bit
/// while that bit was clear, and below 0x20 exactly when subtracting 0x20 does; the first word
/// with a hit is then searched byte by byte.
pub(crate) fn plain_len(bytes: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const QUOTES: u64 = ONES * b'"' as u64;
    const BACKSLASHES: u64 = ONES * b'\\' as u64;
    const SPACES: u64 = ONES * 0x20;
    let mut n = 0;
    for chunk in bytes.chunks_exact(8) {
        let Ok(word) = <[u8; 8]>::try_from(chunk) else { break };
        let w = u64::from_le_bytes(word);
        let quote = w ^ QUOTES;
        let backslash = w ^ BACKSLASHES;
        let special = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (w.wrapping_sub(SPACES) & !w);
        if special & HIGH != 0 {
            break;
        }
        n += 8;
    }
    let tail = bytes.get(n..).unwrap_or_default();
    n + tail.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(tail.len())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)] // a failing unwrap is a failing test
mod tests {
    use super::*;
    /// The canonical form's depth, so that these tests read what request bodies read.
    const CANONICAL_DEPTH: usize = 64;

    fn read_doc(bytes: &[u8]) -> Result<JsonValue<'_>, JsonError> {
        read(bytes, CANONICAL_DEPTH, MemberOrder::Document)
    }

    fn nested(depth: usize, open: &str, close: &str) -> String {
        format!("{}1{}", open.repeat(depth), close.repeat(depth))
    }

    #[test]
    fn a_pointer_names_members_and_array_elements() {
        let doc = read_doc(br#"{"a":{"b/c":[10,{"id":"x"}]},"":1}"#).unwrap();
        let at = |tokens: &[&str]| {
            let tokens: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
            doc.at(&tokens).cloned()
        };
        assert_eq!(at(&["a", "b/c", "0"]), Some(JsonValue::Number("10")));
        assert_eq!(at(&["a", "b/c", "1", "id"]), Some(JsonValue::String("x".into())));
        assert_eq!(at(&[""]), Some(JsonValue::Number("1")));
        for absent in [
            &["a", "b/c", "2"][..],
            &["a", "b/c", "01"],
            &["a", "b/c", "-"],
            &["a", "x"],
            &["a", "b/c", "0", "y"],
        ] {
            assert_eq!(at(absent), None, "{absent:?}");
        }
    }

    #[test]
    fn the_depth_limit_is_the_callers() {
        assert!(read(nested(3, "[", "]").as_bytes(), 3, MemberOrder::Document).is_ok());
        assert_eq!(
            read(nested(4, "[", "]").as_bytes(), 3, MemberOrder::Document),
            Err(JsonError::TooDeep { limit: 3 })
        );
        assert!(JsonError::TooDeep { limit: 3 }.to_string().contains('3'));
    }

    #[test]
    fn members_come_in_the_order_asked_for() {
        let names = |order| match read(br#"{"b":1,"a":2,"c":3}"#, 4, order).unwrap() {
            JsonValue::Object(m) => m.into_iter().map(|(n, _)| n.into_owned()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(names(MemberOrder::Document), ["b", "a", "c"]);
        assert_eq!(names(MemberOrder::ByName), ["a", "b", "c"]);
    }

    fn s(text: &str) -> JsonValue<'static> {
        JsonValue::String(Cow::Owned(text.to_owned()))
    }

    #[test]
    fn parse_keeps_document_order_and_exact_numbers() {
        let v = read_doc(br#" {"b":[1.0,-0,1e3,true,null],"a":{"y":"\u0041\n","x":false}} "#).unwrap();
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
        let v = read_doc(br#"["plain","esc\"aped"]"#).unwrap();
        let JsonValue::Array(items) = v else { unreachable!() };
        assert!(matches!(&items[0], JsonValue::String(Cow::Borrowed("plain"))));
        assert!(matches!(&items[1], JsonValue::String(Cow::Owned(o)) if o == "esc\"aped"));
    }

    #[test]
    fn parse_finds_duplicates_among_many_members_in_any_order() {
        let mut members: Vec<String> = (0..1000).map(|i| format!("\"k{i}\":{i}")).collect();
        assert!(read_doc(format!("{{{}}}", members.join(",")).as_bytes()).is_ok());
        members.push("\"k500\":0".to_owned());
        members.rotate_right(1);
        assert_eq!(
            read_doc(format!("{{{}}}", members.join(",")).as_bytes()),
            Err(JsonError::DuplicateMember)
        );
    }

    #[test]
    fn plain_len_stops_at_the_first_byte_a_string_cannot_hold_as_is() {
        fn reference(bytes: &[u8]) -> usize {
            bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(bytes.len())
        }
        // Every filler next to every special byte at every position of inputs up to 3 words
        // long, so each lane of the word-at-a-time test and the byte tail are both exercised,
        // with neighbours that sit just beside the special values.
        let fillers = [b'a', b' ', b'!', b'#', b'[', b']', b'~', 0x7F, 0x80, 0xC3, 0xFF];
        let specials = [b'"', b'\\', 0x00, 0x01, 0x0A, 0x1F];
        let mut checked = 0;
        for len in 0..25 {
            for &fill in &fillers {
                let plain = vec![fill; len];
                assert_eq!(plain_len(&plain), len, "all {fill:#x}, {len} bytes");
                for at in 0..len {
                    for &special in &specials {
                        let mut bytes = plain.clone();
                        bytes[at] = special;
                        assert_eq!(plain_len(&bytes), reference(&bytes), "{bytes:?}");
                        // a second special after the first never moves the answer
                        if at + 1 < len {
                            bytes[len - 1] = b'"';
                            assert_eq!(plain_len(&bytes), at, "{bytes:?}");
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 10_000);
    }

    #[test]
    fn emit_string_escapes_quote_backslash_and_controls() {
        let mut out = Vec::new();
        emit_string("a\"\\\u{1}\u{1f} é/", &mut out);
        assert_eq!(out, "\"a\\\"\\\\\\u0001\\u001f é/\"".as_bytes());
    }
}
