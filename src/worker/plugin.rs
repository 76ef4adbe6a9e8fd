//! What one root context and all its HTTP contexts share: the configuration, the store, the
//! metric ids, the wait room and this worker's wake-up queue. Held by the root, never in
//! statics, because after a config update the old and new root contexts share one VM.

use super::calls::{DueLookup, RootAdmin, RootBegin, RootCall, RootCalls, RootSettlement};
use super::flows::{Flows, RootHold};
use super::meter::Meter;
use super::wakeups::Wakeups;
use crate::config::{self, Config, Execution, Rule};
use crate::host::{Host, HostError, BUFFER_PLUGIN_CONFIGURATION};
use crate::identity::scope::ScopeId;
use crate::metrics::Counter;
use crate::renewal::Renewals;
use crate::splitmix::splitmix64;
use crate::store::factory::{remote_described, Opened};
use crate::store::remote::Conversation;
use crate::store::seam::{Started, Store, Watch};
use crate::store::{self, Claim, StoreAnswer, StoreOp};
use crate::worker::flow::{Event, Output, ParkPlan, Settlement};
use crate::worker::reconcile::LookupGate;
use crate::worker::wait::{self, NotHeld, WaitRoom, Waiter};
use std::cell::{Cell, RefCell};
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;

/// A random value from the host's WASI random source (each RandomState is seeded from it).
/// A flow the root holds is always in the table (its hold keeps it), and the table is never
/// busy between two of its calls: this is said, never a panic, if either ever is not so.
#[cold]
fn lost_event(context_id: u32) {
    log::warn!("#{context_id} the flow the root held was not found; an event was dropped");
}

fn random_u64(mix: u64) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(mix);
    h.finish()
}

/// The most callouts one try of a store operation makes (authenticate, read, lease grant,
/// write).
const RETIREMENT_CALLS_PER_TRY: u64 = 4;

pub struct PluginState<H: Host> {
    pub host: H,
    pub config: Config,
    /// Where the records live: this Envoy's shared data, or a store the whole fleet shares.
    pub store: Box<dyn Store>,
    pub calls: RefCell<RootCalls>,
    /// Every request's flow on this worker, keyed by its stream's context id.
    pub flows: Rc<Flows>,
    /// What the flows the root holds said of what its work brought them, for the executor to
    /// carry out at the end of the root's callback (`carry::drain`).
    inbox: RefCell<Vec<(RootHold, Output)>>,
    /// Counters, published outcomes, and the warnings logged once per period or per worker.
    pub meter: Meter<H>,
    tokens: Cell<u64>,
    seed: u64,
    pub room: RefCell<WaitRoom<RootHold>>,
    /// This worker's queue, the registry of every worker's, and the peers read there.
    pub wakeups: Wakeups<H>,
    /// Detached calls this worker carries (handed over, made, not yet answered).
    pub detached_in_flight: Cell<u32>,
    /// This Envoy's lookups (`routes[].reconcile`): one at a time and one a second per record.
    pub lookups: LookupGate<H>,
    /// Records this worker looks up itself when their leases end.
    pub lease_end_lookups: RefCell<Vec<DueLookup>>,
    /// The claims this worker's owners hold, renewed by the root while they are at work.
    pub renewals: RefCell<Renewals>,
    /// Per rule, its unsettled records gauges (outcome unknown, processing), and when this
    /// root looks at the registry again (`unsettled`).
    pub unsettled_gauges: Vec<(u32, u32)>,
    pub next_recheck_ms: Cell<u64>,
}

