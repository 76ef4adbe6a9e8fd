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

pub fn decode_pairs(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let word = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let count = word(0)?;
    let mut pairs = Vec::with_capacity(count.min(1024));
    let mut p = 4usize.checked_add(count.checked_mul(8)?)?;
    for i in 0..count {
        let name_len = word(4 + i * 8)?;
        let value_len = word(8 + i * 8)?;
        let name = bytes.get(p..p.checked_add(name_len)?)?;
        p = p.checked_add(name_len + 1)?;
        let value = bytes.get(p..p.checked_add(value_len)?)?;
        p = p.checked_add(value_len + 1)?;
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    Some(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
