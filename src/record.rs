//! Record formats: the compact entries kept in a store bucket, and the response snapshot.
//!
//! Stability contract (record format v1). These bytes outlive the module that wrote them: shared
//! data survives a VM reload (FAIL_RELOAD, config updates with the same vm_id), so a new build
//! must read what the old one wrote, or refuse it. Every value starts with a format version byte;
//! a decoder meets an unknown version or malformed bytes with an error, never a panic or a guess,
//! and the store treats such a bucket as unusable rather than overwriting live records it cannot
//! read. Changing a layout means a new version byte and a new store namespace.
//!
//! Bucket v1:  [1u8][count u8] then `count` entries of ENTRY_LEN bytes:
//!   position u8 | state u8 | flags u8 | status u16 | scope [32] | fingerprint [32] |
//!   owner u64 | lease_deadline_ms u64 | expires_at_ms u64          (integers big-endian)
//! Snapshot v1: [1u8] | scope [32] | owner u64 | status u16 | header count u16 |
//!   per header: name len u16, name, value len u32, value | body len u32 | body

use crate::fingerprint::Fingerprint;
use crate::scope::ScopeId;

pub const FORMAT_V1: u8 = 1;
pub const ENTRY_LEN: usize = 1 + 1 + 1 + 2 + 32 + 32 + 8 + 8 + 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Processing,
    Succeeded,
    FailedFinal,
}

impl State {
    fn code(self) -> u8 {
        match self {
            State::Processing => 1,
            State::Succeeded => 2,
            State::FailedFinal => 3,
        }
    }
    fn from_code(c: u8) -> Option<State> {
        match c {
            1 => Some(State::Processing),
            2 => Some(State::Succeeded),
            3 => Some(State::FailedFinal),
            _ => None,
        }
    }
}

/// Entry flag: the outcome is known but the body was too large to keep.
pub const FLAG_BODY_NOT_STORED: u8 = 1;

/// One record header, small enough that a bucket of them stays cheap to copy under the host's
/// global shared-data lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Index of this entry's snapshot slot within the bucket.
    pub position: u8,
    pub state: State,
    pub flags: u8,
    /// Upstream status once completed; 0 while processing.
    pub status: u16,
    pub scope: ScopeId,
    pub fingerprint: Fingerprint,
    /// Token of the claim that owns the record; also tags its snapshot.
    pub owner: u64,
    /// While processing: after this instant a retry may take the claim over.
    pub lease_deadline_ms: u64,
    /// After this instant the record is absent.
    pub expires_at_ms: u64,
}

impl Entry {
    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms
    }
    pub fn body_stored(&self) -> bool {
        self.flags & FLAG_BODY_NOT_STORED == 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    UnknownVersion(u8),
    Truncated,
    BadState(u8),
    BadPosition(u8),
    DuplicatePosition(u8),
    TrailingBytes,
    NonCanonical,
}

/// Decodes a bucket. An empty value (a fresh or emptied key) is an empty bucket.
pub fn decode_bucket(bytes: &[u8], max_entries: u8) -> Result<Vec<Entry>, DecodeError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if version != FORMAT_V1 {
        return Err(DecodeError::UnknownVersion(version));
    }
    let count = r.u8()?;
    if count == 0 {
        // An empty bucket is written as an empty value; one encoding per bucket keeps readers
        // and writers byte-for-byte in agreement.
        return Err(DecodeError::NonCanonical);
    }
    let mut entries: Vec<Entry> = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let position = r.u8()?;
        if position >= max_entries {
            return Err(DecodeError::BadPosition(position));
        }
        if entries.iter().any(|e| e.position == position) {
            return Err(DecodeError::DuplicatePosition(position));
        }
        let state_code = r.u8()?;
        let state = State::from_code(state_code).ok_or(DecodeError::BadState(state_code))?;
        entries.push(Entry {
            position,
            state,
            flags: r.u8()?,
            status: r.u16()?,
            scope: ScopeId(r.array()?),
            fingerprint: Fingerprint(r.array()?),
            owner: r.u64()?,
            lease_deadline_ms: r.u64()?,
            expires_at_ms: r.u64()?,
        });
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
    let mut out = Vec::with_capacity(2 + entries.len() * ENTRY_LEN);
    out.push(FORMAT_V1);
    out.push(u8::try_from(entries.len()).unwrap_or(u8::MAX));
    for e in entries.iter().take(usize::from(u8::MAX)) {
        out.push(e.position);
        out.push(e.state.code());
        out.push(e.flags);
        out.extend_from_slice(&e.status.to_be_bytes());
        out.extend_from_slice(&e.scope.0);
        out.extend_from_slice(&e.fingerprint.0);
        out.extend_from_slice(&e.owner.to_be_bytes());
        out.extend_from_slice(&e.lease_deadline_ms.to_be_bytes());
        out.extend_from_slice(&e.expires_at_ms.to_be_bytes());
    }
    out
}

