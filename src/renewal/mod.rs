//! A claim lives as long as its owner. While the request that owns a claim is alive on this
//! worker (an inline stream waiting for its response or copying it, a detached call in flight, a
//! completion being written or tried again), the worker's root renews the claim before its lease
//! ends, so that a retry gets 409 (or waits) and no takeover, refusal or lookup starts while the
//! upstream may still execute. Pure: the flow says when it holds a claim and when it lets it go
//! (`Step::Hold`, `Step::LetGo`), the root asks `due` at each tick and carries out the
//! renewals (`StoreOp::Renew`), and hands their answers back (`answered`).
//!
//! - A request that finishes within three quarters of its lease is never renewed: holding and
//!   letting go is memory only, never a host call or a store operation.
//! - When the owner ends without an outcome (its stream reset, its route timed out, its client
//!   left, its Envoy died) nothing more is renewed, and its claim ends where its last lease
//!   ends: at most one `processing_timeout` after the owner's end, and never before one
//!   `processing_timeout` after the claim. No write is needed at the owner's end, so an owner
//!   whose Envoy dies leaves a claim that ends just the same.
//! - A renewal never keeps a claim past its record's expiry (its rule's `ttl`): whatever Envoy
//!   forgets (a stream it never ends, a bug), no key is held longer than a record lives. A
//!   shorter bound would end the claim of a request still running upstream, which is the double
//!   execution this exists to prevent; the filter cannot read the route's timeout.
//! - A worker holds at most `MAX_HELD` claims (each about 150 bytes); one past it is not renewed
//!   (it ends with its lease, as every claim did before renewals) and is counted.

use crate::identity::scope::ScopeId;
use crate::store::{Claim, Kept, Renew, Renewal, MAX_RENEWALS};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Owner tokens are already uniformly spread (`PluginState::owner_token` mixes them with
/// SplitMix64, from a random per-root seed) and no client chooses one: the table uses the token
/// itself as its hash instead of SipHash, whose cost every new key paid twice (hold, let go).
#[derive(Default, Clone, Copy)]
struct OwnerHasher(u64);

impl Hasher for OwnerHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (the key is a u64); any other input still hashes.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type ByOwner = HashMap<u64, Held, BuildHasherDefault<OwnerHasher>>;

/// Claims one worker keeps renewing at most.
pub const MAX_HELD: usize = 65_536;

/// How long after a failed renewal it is tried again.
const RETRY_AFTER_FAILURE_MS: u64 = 500;

/// The least time before a lease's end at which it is renewed: a few of the root's ticks
/// (100 ms) and a store call.
const MIN_MARGIN_MS: u64 = 300;

/// A claim its owner now holds (`Step::Hold`): the flow says when its lease ends and when its
/// record expires, as its claim attempt made them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub claim: Claim,
    pub lease_ms: u64,
    pub lease_end_ms: u64,
    pub expires_at_ms: u64,
}

#[derive(Debug, Clone)]
struct Held {
    hold: Hold,
    /// Parts of a renewal of it under way (a moving claim has two, one per home).
    renewing: u8,
    /// After a failed renewal: not asked again before.
    not_before_ms: u64,
}

/// How long before a lease's end it is renewed: a quarter of the lease (a request that ends
/// before that never renews), at least `MIN_MARGIN_MS`, at most half of it.
fn margin_ms(lease_ms: u64) -> u64 {
    (lease_ms / 4).max(MIN_MARGIN_MS).min(lease_ms / 2)
}

/// What a renewal's answer did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Renewed {
    /// Claims kept for another lease.
    pub kept: usize,
    /// Claims found another owner's (taken over after a lease that ended before it could be
    /// renewed): let go, and said (`claims_lost`). Claims their owner settled meanwhile are let
    /// go without a word.
    pub lost: Vec<ScopeId>,
}

/// The claims a worker's owners hold, by owner token. (`Clone` for the etcd model checker, which
/// copies a worker's state into each state it explores, and tells states apart by their `Debug`:
/// written in owner order, whatever the map's.)
#[derive(Default, Clone)]
pub struct Renewals {
    held: ByOwner,
}

impl std::fmt::Debug for Renewals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut held: Vec<(&u64, &Held)> = self.held.iter().collect();
        held.sort_unstable_by_key(|(owner, _)| **owner);
        f.debug_list().entries(held).finish()
    }
}