impl<H: Host> PluginState<H> {
    /// Reads and checks the configuration and prepares everything traffic needs; the error is
    /// the one line that tells the operator why Envoy refused the configuration.
    /// `remote`: a store across the network given by the caller (the native tests script one);
    /// otherwise the configuration's: etcd with `store.type: "etcd"`, else the local store.
    pub fn configure_with(
        host: H,
        context_id: u32,
        remote: Option<Box<dyn Store>>,
    ) -> Result<PluginState<H>, String> {
        let bytes = host
            .buffer(BUFFER_PLUGIN_CONFIGURATION, 0, usize::MAX)
            .map_err(|e| format!("cannot read the plugin configuration: host status {}", e.0))?;
        let config = config::parse(&bytes).map_err(|e| e.to_string())?;
        // The store's placement secret.
        let fresh_secret: [u8; 32] = std::array::from_fn(|i| {
            random_u64((i / 8) as u64).to_be_bytes().get(i % 8).copied().unwrap_or(0)
        });
        let now_ms = host.now_ms();
        let Opened { store, described } = match remote {
            Some(store) => Opened { described: remote_described(store.as_ref()), store },
            None => {
                // An abandoned claim evicted for room would let its retry execute with no
                // record: the store keeps them unless every rule takes such claims over anyway.
                let lease_ends: Vec<_> =
                    config.rules.iter().map(|r| crate::engine::on_lease_end(r.unknown_outcome)).collect();
                let quota = config.quota.per_tenant.is_some() || config.quota.per_principal.is_some();
                store::open(&config.store, host.clone(), fresh_secret, now_ms, &lease_ends, quota)?
            }
        };
        log::info!("configured {} route rule(s); {described}", config.rules.len());
        for rule in &config.rules {
            let data_key = retry_warning_key(&rule.name);
            let exists =
                host.get(&data_key).map_err(|e| format!("cannot prepare {data_key}: {e:?}"))?.exists();
            if !exists {
                // Racy creation is harmless here: every creator writes the same empty value.
                host.set(&data_key, &[], None).map_err(|e| format!("cannot prepare {data_key}: {e:?}"))?;
            }
        }
        let lookups = LookupGate::new(host.clone());
        if config.rules.iter().any(|r| r.reconcile.is_some()) {
            lookups.create_keys().map_err(|e| format!("cannot prepare the lookup gate: {e:?}"))?;
        }
        let unsettled_gauges = super::unsettled::prepare(&host, &config.rules)?;
        let seed = random_u64(u64::from(context_id) ^ now_ms.rotate_left(32));
        let wakeups = Wakeups::open(host.clone(), seed)?;
        let room = RefCell::new(WaitRoom::new(config.max_waiters_per_key, config.max_waiters));
        Ok(PluginState {
            meter: Meter::new(
                host.clone(),
                &config.rules,
                config.admin.is_some(),
                store.as_ref(),
                config.publish_outcome,
                config.shadow,
            ),
            host,
            config,
            store,
            calls: RefCell::new(RootCalls::default()),
            flows: Rc::new(Flows::default()),
            inbox: RefCell::new(Vec::new()),
            tokens: Cell::new(0),
            seed,
            room,
            wakeups,
            detached_in_flight: Cell::new(0),
            lookups,
            lease_end_lookups: RefCell::new(Vec::new()),
            renewals: RefCell::new(Renewals::default()),
            unsettled_gauges,
            next_recheck_ms: Cell::new(0),
        })
    }

    /// Envoy refused a callout to `cluster` (made for `of`) with host status `status`. Returns
    /// what happened, for the request's own answer.
    ///
    /// BadArgument means Envoy does not know the cluster: its other reasons (a missing `:method`,
    /// `:path` or `:authority`, a timeout over 2^31 ms; Envoy's `Context::httpCall`) never apply
    /// to the filter's calls. Counted every time; said in one critical line naming the field and
    /// the cluster at the first such call for that pair on this worker (then at debug level).
    ///
    /// Why at the first call and not at start: Envoy 1.40 gives a filter no way to ask whether a
    /// cluster exists without calling it. `proxy_http_call` answers BadArgument for an unknown
    /// cluster and for missing headers alike (so a call made to fail cannot tell), and sends the
    /// request when both are right; `proxy_grpc_call` and `proxy_grpc_stream` answer
    /// ParseFailure for an unknown cluster but start the call for a known one; no property names
    /// a cluster but the routed stream's own (`xds.cluster_name`), and Envoy registers no foreign
    /// function that reads its cluster manager (only `declare_property`,
    /// `set_envoy_filter_state`, `verify_signature`, `clear_route_cache`). A cluster from CDS may
    /// also arrive after the filter's configuration, which a check at start would refuse.
    pub fn callout_refused(&self, of: CalloutOf, cluster: &str, status: u32) -> String {
        if status != BAD_ARGUMENT {
            log::warn!("Envoy refused a call to cluster {cluster:?} (host status {status})");
            return format!("Envoy refused the call to cluster {cluster:?} (host status {status})");
        }
        let (field, fails) = self.cluster_field(of, cluster);
        let first = self.meter.unknown_cluster(&field, cluster);
        if first {
            self.host.log_critical(&format!(
                "{field}: Envoy does not know the cluster {cluster:?}, so it refuses every call the filter \
                 makes to it and nothing is sent: {fails}. Add the cluster to Envoy's configuration or \
                 correct {field} (counter unknown_cluster_calls_total; logged once per worker)"
            ));
        }
        format!("Envoy does not know the cluster {cluster:?}")
    }

