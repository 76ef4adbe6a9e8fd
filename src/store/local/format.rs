//! The local store's own value formats, beside the shared ones of `store/record.rs` (the entry
//! a bucket holds, the slot) and under the same stability contract (its module docs): every
//! value starts with a format version byte; a decoder meets an unknown version or malformed
//! bytes with an error, never a panic or a guess. An empty value is the empty list (or 0), and
//! only that: one encoding per value keeps readers and writers byte-for-byte in agreement.
//!
//! Bucket v2:   [2u8][count u8 >= 1] then `count` entries (`record.rs`'s entry v2; an empty
//!   bucket is an empty value).
//! Quota v2:    [2u8][count u8 >= 1] then counters: tag u64 | count u32 | since_ms u64 |
//!   soonest_ms u64 | until_ms u64
//! Layouts v2:  [2u8][count u8 >= 1] then layouts: id u32 | beat_ms u64 | cursor u32. The id
//!   names a namespace: a bucket count for `idem:v2:<buckets>:`, or LAYOUT_V3 | capacity for
//!   `idem:v3:<capacity>:` (capacities stay below 2^31, so the two never collide).
//! Fill v3:     [3u8] | count u32: how many entries the buckets of one fill shard hold (an empty
//!   value is 0). Entries, buckets, slots and quota keys keep their v2 bytes in the v3 namespace:
//!   v3 changed where records are placed, not how they are written.

use crate::store::record::{read_entry, write_entry, DecodeError, Entry, Reader, ENTRY_LEN, FORMAT_V2};

pub const FORMAT_V3: u8 = 3;
/// Layout ids with this bit are `idem:v3:<capacity>:` namespaces.
pub const LAYOUT_V3: u32 = 1 << 31;
pub const COUNTER_LEN: usize = 8 + 4 + 8 + 8 + 8;
pub const LAYOUT_LEN: usize = 4 + 8 + 4;

/// Reads `[version][count >= 1]` (callers handle the empty value, the empty list, first).
fn list_header(r: &mut Reader) -> Result<u8, DecodeError> {
    let version = r.u8()?;
    if version != FORMAT_V2 {
        return Err(DecodeError::UnknownVersion(version));
    }
    let count = r.u8()?;
    if count == 0 {
        // An empty list is written as an empty value; one encoding per value keeps readers and
        // writers byte-for-byte in agreement.
        return Err(DecodeError::NonCanonical);
    }
    Ok(count)
}

fn list_out(len: usize, item_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + len * item_len);
    out.push(FORMAT_V2);
    out.push(u8::try_from(len).unwrap_or(u8::MAX));
    out
}

/// Decodes a bucket. An empty value (a fresh or emptied key) is an empty bucket.
pub fn decode_bucket(bytes: &[u8], max_entries: u8) -> Result<Vec<Entry>, DecodeError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut r = Reader::new(bytes);
    let count = list_header(&mut r)?;
    let mut entries: Vec<Entry> = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let e = read_entry(&mut r)?;
        if e.position >= max_entries {
            return Err(DecodeError::BadPosition(e.position));
        }
        if entries.iter().any(|x| x.position == e.position) {
            return Err(DecodeError::DuplicatePosition(e.position));
        }
        entries.push(e);
    }
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(entries)
}

pub fn encode_bucket(entries: &[Entry]) -> Vec<u8> {
    if entries.is_empty() {
        return Vec::new();
    }
    let mut out = list_out(entries.len(), ENTRY_LEN);
    for e in entries.iter().take(usize::from(u8::MAX)) {
        write_entry(&mut out, e);
    }
    out
}

/// Live-record count of one quota identity (tenant or principal), keyed by its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaCounter {
    pub tag: u64,
    pub count: u32,
    /// Start of the counter's current epoch: records charged before it are no longer counted.
    pub since_ms: u64,
    /// Expiry of the earliest record charged in this epoch (a hint for `retry-after`).
    pub soonest_ms: u64,
    /// Latest instant any record counted here can still be live; after it the counter reads 0.
    pub until_ms: u64,
}

pub fn decode_counters(bytes: &[u8]) -> Result<Vec<QuotaCounter>, DecodeError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut r = Reader::new(bytes);
    let count = list_header(&mut r)?;
    let mut counters: Vec<QuotaCounter> = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let c = QuotaCounter {
            tag: r.u64()?,
            count: r.u32()?,
            since_ms: r.u64()?,
            soonest_ms: r.u64()?,
            until_ms: r.u64()?,
        };
        if counters.iter().any(|x| x.tag == c.tag) {
            return Err(DecodeError::Duplicate);
        }
        counters.push(c);
    }
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(counters)
}

pub fn encode_counters(counters: &[QuotaCounter]) -> Vec<u8> {
    if counters.is_empty() {
        return Vec::new();
    }
    let mut out = list_out(counters.len(), COUNTER_LEN);
    for c in counters.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&c.tag.to_be_bytes());
        out.extend_from_slice(&c.count.to_be_bytes());
        out.extend_from_slice(&c.since_ms.to_be_bytes());
        out.extend_from_slice(&c.soonest_ms.to_be_bytes());
        out.extend_from_slice(&c.until_ms.to_be_bytes());
    }
    out
}

/// One store namespace in use (named by its bucket count), with its heartbeat and, once it is
/// being retired, how far its keys have been emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The namespace: a v2 bucket count, or LAYOUT_V3 | capacity.
    pub buckets: u32,
    pub beat_ms: u64,
    pub cursor: u32,
}

