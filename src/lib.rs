//! Idempotency-Key filter for Envoy. The engine (everything but `glue`) is pure Rust and runs
//! under plain `cargo test`; `glue` adapts it to Envoy's proxy-wasm host. See ARCHITECTURE.md.

pub mod admin;
pub mod build_info;
pub mod codec;
pub mod config;
pub mod detached;
pub mod ending;
pub mod engine;
pub mod flow;
#[cfg(feature = "testing")]
pub mod fuzz_checks;
pub mod identity;
pub mod json;
pub mod metrics;
pub mod problem;
pub mod reconcile;
pub mod renewal;
pub mod router_control;
mod sort;
pub mod splitmix;
pub mod store;
pub mod wait;

// Native builds compile the glue for its tests only: the shipped adapter is the wasm32 one.
#[cfg(any(target_arch = "wasm32", test))]
mod glue;