    /// The field that names the cluster of a call made for `of`, and what its refusal does to
    /// traffic.
    fn cluster_field(&self, of: CalloutOf, cluster: &str) -> (String, &'static str) {
        let (rule, named, field, fails) = match of {
            CalloutOf::Store => return (self.config.store_cluster_field(cluster), STORE_FAILS),
            CalloutOf::Detached(rule) => match &rule.execution {
                Execution::Detached { cluster, .. } => (rule, cluster.as_deref(), "cluster", DETACHED_FAILS),
                Execution::Inline => (rule, None, "cluster", DETACHED_FAILS),
            },
            CalloutOf::Lookup(rule) => {
                let named = rule.reconcile.as_ref().and_then(|r| r.cluster.as_deref());
                (rule, named, "reconcile.cluster", LOOKUP_FAILS)
            }
        };
        let at = self.config.rule_field(&rule.name);
        if named == Some(cluster) {
            (format!("{at}.{field}"), fails)
        } else {
            (format!("{at} (its route's cluster, xds.cluster_name)"), fails)
        }
    }

    /// Starts a store operation (the clock is read only if the store needs it).
    pub fn start(&self, op: StoreOp) -> Started {
        self.store.start(op, &|| self.host.now_ms())
    }

    /// Admits a request to the wait room as its flow planned (within the room's bounds), and
    /// asks a remote store to watch its record: the waiter to hold, once its flow has carried
    /// out its steps. A waiter on a remote store polls it (its original may run on another
    /// Envoy, whose wake-ups never come here): first after `POLL_FIRST_MS`, doubling; on the
    /// local store it relies on wake-ups and the 1 s fallback.
    pub fn admit(&self, context_id: u32, plan: &ParkPlan) -> Result<Waiter<RootHold>, NotHeld> {
        let just_advertised = self.wakeups.ensure_advertised(plan.now_ms);
        let remote = self.store.remote().is_some();
        let (recheck_at_ms, poll_ms) = match (remote, just_advertised) {
            (true, false) => (
                wait::poll_recheck(
                    plan.now_ms,
                    wait::POLL_FIRST_MS,
                    plan.lease_remaining_ms,
                    plan.give_up_at_ms,
                ),
                wait::POLL_FIRST_MS,
            ),
            (true, true) => (plan.recheck_at_ms(true), wait::POLL_FIRST_MS),
            (false, _) => (plan.recheck_at_ms(just_advertised), 0),
        };
        self.room.borrow().admits(&plan.scope)?;
        self.watch_record(&plan.scope, plan.now_ms);
        Ok(Waiter {
            context_id,
            scope: plan.scope,
            give_up_at_ms: plan.give_up_at_ms,
            recheck_at_ms,
            held: None,
            poll_ms,
            woken: false,
            watched: false,
        })
    }

    /// Asks the remote store to watch a record a waiter of this worker waits on (etcd over
    /// gRPC), opening the worker's watch stream first if there is none.
    pub fn watch_record(&self, scope: &ScopeId, now_ms: u64) {
        let Some(watch) = self.store.watch(scope) else { return };
        match watch.want(scope) {
            Some(create) => self.send_watch(watch, &[create], now_ms),
            None => self.open_watch(watch, now_ms),
        }
    }

