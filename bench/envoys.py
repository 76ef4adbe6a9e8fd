"""The Envoys every benchmark tool starts, and how: the fast upstream, a proxy Envoy in front of it
with the HTTP filters of a scenario, the filter's configuration (local or etcd store), and the
helpers that start an Envoy and watch it. The run's phases (bench/rounds.py, bench/memory.py,
bench/fill.py) and the tools beside them (bench/profile.py, bench/callout_floor.py) all take them
from here, so they all measure the same Envoys.

Processes (all the same Envoy binary, each with --concurrency 1 --disable-hot-restart unless a
phase asks for more workers):
  upstream  a fast Envoy: buffer filter (reads the whole request body) + a direct_response route
            answering 201 with a fixed ~1 KiB JSON body;
  proxies   one per scenario (bench/scenarios.py) or phase, each in front of that upstream, with
            its own Wasm filters; the etcd store's proxies also have a cluster for etcd.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from bench import OUT_DIR, HarnessError
from idemkit import bootstrap
from idemkit.bootstrap import MiB
from idemkit.envoy import Envoy, EnvoyStartError

ORDERS = "/orders"
OTHER = "/other"
ETCD_CLUSTER = "etcd"  # the proxy's cluster for the etcd store; its upstream_rq_total = round trips
ETCD_PREFIX = "/bench/"

# Plugin configuration of scenarios 3 and 5 (as given in the issue).
FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 100000},
    # The load generator is one anonymous caller creating every key: a quota as large as the
    # store never refuses it, and the bench pays for the quota counters as a deployment with
    # quotas does (without `quota` a new key costs two host calls fewer).
    "quota": {"per_tenant": 100000, "per_principal": 100000},
    "routes": [
        {
            "name": "orders",
            "match": {"prefix": "/orders", "methods": ["POST"]},
            "require_key": True,
            "ttl": "24h",
        }
    ],
}


def filter_config(ttl: str | None = None, processing_timeout: str | None = None,
                  store: dict | None = None, execution: str | None = None, quota: bool = True) -> str:
    """FILTER_CONFIG with these changes; `quota=False`: without the `quota` section, as the
    product runs by default (no identity is counted)."""
    cfg = json.loads(json.dumps(FILTER_CONFIG))
    if not quota:
        del cfg["quota"]
    if execution:
        cfg["routes"][0]["execution"] = execution
    if store is not None:
        cfg["store"] = store
    if ttl:
        cfg["routes"][0]["ttl"] = ttl
    if processing_timeout:
        cfg["routes"][0]["processing_timeout"] = processing_timeout
    return json.dumps(cfg, separators=(",", ":"))


def response_body() -> str:
    """The upstream's fixed answer: a JSON object of exactly 1024 bytes."""
    head = '{"id":"ord_0001","status":"created","item":"book","qty":1,"currency":"EUR","total":1299,"note":"'
    tail = '"}'
    fill = "".join("abcdefghijklmnopqrstuvwxyz0123456789"[i % 36] for i in range(1024 - len(head) - len(tail)))
    body = head + fill + tail
    assert len(body) == 1024
    return body


def upstream_config() -> dict:
    """The fast upstream: reads the whole body (buffer filter), answers 201 + 1 KiB JSON."""
    buffer_filter = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": 2 * MiB,
        },
    }
    routes = [
        {
            "match": {"prefix": "/"},
            "direct_response": {"status": 201, "body": {"inline_string": response_body()}},
            "response_headers_to_add": [
                {"header": {"key": "content-type", "value": "application/json"}}
            ],
        }
    ]
    hcm = bootstrap.http_connection_manager(routes, [buffer_filter], "upstream")
    return bootstrap.bootstrap(hcm, [], max_connections=10000)


def wasm_filter(wasm: str, name: str, configuration: str) -> dict:
    return bootstrap.wasm_filter(name, wasm, configuration)


def etcd_store(protocol: str) -> dict:
    """The filter's etcd store as docs/CONFIGURATION.md documents it (fail_closed, 250 ms per callout)."""
    return {"type": "etcd", "cluster": ETCD_CLUSTER, "prefix": ETCD_PREFIX, "timeout": "250ms",
            "on_error": "fail_closed", "protocol": protocol}


def proxy_config(upstream_port: int, http_filters: list[dict], extra_clusters: list[dict] | None = None) -> dict:
    routes = [
        {
            "match": {"prefix": "/"},
            "route": {"cluster": "upstream", "timeout": "15s"},
            "request_body_buffer_limit": 2 * MiB,
        }
    ]
    hcm = bootstrap.http_connection_manager(routes, http_filters, "ingress_http")
    clusters = [bootstrap.cluster("upstream", upstream_port)] + (extra_clusters or [])
    return bootstrap.bootstrap(hcm, clusters, max_connections=10000)


def bench_envoy(name: str, config: dict, envoy_bin: str, concurrency: int = 1) -> Envoy:
    """One of the benchmark's Envoys, logging to bench/.out/<name>/."""
    log_dir = OUT_DIR / name
    log_dir.mkdir(parents=True, exist_ok=True)
    return Envoy(envoy_bin, config, name, concurrency, log_level="warn", component_log_level=None,
                 log_dir=log_dir)


def idle_cpu_per_s(envoys: list[Envoy]) -> list[float]:
    """What each Envoy burns without traffic (timers, the filter's tick, stats), in CPU seconds per
    second, over 3 s after half a second's rest: taken off each run at one open-loop rate, where
    it is the same absolute amount for every filter and would pull their ratios towards 1."""
    time.sleep(0.5)
    ns0, t0 = [e.cpu_ns() for e in envoys], time.monotonic()
    time.sleep(3.0)
    wall = time.monotonic() - t0
    return [(e.cpu_ns() - n) / 1e9 / wall for e, n in zip(envoys, ns0)]


def checked(env: Envoy, step: Callable[..., Any], *args: Any) -> Any:
    """`step` (env.check_alive, env.wait_ready) with a failure as a HarnessError that shows the
    tail of Envoy's log."""
    try:
        return step(*args)
    except (EnvoyStartError, TimeoutError) as exc:
        raise HarnessError(f"{exc}\n{env.failure_report(40)}") from None
