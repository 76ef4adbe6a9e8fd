//! Quotas on etcd: which identities a claim is charged to, the live index ranges that count
//! their records, and the refusal (with its retry-after hint) when one is over its bound;
//! with the conversation's two quota-only steps, the read before a takeover or reuse and the undo
//! of a new claim found over its bound. docs/ETCD.md says why a new claim counts after its
//! puts (*Data model*) and where racing claims can overshoot (*Limits worth knowing*).

use super::keys::{counts_until, tag_of};
use super::stage::{Move, Stage};
use super::wire::{self, Guard, TxnOp};
use super::{unusable, EtcdConversation, EtcdStore};
use crate::store::record::{Entry, FLAG_BODY_NOT_STORED, FLAG_PRINCIPAL_CHARGED, FLAG_TENANT_CHARGED};
use crate::store::{Begin, ClaimAttempt, StoreError, StoreOp};

/// Upper bound of a retry-after hint (as the local store).
const RETRY_CAP_MS: u64 = 60_000;

/// The processing record a claim of `a` writes, charged to the identities its quota names.
pub(super) fn charged_entry(a: &ClaimAttempt) -> Entry {
    // A claim read from etcd is a record without a body (`record::decode_record`).
    let (mut flags, mut tenant_tag, mut principal_tag) = (FLAG_BODY_NOT_STORED, 0, 0);
    if let Some(q) = &a.quota {
        if let Some(t) = &q.tenant {
            flags |= FLAG_TENANT_CHARGED;
            tenant_tag = tag_of(t);
        }
        if let Some(p) = &q.principal {
            flags |= FLAG_PRINCIPAL_CHARGED;
            principal_tag = tag_of(p);
        }
    }
    a.processing_entry(0, flags, tenant_tag, principal_tag)
}

/// A charged attempt's quota reads: its tenant's live index (if it has a tenant), then its
/// principal's.
pub(super) fn quota_reads(store: &EtcdStore, a: &ClaimAttempt) -> Vec<TxnOp> {
    let mut reads = Vec::new();
    if let Some(q) = &a.quota {
        if let Some(t) = &q.tenant {
            reads.push(store.live_index(true, tag_of(t), a.now_ms));
        }
        if let Some(p) = &q.principal {
            reads.push(store.live_index(false, tag_of(p), a.now_ms));
        }
    }
    reads
}

/// The quota's refusal of a claim of `a`, given its live index ranges (in `quota_reads`
/// order), or None when there is room. `own`: the claim's record and index keys when the
/// ranges were read after putting them (they count, but not against themselves).
pub(super) fn quota_refusal(
    a: &ClaimAttempt,
    live: &[wire::RangeAnswer],
    own: Option<(&Entry, &[Vec<u8>])>,
) -> Result<Option<Begin>, StoreError> {
    let Some(q) = &a.quota else { return Ok(None) };
    let mut ranges = live.iter();
    for (present, bound, tenant) in
        [(q.tenant.is_some(), q.per_tenant, true), (q.principal.is_some(), q.per_principal, false)]
    {
        if !present {
            continue;
        }
        let what = if tenant { "tenant" } else { "principal" };
        let range =
            ranges.next().ok_or_else(|| unusable(&format!("etcd's answer lacks the {what} index")))?;
        let mut others = range.clone();
        if let Some((entry, keys)) = own {
            // The claim's own key is in the live range when it counts after now.
            if counts_until(entry) > a.now_ms {
                others.count = others.count.saturating_sub(1);
            }
            others.kvs.retain(|kv| !keys.contains(&kv.key));
        }
        if let Some(refusal) = refusal(&others, bound, a.now_ms, tenant) {
            return Ok(Some(refusal));
        }
    }
    Ok(None)
}

/// The quota answer for an identity whose live index is `live`, or None when there is room.
fn refusal(live: &wire::RangeAnswer, bound: u32, now_ms: u64, tenant: bool) -> Option<Begin> {
    if live.count < i64::from(bound) {
        return None;
    }
    // The first live key is the one that stops counting first (keys sort by `until`).
    let soonest = live.kvs.first().and_then(|kv| {
        let text = std::str::from_utf8(&kv.key).ok()?;
        let mut parts = text.rsplit('/');
        parts.next()?;
        u64::from_str_radix(parts.next()?, 16).ok()
    });
    let retry_after_ms = match soonest {
        Some(until) if bound > 0 => until.saturating_sub(now_ms).clamp(1, RETRY_CAP_MS),
        _ => RETRY_CAP_MS,
    };
    Some(Begin::QuotaExceeded { retry_after_ms, tenant })
}

impl EtcdConversation {
    pub(super) fn quota_read(
        &mut self,
        store: &EtcdStore,
        txn: &wire::TxnAnswer,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let StoreOp::Begin(a) = self.op.clone() else { return Err(unusable("not a begin")) };
        let pending = self.pending_claim.take().ok_or_else(|| unusable("a quota read without its claim"))?;
        if !txn.succeeded {
            // The record changed since it was read: look again, as after a lost write.
            return self.read_again(store, &a, now_ms);
        }
        self.claim(store, &a, pending, &txn.ranges, now_ms)
    }

    /// Deletes a new claim found over its quota (record, index keys, lease key), guarded by its
    /// revision; the begin then answers `refusal`.
    pub(super) fn undo(&mut self, store: &EtcdStore, entry: Entry, revision: i64, refusal: Begin) -> Move {
        let key = store.record_key(&entry.scope);
        let mut ops: Vec<TxnOp> =
            store.index_keys(&entry).into_iter().map(|k| TxnOp::Delete { key: k }).collect();
        ops.push(TxnOp::Delete { key: key.clone() });
        ops.push(TxnOp::Delete { key: store.lease_key(&entry.scope) });
        self.refusal = Some(refusal);
        Move::Call(
            wire::txn(store.protocol(), Some((&key, Guard::ModRevision(revision))), &ops, &[]),
            Stage::Undo,
        )
    }
}
