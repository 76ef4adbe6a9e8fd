//! The unsettled records gauge's root part (`unsettled`): the registry's recheck at the root's
//! tick, one root per Envoy every `RECHECK_MS`, and what each look found.

use super::note::{change, read, set_gauges};
use super::{standing_of, RECHECK_MS};
use crate::host::Host;
use crate::identity::scope::ScopeId;
use crate::store::remote::Answer;
use crate::store::seam::Started;
use crate::store::{RecordQuery, StoreAnswer, StoreError, StoreOp};
use crate::worker::calls::RootRecheck;
use crate::worker::plugin::PluginState;
use crate::worker::settle::{step, Stepped};

/// At the root's tick: every `RECHECK_MS` one root of the Envoy (whose CAS on the registry's
/// next check wins) asks the store about each noted record. No host call between two of this
/// root's checks.
pub(in crate::worker) fn recheck_due<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    if now_ms < plugin.next_recheck_ms.get() {
        return;
    }
    plugin.next_recheck_ms.set(now_ms.saturating_add(RECHECK_MS));
    let Some((registry, _)) = read(plugin) else { return };
    // Every configuration on this VM shares the registry, and a root of any of them may win a
    // check (the admin listener's, with no rule of its own, or another filter's): this root
    // sets its own rules' gauges from the registry whoever checked it, so a record another
    // root dropped leaves these gauges within this root's next look.
    set_gauges(plugin, &registry);
    if registry.next_check_ms > now_ms {
        return;
    }
    let next = now_ms.saturating_add(RECHECK_MS);
    let Some(registry) = change(plugin, |r| {
        // Another root moved it since this one read it: its check, not this one's.
        if r.next_check_ms > now_ms {
            return false;
        }
        r.next_check_ms = next;
        true
    }) else {
        return;
    };
    if registry.next_check_ms != next {
        return;
    }
    for noted in registry.noted {
        match plugin.start(StoreOp::Records(RecordQuery::of_scope(noted.scope, now_ms))) {
            Started::Answered(answer) => looked_up(plugin, &noted.scope, answer),
            Started::Conversation(conversation) => {
                converse_recheck(plugin, Box::new(RootRecheck { conversation, scope: noted.scope }), None)
            }
        }
    }
}

/// Takes a recheck's conversation one step: its next callout, or its end.
pub(in crate::worker) fn converse_recheck<H: Host>(
    plugin: &PluginState<H>,
    call: Box<RootRecheck>,
    answer: Option<Answer>,
) {
    match step(plugin, call, answer) {
        Stepped::Kept => {}
        Stepped::Failed(call, error) => recheck_failed(&call.scope, &error),
        Stepped::Done(call, answer) => looked_up(plugin, &call.scope, answer),
    }
}

pub(in crate::worker) fn recheck_failed(scope: &ScopeId, error: &StoreError) {
    log::debug!(
        "unsettled record {} not looked up again ({error}): kept until the next check",
        scope.log_tag()
    );
}

/// What the store said of a noted record: its standing now, or settled (dropped).
fn looked_up<H: Host>(plugin: &PluginState<H>, scope: &ScopeId, answer: StoreAnswer) {
    let page = match answer {
        StoreAnswer::Records(Ok(page)) => page,
        StoreAnswer::Records(Err(error)) => return recheck_failed(scope, &error),
        other => return recheck_failed(scope, &other.unexpected()),
    };
    let standing = standing_of(page.views.iter().find(|v| v.scope == *scope).map(|v| &v.entry));
    let changed = change(plugin, |r| {
        let Some(at) = r.noted.iter().position(|n| n.scope == *scope) else { return false };
        match standing {
            Some(s) if r.noted[at].standing == s => false,
            Some(s) => {
                r.noted[at].standing = s;
                true
            }
            None => {
                r.noted.remove(at);
                true
            }
        }
    });
    if let Some(registry) = changed {
        set_gauges(plugin, &registry);
    }
}
