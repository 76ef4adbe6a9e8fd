//! The one place a store is built from its configuration, as Envoy's cache filter asks its
//! `HttpCacheFactory` for a cache: the worker asks for the configured store on the one seam
//! (`seam::Store`) and never names a backend.

use crate::config::StoreConfig;
use crate::store::etcd::remote::EtcdRemote;
use crate::store::etcd::shards::EtcdShards;
use crate::store::etcd::EtcdStore;
use crate::store::local::LocalStore;
use crate::store::remote::RemoteSettings;
use crate::store::seam::Store;
use crate::store::shared_data::SharedData;
use crate::store::OnLeaseEnd;

/// A store ready for traffic, and what the start-up line says of it.
pub struct Opened {
    pub store: Box<dyn Store>,
    /// "local store: <capacity> records in <n> buckets[, <n> tombstones] (<n> keys created)" or "remote store on
    /// cluster(s) <names>", after "configured <n> route rule(s); " in the worker's start-up line.
    pub described: String,
}

/// The store `config` names: the local store in `data` (its keys created now, before traffic,
/// and `secret` its placement secret unless another worker's is there already), or etcd (one
/// cluster, or shards). `lease_ends`: what every rule asks of a lease that ended without an
/// outcome; an abandoned claim makes room for a new record only when each says take it over
/// (`OnLeaseEnd::may_evict`). `quota`: whether the configuration counts quotas (a local store
/// made without makes no quota keys). Err: the line that says why the configuration is refused.
pub fn open<S: SharedData + 'static>(
    config: &StoreConfig,
    data: S,
    secret: [u8; 32],
    now_ms: u64,
    lease_ends: &[OnLeaseEnd],
    quota: bool,
) -> Result<Opened, String> {
    let store: Box<dyn Store> = match config {
        StoreConfig::Etcd(settings) if settings.shards.len() > 1 || !settings.previous_shards.is_empty() => {
            Box::new(EtcdShards::new(settings))
        }
        StoreConfig::Etcd(settings) => {
            let one = settings.shard_settings().into_iter().next().unwrap_or_else(|| settings.clone());
            Box::new(EtcdRemote::new(EtcdStore::new(one)))
        }
        StoreConfig::Local { capacity, tombstones } => {
            let keep = lease_ends.iter().any(|end| !end.may_evict());
            let store = LocalStore::open_for(data, *capacity, secret, now_ms, quota)
                .and_then(|s| s.keeping_tombstones(*tombstones, now_ms))
                .map_err(|e| format!("cannot prepare the local store: {e}"))?
                .keeping_abandoned_claims(keep);
            let room = match store.tombstone_room() {
                0 => String::new(),
                n => format!(", {n} tombstones"),
            };
            let described = format!(
                "local store: {} records in {} buckets{room} ({} keys created)",
                store.capacity(),
                store.buckets(),
                store.keys_created()
            );
            return Ok(Opened { store: Box::new(store), described });
        }
    };
    Ok(Opened { described: remote_described(store.as_ref()), store })
}

/// How to reach each shard of a remote store, in shard order (none for a store in place).
pub fn remotes(store: &dyn Store) -> impl Iterator<Item = &RemoteSettings> {
    (0..=u8::MAX).map_while(|shard| store.remote_for(shard))
}

/// What the start-up line says of a store across the network: its clusters.
pub fn remote_described(store: &dyn Store) -> String {
    let clusters: Vec<&str> = remotes(store).map(|r| r.cluster.as_str()).collect();
    format!("remote store on cluster{} {}", if clusters.len() == 1 { "" } else { "s" }, clusters.join(", "))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)] // a failing unwrap is a failing test
mod tests {
    use super::*;
    use crate::store::conformance::{attempt, LEASE};
    use crate::store::fake::FakeSharedData;
    use crate::store::seam::Started;
    use crate::store::{Begin, StoreAnswer, StoreOp};

    fn store_config(store: &str) -> StoreConfig {
        let json = format!(r#"{{"store":{store},"routes":[{{"name":"r","match":{{"prefix":"/"}}}}]}}"#);
        crate::config::parse(json.as_bytes()).unwrap().store
    }

    fn begin(store: &dyn Store, scope_n: u64, now_ms: u64) -> Begin {
        match store.start(StoreOp::Begin(attempt(scope_n, 1, scope_n, now_ms)), &|| now_ms) {
            Started::Answered(StoreAnswer::Begun(Ok(b))) => b,
            _ => panic!("the local store answers a begin at once"),
        }
    }

    /// The configured backend, described as the start-up line always said it.
    #[test]
    fn each_configuration_opens_its_store_and_says_which() {
        let data: &'static FakeSharedData = Box::leak(Box::new(FakeSharedData::new()));
        let local =
            open(&store_config(r#"{"type":"local","capacity":100}"#), data, [1; 32], 0, &[], true).unwrap();
        assert!(local.store.remote().is_none());
        assert!(
            local.described.starts_with("local store: 100 records in 19 buckets (")
                && local.described.ends_with(" keys created)"),
            "{}",
            local.described
        );
        let one =
            open(&store_config(r#"{"type":"etcd","cluster":"etcd-main"}"#), data, [1; 32], 0, &[], true)
                .unwrap();
        assert_eq!(one.described, "remote store on cluster etcd-main");
        let shards = r#"{"type":"etcd","shards":[{"cluster":"etcd-a"},{"cluster":"etcd-b"}]}"#;
        let two = open(&store_config(shards), data, [1; 32], 0, &[], true).unwrap();
        assert_eq!(two.described, "remote store on clusters etcd-a, etcd-b");
        assert_eq!(remotes(two.store.as_ref()).count(), 2);
    }

    /// An abandoned claim makes room for a new record only while every rule would take it over.
    #[test]
    fn an_abandoned_claim_is_evicted_only_when_every_rule_takes_lease_ends_over() {
        for (lease_ends, evicted) in [
            (&[OnLeaseEnd::TakeOver][..], true),
            (&[OnLeaseEnd::TakeOver, OnLeaseEnd::MarkUnknown][..], false),
            (&[OnLeaseEnd::Report][..], false),
        ] {
            let data: &'static FakeSharedData = Box::leak(Box::new(FakeSharedData::new()));
            let config = store_config(r#"{"type":"local","capacity":1}"#);
            let opened = open(&config, data, [1; 32], 0, lease_ends, true).unwrap();
            assert!(matches!(begin(opened.store.as_ref(), 1, 0), Begin::Claimed(_)));
            let next = begin(opened.store.as_ref(), 2, LEASE);
            assert_eq!(matches!(next, Begin::Claimed(_)), evicted, "{lease_ends:?}: {next:?}");
        }
    }
}
