//! Tombstones (`routes[].tombstone_ttl`, C29): what stays of a completed record once its ttl
//! dropped its stored response, until `tombstone_ttl` after its completion. A retry with the
//! same key and payload then learns that its request executed (410 `result-expired`, with the
//! original status) instead of executing again.
//!
//! A tombstone is written with its record's outcome (the local store right after the outcome's
//! commit, etcd in the completion's own transaction) and read by a `begin` that finds no live
//! record, before it claims. It is a fixed 83 bytes whatever the response was: the record's
//! scope and fingerprint (another payload is still a 422), its status (0: outcome unknown, which
//! answers as the record did, 502), when it completed and until when it stays.
//!
//! It is best effort by design on the local store: tombstones have their own bounded room
//! (`store.tombstones`), never a live record's, and the oldest go first when it is full. On
//! etcd it is one small key with its own lease (`t/<scope hex>`).

use crate::identity::fingerprint::Fingerprint;
use crate::identity::scope::ScopeId;
use crate::store::record::{DecodeError, Entry, STATUS_OUTCOME_UNKNOWN};
use crate::store::Begin;

/// The format's version byte, first in every encoded tombstone.
pub const TOMBSTONE_V1: u8 = 1;
/// Bytes of one encoded tombstone: version, scope, fingerprint, status, completed, until.
pub const TOMBSTONE_LEN: usize = 1 + 32 + 32 + 2 + 8 + 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tombstone {
    pub scope: ScopeId,
    pub fingerprint: Fingerprint,
    /// The original status; `STATUS_OUTCOME_UNKNOWN` (0) for an outcome nobody knows.
    pub status: u16,
    pub completed_at_ms: u64,
    /// After this instant the tombstone is absent.
    pub until_ms: u64,
}

impl Tombstone {
    /// The tombstone the completed record `e` leaves: completed at `now_ms`, standing
    /// `tombstone_ms` from then.
    pub fn of(e: &Entry, now_ms: u64, tombstone_ms: u64) -> Tombstone {
        Tombstone {
            scope: e.scope,
            fingerprint: e.fingerprint,
            status: e.status,
            completed_at_ms: now_ms,
            until_ms: now_ms.saturating_add(tombstone_ms),
        }
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.until_ms
    }

    /// What a `begin` with `fingerprint` answers while this tombstone stands: the original
    /// status (410), a mismatch (422, as the record answered), or an unknown outcome (502, as
    /// the record answered). Never a claim: the request executed, or may have.
    pub fn answer(&self, fingerprint: &Fingerprint) -> Begin {
        if self.fingerprint != *fingerprint {
            Begin::Mismatch
        } else if self.status == STATUS_OUTCOME_UNKNOWN {
            Begin::OutcomeUnknown
        } else {
            Begin::Expired { status: self.status }
        }
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(TOMBSTONE_V1);
        out.extend_from_slice(&self.scope.0);
        out.extend_from_slice(&self.fingerprint.0);
        out.extend_from_slice(&self.status.to_be_bytes());
        out.extend_from_slice(&self.completed_at_ms.to_be_bytes());
        out.extend_from_slice(&self.until_ms.to_be_bytes());
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(TOMBSTONE_LEN);
        self.encode_into(&mut out);
        out
    }

    /// One tombstone of exactly `TOMBSTONE_LEN` bytes.
    pub fn decode(bytes: &[u8]) -> Result<Tombstone, DecodeError> {
        if bytes.len() < TOMBSTONE_LEN {
            return Err(DecodeError::Truncated);
        }
        if bytes.len() > TOMBSTONE_LEN {
            return Err(DecodeError::TrailingBytes);
        }
        if bytes[0] != TOMBSTONE_V1 {
            return Err(DecodeError::UnknownVersion(bytes[0]));
        }
        let array = |at: usize| -> [u8; 32] {
            let mut a = [0u8; 32];
            a.copy_from_slice(&bytes[at..at + 32]);
            a
        };
        let u64_at = |at: usize| -> u64 {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(a)
        };
        Ok(Tombstone {
            scope: ScopeId(array(1)),
            fingerprint: Fingerprint(array(33)),
            status: u16::from_be_bytes([bytes[65], bytes[66]]),
            completed_at_ms: u64_at(67),
            until_ms: u64_at(75),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn stone(status: u16) -> Tombstone {
        Tombstone {
            scope: ScopeId([3; 32]),
            fingerprint: Fingerprint([4; 32]),
            status,
            completed_at_ms: 1_000,
            until_ms: 61_000,
        }
    }

    #[test]
    fn a_tombstone_reads_back_as_written() {
        let t = stone(201);
        let bytes = t.encode();
        assert_eq!(bytes.len(), TOMBSTONE_LEN);
        assert_eq!(Tombstone::decode(&bytes), Ok(t));
        assert_eq!(Tombstone::decode(&bytes[..TOMBSTONE_LEN - 1]), Err(DecodeError::Truncated));
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Tombstone::decode(&longer), Err(DecodeError::TrailingBytes));
        let mut other = bytes;
        other[0] = 9;
        assert_eq!(Tombstone::decode(&other), Err(DecodeError::UnknownVersion(9)));
    }

    #[test]
    fn a_tombstone_answers_as_its_record_would_have_without_its_body() {
        assert_eq!(stone(201).answer(&Fingerprint([4; 32])), Begin::Expired { status: 201 });
        assert_eq!(stone(201).answer(&Fingerprint([5; 32])), Begin::Mismatch);
        assert_eq!(stone(0).answer(&Fingerprint([4; 32])), Begin::OutcomeUnknown);
        assert_eq!(stone(0).answer(&Fingerprint([5; 32])), Begin::Mismatch);
        assert!(!stone(201).is_expired(60_999));
        assert!(stone(201).is_expired(61_000));
    }
}
