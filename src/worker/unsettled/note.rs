//! The unsettled records registry as the executor and the root change it (`unsettled`): a note
//! when a request meets an unknown outcome (from the executor, or the root that carried its
//! settlement), a record's standing after a look, and the gauges set from the registry. Every
//! shared-data access is a CAS on the one registry key, made at configure (`prepare`), so no
//! write here creates a key.

use super::{Noted, Standing, Unsettled, REGISTRY_KEY};
use crate::host::Host;
use crate::identity::scope::ScopeId;
use crate::store::shared_data::{Read, SharedDataError};
use crate::worker::plugin::PluginState;

/// CAS attempts on the registry before a note or a drop gives up (it is a cache: the next one
/// mends it).
const CAS_ATTEMPTS: usize = 8;

pub(super) fn read<H: Host>(plugin: &PluginState<H>) -> Option<(Unsettled, Read)> {
    let read = plugin.host.get(REGISTRY_KEY).ok()?;
    read.exists().then(|| (Unsettled::decode(read.bytes()), read))
}

/// Changes the registry by `change` (true: changed), CAS-guarded; the registry as written.
pub(super) fn change<H: Host>(
    plugin: &PluginState<H>,
    change: impl Fn(&mut Unsettled) -> bool,
) -> Option<Unsettled> {
    for _ in 0..CAS_ATTEMPTS {
        let (mut registry, read) = read(plugin)?;
        if !change(&mut registry) {
            return Some(registry);
        }
        match plugin.host.set(REGISTRY_KEY, &registry.encode(), read.cas) {
            Ok(()) => return Some(registry),
            Err(SharedDataError::CasMismatch) => {}
            Err(_) => return None,
        }
    }
    None
}

/// Sets this configuration's gauges from `registry`.
pub(super) fn set_gauges<H: Host>(plugin: &PluginState<H>, registry: &Unsettled) {
    for (rule, (unknown, processing)) in plugin.config.rules.iter().zip(&plugin.unsettled_gauges) {
        let _ = plugin.host.record_gauge(*unknown, registry.count(&rule.name, Standing::OutcomeUnknown));
        let _ = plugin.host.record_gauge(*processing, registry.count(&rule.name, Standing::Processing));
    }
}

/// A request met an unknown outcome of `scope` on `rule` (the executor, at the count that says
/// so): noted, and the gauges set at once, so an alert fires within its scrape.
pub(super) fn note<H: Host>(plugin: &PluginState<H>, scope: &ScopeId, rule: &str, standing: Standing) {
    let noted = Noted { scope: *scope, route: rule.to_owned(), standing };
    if let Some(registry) = change(plugin, |r| r.note(noted.clone())) {
        set_gauges(plugin, &registry);
    }
}

/// What a request's outcome `counter` on `rule` leaves of `scope`'s record, if unsettled: noted.
pub(in crate::worker) fn note_counted<H: Host>(
    plugin: &PluginState<H>,
    counter: crate::metrics::Counter,
    rule: &crate::config::Rule,
    scope: &ScopeId,
) {
    if let Some(standing) = super::standing_after(counter, rule.reconcile.is_some()) {
        note(plugin, scope, &rule.name, standing);
    }
}
