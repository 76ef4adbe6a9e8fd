//! One Envoy's lookups (`routes[].reconcile`), across all its workers: at most one at a time per
//! record, and at most one per `LOOKUP_SPACING_MS`, so that clients retrying in a loop (or a
//! crowd of them, spread over the workers) do not turn into a stream of lookups against an
//! upstream that is already in trouble.
//!
//! Kept in Envoy's shared data, in `GATE_KEYS` data keys created at configuration time (a key
//! written on the request path could be created twice: creation ignores CAS). A record's lookup
//! holds an entry in the key its scope hashes to until the lookup may be made again: its
//! timeout, or once it is over, the spacing. An entry past its time is nothing; writes drop such
//! entries, and a key full of live ones refuses (a bound, never an error).
//!
//! Value: [1u8] then entries of scope prefix [16] | until_ms u64 (big-endian).

use crate::engine::LOOKUP_SPACING_MS;
use crate::identity::scope::ScopeId;
use crate::store::shared_data::{Read, SharedData, SharedDataError};

/// Data keys of the gate: lookups of records in one key contend for its CAS only.
pub const GATE_KEYS: u32 = 64;
/// Live entries one key holds at most: lookups of this many records under way in one key.
const ENTRIES_PER_KEY: usize = 32;
const ENTRY_LEN: usize = 16 + 8;
const VERSION: u8 = 1;
/// CAS tries before a lookup is refused (and tried at the next retry).
const WRITE_TRIES: usize = 4;

pub struct LookupGate<S: SharedData> {
    data: S,
}

type Entry = ([u8; 16], u64);

fn decode(read: &Read) -> Vec<Entry> {
    let bytes = read.bytes();
    match bytes.split_first() {
        Some((&VERSION, rest)) => rest
            .chunks_exact(ENTRY_LEN)
            .map(|c| {
                let mut prefix = [0; 16];
                prefix.copy_from_slice(&c[..16]);
                let mut until = [0; 8];
                until.copy_from_slice(&c[16..]);
                (prefix, u64::from_be_bytes(until))
            })
            .collect(),
        // Empty, or bytes of another build: nothing this build can honour.
        _ => Vec::new(),
    }
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + entries.len() * ENTRY_LEN);
    out.push(VERSION);
    for (prefix, until) in entries {
        out.extend_from_slice(prefix);
        out.extend_from_slice(&until.to_be_bytes());
    }
    out
}

fn prefix(scope: &ScopeId) -> [u8; 16] {
    let mut p = [0; 16];
    p.copy_from_slice(&scope.0[..16]);
    p
}

impl<S: SharedData> LookupGate<S> {
    pub fn new(data: S) -> Self {
        LookupGate { data }
    }

    fn data_key(scope: &ScopeId) -> String {
        let n = u32::from_be_bytes([scope.0[16], scope.0[17], scope.0[18], scope.0[19]]) % GATE_KEYS;
        format!("idem:lookups:{n}")
    }

    /// Creates the gate's keys (configuration time, before traffic).
    pub fn create_keys(&self) -> Result<(), SharedDataError> {
        for n in 0..GATE_KEYS {
            let data_key = format!("idem:lookups:{n}");
            if !self.data.get(&data_key)?.exists() {
                // Racy creation is harmless here: every creator writes the same empty value.
                self.data.set(&data_key, &[], None)?;
            }
        }
        Ok(())
    }

