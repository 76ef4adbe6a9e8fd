"""The callout floor (issue 20): what one gRPC call to etcd per request costs Envoy at the least,
next to the filter's replay on the local store (scenario 5) and on etcd (scenario 8), at one
open-loop rate. Not part of `make bench`; `make bench-smoke` runs one short round of it, printed only.

    make bench-callout-floor [FLOOR_ARGS='--rate 200 --rounds 6']

The floor is bench/callout-floor: it holds the request for its body, makes one KV/Range callout
to etcd for a value the size of scenario 8's stored record, and answers 201 with its last 1 KiB.
It does none of a replay's own work (fingerprint, record, scope, headers, metrics). So F/5 is
the least any one-round-trip replay can cost over the local replay on Envoy 1.40, and 8/F is
what the filter's replay adds over a bare callout. Each Envoy's CPU per request comes from its
threads' schedstat time around each run, less what it burns idle over the run's wall time (as
the equal-load phase of `make bench`); the runs are interleaved, their order rotated each round.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time

from bench import HarnessError, log, rel
from bench.envoys import (ETCD_CLUSTER, ETCD_PREFIX, ORDERS, bench_envoy, checked, etcd_store, filter_config,
                          idle_cpu_per_s, proxy_config, upstream_config, wasm_filter)
from bench.load import Loadgen, spread
from bench.report import CALLOUT_FLOOR_HEADING, CALLOUT_FLOOR_SECTION, update_section
from bench.scenarios import REPLAY_KEYS
from idemkit import bootstrap
from idemkit.etcd import Etcd

FLOOR_KEY = "/bench-floor/record"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def stored_record(etcd: Etcd) -> bytes:
    """One of scenario 8's stored records, as etcd holds it."""
    start = (ETCD_PREFIX + "r/").encode()
    end = start[:-1] + bytes([start[-1] + 1])
    kvs = etcd.post("/v3/kv/range", {"key": b64(start), "range_end": b64(end), "limit": 1}).get("kvs") or []
    if not kvs:
        raise HarnessError("scenario 8 stored no record in etcd")
    return base64.b64decode(kvs[0]["value"])