/// A stored upstream response, replayed byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

/// The snapshot as kept in a slot, tagged with the record it belongs to so that a reader can
/// tell a current snapshot from a stale one left by an earlier record in the same slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotValue {
    pub scope: ScopeId,
    pub owner: u64,
    pub snapshot: Snapshot,
}

pub fn encode_slot(v: &SlotValue) -> Vec<u8> {
    let s = &v.snapshot;
    let headers_len: usize = s.headers.iter().map(|(n, val)| 6 + n.len() + val.len()).sum();
    let mut out = Vec::with_capacity(1 + 32 + 8 + 2 + 2 + headers_len + 4 + s.body.len());
    out.push(FORMAT_V1);
    out.extend_from_slice(&v.scope.0);
    out.extend_from_slice(&v.owner.to_be_bytes());
    out.extend_from_slice(&s.status.to_be_bytes());
    // Header counts and sizes are bounded by Envoy's header limits (far below these widths);
    // anything beyond is dropped rather than wrapped, so a decoder never mis-frames.
    let headers: Vec<_> = s
        .headers
        .iter()
        .filter(|(n, val)| n.len() <= usize::from(u16::MAX) && u32::try_from(val.len()).is_ok())
        .take(usize::from(u16::MAX))
        .collect();
    out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    let body = &s.body[..s.body.len().min(u32::MAX as usize)];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

pub fn decode_slot(bytes: &[u8]) -> Result<SlotValue, DecodeError> {
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if version != FORMAT_V1 {
        return Err(DecodeError::UnknownVersion(version));
    }
    let scope = ScopeId(r.array()?);
    let owner = r.u64()?;
    let status = r.u16()?;
    let count = r.u16()?;
    let mut headers = Vec::with_capacity(usize::from(count).min(256));
    for _ in 0..count {
        let n = usize::from(r.u16()?);
        let name = String::from_utf8(r.take(n)?.to_vec()).map_err(|_| DecodeError::Truncated)?;
        let vlen = r.u32()? as usize;
        headers.push((name, r.take(vlen)?.to_vec()));
    }
    let blen = r.u32()? as usize;
    let body = r.take(blen)?.to_vec();
    if !r.rest().is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(SlotValue { scope, owner, snapshot: Snapshot { status, headers, body } })
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.bytes.len() {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    fn rest(&self) -> &'a [u8] {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(position: u8, owner: u64) -> Entry {
        Entry {
            position,
            state: State::Succeeded,
            flags: 0,
            status: 201,
            scope: ScopeId([position; 32]),
            fingerprint: Fingerprint([7; 32]),
            owner,
            lease_deadline_ms: 10,
            expires_at_ms: 99,
        }
    }

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
        assert_eq!(decode_bucket(&[1, 0], 8), Err(DecodeError::NonCanonical));
        assert_eq!(decode_bucket(&good[..good.len() - 1], 8), Err(DecodeError::Truncated));
        let mut extra = good.clone();
        extra.push(0);
        assert_eq!(decode_bucket(&extra, 8), Err(DecodeError::TrailingBytes));
        assert_eq!(decode_bucket(&good, 1), Err(DecodeError::BadPosition(1)));
        let mut bad_state = good.clone();
        bad_state[3] = 9;
        assert_eq!(decode_bucket(&bad_state, 8), Err(DecodeError::BadState(9)));
        let dup = encode_bucket(&[entry(1, 1), entry(1, 2)]);
        assert_eq!(decode_bucket(&dup, 8), Err(DecodeError::DuplicatePosition(1)));
    }

    #[test]
    fn every_truncation_of_a_slot_is_an_error() {
        let v = SlotValue {
            scope: ScopeId([3; 32]),
            owner: 42,
            snapshot: Snapshot {
                status: 201,
                headers: vec![("set-cookie".into(), b"a=b".to_vec()), ("x".into(), vec![0xff])],
                body: b"{\"id\":1}".to_vec(),
            },
        };
        let bytes = encode_slot(&v);
        assert_eq!(decode_slot(&bytes), Ok(v));
        for n in 0..bytes.len() {
            assert!(decode_slot(&bytes[..n]).is_err(), "prefix {n}");
        }
    }
}
