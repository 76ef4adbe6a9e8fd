//! Where an etcd conversation is and what it does next: the vocabulary its parts share (the
//! conversation itself, and its lease, quota and records steps in their own files), apart
//! from all of them so that none of those files imports another back.

use super::wire;
use crate::store::{Begin, RecordPage, Refusal, Settled};

/// Transactions lost to other writers before a begin or a renewal gives up (`Contention`).
pub(super) const TXN_ATTEMPTS: u8 = 3;

/// Where a conversation is: which answer it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Start,
    /// begin: a new claim over its quota, being deleted (guarded by the claim's revision).
    Undo,
    /// begin without the leases a claim needs: the record and its lease key if it exists
    /// (nothing if it is absent), read before granting them.
    Probe,
    /// begin of an existing record that will be claimed (takeover, reuse) with a quota: the
    /// quota indexes, read while the record is unchanged.
    QuotaRead,
    /// complete/release: the record, to check ownership and find its index keys.
    SettleRead,
    LeaseGrant,
    /// The guarded write.
    Write,
    /// records: a page of records; then the labels of those that passed the state filter.
    Scan,
    Labels,
    /// renew: the claim lease the lease keys go on, then the transaction that puts them.
    RenewLease,
    Renew,
    /// An operator's resolve: the record's tombstone, read before the write that rewrites it.
    TombstoneRead,
    Finished,
}

/// What the conversation does next, inside `step`.
pub(super) enum Move {
    Call(wire::Call, Stage),
    Begun(Begin),
    Settled(Settled),
    /// Per claim of a renewal: kept, or why not.
    Renewed(Vec<crate::store::Kept>),
    Records(RecordPage),
    Amended(Result<(), Refusal>),
}