def markdown(a: argparse.Namespace, scenarios: dict, per_req: dict[str, list[float]], record_bytes: int) -> str:
    med = {s: statistics.median(v) for s, v in per_req.items()}
    # Ratios per round (the runs of one round are back to back), then their spread.
    per_round = {s: spread([x / y for x, y in zip(per_req[s], per_req["5"])]) for s in per_req}
    args = [f"--rate {a.rate:g}"] * (a.rate != 200) + [f"--rounds {a.rounds}"] * (a.rounds != 6) + \
        [f"--duration {a.duration:g}"] * (a.duration != 6)
    command = "make bench-callout-floor" + (f" FLOOR_ARGS='{' '.join(args)}'" if args else "")
    rows = [f"| {sid} | {title} | {med[sid]:,.0f} | **{per_round[sid]['median']:.2f}x** | "
            f"{per_round[sid]['min']:.2f}..{per_round[sid]['max']:.2f} |" for sid, (title, _, _) in scenarios.items()]
    callout, work_local, work_etcd = med["F"] - med["L"], med["5"] - med["L"], med["8"] - med["F"]
    return "\n".join([
        CALLOUT_FLOOR_HEADING,
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` (`bench/callout_floor.py`): "
        f"four proxy Envoys in front of one upstream and one etcd member, all at {a.rate:g} req/s open loop "
        f"(as the equal-load phase above), {a.rounds} rounds x {a.duration:g} s, the order rotated every round; "
        "Envoy's CPU per request from its threads' schedstat time, less what it burns idle. L and F are "
        "`bench/callout-floor`, a filter that holds the request for its body and answers 201 with 1 KiB: L at "
        f"once, F after one gRPC KV/Range callout to etcd for a value of {record_bytes:,} bytes (a stored record "
        "of scenario 8), reading the answer's `:status`, `grpc-status` and body as the filter does. Neither does "
        "any of a replay's own work (fingerprint, record, scope, headers, metrics).",
        "",
        "| | scenario | µs/req | over 5 (median of rounds) | min..max |",
        "|---|---|---:|---:|---:|",
        *rows,
        "",
        f"One callout costs Envoy {callout:,.0f} µs here (F - L), {callout / work_local:.1f} times the "
        f"replay's own work on the local store ({work_local:,.0f} µs, 5 - L); on etcd the replay's own work "
        f"is {work_etcd:,.0f} µs over the callout (8 - F). "
        + verdict(per_round["F"]["median"], work_local, callout),
    ])


def verdict(floor: float, work_local: float, callout: float) -> str:
    """What the floor says of issue 20's bound on 8/5, from this run's numbers."""
    head = f"Issue 20 bounds 8/5 at 1.5x. F, a filter that makes the one round trip the issue requires and nothing else, is at {floor:.2f}x: "
    if floor >= 1.5:
        return head + ("so no one-round-trip replay meets the bound on Envoy 1.40. The replay cache (scenario 13) "
                       "does, since it makes no callout.")
    # 8/5 <= 1.5 needs the callout to be at most half of the local replay's cost: L + work >= 2 x callout.
    return head + (f"a replay meets the bound only if its callout ({callout:,.0f} µs) is at most half of its local "
                   f"cost (L + {work_local:,.0f} µs of the replay's own work).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", default="dist/idempotency_filter.wasm")
    ap.add_argument("--floor-wasm", default="target/wasm32-wasip1/release/callout_floor.wasm")
    ap.add_argument("--loadgen", default="target/release/loadgen")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second, every scenario")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per run")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--report", default="BENCHMARKS.md", help="the file whose callout-floor section to write")
    ap.add_argument("--no-report", action="store_true", help="print only")
    a = ap.parse_args()

    loadgen = Loadgen(a.loadgen, a.connections)
    etcd = Etcd("floor-etcd", durable=True).start()
    envoys = []
    try:
        upstream = bench_envoy("floor-upstream", upstream_config(), a.envoy)
        envoys.append(upstream)
        upstream.spawn()  # its port is the proxies' upstream
        checked(upstream, upstream.wait_ready, 60.0)
        grpc = bootstrap.etcd_cluster([etcd.client_port], name=ETCD_CLUSTER, health_checks=False, grpc=True)
        wasm = rel(a.wasm)
        scenarios = {
            "5": ("the filter, local store, replay", [wasm_filter(wasm, "idempotency", filter_config())], None),
            "8": ("the filter, etcd (gRPC), replay",
                  [wasm_filter(wasm, "idempotency", filter_config(store=etcd_store("grpc")))], [grpc]),
            "L": ("the local floor: the same answer without the callout",
                  [wasm_filter(rel(a.floor_wasm), "floor", "local")], None),
            "F": ("the callout floor: one KV/Range callout, nothing else",
                  [wasm_filter(rel(a.floor_wasm), "floor", FLOOR_KEY)], [grpc]),
        }
        proxies = {}
        for sid, (_, filters, clusters) in scenarios.items():
            proxies[sid] = bench_envoy(f"floor-s{sid}", proxy_config(upstream.port, filters, clusters), a.envoy)
            envoys.append(proxies[sid])
        for p in proxies.values():
            p.spawn()
        for p in proxies.values():
            checked(p, p.wait_ready, 60.0)
        prefix = f"floor-{int(time.time())}"
        for sid in ("5", "8"):
            r = loadgen.run(proxies[sid].port, ORDERS, requests=REPLAY_KEYS, key_set=(f"{prefix}-{sid}", REPLAY_KEYS),
                            connections=1, label=f"s{sid} store keys")
            if r["ok"] != REPLAY_KEYS:
                raise HarnessError(f"s{sid}: stored {r['ok']} of {REPLAY_KEYS} keys: {r['statuses']}")
        record = stored_record(etcd)
        etcd.post("/v3/kv/put", {"key": b64(FLOOR_KEY.encode()), "value": b64(record)})
        log(f"  the floor reads a value of {len(record)} bytes, scenario 8's stored record")

        idle = dict(zip(proxies, idle_cpu_per_s(list(proxies.values()))))
        per_req: dict[str, list[float]] = {s: [] for s in proxies}
        order = list(proxies)
        for rnd in range(a.rounds):
            line = []
            for sid in order[rnd % len(order):] + order[: rnd % len(order)]:
                p = proxies[sid]
                # 5 and 8 replay the keys stored above; the floors take any key.
                kwargs: dict = ({"key_set": (f"{prefix}-{sid}", REPLAY_KEYS), "expect_header": "idempotent-replayed: true"}
                                if sid in ("5", "8") else {"key_prefix": prefix})
                ns0_, t0_ = p.cpu_ns(), time.monotonic()
                r = loadgen.run(p.port, ORDERS, duration=a.duration, rate=a.rate, label=f"s{sid} round {rnd + 1}", **kwargs)
                cpu, w = (p.cpu_ns() - ns0_) / 1e9, time.monotonic() - t0_
                checked(p, p.check_alive)
                if r["errors"] or r["ok"] != r["requests"] or not r["requests"]:
                    raise HarnessError(f"s{sid} round {rnd + 1}: {r['requests']} sent, {r['ok']} ok, "
                                       f"statuses {r['statuses']}, errors {r['errors']}")
                per_req[sid].append((cpu - idle[sid] * w) / r["requests"] * 1e6)
                line.append(f"s{sid} {per_req[sid][-1]:6.0f} µs/req")
            log(f"  round {rnd + 1}: " + " | ".join(line))
    finally:
        for e in reversed(envoys):
            e.stop()
        etcd.stop()

    text = markdown(a, scenarios, per_req, len(record))
    log("\n" + text)
    if not a.no_report:
        update_section(a.report, CALLOUT_FLOOR_SECTION, text)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except HarnessError as e:
        log(f"callout floor: {e}")
        raise SystemExit(1) from None
