//! The root's renewals of the claims its worker's owners hold (`renewal`): at each tick the due
//! batches are started on the store, answered at once (the local store) or carried as
//! conversations beside its settlements (a remote store), and their answers go back to the
//! worker's `Renewals`. Beside `settle.rs`, on the same footing: it calls nothing above it.

use super::calls::RootRenewal;
use super::plugin::PluginState;
use super::settle::{step, Stepped};
use crate::host::Host;
use crate::store::remote::Answer;
use crate::store::seam::Started;
use crate::store::{Kept, Renew, StoreError, StoreOp};

/// Starts the renewals due at `now_ms`. Nothing to do (no host call) while no claim is due.
pub(super) fn renew_due<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    let due = plugin.renewals.borrow_mut().due(now_ms);
    for renew in due {
        match plugin.start(StoreOp::Renew(renew.clone())) {
            Started::Answered(answer) => renewed(plugin, &renew, answer.into_renewed()),
            Started::Conversation(conversation) => {
                converse_renewal(plugin, Box::new(RootRenewal { conversation, renew }), None)
            }
        }
    }
}

/// Takes a renewal's conversation one step: its next callout, or its end.
pub(super) fn converse_renewal<H: Host>(
    plugin: &PluginState<H>,
    call: Box<RootRenewal>,
    answer: Option<Answer>,
) {
    match step(plugin, call, answer) {
        Stepped::Kept => {}
        Stepped::Failed(call, error) => renewed(plugin, &call.renew, Err(error)),
        Stepped::Done(call, answer) => renewed(plugin, &call.renew, answer.into_renewed()),
    }
}

/// What the store answered a renewal: counted, and a claim found lost logged (its request may
/// execute twice: its lease ended before it could be renewed).
pub(super) fn renewed<H: Host>(plugin: &PluginState<H>, renew: &Renew, kept: Result<Vec<Kept>, StoreError>) {
    let outcome = match &kept {
        Ok(kept) => plugin.renewals.borrow_mut().answered(renew, Ok(kept)),
        Err(error) => {
            log::debug!("renewing {} claim(s) failed ({error}); asked again shortly", renew.claims.len());
            plugin.renewals.borrow_mut().answered(renew, Err(()))
        }
    };
    plugin.meter.count_renewals(outcome.kept, outcome.lost.len());
    for scope in &outcome.lost {
        log::warn!(
            "the claim of key {} was no longer its owner's when renewed: its lease ended before it could be \
             renewed (claims_lost), and a retry may have executed beside it",
            scope.log_tag()
        );
    }
}
