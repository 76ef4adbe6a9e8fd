//! Root context: configuration, the store, metrics, and the periodic sweep. One per plugin per
//! thread (main and each worker); all state is held here, never in statics, because after a
//! config update the old and new root contexts share one VM.

use super::host::{self, HostSharedData};
use super::http::Http;
use crate::config::{self, Config, StoreConfig};
use crate::identity::scope::ScopeId;
use crate::metrics::Counter;
use crate::store::local::LocalStore;
use crate::store::RecordStore;
use crate::wait::wake::{self, Registry};
use crate::wait::{self, Recheck, WaitRoom, Waiter};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::{Cell, RefCell};
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;

/// Tick period: waiters' give-up and recheck times are honoured to this resolution.
const TICK_MS: u32 = 100;
/// Sweep and wake-registry heartbeat every this many ticks (1 s).
const SLOW_EVERY_TICKS: u64 = 10;
/// Wake-up messages handled per `on_queue_ready`, so one callback stays short.
const MAX_MESSAGES_PER_READY: usize = 4096;

/// How a held (waiting) request was resolved by its root; read (once) by its HTTP context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resumed {
    Forwarded { claim: crate::store::Claim, rule: Rc<crate::config::Rule> },
    Answered { replay_shape: Option<crate::engine::ReplayShape> },
}

pub type WaitHandle = Rc<Cell<Option<Resumed>>>;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Counter ids, defined once per root context (define_metric hands out a new id per call).
pub struct Metrics {
    outcomes: Vec<Option<u32>>,
    swept: Option<u32>,
}

impl Metrics {
    fn define() -> Metrics {
        let define = |name: String| match host::define_counter(&name) {
            Ok(id) => Some(id),
            Err(e) => {
                log::warn!("cannot define metric {name}: host status {}", e.0);
                None
            }
        };
        Metrics {
            outcomes: Counter::ALL
                .iter()
                .map(|o| define(format!("idempotency.requests.{}", o.name())))
                .collect(),
            swept: define("idempotency.records.swept".to_string()),
        }
    }

    pub fn count(&self, counter: Counter) {
        let index = Counter::ALL.iter().position(|o| *o == counter);
        if let Some(Some(id)) = index.and_then(|i| self.outcomes.get(i)) {
            host::increment(*id, 1);
        }
    }

    fn count_swept(&self, n: u32) {
        if let Some(id) = self.swept {
            host::increment(id, i64::from(n));
        }
    }
}

/// What every HTTP context of this plugin shares.
pub struct PluginState {
    pub config: Config,
    pub store: LocalStore<HostSharedData>,
    pub metrics: Metrics,
    tokens: Cell<u64>,
    seed: u64,
    pub room: RefCell<WaitRoom<WaitHandle>>,
    registry: Registry<HostSharedData>,
    queue_name: String,
    queue_id: Option<u32>,
    /// Live wake queues of all workers (refreshed by the heartbeat), with resolved ids.
    peers: RefCell<Vec<(String, Option<u32>)>>,
    /// This root's queue is in the registry (a heartbeat succeeded).
    advertised: Cell<bool>,
}