impl Renewals {
    /// The owner holds its claim from now until it lets go. False: the worker holds
    /// `MAX_HELD` claims already, and this one is not renewed.
    pub fn hold(&mut self, hold: Hold) -> bool {
        if self.held.len() >= MAX_HELD && !self.held.contains_key(&hold.claim.owner) {
            return false;
        }
        self.held.insert(hold.claim.owner, Held { hold, renewing: 0, not_before_ms: 0 });
        true
    }

    /// The owner is done with its claim (settled, or ended without an outcome): not renewed
    /// any more. Its lease's end as it stands, if it was held.
    pub fn let_go(&mut self, owner: u64) -> Option<u64> {
        if self.held.is_empty() {
            return None;
        }
        self.held.remove(&owner).map(|h| h.hold.lease_end_ms)
    }

    /// When the lease of `owner`'s claim ends now, if it is held.
    pub fn lease_end(&self, owner: u64) -> Option<u64> {
        self.held.get(&owner).map(|h| h.hold.lease_end_ms)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The renewals to carry out now: each claim whose lease ends within its margin, with every
    /// other claim of the same shard and lease that would be due within another margin (so that
    /// a worker's long-running claims are renewed together, in one write per batch). Claims
    /// whose record has expired are let go.
    pub fn due(&mut self, now_ms: u64) -> Vec<Renew> {
        if self.held.is_empty() {
            return Vec::new();
        }
        self.held.retain(|_, h| now_ms < h.hold.expires_at_ms);
        let renewable = |h: &Held, margin: u64| {
            h.renewing == 0
                && now_ms >= h.not_before_ms
                && h.hold.lease_end_ms < h.hold.expires_at_ms
                && now_ms.saturating_add(margin) >= h.hold.lease_end_ms
        };
        // The leases with a claim due now; every claim of one of them that would be due within
        // another margin joins it, all of its parts (a moving claim's two homes) at once.
        let mut leases: Vec<u64> = Vec::new();
        for h in self.held.values() {
            if renewable(h, margin_ms(h.hold.lease_ms)) && !leases.contains(&h.hold.lease_ms) {
                leases.push(h.hold.lease_ms);
            }
        }
        let mut parts: Vec<(u8, u64, Renewal)> = Vec::new();
        for h in self.held.values_mut() {
            if !leases.contains(&h.hold.lease_ms) || !renewable(h, 2 * margin_ms(h.hold.lease_ms)) {
                continue;
            }
            for r in h.hold.claim.renewals() {
                parts.push((r.shard, h.hold.lease_ms, r));
                h.renewing = h.renewing.saturating_add(1);
            }
        }
        // One batch per shard and lease (a transaction at most `MAX_RENEWALS` long).
        // A handful of groups: a store's shards (32 at most) by the rules' lease lengths.
        let mut groups: Vec<(u8, u64)> = Vec::new();
        for (shard, lease, _) in &parts {
            if !groups.contains(&(*shard, *lease)) {
                groups.push((*shard, *lease));
            }
        }
        let mut batches: Vec<Renew> = Vec::new();
        for (shard, lease_ms) in groups {
            let claims: Vec<Renewal> =
                parts.iter().filter(|(s, l, _)| (*s, *l) == (shard, lease_ms)).map(|(_, _, r)| *r).collect();
            for chunk in claims.chunks(MAX_RENEWALS) {
                batches.push(Renew { claims: chunk.to_vec(), lease_ms, now_ms });
            }
        }
        batches
    }

    /// A renewal's answer: per claim, kept (its lease now ends `lease_ms` after the renewal was
    /// asked, never past its expiry) or lost (let go); or the store failed it (asked again
    /// after a pause, while the lease still runs: a store that fails its renewals is a store
    /// that fails its takeovers too).
    pub fn answered(&mut self, renew: &Renew, kept: Result<&[Kept], ()>) -> Renewed {
        let mut out = Renewed::default();
        for (i, r) in renew.claims.iter().enumerate() {
            let Some(h) = self.held.get_mut(&r.owner) else { continue };
            h.renewing = h.renewing.saturating_sub(1);
            match kept.map(|k| k.get(i).copied()) {
                Ok(Some(Kept::Renewed)) => {
                    let until = renew.now_ms.saturating_add(renew.lease_ms).min(h.hold.expires_at_ms);
                    h.hold.lease_end_ms = h.hold.lease_end_ms.max(until);
                    out.kept += 1;
                }
                Ok(Some(Kept::TakenOver)) => {
                    out.lost.push(r.scope);
                    self.held.remove(&r.owner);
                }
                Ok(Some(Kept::Settled) | None) => {
                    self.held.remove(&r.owner);
                }
                Err(()) => h.not_before_ms = renew.now_ms.saturating_add(RETRY_AFTER_FAILURE_MS),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
