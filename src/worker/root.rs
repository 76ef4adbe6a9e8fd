//! Root context: configuration, the periodic sweep and heartbeat, and the waiters it wakes. One
//! per plugin per thread (main and each worker).

use super::admin::root::{admin_failed, continue_admin, converse_admin};
use super::begin::{begin_failed, converse_begin};
use super::calls::RootCall;
use super::carry::drain;
use super::detached::root::{detached_answered, dispatch_detached};
use super::http::Http;
use super::plugin::PluginState;
use super::reconcile::root::{dispatch_lookup, lookup_answered, start_lease_end_lookups};
use super::remote;
use super::renew::{converse_renewal, renew_due, renewed};
use super::settle::{abandon, converse, finish_settlement, retry_settlements, Sent};
use super::unsettled::root::{converse_recheck, recheck_due, recheck_failed};
use super::wait::root::{recheck, tend_watch};
use crate::host::{log_filter, Host, HostError, BUFFER_GRPC_RECEIVE};
use crate::identity::scope::ScopeId;
use crate::store::seam::Store;
use std::rc::Rc;

/// Tick period: waiters' give-up and recheck times are honoured to this resolution.
pub const TICK_MS: u32 = 100;
/// Tick period while the root holds admin requests whose store paused a long scan: each tick
/// reads one bounded part (`store::local::admin::SCAN_READS`), and between two ticks Envoy's
/// event loop serves the worker's requests (a timer, unlike a queue's wake-up posted from the
/// root's own callback, lets Envoy poll its connections first).
pub const ADMIN_TICK_MS: u32 = 1;
/// Sweep and wake-registry heartbeat every this many ticks of `TICK_MS` (1 s).
const SLOW_EVERY_TICKS: u64 = 10;
/// Wake-up messages handled per `on_queue_ready`, so one callback stays short.
const MAX_MESSAGES_PER_READY: usize = 4096;

pub struct Root<H: Host> {
    context_id: u32,
    host: H,
    plugin: Option<Rc<PluginState<H>>>,
    /// Ticks of `TICK_MS` so far (faster ticks count once per `TICK_MS`), and when the last
    /// one counted: the once-a-second work keeps its pace whatever the period.
    ticks: u64,
    counted_at_ms: u64,
    /// The tick period set: `ADMIN_TICK_MS` while admin requests go on, else `TICK_MS`.
    tick_ms: u32,
    /// Set when Envoy retired this root and it asked to finish first (`on_done`): when it
    /// stops waiting for the store operations it carries.
    retiring_until_ms: Option<u64>,
}

impl<H: Host> Root<H> {
    /// How many flows the worker keeps (`PluginState::flows`): a test's look for a flow that
    /// outlived its stream and the root's work.
    #[cfg(test)]
    pub fn flows_kept(&self) -> usize {
        self.plugin.as_ref().map_or(0, |p| p.flows.len())
    }

    pub fn new(context_id: u32, host: H) -> Root<H> {
        Root {
            context_id,
            host,
            plugin: None,
            ticks: 0,
            counted_at_ms: 0,
            tick_ms: TICK_MS,
            retiring_until_ms: None,
        }
    }

    /// Envoy started this root (once per root context: the canary, the main thread, each
    /// worker, and again for a configuration update). Says which module this is, off any
    /// request's path: the build-info gauge, and a log line from the first root of this Envoy
    /// to start this build (`build_info`). Never refuses.
    pub fn on_vm_start(&mut self) -> bool {
        log::set_max_level(log_filter(self.host.log_level()));
        if log::Level::Info <= log::max_level() && crate::build_info::first_to_announce(&self.host) {
            log::info!("{}", crate::build_info::start_line());
        }
        let gauge = crate::build_info::gauge();
        if let Err(HostError(s)) = self.host.set_gauge(&gauge, 1) {
            log::warn!("cannot set metric {gauge} (host status {s})");
        }
        true
    }

    /// False makes Envoy refuse the configuration; the reason is logged in one line naming
    /// the field.
    pub fn on_configure(&mut self) -> bool {
        self.on_configure_with(None)
    }

