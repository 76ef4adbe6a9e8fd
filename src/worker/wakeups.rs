//! A worker's wake-ups: its own queue (through which a completion on any worker wakes its
//! waiters, and its streams wake its root), the registry of every worker's queue in shared
//! data, and the peers it read there. One service of `PluginState`.

use super::calls::SETTLE_NOW;
use crate::host::Host;
use crate::identity::scope::ScopeId;
use crate::worker::wait::wake::{self, Registry};
use std::cell::{Cell, RefCell};

pub struct Wakeups<H: Host> {
    host: H,
    registry: Registry<H>,
    queue_name: String,
    /// This worker's queue; none when Envoy refused to register it (waiters then rely on
    /// rechecks, the root on its ticks).
    pub queue_id: Option<u32>,
    /// Live wake queues of all workers (refreshed by the heartbeat), with resolved ids.
    peers: RefCell<Vec<(String, Option<u32>)>>,
    /// This root's queue is in the registry (a heartbeat succeeded).
    advertised: Cell<bool>,
}

impl<H: Host> Wakeups<H> {
    /// Prepares the registry's key and registers this worker's queue, named from `seed`.
    pub fn open(host: H, seed: u64) -> Result<Wakeups<H>, String> {
        let registry = Registry::new(host.clone());
        registry.create_key().map_err(|e| format!("cannot prepare wait-mode wake-ups: {e}"))?;
        let queue_name = wake::queue_name(seed);
        let queue_id = match host.register_queue(&queue_name) {
            Ok(id) => Some(id),
            Err(e) => {
                log::warn!("no wake-up queue (host status {}); waiters on this worker rely on rechecks", e.0);
                None
            }
        };
        Ok(Wakeups {
            host,
            registry,
            queue_name,
            queue_id,
            peers: RefCell::new(Vec::new()),
            advertised: Cell::new(false),
        })
    }

    /// Wakes this worker's root through its own queue (`why` says what waits for it in the
    /// debug line when it cannot): it then runs what it was handed at once, not at its next
    /// tick.
    pub fn wake_root(&self, why: &str) {
        if let Some(queue) = self.queue_id {
            if let Err(e) = self.host.enqueue(queue, SETTLE_NOW) {
                log::debug!("cannot wake the root (host status {}); {why} at its next tick", e.0);
            }
        }
    }

    /// Tells every worker that this record's outcome may be known, so that its waiters look.
    pub fn broadcast(&self, scope: &ScopeId) {
        // Read the registry now rather than trust the list cached at the last heartbeat: a
        // worker that started since would otherwise miss this wake-up (and wait for a recheck).
        if let Ok(names) = self.registry.live(self.host.now_ms()) {
            self.set_peers(names);
        }
        let mut peers = self.peers.borrow_mut();
        for (name, id) in peers.iter_mut() {
            if id.is_none() {
                *id = self.host.resolve_queue(name).ok().flatten();
            }
            if let Some(queue) = *id {
                if let Err(e) = self.host.enqueue(queue, &scope.0) {
                    log::debug!(
                        "wake-up to {name} failed (host status {}); its waiters recheck on their own",
                        e.0
                    );
                }
            }
        }
    }

    /// Puts this worker's queue in the registry before its first waiter parks (ticks do it
    /// within 100 ms of start, but a request may come first). Returns true when it had to: a
    /// completion that happened meanwhile could not have reached this queue, so the caller
    /// rechecks at once instead of trusting a wake-up.
    pub fn ensure_advertised(&self, now_ms: u64) -> bool {
        if self.advertised.get() || self.queue_id.is_none() {
            return false;
        }
        self.heartbeat(now_ms);
        true
    }

    /// Beats in the wake registry (only roots that tick beat, so the short-lived canary VM's
    /// queue is never advertised).
    pub fn heartbeat(&self, now_ms: u64) {
        if self.queue_id.is_none() {
            return;
        }
        match self.registry.heartbeat(&self.queue_name, now_ms) {
            Ok(names) => {
                self.advertised.set(true);
                self.set_peers(names);
            }
            Err(e) => log::warn!("wake registry heartbeat failed: {e}"),
        }
    }

    /// Stops advertising a queue nobody will read.
    pub fn withdraw(&self) {
        let _ = self.registry.remove(&self.queue_name, self.host.now_ms());
    }

    /// Replaces the peer list, keeping the queue ids already resolved.
    fn set_peers(&self, names: Vec<String>) {
        let mut peers = self.peers.borrow_mut();
        let known = std::mem::take(&mut *peers);
        *peers = names
            .into_iter()
            .map(|n| {
                let id = known.iter().find(|(k, _)| *k == n).and_then(|(_, id)| *id);
                (n, id)
            })
            .collect();
    }
}
