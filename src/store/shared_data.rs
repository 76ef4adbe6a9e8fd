//! The host seam for Envoy's shared-data key/value map (its keys are data keys, never to be
//! confused with Idempotency-Keys). `store/fake.rs` reproduces its rules for tests.
//!
//! Envoy (proxy-wasm-cpp-host `shared_data.cc`, checked on Envoy 1.40) gives one process-wide map
//! per `vm_id`, shared by every worker thread, with these rules, all of which the store relies on
//! or works around:
//! - `get` on a missing key returns neither value nor CAS. `get` on a key whose value is empty
//!   returns no value but a CAS, so "missing" and "emptied" can be told apart.
//! - `set` on an EXISTING key with a non-zero CAS fails with a mismatch unless the CAS is current;
//!   a successful `set` gives the key a new CAS. `set` with no CAS overwrites unconditionally.
//! - `set` on a MISSING key ignores the CAS and inserts. Two workers that both saw a key missing
//!   both "create" it and both succeed: creation is racy, so claims must only ever CAS keys that
//!   already exist.
//! - Keys are never deleted; writing an empty value keeps the key. The key space must be bounded.
//! - CAS values come from one counter shared by all keys; it skips 0.

/// A CAS token as handed out by the host (never 0).
pub type Cas = u32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedDataError {
    /// The CAS given to `set` is not the key's current one: someone wrote in between.
    CasMismatch,
    /// The host refused the call for another reason (status code as the host reported it).
    Host(u32),
}

/// One read: the value (None when missing or empty) and the CAS (None only when the key is
/// missing).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Read {
    pub value: Option<Vec<u8>>,
    pub cas: Option<Cas>,
}

impl Read {
    pub fn exists(&self) -> bool {
        self.cas.is_some()
    }
    pub fn bytes(&self) -> &[u8] {
        self.value.as_deref().unwrap_or(&[])
    }
}

pub trait SharedData {
    fn get(&self, data_key: &str) -> Result<Read, SharedDataError>;
    fn set(&self, data_key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), SharedDataError>;
}

/// Several workers share one store: each holds a reference.
impl<T: SharedData + ?Sized> SharedData for &T {
    fn get(&self, data_key: &str) -> Result<Read, SharedDataError> {
        (**self).get(data_key)
    }
    fn set(&self, data_key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), SharedDataError> {
        (**self).set(data_key, value, cas)
    }
}
