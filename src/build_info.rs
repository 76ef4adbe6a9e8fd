//! Which module this is: the crate's version (Cargo.toml, `env!("CARGO_PKG_VERSION")`), said
//! once when a root context starts, never on a request's path (worker/root.rs, `on_vm_start`):
//!
//! - one log line at info level, `idempotency-filter <version> started`, written by the first
//!   root of an Envoy (of its vm_id) to start this version: the shared-data key `ANNOUNCED_KEY`
//!   remembers it, across configuration updates and VM reloads, not across a process restart;
//! - the gauge `idempotency.build_info.version.<version>`, set to 1. Envoy names it
//!   `wasmcustom.idempotency.build_info.version.<version>`; the `version` stats tag of the
//!   shipped configs (envoy/envoy.yaml, istio/stats-tags.yaml) takes the version out of the name,
//!   so Prometheus sees `idempotency_build_info{version="<version>"} 1`, the usual build-info
//!   form; without the tag it is `idempotency_build_info_version_<version with _>`
//!   (docs/OPERATIONS.md, "Which version runs").
//!
//! A gauge, set rather than added to: every root of every worker sets the same Envoy stat to 1,
//! so it reads 1 whatever the number of workers.

use crate::store::shared_data::{SharedData, SharedDataError};

/// The crate's version, as Cargo.toml, the CHANGELOG and the OCI image's tag give it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The gauge's stat name (Envoy prefixes `wasmcustom.`).
pub const GAUGE: &str = concat!("idempotency.build_info.version.", env!("CARGO_PKG_VERSION"));

/// The log line the first root to start this version writes.
pub const START_LINE: &str = concat!("idempotency-filter ", env!("CARGO_PKG_VERSION"), " started");

/// The shared-data key holding the version this Envoy (this vm_id) has announced.
pub const ANNOUNCED_KEY: &str = "idempotency.build_info.announced";

/// Whether this root is the first to start this version here, and so writes `START_LINE`: the
/// canary, the main thread and every worker start a root, and a configuration update starts
/// them all again, all in one Envoy whose log should say it once. A root that finds the key
/// holding this version stays quiet; one that finds it missing or holding another version
/// (a module updated in place) takes it. Creating a missing key is racy (store/shared_data.rs),
/// so two roots starting at the same instant may both say it; a host that refuses the key gets
/// the line from every root rather than from none.
pub fn first_to_announce<D: SharedData>(data: &D) -> bool {
    match data.get(ANNOUNCED_KEY) {
        Ok(read) if read.bytes() == VERSION.as_bytes() => false,
        Ok(read) => !matches!(
            data.set(ANNOUNCED_KEY, VERSION.as_bytes(), read.cas),
            Err(SharedDataError::CasMismatch)
        ),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauge_and_the_line_carry_the_crate_version() {
        assert_eq!(GAUGE, format!("idempotency.build_info.version.{VERSION}"));
        assert_eq!(START_LINE, format!("idempotency-filter {VERSION} started"));
    }

    #[test]
    fn the_first_root_to_start_a_version_announces_it() {
        let data = crate::store::fake::FakeSharedData::new();
        assert!(first_to_announce(&data));
        // The other roots of this Envoy, and those a configuration update starts, stay quiet.
        assert!(!first_to_announce(&data));
        assert!(!first_to_announce(&data));
        // A module updated in place (another version announced last) says it again, once.
        data.poke(ANNOUNCED_KEY, b"0.0.1");
        assert!(first_to_announce(&data));
        assert!(!first_to_announce(&data));
        // Two roots that read the other version at once: the CAS lets one of them say it.
        data.poke(ANNOUNCED_KEY, b"0.0.1");
        data.force_cas_mismatches(1);
        assert!(!first_to_announce(&data));
    }

    #[test]
    fn the_version_is_semver_the_stats_tag_can_take_whole() {
        // MAJOR.MINOR.PATCH, digits only, between releases with a pre-release (`-dev`, letters):
        // the tag's regex takes everything after `version.`, and Envoy keeps these characters in
        // a stat name (its Prometheus output turns `.` and `-` into `_` only without the tag).
        let (release, pre) = VERSION.split_once('-').unwrap_or((VERSION, ""));
        let parts: Vec<&str> = release.split('.').collect();
        assert_eq!(parts.len(), 3, "{VERSION}");
        assert!(parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())), "{VERSION}");
        assert!(pre.bytes().all(|b| b.is_ascii_lowercase()), "{VERSION}");
    }
}
