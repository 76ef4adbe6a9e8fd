//! Canonical JSON, version 1: the byte form a JSON request body is reduced to before it is
//! fingerprinted (see `docs/FINGERPRINT.md`, which is the normative description). Reading is the
//! shared strict reader (`json.rs`) under this form's own depth limit; this module owns only what
//! makes the form canonical: member order, removal of ignored values, one way to write each value.
//!
//! Soundness argument: the output is itself JSON that denotes exactly the parsed value (numbers
//! verbatim, strings fully unescaped then re-escaped one fixed way, members in one fixed order),
//! so two inputs that denote different values can only produce the same output through the
//! caller's ignore pointers.
//!
//! Any change to what this module emits or accepts (its depth limit included) changes
//! fingerprints of stored records, so it is a breaking change that needs a new canonical form
//! version.

use crate::json::{self, emit_string, JsonError, JsonValue, MemberOrder};

/// Maximum nesting of arrays and objects: a document with 64 nested containers is accepted,
/// one with 65 is rejected. Also bounds the recursion of the reader and the writer.
pub const MAX_DEPTH: usize = 64;

/// Appends the canonical form of `body` to `out`, with the values addressed by `ignore` removed.
///
/// Each entry of `ignore` is a JSON Pointer (RFC 6901) already split into decoded reference tokens
/// (`~1` -> `/`, `~0` -> `~`); a pointer that does not resolve is a no-op.
///
/// # Errors
///
/// Any input that is not exactly one RFC 8259 JSON text within the limits of canonical form v1;
/// `out` is left untouched then.
pub fn canonicalize(body: &[u8], ignore: &[Vec<String>], out: &mut Vec<u8>) -> Result<(), JsonError> {
    // Sorted while read: the sort also finds duplicate names, and lookups binary-search.
    let root = json::read(body, MAX_DEPTH, MemberOrder::ByName)?;
    // Every pointer resolves against the document as received, before anything is left out, so
    // array indices do not shift whatever the order of the pointers.
    let ignored: Vec<&JsonValue> = ignore.iter().filter_map(|pointer| resolve(&root, pointer)).collect();
    out.reserve(body.len());
    emit(&root, &ignored, out);
    Ok(())
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

fn child<'v, 'a>(node: &'v JsonValue<'a>, token: &str) -> Option<&'v JsonValue<'a>> {
    match node {
        JsonValue::Object(members) => {
            let i = members.binary_search_by(|(name, _)| name.as_bytes().cmp(token.as_bytes())).ok()?;
            members.get(i).map(|(_, v)| v)
        }
        JsonValue::Array(items) => items.get(array_index(token)?),
        _ => None,
    }
}

/// The value `pointer` addresses. Iterative, so pointer length does not matter. The empty
/// pointer (the whole document) resolves to nothing: there would be nothing left to
/// fingerprint, and treating the entire body as irrelevant is not what an ignore list is for.
/// A pointer below an ignored value resolves, but the value is never written anyway.
fn resolve<'v, 'a>(root: &'v JsonValue<'a>, pointer: &[String]) -> Option<&'v JsonValue<'a>> {
    if pointer.is_empty() {
        return None;
    }
    pointer.iter().try_fold(root, |node, token| child(node, token))
}

/// Ignored values are known by address: they are nodes of this very tree, and a removed
/// element must not leave a mark that shifts or renames anything around it.
fn is_ignored(value: &JsonValue, ignored: &[&JsonValue]) -> bool {
    ignored.iter().any(|i| std::ptr::eq(*i, value))
}

/// Recursion is bounded by `MAX_DEPTH`, which the reader enforced on the way in.
fn emit(value: &JsonValue<'_>, ignored: &[&JsonValue], out: &mut Vec<u8>) {
    match value {
        JsonValue::Null => out.extend_from_slice(b"null"),
        JsonValue::Bool(true) => out.extend_from_slice(b"true"),
        JsonValue::Bool(false) => out.extend_from_slice(b"false"),
        JsonValue::Number(text) => out.extend_from_slice(text.as_bytes()),
        JsonValue::String(s) => emit_string(s, out),
        JsonValue::Array(items) => {
            out.push(b'[');
            let mut first = true;
            for item in items.iter().filter(|v| !is_ignored(v, ignored)) {
                if !first {
                    out.push(b',');
                }
                first = false;
                emit(item, ignored, out);
            }
            out.push(b']');
        }
        JsonValue::Object(members) => {
            out.push(b'{');
            let mut first = true;
            for (name, member) in members.iter().filter(|(_, v)| !is_ignored(v, ignored)) {
                if !first {
                    out.push(b',');
                }
                first = false;
                emit_string(name, out);
                out.push(b':');
                emit(member, ignored, out);
            }
            out.push(b'}');
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)] // a failing unwrap is a failing test
mod tests {
    use super::*;

    fn canon(body: &str) -> Result<String, JsonError> {
        canon_ignoring(body, &[])
    }

    fn canon_ignoring(body: &str, ignore: &[&[&str]]) -> Result<String, JsonError> {
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
            assert!(matches!(r, Err(JsonError::Syntax { .. } | JsonError::TrailingData)), "{bad}: {r:?}");
        }
        assert_eq!(canon("01"), Err(JsonError::Syntax { offset: 1 }));
    }

    #[test]
    fn literals() {
        assert_eq!(canon(" [true,false,null] ").unwrap(), "[true,false,null]");
        for bad in ["tru", "True", "nul", "[fals]", "nil"] {
            assert!(matches!(canon(bad), Err(JsonError::Syntax { .. })), "{bad}");
        }
    }

    #[test]
    fn duplicate_members_are_rejected() {
        assert_eq!(canon(r#"{"a":1,"a":1}"#), Err(JsonError::DuplicateMember));
        assert_eq!(canon(r#"{"a":1,"\u0061":2}"#), Err(JsonError::DuplicateMember));
        assert_eq!(canon(r#"{"x":[{"b":1,"c":2,"b":3}]}"#), Err(JsonError::DuplicateMember));
        // Same name in different objects is fine.
        assert!(canon(r#"{"a":{"a":1},"b":{"a":2}}"#).is_ok());
    }

    #[test]
    fn duplicates_are_rejected_even_under_an_ignored_path() {
        let r = canon_ignoring(r#"{"meta":{"t":1,"t":2}}"#, &[&["meta", "t"]]);
        assert_eq!(r, Err(JsonError::DuplicateMember));
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
        assert_eq!(canon(&nested(MAX_DEPTH + 1, "[", "]")), Err(JsonError::TooDeep { limit: MAX_DEPTH }));
        assert!(canon(&nested(MAX_DEPTH, "{\"a\":", "}")).is_ok());
        assert_eq!(
            canon(&nested(MAX_DEPTH + 1, "{\"a\":", "}")),
            Err(JsonError::TooDeep { limit: MAX_DEPTH })
        );
        assert_eq!(
            canon(&format!("{}{{}}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH))),
            Err(JsonError::TooDeep { limit: MAX_DEPTH })
        );
    }

    #[test]
    fn very_deep_input_fails_without_overflowing_the_stack() {
        for (open, close) in [("[", "]"), ("{\"a\":", "}"), ("[{\"k\":", "}]")] {
            assert_eq!(canon(&nested(10_000, open, close)), Err(JsonError::TooDeep { limit: MAX_DEPTH }));
            // Unterminated too: the depth error must come before any need to see the end.
            assert_eq!(canon(&open.repeat(10_000)), Err(JsonError::TooDeep { limit: MAX_DEPTH }));
        }
    }

    /// Wide input in the worst order (members reversed) comes out sorted and whole. How long it
    /// takes is the bench's business (`examples/engine_cost.rs`), not a timed assertion here.
    #[test]
    fn wide_input_in_reverse_order_comes_out_sorted() {
        let n = 200_000;
        let members: Vec<String> = (0..n).rev().map(|i| format!("\"k{i:06}\":{i}")).collect();
        let body = format!("{{{}}}", members.join(","));
        let sorted: Vec<String> = (0..n).map(|i| format!("\"k{i:06}\":{i}")).collect();
        assert_eq!(canon(&body), Ok(format!("{{{}}}", sorted.join(","))));
        let array = format!("[{}]", vec!["\"\\u00e9x\""; n].join(","));
        assert_eq!(canon(&array), Ok(format!("[{}]", vec!["\"\u{e9}x\""; n].join(","))));
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
            assert_eq!(canonicalize(bad, &[], &mut out), Err(JsonError::InvalidUtf8));
        }
        assert!(out.is_empty());
    }

    #[test]
    fn bom_is_rejected() {
        let mut out = Vec::new();
        assert_eq!(canonicalize(b"\xEF\xBB\xBF{}", &[], &mut out), Err(JsonError::ByteOrderMark));
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
            assert_eq!(canon(bad), Err(JsonError::LoneSurrogate), "{bad}");
        }
        assert!(matches!(canon(r#""\ud83d\u00""#), Err(JsonError::Syntax { .. })));
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
            assert!(matches!(canon(bad), Err(JsonError::Syntax { .. })), "{bad:?}");
        }
    }

    #[test]
    fn only_json_whitespace_is_allowed() {
        assert!(matches!(canon("\u{c}{}"), Err(JsonError::Syntax { offset: 0 })));
        assert!(matches!(canon("{}\u{a0}"), Err(JsonError::TrailingData)));
        assert!(matches!(canon("[1,\u{b}2]"), Err(JsonError::Syntax { .. })));
    }

    #[test]
    fn trailing_data_is_rejected() {
        for bad in ["{} {}", "1 2", "nulll", "{}x", "[]]", "\"a\"\"b\"", "0 0"] {
            assert_eq!(canon(bad), Err(JsonError::TrailingData), "{bad}");
        }
    }

    #[test]
    fn empty_input() {
        assert_eq!(canon(""), Err(JsonError::Empty));
        assert_eq!(canon(" \r\n\t"), Err(JsonError::Empty));
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
        assert_eq!(JsonError::Syntax { offset: 3 }.to_string(), "JSON syntax error at byte 3");
        assert!(JsonError::TooDeep { limit: MAX_DEPTH }.to_string().contains("64"));
    }

    fn read_doc(bytes: &[u8]) -> Result<JsonValue<'_>, JsonError> {
        json::read(bytes, MAX_DEPTH, MemberOrder::Document)
    }

    #[test]
    fn at_the_canonical_depth_it_rejects_exactly_what_canonicalize_rejects() {
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
            assert_eq!(read_doc(input).map(|_| ()), canonical, "{:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(read_doc(b"{\"a\":1,\"a\":2}"), Err(JsonError::DuplicateMember));
        assert_eq!(read_doc(b"[1,]"), Err(JsonError::Syntax { offset: 3 }));
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
