"""The benchmark's numbered scenarios: what each one runs, and the facts about them that both the
phases that run them (bench/rounds.py) and the report that reads them (bench/report.py,
report_more.py) need. It imports no phase and no report module, so both sides can import it
without importing each other (bench/test_imports.py).

One proxy Envoy per scenario (bench/envoys.py), all in front of the same upstream:
   1 envoy               Envoy without any Wasm filter
   2 noop                Envoy + a no-op Rust proxy-wasm filter (bench/noop-filter)
   3 passthrough         the filter; the request matches no rule (POST /other)
   4 new-key             the filter; a new Idempotency-Key per request (claim, forward, store)
   5 replay              the filter; every request replays one of a few stored keys (no upstream)
   6 naive               a naive idempotency filter (bench/naive-filter), new key per request
   7 etcd-new            the filter with the etcd store over gRPC, new key per request
   8 etcd-replay         the filter with the etcd store over gRPC, replay of a stored key
   9 detached-new        the filter, new key per request, with `execution: "detached"`
  10 etcd-new-json       scenario 7 over etcd's JSON gateway (the store's default protocol)
  11 etcd-new-before     scenario 10 with the filter at --before-wasm (`make bench BENCH_BEFORE=<commit>`)
  12 etcd-new-default    scenario 7 at the product's default: no `quota`, so nothing is counted
  13 etcd-replay-cached  scenario 8 with `store.replay_cache` on: replays answered from memory
  14 new-key-default     scenario 4 at the product's default: no `quota`, so nothing is counted
  15-18 (*-before)       with --before-wasm: scenarios 3, 4, 5 and 9 with the filter at that commit
The etcd scenarios (7, 8 and 10 to 13) share one real etcd member on free loopback ports, started
and stopped by the run (idemkit/etcd.py), its data directory removed at the end.
"""

from __future__ import annotations

import argparse

from bench import rel
from bench.envoys import ETCD_CLUSTER, ORDERS, OTHER, etcd_store, filter_config, wasm_filter
from idemkit import bootstrap
from idemkit.envoy import Envoy

REPLAY_KEYS = 64  # scenario 5: keys stored before the rounds, then replayed in turn
# The pairs of the equal-load phase: (etcd scenario, local scenario), each pair run at one
# open-loop rate (bench/report_more.py holds issue 20's bounds on their CPU ratios).
EQUAL_LOAD_PAIRS = ((7, 4), (8, 5), (13, 5))


class Scenario:
    """One scenario of the run: its proxy's filters, the keys it sends, what its verification
    expects, and everything the phases measured of it."""

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


def build_scenarios(a: argparse.Namespace, new_key_ttl: str) -> tuple[list[Scenario], dict[int, str]]:
    """The run's scenarios in the order they are measured, and the idempotency filter's
    configuration per scenario id (the report quotes them); 6 only with --naive-wasm, the etcd
    ones only with --etcd on, 11 and 15 to 18 only with --before-wasm."""
    wasm = rel(a.wasm)
    noop = rel(a.noop_wasm)
    cfg = filter_config()
    cfg4 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl)
    scenarios = [
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
    cfg9 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl, execution="detached")
    scenarios.append(
        Scenario(9, "detached-new", "filter, new key per request, detached execution", ORDERS, "unique",
                 lambda: [wasm_filter(wasm, "idempotency", cfg9)], "new", "local"))
    # Scenario 4 as an operator gets it without a `quota` section (the default): no quota
    # counters are read or written.
    cfg14 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl, quota=False)
    scenarios.append(
        Scenario(14, "new-key-default", "filter, new key per request, no quota (the default)", ORDERS, "unique",
                 lambda: [wasm_filter(wasm, "idempotency", cfg14)], "new", "local"))
    configs = {3: cfg, 4: cfg4, 5: cfg, 9: cfg9, 14: cfg14}
    if a.before_wasm:
        # Scenarios 3, 4, 5 and 9 with the filter as it was at an earlier commit, in the same
        # rounds: what a change costs on the hot paths, as ratios from interleaved runs.
        before = rel(a.before_wasm)
        for sid, like in ((15, 3), (16, 4), (17, 5), (18, 9)):
            base = next(x for x in scenarios if x.sid == like)
            bcfg = configs[like]
            scenarios.append(
                Scenario(sid, base.name + "-before", f"{base.title}, the filter at {a.before_label}", base.path,
                         base.keys, lambda bcfg=bcfg: [wasm_filter(before, "idempotency", bcfg)], base.kind,
                         "local"))
            configs[sid] = bcfg
    if a.naive_wasm:
        naive = rel(a.naive_wasm)
        scenarios.append(
            Scenario(6, "naive", "naive idempotency filter, new key per request", ORDERS, "unique",
                     lambda: [wasm_filter(naive, "naive", "")]))
    if a.etcd == "on":
        # Same routes, quota and ttls as scenarios 4 and 5; only the store differs.
        # gRPC, as docs/ETCD.md recommends for a fleet; scenario 10 is scenario 7 over the
        # JSON gateway (the default protocol), in the same rounds.
        cfg7 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl, store=etcd_store("grpc"))
        cfg8 = filter_config(store=etcd_store("grpc"))
        cfg10 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl, store=etcd_store("json"))
        # 12: scenario 7 as an operator gets it without a `quota` section (the default since the
        # guarantee issue: no identity is counted, so a claim writes no quota index key). 13:
        # scenario 8 with the replay cache, the zero-round-trip replay.
        cfg12 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl, store=etcd_store("grpc"),
                              quota=False)
        cfg13 = filter_config(store=etcd_store("grpc") | {"replay_cache": {}})
        configs |= {7: cfg7, 8: cfg8, 10: cfg10, 12: cfg12, 13: cfg13}
        scenarios += [
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
            cfg11 = filter_config(ttl=new_key_ttl, processing_timeout=new_key_ttl, store=store11)
            configs[11] = cfg11
            scenarios.append(
                Scenario(11, "etcd-new-before", f"etcd store (JSON gateway), new key per request, the filter at "
                         f"{a.before_label}", ORDERS, "unique",
                         # "plain": its counters may have other names; statuses and upstream
                         # requests are still checked.
                         lambda: [wasm_filter(before, "idempotency", cfg11)], "plain", "etcd"))
    return scenarios, configs


def etcd_clusters(client_port: int) -> dict[int, list[dict]]:
    """The etcd scenarios' cluster to the etcd member, by scenario id: over gRPC, or to its JSON
    gateway for the scenarios on the JSON protocol."""
    # No health checks: with one member they only add requests to the cluster whose
    # request count is the store's round trips.
    grpc = bootstrap.etcd_cluster([client_port], name=ETCD_CLUSTER, health_checks=False, grpc=True)
    gateway = bootstrap.etcd_cluster([client_port], name=ETCD_CLUSTER, health_checks=False)
    return {7: [grpc], 8: [grpc], 10: [gateway], 11: [gateway], 12: [grpc], 13: [grpc]}
