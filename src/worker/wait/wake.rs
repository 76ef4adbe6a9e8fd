//! Cross-worker wake-ups for wait mode. Each root context (one per worker thread) owns an Envoy
//! shared queue; `on_queue_ready` runs on the thread that registered it, so a message to a
//! worker's queue reaches that worker's waiters. Queue names are published in one shared-data
//! registry with a heartbeat; entries that stop beating (a VM that was replaced, a root that was
//! dropped after a config update) are pruned, so messages stop going to queues nobody reads.
//!
//! Registry format v1: [1u8][count u8] then per queue: [name len u8][name][heartbeat_ms u64 BE].

use crate::store::shared_data::{SharedData, SharedDataError};
use crate::store::StoreError;

pub const REGISTRY_KEY: &str = "idem:v1:wake-queues";
/// A queue whose owner has not beaten for this long is dropped.
pub const STALE_AFTER_MS: u64 = 10_000;
const MAX_QUEUES: usize = 128;
const CAS_ATTEMPTS: usize = 16;

pub fn queue_name(seed: u64) -> String {
    format!("idem:v1:wake:{seed:016x}")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub heartbeat_ms: u64,
}

pub fn decode(bytes: &[u8]) -> Option<Vec<Peer>> {
    let (&version, rest) = bytes.split_first()?;
    if version != 1 {
        return None;
    }
    let (&count, mut rest) = rest.split_first()?;
    let mut out = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let (&len, r) = rest.split_first()?;
        let name = std::str::from_utf8(r.get(..usize::from(len))?).ok()?.to_string();
        let hb = r.get(usize::from(len)..usize::from(len) + 8)?;
        out.push(Peer { name, heartbeat_ms: u64::from_be_bytes(hb.try_into().ok()?) });
        rest = r.get(usize::from(len) + 8..)?;
    }
    rest.is_empty().then_some(out)
}

pub fn encode(entries: &[Peer]) -> Vec<u8> {
    let kept: Vec<&Peer> =
        entries.iter().filter(|e| e.name.len() <= usize::from(u8::MAX)).take(MAX_QUEUES).collect();
    let mut out = vec![1u8, kept.len() as u8];
    for e in kept {
        out.push(e.name.len() as u8);
        out.extend_from_slice(e.name.as_bytes());
        out.extend_from_slice(&e.heartbeat_ms.to_be_bytes());
    }
    out
}

pub struct Registry<S: SharedData> {
    data: S,
}

fn host(e: SharedDataError) -> StoreError {
    StoreError::Unavailable(format!("wake registry: {e:?}"))
}

impl<S: SharedData> Registry<S> {
    pub fn new(data: S) -> Self {
        Registry { data }
    }

    /// Creates the registry key if it does not exist (at configure time, like the store's keys:
    /// Envoy ignores CAS on a missing key, so it must exist before anyone updates it).
    pub fn create_key(&self) -> Result<(), StoreError> {
        if !self.data.get(REGISTRY_KEY).map_err(host)?.exists() {
            self.data.set(REGISTRY_KEY, &encode(&[]), None).map_err(host)?;
        }
        Ok(())
    }

    /// Applies `change` to the live entries under CAS; returns the names after the change.
    fn update(&self, now_ms: u64, change: impl Fn(&mut Vec<Peer>)) -> Result<Vec<String>, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let read = self.data.get(REGISTRY_KEY).map_err(host)?;
            if !read.exists() {
                return Err(StoreError::Unavailable(format!("{REGISTRY_KEY} was never created")));
            }
            // An unreadable registry is rebuilt: it only holds heartbeats, which every live
            // owner rewrites within a second.
            let mut entries = decode(read.bytes()).unwrap_or_default();
            entries.retain(|e| now_ms.saturating_sub(e.heartbeat_ms) < STALE_AFTER_MS);
            change(&mut entries);
            match self.data.set(REGISTRY_KEY, &encode(&entries), read.cas) {
                Ok(()) => return Ok(entries.into_iter().map(|e| e.name).collect()),
                Err(SharedDataError::CasMismatch) => continue,
                Err(e) => return Err(host(e)),
            }
        }
        Err(StoreError::Contention)
    }

    /// The queues whose owners beat recently (read only).
    pub fn live(&self, now_ms: u64) -> Result<Vec<String>, StoreError> {
        let read = self.data.get(REGISTRY_KEY).map_err(host)?;
        let entries = decode(read.bytes()).unwrap_or_default();
        Ok(entries
            .into_iter()
            .filter(|e| now_ms.saturating_sub(e.heartbeat_ms) < STALE_AFTER_MS)
            .map(|e| e.name)
            .collect())
    }

    /// Records that `name`'s owner is alive; returns every live queue name (its own included).
    pub fn heartbeat(&self, name: &str, now_ms: u64) -> Result<Vec<String>, StoreError> {
        self.update(now_ms, |entries| {
            match entries.iter_mut().find(|e| e.name == name) {
                Some(e) => e.heartbeat_ms = now_ms,
                None => entries.push(Peer { name: name.to_string(), heartbeat_ms: now_ms }),
            }
            crate::sort::small_by_key(entries, |e| std::cmp::Reverse(e.heartbeat_ms));
        })
    }

    pub fn remove(&self, name: &str, now_ms: u64) -> Result<(), StoreError> {
        self.update(now_ms, |entries| entries.retain(|e| e.name != name)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fake::FakeSharedData;

    #[test]
    fn workers_see_each_other_and_stale_queues_drop_out() {
        let data = FakeSharedData::new();
        let r = Registry::new(&data);
        r.create_key().unwrap();
        r.heartbeat("a", 0).unwrap();
        let names = r.heartbeat("b", 100).unwrap();
        assert_eq!(names.len(), 2);
        assert_eq!(r.live(200).unwrap().len(), 2);
        // "a" stops beating; "b" goes on.
        let names = r.heartbeat("b", STALE_AFTER_MS + 1).unwrap();
        assert_eq!(names, vec!["b".to_string()]);
        r.remove("b", STALE_AFTER_MS + 2).unwrap();
        assert!(r.heartbeat("c", STALE_AFTER_MS + 3).unwrap() == vec!["c".to_string()]);
    }

    #[test]
    fn codec_round_trips_and_refuses_garbage() {
        let e = vec![Peer { name: queue_name(7), heartbeat_ms: 42 }];
        assert_eq!(decode(&encode(&e)), Some(e));
        assert_eq!(decode(&[2, 0]), None);
        assert_eq!(decode(&[1, 1, 3, b'a']), None);
        assert_eq!(decode(&[]), None);
    }

    #[test]
    fn never_creates_the_key_on_update() {
        let data = FakeSharedData::new();
        assert!(Registry::new(&data).heartbeat("a", 0).is_err());
        assert_eq!(data.key_count(), 0);
    }
}
