//! Properties checked on arbitrary input by the cargo-fuzz targets (`fuzz/`) and, for every
//! input kept in `fuzz/regressions/`, by plain `cargo test`. Each function panics when a property
//! fails, which is what the fuzzer reports; none may panic on its own for any input.

// A failing property must panic: that is what the fuzzer reports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::identity::canonical::canonicalize;
use crate::store::local::format::{
    decode_bucket, decode_counters, decode_fill, decode_layouts, encode_bucket, encode_counters, encode_fill,
    encode_layouts,
};
use crate::store::record::{decode_label, decode_slot, encode_label, encode_slot};

/// Key parser: total; an accepted key is 1..=255 visible ASCII, and its bare form parses to it.
pub fn key(data: &[u8]) {
    let values: Vec<&[u8]> = data.split(|b| *b == b'\n').take(3).collect();
    if let Ok(k) = crate::identity::key::parse_key(&values) {
        let s = k.as_str();
        assert!(!s.is_empty() && s.len() <= crate::identity::key::MAX_KEY_LEN);
        assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        if !s.starts_with('"') {
            assert_eq!(
                crate::identity::key::parse_key(&[s.as_bytes()]).map(|k2| k2.as_str().to_string()),
                Ok(s.to_string())
            );
        }
    }
}

/// Config parser: total; an accepted config's rules are usable.
pub fn config(data: &[u8]) {
    if let Ok(cfg) = crate::config::parse(data) {
        assert!(!cfg.rules.is_empty());
        for r in &cfg.rules {
            assert!(r.ttl_ms >= r.processing_timeout_ms && r.processing_timeout_ms > 0);
            assert!(r.max_request_bytes > 0 && r.max_response_bytes > 0);
        }
    }
}

/// Canonical JSON: total, bounded, and canonical output is a fixed point (canonicalizing it
/// again gives the same bytes), so equal payloads cannot hash differently across retries. And
/// the key a body gives (`routes[].key.json`, `json_key`) is its canonical form's too.
pub fn canonical_json(data: &[u8]) {
    let mut out = Vec::new();
    if canonicalize(data, &[], &mut out).is_ok() {
        let mut again = Vec::new();
        assert!(canonicalize(&out, &[], &mut again).is_ok(), "canonical output must parse");
        assert_eq!(out, again, "canonical form must be a fixed point");
        json_key(data, Some(&out));
    } else {
        json_key(data, None);
    }
}

/// JSON key extraction: total at every pointer along the document's first members; an accepted
/// key has the header key's bounds; and the canonical form (`canonical`, when the body has one)
/// gives the same answer at the same pointer, so one intent reformatted is one key.
fn json_key(data: &[u8], canonical: Option<&[u8]>) {
    use crate::identity::canonical::MAX_DEPTH;
    use crate::identity::key::{key_from_json, MAX_KEY_LEN};
    use crate::json::{read, JsonValue, MemberOrder};
    let Ok(doc) = read(data, MAX_DEPTH, MemberOrder::Document) else { return };
    let canonical = canonical.and_then(|c| read(c, MAX_DEPTH, MemberOrder::Document).ok());
    let mut tokens: Vec<String> = Vec::new();
    let mut at = Some(&doc);
    while let Some(value) = at {
        let key = key_from_json(doc.at(&tokens)).map(|k| k.as_str().to_string());
        if let Ok(k) = &key {
            assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN && k.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        }
        if let Some(c) = &canonical {
            assert_eq!(key, key_from_json(c.at(&tokens)).map(|k| k.as_str().to_string()), "{tokens:?}");
        }
        let next = match value {
            JsonValue::Object(members) => members.first().map(|(n, v)| (n.to_string(), v)),
            JsonValue::Array(items) => items.first().map(|v| ("0".to_string(), v)),
            _ => None,
        };
        at = next.map(|(token, v)| {
            tokens.push(token);
            v
        });
        if tokens.len() > 8 {
            break;
        }
    }
}

/// Record decoders: total; whatever decodes re-encodes to the same bytes (no two byte strings
/// mean the same record, so nothing read can be silently rewritten differently).
pub fn record(data: &[u8]) {
    if let Ok(entries) = decode_bucket(data, 8) {
        assert_eq!(encode_bucket(&entries), data);
    }
    if let Ok(slot) = decode_slot(data) {
        assert_eq!(encode_slot(&slot), data);
    }
    if let Ok(label) = decode_label(data) {
        assert_eq!(encode_label(&label), data);
    }
    if let Ok(counters) = decode_counters(data) {
        assert_eq!(encode_counters(&counters), data);
    }
    if let Ok(layouts) = decode_layouts(data) {
        assert_eq!(encode_layouts(&layouts), data);
    }
    if let Ok(count) = decode_fill(data) {
        assert_eq!(encode_fill(count), data);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every input the fuzzers ever kept (crashes fixed since, and seeds) stays a test.
    #[test]
    fn regression_inputs_pass() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
        type Check = fn(&[u8]);
        let targets: [(&str, Check); 4] = [
            ("key", super::key),
            ("config", super::config),
            ("canonical_json", super::canonical_json),
            ("record", super::record),
        ];
        let mut ran = 0;
        for (name, check) in targets {
            let Ok(dir) = std::fs::read_dir(root.join(name)) else { continue };
            for entry in dir.flatten() {
                check(&std::fs::read(entry.path()).unwrap());
                ran += 1;
            }
        }
        assert!(ran > 0, "no regression inputs found under {}", root.display());
    }

    /// The kept record inputs are real v2 values (so the round-trip property is exercised on
    /// them), except those named as refused or truncated.
    #[test]
    fn kept_record_inputs_decode_as_v2() {
        use crate::store::local::format::{decode_bucket, decode_counters, decode_fill, decode_layouts};
        use crate::store::record::decode_slot;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/record");
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let data = std::fs::read(entry.path()).unwrap();
            let decodes = decode_bucket(&data, 8).is_ok()
                || decode_slot(&data).is_ok()
                || decode_counters(&data).is_ok()
                || decode_layouts(&data).is_ok()
                || decode_fill(&data).is_ok();
            let bad = name.contains("refused") || name.contains("truncated");
            assert_eq!(decodes, !bad, "{name}");
        }
    }
}