    /// `on_configure` with the remote store given (the native tests script one).
    pub fn on_configure_with(&mut self, remote: Option<Box<dyn Store>>) -> bool {
        log::set_max_level(log_filter(self.host.log_level()));
        match PluginState::configure_with(self.host.clone(), self.context_id, remote) {
            Ok(plugin) => {
                self.plugin = Some(Rc::new(plugin));
                if let Err(HostError(s)) = self.host.set_tick_period_ms(TICK_MS) {
                    log::warn!(
                        "no sweep timer (host status {s}); expired records are reclaimed on reuse only"
                    );
                }
                true
            }
            Err(message) => {
                self.host.log_critical(&message);
                false
            }
        }
    }

    /// Envoy retires this root: a configuration update replaced it (after the last stream of
    /// the old configuration ended), or the listener went. The store operations it carries
    /// for streams that have ended (completions, releases, answers to begins and rechecks)
    /// would be cancelled with it, and a completion lost that way leaves its record in
    /// flight, so a retry after the lease would execute again. So while any is left it asks
    /// Envoy to wait (false), and says when it is finished (`proxy_done`), at the latest after
    /// `PluginState::retirement_bound_ms`.
    pub fn on_done(&mut self) -> bool {
        let Some(plugin) = &self.plugin else { return true };
        self.host.flush_metrics();
        plugin.wakeups.withdraw();
        let left = plugin.calls.borrow().len();
        if left == 0 {
            return true;
        }
        let bound_ms = plugin.retirement_bound_ms();
        self.retiring_until_ms = Some(self.host.now_ms().saturating_add(bound_ms));
        log::info!(
            "configuration retired: finishing {left} store operation(s) first (at most {bound_ms} ms)"
        );
        false
    }

    /// The end of each of the root's callbacks: the executor carries out what the callback's
    /// work posted to the flows the root holds (`carry::drain`), then a retiring root may
    /// finish.
    fn end_callback(&mut self, plugin: &PluginState<H>) {
        drain(plugin);
        self.finish_retirement();
    }

    /// A retiring root whose store operations are finished, or whose bound has passed, tells
    /// Envoy it is done; what is left then is counted and logged as abandoned.
    fn finish_retirement(&mut self) {
        let (Some(until_ms), Some(plugin)) = (self.retiring_until_ms, self.plugin.clone()) else { return };
        if !plugin.calls.borrow().is_empty() {
            if self.host.now_ms() < until_ms {
                return;
            }
            abandon(&plugin);
        }
        self.retiring_until_ms = None;
        self.host.flush_metrics();
        if let Err(HostError(s)) = self.host.done() {
            log::warn!("could not tell Envoy this retired root is done (host status {s})");
        }
    }

    pub fn on_tick(&mut self) {
        let Some(plugin) = self.plugin.clone() else { return };
        // What this worker counted since the last tick (no request pays a crossing for it).
        self.host.flush_metrics();
        let now_ms = self.host.now_ms();
        // Settlements handed over without a wake-up (no queue, or the enqueue failed), and
        // those due to be tried again.
        take_on_handed_over(&plugin);
        retry_settlements(&plugin, now_ms);
        // Claims whose owners are still at work, before their leases end.
        renew_due(&plugin, now_ms);
        start_lease_end_lookups(&plugin, now_ms);
        // The unsettled records this Envoy noted, looked up again by one root every few seconds.
        recheck_due(&plugin, now_ms);
        // Conversations waiting for a token: on, or over once its fetch is past its deadline.
        resume_parked(&plugin);
        let counted =
            self.tick_ms == TICK_MS || now_ms.saturating_sub(self.counted_at_ms) >= u64::from(TICK_MS);
        if counted {
            self.counted_at_ms = now_ms;
        }
        if counted && self.ticks.is_multiple_of(SLOW_EVERY_TICKS) {
            // Once a second: reclaim expired records (a remote store expires its own), and beat
            // in the wake registry.
            match plugin.store.sweep(now_ms) {
                Ok(0) => {}
                Ok(n) => {
                    plugin.meter.count_swept(n);
                    log::debug!("swept {n} expired record(s)");
                }
                Err(e) => log::warn!("sweep failed: {e}"),
            }
            plugin.wakeups.heartbeat(now_ms);
            tend_watch(&plugin, now_ms);
        }
        if counted {
            self.ticks = self.ticks.wrapping_add(1);
        }
        let due = plugin.room.borrow_mut().due(now_ms);
        for w in due {
            recheck(&plugin, w);
        }
        continue_admin(&plugin);
        self.pace(&plugin);
        self.end_callback(&plugin);
    }

