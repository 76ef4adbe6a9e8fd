//! The test kit's shared data: an in-memory map with Envoy's exact rules (see
//! `shared_data.rs`), and a wrapper that interleaves another worker's steps at an exact point.
//! Behind the `testing` feature: never part of the shipped filter.

// A failing assertion is the test kit's job; it never runs inside Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::store::shared_data::{Cas, Read, SharedData, SharedDataError};
use std::cell::RefCell;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Io {
    pub gets: u64,
    pub sets: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl std::ops::Sub for Io {
    type Output = Io;
    fn sub(self, o: Io) -> Io {
        Io {
            gets: self.gets.saturating_sub(o.gets),
            sets: self.sets.saturating_sub(o.sets),
            bytes_read: self.bytes_read.saturating_sub(o.bytes_read),
            bytes_written: self.bytes_written.saturating_sub(o.bytes_written),
        }
    }
}

/// In-memory fake with Envoy's exact semantics, for unit tests of pure logic. Several "workers"
/// share one instance (`&FakeSharedData`); interleavings are written out step by step in tests.
#[derive(Debug, Default)]
pub struct FakeSharedData {
    inner: RefCell<FakeInner>,
}

#[derive(Debug, Default)]
struct FakeInner {
    map: HashMap<String, (Vec<u8>, Cas)>,
    next_cas: Cas,
    /// Armed by tests to make the next `set`s fail as if another worker had just written.
    forced_mismatches: u32,
    /// When set, only keys containing this fragment are subject to `forced_mismatches`.
    forced_only: Option<String>,
    gets: u64,
    sets: u64,
    /// Value bytes the host copied out (gets) and in (sets that were applied or refused).
    bytes_read: u64,
    bytes_written: u64,
}

impl FakeSharedData {
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys ever created; Envoy never frees one, so this is the store's key-space footprint.
    pub fn key_count(&self) -> usize {
        self.inner.borrow().map.len()
    }

    /// Bytes held in values (the memory the host keeps for us).
    pub fn value_bytes(&self) -> usize {
        self.inner.borrow().map.values().map(|(v, _)| v.len()).sum()
    }

    pub fn op_counts(&self) -> (u64, u64) {
        let inner = self.inner.borrow();
        (inner.gets, inner.sets)
    }

    /// Host calls and value bytes copied so far: what a store operation costs the host, whose
    /// global shared-data lock is held for every copy.
    pub fn io(&self) -> Io {
        let inner = self.inner.borrow();
        Io {
            gets: inner.gets,
            sets: inner.sets,
            bytes_read: inner.bytes_read,
            bytes_written: inner.bytes_written,
        }
    }

    /// The next `n` CAS writes to existing keys fail with a mismatch (the key's CAS is bumped, as
    /// if another worker wrote the same value in between).
    pub fn force_cas_mismatches(&self, n: u32) {
        let mut inner = self.inner.borrow_mut();
        inner.forced_mismatches = n;
        inner.forced_only = None;
    }

    /// Like `force_cas_mismatches`, but only CAS writes to keys containing `fragment` lose: a
    /// busy bucket without busy snapshot slots, for instance.
    pub fn force_cas_mismatches_on(&self, fragment: &str, n: u32) {
        let mut inner = self.inner.borrow_mut();
        inner.forced_mismatches = n;
        inner.forced_only = Some(fragment.to_string());
    }

    /// Raw overwrite, for tests that corrupt stored bytes.
    pub fn poke(&self, data_key: &str, value: &[u8]) {
        let mut inner = self.inner.borrow_mut();
        let cas = inner.bump();
        inner.map.insert(data_key.to_string(), (value.to_vec(), cas));
    }
}

impl FakeInner {
    fn bump(&mut self) -> Cas {
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        self.next_cas
    }
}

impl SharedData for FakeSharedData {
    fn get(&self, data_key: &str) -> Result<Read, SharedDataError> {
        let mut inner = self.inner.borrow_mut();
        inner.gets += 1;
        let copied = inner.map.get(data_key).map_or(0, |(v, _)| v.len() as u64);
        inner.bytes_read += copied;
        Ok(match inner.map.get(data_key) {
            None => Read { value: None, cas: None },
            Some((v, cas)) if v.is_empty() => Read { value: None, cas: Some(*cas) },
            Some((v, cas)) => Read { value: Some(v.clone()), cas: Some(*cas) },
        })
    }

    fn set(&self, data_key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), SharedDataError> {
        let mut inner = self.inner.borrow_mut();
        inner.sets += 1;
        inner.bytes_written += value.len() as u64;
        if let Some((_, current)) = inner.map.get(data_key) {
            let current = *current;
            let targeted = inner.forced_only.as_deref().is_none_or(|f| data_key.contains(f));
            if inner.forced_mismatches > 0 && cas.is_some() && targeted {
                inner.forced_mismatches -= 1;
                let bumped = inner.bump();
                if let Some(entry) = inner.map.get_mut(data_key) {
                    entry.1 = bumped;
                }
                return Err(SharedDataError::CasMismatch);
            }
            if let Some(cas) = cas {
                if cas != current {
                    return Err(SharedDataError::CasMismatch);
                }
            }
        }
        // A missing key is inserted whatever the CAS: this is the trap the store designs around.
        let new_cas = inner.bump();
        inner.map.insert(data_key.to_string(), (value.to_vec(), new_cas));
        Ok(())
    }
}

/// Test wrapper that runs another worker's steps at an exact point of this worker's sequence:
/// just before this worker's n-th operation on a key containing `trigger`. Deterministic
/// interleavings without threads.
pub struct Interleave<'a, S: SharedData> {
    pub inner: &'a S,
    pub trigger: &'static str,
    pub before_nth: std::cell::Cell<u32>,
    pub action: RefCell<Option<Box<dyn FnOnce() + 'a>>>,
}

