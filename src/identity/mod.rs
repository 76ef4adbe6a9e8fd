//! Who a request is and what it says: the Idempotency-Key, the record's scope (tenant,
//! principal, authority, method, path, key) and the payload's fingerprint over its canonical
//! JSON form. Every output here is a versioned contract (golden vectors guard them).

pub mod canonical;
pub mod fingerprint;
pub mod key;
pub mod scope;
