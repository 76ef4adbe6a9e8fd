"""Issue 49: what one claim of a new key costs Envoy 1.40 through the dynamic-modules interface
(bench/native-floor, a minimal native module) beside the same claim through proxy-wasm (the
project's filter, dist/idempotency_filter.wasm), and the ratio of their marginal costs.

    make bench-native-floor [NATIVE_FLOOR_ARGS="--rounds 12 --duration 4"]

which builds the module into target/native-floor and runs this script.

Scenarios, each its own proxy Envoy (--concurrency 1 --disable-hot-restart) in front of one
upstream Envoy (buffer filter + direct_response 201 with 1 KiB of JSON), as bench/envoys.py
makes them:
  A   Envoy alone (no HTTP filter but the router)
  N0  the native module, mode "noop": continue everywhere (the interface's own floor)
  N   the native module, mode "claim": hold the body, fingerprint, scope, CAS claim, snapshot
  W   the Wasm filter, new key: {"store":{"type":"local","capacity":100000},"routes":[orders]}
Every request: POST /orders, a 1024-byte JSON body, content-type application/json, a fresh
idempotency-key (the new-key path). Open loop at one rate for every scenario, interleaved
rounds with the order rotated each round. CPU per request of the proxy Envoy: its threads'
schedstat run time (and, as a cross-check, /proc/<pid>/stat utime+stime, 10 ms ticks) around
each run, less what it burns idle over the run's wall time, over the answers counted.
Logs and configs: <temporary directory>/native-floor/.
"""

from __future__ import annotations

import tempfile

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_DIR = HERE.parent.parent
sys.path.insert(0, str(REPO_DIR))

from bench import HarnessError  # noqa: E402
from bench.envoys import ORDERS, checked, filter_config, idle_cpu_per_s, proxy_config, response_body, upstream_config, wasm_filter  # noqa: E402
from bench.load import BODY_BYTES, Loadgen, spread  # noqa: E402
from idemkit.envoy import Envoy, default_binary  # noqa: E402
from idemkit import process  # noqa: E402

LOG_ROOT = Path(tempfile.gettempdir()) / "native-floor"
MODULE_NAME = "native_floor"  # Envoy loads lib<name>.so from ENVOY_DYNAMIC_MODULES_SEARCH_PATH
CLK_TCK = os.sysconf("SC_CLK_TCK")

SCENARIOS = {
    "A": "Envoy alone",
    "N0": "native module, no-op (continue everywhere)",
    "N": "native module, claim of a new key + snapshot",
    "W": "Wasm filter (proxy-wasm, V8), new key",
}


def native_filter(mode: str) -> dict:
    return {
        "name": "native_floor",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": MODULE_NAME, "do_not_close": True},
            "filter_name": "native_floor",
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": mode},
        },
    }


