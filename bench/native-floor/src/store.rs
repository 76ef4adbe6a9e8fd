//! The process-wide store: one Mutex around a bounded HashMap, shared by every worker (the
//! module is dlopened once per process). Not the filter's store: no two-choice buckets in
//! shared data, no TTL, no lease or fencing token, no quota; when full it evicts any entry.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};

pub const CAPACITY: usize = 100_000;

/// A record: the request's fingerprint, and once the upstream answered, its snapshot.
pub struct Record {
    pub fingerprint: [u8; 32],
    /// 0 while the first request is in flight (claimed), else the stored answer's status.
    pub status: u32,
    pub body: Vec<u8>,
    /// The length of the request body the fingerprint covers (shown on replays, as a check).
    pub request_bytes: usize,
}

/// What a claim found.
pub enum Claim {
    /// The key is new: it is ours now; go to the upstream.
    New,
    /// The same request was answered: replay this.
    Replay { status: u32, body: Vec<u8>, request_bytes: usize },
    /// The same request is still in flight.
    InFlight,
    /// The key was used with another request.
    Mismatch,
}

static STORE: LazyLock<Mutex<HashMap<[u8; 32], Record>>> =
    LazyLock::new(|| Mutex::new(HashMap::with_capacity(CAPACITY)));

fn store() -> MutexGuard<'static, HashMap<[u8; 32], Record>> {
    // A poisoned lock only means another thread panicked while holding it; the map is still
    // usable (nothing here panics, but never panic across the C boundary because of it).
    STORE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Compare-and-swap: claim `key` for `fingerprint` if absent, else say what is there.
pub fn claim(key: [u8; 32], fingerprint: [u8; 32], request_bytes: usize) -> Claim {
    let mut map = store();
    if let Some(rec) = map.get(&key) {
        if rec.fingerprint != fingerprint {
            return Claim::Mismatch;
        }
        if rec.status == 0 {
            return Claim::InFlight;
        }
        return Claim::Replay { status: rec.status, body: rec.body.clone(), request_bytes: rec.request_bytes };
    }
    if map.len() >= CAPACITY {
        if let Some(victim) = map.keys().next().copied() {
            map.remove(&victim);
        }
    }
    map.insert(key, Record { fingerprint, status: 0, body: Vec::new(), request_bytes });
    Claim::New
}

/// The snapshot: the upstream's status and body, stored if the claim is still ours.
pub fn complete(key: &[u8; 32], fingerprint: &[u8; 32], status: u32, body: Vec<u8>) -> bool {
    let mut map = store();
    match map.get_mut(key) {
        Some(rec) if rec.fingerprint == *fingerprint && rec.status == 0 => {
            rec.status = status;
            rec.body = body;
            true
        }
        _ => false,
    }
}

/// A claim whose stream ended without an answer to store: forget it.
pub fn release(key: &[u8; 32], fingerprint: &[u8; 32]) {
    let mut map = store();
    if matches!(map.get(key), Some(rec) if rec.fingerprint == *fingerprint && rec.status == 0) {
        map.remove(key);
    }
}
