//! The etcd store's section of the configuration (`store.type: "etcd"`): its settings, their
//! defaults and limits, and what a route may ask of a store kept in etcd. Its one home: the
//! etcd store (`store::etcd`) is built from these settings and imports its size limits from
//! here, while `config` depends on nothing of the store, so the configuration can be read (and
//! its limits changed) without the backend.

use super::fields::{
    array, duration_ms, err, index, key, object, optional, reject_unknown, required, string, uint, Obj, Res,
};
use super::Rule;
use crate::json::JsonValue as Value;

/// What to do when etcd cannot be used (unreachable, erroring, too slow).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Refuse the request (503 store-unavailable): the guarantee is never silently dropped.
    #[default]
    FailClosed,
    /// Forward the request unprotected, counted and logged.
    FailOpen,
}

/// How the store speaks to etcd (`store.protocol`): etcd serves its v3 API both ways on its
/// client port. docs/ETCD.md (JSON gateway or native gRPC) has what each costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// JSON over HTTP/1.1 to etcd's gateway (`/v3/kv/txn`, ...): works on any cluster, so the
    /// default; the gateway costs etcd about twice the CPU of gRPC per call.
    #[default]
    Json,
    /// etcd's gRPC API (`/etcdserverpb.KV/Txn`, ...): protobuf in gRPC frames. The cluster must
    /// speak HTTP/2 to etcd (`http2_protocol_options`).
    Grpc,
}

/// Credentials for etcd's Authenticate call.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    pub username: String,
    pub password: String,
}

/// The password never reaches a log line, whoever formats the settings.
impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

/// The etcd store's configuration (`store.type: "etcd"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    /// Envoy cluster name pointing at etcd's client URLs (with `shards`: the first shard's).
    pub cluster: String,
    /// The callouts' `:authority` (with `shards`: the first shard's).
    pub authority: String,
    /// Key prefix every key of this store lives under.
    pub prefix: String,
    /// Per callout.
    pub timeout_ms: u64,
    pub on_error: OnStoreError,
    pub auth: Option<EtcdAuth>,
    /// `store.auth.timeout`: the token fetch's callout (authenticate is a bcrypt check and a Raft
    /// write on etcd: slow when etcd is loaded, and every conversation waiting for it waits this long
    /// at most).
    pub auth_timeout_ms: u64,
    /// `store.replay_cache`: None (the default) answers every begin from etcd.
    pub replay_cache: Option<ReplayCacheSettings>,
    pub protocol: Protocol,
    /// `store.shards`: every shard, each its own etcd cluster, in the configured order; empty
    /// when `store.cluster` names the one cluster. `shard_settings` gives each its settings.
    pub shards: Vec<EtcdShard>,
    /// `store.previous_shards`: while the shard list changes, the list before the change
    /// (docs/ETCD.md, Shards); empty otherwise.
    pub previous_shards: Vec<EtcdShard>,
}

/// One etcd cluster of `store.shards`: what differs from shard to shard. A record's shard is
/// chosen by its scope (`store::etcd::shards`), so every Envoy of a fleet must list the same
/// clusters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdShard {
    pub cluster: String,
    pub authority: String,
    pub auth: Option<EtcdAuth>,
}

impl EtcdSettings {
    /// The settings of each shard's store: these, with the shard's cluster, authority and
    /// credentials; just these without `shards`.
    pub fn shard_settings(&self) -> Vec<EtcdSettings> {
        if self.shards.is_empty() {
            return vec![self.clone()];
        }
        self.shards
            .iter()
            .map(|shard| EtcdSettings {
                cluster: shard.cluster.clone(),
                authority: shard.authority.clone(),
                auth: shard.auth.clone(),
                shards: Vec::new(),
                previous_shards: Vec::new(),
                ..self.clone()
            })
            .collect()
    }

    /// The settings of each shard of the previous list, as `shard_settings`; none when no
    /// change is under way.
    pub fn previous_shard_settings(&self) -> Vec<EtcdSettings> {
        if self.previous_shards.is_empty() {
            return Vec::new();
        }
        EtcdSettings { shards: self.previous_shards.clone(), previous_shards: Vec::new(), ..self.clone() }
            .shard_settings()
    }
}

/// What the calls to etcd name as `:authority` unless a shard names its own: etcd reads no host
/// (gateway or gRPC), but Go's HTTP server refuses an invalid one (an Istio cluster name such as
/// `outbound|2379||etcd...` is).
pub const DEFAULT_AUTHORITY: &str = "etcd";
/// Most shards one store may have: each is a cluster every worker keeps leases, a token and a
/// replay cache for.
pub const MAX_SHARDS: usize = 32;

pub const DEFAULT_PREFIX: &str = "/idempotency/";
pub const DEFAULT_TIMEOUT_MS: u64 = 250;
pub const DEFAULT_AUTH_TIMEOUT_MS: u64 = 2_000;

