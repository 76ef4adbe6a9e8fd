//! The etcd key layout under the configured prefix: `r/<scope hex>` (the record),
//! `l/<scope hex>` (a claim's lease key, its value the owner token), `t/<scope hex>` (a
//! completed record's tombstone, on its own lease) and
//! `q/<t|p>/<tag hex16>/<until hex16>/<scope hex>` (quota index keys, sorted by when the record
//! stops counting). Every key the backend reads or writes is named here, so the layout that
//! docs/ETCD.md (*Data model*) describes is in one place.

use super::wire::TxnOp;
use super::EtcdStore;
use crate::codec::hex;
use crate::store::record::{Entry, FLAG_PRINCIPAL_CHARGED, FLAG_TENANT_CHARGED};

impl EtcdStore {
    fn key(&self, parts: &[&str]) -> Vec<u8> {
        let mut key = self.settings.prefix.clone().into_bytes();
        for p in parts {
            key.extend_from_slice(p.as_bytes());
        }
        key
    }

    /// `<prefix>r/<scope hex>`: the record.
    pub(super) fn record_key(&self, scope: &crate::identity::scope::ScopeId) -> Vec<u8> {
        self.key(&["r/", &hex(&scope.0)])
    }

    /// `<prefix>l/<scope hex>`: a claim's lease key, on a claim lease: it exists while the
    /// claim's processing lease runs by etcd's clock, whatever the Envoys' clocks say. Its value
    /// is the claim's owner token.
    pub(super) fn lease_key(&self, scope: &crate::identity::scope::ScopeId) -> Vec<u8> {
        self.key(&["l/", &hex(&scope.0)])
    }

    /// `<prefix>t/<scope hex>`: a completed record's tombstone (`store::tombstone`, a rule's
    /// `tombstone_ttl`), on a lease of its own that outlives the record's.
    pub(super) fn tombstone_key(&self, scope: &crate::identity::scope::ScopeId) -> Vec<u8> {
        self.key(&["t/", &hex(&scope.0)])
    }

    /// `<prefix>q/<t|p>/<tag hex16>/`: one identity's quota index; below it one key per record
    /// counted, `<until hex16>/<scope hex>`, where `until` is when the record stops counting.
    /// Keys sort by `until`, so the live ones are a range starting at now.
    fn index_prefix(&self, tenant: bool, tag: u64) -> Vec<u8> {
        self.key(&["q/", if tenant { "t/" } else { "p/" }, &format!("{tag:016x}/")])
    }

    pub(super) fn index_keys(&self, e: &Entry) -> Vec<Vec<u8>> {
        let until = counts_until(e);
        let mut keys = Vec::new();
        for (flag, tenant, tag) in
            [(FLAG_TENANT_CHARGED, true, e.tenant_tag), (FLAG_PRINCIPAL_CHARGED, false, e.principal_tag)]
        {
            if e.flags & flag != 0 {
                let mut key = self.index_prefix(tenant, tag);
                key.extend_from_slice(format!("{until:016x}/{}", hex(&e.scope.0)).as_bytes());
                keys.push(key);
            }
        }
        keys
    }

    /// The live part of an identity's index at `now_ms`: keys whose `until` is after now.
    pub(super) fn live_index(&self, tenant: bool, tag: u64, now_ms: u64) -> TxnOp {
        let prefix = self.index_prefix(tenant, tag);
        let mut key = prefix.clone();
        key.extend_from_slice(format!("{:016x}", now_ms.saturating_add(1)).as_bytes());
        let mut range_end = prefix;
        // '/' + 1: the first key after every key under the prefix.
        if let Some(last) = range_end.last_mut() {
            *last = b'0';
        }
        TxnOp::Range { key, range_end: Some(range_end), limit: 2, keys_only: true }
    }
}

/// When a record stops counting against its quota: a claim at the end of its lease (an abandoned
/// claim must not lock its client out for the ttl, as the local store's sweep discharges it), a
/// completed record at its expiry.
pub(super) fn counts_until(e: &Entry) -> u64 {
    if e.is_completed() {
        e.expires_at_ms
    } else {
        e.lease_deadline_ms.min(e.expires_at_ms)
    }
}

/// A quota tag: the first 8 bytes of the identity's digest. A collision (2^-64 per pair) merges
/// two identities' quotas, nothing worse; the tag keeps the digest itself out of etcd's keys.
pub(super) fn tag_of(digest: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The owner token a lease key holds.
pub(super) fn owner_of(value: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(value).ok().map(u64::from_be_bytes)
}
