//! Keeping the claims whose owners are still at work (`StoreOp::Renew`). Each claim's lease key
//! is put again on a claim lease this worker holds (granted first when it has none for the
//! claims' processing lease), one transaction for every claim of the batch, guarded by each
//! record's revision still being its claim's. The record itself is not rewritten, so the claim
//! (its revision) stays what its completion is guarded by; another Envoy's begin finds the lease
//! key its owner's and answers "in flight" (`conversation::existing`), whatever the record's own
//! deadline says. One write per batch, not per claim: a worker renews all its long-running
//! claims of one lease length together.
//!
//! A claim whose record moved (settled, released, taken over) fails the transaction: its failure
//! branch reads each record's revision, those claims are answered "no longer the owner's", and
//! the others are tried again in a new transaction (`TXN_ATTEMPTS` at most).

use super::decode;
use super::leases::claim_lease_ttl_s;
use super::stage::{Move, Stage, TXN_ATTEMPTS};
use super::wire::{self, Guard, TxnOp};
use super::{unusable, EtcdConversation, EtcdStore};
use crate::store::{Kept, StoreError, StoreOp, MAX_RENEWALS};

/// A renewal in progress.
#[derive(Debug, Clone)]
pub(super) struct Renewing {
    /// The claims (their index in the `Renew`) not yet answered.
    pending: Vec<usize>,
    kept: Vec<Kept>,
    /// The claim lease the lease keys go on (0: not known yet), asked for at `grant_sent_ms`.
    lease: i64,
    grant_sent_ms: u64,
    attempts: u8,
}

impl EtcdConversation {
    pub(super) fn start_renew(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Move, StoreError> {
        let StoreOp::Renew(r) = &self.op else { return Err(unusable("not a renewal")) };
        let n = r.claims.len();
        if n == 0 {
            return Ok(Move::Renewed(Vec::new()));
        }
        if n > MAX_RENEWALS {
            return Err(unusable("more claims than one renewal carries"));
        }
        self.renewing = Some(Box::new(Renewing {
            pending: (0..n).collect(),
            kept: vec![Kept::Settled; n],
            lease: 0,
            grant_sent_ms: 0,
            attempts: 0,
        }));
        self.renew_call(store, now_ms)
    }

    /// The renewal's next call: the claim lease's grant when the worker has none that is young
    /// enough, else the transaction.
    fn renew_call(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Move, StoreError> {
        let StoreOp::Renew(r) = &self.op else { return Err(unusable("not a renewal")) };
        let Some(state) = self.renewing.as_mut() else { return Err(unusable("a renewal without its state")) };
        if state.lease == 0 {
            match store.claim_lease_for(r.lease_ms, now_ms) {
                Some(id) => state.lease = id,
                None => {
                    state.grant_sent_ms = now_ms;
                    let grant = wire::lease_grant(store.protocol(), claim_lease_ttl_s(r.lease_ms));
                    return Ok(Move::Call(grant, Stage::RenewLease));
                }
            }
        }
        let mut records = Vec::with_capacity(state.pending.len());
        let mut puts = Vec::with_capacity(state.pending.len());
        for &i in &state.pending {
            let Some(c) = r.claims.get(i) else { return Err(unusable("a renewal of no claim")) };
            let revision = i64::try_from(c.locator).map_err(|_| unusable("a revision out of range"))?;
            records.push((store.record_key(&c.scope), revision));
            let value = c.owner.to_be_bytes().to_vec();
            puts.push(TxnOp::Put { key: store.lease_key(&c.scope), value, lease: state.lease });
        }
        let guards: Vec<(&[u8], Guard)> =
            records.iter().map(|(key, revision)| (key.as_slice(), Guard::ModRevision(*revision))).collect();
        let reads: Vec<TxnOp> = records
            .iter()
            .map(|(key, _)| TxnOp::Range { key: key.clone(), range_end: None, limit: 0, keys_only: false })
            .collect();
        Ok(Move::Call(wire::txn_all(store.protocol(), &guards, &puts, &reads), Stage::Renew))
    }

    pub(super) fn renew_lease_granted(
        &mut self,
        store: &EtcdStore,
        id: i64,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let StoreOp::Renew(r) = &self.op else { return Err(unusable("not a renewal")) };
        let Some(state) = self.renewing.as_mut() else { return Err(unusable("a renewal without its state")) };
        store.remember_claim_lease(r.lease_ms, state.grant_sent_ms, id);
        state.lease = id;
        self.renew_call(store, now_ms)
    }

    /// etcd no longer knows the claim lease the transaction named: granted anew, once.
    pub(super) fn renew_lease_lost(&mut self, store: &EtcdStore, now_ms: u64) -> Result<Move, StoreError> {
        let Some(state) = self.renewing.as_mut() else { return Err(unusable("a renewal without its state")) };
        store.forget_lease(state.lease);
        state.lease = 0;
        self.renew_call(store, now_ms)
    }

    pub(super) fn renewed(
        &mut self,
        store: &EtcdStore,
        txn: &wire::TxnAnswer,
        now_ms: u64,
    ) -> Result<Move, StoreError> {
        let StoreOp::Renew(r) = &self.op else { return Err(unusable("not a renewal")) };
        let Some(state) = self.renewing.as_mut() else { return Err(unusable("a renewal without its state")) };
        if txn.succeeded {
            for &i in &state.pending {
                if let Some(k) = state.kept.get_mut(i) {
                    *k = Kept::Renewed;
                }
            }
            return Ok(Move::Renewed(std::mem::take(&mut state.kept)));
        }
        // The failure branch read each record, in the order of the claims still pending: those
        // whose revision is still their claim's are tried again; the others are settled (their
        // owner's, or gone) or taken over (another owner's).
        let mut still = Vec::new();
        for (read, &i) in txn.ranges.iter().zip(&state.pending) {
            let Some(c) = r.claims.get(i) else { continue };
            match read.kvs.first() {
                Some(kv) if u64::try_from(kv.mod_revision).ok() == Some(c.locator) => still.push(i),
                Some(kv) => {
                    let theirs = decode(&kv.value).is_ok_and(|v| v.entry.owner != c.owner);
                    if let Some(k) = state.kept.get_mut(i) {
                        *k = if theirs { Kept::TakenOver } else { Kept::Settled };
                    }
                }
                None => {}
            }
        }
        state.attempts += 1;
        if still.is_empty() {
            return Ok(Move::Renewed(std::mem::take(&mut state.kept)));
        }
        if state.attempts >= TXN_ATTEMPTS {
            return Err(StoreError::Contention);
        }
        state.pending = still;
        self.renew_call(store, now_ms)
    }
}
