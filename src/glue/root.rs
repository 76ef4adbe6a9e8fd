//! Root context: configuration, the store, metrics, and the periodic sweep. One per plugin per
//! thread (main and each worker); all state is held here, never in statics, because after a
//! config update the old and new root contexts share one VM.

use super::host::{self, HostSharedData};
use super::http::Http;
use crate::config::{self, Config, StoreConfig};
use crate::engine::Outcome;
use crate::local_store::LocalStore;
use crate::store::RecordStore;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use sha2::{Digest, Sha256};
use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;

const SWEEP_PERIOD_MS: u32 = 1000;

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
            outcomes: Outcome::ALL.iter().map(|o| define(format!("idempotency.requests.{}", o.name()))).collect(),
            swept: define("idempotency.records.swept".to_string()),
        }
    }

    pub fn count(&self, outcome: Outcome) {
        let index = Outcome::ALL.iter().position(|o| *o == outcome);
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
pub struct Shared {
    pub config: Config,
    pub store: LocalStore<HostSharedData>,
    pub metrics: Metrics,
    tokens: Cell<u64>,
    seed: u64,
}

impl Shared {
    /// A claim owner token: unique per claim across workers and VMs with overwhelming
    /// probability (a random per-root seed, the time, the context and a counter), never 0.
    pub fn owner_token(&self, context_id: u32, now_nanos: u64) -> u64 {
        let n = self.tokens.get().wrapping_add(1);
        self.tokens.set(n);
        let mut h = Sha256::new();
        h.update(self.seed.to_le_bytes());
        h.update(now_nanos.to_le_bytes());
        h.update(context_id.to_le_bytes());
        h.update(n.to_le_bytes());
        let digest = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(b).max(1)
    }
}

pub struct Root {
    context_id: u32,
    shared: Option<Rc<Shared>>,
}

impl Root {
    pub fn new(context_id: u32) -> Root {
        Root { context_id, shared: None }
    }

    fn configure(&mut self) -> Result<Rc<Shared>, String> {
        let bytes = host::buffer(host::BUFFER_PLUGIN_CONFIGURATION, 0, usize::MAX)
            .map_err(|e| format!("cannot read the plugin configuration: host status {}", e.0))?;
        let config = config::parse(&bytes).map_err(|e| e.to_string())?;
        let StoreConfig::Local { capacity } = config.store;
        let store = LocalStore::new(HostSharedData, capacity);
        let created = store.create_keys().map_err(|e| format!("cannot prepare the local store: {e}"))?;
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
        Ok(Rc::new(Shared { config, store, metrics: Metrics::define(), tokens: Cell::new(0), seed }))
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        super::follow_host_log_level();
        match self.configure() {
            Ok(shared) => {
                self.shared = Some(shared);
                if let Err(e) = host::set_tick_period_ms(SWEEP_PERIOD_MS) {
                    log::warn!("no sweep timer (host status {}); expired records are reclaimed on reuse only", e.0);
                }
                true
            }
            Err(message) => {
                // One line naming the field; returning false makes Envoy refuse the config.
                host::log(host::LOG_CRITICAL, &format!("{message}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(shared) = &self.shared else { return };
        let Ok(now) = host::now_nanos() else { return };
        match shared.store.sweep(now / 1_000_000) {
            Ok(0) => {}
            Ok(n) => {
                shared.metrics.count_swept(n);
                log::debug!("swept {n} expired record(s)");
            }
            Err(e) => log::warn!("sweep failed: {e}"),
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(context_id, self.shared.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
