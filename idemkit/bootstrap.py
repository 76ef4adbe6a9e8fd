"""Envoy bootstrap builder: the pieces every Envoy of the kit is made of (listener, HTTP
connection manager, static clusters, routes, the Wasm filter, jwt_authn, local rate limit), and
`orders_proxy`, the proxy the e2e tests and the wake-up measurement run in front of the demo
upstream. Plain dicts, written as JSON for `envoy -c`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any, Sequence

from idemkit import REPO_ROOT

MiB = 1024 * 1024
LOCALHOST = "127.0.0.1"


def _copy(value: Any) -> Any:
    """A deep copy of a JSON value (callers may reuse what they passed)."""
    return json.loads(json.dumps(value))


def shipped_stats_config(path: Path | str | None = None) -> dict:
    """The `stats_config` of a shipped Envoy config (default: envoy/envoy.yaml), so tests run
    with the very stats tags users get. The block is written as JSON (valid YAML too), which the
    standard library reads without a YAML parser: the value after `stats_config:` is decoded up
    to its closing brace."""
    path = Path(path or REPO_ROOT / "envoy" / "envoy.yaml")
    _, sep, rest = path.read_text().partition("\nstats_config:")
    if not sep:
        raise ValueError("%s has no top-level stats_config" % path)
    value, _ = json.JSONDecoder().raw_decode(rest.lstrip())
    return value


def socket_address(port: int) -> dict:
    return {"socket_address": {"address": LOCALHOST, "port_value": port}}


def cluster(name: str, port: int, http_protocol_options: dict | None = None) -> dict:
    """A STATIC cluster of one endpoint, 127.0.0.1:`port`, spoken to in HTTP/1.1."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": http_protocol_options or {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(port)}}]}],
        },
    }


def etcd_cluster(client_ports: Sequence[int], name: str = "etcd",
                 health_checks: bool = True, tls_sni: str | None = None, grpc: bool = False) -> dict:
    """The cluster the filter's etcd store calls (`store.cluster`): etcd's client ports on
    127.0.0.1, HTTP/1.1 to its JSON gateway, or with `grpc` (for `store.protocol: "grpc"`)
    HTTP/2 to its gRPC API, health-checked with gRPC's health service, which etcd serves (a
    plain HTTP/2 GET /version is not gRPC, and etcd's port then has no server for it).
    `health_checks`: GET /version every 500 ms, so a
    dead member stops getting callouts within a second. Not /health: etcd answers it 503 on
    every member while there is no leader, so during an election Envoy marked all members
    unhealthy, fell back to panic routing and sent callouts to the dead one again (measured:
    about 40 refused requests over 2.5 s after killing the leader, against 3 to 6 within 0.5 s
    with /version). `tls_sni`: the TLS form (an
    UpstreamTlsContext transport socket), as documented in docs/ETCD.md (TLS to etcd); the tests run plain."""
    c = cluster(name, client_ports[0])
    c["connect_timeout"] = "0.25s"
    if grpc:
        c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
            "explicit_http_config"] = {"http2_protocol_options": {}}
    c["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [{"endpoint": {"address": socket_address(p)}} for p in client_ports]}
    ]
    if health_checks:
        c["health_checks"] = [{
            "timeout": "1s",
            "interval": "0.5s",
            # Envoy checks a cluster it sees no traffic on only this often (default 60 s), and
            # callouts do not count as traffic: a killed member kept getting a third of them.
            "no_traffic_interval": "0.5s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            **({"grpc_health_check": {}} if grpc else {"http_health_check": {"path": "/version"}}),
        }]
    if tls_sni is not None:
        c["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": tls_sni,
            },
        }
    return c


