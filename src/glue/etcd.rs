//! The etcd store (`store::etcd`) as the glue's `RemoteStore`: its exchanges are the
//! conversations, its calls the callouts. Nothing is decided here.

use super::remote::{Answer, Conversation, Next, RemoteSettings, RemoteStore, Request};
use crate::store::etcd::{EtcdStore, Exchange, ExchangeStep, HttpAnswer};
use crate::store::StoreOp;
use std::rc::Rc;

/// What the callouts to etcd name as `:authority`.
pub const ETCD_AUTHORITY: &str = "etcd";

pub struct EtcdRemote {
    store: Rc<EtcdStore>,
    settings: RemoteSettings,
}

impl EtcdRemote {
    pub fn new(store: EtcdStore) -> EtcdRemote {
        let s = store.settings();
        let settings = RemoteSettings {
            cluster: s.cluster.clone(),
            // etcd's gateway reads no host, but Go's HTTP server refuses an invalid one.
            authority: ETCD_AUTHORITY.to_string(),
            // Envoy reads 0 as "no timeout": a callout is always bounded.
            timeout_ms: u32::try_from(s.timeout_ms).unwrap_or(u32::MAX).max(1),
            on_error: s.on_error,
        };
        EtcdRemote { store: Rc::new(store), settings }
    }
}

impl RemoteStore for EtcdRemote {
    fn settings(&self) -> &RemoteSettings {
        &self.settings
    }
    fn start(&self, op: StoreOp) -> Box<dyn Conversation> {
        Box::new(EtcdConversation { store: Rc::clone(&self.store), exchange: self.store.start(op) })
    }
    fn take_woken(&self) -> bool {
        self.store.take_fetch_ended()
    }
}

struct EtcdConversation {
    store: Rc<EtcdStore>,
    exchange: Exchange,
}

impl Conversation for EtcdConversation {
    fn step(&mut self, answer: Option<Answer>, now_ms: u64) -> Next {
        let answer = answer.map(|a| HttpAnswer { status: a.status, body: a.body });
        match self.exchange.step(&self.store, answer, now_ms) {
            ExchangeStep::Call { path, body, token, timeout_ms } => Next::Call(Request {
                path,
                body,
                token,
                // Envoy reads 0 as "no timeout": a callout is always bounded.
                timeout_ms: Some(u32::try_from(timeout_ms).unwrap_or(u32::MAX).max(1)),
            }),
            ExchangeStep::AwaitToken => Next::Wait,
            ExchangeStep::Done(answer) => Next::Done(answer),
        }
    }
    fn into_op(self: Box<Self>) -> StoreOp {
        self.exchange.into_op()
    }
}
