//! Idempotency-Key filter for Envoy. The engine (everything but `glue`) is pure Rust and runs
//! under plain `cargo test`; `glue` adapts it to Envoy's proxy-wasm host. See ARCHITECTURE.md.

pub mod canonical_json;
pub mod config;
pub mod engine;
pub mod fingerprint;
pub mod fuzz_checks;
pub mod key;
pub mod local_store;
pub mod outcome;
pub mod problem;
pub mod record;
pub mod scope;
pub mod shared_data;
pub mod store;
#[cfg(test)]
pub mod store_conformance;
pub mod wait;
pub mod wake;

#[cfg(target_arch = "wasm32")]
mod glue;