def router(suppress_envoy_headers: bool = False) -> dict:
    """`suppress_envoy_headers`: the router adds no x-envoy-* headers (x-envoy-upstream-service-time
    among them), as some operators configure it."""
    typed: dict[str, Any] = {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    if suppress_envoy_headers:
        typed["suppress_envoy_headers"] = True
    return {"name": "envoy.filters.http.router", "typed_config": typed}


def http_connection_manager(routes: list[dict], http_filters: list[dict],
                            stat_prefix: str = "ingress_http",
                            http_protocol_options: dict | None = None,
                            suppress_envoy_headers: bool = False,
                            virtual_host_per_filter: dict | None = None,
                            access_log: Sequence[dict] = (),
                            tracing: dict | None = None,
                            hcm_options: dict | None = None) -> dict:
    """The listener's network filter: one virtual host for every domain with `routes`, then
    `http_filters` and the router. `virtual_host_per_filter`: the virtual host's
    typed_per_filter_config (e.g. `cors_policy(...)`), which every route inherits.
    `access_log`: the HCM's access loggers (e.g. `file_access_log(...)`). `tracing`: the HCM's
    tracing (e.g. `zipkin_tracing(...)`). `hcm_options`: more HCM fields, as they are (e.g.
    `internal_callers()`)."""
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": "AUTO",
        "request_timeout": "60s",
        "stream_idle_timeout": "30s",
    }
    if http_protocol_options is not None:
        hcm["http_protocol_options"] = http_protocol_options
    if access_log:
        hcm["access_log"] = _copy(list(access_log))
    if tracing is not None:
        hcm["tracing"] = _copy(tracing)
    hcm.update(_copy(hcm_options or {}))
    vhost: dict[str, Any] = {"name": "all", "domains": ["*"], "routes": routes}
    if virtual_host_per_filter is not None:
        vhost["typed_per_filter_config"] = virtual_host_per_filter
    hcm["route_config"] = {"name": "local_route", "virtual_hosts": [vhost]}
    hcm["http_filters"] = http_filters + [router(suppress_envoy_headers)]
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}


def internal_callers() -> dict:
    """HCM fields (for `hcm_options`) with which Envoy counts a caller on 127.0.0.1 as internal,
    as an edge Envoy behind an internal load balancer counts its callers: it then keeps their
    `x-envoy-*` router control headers (retries, timeouts) instead of stripping them."""
    return {
        "use_remote_address": True,
        "internal_address_config": {"cidr_ranges": [{"address_prefix": "127.0.0.1", "prefix_len": 32}]},
    }


def file_access_log(path: Path | str, fields: dict[str, str]) -> dict:
    """An access logger (for `access_log`) writing one JSON object per downstream request to
    `path`, with `fields` as Envoy command operators, e.g. {"status": "%RESPONSE_CODE%",
    "key": "%REQ(IDEMPOTENCY-KEY)%"}. Envoy writes a request's line when its stream ends, and
    flushes the file every `--file-flush-interval-msec` (idemkit starts Envoy with 100 ms)."""
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(path),
            "log_format": {"json_format": dict(fields)},
        },
    }


def zipkin_tracing(collector_cluster: str, custom_tags: Sequence[dict] = ()) -> dict:
    """An HCM `tracing` that samples every request and sends its spans to a Zipkin collector
    (JSON v2, POST /api/v2/spans) on `collector_cluster`; `custom_tags` as Envoy takes them,
    e.g. {"tag": "t", "value": "%FILTER_STATE(...)%"}."""
    return {
        "random_sampling": {"value": 100},
        "custom_tags": _copy(list(custom_tags)),
        "provider": {
            "name": "envoy.tracers.zipkin",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                "collector_cluster": collector_cluster,
                "collector_endpoint": "/api/v2/spans",
                "collector_endpoint_version": "HTTP_JSON",
            },
        },
    }


def text_file_access_log(path: Path | str, text_format: str) -> dict:
    """An access logger (for `access_log`) writing one `text_format` line per downstream
    request to `path` (as the shipped envoy/*.yaml log to stdout)."""
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(path),
            "log_format": {"text_format_source": {"inline_string": text_format}},
        },
    }


