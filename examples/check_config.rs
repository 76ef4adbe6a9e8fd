//! Checks plugin configurations with the filter's own parser, the one `on_configure` runs, so a
//! manifest (Istio `pluginConfig`, an EnvoyFilter's `configuration`) is refused here exactly as
//! the filter would refuse it at start. Used by tests/deploy; also handy before a rollout:
//!   cargo run -q --example check_config -- config.json [more.json ...]
//! Prints `ok <file>` or `error <file>: <reason naming the field>` per file; exits 1 if any
//! file is refused or unreadable.

use idempotency_filter::config::parse;
use std::process::ExitCode;

fn main() -> ExitCode {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() {
        eprintln!("usage: check_config FILE.json [FILE.json ...]");
        return ExitCode::from(2);
    }
    let mut refused = 0;
    for file in &files {
        match std::fs::read(file) {
            Ok(bytes) => match parse(&bytes) {
                Ok(_) => println!("ok {file}"),
                Err(e) => {
                    refused += 1;
                    println!("error {file}: {e}");
                }
            },
            Err(e) => {
                refused += 1;
                println!("error {file}: cannot read: {e}");
            }
        }
    }
    if refused == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
