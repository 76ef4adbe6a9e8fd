//! What one Envoy worker runs for the filter: its root context and its streams, the flow of each
//! request, and the features, each in its own folder. Written against the `Host` trait
//! (`crate::host`), so it compiles natively and `cargo test` drives it against a fake host (the
//! suite in `tests/`, one file per subject).
//!
//! The runtime, in this folder: the root (`root.rs`), a stream's context (`http.rs`), the flow
//! table (`flows.rs`), the executor (`carry.rs`), what the root carries (`calls.rs`, `begin.rs`,
//! `settle.rs`, `renew.rs`, `remote.rs`) and what a worker holds (`plugin.rs`, `meter.rs`,
//! `wakeups.rs`). The request's flow: `flow/`. Each feature's folder holds its pure plan
//! (`mod.rs`), the flow's part (`flow.rs`: what the feature's events mean to a request) and the
//! root's part (`root.rs`: the calls the root makes for it): `reconcile/`, `detached/`,
//! `wait/`, `admin/` (no flow: the admin API's stream is its own).

pub mod admin;
pub mod audit;
pub mod detached;
pub mod flow;
pub mod reconcile;
pub mod unsettled;
pub mod wait;

mod begin;
pub mod calls;
mod carry;
pub mod flows;
pub mod http;
pub mod meter;
pub mod plugin;
pub mod remote;
mod renew;
pub mod root;
mod settle;
pub mod wakeups;

#[cfg(test)]
mod tests;