def bootstrap(hcm: dict, clusters: list[dict], connection_buffer_limit: int = 2 * MiB,
              max_connections: int | None = None) -> dict:
    """Admin and one listener, both on 127.0.0.1 port 0 (the kernel chooses; `Envoy` reads the
    ports back). `max_connections`: the overload manager's downstream connection limit."""
    config: dict[str, Any] = {"admin": {"address": socket_address(0)}}
    if max_connections is not None:
        config["overload_manager"] = {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": max_connections,
                    },
                }
            ]
        }
    config["static_resources"] = {
        "listeners": [
            {
                "name": "ingress",
                "address": socket_address(0),
                "per_connection_buffer_limit_bytes": connection_buffer_limit,
                "filter_chains": [{"filters": [hcm]}],
            }
        ],
        "clusters": clusters,
    }
    return config


def wasm_filter(name: str, wasm_path: Path | str, configuration: str,
                failure_policy: str = "FAIL_RELOAD") -> dict:
    """An http_filters entry that loads the proxy-wasm module `wasm_path` (V8) with the plugin
    configuration string `configuration`; `name` is also its root_id and vm_id."""
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": name,
                "failure_policy": failure_policy,
                "reload_config": {"backoff": {"base_interval": "1s", "max_interval": "10s"}},
                "allow_on_headers_stop_iteration": True,
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(wasm_path)}},
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": configuration,
                },
            },
        },
    }


def filter_http_filter(filter_config: dict | str, wasm_path: Path | str,
                       failure_policy: str = "FAIL_RELOAD") -> dict:
    """The Envoy http_filters entry that loads the idempotency filter."""
    value = filter_config if isinstance(filter_config, str) else json.dumps(filter_config)
    return wasm_filter("idempotency", wasm_path, value, failure_policy)


def route(prefix: str, timeout: str | None = None, cluster: str = "orders",
          exact: bool = False, buffer_limit: int | None = None,
          retry_policy: dict | None = None, per_filter: dict | None = None) -> dict:
    """An Envoy route entry for `extra_routes` (placed before the catch-all `/` route).
    `retry_policy`: the route's Envoy retry policy; `per_filter`: its typed_per_filter_config."""
    r: dict[str, Any] = {
        "match": {"path" if exact else "prefix": prefix},
        "route": {"cluster": cluster},
    }
    if timeout is not None:
        r["route"]["timeout"] = timeout
    if retry_policy is not None:
        r["route"]["retry_policy"] = retry_policy
    if buffer_limit is not None:
        r["request_body_buffer_limit"] = buffer_limit
    if per_filter is not None:
        r["typed_per_filter_config"] = per_filter
    return r


def direct_response(prefix: str, status: int, body: str | None = None) -> dict:
    """An `extra_routes` entry that Envoy answers itself (no upstream, no cluster)."""
    r: dict[str, Any] = {"match": {"prefix": prefix}, "direct_response": {"status": status}}
    if body is not None:
        r["direct_response"]["body"] = {"inline_string": body}
    return r


# ---- JWT (jwt_authn in front of the filter) -----------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mint_hs256(secret: bytes, claims: dict, kid: str = "test-key") -> str:
    """A compact HS256 JWS (RFC 7515/7519) signed with `secret`, standard library only."""
    header = {"alg": "HS256", "typ": "JWT", "kid": kid}
    signing_input = (
        b64url(json.dumps(header, separators=(",", ":")).encode())
        + "."
        + b64url(json.dumps(claims, separators=(",", ":")).encode())
    )
    sig = hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest()
    return signing_input + "." + b64url(sig)


def jwt_authn_filter(issuer: str, secret: bytes, payload_in_metadata: str = "jwt_payload",
                     provider: str = "test", kid: str = "test-key") -> dict:
    """An `envoy.filters.http.jwt_authn` http_filters entry (for `pre_filters`): one provider
    with an inline HS256 `oct` JWKS, the token from `authorization: Bearer ...`, the verified
    payload in dynamic metadata under `payload_in_metadata`, the Authorization header kept
    (`forward`). Every path: a valid token or none (`allow_missing`); an invalid token gets 401."""
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": kid, "k": b64url(secret)}]}
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                provider: {
                    "issuer": issuer,
                    "local_jwks": {"inline_string": json.dumps(jwks)},
                    "from_headers": [{"name": "authorization", "value_prefix": "Bearer "}],
                    "payload_in_metadata": payload_in_metadata,
                    "forward": True,
                }
            },
            "rules": [
                {
                    "match": {"prefix": "/"},
                    "requires": {
                        "requires_any": {
                            "requirements": [
                                {"provider_name": provider},
                                {"allow_missing": {}},
                            ]
                        }
                    },
                }
            ],
        },
    }