/// etcd's default `--max-request-bytes` (1.5 MiB): the largest request, so the largest
/// transaction writing a record, etcd accepts.
pub const ETCD_MAX_REQUEST_BYTES: u64 = 1_572_864;
/// What a completion's transaction carries besides the response body: the record's entry and
/// snapshot framing, the response headers (Envoy refuses response headers over 60 KiB by
/// default; 64 KiB kept), the record and index keys and protobuf framing (4 KiB kept).
pub const RECORD_OVERHEAD_BYTES: u64 = (64 + 4) * 1024;
/// The largest `max_response_bytes` a route may have with the etcd store.
pub const MAX_STORED_BODY_BYTES: u64 = ETCD_MAX_REQUEST_BYTES - RECORD_OVERHEAD_BYTES;

/// Configured bounds (`store.replay_cache`), per worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCacheSettings {
    pub entries: u32,
    pub max_bytes: u64,
}

pub const DEFAULT_REPLAY_CACHE_ENTRIES: u32 = 1_024;
pub const DEFAULT_REPLAY_CACHE_BYTES: u64 = 8 * 1024 * 1024;
pub const MAX_REPLAY_CACHE_ENTRIES: u32 = 100_000;
pub const MAX_REPLAY_CACHE_BYTES: u64 = 256 * 1024 * 1024;
/// Smallest `store.replay_cache.max_bytes`: a few small records.
const MIN_REPLAY_CACHE_BYTES: u64 = 4_096;

/// What a route asks of the store that the etcd store cannot give.
pub(super) fn etcd_fits(r: &Rule, path: &str) -> Res<()> {
    // A record is written in one etcd request, which etcd bounds (--max-request-bytes).
    if r.max_response_bytes > MAX_STORED_BODY_BYTES {
        return Err(err(
            &key(path, "max_response_bytes"),
            format!(
                "{} bytes cannot be stored in etcd: a record must fit its {}-byte request limit, which leaves at most {} bytes of body",
                r.max_response_bytes,
                ETCD_MAX_REQUEST_BYTES,
                MAX_STORED_BODY_BYTES
            ),
        ));
    }
    Ok(())
}

/// Longest a callout to etcd may take: a request stays paused for it.
const MAX_ETCD_TIMEOUT_MS: u64 = 10_000;
const MAX_ETCD_PREFIX_LEN: usize = 128;

pub(super) fn etcd_settings(o: &Obj, path: &str) -> Res<EtcdSettings> {
    reject_unknown(
        o,
        path,
        &[
            "type",
            "cluster",
            "shards",
            "previous_shards",
            "prefix",
            "timeout",
            "on_error",
            "auth",
            "replay_cache",
            "protocol",
        ],
    )?;
    let shards = optional(o, path, "shards", shard_list)?.unwrap_or_default();
    let cluster = match (shards.first(), o.iter().any(|(k, _)| k == "cluster")) {
        (Some(_), true) => {
            return Err(err(
                &key(path, "shards"),
                "store.cluster and store.shards together: give one of them",
            ))
        }
        (Some(first), false) => first.cluster.clone(),
        (None, _) => optional(o, path, "cluster", cluster_name)?
            .ok_or_else(|| err(&key(path, "cluster"), "required (or store.shards: a list of clusters)"))?,
    };
    let prefix = optional(o, path, "prefix", |v, f| {
        let s = string(v, f)?;
        // Keys are `<prefix>r/...` and `<prefix>q/...`: a prefix ending in '/' keeps them apart
        // from whatever else lives in the same etcd.
        if s.is_empty()
            || !s.ends_with('/')
            || s.len() > MAX_ETCD_PREFIX_LEN
            || s.chars().any(char::is_control)
        {
            return Err(err(
                f,
                format!(
                    "expected 1 to {MAX_ETCD_PREFIX_LEN} bytes ending in '/', without control characters"
                ),
            ));
        }
        Ok(s.to_owned())
    })?
    .unwrap_or_else(|| DEFAULT_PREFIX.into());
    let timeout_ms = optional(o, path, "timeout", callout_timeout)?.unwrap_or(DEFAULT_TIMEOUT_MS);
    let on_error = optional(o, path, "on_error", |v, f| match string(v, f)? {
        "fail_closed" => Ok(OnStoreError::FailClosed),
        "fail_open" => Ok(OnStoreError::FailOpen),
        other => Err(err(f, format!("{other:?}: expected \"fail_closed\" or \"fail_open\""))),
    })?
    .unwrap_or_default();
    let mut auth_timeout_ms = DEFAULT_AUTH_TIMEOUT_MS;
    let auth = optional(o, path, "auth", |v, f| {
        let a = object(v, f, &["username", "password", "timeout"])?;
        // The token fetch is its own callout: authenticate costs etcd a bcrypt check and a Raft
        // write, slow under load, and every conversation needing a token waits for the one fetch.
        if let Some(ms) = optional(a, f, "timeout", callout_timeout)? {
            auth_timeout_ms = ms;
        }
        credentials(a, f)
    })?;
    let previous_shards = optional(o, path, "previous_shards", shard_list)?.unwrap_or_default();
    if !previous_shards.is_empty() && o.iter().all(|(k, _)| k != "shards") {
        return Err(err(&key(path, "previous_shards"), "only with store.shards (the list it changes to)"));
    }
    // A shard without credentials of its own uses the store's.
    let own = |list: Vec<EtcdShard>| -> Vec<EtcdShard> {
        list.into_iter().map(|s| EtcdShard { auth: s.auth.or_else(|| auth.clone()), ..s }).collect()
    };
    let (shards, previous_shards) = (own(shards), own(previous_shards));
    // A cluster on both lists is one etcd: reached one way.
    for (i, before) in previous_shards.iter().enumerate() {
        if shards.iter().any(|now| now.cluster == before.cluster && now != before) {
            return Err(err(
                &index(&key(path, "previous_shards"), i),
                format!("{:?} is on store.shards with another authority or auth: one cluster, one way to reach it", before.cluster),
            ));
        }
    }
    let (authority, auth) = match shards.first() {
        Some(first) => (first.authority.clone(), first.auth.clone()),
        None => (DEFAULT_AUTHORITY.to_string(), auth),
    };
    // Off unless asked for: it is memory in every worker's Wasm VM (which never gives memory
    // back), sized by the operator for the replays worth keeping; see docs/ETCD.md.
    let replay_cache = optional(o, path, "replay_cache", |v, f| {
        let c = object(v, f, &["entries", "max_bytes"])?;
        let entries = optional(c, f, "entries", |v, f| uint(v, f, 1, u64::from(MAX_REPLAY_CACHE_ENTRIES)))?
            .map_or(Ok(DEFAULT_REPLAY_CACHE_ENTRIES), |n| {
            u32::try_from(n).map_err(|_| err(&key(f, "entries"), "out of range"))
        })?;
        let max_bytes =
            optional(c, f, "max_bytes", |v, f| uint(v, f, MIN_REPLAY_CACHE_BYTES, MAX_REPLAY_CACHE_BYTES))?
                .unwrap_or(DEFAULT_REPLAY_CACHE_BYTES);
        Ok(ReplayCacheSettings { entries, max_bytes })
    })?;
    let protocol = optional(o, path, "protocol", |v, f| match string(v, f)? {
        "json" => Ok(Protocol::Json),
        "grpc" => Ok(Protocol::Grpc),
        other => Err(err(f, format!("{other:?}: expected \"json\" or \"grpc\""))),
    })?
    .unwrap_or_default();
    Ok(EtcdSettings {
        cluster,
        authority,
        prefix,
        timeout_ms,
        on_error,
        auth,
        auth_timeout_ms,
        replay_cache,
        protocol,
        shards,
        previous_shards,
    })
}

