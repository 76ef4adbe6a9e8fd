//! The etcd store behind the one storage interface (`store::seam`): each store operation is an
//! `EtcdConversation`, which already speaks the remote-store vocabulary (`store::remote`); this only
//! keeps the store the conversations share and the settings the worker needs to make their calls.

use super::watch::RecordWatch;
use super::{EtcdConversation, EtcdStore};
use crate::config::etcd::Protocol;
use crate::identity::scope::ScopeId;
use crate::store::remote::{Answer, Conversation, Next, RemoteSettings};
use crate::store::seam::{Started, Store, Watch};
use crate::store::{Claim, StoreOp};
use std::rc::Rc;

pub struct EtcdRemote {
    store: Rc<EtcdStore>,
    settings: RemoteSettings,
    /// Over gRPC: a watch on the records this worker's waiters wait on.
    watch: Option<RecordWatch>,
}

impl EtcdRemote {
    pub fn new(store: EtcdStore) -> EtcdRemote {
        let s = store.settings();
        let settings = RemoteSettings {
            cluster: s.cluster.clone(),
            authority: s.authority.clone(),
            // Envoy reads 0 as "no timeout": a call is always bounded.
            timeout_ms: u32::try_from(s.timeout_ms).unwrap_or(u32::MAX).max(1),
            on_error: s.on_error,
            protocol: s.protocol,
        };
        let store = Rc::new(store);
        let watch = match settings.protocol {
            Protocol::Grpc => Some(RecordWatch::new(Rc::clone(&store), &settings.authority)),
            Protocol::Json => None,
        };
        EtcdRemote { store, settings, watch }
    }
}

impl Store for EtcdRemote {
    /// The first step is taken at once: a replay from the cache needs no call.
    fn start(&self, op: StoreOp, now: &dyn Fn() -> u64) -> Started {
        let bound = Bound { store: Rc::clone(&self.store), conversation: self.store.start(op) };
        Started::first_step(Box::new(bound), now())
    }
    fn remote_for(&self, shard: u8) -> Option<&RemoteSettings> {
        (shard == 0).then_some(&self.settings)
    }
    fn held_past_lease_ms(&self, lease_ms: u64) -> u64 {
        super::leases::held_past_lease_ms(lease_ms)
    }
    fn take_woken(&self) -> bool {
        self.store.take_fetch_ended()
    }
    fn watch(&self, _scope: &ScopeId) -> Option<&dyn Watch> {
        self.watch.as_ref().map(|w| w as &dyn Watch)
    }
    fn watches(&self) -> Vec<&dyn Watch> {
        self.watch.iter().map(|w| w as &dyn Watch).collect()
    }
}

/// An etcd conversation with the store it talks to, as the seam's `Conversation`.
struct Bound {
    store: Rc<EtcdStore>,
    conversation: EtcdConversation,
}

impl Conversation for Bound {
    fn step(&mut self, answer: Option<Answer>, now_ms: u64) -> Next {
        self.conversation.step(&self.store, answer, now_ms)
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.conversation.into_op()
    }
    fn unanswered_claim(&self) -> Option<Claim> {
        self.conversation.unanswered_claim()
    }
}