# ---- local rate limit (after the filter) ---------------------------------------------------

LOCAL_RATELIMIT_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
)


def local_ratelimit_filter() -> dict:
    """An `envoy.filters.http.local_ratelimit` http_filters entry with no bucket of its own:
    it limits only the routes that carry `local_ratelimit_route(...)`."""
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {"@type": LOCAL_RATELIMIT_TYPE, "stat_prefix": "http_local_rate_limiter"},
    }


def local_ratelimit_route(max_tokens: int, fill_interval: str) -> dict:
    """typed_per_filter_config for a route limited by `local_ratelimit_filter()` (answers 429)."""
    always = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    return {
        "envoy.filters.http.local_ratelimit": {
            "@type": LOCAL_RATELIMIT_TYPE,
            "stat_prefix": "route_local_rate_limiter",
            "token_bucket": {"max_tokens": max_tokens, "tokens_per_fill": max_tokens,
                             "fill_interval": fill_interval},
            "filter_enabled": dict(always, runtime_key="local_rate_limit_enabled"),
            "filter_enforced": dict(always, runtime_key="local_rate_limit_enforced"),
        }
    }


# ---- CORS (before the filter) ---------------------------------------------------------------

CORS_FILTER = "envoy.filters.http.cors"


def cors_filter() -> dict:
    """An `envoy.filters.http.cors` http_filters entry (for `pre_filters`). It has no policy of
    its own: it acts on the routes or virtual hosts that carry `cors_policy(...)`."""
    return {
        "name": CORS_FILTER,
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"},
    }


def cors_policy(origins: Sequence[str], allow_methods: str = "GET, POST, OPTIONS",
                allow_headers: str = "idempotency-key, content-type, authorization",
                expose_headers: str = "idempotent-replayed, retry-after",
                max_age: str = "600", forward_not_matching_preflights: bool = False) -> dict:
    """typed_per_filter_config (for a virtual host, `orders_proxy(virtual_host_per_filter=...)`,
    or a route, `route(per_filter=...)`) with the CorsPolicy of `cors_filter()`: `origins` are
    exact origins (e.g. "http://localhost:3000"); the other fields are the header values Envoy
    sends as they are. `forward_not_matching_preflights`: False (as envoy/envoy.yaml ships it)
    answers a preflight from an origin not allowed in Envoy, without `access-control-allow-origin`;
    Envoy's default (True) forwards it upstream as a plain OPTIONS request."""
    return {
        CORS_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy",
            "allow_origin_string_match": [{"exact": o} for o in origins],
            "allow_methods": allow_methods,
            "allow_headers": allow_headers,
            "expose_headers": expose_headers,
            "max_age": max_age,
            "forward_not_matching_preflights": forward_not_matching_preflights,
        }
    }