fn cluster_name(v: &Value, f: &str) -> Res<String> {
    let s = string(v, f)?;
    if s.is_empty() || s.chars().any(char::is_control) {
        return Err(err(f, "expected the name of an Envoy cluster"));
    }
    Ok(s.to_owned())
}

fn callout_timeout(v: &Value, f: &str) -> Res<u64> {
    let ms = duration_ms(v, f)?;
    if ms > MAX_ETCD_TIMEOUT_MS {
        return Err(err(f, format!("{ms} ms exceeds the longest callout, {MAX_ETCD_TIMEOUT_MS} ms")));
    }
    Ok(ms)
}

fn credentials(a: &Obj, f: &str) -> Res<EtcdAuth> {
    let part = |v: &Value, f: &str| -> Res<String> {
        let s = string(v, f)?;
        if s.is_empty() {
            return Err(err(f, "must not be empty"));
        }
        Ok(s.to_owned())
    };
    Ok(EtcdAuth { username: required(a, f, "username", part)?, password: required(a, f, "password", part)? })
}

/// `store.shards`: 1 to `MAX_SHARDS` distinct clusters. A record's shard is chosen by hashing
/// with the cluster's name, so a cluster listed twice would be one etcd holding two shards'
/// records under one name: refused.
fn shard_list(v: &Value, path: &str) -> Res<Vec<EtcdShard>> {
    let items = array(v, path)?;
    if items.is_empty() || items.len() > MAX_SHARDS {
        return Err(err(path, format!("expected 1 to {MAX_SHARDS} shards, got {}", items.len())));
    }
    let mut out: Vec<EtcdShard> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = index(path, i);
        let o = object(item, &p, &["cluster", "authority", "auth"])?;
        let cluster = required(o, &p, "cluster", cluster_name)?;
        if let Some(first) = out.iter().position(|s| s.cluster == cluster) {
            return Err(err(&key(&p, "cluster"), format!("{cluster:?} is shard {first}'s cluster already")));
        }
        let authority = optional(o, &p, "authority", |v, f| {
            let s = string(v, f)?;
            if s.is_empty()
                || s.len() > 255
                || !s.bytes().all(|b| b.is_ascii_graphic() && b != b'|' && b != b'/')
            {
                return Err(err(f, "expected a host name (etcd's HTTP server refuses an invalid one)"));
            }
            Ok(s.to_owned())
        })?
        .unwrap_or_else(|| DEFAULT_AUTHORITY.to_string());
        let auth = optional(o, &p, "auth", |v, f| credentials(object(v, f, &["username", "password"])?, f))?;
        out.push(EtcdShard { cluster, authority, auth });
    }
    Ok(out)
}
