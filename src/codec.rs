//! The text codings of bytes the filter reads and writes, each written once: hex (scope ids and
//! tags in logs, etcd keys and the admin API; digests in the configuration), percent-encoding
//! (a key in a reconcile lookup's path; the admin API's query, a gRPC status message) and, in
//! `base64`, etcd's JSON gateway's and the admin API's base64. No crate: each is a few lines, and
//! the module's size counts (ARCHITECTURE.md, "Dependencies").

pub mod base64;

/// A nibble (0..16) as its lower-case hex digit.
pub fn hex_digit(nibble: u8) -> u8 {
    if nibble < 10 {
        b'0' + nibble
    } else {
        b'a' + (nibble - 10)
    }
}

/// The value of a hex digit of either case; None for any other byte.
pub fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Lower-case hex, two digits a byte.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(hex_digit(b >> 4)));
        s.push(char::from(hex_digit(b & 0x0F)));
    }
    s
}

/// The bytes of a hex string (either case); None for an odd length or any other character.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.as_bytes().chunks(2).map(|p| Some(hex_value(*p.first()?)? << 4 | hex_value(*p.get(1)?)?)).collect()
}

/// RFC 3986 percent-encoding of everything but the unreserved characters (upper-case hex), so
/// that any text is one path segment whatever it holds (`/`, `?`, `%`, ...).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(hex_digit(b >> 4).to_ascii_uppercase()));
            out.push(char::from(hex_digit(b & 0x0F).to_ascii_uppercase()));
        }
    }
    out
}

/// Percent-decoding (RFC 3986): `%` and two hex digits of either case is that byte; anything
/// else, a `%` not followed by two hex digits too, is itself. Invalid UTF-8 in the result is
/// replaced (U+FFFD). For a gRPC status message (`grpc-message`), where `+` is itself.
pub fn percent_decode(s: &str) -> String {
    decode(s, false)
}

/// A query component's value (`application/x-www-form-urlencoded`, as browsers and `curl
/// --data-urlencode` write a query): `percent_decode`, and `+` is a space. Its own function
/// because the two differ there: a `+` in a gRPC message is a plus sign.
pub fn form_decode(s: &str) -> String {
    decode(s, true)
}

fn decode(s: &str, plus_is_space: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let escaped = match (b.get(i + 1), b.get(i + 2)) {
            (Some(&hi), Some(&lo)) if c == b'%' => hex_value(hi).zip(hex_value(lo)),
            _ => None,
        };
        match escaped {
            Some((hi, lo)) => {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
            None if c == b'+' && plus_is_space => out.push(b' '),
            None => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a failing unwrap is a failing test
mod tests {
    use super::*;

    #[test]
    fn hex_both_ways() {
        for (bytes, text) in [
            (&b""[..], ""),
            (&[0x00][..], "00"),
            (&[0x0f, 0xf0][..], "0ff0"),
            (&[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef][..], "0123456789abcdef"),
        ] {
            assert_eq!(hex(bytes), text);
            assert_eq!(unhex(text).as_deref(), Some(bytes));
        }
        let all: Vec<u8> = (0..=255u8).collect();
        assert_eq!(unhex(&hex(&all)).unwrap(), all);
    }

    #[test]
    fn unhex_takes_either_case_and_refuses_anything_else() {
        assert_eq!(unhex("ABcd").unwrap(), vec![0xab, 0xcd]);
        for bad in ["a", "abc", "0g", "+f", " 0", "é0", "0x"] {
            assert_eq!(unhex(bad), None, "{bad}");
        }
    }

    #[test]
    fn percent_encode_keeps_only_the_unreserved_characters() {
        for (text, coded) in [
            ("abc-XYZ_0.9~", "abc-XYZ_0.9~"),
            ("a/b?c", "a%2Fb%3Fc"),
            ("100%", "100%25"),
            ("a b+c", "a%20b%2Bc"),
            ("é", "%C3%A9"),
            ("\u{0}\u{7f}", "%00%7F"),
        ] {
            assert_eq!(percent_encode(text), coded, "{text}");
            assert_eq!(percent_decode(coded), text, "{coded}");
        }
    }

    #[test]
    fn the_two_decodings_differ_in_plus_only() {
        for (coded, plain, form) in [
            ("a+b", "a+b", "a b"),
            ("a%2Bb", "a+b", "a+b"),
            ("a%20b", "a b", "a b"),
            ("%e2%82%AC", "€", "€"),
            // A `%` without two hex digits after it is itself, to the end of the text.
            ("100%", "100%", "100%"),
            ("%4", "%4", "%4"),
            ("%zz%41", "%zzA", "%zzA"),
            ("%+f", "%+f", "% f"),
            ("%%41", "%A", "%A"),
            // Bytes that are not UTF-8 are replaced, never an error.
            ("%ff", "\u{fffd}", "\u{fffd}"),
        ] {
            assert_eq!(percent_decode(coded), plain, "{coded}");
            assert_eq!(form_decode(coded), form, "{coded}");
        }
    }
}