def orders_proxy(
    upstream_port: int,
    unreachable_port: int,
    filter_config: dict | str | None,
    wasm_path: Path | str | None = None,
    route_timeout: str = "5s",
    buffer_limit: int = 2 * MiB,
    connection_buffer_limit: int | None = None,
    extra_routes: Sequence[dict] = (),
    extra_clusters: Sequence[dict] = (),
    pre_filters: Sequence[dict] = (),
    post_filters: Sequence[dict] = (),
    enable_trailers: bool = True,
    failure_policy: str = "FAIL_RELOAD",
    stats_config: dict | None = None,
    suppress_envoy_headers: bool = False,
    virtual_host_per_filter: dict | None = None,
    access_log: Sequence[dict] = (),
    tracing: dict | None = None,
    hcm_options: dict | None = None,
    extra_listeners: Sequence[dict] = (),
    header_prefix: str | None = None,
) -> dict:
    """The proxy in front of the orders upstream (cluster `orders`).

    filter_config: the filter's JSON configuration (dict, or a raw string), or None for Envoy
    WITHOUT the wasm filter. Routes: `extra_routes` first, then `/unreachable` (cluster
    `unreachable`, on `unreachable_port`, which should refuse connections), then `/` -> the
    upstream. An `extra_routes` entry may be any Envoy route (e.g. `direct_response(...)`): only
    entries with a `route` action get the default timeout.

    HTTP filter chain: `pre_filters` (e.g. jwt_authn), the idempotency filter, `post_filters`
    (e.g. a local rate limit that answers locally after the filter claimed), the router.
    `stats_config`: the bootstrap's (e.g. `shipped_stats_config()`, the stats tags of
    envoy/envoy.yaml). `virtual_host_per_filter`: the virtual host's typed_per_filter_config
    (e.g. `cors_policy(...)`, with `cors_filter()` in `pre_filters`). `access_log`: the HCM's
    access loggers (`file_access_log(...)`). `tracing`: the HCM's tracing (`zipkin_tracing(...)`,
    whose collector cluster goes in `extra_clusters`). `hcm_options`: more HCM fields
    (`internal_callers()`). `extra_listeners`: listeners after the proxy's own (e.g.
    `admin_listener(...)`). `header_prefix`: the bootstrap's `header_prefix`, which renames
    every `x-envoy-*` header Envoy reads or writes (`x-acme`: `x-acme-upstream-service-time`,
    `x-acme-retry-on`, ...), to be matched by the filter's `envoy_header_prefix`.
    """
    if filter_config is not None and wasm_path is None:
        raise ValueError("a filter configuration needs wasm_path")
    routes = []
    for r in _copy(list(extra_routes)):
        r.setdefault("request_body_buffer_limit", buffer_limit)
        if "route" in r:  # direct_response routes have no route action
            r["route"].setdefault("timeout", route_timeout)
        routes.append(r)
    for prefix, cluster_name in (("/unreachable", "unreachable"), ("/", "orders")):
        routes.append(
            {
                "match": {"prefix": prefix},
                "route": {"cluster": cluster_name, "timeout": route_timeout},
                "request_body_buffer_limit": buffer_limit,
            }
        )
    http_filters = _copy(list(pre_filters))
    if filter_config is not None:
        http_filters.append(filter_http_filter(filter_config, wasm_path, failure_policy))
    http_filters += _copy(list(post_filters))
    trailers = {"enable_trailers": enable_trailers}
    hcm = http_connection_manager(
        routes, http_filters, "ingress_http", trailers,
        suppress_envoy_headers=suppress_envoy_headers,
        virtual_host_per_filter=None if virtual_host_per_filter is None
        else _copy(virtual_host_per_filter),
        access_log=access_log,
        tracing=tracing,
        hcm_options=hcm_options,
    )
    clusters = [
        cluster("orders", upstream_port, trailers),
        cluster("unreachable", unreachable_port, trailers),
    ] + list(extra_clusters)
    config = bootstrap(
        hcm, clusters, buffer_limit if connection_buffer_limit is None else connection_buffer_limit
    )
    if stats_config is not None:
        config["stats_config"] = _copy(stats_config)
    config["static_resources"]["listeners"] += _copy(list(extra_listeners))
    if header_prefix is not None:
        config["header_prefix"] = header_prefix
    return config


def admin_listener(admin_config: dict | str, wasm_path: Path | str, port: int = 0,
                   access_log: Sequence[dict] = ()) -> dict:
    """A listener (named `idempotency_admin`) whose only filter is the idempotency filter with
    an admin configuration (`{"admin": {...}}`): the same module, vm_id and root_id as the
    proxy's filter, so it reads the same shared data, as the shipped envoy/envoy.yaml has it.
    `access_log`: its access loggers (the shipped one prints each request's audit entry)."""
    hcm = http_connection_manager(
        [{"match": {"prefix": "/"}, "direct_response": {"status": 404}}],
        [filter_http_filter(admin_config, wasm_path)],
        "idempotency_admin",
        access_log=access_log,
    )
    return {"name": "idempotency_admin", "address": socket_address(port), "filter_chains": [{"filters": [hcm]}]}
