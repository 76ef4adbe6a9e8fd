//! proxy-wasm's header map serialization, as Envoy writes it into the module and reads it out:
//! a little-endian u32 count, then a (name length, value length) pair of u32 per entry, then
//! each name and each value followed by a NUL byte. Written here from the ABI's description, not
//! shared with the module's own `host/pairs.rs`, so that a mistake in one is not in both.

pub type Pairs = Vec<(String, Vec<u8>)>;

/// Pairs from `&str`s, names as Envoy keeps them (lowercase).
pub fn pairs(list: &[(&str, &str)]) -> Pairs {
    list.iter().map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec())).collect()
}

pub fn encode(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

/// None when `bytes` is not a well-formed map (Envoy refuses it: the module sent garbage).
pub fn decode(bytes: &[u8]) -> Option<Pairs> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = word(0)?;
    let mut sizes = Vec::new();
    for i in 0..count {
        sizes.push((word(4 + 8 * i)?, word(8 + 8 * i)?));
    }
    let mut at = 4 + 8 * count;
    let mut out = Vec::new();
    for (name_len, value_len) in sizes {
        let name = bytes.get(at..at + name_len)?;
        at += name_len;
        (bytes.get(at) == Some(&0)).then_some(())?;
        at += 1;
        let value = bytes.get(at..at + value_len)?;
        at += value_len;
        (bytes.get(at) == Some(&0)).then_some(())?;
        at += 1;
        out.push((String::from_utf8(name.to_vec()).ok()?, value.to_vec()));
    }
    (at == bytes.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_round_trips_and_garbage_is_refused() {
        let map = pairs(&[(":status", "201"), ("Content-Type", "application/json"), ("x-empty", "")]);
        assert_eq!(decode(&encode(&map)), Some(map.clone()));
        assert_eq!(map[1].0, "content-type");
        let mut cut = encode(&map);
        cut.pop();
        assert_eq!(decode(&cut), None);
        assert_eq!(decode(&[]), Some(Vec::new()));
    }
}