    /// Opens the watch stream when one is due (something to watch, none open, past the
    /// backoff of the last one), and sends the watches it is to carry.
    pub fn open_watch(&self, watch: &dyn Watch, now_ms: u64) {
        if !watch.should_open(now_ms) {
            return;
        }
        let Some(metadata) = watch.metadata() else { return };
        let (service, service_name, method) = watch.target();
        match self.host.open_grpc_stream(service, service_name, method, &metadata) {
            Ok(token) => {
                log::debug!("watch stream {token} opened");
                let creates = watch.opened(token);
                self.send_watch(watch, &creates, now_ms);
            }
            Err(HostError(s)) => {
                log::debug!("watch stream refused (host status {s}); waiters poll");
                self.meter.count_watch_ended();
                watch.refused(now_ms);
            }
        }
    }

    /// Sends messages on the watch stream; a stream that refuses one is ended (its waiters
    /// poll until it is opened again).
    pub fn send_watch(&self, watch: &dyn Watch, messages: &[Vec<u8>], now_ms: u64) {
        let Some(token) = watch.token() else { return };
        for m in messages {
            if let Err(HostError(s)) = self.host.send_grpc_message(token, m) {
                log::debug!("watch stream {token} refused a message (host status {s}); closing it");
                let _ = self.host.cancel_grpc_stream(token);
                self.watch_ended(watch.closed(now_ms), now_ms);
                return;
            }
        }
    }

    /// The watch stream ended: changes of these records may go unseen, so their waiters poll
    /// at the usual pace again, the next time at most `RECHECK_EVERY_MS` from now (not at once:
    /// a stream usually ends because etcd is unreachable, and a poll into that fails the waiter
    /// by the store's fail mode). Counted in `store_watch_ended_total`.
    pub fn watch_ended(&self, scopes: Vec<ScopeId>, now_ms: u64) {
        self.meter.count_watch_ended();
        let mut room = self.room.borrow_mut();
        for scope in scopes {
            room.hasten(&scope, now_ms.saturating_add(wait::RECHECK_EVERY_MS));
        }
    }

    /// Hands a settlement to this worker's root, which outlives the stream (the answer to a
    /// callout goes to the context that dispatched it, and a response's end is exactly when
    /// streams end).
    pub fn settle_from_root(
        &self,
        conversation: Box<dyn Conversation>,
        settlement: Settlement,
        holds_response: bool,
    ) {
        self.to_root(RootCall::Settle(Box::new(RootSettlement {
            conversation,
            settlement,
            holds_response,
            retry: None,
            then_answer: None,
        })));
    }

    /// Hands an admin request's store operation to this worker's root.
    pub fn admin_from_root(
        &self,
        context_id: u32,
        conversation: Box<dyn Conversation>,
        ask: super::calls::AdminAsk,
    ) {
        self.to_root(RootCall::Admin(Box::new(RootAdmin { context_id, conversation, ask })));
    }

    /// Hands an admin request whose store paused a long scan to this worker's root, which asks
    /// again at its next tick (and ticks faster while it holds one: `Root::pace`); woken at once
    /// through its queue so that it does.
    pub fn admin_later(&self, context_id: u32, ask: super::calls::AdminAsk) {
        self.calls.borrow_mut().admin_later.push(super::calls::AdminLater { context_id, ask });
        self.wakeups.wake_root("it goes on");
    }

    /// Hands a flow the root holds what the root's work brought it (a callout's answer, a
    /// refusal, a lease-end lookup's time), and posts what the flow says: the executor carries
    /// it out at the end of the root's callback (`carry::drain`), never inside the work that
    /// brought it.
    pub fn post(&self, flow: RootHold, event: Event<'static>) {
        match flow.with(|f| f.handle(&self.config, event)) {
            Some(out) => self.inbox.borrow_mut().push((flow, out)),
            None => lost_event(flow.context_id()),
        }
    }

    /// What was posted since the executor last drained it, oldest first.
    pub fn take_posted(&self) -> Vec<(RootHold, Output)> {
        std::mem::take(&mut *self.inbox.borrow_mut())
    }

    /// Hands a paused request's `begin` (and the hold on its flow) to this worker's root.
    pub fn begin_from_root(&self, conversation: Box<dyn Conversation>, flow: RootHold) {
        self.to_root(RootCall::Begin(Box::new(RootBegin { conversation, flow })));
    }

