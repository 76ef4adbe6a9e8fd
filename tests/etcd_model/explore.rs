//! The exhaustive explorer: breadth first over every state the fleet can reach, each state
//! once (told apart by a 64-bit fingerprint of everything in it), so a broken invariant comes
//! with the shortest path to it.
//!
//! Why not `stateright`: its checkers run on threads and require states that are `Send` and
//! `Sync`, while the product's store is single-threaded by design (a worker's `EtcdStore` keeps
//! its leases in `RefCell`s; a claim's label holds an `Rc`). Its states could then only carry
//! the conversations' histories and replay them from the start at every step, or the store
//! would have to change for the checker. This explorer holds the product's own objects in its
//! states (cloned, with the `testing` feature) and steps them once per transition.

use crate::fleet::{Action, Fleet, FleetState};
use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

pub struct Explored {
    /// Distinct states reached.
    pub states: usize,
    /// Transitions taken (states generated, revisits included).
    pub transitions: usize,
    /// The longest shortest path.
    pub depth: usize,
    /// The union of the states' `seen` flags.
    pub seen: u16,
    /// The shortest path to the first state that broke an invariant: each state and the action
    /// taken from it; the state it led to last.
    pub counterexample: Option<(Vec<(FleetState, Action)>, FleetState)>,
}

fn fingerprint(state: &FleetState) -> u64 {
    // std's SipHash with its fixed keys: the same on every run. 64 bits, as stateright's
    // fingerprints: a collision among a million states is about one in 36 million.
    let mut h = DefaultHasher::new();
    state.hash(&mut h);
    h.finish()
}

pub fn explore(fleet: &Fleet) -> Explored {
    let init = fleet.init();
    // Node i: its parent node and the action from it (the root has none).
    let mut nodes: Vec<(usize, Option<Action>)> = vec![(0, None)];
    let mut visited: HashMap<u64, ()> = HashMap::new();
    visited.insert(fingerprint(&init), ());
    let mut queue = VecDeque::from([(0usize, init.clone(), 0usize)]);
    let (mut transitions, mut depth, mut seen) = (0, 0, 0u16);
    let mut actions = Vec::new();
    let mut next_report = 100_000;
    while let Some((node, state, d)) = queue.pop_front() {
        depth = depth.max(d);
        seen |= state.seen;
        if !state.violations.is_empty() {
            let path = path_to(fleet, &init, &nodes, node);
            return Explored {
                states: visited.len(),
                transitions,
                depth,
                seen,
                counterexample: Some((path, state)),
            };
        }
        if nodes.len() >= next_report {
            // Large sizes run for minutes: say how far they got.
            eprintln!("  ... {} states, depth {d}, {} waiting", visited.len(), queue.len());
            next_report += 100_000;
        }
        actions.clear();
        fleet.actions(&state, &mut actions);
        for action in actions.drain(..) {
            transitions += 1;
            let (next, _) = fleet.apply(&state, &action);
            if visited.insert(fingerprint(&next), ()).is_none() {
                nodes.push((node, Some(action)));
                queue.push_back((nodes.len() - 1, next, d + 1));
            }
        }
    }
    Explored { states: visited.len(), transitions, depth, seen, counterexample: None }
}

/// The states and actions from the start to `node`, taken again (every step is deterministic).
fn path_to(
    fleet: &Fleet,
    init: &FleetState,
    nodes: &[(usize, Option<Action>)],
    mut node: usize,
) -> Vec<(FleetState, Action)> {
    let mut actions = Vec::new();
    while let (parent, Some(action)) = &nodes[node] {
        actions.push(action.clone());
        node = *parent;
    }
    actions.reverse();
    let mut state = init.clone();
    let mut path = Vec::new();
    for action in actions {
        let (next, _) = fleet.apply(&state, &action);
        path.push((state, action));
        state = next;
    }
    path
}