    /// Ticks every `ADMIN_TICK_MS` while admin requests go on, else every `TICK_MS`.
    fn pace(&mut self, plugin: &PluginState<H>) {
        let want = if plugin.calls.borrow().admin_later.is_empty() { TICK_MS } else { ADMIN_TICK_MS };
        if want != self.tick_ms {
            match self.host.set_tick_period_ms(want) {
                Ok(()) => self.tick_ms = want,
                Err(HostError(s)) => log::debug!("cannot set the tick period to {want} ms (host status {s})"),
            }
        }
    }

    pub fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(plugin) = self.plugin.clone() else { return };
        // A stream handed over a settlement and left `SETTLE_NOW` (skipped below: not a scope).
        take_on_handed_over(&plugin);
        for _ in 0..MAX_MESSAGES_PER_READY {
            let message = match self.host.dequeue(queue_id) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(HostError(s)) => {
                    log::warn!("wake queue read failed (host status {s})");
                    break;
                }
            };
            let Ok(scope) = <[u8; 32]>::try_from(message.as_slice()) else { continue };
            let woken = plugin.room.borrow_mut().wake(&ScopeId(scope));
            for w in woken {
                recheck(&plugin, w);
            }
        }
        // An admin request handed over by its stream goes on at the next tick, soon.
        self.pace(&plugin);
        self.end_callback(&plugin);
    }

    /// A message on the worker's watch stream: the records that changed wake their waiters.
    pub fn on_grpc_receive(&mut self, token: u32, size: usize) {
        let Some(plugin) = self.plugin.clone() else { return };
        let Some(watch) = plugin.store.watches().into_iter().find(|w| w.token() == Some(token)) else {
            return;
        };
        let now_ms = self.host.now_ms();
        let message = match self.host.buffer(BUFFER_GRPC_RECEIVE, 0, size) {
            Ok(m) => m,
            Err(HostError(s)) => {
                log::debug!("watch stream {token}: message unreadable (host status {s})");
                Vec::new()
            }
        };
        match watch.received(&message) {
            Ok(received) => {
                for scope in received.wake.iter().chain(&received.dropped) {
                    let woken = plugin.room.borrow_mut().wake(scope);
                    for w in woken {
                        recheck(&plugin, w);
                    }
                }
                if received.refused {
                    // Opened again later with the worker's token as it is then.
                    let _ = self.host.cancel_grpc_stream(token);
                    plugin.watch_ended(watch.closed(now_ms), now_ms);
                }
            }
            Err(why) => {
                log::debug!("watch stream {token}: {why}; closing it, waiters poll");
                let _ = self.host.cancel_grpc_stream(token);
                plugin.watch_ended(watch.closed(now_ms), now_ms);
            }
        }
        self.end_callback(&plugin);
    }

    /// The watch stream ended (etcd, the connection, or Envoy): waiters poll until it opens
    /// again.
    pub fn on_grpc_close(&mut self, token: u32, status: u32) {
        let Some(plugin) = self.plugin.clone() else { return };
        let Some(watch) = plugin.store.watches().into_iter().find(|w| w.token() == Some(token)) else {
            return;
        };
        log::debug!("watch stream {token} closed (grpc-status {status}); waiters poll");
        let now_ms = self.host.now_ms();
        plugin.watch_ended(watch.closed(now_ms), now_ms);
        self.end_callback(&plugin);
    }

    /// The answer to a callout the root dispatched: the next step of a stream's `begin` or of a
    /// settlement.
    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        let Some(plugin) = self.plugin.clone() else { return };
        let call = plugin.calls.borrow_mut().in_flight.remove(&token);
        let Some(call) = call else {
            log::debug!("root ignored the answer to callout {token}");
            return;
        };
        let call = match call {
            RootCall::Detached(call) => {
                detached_answered(&plugin, *call, body_size);
                self.end_callback(&plugin);
                return;
            }
            RootCall::Lookup(call) => {
                lookup_answered(&plugin, *call, body_size);
                self.end_callback(&plugin);
                return;
            }
            call => call,
        };
        let Some(settings) = plugin.store.remote() else { return };
        let service_time = &plugin.config.envoy_headers.upstream_service_time;
        let answer = remote::read_answer(&plugin.host, body_size, settings.protocol, service_time);
        let shard = {
            let mut calls = plugin.calls.borrow_mut();
            let at = calls.shard_of.iter().position(|(t, _)| *t == token);
            at.map_or(0, |at| calls.shard_of.swap_remove(at).1)
        };
        if !answer.as_ref().is_ok_and(|a| a.succeeded()) {
            plugin.meter.count_call_failed(shard);
        }
        match (call, answer) {
            (RootCall::Begin(begin), Ok(answer)) => converse_begin(&plugin, begin, Some(answer)),
            (RootCall::Begin(begin), Err(error)) => begin_failed(&plugin, *begin, error, Sent::Yes),
            (RootCall::Settle(settle), Ok(answer)) => converse(&plugin, settle, Some(answer)),
            (RootCall::Settle(settle), Err(error)) => finish_settlement(&plugin, settle, Err(error)),
            (RootCall::Admin(call), Ok(answer)) => converse_admin(&plugin, call, Some(answer)),
            (RootCall::Admin(call), Err(error)) => admin_failed(&plugin, call, error),
            (RootCall::Renew(call), Ok(answer)) => converse_renewal(&plugin, call, Some(answer)),
            (RootCall::Renew(call), Err(error)) => renewed(&plugin, &call.renew, Err(error)),
            (RootCall::Recheck(call), Ok(answer)) => converse_recheck(&plugin, call, Some(answer)),
            (RootCall::Recheck(call), Err(error)) => recheck_failed(&call.scope, &error),
            (RootCall::Detached(_) | RootCall::Lookup(_), _) => {}
        }
        if plugin.store.take_woken() {
            resume_parked(&plugin);
        }
        self.end_callback(&plugin);
    }

    #[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
    pub fn context_id(&self) -> u32 {
        self.context_id
    }

    /// Claims this worker keeps renewing (tests).
    #[cfg(test)]
    pub fn held_claims(&self) -> usize {
        self.plugin.as_ref().map_or(0, |p| p.renewals.borrow().len())
    }

    pub fn http_context(&self, context_id: u32) -> Http<H> {
        Http::new(context_id, self.plugin.clone())
    }
}