    /// The cluster Envoy's route picked for the effective context's request.
    pub fn route_cluster(&self) -> Option<String> {
        match self.host.property(&["xds", "cluster_name"]) {
            Ok(Some(name)) if !name.is_empty() => Some(String::from_utf8_lossy(&name).into_owned()),
            _ => None,
        }
    }

    /// Gives back a claim nobody will use: at once where the store answers at once, else
    /// through the root; counted as released when done.
    pub fn release_claim(&self, context_id: u32, claim: Claim, rule: &Rc<Rule>) {
        match self.start(StoreOp::Release(claim)) {
            Started::Answered(answer) => {
                if let StoreAnswer::Settled(Ok(_)) = answer {
                    self.meter.count(Counter::Released, Some(rule));
                }
            }
            Started::Conversation(conversation) => {
                let settlement =
                    Settlement { context_id, claim, rule: Rc::clone(rule), done: Counter::Released };
                self.settle_from_root(conversation, settlement, false);
            }
        }
    }

    /// The root runs what it is handed from its own callback: at once through its queue, else
    /// at its next tick.
    pub(super) fn to_root(&self, call: RootCall) {
        self.calls.borrow_mut().queued.push(call);
        self.wakeups.wake_root("it settles");
    }

    /// How long a retired root waits for the store operations it carries (`Root::on_done`):
    /// a settlement is tried again for its rule's `processing_timeout` after its first
    /// failure, and one try is at most `RETIREMENT_CALLS_PER_TRY` callouts, each bounded by
    /// the store's timeout; twice that covers a try under way when the root was retired.
    pub fn retirement_bound_ms(&self) -> u64 {
        let lease_ms = self.config.rules.iter().map(|r| r.processing_timeout_ms).max().unwrap_or(0);
        let timeout_ms = self.store.remote().map_or(0, |r| u64::from(r.timeout_ms));
        lease_ms.saturating_add(timeout_ms.saturating_mul(2 * RETIREMENT_CALLS_PER_TRY))
    }

    /// True the first time any worker of this Envoy asks for this rule: the retry warning is
    /// logged once per rule, not once per request. The flag's data key was created empty when
    /// the plugin was configured, so marking it is a real compare-and-swap: exactly one worker
    /// wins, and no key is ever created on the request path.
    pub fn first_retry_warning(&self, rule_name: &str) -> bool {
        match self.host.get(&retry_warning_key(rule_name)) {
            Ok(read) if read.exists() && read.value.is_none() => {
                self.host.set(&retry_warning_key(rule_name), b"1", read.cas).is_ok()
            }
            _ => false,
        }
    }

    /// A claim owner token: unique per claim across workers and VMs with overwhelming
    /// probability (a random per-root seed, the context and a counter), never 0.
    pub fn owner_token(&self, context_id: u32) -> u64 {
        let n = self.tokens.get().wrapping_add(1);
        self.tokens.set(n);
        // Unique per root by the counter (for 2^40 claims: the context only fills the high
        // bits), across roots by the random seed. A cheap bijective mix, not a hash: tokens need
        // uniqueness, not secrecy (they never leave shared data). No clock: a host call per claim
        // that added nothing to uniqueness.
        let mixed = splitmix64(self.seed ^ splitmix64(n ^ (u64::from(context_id) << 40)));
        mixed.max(1)
    }
}

/// The host status of a call Envoy refused for its arguments (proxy-wasm's `BadArgument`).
const BAD_ARGUMENT: u32 = 2;

/// What a call is for, when Envoy refuses it (`PluginState::callout_refused`).
#[derive(Clone, Copy)]
pub enum CalloutOf<'r> {
    Store,
    Detached(&'r Rule),
    Lookup(&'r Rule),
}

const STORE_FAILS: &str =
    "every protected request whose record lives there gets 503 store-unavailable (forwarded unprotected \
     with on_error: fail_open)";
const DETACHED_FAILS: &str = "every new key on this rule gets 503 detached-capacity and is not executed";
const LOOKUP_FAILS: &str = "no lookup of this rule can be made, so its unknown outcomes stay unsettled \
                            (503 outcome-unknown)";

/// Data key of the once-per-Envoy warning that a rule's requests went upstream more than once;
/// one per configured rule name, created at configure time.
fn retry_warning_key(rule_name: &str) -> String {
    format!("idem:warned:retry:{rule_name}")
}