impl PluginState {
    /// Tells every worker that this record's outcome may be known, so that its waiters look.
    pub fn broadcast(&self, scope: &ScopeId) {
        // Read the registry now rather than trust the list cached at the last heartbeat: a
        // worker that started since would otherwise miss this wake-up (and wait for a recheck).
        let now_ms = host::now_nanos().map(|n| n / 1_000_000).unwrap_or(0);
        if let Ok(names) = self.registry.live(now_ms) {
            self.set_peers(names);
        }
        let mut peers = self.peers.borrow_mut();
        for (name, id) in peers.iter_mut() {
            if id.is_none() {
                *id = host::resolve_queue(name).ok().flatten();
            }
            if let Some(queue) = *id {
                if let Err(e) = host::enqueue(queue, &scope.0) {
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
        if let Ok(names) = self.registry.heartbeat(&self.queue_name, now_ms) {
            self.advertised.set(true);
            self.set_peers(names);
        }
        true
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

    /// Looks at a waiter's record again and answers, forwards or re-parks it.
    pub fn recheck(&self, w: Waiter<WaitHandle>) {
        if host::set_effective_context(w.context_id).is_err() {
            return; // its client went away; nothing is held for it
        }
        let now_nanos = host::now_nanos().unwrap_or(0);
        let owner = self.owner_token(w.context_id, now_nanos);
        match wait::recheck(&self.config, &w, &self.store, now_nanos / 1_000_000, owner) {
            Recheck::KeepWaiting { recheck_at_ms } => {
                self.room.borrow_mut().repark(Waiter { recheck_at_ms, ..w });
            }
            Recheck::Forward { claim, counter } => {
                self.metrics.count(counter);
                w.handle.set(Some(Resumed::Forwarded { claim, rule: Rc::clone(&w.pending.rule) }));
                if let Err(e) = host::resume_request() {
                    log::warn!(
                        "#{} could not resume a held request (host status {}); releasing its claim",
                        w.context_id,
                        e.0
                    );
                    let _ = self.store.release(&claim);
                }
            }
            Recheck::Respond { reply, counter } => {
                self.metrics.count(counter);
                w.handle.set(Some(Resumed::Answered { replay_shape: reply.replay_shape.clone() }));
                let details =
                    if counter == Counter::Replayed { "idempotency_replay" } else { "idempotency_problem" };
                if let Err(e) = host::send_response(reply.status, details, &reply.headers, &reply.body) {
                    log::warn!("#{} could not answer a held request (host status {})", w.context_id, e.0);
                }
            }
        }
    }

    /// True the first time any worker of this Envoy asks for this rule: the retry warning is
    /// logged once per rule, not once per request. The key space is the configured rule names.
    pub fn first_retry_warning(&self, rule_name: &str) -> bool {
        use crate::store::shared_data::SharedData;
        let data_key = format!("idem:warned:retry:{rule_name}");
        match HostSharedData.get(&data_key) {
            Ok(read) if read.exists() => false,
            // Creation is racy, so two workers may both log once: still bounded.
            Ok(_) => HostSharedData.set(&data_key, b"1", None).is_ok(),
            Err(_) => false,
        }
    }

    /// A claim owner token: unique per claim across workers and VMs with overwhelming
    /// probability (a random per-root seed, the time, the context and a counter), never 0.
    pub fn owner_token(&self, context_id: u32, now_nanos: u64) -> u64 {
        let n = self.tokens.get().wrapping_add(1);
        self.tokens.set(n);
        // Unique per root by the counter, across roots by the random seed; the time and context
        // only spread the values. A cheap bijective mix, not a hash: tokens need uniqueness,
        // not secrecy (they never leave shared data).
        let mixed =
            splitmix64(self.seed ^ splitmix64(n ^ (u64::from(context_id) << 40) ^ now_nanos.rotate_left(17)));
        mixed.max(1)
    }
}

pub struct Root {
    context_id: u32,
    plugin: Option<Rc<PluginState>>,
    ticks: u64,
}

impl Root {
    pub fn new(context_id: u32) -> Root {
        Root { context_id, plugin: None, ticks: 0 }
    }

    /// Once a second: reclaim expired records, and beat in the wake registry (only roots that
    /// tick beat, so the short-lived canary VM's queue is never advertised).
    fn slow_tick(plugin: &PluginState, now_ms: u64) {
        match plugin.store.sweep(now_ms) {
            Ok(0) => {}
            Ok(n) => {
                plugin.metrics.count_swept(n);
                log::debug!("swept {n} expired record(s)");
            }
            Err(e) => log::warn!("sweep failed: {e}"),
        }
        if plugin.queue_id.is_some() {
            match plugin.registry.heartbeat(&plugin.queue_name, now_ms) {
                Ok(names) => {
                    plugin.advertised.set(true);
                    plugin.set_peers(names);
                }
                Err(e) => log::warn!("wake registry heartbeat failed: {e}"),
            }
        }
    }

    fn configure(&mut self) -> Result<Rc<PluginState>, String> {
        let bytes = host::buffer(host::BUFFER_PLUGIN_CONFIGURATION, 0, usize::MAX)
            .map_err(|e| format!("cannot read the plugin configuration: host status {}", e.0))?;
        let config = config::parse(&bytes).map_err(|e| e.to_string())?;
        let StoreConfig::Local { capacity } = config.store;
        // The store's placement secret; each RandomState is seeded from the WASI random source.
        let fresh_secret: [u8; 32] = std::array::from_fn(|i| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_usize(i / 8);
            h.finish().to_be_bytes()[i % 8]
        });
        let now_ms = host::now_nanos().unwrap_or(0) / 1_000_000;
        let store = LocalStore::open(HostSharedData, capacity, fresh_secret, now_ms)
            .map_err(|e| format!("cannot prepare the local store: {e}"))?;
        let created = store.keys_created();
        log::info!(
            "configured {} route rule(s); local store: {} records in {} buckets ({} keys created)",
            config.rules.len(),
            store.capacity(),
            store.buckets(),
            created
        );
        let seed = {
            // RandomState draws from the host's WASI random source.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(self.context_id);
            h.write_u64(host::now_nanos().unwrap_or(0));
            h.finish()
        };
        let registry = Registry::new(HostSharedData);
        registry.create_key().map_err(|e| format!("cannot prepare wait-mode wake-ups: {e}"))?;
        let queue_name = wake::queue_name(seed);
        let queue_id = match host::register_queue(&queue_name) {
            Ok(id) => Some(id),
            Err(e) => {
                log::warn!("no wake-up queue (host status {}); waiters on this worker rely on rechecks", e.0);
                None
            }
        };
        let room = RefCell::new(WaitRoom::new(config.max_waiters_per_key, config.max_waiters));
        Ok(Rc::new(PluginState {
            config,
            store,
            metrics: Metrics::define(),
            tokens: Cell::new(0),
            seed,
            room,
            registry,
            queue_name,
            queue_id,
            peers: RefCell::new(Vec::new()),
            advertised: Cell::new(false),
        }))
    }
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        if let Some(plugin) = &self.plugin {
            // Stop advertising a queue nobody will read.
            let now_ms = host::now_nanos().map(|n| n / 1_000_000).unwrap_or(0);
            let _ = plugin.registry.remove(&plugin.queue_name, now_ms);
        }
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        super::follow_host_log_level();
        match self.configure() {
            Ok(plugin) => {
                self.plugin = Some(plugin);
                if let Err(e) = host::set_tick_period_ms(TICK_MS) {
                    log::warn!(
                        "no sweep timer (host status {}); expired records are reclaimed on reuse only",
                        e.0
                    );
                }
                true
            }
            Err(message) => {
                // One line naming the field; returning false makes Envoy refuse the config.
                host::log(host::LOG_CRITICAL, &message);
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(plugin) = self.plugin.clone() else { return };
        let Ok(now) = host::now_nanos() else { return };
        let now_ms = now / 1_000_000;
        if self.ticks.is_multiple_of(SLOW_EVERY_TICKS) {
            Self::slow_tick(&plugin, now_ms);
        }
        self.ticks = self.ticks.wrapping_add(1);
        let due = plugin.room.borrow_mut().due(now_ms);
        for w in due {
            plugin.recheck(w);
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(plugin) = self.plugin.clone() else { return };
        for _ in 0..MAX_MESSAGES_PER_READY {
            let message = match host::dequeue(queue_id) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    log::warn!("wake queue read failed (host status {})", e.0);
                    break;
                }
            };
            let Ok(scope) = <[u8; 32]>::try_from(message.as_slice()) else { continue };
            let woken = plugin.room.borrow_mut().wake(&ScopeId(scope));
            for w in woken {
                plugin.recheck(w);
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(context_id, self.plugin.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