/// Starts what streams handed over since the root last ran; from here on the root owns their
/// callouts, so their answers come whether or not the stream is still there.
fn take_on_handed_over<H: Host>(plugin: &PluginState<H>) {
    let queued = std::mem::take(&mut plugin.calls.borrow_mut().queued);
    for call in queued {
        take_on(plugin, call);
    }
}

/// Steps again every conversation that was waiting (for the etcd token): each goes on, waits
/// on, or ends with the wait's failure through its ordinary path (a stream's fail mode, a
/// settlement counted, a client that left: nothing held).
fn resume_parked<H: Host>(plugin: &PluginState<H>) {
    let parked = std::mem::take(&mut plugin.calls.borrow_mut().parked);
    for call in parked {
        take_on(plugin, call);
    }
}

/// Takes a call handed over (or parked) one step: a store conversation's next step, or a
/// detached call or a lookup made (neither waits for the store's token).
fn take_on<H: Host>(plugin: &PluginState<H>, call: RootCall) {
    match call {
        RootCall::Begin(begin) => converse_begin(plugin, begin, None),
        RootCall::Settle(settle) => converse(plugin, settle, None),
        RootCall::Admin(call) => converse_admin(plugin, call, None),
        RootCall::Detached(call) => dispatch_detached(plugin, call),
        RootCall::Lookup(call) => dispatch_lookup(plugin, call),
        RootCall::Renew(call) => converse_renewal(plugin, call, None),
        RootCall::Recheck(call) => converse_recheck(plugin, call, None),
    }
}
