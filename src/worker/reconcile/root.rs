//! Reconciliation's root part (`routes[].reconcile`): a paused request's lookup and the
//! lease-end lookups the root makes itself, each made from the root (its answer comes whether or
//! not the request's stream is still there) and posted to the flow the root holds meanwhile.

use super::{LaterLookup, LeaseEnd};
use crate::config::Rule;
use crate::host::{Host, HostError};
use crate::identity::scope::ScopeId;
use crate::worker::calls::{
    DueLookup, Lookup, RootCall, RootLookup, LEASE_END_MARGIN_MS, MAX_LEASE_END_LOOKUPS,
};
use crate::worker::flow::{said, Event, RequestFlow};
use crate::worker::flows::{FlowKey, RootHold};
use crate::worker::plugin::{CalloutOf, PluginState};
use crate::worker::reconcile::{self, LookupAnswer};
use crate::worker::remote::callout_answer;
use std::rc::Rc;

/// Makes a paused request's lookup from the root, so that its answer comes whether or not the
/// stream is still there (a stream's callouts end with it).
pub(in crate::worker) fn dispatch_lookup<H: Host>(plugin: &PluginState<H>, call: Box<RootLookup>) {
    let l = &call.lookup;
    let headers: Vec<(&str, &[u8])> = l.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    match plugin.host.dispatch_http_call(&l.cluster, &headers, &[], l.timeout_ms) {
        Ok(token) => {
            plugin.calls.borrow_mut().in_flight.insert(token, RootCall::Lookup(call));
        }
        Err(HostError(s)) => {
            let why = plugin.callout_refused(CalloutOf::Lookup(&l.rule), &l.cluster, s);
            plugin.lookups.finished(&call.lookup.scope, call.lookup.started_ms, plugin.host.now_ms());
            answer_lookup(plugin, *call, LookupAnswer::Failed(why));
        }
    }
}

/// The lookup's answer, read from the callout's.
pub(in crate::worker) fn lookup_answered<H: Host>(
    plugin: &PluginState<H>,
    call: RootLookup,
    body_size: usize,
) {
    let host = &plugin.host;
    plugin.lookups.finished(&call.lookup.scope, call.lookup.started_ms, host.now_ms());
    let answer = match callout_answer(host, body_size) {
        Some((status, headers, body)) => reconcile::answer_of(&call.lookup.rule, status, headers, body),
        None => LookupAnswer::Failed("the lookup's answer could not be read".into()),
    };
    answer_lookup(plugin, call, answer);
}

/// Lease-end lookups tried this often settle nothing, then the record waits for a retry's.
const LEASE_END_TRIES: u32 = 8;

/// The longest pause between two tries of a lease-end lookup (from 2 s, doubling).
const LEASE_END_BACKOFF_MAX_MS: u64 = 60_000;

/// What the lookup's answer means, carried out for the request that asked (if it is still
/// there: a lookup writes nothing, so a client that left leaves the record as it was, for its
/// retry's lookup), or for a lease-end lookup.
fn answer_lookup<H: Host>(plugin: &PluginState<H>, call: RootLookup, answer: LookupAnswer) {
    let RootLookup { flow, lookup } = call;
    let headless = flow.with(|f| f.headless()).unwrap_or(false);
    let context_id = flow.context_id();
    if !headless && plugin.host.set_effective_context(context_id).is_err() {
        said(context_id, "lookup answered after its client left:", Some(&lookup.scope));
        return;
    }
    let now_ms = plugin.host.now_ms();
    plugin.post(flow, Event::LookupAnswered { answer, now_ms });
}

/// A lease-end lookup that settled nothing yet (the lookup failed, or the store still holds
/// the claim's lease by its own clock): asked again later, backing off, `LEASE_END_TRIES` times.
pub(in crate::worker) fn look_up_again_later<H: Host>(plugin: &PluginState<H>, flow: RootHold) {
    let tries = flow.with(RequestFlow::lease_end_tried).unwrap_or(LEASE_END_TRIES);
    let tag = flow.with(|f| f.scope().map(|s| s.log_tag())).flatten().unwrap_or_default();
    if tries >= LEASE_END_TRIES {
        log::warn!("lookup of key {tag} settled nothing {tries} times; its record waits for a retry");
        return;
    }
    let backoff_ms = (1_000u64 << tries.min(16)).min(LEASE_END_BACKOFF_MAX_MS);
    let due_ms = plugin.host.now_ms().saturating_add(backoff_ms);
    log::debug!("lookup of key {tag} asked again in {backoff_ms} ms");
    plugin.look_up_at_lease_end(DueLookup { due_ms, flow });
}

/// Starts the lease-end lookups that are due: each asks the store first, and looks its record
/// up only if it is still unsettled.
pub(in crate::worker) fn start_lease_end_lookups<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    let due: Vec<DueLookup> = {
        let mut queue = plugin.lease_end_lookups.borrow_mut();
        if !queue.iter().any(|l| l.due_ms <= now_ms) {
            return;
        }
        let (due, later) = std::mem::take(&mut *queue).into_iter().partition(|l| l.due_ms <= now_ms);
        *queue = later;
        due
    };
    for DueLookup { flow, .. } in due {
        plugin.post(flow, Event::LeaseEndDue { now_ms });
    }
}

