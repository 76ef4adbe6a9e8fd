//! (`testing`) A `RecordStore` over etcd that drives `Exchange`s with a blocking std::net
//! HTTP/1.1 client: the conformance suite runs against a real etcd through the same exchanges the
//! filter performs as callouts.

use std::net::SocketAddr;

use crate::store::etcd::{EtcdSettings, EtcdStore};
use crate::store::{Begin, Claim, ClaimAttempt, Completion, RecordStore, Settled, StoreError};

pub struct BlockingEtcd {
    pub addr: SocketAddr,
    store: EtcdStore,
}

impl BlockingEtcd {
    pub fn new(addr: SocketAddr, settings: EtcdSettings) -> BlockingEtcd {
        BlockingEtcd { addr, store: EtcdStore::new(settings) }
    }

    pub fn store(&self) -> &EtcdStore {
        &self.store
    }
}

impl RecordStore for BlockingEtcd {
    fn begin(&self, _attempt: &ClaimAttempt) -> Result<Begin, StoreError> {
        Err(StoreError::Unavailable("not yet".into()))
    }
    fn complete(&self, _claim: &Claim, _completion: &Completion) -> Result<Settled, StoreError> {
        Err(StoreError::Unavailable("not yet".into()))
    }
    fn release(&self, _claim: &Claim) -> Result<Settled, StoreError> {
        Err(StoreError::Unavailable("not yet".into()))
    }
    /// Leases collect expired records; nothing to sweep.
    fn sweep(&self, _now_ms: u64) -> Result<u32, StoreError> {
        Ok(0)
    }
}
