//! The proxy-wasm adapter: Envoy's callbacks in, the engine's decisions out as host calls.
//! Compiled for wasm32 only, so no native test can reach a host call.

mod host;
mod http;
mod root;

use proxy_wasm::traits::RootContext;

static LOGGER: host::HostLogger = host::HostLogger;

proxy_wasm::main! {{
    // Our own logger and panic hook instead of the SDK's: both of its versions unwrap host calls.
    // No host calls here: Envoy refuses them while the module initializes.
    let _ = log::set_logger(&LOGGER);
    std::panic::set_hook(Box::new(|info| host::log(host::LOG_CRITICAL, &format!("{info}"))));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> { Box::new(root::Root::new(context_id)) });
}}

/// Follows Envoy's log level for the wasm component, so that debug lines are not even formatted
/// unless someone asked for them.
fn follow_host_log_level() {
    log::set_max_level(match host::log_level() {
        0 => log::LevelFilter::Trace,
        1 => log::LevelFilter::Debug,
        2 => log::LevelFilter::Info,
        3 => log::LevelFilter::Warn,
        4 => log::LevelFilter::Error,
        _ => log::LevelFilter::Off,
    });
}
