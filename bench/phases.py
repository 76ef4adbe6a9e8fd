"""The benchmark's Envoys and its phases.

Processes (all the same Envoy binary, each with --concurrency 1 --disable-hot-restart):
  upstream  a fast Envoy: buffer filter (reads the whole request body) + a direct_response route
            answering 201 with a fixed ~1 KiB JSON body;
  s1 .. s5  one proxy Envoy per scenario, all in front of that upstream:
            1 envoy       Envoy without any Wasm filter
            2 noop        Envoy + a no-op Rust proxy-wasm filter (bench/noop-filter)
            3 passthrough the filter; the request matches no rule (POST /other)
            4 new-key     the filter; a new Idempotency-Key per request (claim, forward, store)
            5 replay      the filter; every request replays one of a few stored keys (no upstream)
            6 naive       a naive idempotency filter (bench/naive-filter), new key per request
            7 etcd-new    the filter with the etcd store over gRPC, new key per request
            8 etcd-replay the filter with the etcd store over gRPC, replay of a stored key
           10 etcd-new-json  scenario 7 over etcd's JSON gateway (the store's default protocol)
           11 etcd-new-before  scenario 10 with the filter at --before-wasm (`make bench BENCH_BEFORE=<commit>`)
           12 etcd-new-default scenario 7 at the product's default: no `quota`, so nothing is counted
           13 etcd-replay-cached scenario 8 with `store.replay_cache` on: replays answered from memory
            9 detached-new the filter, new key per request, with `execution: "detached"`
           15-18 with --before-wasm: scenarios 3, 4, 5 and 9 with the filter at that commit
           14 new-key-default scenario 4 at the product's default: no `quota`, so nothing is counted
  etcd      (scenarios 7, 8 and 10 to 13) one real etcd member on free loopback ports, started and
            stopped by the bench (idemkit/etcd.py), data directory removed at the end.
  mem       (memory phase) one more proxy with the filter, ttl 5s, fed 1,000,000 distinct keys.
  fill      (refusal curve, bench/fill.py) one more proxy with a small capacity, filled with new keys.

Closed loop: R rounds; each round runs every scenario for D seconds, in an order rotated every
round (A B C D E, B C D E A, ...). Then an open-loop phase at one fixed rate (a fraction of the
slowest scenario's closed-loop throughput) compares latency at the same load. Envoy's CPU time
per request comes from /proc/<pid>/stat deltas around each run, its peak RSS from VmHWM.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
import uuid
from typing import Any, Callable

from bench import OUT_DIR, HarnessError, loadavg, log, rel
from bench.load import Loadgen, spread
from bench.report_memory import ENTRY_BYTES, QUOTA_BYTES, SLOT_OVERHEAD
from bench.scenarios import EQUAL_LOAD_PAIRS
from idemkit import bootstrap
from idemkit.bootstrap import MiB
from idemkit.client import request
from idemkit.envoy import SWEPT_STAT, Envoy, EnvoyStartError
from idemkit.etcd import Etcd

ORDERS = "/orders"
OTHER = "/other"
REPLAY_KEYS = 64  # scenario 5: keys stored before the rounds, then replayed in turn
SWEPT = SWEPT_STAT
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


def etcd_methods(etcd: Etcd | None) -> dict[str, int]:
    """etcd's count of the gRPC calls it handled, by method (Txn, Range, LeaseGrant, ...), from its
    /metrics: the JSON gateway forwards each call to the gRPC server, which counts it."""
    if etcd is None:
        return {}
    try:
        resp = request(etcd.client_port, "GET", "/metrics", timeout=5)
    except OSError:
        return {}
    out: dict[str, int] = {}
    for m in re.finditer(r'^grpc_server_handled_total\{[^}]*grpc_method="(\w+)"[^}]*\} (\S+)$',
                         resp.body.decode("utf-8", "replace"), re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + int(float(m.group(2)))
    return out


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


# ------------------------------------------------------------------------------------------
# the benchmark

class Scenario:
    def __init__(self, sid: int, name: str, title: str, path: str, keys: str, filters_fn,
                 kind: str = "", store: str = "") -> None:
        self.sid = sid
        self.name = name
        self.title = title
        self.path = path
        self.keys = keys  # "unique" or "replay"
        self.filters_fn = filters_fn
        # What the verification expects: "plain" (no filter counters), "passthrough", "new", "replay".
        self.kind = kind or {"replay": "replay"}.get(keys, "plain")
        self.store = store  # "local", "etcd" or "" (no idempotency filter)
        self.replay_prefix = ""
        self.etcd_rq_before = 0
        self.etcd_rq_after = 0
        self.etcd_methods: dict[str, int] = {}  # etcd's own count of the calls it served, by method
        self.envoy: Envoy | None = None
        self.closed: list[dict] = []  # loadgen results of the measured closed-loop rounds
        self.open: list[dict] = []
        self.cpu: list[float] = []  # Envoy CPU seconds per closed-loop round
        self.up_cpu: list[float] = []  # upstream Envoy CPU seconds per closed-loop round
        self.etcd_cpu: list[float] = []  # etcd's CPU seconds per closed-loop round (etcd scenarios)
        # (loadgen result, Envoy CPU seconds) per run of the equal-load phase (scenarios 4, 5, 7, 8).
        self.equal: list[tuple[dict, float]] = []
        self.equal_idle: list[float] = []  # per equal-load run: the CPU seconds idling costs over its wall time
        self.idle_cpu_per_s = 0.0  # Envoy's CPU seconds per second without traffic (equal-load phase)
        self.rss_after_warmup: dict[str, int] = {}
        self.rss_end: dict[str, int] = {}
        self.counters_before: dict[str, int] = {}
        self.counters_after: dict[str, int] = {}
        self.upstream_rq_before = 0
        self.upstream_rq_after = 0
        self.errors: list[str] = []


def store_timeouts_only(s: Scenario, r: dict) -> bool:
    """An etcd scenario whose only errors are 503s (the store did not answer within its 250 ms
    timeout on this loaded machine: fail_closed): reported, but not a broken harness."""
    return (s.store == "etcd" and r["ok"] > 0 and set(r["unexpected_statuses"]) <= {"503"}
            and not (r["io_errors"] or r["timeouts"] or r["missing_header"]))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.loadgen = Loadgen(args.loadgen, args.connections)
        self.upstream: Envoy | None = None
        self.processes: list[Envoy] = []
        self.scenarios: list[Scenario] = []
        self.open_rate: float | None = None
        # The rate of the equal-load phase: the local and the etcd store's scenarios at one rate.
        self.equal_rate: float | None = None
        self.memory: dict[str, Any] | None = None
        self.wake: dict[str, Any] | None = None  # bench/wake_latency.py's result
        self.wake_failed = False
        self.failures: list[str] = []
        self.key_counter = 0
        self.started = time.time()
        self.loadavg_start = loadavg()
        self.new_key_ttl = args.new_key_ttl
        self.etcd: Etcd | None = None
        self.fill: dict[str, Any] | None = None  # bench/fill.py's refusal curve

    # ---- helpers -------------------------------------------------------------------------

    def fresh_prefix(self, what: str) -> str:
        self.key_counter += 1
        return f"{self.run_id}-{what}-{self.key_counter}"

    def start(self, envoys: list[Envoy]) -> None:
        for e in envoys:
            self.processes.append(e)
            e.spawn()
        for e in envoys:
            checked(e, e.wait_ready, 60.0)

    def stop_all(self) -> None:
        for e in reversed(self.processes):
            e.stop()
        self.stop_etcd()

    def stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()  # its temporary data directory goes with it
            self.etcd = None

    def sid(self, sid: int) -> Scenario | None:
        return next((s for s in self.scenarios if s.sid == sid), None)

    def problem(self, msg: str, fatal: bool) -> None:
        """A harness problem: logged and listed in the report; `fatal` stops the run."""
        log("  !! " + msg)
        self.failures.append(msg)
        if fatal:
            raise HarnessError(msg)

    def check_result(self, sc_name: str, r: dict, what: str, fatal: bool) -> None:
        """A loadgen result with errors or no requests is a harness failure (in the smoke run,
        always; in the full run it is reported and the command still succeeds)."""
        problems = []
        if r["requests"] == 0:
            problems.append("zero requests completed")
        if r["errors"]:
            problems.append(
                "%d error(s): unexpected statuses %s, i/o %d, timeouts %d, missing header %d; first: %s"
                % (r["errors"], r["unexpected_statuses"], r["io_errors"], r["timeouts"], r["missing_header"], r["first_error"])
            )
        if problems:
            self.problem(f"{sc_name} {what}: " + "; ".join(problems), fatal)

    # ---- main phase ----------------------------------------------------------------------

    def setup(self) -> None:
        a = self.args
        self.upstream = bench_envoy("upstream", upstream_config(), a.envoy)
        self.start([self.upstream])
        # Sanity: the upstream answers 201 with the 1 KiB body.
        resp = request(self.upstream.port, "POST", "/orders", b"{}",
                       {"content-type": "application/json"}, timeout=5)
        self.upstream_headers = resp.headers
        if resp.status != 201 or len(resp.body) != 1024:
            raise HarnessError(f"upstream answered {resp.status} with {len(resp.body)} bytes")

        wasm = rel(a.wasm)
        noop = rel(a.noop_wasm)
        cfg = filter_config()
        cfg4 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl)
        self.scenarios = [
            Scenario(1, "envoy", "Envoy alone (no Wasm filter)", ORDERS, "unique", lambda: []),
            Scenario(2, "noop", "Envoy + no-op Rust Wasm filter", ORDERS, "unique",
                     lambda: [wasm_filter(noop, "noop", "")]),
            Scenario(3, "passthrough", f"filter, no rule matches (POST {OTHER})", OTHER, "unique",
                     lambda: [wasm_filter(wasm, "idempotency", cfg)], "passthrough", "local"),
            Scenario(4, "new-key", "filter, new key per request (claim, forward, store)", ORDERS, "unique",
                     lambda: [wasm_filter(wasm, "idempotency", cfg4)], "new", "local"),
            Scenario(5, "replay", "filter, replay of a stored key (no upstream)", ORDERS, "replay",
                     lambda: [wasm_filter(wasm, "idempotency", cfg)], "replay", "local"),
        ]
        # Scenario 4 with detached execution: the root's callout carries every new key.
        cfg9 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl, execution="detached")
        self.scenarios.append(
            Scenario(9, "detached-new", "filter, new key per request, detached execution", ORDERS, "unique",
                     lambda: [wasm_filter(wasm, "idempotency", cfg9)], "new", "local"))
        # Scenario 4 as an operator gets it without a `quota` section (the default): no quota
        # counters are read or written.
        cfg14 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl, quota=False)
        self.scenarios.append(
            Scenario(14, "new-key-default", "filter, new key per request, no quota (the default)", ORDERS, "unique",
                     lambda: [wasm_filter(wasm, "idempotency", cfg14)], "new", "local"))
        self.filter_configs = {3: cfg, 4: cfg4, 5: cfg, 9: cfg9, 14: cfg14}
        if a.before_wasm:
            # Scenarios 3, 4, 5 and 9 with the filter as it was at an earlier commit, in the same
            # rounds: what a change costs on the hot paths, as ratios from interleaved runs.
            before = rel(a.before_wasm)
            for sid, like in ((15, 3), (16, 4), (17, 5), (18, 9)):
                base = next(x for x in self.scenarios if x.sid == like)
                bcfg = self.filter_configs[like]
                self.scenarios.append(
                    Scenario(sid, base.name + "-before", f"{base.title}, the filter at {a.before_label}", base.path,
                             base.keys, lambda bcfg=bcfg: [wasm_filter(before, "idempotency", bcfg)], base.kind,
                             "local"))
                self.filter_configs[sid] = bcfg
        if a.naive_wasm:
            naive = rel(a.naive_wasm)
            self.scenarios.append(
                Scenario(6, "naive", "naive idempotency filter, new key per request", ORDERS, "unique",
                         lambda: [wasm_filter(naive, "naive", "")]))
        extra: dict[int, list[dict]] = {}
        if a.etcd == "on":
            # Same routes, quota and ttls as scenarios 4 and 5; only the store differs.
            # gRPC, as docs/ETCD.md recommends for a fleet; scenario 10 is scenario 7 over the
            # JSON gateway (the default protocol), in the same rounds.
            cfg7 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl, store=etcd_store("grpc"))
            cfg8 = filter_config(store=etcd_store("grpc"))
            cfg10 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl, store=etcd_store("json"))
            # 12: scenario 7 as an operator gets it without a `quota` section (the default since the
            # guarantee issue: no identity is counted, so a claim writes no quota index key). 13:
            # scenario 8 with the replay cache, the zero-round-trip replay.
            cfg12 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl, store=etcd_store("grpc"),
                                  quota=False)
            cfg13 = filter_config(store=etcd_store("grpc") | {"replay_cache": {}})
            self.filter_configs |= {7: cfg7, 8: cfg8, 10: cfg10, 12: cfg12, 13: cfg13}
            self.scenarios += [
                Scenario(7, "etcd-new", "etcd store (gRPC), new key per request", ORDERS, "unique",
                         lambda: [wasm_filter(wasm, "idempotency", cfg7)], "new", "etcd"),
                Scenario(8, "etcd-replay", "etcd store (gRPC), replay of a stored key", ORDERS, "replay",
                         lambda: [wasm_filter(wasm, "idempotency", cfg8)], "replay", "etcd"),
                Scenario(10, "etcd-new-json", "etcd store (JSON gateway, the default), new key per request", ORDERS,
                         "unique", lambda: [wasm_filter(wasm, "idempotency", cfg10)], "new", "etcd"),
                Scenario(12, "etcd-new-default", "etcd store (gRPC), new key per request, no quota (the default)",
                         ORDERS, "unique", lambda: [wasm_filter(wasm, "idempotency", cfg12)], "new", "etcd"),
                Scenario(13, "etcd-replay-cached", "etcd store (gRPC), replay of a stored key, replay cache on",
                         ORDERS, "replay", lambda: [wasm_filter(wasm, "idempotency", cfg13)], "replay", "etcd"),
            ]
            if a.before_wasm:
                # The filter as it was at an earlier commit, on the JSON gateway (it may not know
                # `protocol`): what a change to the etcd store saved, measured in the same rounds.
                before = rel(a.before_wasm)
                store11 = {k: v for k, v in etcd_store("json").items() if k != "protocol"}
                cfg11 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl, store=store11)
                self.filter_configs[11] = cfg11
                self.scenarios.append(
                    Scenario(11, "etcd-new-before", f"etcd store (JSON gateway), new key per request, the filter at "
                             f"{a.before_label}", ORDERS, "unique",
                             # "plain": its counters may have other names; statuses and upstream
                             # requests are still checked.
                             lambda: [wasm_filter(before, "idempotency", cfg11)], "plain", "etcd"))
            (OUT_DIR / "etcd").mkdir(parents=True, exist_ok=True)
            self.etcd = Etcd("etcd", log_dir=OUT_DIR / "etcd", durable=True)
            try:
                self.etcd.start()
            except (RuntimeError, TimeoutError, OSError) as e:
                raise HarnessError(f"etcd did not start: {e}") from None
            # No health checks: with one member they only add requests to the cluster whose
            # request count is the store's round trips.
            grpc = bootstrap.etcd_cluster([self.etcd.client_port], name=ETCD_CLUSTER, health_checks=False, grpc=True)
            gateway = bootstrap.etcd_cluster([self.etcd.client_port], name=ETCD_CLUSTER, health_checks=False)
            extra = {7: [grpc], 8: [grpc], 10: [gateway], 11: [gateway], 12: [grpc], 13: [grpc]}
        for s in self.scenarios:
            s.envoy = bench_envoy(f"s{s.sid}-{s.name}",
                                  proxy_config(self.upstream.port, s.filters_fn(), extra.get(s.sid)), a.envoy)
        t0 = time.monotonic()
        self.start([s.envoy for s in self.scenarios])
        log(f"  {len(self.scenarios) + 1} Envoys ready in {time.monotonic() - t0:.1f}s "
            f"(upstream :{self.upstream.port}, proxies " + ", ".join(f"s{s.sid} :{s.envoy.port}" for s in self.scenarios)
            + (f"; etcd :{self.etcd.client_port}" if self.etcd else "") + ")")
        s6 = self.sid(6)
        if s6 and s6.envoy:
            self.check_naive(s6.envoy)
        # The replay scenarios: store the keys they will replay.
        for s in self.scenarios:
            if s.keys != "replay":
                continue
            s.replay_prefix = self.fresh_prefix(f"replay{s.sid}")
            r = self.loadgen.run(s.envoy.port, ORDERS, requests=REPLAY_KEYS, key_set=(s.replay_prefix, REPLAY_KEYS),
                                 connections=1, label=f"s{s.sid} store keys")
            self.check_result(f"s{s.sid}", r, "storing the replay keys", fatal=True)
            if r["ok"] != REPLAY_KEYS:
                raise HarnessError(f"s{s.sid}: stored {r['ok']} of {REPLAY_KEYS} keys")

    def check_naive(self, env: Envoy) -> None:
        """The naive filter does its work: a key's first request goes through, the same key again
        finds the claim (409 from the naive filter)."""
        key = self.fresh_prefix("naive-check")
        hdrs = {"content-type": "application/json", "idempotency-key": key}
        got = [request(env.port, "POST", ORDERS, b'{"n":1}', hdrs, timeout=5).status for _ in range(2)]
        if got != [201, 409]:
            raise HarnessError(f"naive filter: a key sent twice got {got}, expected [201, 409]")

    def run_one(self, s: Scenario, duration: float, rate: float | None = None, label: str = "") -> tuple[dict, float, float]:
        kwargs: dict[str, Any] = {}
        if s.keys == "replay":
            kwargs["key_set"] = (s.replay_prefix, REPLAY_KEYS)
            kwargs["expect_header"] = "idempotent-replayed: true"
        else:
            kwargs["key_prefix"] = self.fresh_prefix(f"s{s.sid}")
        assert s.envoy and self.upstream
        checked(s.envoy, s.envoy.check_alive)
        checked(self.upstream, self.upstream.check_alive)
        m0 = etcd_methods(self.etcd) if s.store == "etcd" else {}
        ecpu0 = self.etcd.cpu_seconds() if s.store == "etcd" and self.etcd else 0.0
        cpu0, ucpu0 = s.envoy.cpu_seconds(), self.upstream.cpu_seconds()
        r = self.loadgen.run(s.envoy.port, s.path, duration=duration, rate=rate, label=label or f"s{s.sid}", **kwargs)
        cpu1, ucpu1 = s.envoy.cpu_seconds(), self.upstream.cpu_seconds()
        if s.store == "etcd" and self.etcd:
            r["etcd_cpu_s"] = self.etcd.cpu_seconds() - ecpu0
        if s.store == "etcd":
            for k, v in etcd_methods(self.etcd).items():
                s.etcd_methods[k] = s.etcd_methods.get(k, 0) + v - m0.get(k, 0)
        checked(s.envoy, s.envoy.check_alive)
        return r, cpu1 - cpu0, ucpu1 - ucpu0

    def rounds(self) -> None:
        a = self.args
        n = len(self.scenarios)
        log(f"  warm-up: {a.warmup:g}s per scenario")
        for s in self.scenarios:
            r, _, _ = self.run_one(s, a.warmup, label=f"s{s.sid} warm-up")
            self.check_result(f"s{s.sid}", r, "warm-up", fatal=a.smoke and not store_timeouts_only(s, r))
            s.rss_after_warmup = s.envoy.memory_kib()
        time.sleep(0.2)
        for s in self.scenarios:
            s.counters_before = s.envoy.outcomes()
            s.upstream_rq_before = s.envoy.counter("cluster.upstream.upstream_rq_total")
            if s.store == "etcd":
                s.etcd_rq_before = s.envoy.counter(f"cluster.{ETCD_CLUSTER}.upstream_rq_total")
                s.etcd_methods = {}
        log(f"  closed loop: {a.rounds} rounds x {a.duration:g}s per scenario, {a.connections} connections, order rotated every round")
        for rnd in range(a.rounds):
            order = [self.scenarios[(rnd + i) % n] for i in range(n)]
            line = []
            for s in order:
                r, cpu, ucpu = self.run_one(s, a.duration, label=f"s{s.sid} round {rnd + 1}")
                self.check_result(f"s{s.sid}", r, f"round {rnd + 1}", fatal=a.smoke and not store_timeouts_only(s, r))
                s.closed.append(r)
                s.cpu.append(cpu)
                s.up_cpu.append(ucpu)
                if "etcd_cpu_s" in r:
                    s.etcd_cpu.append(r["etcd_cpu_s"])
                line.append(f"s{s.sid} {r['ok_rps']:7.0f}/s p99 {r['latency_us']['p99'] / 1000:5.2f}ms")
            log(f"  round {rnd + 1:2d}: " + " | ".join(line))
        # The etcd scenarios run closed loop only: their throughput is set by the store's round
        # trips, and a rate half of theirs would say little about the local scenarios' latency.
        local = [s for s in self.scenarios if s.store != "etcd"]
        if a.open_rounds > 0:
            slowest = min(spread([r["ok_rps"] for r in s.closed])["median"] for s in local)
            self.open_rate = max(100.0, round(slowest * a.open_fraction / 100.0) * 100.0)
            log(f"  open loop: {a.open_rounds} rounds x {a.duration:g}s per scenario at {self.open_rate:.0f} req/s "
                f"({a.open_fraction:.0%} of the slowest local scenario's closed-loop throughput)")
            for rnd in range(a.open_rounds):
                order = [local[(rnd + i) % len(local)] for i in range(len(local))]
                line = []
                for s in order:
                    r, _, _ = self.run_one(s, a.duration, rate=self.open_rate, label=f"s{s.sid} open {rnd + 1}")
                    self.check_result(f"s{s.sid}", r, f"open-loop round {rnd + 1}", fatal=a.smoke)
                    s.open.append(r)
                    line.append(f"s{s.sid} p99 {r['latency_us']['p99'] / 1000:5.2f}ms")
                log(f"  open {rnd + 1:2d}: " + " | ".join(line))
        self.equal_load()
        time.sleep(0.3)  # counters are bumped when a stream ends
        for s in self.scenarios:
            s.counters_after = s.envoy.outcomes()
            s.upstream_rq_after = s.envoy.counter("cluster.upstream.upstream_rq_total")
            if s.store == "etcd":
                s.etcd_rq_after = s.envoy.counter(f"cluster.{ETCD_CLUSTER}.upstream_rq_total")
            s.rss_end = s.envoy.memory_kib()
        self.verify()

    def equal_load(self) -> None:
        """The local and the etcd store at one open-loop rate (scenarios 4 and 7, 5 and 8, 5 and 13): Envoy's
        CPU per request depends on its load (at a few hundred requests a second every request
        wakes Envoy on its own, at thousands their events share wake-ups and warm caches), and
        the closed loop runs the etcd scenarios at a tenth of the local ones' rate. The rate is
        `open_fraction` of the slower etcd scenario's closed-loop throughput, so both stores
        sustain it; each run lasts twice `duration`, and its CPU is read from schedstat (ns), since
        stat's 10 ms ticks are a few hundred requests' worth at this rate."""
        a = self.args
        pairs = [(self.sid(loc), self.sid(e)) for e, loc in EQUAL_LOAD_PAIRS]
        pairs = [(x, y) for x, y in pairs if x and y]
        if a.open_rounds <= 0 or not pairs:
            return
        # What each of these Envoys burns without traffic (timers, the filter's tick, stats), per
        # second: the same absolute amount for both stores, which would pull their ratio towards
        # 1, so it is taken off each run (`equal_idle`).
        envs = [s for pair in pairs for s in pair if s.envoy]
        for s, idle in zip(envs, idle_cpu_per_s([s.envoy for s in envs])):
            s.idle_cpu_per_s = idle
        slowest = min(spread([r["ok_rps"] for r in y.closed])["median"] for _, y in pairs)
        self.equal_rate = max(50.0, round(slowest * a.open_fraction / 50.0) * 50.0)
        log(f"  equal load: {a.open_rounds} rounds x {2 * a.duration:g}s of scenarios "
            + ", ".join(f"{x.sid} and {y.sid}" for x, y in pairs) + f" at {self.equal_rate:.0f} req/s")
        for rnd in range(a.open_rounds):
            line = []
            for x, y in pairs:
                for s in ((x, y) if rnd % 2 == 0 else (y, x)):
                    assert s.envoy
                    ns0, t0 = s.envoy.cpu_ns(), time.monotonic()
                    r, _, _ = self.run_one(s, 2 * a.duration, rate=self.equal_rate, label=f"s{s.sid} equal {rnd + 1}")
                    cpu, wall = (s.envoy.cpu_ns() - ns0) / 1e9, time.monotonic() - t0
                    self.check_result(f"s{s.sid}", r, f"equal-load round {rnd + 1}",
                                      fatal=a.smoke and not store_timeouts_only(s, r))
                    s.equal.append((r, cpu))
                    s.equal_idle.append(s.idle_cpu_per_s * wall)
                    line.append(f"s{s.sid} {(cpu - s.idle_cpu_per_s * wall) / max(1, r['requests']) * 1e6:6.0f} µs/req")
            log(f"  equal {rnd + 1:2d}: " + " | ".join(line))

    def verify(self) -> None:
        """The scenarios did what they claim (from Envoy's own counters)."""
        fatal = self.args.smoke
        for s in self.scenarios:
            runs = s.closed + s.open + [r for r, _ in s.equal]
            sent = sum(r["requests"] for r in runs)
            d = {k: s.counters_after.get(k, 0) - s.counters_before.get(k, 0) for k in set(s.counters_after) | set(s.counters_before)}
            d = {k: v for k, v in d.items() if v}
            up = s.upstream_rq_after - s.upstream_rq_before
            s.verification = {"sent": sent, "filter_counters": d, "upstream_requests": up}
            if s.store == "etcd":
                # The store's round trips: every callout to etcd is one request on its cluster.
                s.verification["store_round_trips"] = s.etcd_rq_after - s.etcd_rq_before
                s.verification["etcd_methods"] = {k: v for k, v in s.etcd_methods.items() if v}
            expected: dict[str, int] = {}
            expect_up = sent
            if s.kind == "passthrough":
                expected = {"passed_through": sent}
            elif s.kind == "new":
                expected = {"claimed": sent, "stored": sent}
            elif s.kind == "replay":
                expected = {"replayed": sent}
                expect_up = 0
            problems = []
            if s.kind != "plain" and d != expected:
                problems.append(f"filter counters {d}, expected {expected}")
            if up != expect_up:
                problems.append(f"{up} upstream requests, expected {expect_up}")
            n503 = sum(r["statuses"].get("503", 0) for r in runs)
            if problems:
                self.problem(f"s{s.sid} verification: " + "; ".join(problems),
                             fatal and not (s.store == "etcd" and n503 and d.get("store_error")))

    # ---- memory phase --------------------------------------------------------------------

    def memory_phase(self) -> None:
        a = self.args
        if self.upstream is None:
            self.upstream = bench_envoy("upstream", upstream_config(), a.envoy)
            self.start([self.upstream])
        ttl = "5s"
        cfg = filter_config(ttl=ttl, processing_timeout=ttl)
        env = bench_envoy("mem", proxy_config(self.upstream.port, [wasm_filter(rel(a.wasm), "idempotency", cfg)]), a.envoy,
                          concurrency=a.memory_concurrency)
        self.start([env])
        time.sleep(0.5)
        idle = env.memory_kib()
        heap_idle = env.allocator()
        total = a.memory_requests
        log(f"  memory: {total:,} requests with distinct keys, {a.connections} connections, ttl {ttl}, "
            f"capacity 100000; RSS sampled every {a.memory_interval:g}s")
        samples: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            m = env.memory_kib()
            try:
                rq = env.counter("http.ingress_http.downstream_rq_total", settle=False)
                st = env.outcomes(settle=False)
                swept = env.counter(SWEPT, settle=False)
            except OSError:
                rq, st, swept = -1, {}, 0
            samples.append({
                "t": round(time.monotonic() - t0, 2),
                "requests": rq,
                "rss_kib": m.get("VmRSS", 0),
                "hwm_kib": m.get("VmHWM", 0),
                "stored": st.get("stored", 0),
                "store_full": st.get("store_full", 0),
                "swept": swept,
            })

        def sampler() -> None:
            while not stop.wait(a.memory_interval):
                try:
                    sample()
                except OSError:
                    return

        sample()
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        cpu0 = env.cpu_seconds()
        # 503 store_full is tolerated here (not in the smoke run): with ttl 5s about (rate x 5 s)
        # records are live, and a bucket of 8 now and then holds 8 of them. They are counted and
        # must match the filter's own store_full counter.
        expect = "201" if a.smoke else "201,503"
        try:
            r = self.loadgen.run(env.port, ORDERS, requests=total, duration=a.memory_max_seconds,
                                 key_prefix=self.fresh_prefix("mem"), expect=expect, label="memory")
        finally:
            stop.set()
            th.join()
        cpu = env.cpu_seconds() - cpu0
        time.sleep(0.3)
        sample()
        checked(env, env.check_alive)
        counters = env.outcomes()
        swept = env.counter(SWEPT)
        heap_end = env.allocator()
        env.stop()
        self.check_result("memory", r, "memory phase", fatal=a.smoke)
        if r["requests"] < total:
            self.problem(f"memory phase: {r['requests']:,} of {total:,} requests completed "
                         f"(stopped by the {a.memory_max_seconds:g} s cap)", a.smoke)
        full_503 = r["statuses"].get("503", 0)
        if full_503 != counters.get("store_full", 0):
            self.problem(f"memory phase: {full_503} answers 503 but the filter counted "
                         f"{counters.get('store_full', 0)} store_full", a.smoke)

        rss = [s["rss_kib"] for s in samples]
        # RSS once as many records were written as the store holds, and at the end.
        after_cap = next((s for s in samples if s["requests"] >= 100000), None)
        cap_growth = ((samples[-1]["rss_kib"] - after_cap["rss_kib"]) / after_cap["rss_kib"]
                      if after_cap and after_cap["rss_kib"] else float("nan"))
        third = samples[len(samples) * 2 // 3:] if len(samples) >= 3 else samples
        base = third[0]["rss_kib"] if third else 0
        growth = (max(s["rss_kib"] for s in third) - base) / base if base else float("nan")
        # The bound docs/OPERATIONS.md states: capacity x (bucket entry + slot + response + quota counters)
        # + fixed cost (bench/report_memory.py's constants).
        stored_headers = sum(
            6 + len(k) + len(v)
            for k, v in self.upstream_headers_for_bound()
        )
        slot = 45 + 4 + stored_headers + 1024
        per_record = ENTRY_BYTES + SLOT_OVERHEAD + QUOTA_BYTES + stored_headers + 1024
        self.memory = {
            "requests": total,
            "result": r,
            "samples": samples,
            "idle_kib": idle,
            "heap_idle": heap_idle,
            "heap_end": heap_end,
            "peak_rss_kib": max(rss) if rss else 0,
            "last_third_growth": growth,
            "after_capacity": after_cap,
            "after_capacity_growth": cap_growth,
            # Judged only when the store was written over at least twice.
            "levels_off": (growth < 0.05 if growth == growth else False) if r["requests"] >= 200000 else None,
            "counters": counters,
            "swept": swept,
            "cpu_us_per_req": cpu / max(1, r["requests"]) * 1e6,
            "slot_bytes": slot,
            "per_record": per_record,
            "bound_records_mib": 100000 * per_record / MiB,
            "ttl": ttl,
        }
        log(f"  memory: {r['requests']:,} requests in {r['elapsed_s']:.1f}s ({r['ok_rps']:.0f}/s), "
            f"statuses {r['statuses']}; RSS idle {idle.get('VmRSS', 0) / 1024:.1f} MiB -> peak {max(rss) / 1024:.1f} MiB; "
            f"last third grows {growth:.1%}")
        for s in samples:
            log(f"    t={s['t']:7.2f}s requests={s['requests']:>9,} RSS={s['rss_kib'] / 1024:8.1f} MiB "
                f"stored={s['stored']:>9,} store_full={s['store_full']:>5,} swept={s['swept']:>9,}")

    def upstream_headers_for_bound(self) -> list[tuple[str, str]]:
        """The response headers a snapshot keeps, as the filter sees them from this upstream
        (the proxy adds x-envoy-upstream-service-time; hop-by-hop and content-length are not
        kept)."""
        hop = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}
        hs = [(k.lower(), v) for k, v in getattr(self, "upstream_headers", []) if k.lower() not in hop]
        if not hs:
            hs = [("content-type", "application/json"), ("date", "Thu, 01 Jan 2026 00:00:00 GMT"), ("server", "envoy")]
        hs.append(("x-envoy-upstream-service-time", "0"))
        return hs