pub fn decode_layouts(bytes: &[u8]) -> Result<Vec<Layout>, DecodeError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut r = Reader::new(bytes);
    let count = list_header(&mut r)?;
    let mut layouts: Vec<Layout> = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let l = Layout { buckets: r.u32()?, beat_ms: r.u64()?, cursor: r.u32()? };
        if layouts.iter().any(|x| x.buckets == l.buckets) {
            return Err(DecodeError::Duplicate);
        }
        layouts.push(l);
    }
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(layouts)
}

pub fn encode_layouts(layouts: &[Layout]) -> Vec<u8> {
    if layouts.is_empty() {
        return Vec::new();
    }
    let mut out = list_out(layouts.len(), LAYOUT_LEN);
    for l in layouts.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&l.buckets.to_be_bytes());
        out.extend_from_slice(&l.beat_ms.to_be_bytes());
        out.extend_from_slice(&l.cursor.to_be_bytes());
    }
    out
}

/// Decodes a fill shard's entry count. An empty value (a fresh or emptied key) is 0.
pub fn decode_fill(bytes: &[u8]) -> Result<u32, DecodeError> {
    if bytes.is_empty() {
        return Ok(0);
    }
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if version != FORMAT_V3 {
        return Err(DecodeError::UnknownVersion(version));
    }
    let count = r.u32()?;
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    if count == 0 {
        // 0 is written as an empty value: one encoding per value.
        return Err(DecodeError::NonCanonical);
    }
    Ok(count)
}

pub fn encode_fill(count: u32) -> Vec<u8> {
    if count == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(5);
    out.push(FORMAT_V3);
    out.extend_from_slice(&count.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::tests::entry;
    use crate::store::record::State;

    #[test]
    fn bucket_round_trip() {
        let es = vec![entry(0, 1), Entry { state: State::Processing, ..entry(5, 2) }];
        let bytes = encode_bucket(&es);
        assert_eq!(bytes.len(), 2 + 2 * ENTRY_LEN);
        assert_eq!(decode_bucket(&bytes, 8), Ok(es));
        assert_eq!(decode_bucket(&[], 8), Ok(vec![]));
        assert!(encode_bucket(&[]).is_empty());
    }

    #[test]
    fn bucket_decoder_refuses_bad_bytes() {
        let good = encode_bucket(&[entry(1, 1)]);
        assert_eq!(decode_bucket(&[9, 0], 8), Err(DecodeError::UnknownVersion(9)));
        assert_eq!(decode_bucket(&[1, 1], 8), Err(DecodeError::UnknownVersion(1)), "v1 is refused");
        assert_eq!(decode_bucket(&[2, 0], 8), Err(DecodeError::NonCanonical));
        assert_eq!(decode_bucket(&good[..good.len() - 1], 8), Err(DecodeError::Truncated));
        let mut extra = good.clone();
        extra.push(0);
        assert_eq!(decode_bucket(&extra, 8), Err(DecodeError::TrailingBytes));
        assert_eq!(decode_bucket(&good, 1), Err(DecodeError::BadPosition(1)));
        let mut bad_state = good.clone();
        bad_state[3] = 9;
        assert_eq!(decode_bucket(&bad_state, 8), Err(DecodeError::BadState(9)));
        let mut bad_flags = good.clone();
        bad_flags[4] = 0x80;
        assert_eq!(decode_bucket(&bad_flags, 8), Err(DecodeError::BadFlags(0x80)));
        let dup = encode_bucket(&[entry(1, 1), entry(1, 2)]);
        assert_eq!(decode_bucket(&dup, 8), Err(DecodeError::DuplicatePosition(1)));
    }

    #[test]
    fn counters_and_layouts_round_trip_and_refuse_duplicates() {
        let c = QuotaCounter { tag: 9, count: 3, since_ms: 1, soonest_ms: 2, until_ms: 3 };
        let bytes = encode_counters(&[c, QuotaCounter { tag: 10, ..c }]);
        assert_eq!(bytes.len(), 2 + 2 * COUNTER_LEN);
        assert_eq!(decode_counters(&bytes), Ok(vec![c, QuotaCounter { tag: 10, ..c }]));
        assert_eq!(decode_counters(&encode_counters(&[c, c])), Err(DecodeError::Duplicate));
        let l = Layout { buckets: 8, beat_ms: 5, cursor: 0 };
        assert_eq!(decode_layouts(&encode_layouts(&[l])), Ok(vec![l]));
        assert_eq!(decode_layouts(&encode_layouts(&[l, l])), Err(DecodeError::Duplicate));
        assert_eq!(decode_layouts(&[]), Ok(vec![]));
        assert_eq!(decode_counters(&[2, 0]), Err(DecodeError::NonCanonical));
    }

    #[test]
    fn fill_counts_round_trip_and_refuse_bad_bytes() {
        for n in [0, 1, 7, u32::MAX] {
            assert_eq!(decode_fill(&encode_fill(n)), Ok(n));
        }
        assert_eq!(encode_fill(0), Vec::<u8>::new());
        assert_eq!(decode_fill(&[FORMAT_V3, 0, 0, 0, 0]), Err(DecodeError::NonCanonical));
        assert_eq!(decode_fill(&[FORMAT_V2, 0, 0, 0, 1]), Err(DecodeError::UnknownVersion(2)));
        assert_eq!(decode_fill(&[FORMAT_V3, 0, 0, 1]), Err(DecodeError::Truncated));
        assert_eq!(decode_fill(&[FORMAT_V3, 0, 0, 0, 1, 0]), Err(DecodeError::TrailingBytes));
    }
}
