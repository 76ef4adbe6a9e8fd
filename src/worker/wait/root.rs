//! Wait mode's root part: a waiter's look at its record again (its flow's `begin`, carried out
//! as any paused request's: `begin.rs`), and the watches a remote store keeps for waiters.

use crate::host::Host;
use crate::store::seam::Started;
use crate::worker::begin::{begin_answered, converse_begin};
use crate::worker::calls::RootBegin;
use crate::worker::flows::RootHold;
use crate::worker::plugin::PluginState;
use crate::worker::wait::Waiter;

/// Looks at a waiter's record again: its flow asks a fresh `begin`, and the store's answer is
/// carried out as any paused request's (`begin_answered`): at once when the store answers at
/// once, else when its callouts are answered, the waiter held in the room meanwhile (the
/// conversation holds its flow).
pub(in crate::worker) fn recheck<H: Host>(plugin: &PluginState<H>, w: Waiter<RootHold>) {
    let context_id = w.context_id;
    let now_ms = plugin.host.now_ms();
    let owner = plugin.owner_token(context_id);
    // Watched records wake their waiters: those poll only as a fallback.
    let watched = plugin.store.watch(&w.scope).is_some_and(|watch| watch.is_live(&w.scope));
    let Some(flow) = plugin.room.borrow_mut().start_check(Waiter { watched, ..w }) else {
        return;
    };
    let Some(op) = flow.with(|f| f.recheck(&plugin.config, now_ms, owner)).flatten() else {
        log::warn!("#{context_id} a held request's flow was not waiting; let go");
        plugin.room.borrow_mut().leave(context_id);
        return;
    };
    match plugin.start(op) {
        Started::Answered(answer) => begin_answered(plugin, flow, answer),
        Started::Conversation(conversation) => {
            converse_begin(plugin, Box::new(RootBegin { conversation, flow }), None)
        }
    }
}

/// Once a second: ends the watches no waiter of this worker needs any more, and opens the
/// watch stream again when it is due.
pub(in crate::worker) fn tend_watch<H: Host>(plugin: &PluginState<H>, now_ms: u64) {
    for watch in plugin.store.watches() {
        let cancels = {
            let room = plugin.room.borrow();
            watch.tidy(&|scope| room.waits_on(scope))
        };
        plugin.send_watch(watch, &cancels, now_ms);
        plugin.open_watch(watch, now_ms);
    }
}
