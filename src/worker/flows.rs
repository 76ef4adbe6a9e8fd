//! The worker's flows: every request's `RequestFlow` lives in one table, which the root's state
//! owns, keyed by its stream's context id, from its stream's first callback until its stream and
//! the root are both done with it. A flow never moves: a stream's callback and the root's work
//! for the request (its `begin` or lookup as callouts, its wait, its detached call) find it by
//! its key, and what comes for it is an `Event` the executor (`carry.rs`) hands it.
//!
//! While the root works for a request (it holds a `RootHold` on its flow), the stream's own
//! callbacks leave the flow alone: its request is paused, and what Envoy still tells the stream
//! (that it ended) is the root's to find out, through the effective context.

use crate::worker::flow::RequestFlow;
use std::cell::{Cell, RefCell, RefMut};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;

/// A flow's key: its stream's context id, or, for a lease-end lookup (which has no stream), a
/// number of the worker's own above every context id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey(u64);

impl FlowKey {
    pub fn stream(context_id: u32) -> FlowKey {
        FlowKey(u64::from(context_id))
    }

    /// The stream's context id (0 for a lease-end lookup's flow: it has none).
    pub fn context_id(self) -> u32 {
        u32::try_from(self.0).unwrap_or(0)
    }
}

struct Entry {
    flow: RequestFlow,
    /// Its stream is still there (its context not yet deleted).
    stream: bool,
    /// `RootHold`s on it: the root's work for the request that is not over.
    held: u32,
}

/// The table of a worker's flows.
pub struct Flows {
    table: RefCell<HashMap<FlowKey, Entry, ContextIds>>,
    /// The last key given to a lease-end lookup's flow (past `u32::MAX`).
    headless: Cell<u64>,
}

impl Default for Flows {
    fn default() -> Flows {
        Flows {
            table: RefCell::new(HashMap::with_hasher(ContextIds)),
            headless: Cell::new(u64::from(u32::MAX)),
        }
    }
}

impl Flows {
    /// A stream's flow, made at its first callback: `f` runs on it unless the root holds it
    /// (None then, and when the table is busy, which a callback never finds it).
    pub fn of_stream<T>(&self, context_id: u32, f: impl FnOnce(&mut RequestFlow) -> T) -> Option<T> {
        let mut table = self.table.try_borrow_mut().ok()?;
        let key = FlowKey::stream(context_id);
        if let Some(entry) = table.get_mut(&key) {
            return (entry.held == 0).then(|| f(&mut entry.flow));
        }
        // Its first callback. (Not `entry()`: its code would be the module's only use of it.)
        table.insert(key, Entry { flow: RequestFlow::new(context_id), stream: true, held: 0 });
        table.get_mut(&key).map(|entry| f(&mut entry.flow))
    }

    /// True when the stream's flow is the stream's, and its later callbacks would do nothing
    /// (`RequestFlow::inert`).
    pub fn inert(&self, context_id: u32) -> bool {
        let Ok(table) = self.table.try_borrow() else { return false };
        table.get(&FlowKey::stream(context_id)).is_none_or(|e| e.held == 0 && e.flow.inert())
    }

    /// `f` on the flow under `key`, whoever holds it (None if it is gone).
    #[inline]
    pub fn with<T>(&self, key: FlowKey, f: impl FnOnce(&mut RequestFlow) -> T) -> Option<T> {
        self.get(key).map(|mut flow| f(&mut flow))
    }

    /// The flow under `key`, borrowed until the result is dropped: the one lookup every `with`
    /// shares, so that each of them is only its own few lines.
    #[inline(never)]
    fn get(&self, key: FlowKey) -> Option<RefMut<'_, RequestFlow>> {
        let table = self.table.try_borrow_mut().ok()?;
        RefMut::filter_map(table, |t| t.get_mut(&key).map(|e| &mut e.flow)).ok()
    }

    /// The stream's context is gone: its flow ends now, or when the root lets it go.
    pub fn stream_ended(&self, context_id: u32) {
        let Ok(mut table) = self.table.try_borrow_mut() else { return };
        let key = FlowKey::stream(context_id);
        match table.get_mut(&key) {
            Some(entry) if entry.held > 0 => entry.stream = false,
            Some(_) => {
                table.remove(&key);
            }
            None => {}
        }
    }

    /// How many flows the worker keeps.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.try_borrow().map_or(0, |t| t.len())
    }
}

/// The root's hold on a flow: while one exists, the root works for the request and its stream's
/// callbacks leave the flow alone. Dropping it gives the flow back to its stream, or ends the
/// flow if its stream is gone; so a hold is never lost with its flow still kept.
pub struct RootHold {
    key: FlowKey,
    flows: Rc<Flows>,
}

impl RootHold {
    /// The root takes the flow under `key` (a stream's, from its callback, or one the root
    /// already holds).
    pub fn of(flows: &Rc<Flows>, key: FlowKey) -> RootHold {
        if let Ok(mut table) = flows.table.try_borrow_mut() {
            if let Some(entry) = table.get_mut(&key) {
                entry.held += 1;
            }
        }
        RootHold { key, flows: Rc::clone(flows) }
    }

    /// A flow with no stream (a lease-end lookup's), kept as long as the root holds it.
    pub fn headless(flows: &Rc<Flows>, flow: RequestFlow) -> RootHold {
        let n = flows.headless.get().wrapping_add(1).max(u64::from(u32::MAX) + 1);
        flows.headless.set(n);
        let key = FlowKey(n);
        if let Ok(mut table) = flows.table.try_borrow_mut() {
            table.insert(key, Entry { flow, stream: false, held: 1 });
        }
        RootHold { key, flows: Rc::clone(flows) }
    }

    pub fn key(&self) -> FlowKey {
        self.key
    }

    pub fn context_id(&self) -> u32 {
        self.key.context_id()
    }

    /// `f` on the held flow (None only if the table is busy: never within one callback's work).
    pub fn with<T>(&self, f: impl FnOnce(&mut RequestFlow) -> T) -> Option<T> {
        self.flows.with(self.key, f)
    }
}

impl Drop for RootHold {
    fn drop(&mut self) {
        let Ok(mut table) = self.flows.table.try_borrow_mut() else { return };
        let Some(entry) = table.get_mut(&self.key) else { return };
        entry.held = entry.held.saturating_sub(1);
        if entry.held == 0 && !entry.stream {
            table.remove(&self.key);
        }
    }
}

/// Hashes Envoy's context ids (and flow keys) with one multiplication instead of SipHash: every
/// callback of every stream looks its context up, and the ids are Envoy's own counter, not a
/// client's input, so there is no flooding to resist.
#[derive(Default, Clone, Copy)]
pub struct ContextIds;

impl BuildHasher for ContextIds {
    type Hasher = ContextIdHasher;
    fn build_hasher(&self) -> ContextIdHasher {
        ContextIdHasher(0)
    }
}

pub struct ContextIdHasher(u64);

impl Hasher for ContextIdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, id: u32) {
        // Fibonacci hashing: the high bits (hashbrown's tag) depend on every bit of the id.
        self.0 = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}
