//! Detached execution's root part (`routes[].execution: "detached"`): the call made from the
//! root, so that it outlives the client's stream, and its answer posted to the request's flow,
//! which the root holds meanwhile.

use crate::config::{Execution, Rule};
use crate::host::{Host, HostError, BUFFER_REQUEST_BODY, MAP_REQUEST_HEADERS};
use crate::store::Claim;
use crate::worker::calls::{DetachedCall, RootCall};
use crate::worker::detached;
use crate::worker::flow::{said, Event};
use crate::worker::flows::RootHold;
use crate::worker::plugin::{CalloutOf, PluginState};
use crate::worker::remote::callout_answer;
use std::rc::Rc;

/// Makes a detached call from the root, so that it outlives the client's stream.
pub(in crate::worker) fn dispatch_detached<H: Host>(plugin: &PluginState<H>, mut call: Box<DetachedCall>) {
    let host = &plugin.host;
    let headers: Vec<(&str, &[u8])> = call.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    match host.dispatch_http_call(&call.cluster, &headers, &call.body, call.timeout_ms) {
        Ok(token) => {
            // Envoy has its copy; the worker holds the answer next.
            call.body = Vec::new();
            plugin.calls.borrow_mut().in_flight.insert(token, RootCall::Detached(call));
        }
        Err(HostError(s)) => {
            let why = plugin.callout_refused(CalloutOf::Detached(&call.rule), &call.cluster, s);
            plugin.detached_done();
            plugin.release_claim(call.context_id, call.claim, &call.rule);
            // A client gone meanwhile hears nothing (`carry::drain`).
            plugin.post(call.flow, Event::DetachRefused(why));
        }
    }
}

/// A detached call's answer goes to the request's flow, which says what it means for the record
/// (as an inline upstream answer would) and for its client, if still there: its steps are
/// carried out as any flow's the root holds (with a remote store, the reply once the record is
/// written).
pub(in crate::worker) fn detached_answered<H: Host>(
    plugin: &PluginState<H>,
    call: DetachedCall,
    body_size: usize,
) {
    let host = &plugin.host;
    plugin.detached_done();
    let now_ms = host.now_ms();
    let answer = match callout_answer(host, body_size) {
        Some((status, headers, body)) => {
            let envoy = &plugin.config.envoy_headers;
            // Asked only of an answer without our mark (a local reply, or a prefix mismatch).
            if !envoy.from_upstream(&headers) {
                if let Some(seen) = envoy.foreign_service_time(&headers) {
                    plugin.meter.header_prefix_mismatch(&plugin.config.envoy_headers.prefix, seen);
                }
            }
            detached::answer_of(envoy, status, headers, body)
        }
        // An answer that cannot be read: what it said is unknown.
        None => detached::CallAnswer::Unknown { timed_out: false },
    };
    let DetachedCall { context_id, claim, rule, flow, .. } = call;
    said(context_id, "detached call answered:", Some(&claim.scope));
    let held_ms = plugin.store.held_past_lease_ms(rule.processing_timeout_ms);
    plugin.post(flow, Event::DetachedAnswered { answer, now_ms, held_ms });
}

/// What a detached call sends: the request as Envoy holds it, to its cluster.
struct DetachedRequest {
    cluster: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    timeout_ms: u32,
}

/// The detached calls a worker carries.
impl<H: Host> PluginState<H> {
    /// The call a claimed request on a detached rule becomes (the effective context is the
    /// request's: its head and body are read here), holding its flow, for `hand_over_detached`.
    /// Refused, with the reason and the hold given back, when the worker carries
    /// `max_detached_calls` already or the request cannot be sent: the claim is then given back
    /// here (nothing was sent upstream).
    pub fn detach(
        &self,
        claim: Claim,
        rule: &Rc<Rule>,
        flow: RootHold,
    ) -> Result<DetachedCall, (String, RootHold)> {
        let context_id = flow.context_id();
        match self.detached_call(rule) {
            Ok(DetachedRequest { cluster, headers, body, timeout_ms }) => Ok(DetachedCall {
                context_id,
                claim,
                rule: Rc::clone(rule),
                cluster,
                headers,
                body,
                timeout_ms,
                flow,
            }),
            Err(why) => {
                self.release_claim(context_id, claim, rule);
                Err((why, flow))
            }
        }
    }

    /// Hands a detached call to this worker's root, which makes it.
    pub fn hand_over_detached(&self, call: DetachedCall) {
        self.detached_in_flight.set(self.detached_in_flight.get() + 1);
        self.to_root(RootCall::Detached(Box::new(call)));
    }

    /// The call `detach` makes, from the request as Envoy holds it.
    fn detached_call(&self, rule: &Rule) -> Result<DetachedRequest, String> {
        let Execution::Detached { cluster, upstream_timeout_ms, rewrite } = &rule.execution else {
            return Err("not a detached rule".into());
        };
        if self.detached_in_flight.get() >= self.config.max_detached_calls {
            return Err(format!(
                "this Envoy worker carries max_detached_calls ({}) already",
                self.config.max_detached_calls
            ));
        }
        let cluster = match cluster {
            Some(c) => c.clone(),
            None => self.route_cluster().ok_or("the route picked no cluster and the rule names none")?,
        };
        let headers = self
            .host
            .header_pairs(MAP_REQUEST_HEADERS)
            .ok()
            .and_then(|h| detached::call_headers(&rule.path, rewrite, &self.config.envoy_headers, h));
        let Some(headers) = headers else { return Err("the request head could not be read".into()) };
        let body = self
            .host
            .buffer(BUFFER_REQUEST_BODY, 0, usize::MAX)
            .map_err(|e| format!("the request body could not be read (host status {})", e.0))?;
        Ok(DetachedRequest {
            cluster,
            headers,
            body,
            timeout_ms: u32::try_from(*upstream_timeout_ms).unwrap_or(u32::MAX),
        })
    }

    /// A detached call is over (answered, refused or abandoned).
    pub fn detached_done(&self) {
        self.detached_in_flight.set(self.detached_in_flight.get().saturating_sub(1));
    }
}
