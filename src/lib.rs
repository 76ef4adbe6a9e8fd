//! Idempotency-Key filter for Envoy. The engine (everything but `worker` and `glue`) is pure
//! Rust; the `worker` (a root's and its streams' runtime, the request's flow, the features) is
//! written against the `host` seam; both run under plain `cargo test`. `glue` is the raw
//! proxy-wasm ABI behind that seam, wasm32 only. See ARCHITECTURE.md.

pub mod build_info;
pub mod codec;
pub mod config;
pub mod ending;
pub mod engine;
#[cfg(feature = "testing")]
pub mod fuzz_checks;
pub mod host;
pub mod identity;
pub mod json;
pub mod metrics;
pub mod problem;
pub mod renewal;
pub mod router_control;
mod sort;
pub mod splitmix;
pub mod store;
// Public for the model checkers in tests/; private in the module, where LTO then treats every
// function of the worker as the module's own (2.3 KB smaller, measured with `make build`).
#[cfg(not(target_arch = "wasm32"))]
pub mod worker;
#[cfg(target_arch = "wasm32")]
mod worker;

// The raw ABI exists for wasm32 only: natively the worker runs against the fake host.
#[cfg(target_arch = "wasm32")]
mod glue;