    /// Starts a lookup of `scope` at `now_ms` that may take `timeout_ms`, or says in how many
    /// ms one may start.
    pub fn start(&self, scope: &ScopeId, now_ms: u64, timeout_ms: u64) -> Result<(), u64> {
        let data_key = Self::data_key(scope);
        let me = prefix(scope);
        for _ in 0..WRITE_TRIES {
            let read = match self.data.get(&data_key) {
                Ok(read) if read.exists() => read,
                // A key that was never created is never written here (creation ignores CAS).
                _ => return Err(LOOKUP_SPACING_MS),
            };
            let mut entries: Vec<Entry> =
                decode(&read).into_iter().filter(|(_, until)| *until > now_ms).collect();
            if let Some((_, until)) = entries.iter().find(|(p, _)| *p == me) {
                return Err(until.saturating_sub(now_ms));
            }
            if entries.len() >= ENTRIES_PER_KEY {
                return Err(LOOKUP_SPACING_MS);
            }
            entries.push((me, now_ms.saturating_add(timeout_ms.max(LOOKUP_SPACING_MS))));
            match self.data.set(&data_key, &encode(&entries), read.cas) {
                Ok(()) => return Ok(()),
                Err(SharedDataError::CasMismatch) => continue,
                Err(SharedDataError::Host(_)) => return Err(LOOKUP_SPACING_MS),
            }
        }
        Err(LOOKUP_SPACING_MS)
    }

    /// The lookup of `scope` started at `started_ms` is over: the next may start a spacing after
    /// it started. Best effort: if the write loses, the entry holds until the lookup's timeout.
    pub fn finished(&self, scope: &ScopeId, started_ms: u64, now_ms: u64) {
        let data_key = Self::data_key(scope);
        let me = prefix(scope);
        let Ok(read) = self.data.get(&data_key) else { return };
        let until = started_ms.saturating_add(LOOKUP_SPACING_MS);
        let entries: Vec<Entry> = decode(&read)
            .into_iter()
            .filter(|(_, u)| *u > now_ms)
            .map(|(p, u)| if p == me { (p, until.min(u)) } else { (p, u) })
            .filter(|(_, u)| *u > now_ms)
            .collect();
        if read.exists() {
            let _ = self.data.set(&data_key, &encode(&entries), read.cas);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fake::FakeSharedData;

    fn scope(n: u8) -> ScopeId {
        let mut id = [n; 32];
        id[16..20].copy_from_slice(&[0, 0, 0, 7]); // every test scope in one key
        ScopeId(id)
    }

    #[test]
    fn one_lookup_at_a_time_and_one_a_second_per_record_across_workers() {
        let data = FakeSharedData::new();
        let (w0, w1) = (LookupGate::new(&data), LookupGate::new(&data));
        w0.create_keys().unwrap();
        w1.create_keys().unwrap();
        let (a, b) = (scope(1), scope(2));
        assert_eq!(w0.start(&a, 1_000, 2_000), Ok(()));
        // Under way, seen from another worker: refused until its timeout; another record is not.
        assert_eq!(w1.start(&a, 1_500, 2_000), Err(1_500));
        assert_eq!(w1.start(&b, 1_500, 2_000), Ok(()));
        // Over: the next may start a second after it started.
        w0.finished(&a, 1_000, 1_200);
        assert_eq!(w1.start(&a, 1_300, 2_000), Err(700));
        assert_eq!(w1.start(&a, 2_000, 2_000), Ok(()));
        // A lookup that outlives the spacing holds until it is over.
        w1.finished(&b, 1_500, 3_000);
        assert_eq!(w0.start(&b, 3_000, 2_000), Ok(()));
    }

    #[test]
    fn a_key_holds_a_bounded_number_of_live_lookups_and_forgets_old_ones() {
        let data = FakeSharedData::new();
        let gate = LookupGate::new(&data);
        gate.create_keys().unwrap();
        for n in 0..ENTRIES_PER_KEY as u8 {
            assert_eq!(gate.start(&scope(n), 1_000, 2_000), Ok(()), "{n}");
        }
        assert_eq!(gate.start(&scope(200), 1_000, 2_000), Err(LOOKUP_SPACING_MS));
        // Past their time, the entries are nothing.
        assert_eq!(gate.start(&scope(200), 3_000, 2_000), Ok(()));
        // A key nobody created is never written (creation ignores CAS): refused.
        let bare = FakeSharedData::new();
        assert_eq!(LookupGate::new(&bare).start(&scope(1), 1_000, 2_000), Err(LOOKUP_SPACING_MS));
    }
}
