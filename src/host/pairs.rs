//! proxy-wasm's header map serialization, both ways. Plain bytes, so it is tested natively even
//! though only the wasm32 host calls use it.

/// proxy-wasm map serialization: count, then (name len, value len) pairs, then the NUL-ended
/// names and values.
pub fn encode_pairs(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let size: usize = 4 + pairs.iter().map(|(n, v)| 8 + n.len() + v.len() + 2).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (n, v) in pairs {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in pairs {
        out.extend_from_slice(n.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// A header map as Envoy serialized it, checked once and read in place: finding `:path` and
/// `:method` of a request the filter lets pass costs no allocation per header.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeaderMap(Vec<u8>);

impl HeaderMap {
    /// None when the counts lie about the bytes.
    pub fn from_bytes(bytes: Vec<u8>) -> Option<HeaderMap> {
        if bytes.is_empty() {
            return Some(HeaderMap::default());
        }
        let count = word(&bytes, 0)?;
        let mut end = 4usize.checked_add(count.checked_mul(8)?)?;
        for i in 0..count {
            let name_len = word(&bytes, 4 + i * 8)?;
            let value_len = word(&bytes, 8 + i * 8)?;
            // Each name and value is followed by a NUL; the last one's may be cut.
            end = end.checked_add(name_len)?.checked_add(1)?.checked_add(value_len)?;
            if i + 1 < count {
                end = end.checked_add(1)?;
            }
        }
        (end <= bytes.len()).then_some(HeaderMap(bytes))
    }

    #[cfg(test)]
    pub fn from_pairs(pairs: &[(String, Vec<u8>)]) -> HeaderMap {
        HeaderMap(encode_pairs(pairs))
    }

    /// (name, value) in Envoy's order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let count = if self.0.is_empty() { 0 } else { word(&self.0, 0).unwrap_or(0) };
        let mut at = 4 + count * 8;
        (0..count).map_while(move |i| {
            let name_len = word(&self.0, 4 + i * 8)?;
            let value_len = word(&self.0, 8 + i * 8)?;
            let name = self.0.get(at..at + name_len)?;
            let value = self.0.get(at + name_len + 1..at + name_len + 1 + value_len)?;
            at += name_len + value_len + 2;
            Some((name, value))
        })
    }

    /// The first value of a header (names are lower case in Envoy's maps).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter().find(|(n, _)| *n == name.as_bytes()).map(|(_, v)| v)
    }

    pub fn pairs(&self) -> Vec<(String, Vec<u8>)> {
        self.iter().map(|(n, v)| (text(n).into_owned(), v.to_vec())).collect()
    }
}

/// Bytes as text, invalid UTF-8 replaced as `String::from_utf8_lossy` replaces it. Header names,
/// paths and methods are ASCII: `from_utf8` checks them a word at a time, where the lossy
/// decoder steps byte by byte (a fifth of what reading a request's headers cost in Wasm).
pub fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

fn word(bytes: &[u8], at: usize) -> Option<usize> {
    Some(u32::from_le_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?) as usize)
}

#[cfg(test)]
mod tests {
    #[test]
    fn text_is_the_lossy_decoding_without_its_cost() {
        for bytes in [
            &b""[..],
            b"content-type",
            b"/orders?x=1",
            b"caf\xc3\xa9",
            b"bad \xff byte",
            b"\xc3",
            b"\xe2\x82",
        ] {
            assert_eq!(super::text(bytes), String::from_utf8_lossy(bytes), "{bytes:?}");
        }
        assert!(matches!(super::text(b"ascii"), std::borrow::Cow::Borrowed("ascii")));
    }

    use super::*;

    fn decode_pairs(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
        Some(HeaderMap::from_bytes(bytes.to_vec())?.pairs())
    }

    #[test]
    fn maps_round_trip_with_raw_bytes_and_empty_values() {
        let pairs = vec![
            (":status".to_string(), b"200".to_vec()),
            ("x-raw".to_string(), vec![0xff, 0]),
            ("e".into(), vec![]),
        ];
        assert_eq!(decode_pairs(&encode_pairs(&pairs)), Some(pairs));
        assert_eq!(decode_pairs(&[]), Some(Vec::new()));
        assert_eq!(encode_pairs(&[]), 0u32.to_le_bytes());
    }

    #[test]
    fn truncated_or_lying_maps_are_refused() {
        let bytes = encode_pairs(&[("a".to_string(), b"b".to_vec())]);
        // Every cut inside the counts, names or values is refused; only the last value's NUL
        // is not needed to read it.
        assert!(decode_pairs(&bytes[..bytes.len() - 1]).is_some());
        for cut in 1..bytes.len() - 1 {
            assert_eq!(decode_pairs(&bytes[..cut]), None, "{cut}");
        }
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert_eq!(decode_pairs(&huge), None);
    }

    #[test]
    fn a_map_is_read_in_place() {
        let pairs = vec![
            (":path".to_string(), b"/orders?x".to_vec()),
            (":method".to_string(), b"POST".to_vec()),
            ("x-dup".to_string(), b"1".to_vec()),
            ("x-dup".to_string(), b"2".to_vec()),
            ("e".to_string(), vec![]),
        ];
        let map = HeaderMap::from_bytes(encode_pairs(&pairs)).unwrap();
        assert_eq!(map, HeaderMap::from_pairs(&pairs));
        assert_eq!(map.get(":path"), Some(&b"/orders?x"[..]));
        assert_eq!(map.get("x-dup"), Some(&b"1"[..]));
        assert_eq!(map.get("e"), Some(&b""[..]));
        assert_eq!(map.get(":pat"), None);
        assert_eq!(map.pairs(), pairs);
        assert_eq!(HeaderMap::default().get(":path"), None);
    }
}