def stat_ticks_ns(pid: int) -> int:
    """utime + stime of the process from /proc/<pid>/stat, in ns (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // CLK_TCK


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (Envoy makes its threads at start, before this)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that ended meanwhile


def envoy(name: str, config: dict, binary: str) -> Envoy:
    log_dir = LOG_ROOT / name
    log_dir.mkdir(parents=True, exist_ok=True)
    return Envoy(binary, config, name, 1, log_level="warn", component_log_level=None, log_dir=log_dir)


def json_body(size: int, tag: str) -> bytes:
    head = '{"item":"book","qty":1,"tag":"%s","pad":"' % tag
    body = head + "x" * (size - len(head) - 2) + '"}'
    assert len(body) == size
    return body.encode()


def check_replay(proxy: Envoy, upstream: Envoy) -> list[str]:
    """One new key, its retry (same key, same body), and a reuse with another body, through the
    native module; what was seen, as lines. Raises HarnessError if the replay is wrong."""
    key = f"check-{int(time.time() * 1000)}"
    body = json_body(BODY_BYTES, "check")
    headers = {"content-type": "application/json", "idempotency-key": key}
    counter = "http.upstream.downstream_rq_total"
    u0 = upstream.counter(counter)
    first = proxy.post(ORDERS, body, headers)
    u1 = upstream.counter(counter)
    retry = proxy.post(ORDERS, body, headers)
    u2 = upstream.counter(counter)
    other = proxy.post(ORDERS, json_body(BODY_BYTES, "other"), headers)
    u3 = upstream.counter(counter)
    lines = [
        f"first:  {first.status}, {len(first.body)} B body, upstream requests +{u1 - u0}",
        f"retry:  {retry.status}, {len(retry.body)} B body, same body: {retry.body == first.body}, "
        f"idempotent-replayed: {retry.header('idempotent-replayed')}, fingerprinted request bytes: "
        f"{retry.header('x-native-floor-request-bytes')}, upstream requests +{u2 - u1}",
        f"reuse with another body: {other.status}, upstream requests +{u3 - u2}",
    ]
    ok = (first.status == 201 and first.body == response_body().encode() and u1 - u0 == 1
          and retry.status == 201 and retry.body == first.body and u2 == u1
          and retry.header("x-native-floor-request-bytes") == str(BODY_BYTES)
          and other.status == 422 and u3 == u2)
    if not ok:
        raise HarnessError("native replay check failed:\n  " + "\n  ".join(lines))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envoy", default=str(default_binary() or ""))
    ap.add_argument("--wasm", default=str(REPO_DIR / "dist" / "idempotency_filter.wasm"))
    ap.add_argument("--module-dir", default=str(REPO_DIR / "target" / "native-floor" / "release"),
                    help="directory holding libnative_floor.so")
    ap.add_argument("--loadgen", default=str(REPO_DIR / "target" / "release" / "loadgen"))
    ap.add_argument("--rate", type=float, default=1000.0, help="requests per second, every scenario")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--scenarios", default="A,N0,N,W")
    ap.add_argument("--json", default=str(LOG_ROOT / "results.json"))
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=os.cpu_count() == 2,
                    help="proxies on CPU 0; upstream, load generator and this script on CPU 1 (default on 2 CPUs)")
    a = ap.parse_args()

    so = Path(a.module_dir) / f"lib{MODULE_NAME}.so"
    if not so.exists():
        raise SystemExit(f"{so} is missing: build bench/native-floor first (see README.md)")
    if not Path(a.envoy).exists():
        raise SystemExit("no Envoy binary: pass --envoy")
    os.environ["ENVOY_DYNAMIC_MODULES_SEARCH_PATH"] = str(Path(a.module_dir).resolve())
    LOG_ROOT.mkdir(parents=True, exist_ok=True)

    wanted = [s for s in a.scenarios.split(",") if s]
    filters = {
        "A": [],
        "N0": [native_filter("noop")],
        "N": [native_filter("claim")],
        "W": [wasm_filter(str(Path(a.wasm).resolve()), "idempotency", filter_config(quota=False))],
    }
    loadgen = Loadgen(a.loadgen, a.connections)
    try:
        upstream = envoy("upstream", upstream_config(), a.envoy).spawn()
        checked(upstream, upstream.wait_ready, 60.0)
        proxies = {s: envoy(f"proxy-{s}", proxy_config(upstream.port, filters[s]), a.envoy) for s in wanted}
        for p in proxies.values():
            p.spawn()
        for p in proxies.values():
            checked(p, p.wait_ready, 60.0)
        print(f"Envoy {a.envoy}\nmodule {so}\nwasm {a.wasm}", flush=True)
        if a.pin:
            for p in proxies.values():
                pin(p.proc.pid, {0})
            pin(upstream.proc.pid, {1})
            os.sched_setaffinity(0, {1})  # the load generator, started from here, inherits it
            print("pinned: proxies on CPU 0; upstream, loadgen on CPU 1", flush=True)

        check = check_replay(proxies["N"], upstream) if "N" in proxies else []
        for line in check:
            print("  check (native): " + line, flush=True)

        prefix = f"nf-{int(time.time())}"
        for sid, p in proxies.items():  # warm-up: JIT, connection pools, first allocations
            loadgen.run(p.port, ORDERS, duration=1.0, rate=a.rate, key_prefix=f"{prefix}-warm-{sid}",
                        label=f"warm {sid}")
        idle = dict(zip(proxies, idle_cpu_per_s(list(proxies.values()))))
        print("idle CPU (ms/s): " + ", ".join(f"{s} {v * 1e3:.2f}" for s, v in idle.items()), flush=True)

        per_req: dict[str, list[float]] = {s: [] for s in proxies}
        per_req_stat: dict[str, list[float]] = {s: [] for s in proxies}
        order = list(proxies)
        for rnd in range(a.rounds):
            line = []
            for sid in order[rnd % len(order):] + order[: rnd % len(order)]:
                p = proxies[sid]
                pid = p.proc.pid
                n0, s0, t0 = p.cpu_ns(), stat_ticks_ns(pid), time.monotonic()
                r = loadgen.run(p.port, ORDERS, duration=a.duration, rate=a.rate,
                                key_prefix=f"{prefix}-r{rnd}-{sid}", label=f"r{rnd} {sid}")
                n1, s1, wall = p.cpu_ns(), stat_ticks_ns(pid), time.monotonic() - t0
                ok = r.get("ok", 0)
                errors = r.get("errors", 0)
                if not ok or errors:
                    raise HarnessError(f"round {rnd} {sid}: ok {ok}, errors {errors}: {r.get('statuses')}")
                idle_ns = idle[sid] * 1e9 * wall
                per_req[sid].append((n1 - n0 - idle_ns) / ok / 1e3)
                per_req_stat[sid].append((s1 - s0 - idle_ns) / ok / 1e3)
                line.append(f"{sid} {per_req[sid][-1]:.1f}")
            print(f"round {rnd + 1}/{a.rounds}: " + ", ".join(line) + " µs/req", flush=True)

        summary = report(a, per_req, per_req_stat)
        Path(a.json).write_text(json.dumps({"args": vars(a), "per_req_us": per_req, "per_req_stat_us": per_req_stat,
                                            "idle_cpu_per_s": idle, "check": check, "summary": summary}, indent=1))
        print(f"raw results: {a.json}")
        return 0
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(list(process.LIVE)):  # every Envoy this script started, by its own handle
            proc.stop()


def report(a: argparse.Namespace, per_req: dict[str, list[float]], per_req_stat: dict[str, list[float]]) -> dict:
    med = {s: statistics.median(v) for s, v in per_req.items()}
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {a.rounds} rounds x {a.duration:g} s, "
          f"{a.rate:g} req/s open loop, {a.connections} connections, pinned: {a.pin}; proxy Envoy CPU per request, "
          "idle removed\n")
    print("| | scenario | µs/req (schedstat, median) | min..max | µs/req (/proc stat, median) |")
    print("|---|---|---:|---:|---:|")
    for s, v in per_req.items():
        sp = spread(v)
        print(f"| {s} | {SCENARIOS[s]} | {sp['median']:.1f} | {sp['min']:.1f}..{sp['max']:.1f} | "
              f"{statistics.median(per_req_stat[s]):.1f} |")
    out: dict = {"median_us": med}
    if {"A", "N", "W"} <= per_req.keys():
        # Per round (the runs of one round are back to back), then the spread of the rounds.
        rounds = [((n - al) / (w - al)) for al, n, w in zip(per_req["A"], per_req["N"], per_req["W"]) if w - al > 0]
        ratio = spread(rounds)
        of_medians = (med["N"] - med["A"]) / (med["W"] - med["A"])
        out.update(ratio_per_round=ratio, ratio_of_medians=of_medians,
                   native_marginal_us=med["N"] - med["A"], wasm_marginal_us=med["W"] - med["A"])
        print(f"\nmarginal cost over Envoy alone: native claim {med['N'] - med['A']:.1f} µs, "
              f"Wasm new key {med['W'] - med['A']:.1f} µs")
        print(f"(N - A) / (W - A): {of_medians:.3f} of the medians; per round median {ratio['median']:.3f} "
              f"(min {ratio['min']:.3f} .. max {ratio['max']:.3f})")
        if "N0" in per_req:
            out["noop_marginal_us"] = med["N0"] - med["A"]
            print(f"native no-op over Envoy alone: {med['N0'] - med['A']:.1f} µs; claim work over the no-op: "
                  f"{med['N'] - med['N0']:.1f} µs")
    return out


if __name__ == "__main__":
    sys.exit(main())