/// The lookup of a lease-end flow's record, through this Envoy's gate. None when a lookup of the
/// record is under way or was just made here: then a request is here for it.
pub(in crate::worker) fn start_lease_end_lookup<H: Host>(
    plugin: &PluginState<H>,
    key: FlowKey,
) -> Option<Lookup> {
    // The stream it came from names it in the log (its own key names no context).
    let (lookup, context_id) = plugin
        .flows
        .with(key, |flow| {
            let (call, rule) = flow.lease_end_call()?;
            let lookup = Lookup {
                scope: flow.scope().copied()?,
                started_ms: 0,
                rule: Rc::clone(rule),
                cluster: call.cluster.clone(),
                headers: call.headers.clone(),
                timeout_ms: call.timeout_ms,
            };
            Some((lookup, flow.context_id))
        })
        .flatten()?;
    let now_ms = plugin.host.now_ms();
    if plugin.lookups.start(&lookup.scope, now_ms, u64::from(lookup.timeout_ms)).is_err() {
        said(context_id, "lease-end lookup left to the request already asking about", Some(&lookup.scope));
        return None;
    }
    Some(Lookup { started_ms: now_ms, ..lookup })
}

/// The lookups a worker makes.
impl<H: Host> PluginState<H> {
    /// Starts the lookup of a paused request's record, made from `request` (its head as the
    /// flow kept it). Refused, with when to try again, when this record's lookup is under way or
    /// was made less than a second ago on this Envoy, or no lookup can be made.
    pub fn start_lookup(
        &self,
        context_id: u32,
        scope: Option<ScopeId>,
        rule: &Rc<Rule>,
        request: &[(String, Vec<u8>)],
    ) -> Result<Lookup, u64> {
        let Some(scope) = scope else { return Err(crate::engine::LOOKUP_SPACING_MS) };
        let timeout_ms = rule.reconcile.as_ref().map_or(0, |r| r.timeout_ms);
        let started_ms = self.host.now_ms();
        self.lookups.start(&scope, started_ms, timeout_ms)?;
        match self.lookup_of(context_id, scope, rule, request, None) {
            Some(lookup) => Ok(Lookup { started_ms, ..lookup }),
            None => {
                self.lookups.finished(&scope, started_ms, started_ms);
                Err(crate::engine::LOOKUP_SPACING_MS)
            }
        }
    }

    /// The lookup of `scope`, made from `request`, to the rule's cluster or (read from the
    /// effective stream) the route's. None (logged) if it cannot be made.
    fn lookup_of(
        &self,
        context_id: u32,
        scope: ScopeId,
        rule: &Rc<Rule>,
        request: &[(String, Vec<u8>)],
        route_cluster: Option<&str>,
    ) -> Option<Lookup> {
        let reconcile = rule.reconcile.as_ref()?;
        let call = reconcile::lookup_call(rule, reconcile, request);
        let cluster = match call.as_ref().map(|c| c.cluster.clone()) {
            Some(Some(c)) => Some(c),
            Some(None) => route_cluster.map(str::to_string).or_else(|| self.route_cluster()),
            None => None,
        };
        let (Some(call), Some(cluster)) = (call, cluster) else {
            log::warn!(
                "#{context_id} no lookup for key {}: no cluster, or no key or authority",
                scope.log_tag()
            );
            return None;
        };
        Some(Lookup {
            scope,
            started_ms: 0,
            rule: Rc::clone(rule),
            cluster,
            headers: call.headers,
            timeout_ms: call.timeout_ms,
        })
    }

    /// What the root needs to look the stream's record up when its lease ends, with no request
    /// waiting (`Step::LookUpAtLeaseEnd`): the lookup is built now (the route's cluster is the
    /// stream's).
    pub fn lease_end_lookup(&self, context_id: u32, later: LaterLookup) -> Option<DueLookup> {
        let rule = Rc::clone(&later.pending.rule);
        let lookup = self.lookup_of(
            context_id,
            later.pending.scope,
            &rule,
            &later.request,
            later.route_cluster.as_deref(),
        )?;
        // While its owner held the claim its lease ran on: due where the last renewed lease ends.
        let lease_ends_ms = self.renewals.borrow().lease_end(later.owner).unwrap_or(0).max(later.due_ms);
        let owner = self.owner_token(context_id);
        let attempt = crate::engine::claim_attempt(
            &self.config,
            &later.pending,
            later.fingerprint,
            lease_ends_ms,
            owner,
        );
        // A margin past the lease: etcd ends a claim's lease key by its own clock, in whole
        // seconds, and a retry at the lease's end is given the first word. A store that keeps
        // the claim past its lease (etcd: its completion's retry window) keeps it from the lookup
        // too: asked before, its begin would only find the claim in flight.
        let held_ms = self.store.held_past_lease_ms(rule.processing_timeout_ms);
        let due_ms = lease_ends_ms.saturating_add(held_ms).saturating_add(LEASE_END_MARGIN_MS);
        let Lookup { cluster, headers, timeout_ms, .. } = lookup;
        let lease_end = LeaseEnd { cluster, headers, timeout_ms, attempt, tries: 0 };
        let flow = RootHold::headless(&self.flows, RequestFlow::lease_end(context_id, later, lease_end));
        Some(DueLookup { due_ms, flow })
    }

    /// Keeps a lease-end lookup for the root. At most `MAX_LEASE_END_LOOKUPS` per worker: past
    /// it, the record waits for a retry's lookup.
    pub fn look_up_at_lease_end(&self, lookup: DueLookup) {
        let mut queue = self.lease_end_lookups.borrow_mut();
        if queue.len() >= MAX_LEASE_END_LOOKUPS {
            log::debug!("lease-end lookups full; a record waits for a retry");
            return;
        }
        queue.push(lookup);
    }

    /// Hands a started lookup, holding its paused request's flow, to this worker's root, which
    /// makes the call and lets the flow go once it has carried out what the answer means.
    pub fn lookup_from_root(&self, flow: RootHold, lookup: Lookup) {
        self.to_root(RootCall::Lookup(Box::new(RootLookup { flow, lookup })));
    }
}