impl<'a, S: SharedData> Interleave<'a, S> {
    pub fn new(inner: &'a S, trigger: &'static str, nth: u32, action: impl FnOnce() + 'a) -> Self {
        Interleave {
            inner,
            trigger,
            before_nth: std::cell::Cell::new(nth),
            action: RefCell::new(Some(Box::new(action))),
        }
    }

    fn maybe_fire(&self, data_key: &str) {
        if !data_key.contains(self.trigger) {
            return;
        }
        let n = self.before_nth.get();
        self.before_nth.set(n.saturating_sub(1));
        if n == 1 {
            if let Some(action) = self.action.borrow_mut().take() {
                action();
            }
        }
    }
}

impl<S: SharedData> SharedData for Interleave<'_, S> {
    fn get(&self, data_key: &str) -> Result<Read, SharedDataError> {
        self.maybe_fire(data_key);
        self.inner.get(data_key)
    }
    fn set(&self, data_key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), SharedDataError> {
        self.maybe_fire(data_key);
        self.inner.set(data_key, value, cas)
    }
}

/// Every order of `items` (n! of them; equal items give equal orders more than once), for the
/// model tests that run each order of a few events.
pub fn permutations<T: Clone>(items: &[T]) -> Vec<Vec<T>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut out = Vec::new();
    for i in 0..items.len() {
        let mut rest = items.to_vec();
        let first = rest.remove(i);
        for mut tail in permutations(&rest) {
            tail.insert(0, first.clone());
            out.push(tail);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::shared_data::{Read, SharedData, SharedDataError};

    #[test]
    fn missing_key_reads_as_neither_value_nor_cas() {
        let s = FakeSharedData::new();
        assert_eq!(s.get("k").unwrap(), Read { value: None, cas: None });
    }

    #[test]
    fn set_on_missing_key_ignores_cas() {
        let s = FakeSharedData::new();
        s.set("k", b"v1", Some(12345)).unwrap();
        assert_eq!(s.get("k").unwrap().value.as_deref(), Some(&b"v1"[..]));
    }

    #[test]
    fn creation_race_lets_both_workers_win() {
        let s = FakeSharedData::new();
        let a = s.get("k").unwrap();
        let b = s.get("k").unwrap();
        assert!(s.set("k", b"a", a.cas).is_ok());
        assert!(s.set("k", b"b", b.cas).is_ok(), "Envoy lets the second creator win too");
        assert_eq!(s.get("k").unwrap().value.as_deref(), Some(&b"b"[..]));
    }

    #[test]
    fn cas_on_existing_key_is_atomic() {
        let s = FakeSharedData::new();
        s.set("k", b"", None).unwrap();
        let a = s.get("k").unwrap();
        let b = s.get("k").unwrap();
        assert!(s.set("k", b"a", a.cas).is_ok());
        assert_eq!(s.set("k", b"b", b.cas), Err(SharedDataError::CasMismatch));
        let reused = a.cas;
        assert_eq!(s.set("k", b"c", reused), Err(SharedDataError::CasMismatch));
    }

    #[test]
    fn empty_value_keeps_the_key_as_a_tombstone() {
        let s = FakeSharedData::new();
        s.set("k", b"v", None).unwrap();
        s.set("k", b"", None).unwrap();
        let r = s.get("k").unwrap();
        assert_eq!(r.value, None);
        assert!(r.cas.is_some());
        assert_eq!(s.key_count(), 1);
    }

    #[test]
    fn no_cas_overwrites_unconditionally() {
        let s = FakeSharedData::new();
        s.set("k", b"v", None).unwrap();
        s.set("k", b"w", None).unwrap();
        assert_eq!(s.get("k").unwrap().bytes(), b"w");
    }
}
