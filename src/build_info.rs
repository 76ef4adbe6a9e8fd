//! Which module this is: the crate's version (Cargo.toml, `env!("CARGO_PKG_VERSION")`) and the
//! source revision it was built from, said once when a root context starts, never on a
//! request's path (worker/root.rs, `on_vm_start`):
//!
//! - one log line at info level, `idempotency-filter <version> (revision <revision>) started`,
//!   written by the first root of an Envoy (of its vm_id) to start this build: the shared-data
//!   key `ANNOUNCED_KEY` remembers it, across configuration updates and VM reloads, not across a
//!   process restart;
//! - the gauge `idempotency.build_info.version.<version>.revision.<revision>`, set to 1. Envoy
//!   names it `wasmcustom.idempotency.build_info.version.<version>.revision.<revision>`; the
//!   `version` and `revision` stats tags of the shipped configs (envoy/envoy.yaml,
//!   istio/stats-tags.yaml) take both out of the name, so Prometheus sees
//!   `idempotency_build_info{version="<version>",revision="<revision>"} 1`, the usual build-info
//!   form; without the tags it is `idempotency_build_info_version_<version>_revision_<revision>`
//!   with `.` and `-` as `_` (docs/OPERATIONS.md, "Which version runs").
//!
//! The revision is the commit that last changed the module's sources, 12 hex digits, which
//! `make build` hands to rustc as IDEMPOTENCY_REVISION (deploy/oci/revision.py says how it is
//! found); `unknown` where the build could not tell (sources changed and not committed, a
//! `cargo build` outside make). Two modules that both say `0.3.0-dev` are told apart by it, and
//! the version skew alert counts them as two builds.
//!
//! A gauge, set rather than added to: every root of every worker sets the same Envoy stat to 1,
//! so it reads 1 whatever the number of workers.

use crate::store::shared_data::{SharedData, SharedDataError};

/// The crate's version, as Cargo.toml, the CHANGELOG and the OCI image's tag give it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit that last changed the module's sources (12 hex digits), or `unknown`.
pub const REVISION: &str = match option_env!("IDEMPOTENCY_REVISION") {
    Some(revision) => revision,
    None => "unknown",
};

// Another value is a build error, not a stat name the stats tag cannot take.
const _: () = assert!(is_revision(REVISION), "IDEMPOTENCY_REVISION: 12 lowercase hex digits or `unknown`");

/// What a revision may be: it becomes part of a stat name, and the `revision` stats tag takes
/// only these characters.
const fn is_revision(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() == 7 && matches!(b, b"unknown") {
        return true;
    }
    if b.len() != 12 {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if !matches!(b[i], b'0'..=b'9' | b'a'..=b'f') {
            return false;
        }
        i += 1;
    }
    true
}

/// The gauge's stat name (Envoy prefixes `wasmcustom.`). Made once per root start.
pub fn gauge() -> String {
    format!("idempotency.build_info.version.{VERSION}.revision.{REVISION}")
}

/// The log line the first root to start this build writes.
pub fn start_line() -> String {
    format!("idempotency-filter {VERSION} (revision {REVISION}) started")
}

/// What `ANNOUNCED_KEY` holds once this build is announced: a build of the same version from
/// other sources is announced again.
fn announced() -> String {
    format!("{VERSION} {REVISION}")
}

/// The shared-data key holding the build this Envoy (this vm_id) has announced.
pub const ANNOUNCED_KEY: &str = "idempotency.build_info.announced";

/// Whether this root is the first to start this version here, and so writes `START_LINE`: the
/// canary, the main thread and every worker start a root, and a configuration update starts
/// them all again, all in one Envoy whose log should say it once. A root that finds the key
/// holding this version stays quiet; one that finds it missing or holding another version
/// (a module updated in place) takes it. Creating a missing key is racy (store/shared_data.rs),
/// so two roots starting at the same instant may both say it; a host that refuses the key gets
/// the line from every root rather than from none.
pub fn first_to_announce<D: SharedData>(data: &D) -> bool {
    let build = announced();
    match data.get(ANNOUNCED_KEY) {
        Ok(read) if read.bytes() == build.as_bytes() => false,
        Ok(read) => {
            !matches!(data.set(ANNOUNCED_KEY, build.as_bytes(), read.cas), Err(SharedDataError::CasMismatch))
        }
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauge_and_the_line_carry_the_crate_version_and_the_revision() {
        assert_eq!(gauge(), format!("idempotency.build_info.version.{VERSION}.revision.{REVISION}"));
        assert_eq!(start_line(), format!("idempotency-filter {VERSION} (revision {REVISION}) started"));
    }

    #[test]
    fn a_revision_is_twelve_hex_digits_or_unknown() {
        assert!(is_revision(REVISION), "{REVISION}");
        for good in ["unknown", "cf5a9608d8c3", "000000000000"] {
            assert!(is_revision(good), "{good}");
        }
        // What the stats tag could not take whole, or would take for another tag's.
        for bad in
            ["", "cf5a960", "CF5A9608D8C3", "cf5a9608d8c3388c", "cf5a9608d8c.", "unknowns", "g00000000000"]
        {
            assert!(!is_revision(bad), "{bad}");
        }
    }

    #[test]
    fn the_first_root_to_start_a_version_announces_it() {
        let data = crate::store::fake::FakeSharedData::new();
        assert!(first_to_announce(&data));
        // The other roots of this Envoy, and those a configuration update starts, stay quiet.
        assert!(!first_to_announce(&data));
        assert!(!first_to_announce(&data));
        // A module updated in place (another build announced last) says it again, once.
        data.poke(ANNOUNCED_KEY, b"0.0.1 unknown");
        assert!(first_to_announce(&data));
        assert!(!first_to_announce(&data));
        // The same version from other sources is another build.
        data.poke(ANNOUNCED_KEY, format!("{VERSION} 0123456789ab").as_bytes());
        assert!(first_to_announce(&data));
        assert!(!first_to_announce(&data));
        // Two roots that read the other version at once: the CAS lets one of them say it.
        data.poke(ANNOUNCED_KEY, b"0.0.1 unknown");
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
