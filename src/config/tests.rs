//! The configuration's table tests: each case is a JSON document and the field its error must
//! name (or the `Config` it must yield), so the format's every rule is stated once, here.

use super::etcd::{EtcdAuth, EtcdSettings, OnStoreError, Protocol, ReplayCacheSettings};
use super::*;
use crate::router_control::EnvoyHeaders;
use StatusPattern::{Class, Code};

/// Top-level fields before a minimal valid route list.
fn top(fields: &str) -> String {
    format!(r#"{{{fields},"routes":[{{"name":"a","match":{{"prefix":"/"}}}}]}}"#)
}

/// Extra fields inside an otherwise minimal route.
fn rule_json(fields: &str) -> String {
    format!(r#"{{"routes":[{{"name":"a","match":{{"prefix":"/"}},{fields}}}]}}"#)
}

fn matcher(m: &str) -> String {
    format!(r#"{{"routes":[{{"name":"a","match":{m}}}]}}"#)
}

fn parse_str(s: &str) -> Result<Config, ConfigError> {
    parse(s.as_bytes())
}

fn only_rule(json: &str) -> Rule {
    match parse_str(json) {
        Ok(mut c) if c.rules.len() == 1 => (*c.rules.remove(0)).clone(),
        other => unreachable!("{json}: {other:?}"),
    }
}

fn default_rule(name: &str, path: PathMatch) -> Rule {
    Rule {
        name: name.into(),
        path,
        methods: vec!["POST".into(), "PATCH".into()],
        require_key: false,
        key: KeySource::Header { name: "idempotency-key".into(), own: false },
        ttl_ms: 86_400_000,
        processing_timeout_ms: 30_000,
        max_request_bytes: 1_048_576,
        max_response_bytes: 1_048_576,
        fingerprint_headers: vec![],
        ignore_json_fields: vec![],
        statuses: StatusPolicy {
            store: vec![Class(2), Class(3), Class(4)],
            release: vec![Class(5), Code(401), Code(403), Code(408), Code(409), Code(425), Code(429)],
        },
        replay_exclude_headers: vec![],
        concurrency: Concurrency::Reject,
        execution: Execution::Inline,
        unknown_outcome: UnknownOutcome::Refuse,
        reconcile: None,
        tombstone_ms: 0,
    }
}

#[test]
fn a_rule_s_key_source() {
    let header = |own: bool, name: &str| KeySource::Header { name: name.into(), own };
    let cases: &[(&str, KeySource, u64, u64)] = &[
        ("", header(false, "idempotency-key"), 86_400_000, 30_000),
        (r#","key":{"header":"X-Request-ID"}"#, header(true, "x-request-id"), 86_400_000, 30_000),
        // key_header's own name is key_header's key: one record, as without `key`.
        (r#","key":{"header":"Idempotency-Key"}"#, header(false, "idempotency-key"), 86_400_000, 30_000),
        (
            r#","key":{"json":"/order/id~1x"}"#,
            KeySource::Json { pointer: "/order/id~1x".into(), tokens: vec!["order".into(), "id/x".into()] },
            86_400_000,
            30_000,
        ),
        // The window is the ttl, and the default lease fits in it.
        (r#","key":{"fingerprint":{"window":"3s"}}"#, KeySource::Fingerprint, 3_000, 3_000),
        (r#","key":{"fingerprint":{"window":"10m"}}"#, KeySource::Fingerprint, 600_000, 30_000),
    ];
    for (extra, source, ttl_ms, lease_ms) in cases {
        let r = only_rule(&format!(r#"{{"routes":[{{"name":"a","match":{{"prefix":"/"}}{extra}}}]}}"#));
        assert_eq!((&r.key, r.ttl_ms, r.processing_timeout_ms), (source, *ttl_ms, *lease_ms), "{extra}");
    }
    let own =
        r#"{"key_header":"x-key","routes":[{"name":"a","match":{"prefix":"/"},"key":{"header":"x-key"}}]}"#;
    assert_eq!(only_rule(own).key, header(false, "x-key"));
}

/// `tombstone_ttl` and the local store's room for tombstones: by default the records' capacity
/// times how much longer the longest tombstone stands than its rule's ttl (at most four times),
/// or `store.tombstones` as given; none without a rule that keeps them.
#[test]
fn tombstones_and_their_room() {
    let cases: &[(&str, &str, u64, u32)] = &[
        ("", "", 0, 0),
        (r#","tombstone_ttl":"48h""#, "", 172_800_000, 200_000),
        (r#","ttl":"1h","tombstone_ttl":"150m""#, r#","capacity":1000"#, 9_000_000, 3_000),
        (
            r#","ttl":"1s","processing_timeout":"1s","tombstone_ttl":"1d""#,
            r#","capacity":1000"#,
            86_400_000,
            4_000,
        ),
        (r#","tombstone_ttl":"48h""#, r#","capacity":1000,"tombstones":50"#, 172_800_000, 50),
    ];
    for (rule, store, tombstone_ms, room) in cases {
        let c = parse(
            format!(r#"{{"store":{{"type":"local"{store}}},"routes":[{{"name":"a","match":{{"prefix":"/"}}{rule}}}]}}"#)
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(c.rules[0].tombstone_ms, *tombstone_ms, "{rule}");
        let StoreConfig::Local { tombstones, .. } = c.store else { unreachable!() };
        assert_eq!(tombstones, *room, "{rule} {store}");
    }
}

#[test]
fn rejects_bad_configs_naming_the_field() {
    let long_header = format!(r#""key_header":"{}""#, "h".repeat(129));
    let long_name = format!(r#"{{"routes":[{{"name":"{}","match":{{"prefix":"/"}}}}]}}"#, "n".repeat(65));
    let cases: Vec<(&str, String, &str)> = vec![
        // document
        ("invalid json", "{".into(), ""),
        ("empty input", "".into(), ""),
        ("top-level array", "[]".into(), ""),
        ("top-level null", "null".into(), ""),
        ("top-level string", r#""x""#.into(), ""),
        ("duplicate top-level key", r#"{"routes":[{"name":"a","match":{"prefix":"/"}}],"routes":[{"name":"b","match":{"prefix":"/"}}]}"#.into(), ""),
        ("duplicate nested key", rule_json(r#""ttl":"1h","ttl":"2h""#), ""),
        ("byte order mark", "\u{feff}{}".into(), ""),
        ("trailing data", format!("{} x", top(r#""key_header":"k""#)), ""),
        ("unknown top-level field", top(r#""foo":1"#), "foo"),
        ("missing routes", "{}".into(), "routes"),
        ("routes not array", r#"{"routes":{}}"#.into(), "routes"),
        ("empty routes", r#"{"routes":[]}"#.into(), "routes"),
        // wait mode and replay
        ("concurrent unknown", rule_json(r#""concurrent":"queue""#), "routes[0].concurrent"),
        ("execution unknown", rule_json(r#""execution":"async""#), "routes[0].execution"),
        ("unknown_outcome unknown", rule_json(r#""unknown_outcome":"retry""#), "routes[0].unknown_outcome"),
        ("unknown_outcome not string", rule_json(r#""unknown_outcome":true"#), "routes[0].unknown_outcome"),
        ("unknown_outcome wrong case", rule_json(r#""unknown_outcome":"Refuse""#), "routes[0].unknown_outcome"),
        ("execution not string", rule_json(r#""execution":1"#), "routes[0].execution"),
        ("cluster inline", rule_json(r#""cluster":"orders""#), "routes[0].cluster"),
        ("upstream_timeout inline", rule_json(r#""upstream_timeout":"1s""#), "routes[0].upstream_timeout"),
        ("cluster empty", rule_json(r#""execution":"detached","cluster":"""#), "routes[0].cluster"),
        (
            "upstream_rewrite inline",
            rule_json(r#""upstream_rewrite":{"prefix_rewrite":"/v2"}"#),
            "routes[0].upstream_rewrite",
        ),
        (
            "upstream_rewrite empty",
            rule_json(r#""execution":"detached","upstream_rewrite":{}"#),
            "routes[0].upstream_rewrite",
        ),
        (
            "upstream_rewrite unknown field",
            rule_json(r#""execution":"detached","upstream_rewrite":{"regex_rewrite":"x"}"#),
            "routes[0].upstream_rewrite.regex_rewrite",
        ),
        (
            "prefix_rewrite not a path",
            rule_json(r#""execution":"detached","upstream_rewrite":{"prefix_rewrite":"v2?x"}"#),
            "routes[0].upstream_rewrite.prefix_rewrite",
        ),
        (
            "host_rewrite_literal with a path",
            rule_json(r#""execution":"detached","upstream_rewrite":{"host_rewrite_literal":"h/x"}"#),
            "routes[0].upstream_rewrite.host_rewrite_literal",
        ),
        (
            "host_rewrite_literal empty",
            rule_json(r#""execution":"detached","upstream_rewrite":{"host_rewrite_literal":""}"#),
            "routes[0].upstream_rewrite.host_rewrite_literal",
        ),
        (
            "upstream_timeout at the lease",
            rule_json(r#""execution":"detached","processing_timeout":"10s","upstream_timeout":"10s""#),
            "routes[0].upstream_timeout",
        ),
        (
            "upstream_timeout past the lease",
            rule_json(r#""execution":"detached","upstream_timeout":"31s""#),
            "routes[0].upstream_timeout",
        ),
        ("detached calls zero", top(r#""max_detached_calls":0"#), "max_detached_calls"),
        ("publish_outcome not a boolean", top(r#""publish_outcome":"yes""#), "publish_outcome"),
        ("audit not a boolean", top(r#""audit":1"#), "audit"),
        ("mode unknown", top(r#""mode":"observe""#), "mode"),
        ("mode not a string", top(r#""mode":true"#), "mode"),
        // routes[].key: one source, each checked as the field it replaces
        ("key empty", rule_json(r#""key":{}"#), "routes[0].key"),
        ("key two sources", rule_json(r#""key":{"header":"x-a","json":"/a"}"#), "routes[0].key"),
        ("key unknown source", rule_json(r#""key":{"query":"id"}"#), "routes[0].key.query"),
        ("key not an object", rule_json(r#""key":"x-request-id""#), "routes[0].key"),
        ("key header pseudo", rule_json(r#""key":{"header":":path"}"#), "routes[0].key.header"),
        ("key header not a token", rule_json(r#""key":{"header":"x a"}"#), "routes[0].key.header"),
        ("key json not a pointer", rule_json(r#""key":{"json":"order_id"}"#), "routes[0].key.json"),
        ("key json bad escape", rule_json(r#""key":{"json":"/a~2"}"#), "routes[0].key.json"),
        ("key json the whole body", rule_json(r#""key":{"json":""}"#), "routes[0].key.json"),
        ("key fingerprint no window", rule_json(r#""key":{"fingerprint":{}}"#), "routes[0].key.fingerprint.window"),
        ("key fingerprint bad window", rule_json(r#""key":{"fingerprint":{"window":"soon"}}"#), "routes[0].key.fingerprint.window"),
        ("key fingerprint extra", rule_json(r#""key":{"fingerprint":{"window":"1m","ttl":"1h"}}"#), "routes[0].key.fingerprint.ttl"),
        ("key fingerprint beside ttl", rule_json(r#""key":{"fingerprint":{"window":"1m"}},"ttl":"1h""#), "routes[0].ttl"),
        ("key fingerprint lease past window", rule_json(r#""key":{"fingerprint":{"window":"5s"}},"processing_timeout":"10s""#), "routes[0].processing_timeout"),
        ("key json with reconcile", rule_json(r#""key":{"json":"/id"},"reconcile":{"path":"/p/{key}"}"#), "routes[0].reconcile"),
        ("key fingerprint with reconcile", rule_json(r#""key":{"fingerprint":{"window":"1m"}},"reconcile":{"path":"/p/{key}"}"#), "routes[0].reconcile"),
        ("tombstone_ttl not longer than ttl", rule_json(r#""ttl":"1h","tombstone_ttl":"1h""#), "routes[0].tombstone_ttl"),
        ("tombstone_ttl shorter than the default ttl", rule_json(r#""tombstone_ttl":"1h""#), "routes[0].tombstone_ttl"),
        ("tombstone_ttl bad", rule_json(r#""tombstone_ttl":"2 days""#), "routes[0].tombstone_ttl"),
        ("tombstone_ttl zero", rule_json(r#""tombstone_ttl":"0s""#), "routes[0].tombstone_ttl"),
        ("tombstone_ttl with a fingerprint window", rule_json(r#""key":{"fingerprint":{"window":"1m"}},"tombstone_ttl":"1h""#), "routes[0].tombstone_ttl"),
        ("store tombstones without a rule", r#"{"store":{"type":"local","tombstones":10},"routes":[{"name":"a","match":{"prefix":"/"}}]}"#.into(), "store.tombstones"),
        ("store tombstones zero", r#"{"store":{"type":"local","tombstones":0},"routes":[{"name":"a","match":{"prefix":"/"},"tombstone_ttl":"48h"}]}"#.into(), "store.tombstones"),
        ("scope_host unknown", top(r#""scope_host":"host""#), "scope_host"),
        ("scope_host not a string", top(r#""scope_host":true"#), "scope_host"),
        // Envoy's bootstrap header_prefix, as Envoy holds it: a lowercase token.
        ("envoy_header_prefix uppercase", top(r#""envoy_header_prefix":"X-Acme""#), "envoy_header_prefix"),
        ("envoy_header_prefix empty", top(r#""envoy_header_prefix":"""#), "envoy_header_prefix"),
        ("envoy_header_prefix space", top(r#""envoy_header_prefix":"x acme""#), "envoy_header_prefix"),
        ("envoy_header_prefix colon", top(r#""envoy_header_prefix":"x-acme:""#), "envoy_header_prefix"),
        ("envoy_header_prefix not a string", top(r#""envoy_header_prefix":1"#), "envoy_header_prefix"),
        ("envoy_header_prefix null", top(r#""envoy_header_prefix":null"#), "envoy_header_prefix"),
        ("envoy_header_prefix too long", top(&format!(r#""envoy_header_prefix":"{}""#, "x".repeat(65))), "envoy_header_prefix"),
        ("admin beside routes", top(r#""admin":{}"#), "admin"),
        ("admin token not a digest", r#"{"admin":{"token_sha256":"abc"}}"#.into(), "admin.token_sha256"),
        ("admin unknown field", r#"{"admin":{"token":"x"}}"#.into(), "admin.token"),
        (
            "detached calls over the memory budget",
            r#"{"max_detached_calls":129,"routes":[{"name":"a","match":{"prefix":"/"},"execution":"detached"}]}"#.into(),
            "max_detached_calls",
        ),
        ("concurrent not string", rule_json(r#""concurrent":true"#), "routes[0].concurrent"),
        ("wait_timeout without wait", rule_json(r#""wait_timeout":"5s""#), "routes[0].wait_timeout"),
        ("wait_timeout bad", rule_json(r#""concurrent":"wait","wait_timeout":"5""#), "routes[0].wait_timeout"),
        ("waiters zero", top(r#""max_waiters":0"#), "max_waiters"),
        ("waiters per key too many", top(r#""max_waiters_per_key":100001"#), "max_waiters_per_key"),
        ("replay exclude bad", rule_json(r#""replay_exclude_headers":["set cookie"]"#), "routes[0].replay_exclude_headers[0]"),
        ("wait_timeout over the bound", rule_json(r#""concurrent":"wait","wait_timeout":"301s""#), "routes[0].wait_timeout"),
        ("wait_timeout huge", rule_json(r#""concurrent":"wait","wait_timeout":"99999999999999d""#), "routes[0].wait_timeout"),
        ("waiters over the memory budget", r#"{"max_waiters":257,"routes":[{"name":"a","match":{"prefix":"/"},"concurrent":"wait"}]}"#.into(), "max_waiters"),
        ("waiters x largest wait body", r#"{"max_waiters":100000,"routes":[{"name":"a","match":{"prefix":"/"},"concurrent":"wait","max_request_bytes":67108864}]}"#.into(), "max_waiters"),
        // identity and quota
        ("principal not object", top(r#""principal":"jwt""#), "principal"),
        ("principal unknown field", top(r#""principal":{"jwt_payload":"p","claims":["sub"],"x":1}"#), "principal.x"),
        ("principal payload missing", top(r#""principal":{"claims":["sub"]}"#), "principal.jwt_payload"),
        ("principal payload empty", top(r#""principal":{"jwt_payload":"","claims":["sub"]}"#), "principal.jwt_payload"),
        ("principal claims missing", top(r#""principal":{"jwt_payload":"p"}"#), "principal.claims"),
        ("principal claims empty", top(r#""principal":{"jwt_payload":"p","claims":[]}"#), "principal.claims"),
        ("principal claim duplicate", top(r#""principal":{"jwt_payload":"p","claims":["sub","sub"]}"#), "principal.claims[1]"),
        ("principal claim number", top(r#""principal":{"jwt_payload":"p","claims":[1]}"#), "principal.claims[0]"),
        ("quota not object", top(r#""quota":5"#), "quota"),
        ("quota unknown field", top(r#""quota":{"per_route":5}"#), "quota.per_route"),
        ("quota zero", top(r#""quota":{"per_principal":0}"#), "quota.per_principal"),
        ("quota too big", top(r#""quota":{"per_tenant":10000001}"#), "quota.per_tenant"),
        ("route not object", r#"{"routes":[1]}"#.into(), "routes[0]"),
        // headers
        ("key header with space", top(r#""key_header":"idem key""#), "key_header"),
        ("key header empty", top(r#""key_header":"""#), "key_header"),
        ("key header pseudo", top(r#""key_header":":authority""#), "key_header"),
        ("key header too long", top(&long_header), "key_header"),
        ("key header number", top(r#""key_header":1"#), "key_header"),
        ("key header null", top(r#""key_header":null"#), "key_header"),
        ("tenant header bad", top(r#""tenant_header":"x y""#), "tenant_header"),
        ("tenant header bool", top(r#""tenant_header":false"#), "tenant_header"),
        ("principal not array", top(r#""principal_headers":"authorization""#), "principal_headers"),
        ("principal entry number", top(r#""principal_headers":[1]"#), "principal_headers[0]"),
        ("principal entry bad", top(r#""principal_headers":["a","b(c)"]"#), "principal_headers[1]"),
        ("principal duplicate after lowercasing", top(r#""principal_headers":["Authorization","authorization"]"#), "principal_headers[1]"),
        // store
        ("store not object", top(r#""store":"local""#), "store"),
        ("store missing type", top(r#""store":{"capacity":10}"#), "store.type"),
        ("store type redis", top(r#""store":{"type":"redis"}"#), "store.type"),
        ("store type number", top(r#""store":{"type":1}"#), "store.type"),
        ("store unknown field", top(r#""store":{"type":"local","foo":1}"#), "store.foo"),
        ("capacity zero", top(r#""store":{"type":"local","capacity":0}"#), "store.capacity"),
        ("capacity too big", top(r#""store":{"type":"local","capacity":10000001}"#), "store.capacity"),
        ("capacity negative", top(r#""store":{"type":"local","capacity":-1}"#), "store.capacity"),
        ("capacity float", top(r#""store":{"type":"local","capacity":1.5}"#), "store.capacity"),
        ("capacity integral float", top(r#""store":{"type":"local","capacity":10.0}"#), "store.capacity"),
        ("capacity string", top(r#""store":{"type":"local","capacity":"10"}"#), "store.capacity"),
        (
            "replay_cache with the local store",
            top(r#""store":{"type":"local","replay_cache":{}}"#),
            "store.replay_cache",
        ),
        ("capacity exponent", top(r#""store":{"type":"local","capacity":1e3}"#), "store.capacity"),
        ("capacity upper exponent", top(r#""store":{"type":"local","capacity":10E0}"#), "store.capacity"),
        ("capacity negative zero", top(r#""store":{"type":"local","capacity":-0}"#), "store.capacity"),
        ("capacity above u64", top(r#""store":{"type":"local","capacity":18446744073709551616}"#), "store.capacity"),
        ("waiters plus sign", top(r#""max_waiters":+5"#), ""),
        ("waiters leading zero", top(r#""max_waiters":05"#), ""),
        // problem statuses
        ("problem statuses not object", top(r#""problem_statuses":[]"#), "problem_statuses"),
        ("problem status unknown", top(r#""problem_statuses":{"foo":400}"#), "problem_statuses.foo"),
        ("problem status 200", top(r#""problem_statuses":{"invalid_key":200}"#), "problem_statuses.invalid_key"),
        ("problem status 600", top(r#""problem_statuses":{"mismatch":600}"#), "problem_statuses.mismatch"),
        ("problem status 500", top(r#""problem_statuses":{"in_flight":500}"#), "problem_statuses.in_flight"),
        ("problem status string", top(r#""problem_statuses":{"in_flight":"409"}"#), "problem_statuses.in_flight"),
        // route name
        ("unknown route field", rule_json(r#""foo":1"#), "routes[0].foo"),
        ("name missing", r#"{"routes":[{"match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
        ("name empty", r#"{"routes":[{"name":"","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
        ("name with space", r#"{"routes":[{"name":"a b","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
        ("name ending with a dot", r#"{"routes":[{"name":"a.","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
        ("name starting with a dot", r#"{"routes":[{"name":".a","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
        ("name with two dots", r#"{"routes":[{"name":"a..b","match":{"prefix":"/"}}]}"#.into(), "routes[0].name"),
        ("name too long", long_name, "routes[0].name"),
        ("duplicate names", r#"{"routes":[{"name":"a","match":{"prefix":"/a"}},{"name":"a","match":{"prefix":"/b"}}]}"#.into(), "routes[1].name"),
        // match
        ("match missing", r#"{"routes":[{"name":"a"}]}"#.into(), "routes[0].match"),
        ("match not object", matcher(r#""/""#), "routes[0].match"),
        ("match unknown field", matcher(r#"{"prefix":"/","foo":1}"#), "routes[0].match.foo"),
        ("prefix and exact", matcher(r#"{"prefix":"/","exact":"/a"}"#), "routes[0].match"),
        ("neither prefix nor exact", matcher(r#"{"methods":["POST"]}"#), "routes[0].match"),
        ("prefix without slash", matcher(r#"{"prefix":"orders"}"#), "routes[0].match.prefix"),
        ("prefix empty", matcher(r#"{"prefix":""}"#), "routes[0].match.prefix"),
        ("prefix with fragment", matcher(r##"{"prefix":"/a#b"}"##), "routes[0].match.prefix"),
        ("exact with query", matcher(r#"{"exact":"/a?b=1"}"#), "routes[0].match.exact"),
        ("prefix number", matcher(r#"{"prefix":1}"#), "routes[0].match.prefix"),
        ("methods empty", matcher(r#"{"prefix":"/","methods":[]}"#), "routes[0].match.methods"),
        ("methods string", matcher(r#"{"prefix":"/","methods":"POST"}"#), "routes[0].match.methods"),
        ("method bad token", matcher(r#"{"prefix":"/","methods":["PO ST"]}"#), "routes[0].match.methods[0]"),
        ("method duplicate after uppercasing", matcher(r#"{"prefix":"/","methods":["post","POST"]}"#), "routes[0].match.methods[1]"),
        // booleans and durations
        ("require_key string", rule_json(r#""require_key":"yes""#), "routes[0].require_key"),
        ("ttl empty", rule_json(r#""ttl":"""#), "routes[0].ttl"),
        ("ttl no unit", rule_json(r#""ttl":"10""#), "routes[0].ttl"),
        ("ttl fraction", rule_json(r#""ttl":"1.5s""#), "routes[0].ttl"),
        ("ttl negative", rule_json(r#""ttl":"-1s""#), "routes[0].ttl"),
        ("ttl zero", rule_json(r#""ttl":"0s""#), "routes[0].ttl"),
        ("ttl bad unit", rule_json(r#""ttl":"10x""#), "routes[0].ttl"),
        ("ttl uppercase unit", rule_json(r#""ttl":"10S""#), "routes[0].ttl"),
        ("ttl leading space", rule_json(r#""ttl":" 10s""#), "routes[0].ttl"),
        ("ttl trailing space", rule_json(r#""ttl":"10s ""#), "routes[0].ttl"),
        ("ttl unit only", rule_json(r#""ttl":"s""#), "routes[0].ttl"),
        ("ttl two units", rule_json(r#""ttl":"1h30m""#), "routes[0].ttl"),
        ("ttl number", rule_json(r#""ttl":10"#), "routes[0].ttl"),
        ("ttl null", rule_json(r#""ttl":null"#), "routes[0].ttl"),
        ("ttl digits overflow", rule_json(r#""ttl":"99999999999999999999ms""#), "routes[0].ttl"),
        ("ttl ms overflow", rule_json(r#""ttl":"213503982335d""#), "routes[0].ttl"),
        ("processing timeout zero", rule_json(r#""processing_timeout":"0ms""#), "routes[0].processing_timeout"),
        ("processing timeout above ttl", rule_json(r#""ttl":"10s","processing_timeout":"11s""#), "routes[0].processing_timeout"),
        ("default processing timeout above ttl", rule_json(r#""ttl":"1s""#), "routes[0].processing_timeout"),
        // sizes
        ("request bytes zero", rule_json(r#""max_request_bytes":0"#), "routes[0].max_request_bytes"),
        ("request bytes negative", rule_json(r#""max_request_bytes":-1"#), "routes[0].max_request_bytes"),
        ("request bytes float", rule_json(r#""max_request_bytes":1.5"#), "routes[0].max_request_bytes"),
        ("request bytes exponent", rule_json(r#""max_request_bytes":1e3"#), "routes[0].max_request_bytes"),
        ("request bytes above 64 MiB", rule_json(r#""max_request_bytes":67108865"#), "routes[0].max_request_bytes"),
        ("request bytes string", rule_json(r#""max_request_bytes":"1""#), "routes[0].max_request_bytes"),
        ("response bytes zero", rule_json(r#""max_response_bytes":0"#), "routes[0].max_response_bytes"),
        ("response bytes huge", rule_json(r#""max_response_bytes":18446744073709551616"#), "routes[0].max_response_bytes"),
        // fingerprint
        ("fingerprint not object", rule_json(r#""fingerprint":[]"#), "routes[0].fingerprint"),
        ("fingerprint unknown field", rule_json(r#""fingerprint":{"foo":1}"#), "routes[0].fingerprint.foo"),
        ("fingerprint header bad", rule_json(r#""fingerprint":{"headers":["content type"]}"#), "routes[0].fingerprint.headers[0]"),
        ("fingerprint header duplicate", rule_json(r#""fingerprint":{"headers":["A","a"]}"#), "routes[0].fingerprint.headers[1]"),
        ("pointer empty", rule_json(r#""fingerprint":{"ignore_json_fields":[""]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
        ("pointer without slash", rule_json(r#""fingerprint":{"ignore_json_fields":["a/b"]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
        ("pointer bad escape", rule_json(r#""fingerprint":{"ignore_json_fields":["/a~2"]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
        ("pointer dangling tilde", rule_json(r#""fingerprint":{"ignore_json_fields":["/ok","/a~"]}"#), "routes[0].fingerprint.ignore_json_fields[1]"),
        ("pointer not string", rule_json(r#""fingerprint":{"ignore_json_fields":[1]}"#), "routes[0].fingerprint.ignore_json_fields[0]"),
        (
            "pointer error in second route",
            r#"{"routes":[{"name":"a","match":{"prefix":"/a"}},{"name":"b","match":{"prefix":"/b"},"fingerprint":{"ignore_json_fields":["/x","/y","z"]}}]}"#.into(),
            "routes[1].fingerprint.ignore_json_fields[2]",
        ),
        // statuses
        ("statuses not array", rule_json(r#""store_statuses":"2xx""#), "routes[0].store_statuses"),
        ("status number", rule_json(r#""store_statuses":[200]"#), "routes[0].store_statuses[0]"),
        ("status class 6xx", rule_json(r#""store_statuses":["6xx"]"#), "routes[0].store_statuses[0]"),
        ("status class 0xx", rule_json(r#""store_statuses":["0xx"]"#), "routes[0].store_statuses[0]"),
        ("status half class", rule_json(r#""store_statuses":["2x0"]"#), "routes[0].store_statuses[0]"),
        ("status 600", rule_json(r#""store_statuses":["600"]"#), "routes[0].store_statuses[0]"),
        ("status 099", rule_json(r#""store_statuses":["099"]"#), "routes[0].store_statuses[0]"),
        ("status two digits", rule_json(r#""store_statuses":["20"]"#), "routes[0].store_statuses[0]"),
        ("status four digits", rule_json(r#""store_statuses":["2000"]"#), "routes[0].store_statuses[0]"),
        ("status with sign", rule_json(r#""release_statuses":["+50"]"#), "routes[0].release_statuses[0]"),
        ("status duplicate class", rule_json(r#""store_statuses":["2xx","2XX"]"#), "routes[0].store_statuses[1]"),
        ("status duplicate code", rule_json(r#""release_statuses":["500","500"]"#), "routes[0].release_statuses[1]"),
        ("code in both lists", rule_json(r#""store_statuses":["429"]"#), "routes[0].release_statuses"),
        ("class in both lists", rule_json(r#""store_statuses":["5xx"]"#), "routes[0].release_statuses"),
    ];
    for (name, json, field) in cases {
        match parse_str(&json) {
            Err(e) => assert_eq!(e.field, field, "{name}: {json}: {e}"),
            Ok(c) => unreachable!("{name}: {json} parsed: {c:?}"),
        }
    }
}

#[test]
fn full_example_parses_exactly() {
    let json = r#"{
      "key_header": "idempotency-key",
      "tenant_header": "x-tenant-id",
      "principal_headers": ["authorization"],
      "store": {"type": "local", "capacity": 100000},
      "problem_statuses": {"invalid_key": 400, "mismatch": 422, "in_flight": 409},
      "routes": [
        {
          "name": "orders",
          "match": {"prefix": "/orders", "methods": ["POST"]},
          "require_key": true,
          "ttl": "24h",
          "processing_timeout": "30s",
          "max_request_bytes": 1048576,
          "max_response_bytes": 1048576,
          "fingerprint": {"headers": ["content-type"], "ignore_json_fields": ["/meta/sent_at"]},
          "store_statuses": ["2xx", "3xx", "4xx"],
              "release_statuses": ["5xx", "408", "425", "429"]
        }
      ],
      "principal": {"jwt_payload": "jwt_payload", "claims": ["iss", "sub"]},
      "quota": {"per_tenant": 5000, "per_principal": 100},
      "publish_outcome": true,
      "audit": true,
      "mode": "shadow",
      "scope_host": "cluster",
      "envoy_header_prefix": "x-acme"
    }"#;
    let expected = Config {
        key_header: "idempotency-key".into(),
        tenant_header: Some("x-tenant-id".into()),
        principal_headers: vec!["authorization".into()],
        store: StoreConfig::Local { capacity: 100_000, tombstones: 0 },
        problem_statuses: ProblemStatuses { invalid_key: 400, mismatch: 422, in_flight: 409 },
        rules: vec![Rule {
            methods: vec!["POST".into()],
            require_key: true,
            fingerprint_headers: vec!["content-type".into()],
            ignore_json_fields: vec![vec!["meta".into(), "sent_at".into()]],
            statuses: StatusPolicy {
                store: vec![Class(2), Class(3), Class(4)],
                release: vec![Class(5), Code(408), Code(425), Code(429)],
            },
            ..default_rule("orders", PathMatch::Prefix("/orders".into()))
        }
        .into()],
        max_waiters_per_key: 100,
        max_waiters: 1_000,
        jwt_principal: Some(JwtPrincipal {
            payload: "jwt_payload".into(),
            claims: vec!["iss".into(), "sub".into()],
        }),
        quota: Quota { per_tenant: Some(5000), per_principal: Some(100) },
        max_detached_calls: 1_000,
        publish_outcome: true,
        audit: true,
        shadow: true,
        scope_host: ScopeHost::Cluster,
        admin: None,
        envoy_headers: EnvoyHeaders::new("x-acme"),
    };
    assert_eq!(parse_str(json), Ok(expected));
}

#[test]
fn wait_mode_and_replay_exclusions() {
    let r = only_rule(&rule_json(r#""concurrent":"wait","replay_exclude_headers":["Set-Cookie"]"#));
    assert_eq!(r.concurrency, Concurrency::Wait { timeout_ms: 10_000 });
    assert_eq!(r.replay_exclude_headers, vec!["set-cookie".to_string()]);
    let r = only_rule(&rule_json(r#""concurrent":"wait","wait_timeout":"250ms""#));
    assert_eq!(r.concurrency, Concurrency::Wait { timeout_ms: 250 });
    assert_eq!(only_rule(&rule_json(r#""concurrent":"reject""#)).concurrency, Concurrency::Reject);
}

#[test]
fn waiter_defaults_fit_the_memory_budget() {
    let wait = |fields: &str| {
        parse_str(&format!(
            r#"{{{fields}"routes":[{{"name":"a","match":{{"prefix":"/"}},"concurrent":"wait","max_request_bytes":4194304}}]}}"#
        ))
    };
    // 4 MiB bodies: the default 1000 waiters would hold 4 GiB; it shrinks to the budget.
    assert_eq!(wait("").map(|c| c.max_waiters), Ok(64));
    assert_eq!(wait(r#""max_waiters":64,"#).map(|c| c.max_waiters), Ok(64));
    assert_eq!(wait(r#""max_waiters":65,"#).map_err(|e| e.field), Err("max_waiters".to_string()));
    // Reject-mode rules hold nothing: no budget applies.
    assert_eq!(parse_str(&top(r#""max_waiters":100000"#)).map(|c| c.max_waiters), Ok(100_000));
}

#[test]
fn quotas_are_opt_in_and_an_explicit_one_stays_as_configured() {
    // Issue 18, item 5: the defaults were capacity/10 per caller and capacity/4 per tenant,
    // so one anonymous caller (or one service token) got 429 once a tenth of the store was
    // live. No default binds now, for either store; only what the operator writes does.
    let quota = |store: &str, quota: &str| {
        let routes = r#""routes":[{"name":"a","match":{"prefix":"/"}}]"#;
        let fields: Vec<&str> = [store, quota, routes].into_iter().filter(|f| !f.is_empty()).collect();
        parse_str(&format!("{{{}}}", fields.join(","))).map(|c| c.quota)
    };
    let none = Quota { per_tenant: None, per_principal: None };
    for store in [
        "",
        r#""store":{"type":"local","capacity":8}"#,
        r#""store":{"type":"local","capacity":10000000}"#,
        r#""store":{"type":"etcd","cluster":"etcd"},"tenant_header":"x-tenant-id""#,
    ] {
        assert_eq!(quota(store, ""), Ok(none), "{store}");
        assert_eq!(quota(store, r#""quota":{}"#), Ok(none), "{store}");
        assert_eq!(
            quota(store, r#""quota":{"per_tenant":3}"#),
            Ok(Quota { per_tenant: Some(3), per_principal: None }),
            "{store}"
        );
        assert_eq!(
            quota(store, r#""quota":{"per_principal":1,"per_tenant":10000000}"#),
            Ok(Quota { per_tenant: Some(10_000_000), per_principal: Some(1) }),
            "{store}"
        );
    }
}

#[test]
fn minimal_config_yields_all_defaults() {
    let expected = Config {
        key_header: "idempotency-key".into(),
        tenant_header: None,
        principal_headers: vec!["authorization".into()],
        store: StoreConfig::Local { capacity: 100_000, tombstones: 0 },
        problem_statuses: ProblemStatuses { invalid_key: 400, mismatch: 422, in_flight: 409 },
        rules: vec![default_rule("a", PathMatch::Prefix("/".into())).into()],
        max_waiters_per_key: 100,
        max_waiters: 1_000,
        jwt_principal: None,
        // No quota: a default bound would refuse a lone honest caller.
        quota: Quota { per_tenant: None, per_principal: None },
        max_detached_calls: 1_000,
        publish_outcome: false,
        audit: false,
        shadow: false,
        // The host as the caller wrote it, normalized: every build's scope before the field.
        scope_host: ScopeHost::Authority,
        admin: None,
        // Envoy's own names, x-envoy-*: its bootstrap header_prefix unset.
        envoy_headers: EnvoyHeaders::new("x-envoy"),
    };
    assert_eq!(parse_str(r#"{"routes":[{"name":"a","match":{"prefix":"/"}}]}"#), Ok(expected));
}

#[test]
fn unknown_outcome_defaults_to_refuse_and_takes_both_values() {
    // At most one execution per key unless the operator says a repeat is harmless: the old
    // default, takeover, executed a timed-out payment again once its lease ended.
    let default = only_rule(r#"{"routes":[{"name":"a","match":{"prefix":"/"}}]}"#);
    assert_eq!(default.unknown_outcome, UnknownOutcome::Refuse);
    let cases = [("takeover", UnknownOutcome::Takeover), ("refuse", UnknownOutcome::Refuse)];
    for (value, expected) in cases {
        let json = rule_json(&format!(r#""unknown_outcome":"{value}""#));
        assert_eq!(only_rule(&json).unknown_outcome, expected, "{value}");
    }
    // Per rule: one rule's choice is not another's.
    let cfg = parse_str(
        r#"{"routes":[{"name":"search","match":{"prefix":"/search"},"unknown_outcome":"takeover"},
            {"name":"pay","match":{"prefix":"/"}}]}"#,
    )
    .unwrap();
    assert_eq!(cfg.rules[0].unknown_outcome, UnknownOutcome::Takeover);
    assert_eq!(cfg.rules[1].unknown_outcome, UnknownOutcome::Refuse);
    // The error names the field and the accepted values.
    let e = parse_str(&rule_json(r#""unknown_outcome":"retry""#)).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid configuration: field `routes[0].unknown_outcome`: "retry": expected "takeover" or "refuse""#
    );
}

/// C27: `envoy_header_prefix` names Envoy's headers by its bootstrap's `header_prefix`: the
/// router controls a protected request loses and the mark of an upstream answer, built once.
#[test]
fn envoy_header_prefix_names_envoys_headers() {
    let prefixed = |prefix: &str| parse_str(&top(&format!(r#""envoy_header_prefix":"{prefix}""#)));
    let acme = prefixed("x-acme").unwrap().envoy_headers;
    assert_eq!(acme, EnvoyHeaders::new("x-acme"));
    assert_eq!(
        (acme.prefix.as_str(), acme.upstream_service_time.as_str()),
        ("x-acme", "x-acme-upstream-service-time")
    );
    assert!(acme.is_control("x-acme-retry-on") && !acme.is_control("x-envoy-retry-on"));
    assert_eq!(parse_str(&top(r#""key_header":"k""#)).unwrap().envoy_headers, EnvoyHeaders::default());
    for ok in ["x-envoy", "envoy", "x_corp.proxy", "a", &"x".repeat(64)] {
        assert_eq!(prefixed(ok).map(|c| c.envoy_headers.prefix), Ok(ok.to_string()), "{ok}");
    }
    let e = prefixed("X-Acme").unwrap_err();
    assert!(e.reason.contains("lowercase") && e.reason.contains("header_prefix"), "{e}");
    // A reconcile lookup never carries a router control header, by the configured prefix.
    let lookup = |prefix: &str, header: &str| {
        parse_str(&format!(
            r#"{{"envoy_header_prefix":"{prefix}","routes":[{{"name":"a","match":{{"prefix":"/"}},
                "reconcile":{{"path":"/k","headers":["{header}"]}}}}]}}"#
        ))
        .map(|_| ())
        .map_err(|e| e.field)
    };
    assert_eq!(lookup("x-acme", "x-acme-retry-on"), Err("routes[0].reconcile.headers".to_string()));
    assert_eq!(lookup("x-acme", "x-envoy-retry-on"), Ok(()));
    assert_eq!(lookup("x-envoy", "x-envoy-retry-on"), Err("routes[0].reconcile.headers".to_string()));
}

#[test]
fn reconcile_and_its_defaults() {
    let cfg = parse_str(
        r#"{"tenant_header":"x-tenant","principal_headers":["authorization","x-user"],"routes":[
            {"name":"a","match":{"prefix":"/a"},"reconcile":{"path":"/a/by-key/{key}"}},
            {"name":"b","match":{"prefix":"/b"},"processing_timeout":"10s","reconcile":{"path":"/lookup",
             "method":"post","cluster":"orders","timeout":"9s","headers":["x-api-key"]}},
            {"name":"c","match":{"prefix":"/c"}}]}"#,
    )
    .unwrap();
    let a = &cfg.rules[0];
    assert_eq!(a.unknown_outcome, UnknownOutcome::Reconcile);
    assert_eq!(
        a.reconcile,
        Some(Reconcile {
            path: "/a/by-key/{key}".into(),
            method: "GET".into(),
            cluster: None,
            timeout_ms: 2_000,
            // The caller's identity, so that the upstream authorizes the lookup as the caller.
            headers: vec!["authorization".into(), "x-user".into(), "x-tenant".into()],
        })
    );
    let b = cfg.rules[1].reconcile.as_ref().unwrap();
    assert_eq!(
        (b.method.as_str(), b.cluster.as_deref(), b.timeout_ms, b.headers.clone()),
        ("POST", Some("orders"), 9_000, vec!["x-api-key".to_string()])
    );
    assert_eq!((cfg.rules[2].unknown_outcome, &cfg.rules[2].reconcile), (UnknownOutcome::Refuse, &None));
    let cases = [
        (r#""reconcile":{}"#, "routes[0].reconcile.path", "required"),
        (r#""reconcile":{"path":"by-key"}"#, "routes[0].reconcile.path", "is not a path"),
        (r#""reconcile":{"path":"/k/{key}/{key}"}"#, "routes[0].reconcile.path", "at most one {key}"),
        (r#""reconcile":{"path":"/k/{id}"}"#, "routes[0].reconcile.path", "no other braces"),
        (r#""reconcile":{"path":"/k","method":"G T"}"#, "routes[0].reconcile.method", "not an HTTP method"),
        (r#""reconcile":{"path":"/k","cluster":""}"#, "routes[0].reconcile.cluster", "cluster name"),
        (
            r#""reconcile":{"path":"/k","timeout":"30s"}"#,
            "routes[0].reconcile.timeout",
            "below processing_timeout",
        ),
        (
            r#""reconcile":{"path":"/k","headers":[":path"]}"#,
            "routes[0].reconcile.headers[0]",
            "pseudo-header",
        ),
        (
            r#""reconcile":{"path":"/k","headers":["X-Envoy-Max-Retries"]}"#,
            "routes[0].reconcile.headers",
            "router control header",
        ),
        (r#""reconcile":{"path":"/k","retries":1}"#, "routes[0].reconcile.retries", "unknown field"),
        (r#""reconcile":{"path":"/k"},"unknown_outcome":"refuse""#, "routes[0].unknown_outcome", "left out"),
        (
            r#""reconcile":{"path":"/k"},"unknown_outcome":"takeover""#,
            "routes[0].unknown_outcome",
            "left out",
        ),
        (r#""reconcile":"/k""#, "routes[0].reconcile", "expected"),
    ];
    for (fields, field, reason) in cases {
        let e = parse_str(&rule_json(fields)).unwrap_err();
        assert_eq!(e.field, field, "{fields}: {e}");
        assert!(e.reason.contains(reason), "{fields}: {e}");
    }
}

#[test]
fn detached_execution_and_its_defaults() {
    let cfg = parse_str(
        r#"{"routes":[{"name":"a","match":{"prefix":"/"},"execution":"detached"},
            {"name":"b","match":{"prefix":"/b"},"execution":"detached","cluster":"pay","upstream_timeout":"9s",
             "max_request_bytes":65536,"max_response_bytes":65536},
            {"name":"c","match":{"prefix":"/c"},"execution":"inline"},
            {"name":"d","match":{"prefix":"/d"},"execution":"detached",
             "upstream_rewrite":{"prefix_rewrite":"/v2/d","host_rewrite_literal":"payments.internal"}}]}"#,
    )
    .unwrap();
    // Half the lease by default; the route's own cluster unless one is named.
    assert_eq!(
        cfg.rules[0].execution,
        Execution::Detached {
            cluster: None,
            upstream_timeout_ms: 15_000,
            rewrite: UpstreamRewrite::default()
        }
    );
    assert_eq!(
        cfg.rules[1].execution,
        Execution::Detached {
            cluster: Some("pay".into()),
            upstream_timeout_ms: 9_000,
            rewrite: UpstreamRewrite::default()
        }
    );
    assert_eq!(cfg.rules[2].execution, Execution::Inline);
    let rewrite = UpstreamRewrite {
        prefix_rewrite: Some("/v2/d".into()),
        host_rewrite_literal: Some("payments.internal".into()),
    };
    assert!(matches!(&cfg.rules[3].execution, Execution::Detached { rewrite: r, .. } if *r == rewrite));
    // 256 MiB over the largest detached request + response (1 + 1 MiB by default).
    assert_eq!(cfg.max_detached_calls, 128);
    let few =
        parse_str(r#"{"max_detached_calls":7,"routes":[{"name":"a","match":{"prefix":"/"}}]}"#).unwrap();
    assert_eq!(few.max_detached_calls, 7);
}

#[test]
fn normalises_case_and_accepts_optional_forms() {
    let json = r#"{
      "key_header": "Idempotency-Key",
      "tenant_header": null,
      "principal_headers": [],
      "store": {"type": "local"},
      "problem_statuses": {"mismatch": 400},
      "routes": [{
        "name": "Pay_v1.x-y",
        "match": {"exact": "/pay", "methods": ["put", "Post"]},
        "fingerprint": {"headers": ["Content-Type", "X-Api-Version"]},
        "store_statuses": ["2XX", "201"],
        "release_statuses": []
      }]
    }"#;
    let c = match parse_str(json) {
        Ok(c) => c,
        Err(e) => unreachable!("{e}"),
    };
    assert_eq!(c.key_header, "idempotency-key");
    assert_eq!(c.tenant_header, None);
    assert!(c.principal_headers.is_empty());
    assert_eq!(c.store, StoreConfig::Local { capacity: 100_000, tombstones: 0 });
    assert_eq!(c.problem_statuses, ProblemStatuses { invalid_key: 400, mismatch: 400, in_flight: 409 });
    let r = &c.rules[0];
    assert_eq!(r.name, "Pay_v1.x-y");
    assert_eq!(r.path, PathMatch::Exact("/pay".into()));
    assert_eq!(r.methods, ["PUT", "POST"]);
    assert_eq!(r.fingerprint_headers, ["content-type", "x-api-version"]);
    assert_eq!(r.statuses, StatusPolicy { store: vec![Class(2), Code(201)], release: vec![] });
}

#[test]
fn accepts_boundaries() {
    let r = only_rule(&rule_json(
        r#""max_request_bytes":1,"max_response_bytes":67108864,"ttl":"1ms","processing_timeout":"1ms""#,
    ));
    assert_eq!(
        (r.max_request_bytes, r.max_response_bytes, r.ttl_ms, r.processing_timeout_ms),
        (1, 67_108_864, 1, 1)
    );
    let c = parse_str(&top(
        r#""store":{"type":"local","capacity":10000000},"problem_statuses":{"invalid_key":499,"in_flight":400}"#,
    ));
    assert_eq!(
        c.as_ref().map(|c| c.store.clone()),
        Ok(StoreConfig::Local { capacity: 10_000_000, tombstones: 0 })
    );
    assert_eq!(
        c.map(|c| c.problem_statuses),
        Ok(ProblemStatuses { invalid_key: 499, mismatch: 422, in_flight: 400 })
    );
    let long = format!(
        r#"{{"key_header":"{}","routes":[{{"name":"{}","match":{{"prefix":"/"}}}}]}}"#,
        "h".repeat(128),
        "n".repeat(64)
    );
    assert!(parse_str(&long).is_ok());
}

#[test]
fn durations_convert_to_milliseconds() {
    let cases = [
        ("1ms", 1),
        ("2s", 2_000),
        ("3m", 180_000),
        ("4h", 14_400_000),
        ("5d", 432_000_000),
        ("007s", 7_000),
        ("213503982334d", 213_503_982_334 * 86_400_000),
    ];
    for (text, ms) in cases {
        let r = only_rule(&rule_json(&format!(r#""ttl":"{text}","processing_timeout":"1ms""#)));
        assert_eq!(r.ttl_ms, ms, "{text}");
    }
}

#[test]
fn duration_error_states_the_grammar() {
    let e = parse_str(&rule_json(r#""ttl":"10x""#));
    let expected = r#""10x" is not a duration: expected digits followed by ms, s, m, h or d (e.g. "30s")"#;
    assert_eq!(e.map_err(|e| e.reason), Err(expected.to_owned()));
    let e = parse_str(&rule_json(r#""ttl":10"#));
    assert!(e.is_err_and(|e| e.reason.contains("digits followed by ms, s, m, h or d")));
}

#[test]
fn json_pointers_are_decoded() {
    let cases: [(&str, &[&str]); 6] = [
        ("/a~1b/0", &["a/b", "0"]),
        ("/meta/sent_at", &["meta", "sent_at"]),
        ("/", &[""]),
        ("/a//b", &["a", "", "b"]),
        ("/~01", &["~1"]),
        ("/~1~0", &["/~"]),
    ];
    for (pointer, tokens) in cases {
        let r = only_rule(&rule_json(&format!(r#""fingerprint":{{"ignore_json_fields":["{pointer}"]}}"#)));
        assert_eq!(r.ignore_json_fields, [tokens.to_vec()], "{pointer}");
    }
}

#[test]
fn status_entries_parse() {
    let r = only_rule(&rule_json(
        r#""store_statuses":["1xx","2Xx","100","599"],"release_statuses":["5xx","200"]"#,
    ));
    assert_eq!(r.statuses.store, [Class(1), Class(2), Code(100), Code(599)]);
    assert_eq!(r.statuses.release, [Class(5), Code(200)]);
}

#[test]
fn errors_display_with_field() {
    let e = parse_str(&rule_json(r#""fingerprint":{"foo":1}"#));
    assert_eq!(
        e.map_err(|e| e.to_string()),
        Err("invalid configuration: field `routes[0].fingerprint.foo`: unknown field".to_owned())
    );
    let e = parse_str("{");
    assert_eq!(
        e.map_err(|e| (e.field.clone(), e.to_string())),
        Err((String::new(), "invalid configuration: not valid JSON: syntax error at byte 1".to_owned()))
    );
}

#[test]
fn json_errors_name_the_problem() {
    let reason = |json: &[u8]| parse(json).map(|_| ()).map_err(|e| e.reason);
    assert_eq!(
        reason(br#"{"routes":[{"name":"a","match":{"prefix":"/"}}],"routes":[]}"#),
        Err("not valid JSON: an object has a duplicate member name".to_owned())
    );
    assert_eq!(reason(br#"{"routes": [1,]}"#), Err("not valid JSON: syntax error at byte 14".to_owned()));
    assert_eq!(reason(b" \n"), Err("empty: expected a JSON object".to_owned()));
    assert_eq!(reason(b"{\"routes\":\"\xff\"}"), Err("not valid UTF-8".to_owned()));
    let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
    assert!(reason(deep.as_bytes()).is_err_and(|r| r.contains("deeper than 64")));
}

#[test]
fn integer_errors_quote_the_number_as_written() {
    let e = parse_str(&top(r#""store":{"type":"local","capacity":1e3}"#));
    assert_eq!(e.map_err(|e| e.reason), Err("expected an integer from 1 to 10000000, got 1e3".to_owned()));
    let e = parse_str(&rule_json(r#""max_request_bytes":1.0"#));
    assert!(e.is_err_and(|e| e.reason.ends_with("got 1.0")));
}

#[test]
fn escaped_strings_and_members_in_any_order_are_read() {
    let json = r#"{"routes":[{"match":{"prefix":"\/orders"},"name":"\u006frders","ttl":"1\u0068"}],"key_header":"X-K\u0065y"}"#;
    let c = match parse_str(json) {
        Ok(c) => c,
        Err(e) => unreachable!("{e}"),
    };
    assert_eq!(c.key_header, "x-key");
    assert_eq!(c.rules[0].name, "orders");
    assert_eq!(c.rules[0].path, PathMatch::Prefix("/orders".into()));
    assert_eq!(c.rules[0].ttl_ms, 3_600_000);
}

#[test]
fn first_unknown_field_in_document_order_is_reported() {
    let e = parse_str(&rule_json(r#""zzz":1,"aaa":2"#));
    assert_eq!(e.map_err(|e| e.field), Err("routes[0].zzz".to_owned()));
}

#[test]
fn disposition_prefers_exact_codes_over_classes() {
    let policy = StatusPolicy {
        store: vec![Class(2), Code(503), Class(4)],
        release: vec![Class(5), Code(409), Code(201)],
    };
    let cases = [
        (200, Disposition::Store),
        (201, Disposition::Release),
        (404, Disposition::Store),
        (409, Disposition::Release),
        (500, Disposition::Release),
        (503, Disposition::Store),
        (302, Disposition::Release),
        (100, Disposition::Release),
        (600, Disposition::Release),
        (0, Disposition::Release),
        (u16::MAX, Disposition::Release),
    ];
    for (status, expected) in cases {
        assert_eq!(policy.disposition(status), expected, "{status}");
    }
    let defaults = default_rule("a", PathMatch::Prefix("/".into())).statuses;
    let cases =
        [(200, true), (301, true), (404, true), (408, false), (425, false), (429, false), (500, false)];
    for (status, stored) in cases {
        assert_eq!(defaults.disposition(status) == Disposition::Store, stored, "{status}");
    }
}

#[test]
fn rules_match_method_and_path() {
    let prefix =
        Rule { methods: vec!["POST".into()], ..default_rule("p", PathMatch::Prefix("/orders".into())) };
    let exact = default_rule("e", PathMatch::Exact("/pay".into()));
    let cases = [
        (&prefix, "POST", "/orders", true),
        (&prefix, "POST", "/orders/1", true),
        (&prefix, "POST", "/ordersx", true),
        (&prefix, "POST", "/order", false),
        (&prefix, "post", "/orders", false),
        (&prefix, "PATCH", "/orders", false),
        (&exact, "PATCH", "/pay", true),
        (&exact, "POST", "/pay", true),
        (&exact, "POST", "/pay/", false),
        (&exact, "POST", "/pa", false),
        (&exact, "GET", "/pay", false),
    ];
    for (rule, method, path, expected) in cases {
        assert_eq!(rule.matches(method, path), expected, "{} {method} {path}", rule.name);
    }
}

#[test]
fn rule_for_takes_first_match() {
    let json = r#"{"routes":[
        {"name":"specific","match":{"exact":"/orders/bulk"}},
        {"name":"general","match":{"prefix":"/orders"}}
    ]}"#;
    let c = match parse_str(json) {
        Ok(c) => c,
        Err(e) => unreachable!("{e}"),
    };
    let name = |m, p| c.rule_for(m, p).map(|r| r.name.as_str());
    assert_eq!(name("POST", "/orders/bulk"), Some("specific"));
    assert_eq!(name("POST", "/orders/1"), Some("general"));
    assert_eq!(name("GET", "/orders/1"), None);
    assert_eq!(name("POST", "/users"), None);
}

fn etcd(store_fields: &str, route_fields: &str) -> String {
    let sep = if route_fields.is_empty() { "" } else { "," };
    format!(
        r#"{{"store":{{"type":"etcd","cluster":"etcd"{store_fields}}},"routes":[{{"name":"a","match":{{"prefix":"/"}}{sep}{route_fields}}}]}}"#
    )
}

#[test]
fn rejects_bad_etcd_configs_naming_the_field() {
    let long_prefix = format!(r#","prefix":"/{}/""#, "p".repeat(127));
    let over_limit = format!(r#""max_response_bytes":{}"#, etcd::MAX_STORED_BODY_BYTES + 1);
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "cluster missing",
            r#"{"store":{"type":"etcd"},"routes":[{"name":"a","match":{"prefix":"/"}}]}"#.into(),
            "store.cluster",
        ),
        (
            "cluster empty",
            etcd(r#","cluster":"""#, "").replacen(r#""cluster":"etcd","#, "", 1),
            "store.cluster",
        ),
        ("cluster number", etcd("", "").replace(r#""cluster":"etcd""#, r#""cluster":1"#), "store.cluster"),
        ("unknown etcd field", etcd(r#","capacity":10"#, ""), "store.capacity"),
        ("prefix empty", etcd(r#","prefix":"""#, ""), "store.prefix"),
        ("prefix without trailing slash", etcd(r#","prefix":"/idem""#, ""), "store.prefix"),
        ("prefix too long", etcd(&long_prefix, ""), "store.prefix"),
        ("prefix control character", etcd(r#","prefix":"/a\u0001/""#, ""), "store.prefix"),
        ("timeout without unit", etcd(r#","timeout":"250""#, ""), "store.timeout"),
        ("timeout number", etcd(r#","timeout":250"#, ""), "store.timeout"),
        ("timeout zero", etcd(r#","timeout":"0ms""#, ""), "store.timeout"),
        ("timeout over the bound", etcd(r#","timeout":"11s""#, ""), "store.timeout"),
        ("on_error unknown", etcd(r#","on_error":"retry""#, ""), "store.on_error"),
        ("on_error bool", etcd(r#","on_error":true"#, ""), "store.on_error"),
        ("protocol unknown", etcd(r#","protocol":"http2""#, ""), "store.protocol"),
        ("protocol not a string", etcd(r#","protocol":1"#, ""), "store.protocol"),
        ("auth not object", etcd(r#","auth":"root:pw""#, ""), "store.auth"),
        ("auth username missing", etcd(r#","auth":{"password":"pw"}"#, ""), "store.auth.username"),
        ("auth password missing", etcd(r#","auth":{"username":"u"}"#, ""), "store.auth.password"),
        (
            "auth username empty",
            etcd(r#","auth":{"username":"","password":"pw"}"#, ""),
            "store.auth.username",
        ),
        ("auth password number", etcd(r#","auth":{"username":"u","password":1}"#, ""), "store.auth.password"),
        (
            "auth timeout without unit",
            etcd(r#","auth":{"username":"u","password":"p","timeout":"2000"}"#, ""),
            "store.auth.timeout",
        ),
        (
            "auth timeout number",
            etcd(r#","auth":{"username":"u","password":"p","timeout":2000}"#, ""),
            "store.auth.timeout",
        ),
        (
            "auth timeout zero",
            etcd(r#","auth":{"username":"u","password":"p","timeout":"0s"}"#, ""),
            "store.auth.timeout",
        ),
        (
            "auth timeout over the bound",
            etcd(r#","auth":{"username":"u","password":"p","timeout":"11s"}"#, ""),
            "store.auth.timeout",
        ),
        (
            "auth unknown field",
            etcd(r#","auth":{"username":"u","password":"p","token":"t"}"#, ""),
            "store.auth.token",
        ),
        // Waiters on etcd keep the same memory budget as on the local store.
        (
            "waiters over the memory budget",
            etcd("", r#""concurrent":"wait""#).replacen('{', r#"{"max_waiters":257,"#, 1),
            "max_waiters",
        ),
        ("response over etcd's request limit", etcd("", &over_limit), "routes[0].max_response_bytes"),
        ("replay_cache not an object", etcd(r#","replay_cache":true"#, ""), "store.replay_cache"),
        ("replay_cache number", etcd(r#","replay_cache":1024"#, ""), "store.replay_cache"),
        ("replay_cache unknown field", etcd(r#","replay_cache":{"ttl":"1s"}"#, ""), "store.replay_cache.ttl"),
        (
            "replay_cache entries zero",
            etcd(r#","replay_cache":{"entries":0}"#, ""),
            "store.replay_cache.entries",
        ),
        (
            "replay_cache entries over the bound",
            etcd(r#","replay_cache":{"entries":100001}"#, ""),
            "store.replay_cache.entries",
        ),
        (
            "replay_cache entries negative",
            etcd(r#","replay_cache":{"entries":-1}"#, ""),
            "store.replay_cache.entries",
        ),
        (
            "replay_cache entries string",
            etcd(r#","replay_cache":{"entries":"10"}"#, ""),
            "store.replay_cache.entries",
        ),
        (
            "replay_cache entries fraction",
            etcd(r#","replay_cache":{"entries":1.5}"#, ""),
            "store.replay_cache.entries",
        ),
        (
            "replay_cache max_bytes under the bound",
            etcd(r#","replay_cache":{"max_bytes":4095}"#, ""),
            "store.replay_cache.max_bytes",
        ),
        (
            "replay_cache max_bytes over the bound",
            etcd(r#","replay_cache":{"max_bytes":268435457}"#, ""),
            "store.replay_cache.max_bytes",
        ),
        (
            "replay_cache max_bytes as text",
            etcd(r#","replay_cache":{"max_bytes":"8MiB"}"#, ""),
            "store.replay_cache.max_bytes",
        ),
    ];
    for (name, json, field) in cases {
        match parse_str(&json) {
            Err(e) => assert_eq!(e.field, field, "{name}: {json}: {e}"),
            Ok(c) => unreachable!("{name}: {json} parsed: {c:?}"),
        }
    }
}

fn sharded(store_fields: &str) -> String {
    format!(
        r#"{{"store":{{"type":"etcd"{store_fields}}},"routes":[{{"name":"a","match":{{"prefix":"/"}}}}]}}"#
    )
}

#[test]
fn rejects_bad_shard_lists_naming_the_field() {
    let shard = |c: &str| format!(r#"{{"cluster":"{c}"}}"#);
    let many = (0..=etcd::MAX_SHARDS).map(|i| shard(&format!("etcd-{i}"))).collect::<Vec<_>>().join(",");
    let cases: Vec<(&str, String, &str, &str)> = vec![
        ("neither cluster nor shards", sharded(""), "store.cluster", "store.shards"),
        ("an empty list", sharded(r#","shards":[]"#), "store.shards", "1 to 32 shards, got 0"),
        ("over the bound", sharded(&format!(r#","shards":[{many}]"#)), "store.shards", "got 33"),
        ("not a list", sharded(r#","shards":"etcd-a""#), "store.shards", "array"),
        (
            "a duplicate cluster",
            sharded(r#","shards":[{"cluster":"etcd-a"},{"cluster":"etcd-b"},{"cluster":"etcd-a"}]"#),
            "store.shards[2].cluster",
            "shard 0's cluster",
        ),
        (
            "cluster and shards together",
            sharded(r#","cluster":"etcd","shards":[{"cluster":"etcd-a"}]"#),
            "store.shards",
            "together",
        ),
        (
            "a shard without its cluster",
            sharded(r#","shards":[{"authority":"etcd"}]"#),
            "store.shards[0].cluster",
            "required",
        ),
        ("an empty cluster", sharded(r#","shards":[{"cluster":""}]"#), "store.shards[0].cluster", "cluster"),
        (
            "an unknown shard field",
            sharded(r#","shards":[{"cluster":"a","prefix":"/x/"}]"#),
            "store.shards[0].prefix",
            "unknown",
        ),
        (
            "an Istio cluster name as authority",
            sharded(r#","shards":[{"cluster":"a","authority":"outbound|2379||etcd"}]"#),
            "store.shards[0].authority",
            "host name",
        ),
        (
            "a shard's auth with a timeout (the store's alone)",
            sharded(r#","shards":[{"cluster":"a","auth":{"username":"u","password":"p","timeout":"1s"}}]"#),
            "store.shards[0].auth.timeout",
            "unknown",
        ),
        (
            "previous_shards with store.cluster",
            sharded(r#","cluster":"etcd","previous_shards":[{"cluster":"etcd-a"}]"#),
            "store.previous_shards",
            "only with store.shards",
        ),
        (
            "an empty previous list",
            sharded(r#","shards":[{"cluster":"a"}],"previous_shards":[]"#),
            "store.previous_shards",
            "got 0",
        ),
        (
            "a cluster twice in the previous list",
            sharded(r#","shards":[{"cluster":"a"}],"previous_shards":[{"cluster":"b"},{"cluster":"b"}]"#),
            "store.previous_shards[1].cluster",
            "shard 0's cluster",
        ),
        (
            "one cluster reached two ways",
            sharded(r#","shards":[{"cluster":"a"}],"previous_shards":[{"cluster":"a","authority":"other"}]"#),
            "store.previous_shards[0]",
            "one cluster, one way",
        ),
        (
            "a shard's auth without its password",
            sharded(r#","shards":[{"cluster":"a","auth":{"username":"u"}}]"#),
            "store.shards[0].auth.password",
            "required",
        ),
    ];
    for (name, json, field, reason) in cases {
        match parse_str(&json) {
            Err(e) => {
                assert_eq!(e.field, field, "{name}: {json}: {e}");
                assert!(e.reason.contains(reason), "{name}: {e}");
            }
            Ok(c) => unreachable!("{name}: {json} parsed: {c:?}"),
        }
    }
}

#[test]
fn a_shard_list_parses_each_shard_with_the_stores_credentials_unless_its_own() {
    let json = sharded(
        r#","auth":{"username":"idem","password":"pw"},"prefix":"/p/","shards":[{"cluster":"etcd-a"},{"cluster":"etcd-b","authority":"etcd-b.db","auth":{"username":"b","password":"bpw"}}]"#,
    );
    let settings = match parse_str(&json) {
        Ok(Config { store: StoreConfig::Etcd(settings), .. }) => settings,
        other => unreachable!("{other:?}"),
    };
    let store_auth = Some(EtcdAuth { username: "idem".into(), password: "pw".into() });
    let each = settings.shard_settings();
    assert_eq!(each.len(), 2);
    assert_eq!((each[0].cluster.as_str(), each[0].authority.as_str()), ("etcd-a", "etcd"));
    assert_eq!(each[0].auth, store_auth);
    assert_eq!((each[1].cluster.as_str(), each[1].authority.as_str()), ("etcd-b", "etcd-b.db"));
    assert_eq!(each[1].auth, Some(EtcdAuth { username: "b".into(), password: "bpw".into() }));
    assert!(each.iter().all(|s| s.prefix == "/p/" && s.shards.is_empty()));
    // The store's own fields are its first shard's.
    assert_eq!((settings.cluster.as_str(), &settings.auth), ("etcd-a", &store_auth));
    // A change under way: the previous list's shards, each as the current list's would be.
    let json = sharded(
        r#","shards":[{"cluster":"etcd-a"},{"cluster":"etcd-b"},{"cluster":"etcd-c"}],"previous_shards":[{"cluster":"etcd-a"},{"cluster":"etcd-b"}]"#,
    );
    match parse_str(&json) {
        Ok(Config { store: StoreConfig::Etcd(settings), .. }) => {
            let before: Vec<String> =
                settings.previous_shard_settings().into_iter().map(|s| s.cluster).collect();
            assert_eq!(before, ["etcd-a", "etcd-b"]);
            assert!(settings.shard_settings().iter().all(|s| s.previous_shards.is_empty()));
        }
        other => unreachable!("{other:?}"),
    }
    // One cluster: one shard, the store itself.
    match parse_str(&etcd("", "")) {
        Ok(Config { store: StoreConfig::Etcd(one), .. }) => assert_eq!(one.shard_settings(), vec![one]),
        other => unreachable!("{other:?}"),
    }
}

#[test]
fn wait_mode_is_accepted_with_the_etcd_store() {
    let c = match parse_str(&etcd("", r#""concurrent":"wait","wait_timeout":"3s""#)) {
        Ok(c) => c,
        Err(e) => unreachable!("{e}"),
    };
    assert!(matches!(c.store, StoreConfig::Etcd(_)));
    assert_eq!(c.rules[0].concurrency, Concurrency::Wait { timeout_ms: 3_000 });
}

#[test]
fn etcd_store_parses_with_defaults_and_in_full() {
    let settings = |json: &str| match parse_str(json) {
        Ok(Config { store: StoreConfig::Etcd(settings), .. }) => Some(settings),
        Ok(_) => None,
        Err(e) => unreachable!("{json}: {e}"),
    };
    assert_eq!(
        settings(&etcd("", "")),
        Some(EtcdSettings {
            cluster: "etcd".into(),
            authority: "etcd".into(),
            prefix: "/idempotency/".into(),
            timeout_ms: 250,
            on_error: OnStoreError::FailClosed,
            auth: None,
            auth_timeout_ms: 2_000,
            replay_cache: None,
            protocol: Protocol::Json,
            shards: Vec::new(),
            previous_shards: Vec::new(),
        })
    );
    let full = etcd(
        r#","prefix":"/shop/idem/","timeout":"1s","on_error":"fail_open","auth":{"username":"idem","password":"s\"ecret","timeout":"5s"},"protocol":"grpc""#,
        &format!(r#""max_response_bytes":{}"#, etcd::MAX_STORED_BODY_BYTES),
    );
    assert_eq!(
        settings(&full),
        Some(EtcdSettings {
            cluster: "etcd".into(),
            authority: "etcd".into(),
            prefix: "/shop/idem/".into(),
            timeout_ms: 1_000,
            on_error: OnStoreError::FailOpen,
            auth: Some(EtcdAuth { username: "idem".into(), password: "s\"ecret".into() }),
            auth_timeout_ms: 5_000,
            replay_cache: None,
            protocol: Protocol::Grpc,
            shards: Vec::new(),
            previous_shards: Vec::new(),
        })
    );
    // The local store keeps no etcd settings, and wait mode and large bodies stay its own.
    let local = r#"{"store":{"type":"local"},"routes":[{"name":"a","match":{"prefix":"/"},"concurrent":"wait","max_response_bytes":67108864}]}"#;
    assert_eq!(settings(local), None);
    // The replay cache: off by default, defaults per field, bounds inclusive.
    let cache = |fields: &str| settings(&etcd(fields, "")).and_then(|s| s.replay_cache);
    for (fields, expected) in [
        ("", None),
        (r#","replay_cache":{}"#, Some(ReplayCacheSettings { entries: 1_024, max_bytes: 8_388_608 })),
        (r#","replay_cache":{"entries":1}"#, Some(ReplayCacheSettings { entries: 1, max_bytes: 8_388_608 })),
        (
            r#","replay_cache":{"max_bytes":4096}"#,
            Some(ReplayCacheSettings { entries: 1_024, max_bytes: 4_096 }),
        ),
        (
            r#","replay_cache":{"entries":100000,"max_bytes":268435456}"#,
            Some(ReplayCacheSettings { entries: 100_000, max_bytes: 268_435_456 }),
        ),
    ] {
        assert_eq!(cache(fields), expected, "{fields}");
    }
    // Explicit fail_closed is the default spelled out.
    assert_eq!(
        settings(&etcd(r#","on_error":"fail_closed""#, "")).map(|s| s.on_error),
        Some(OnStoreError::FailClosed)
    );
}

#[test]
fn etcd_sizing_leaves_the_default_body_limit_room() {
    // 1.5 MiB of request minus 68 KiB of headers and framing: the 1 MiB default fits.
    assert_eq!(etcd::MAX_STORED_BODY_BYTES, 1_503_232);
}

#[test]
fn an_admin_instance_protects_no_routes_and_keeps_the_tokens_digest() {
    let digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let c = parse_str(&format!(r#"{{"admin":{{"token_sha256":"{digest}"}}}}"#)).unwrap();
    assert!(c.rules.is_empty());
    let admin = c.admin.unwrap();
    assert_eq!(crate::codec::hex(&admin.token_sha256.unwrap()), digest);
    assert_eq!(parse_str(r#"{"admin":{}}"#).unwrap().admin.unwrap().token_sha256, None);
    // On etcd too: it reads and settles the fleet's records there.
    let on_etcd = parse_str(r#"{"admin":{},"store":{"type":"etcd","cluster":"etcd"}}"#).unwrap();
    assert!(on_etcd.admin.is_some() && on_etcd.rules.is_empty());
}

/// A log line about a cluster names the field that named it (an unknown cluster's line).
#[test]
fn a_cluster_is_named_by_its_field() {
    let one = parse_str(&sharded(r#","cluster":"etcd-main""#)).expect("valid");
    assert_eq!(one.store_cluster_field("etcd-main"), "store.cluster");
    let moving = parse_str(&sharded(
        r#","shards":[{"cluster":"a"},{"cluster":"b"}],"previous_shards":[{"cluster":"a"},{"cluster":"old"}]"#,
    ))
    .expect("valid");
    assert_eq!(moving.store_cluster_field("b"), "store.shards[1].cluster");
    assert_eq!(moving.store_cluster_field("a"), "store.shards[0].cluster");
    assert_eq!(moving.store_cluster_field("old"), "store.previous_shards[1].cluster");
    let two = parse_str(&format!(
        r#"{{"routes":[{},{}]}}"#,
        r#"{"name":"first","match":{"prefix":"/a"}}"#, r#"{"name":"pay","match":{"prefix":"/b"}}"#
    ))
    .expect("valid");
    assert_eq!(two.rule_field("pay"), "routes[1]");
    assert_eq!(two.rule_field("gone"), "route rule gone");
}
