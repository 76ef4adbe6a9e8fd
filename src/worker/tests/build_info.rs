//! Which module runs: a root that starts sets the build-info gauge to 1, and the first root of
//! this Envoy to start this version takes the announcement key and writes the log line, all
//! once, at its start; requests never touch either, and a host that refuses the gauge does not
//! stop the root.

use super::{capture_logs, executed, host, logged, root};
use crate::build_info::{gauge, start_line, ANNOUNCED_KEY, REVISION, VERSION};
use crate::store::shared_data::SharedData;
use crate::worker::root::Root;

fn calls(tally: &std::collections::BTreeMap<&'static str, (u64, u64)>, call: &str) -> u64 {
    tally.get(call).map_or(0, |(c, _)| *c)
}

#[test]
fn a_root_that_starts_sets_the_build_info_gauge_once() {
    capture_logs();
    let h = host();
    let gauge = gauge();
    assert_eq!(h.gauge(&gauge), None);
    let _ = h.take_tally();
    let mut first = Root::new(1, h.clone());
    assert!(first.on_vm_start());
    let tally = h.take_tally();
    assert_eq!(calls(&tally, "define_metric"), 1, "{tally:?}");
    assert_eq!(calls(&tally, "record_metric"), 1, "{tally:?}");
    // The announcement: the key read, and taken by this first root.
    assert_eq!(calls(&tally, "get_shared_data"), 1, "{tally:?}");
    assert_eq!(calls(&tally, "set_shared_data"), 1, "{tally:?}");
    assert_eq!(tally.values().map(|(c, _)| c).sum::<u64>(), 4, "{tally:?}");
    assert_eq!(h.gauge(&gauge), Some(1));
    assert!(gauge.ends_with(&format!(".version.{VERSION}.revision.{REVISION}")), "{gauge}");
    assert_eq!(
        h.get(ANNOUNCED_KEY).map(|r| r.bytes().to_vec()),
        Ok(format!("{VERSION} {REVISION}").into_bytes())
    );
    assert_eq!(
        logged(log::Level::Info),
        vec![format!("idempotency-filter {VERSION} (revision {REVISION}) started")]
    );
    assert_eq!(start_line(), format!("idempotency-filter {VERSION} (revision {REVISION}) started"));

    // Another root (a worker, a configuration update) sets the same gauge, still 1, and finds
    // the version announced: one read, no write.
    let _ = h.take_tally();
    let mut second = Root::new(2, h.clone());
    assert!(second.on_vm_start());
    let tally = h.take_tally();
    assert_eq!(calls(&tally, "get_shared_data"), 1, "{tally:?}");
    assert_eq!(calls(&tally, "set_shared_data"), 0, "{tally:?}");
    assert_eq!(h.gauge(&gauge), Some(1));
    assert_eq!(logged(log::Level::Info).iter().filter(|l| l.ends_with(" started")).count(), 1);

    // Configuration and traffic leave both alone: nothing of it on a request's path.
    let root = root(&h);
    let _ = h.take_tally();
    executed(&h, &root, 3, "k-1", b"{}");
    let tally = h.take_tally();
    assert_eq!(calls(&tally, "define_metric") + calls(&tally, "record_metric"), 0, "{tally:?}");
    assert_eq!(h.gauge(&gauge), Some(1));
}

#[test]
fn a_refused_gauge_does_not_stop_the_root() {
    let h = host();
    h.fail("set_gauge", 2);
    let mut root = Root::new(1, h.clone());
    assert!(root.on_vm_start());
    assert_eq!(h.gauge(&gauge()), None);
    assert!(root.on_configure());
}
