//! The proxy-wasm ABI, wasm32 only and without decisions of its own: `host.rs` is the raw ABI
//! behind the `Host` trait (`crate::host`), `abi.rs` the module's exports (Envoy's callbacks,
//! routed by context id to the worker's `Root` and `Http`).

mod abi;
mod host;
