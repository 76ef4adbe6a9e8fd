"""The run's main phase: every scenario (bench/scenarios.py) on its own proxy Envoy, measured in
interleaved rounds, then verified against Envoy's own counters.

Closed loop: R rounds; each round runs every scenario for D seconds, in an order rotated every
round (A B C D E, B C D E A, ...). Then an open-loop phase at one fixed rate (a fraction of the
slowest scenario's closed-loop throughput) compares latency at the same load, and the equal-load
phase runs each pair of EQUAL_LOAD_PAIRS (an etcd and a local scenario) at one rate. Envoy's CPU
time per request comes from /proc/<pid>/stat deltas around each run, its peak RSS from VmHWM.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from bench import OUT_DIR, HarnessError, log
from bench.envoys import (ETCD_CLUSTER, ORDERS, bench_envoy, checked, idle_cpu_per_s, proxy_config,
                          upstream_config)
from bench.load import spread
from bench.scenarios import (EQUAL_LOAD_PAIRS, REPLAY_KEYS, Scenario, build_scenarios, etcd_clusters,
                             store_timeouts_only)
from idemkit.client import request
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd

if TYPE_CHECKING:
    from bench.harness import Bench


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


def setup(b: Bench) -> None:
    """The upstream, etcd when the run has etcd scenarios, every scenario's proxy; then the keys
    the replay scenarios will replay, stored."""
    a = b.args
    b.upstream = bench_envoy("upstream", upstream_config(), a.envoy)
    b.start([b.upstream])
    # Sanity: the upstream answers 201 with the 1 KiB body.
    resp = request(b.upstream.port, "POST", "/orders", b"{}",
                   {"content-type": "application/json"}, timeout=5)
    b.upstream_headers = resp.headers
    if resp.status != 201 or len(resp.body) != 1024:
        raise HarnessError(f"upstream answered {resp.status} with {len(resp.body)} bytes")

    b.scenarios, b.filter_configs = build_scenarios(a, b.new_key_ttl)
    extra: dict[int, list[dict]] = {}
    if a.etcd == "on":
        (OUT_DIR / "etcd").mkdir(parents=True, exist_ok=True)
        b.etcd = Etcd("etcd", log_dir=OUT_DIR / "etcd", durable=True)
        try:
            b.etcd.start()
        except (RuntimeError, TimeoutError, OSError) as e:
            raise HarnessError(f"etcd did not start: {e}") from None
        extra = etcd_clusters(b.etcd.client_port)
    for s in b.scenarios:
        s.envoy = bench_envoy(f"s{s.sid}-{s.name}",
                              proxy_config(b.upstream.port, s.filters_fn(), extra.get(s.sid)), a.envoy)
    t0 = time.monotonic()
    b.start([s.envoy for s in b.scenarios])
    log(f"  {len(b.scenarios) + 1} Envoys ready in {time.monotonic() - t0:.1f}s "
        f"(upstream :{b.upstream.port}, proxies " + ", ".join(f"s{s.sid} :{s.envoy.port}" for s in b.scenarios)
        + (f"; etcd :{b.etcd.client_port}" if b.etcd else "") + ")")
    s6 = b.sid(6)
    if s6 and s6.envoy:
        check_naive(b, s6.envoy)
    # The replay scenarios: store the keys they will replay.
    for s in b.scenarios:
        if s.keys != "replay":
            continue
        s.replay_prefix = b.fresh_prefix(f"replay{s.sid}")
        r = b.loadgen.run(s.envoy.port, ORDERS, requests=REPLAY_KEYS, key_set=(s.replay_prefix, REPLAY_KEYS),
                          connections=1, label=f"s{s.sid} store keys")
        b.check_result(f"s{s.sid}", r, "storing the replay keys", fatal=True)
        if r["ok"] != REPLAY_KEYS:
            raise HarnessError(f"s{s.sid}: stored {r['ok']} of {REPLAY_KEYS} keys")


def check_naive(b: Bench, env: Envoy) -> None:
    """The naive filter does its work: a key's first request goes through, the same key again
    finds the claim (409 from the naive filter)."""
    key = b.fresh_prefix("naive-check")
    hdrs = {"content-type": "application/json", "idempotency-key": key}
    got = [request(env.port, "POST", ORDERS, b'{"n":1}', hdrs, timeout=5).status for _ in range(2)]
    if got != [201, 409]:
        raise HarnessError(f"naive filter: a key sent twice got {got}, expected [201, 409]")


def run_one(b: Bench, s: Scenario, duration: float, rate: float | None = None, label: str = "") -> tuple[dict, float, float]:
    kwargs: dict[str, Any] = {}
    if s.keys == "replay":
        kwargs["key_set"] = (s.replay_prefix, REPLAY_KEYS)
        kwargs["expect_header"] = "idempotent-replayed: true"
    else:
        kwargs["key_prefix"] = b.fresh_prefix(f"s{s.sid}")
    assert s.envoy and b.upstream
    checked(s.envoy, s.envoy.check_alive)
    checked(b.upstream, b.upstream.check_alive)
    m0 = etcd_methods(b.etcd) if s.store == "etcd" else {}
    ecpu0 = b.etcd.cpu_seconds() if s.store == "etcd" and b.etcd else 0.0
    cpu0, ucpu0 = s.envoy.cpu_seconds(), b.upstream.cpu_seconds()
    r = b.loadgen.run(s.envoy.port, s.path, duration=duration, rate=rate, label=label or f"s{s.sid}", **kwargs)
    cpu1, ucpu1 = s.envoy.cpu_seconds(), b.upstream.cpu_seconds()
    if s.store == "etcd" and b.etcd:
        r["etcd_cpu_s"] = b.etcd.cpu_seconds() - ecpu0
    if s.store == "etcd":
        for k, v in etcd_methods(b.etcd).items():
            s.etcd_methods[k] = s.etcd_methods.get(k, 0) + v - m0.get(k, 0)
    checked(s.envoy, s.envoy.check_alive)
    return r, cpu1 - cpu0, ucpu1 - ucpu0


def run(b: Bench) -> None:
    """Warm-up, the closed-loop rounds, the open-loop rounds, the equal-load phase, then the
    verification of every scenario (after `setup`)."""
    a = b.args
    n = len(b.scenarios)
    log(f"  warm-up: {a.warmup:g}s per scenario")
    for s in b.scenarios:
        r, _, _ = run_one(b, s, a.warmup, label=f"s{s.sid} warm-up")
        b.check_result(f"s{s.sid}", r, "warm-up", fatal=a.smoke and not store_timeouts_only(s, r))
        s.rss_after_warmup = s.envoy.memory_kib()
    time.sleep(0.2)
    for s in b.scenarios:
        s.counters_before = s.envoy.outcomes()
        s.upstream_rq_before = s.envoy.counter("cluster.upstream.upstream_rq_total")
        if s.store == "etcd":
            s.etcd_rq_before = s.envoy.counter(f"cluster.{ETCD_CLUSTER}.upstream_rq_total")
            s.etcd_methods = {}
    log(f"  closed loop: {a.rounds} rounds x {a.duration:g}s per scenario, {a.connections} connections, order rotated every round")
    for rnd in range(a.rounds):
        order = [b.scenarios[(rnd + i) % n] for i in range(n)]
        line = []
        for s in order:
            r, cpu, ucpu = run_one(b, s, a.duration, label=f"s{s.sid} round {rnd + 1}")
            b.check_result(f"s{s.sid}", r, f"round {rnd + 1}", fatal=a.smoke and not store_timeouts_only(s, r))
            s.closed.append(r)
            s.cpu.append(cpu)
            s.up_cpu.append(ucpu)
            if "etcd_cpu_s" in r:
                s.etcd_cpu.append(r["etcd_cpu_s"])
            line.append(f"s{s.sid} {r['ok_rps']:7.0f}/s p99 {r['latency_us']['p99'] / 1000:5.2f}ms")
        log(f"  round {rnd + 1:2d}: " + " | ".join(line))
    # The etcd scenarios run closed loop only: their throughput is set by the store's round
    # trips, and a rate half of theirs would say little about the local scenarios' latency.
    local = [s for s in b.scenarios if s.store != "etcd"]
    if a.open_rounds > 0:
        slowest = min(spread([r["ok_rps"] for r in s.closed])["median"] for s in local)
        b.open_rate = max(100.0, round(slowest * a.open_fraction / 100.0) * 100.0)
        log(f"  open loop: {a.open_rounds} rounds x {a.duration:g}s per scenario at {b.open_rate:.0f} req/s "
            f"({a.open_fraction:.0%} of the slowest local scenario's closed-loop throughput)")
        for rnd in range(a.open_rounds):
            order = [local[(rnd + i) % len(local)] for i in range(len(local))]
            line = []
            for s in order:
                r, _, _ = run_one(b, s, a.duration, rate=b.open_rate, label=f"s{s.sid} open {rnd + 1}")
                b.check_result(f"s{s.sid}", r, f"open-loop round {rnd + 1}", fatal=a.smoke)
                s.open.append(r)
                line.append(f"s{s.sid} p99 {r['latency_us']['p99'] / 1000:5.2f}ms")
            log(f"  open {rnd + 1:2d}: " + " | ".join(line))
    equal_load(b)
    time.sleep(0.3)  # counters are bumped when a stream ends
    for s in b.scenarios:
        s.counters_after = s.envoy.outcomes()
        s.upstream_rq_after = s.envoy.counter("cluster.upstream.upstream_rq_total")
        if s.store == "etcd":
            s.etcd_rq_after = s.envoy.counter(f"cluster.{ETCD_CLUSTER}.upstream_rq_total")
        s.rss_end = s.envoy.memory_kib()
    verify(b)


def equal_load(b: Bench) -> None:
    """The local and the etcd store at one open-loop rate (scenarios 4 and 7, 5 and 8, 5 and 13): Envoy's
    CPU per request depends on its load (at a few hundred requests a second every request
    wakes Envoy on its own, at thousands their events share wake-ups and warm caches), and
    the closed loop runs the etcd scenarios at a tenth of the local ones' rate. The rate is
    `open_fraction` of the slower etcd scenario's closed-loop throughput, so both stores
    sustain it; each run lasts twice `duration`, and its CPU is read from schedstat (ns), since
    stat's 10 ms ticks are a few hundred requests' worth at this rate."""
    a = b.args
    pairs = [(b.sid(loc), b.sid(e)) for e, loc in EQUAL_LOAD_PAIRS]
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
    b.equal_rate = max(50.0, round(slowest * a.open_fraction / 50.0) * 50.0)
    log(f"  equal load: {a.open_rounds} rounds x {2 * a.duration:g}s of scenarios "
        + ", ".join(f"{x.sid} and {y.sid}" for x, y in pairs) + f" at {b.equal_rate:.0f} req/s")
    for rnd in range(a.open_rounds):
        line = []
        for x, y in pairs:
            for s in ((x, y) if rnd % 2 == 0 else (y, x)):
                assert s.envoy
                ns0, t0 = s.envoy.cpu_ns(), time.monotonic()
                r, _, _ = run_one(b, s, 2 * a.duration, rate=b.equal_rate, label=f"s{s.sid} equal {rnd + 1}")
                cpu, wall = (s.envoy.cpu_ns() - ns0) / 1e9, time.monotonic() - t0
                b.check_result(f"s{s.sid}", r, f"equal-load round {rnd + 1}",
                               fatal=a.smoke and not store_timeouts_only(s, r))
                s.equal.append((r, cpu))
                s.equal_idle.append(s.idle_cpu_per_s * wall)
                line.append(f"s{s.sid} {(cpu - s.idle_cpu_per_s * wall) / max(1, r['requests']) * 1e6:6.0f} µs/req")
        log(f"  equal {rnd + 1:2d}: " + " | ".join(line))


def verify(b: Bench) -> None:
    """The scenarios did what they claim (from Envoy's own counters)."""
    fatal = b.args.smoke
    for s in b.scenarios:
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
            b.problem(f"s{s.sid} verification: " + "; ".join(problems),
                      fatal and not (s.store == "etcd" and n503 and d.get("store_error")))
