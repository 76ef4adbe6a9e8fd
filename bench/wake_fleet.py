"""Wait mode across a fleet: a duplicate held on Envoy B while its original runs on Envoy A,
both on one etcd, with each store protocol (issue 20's stretch: etcd's Watch instead of polling).

    python -m bench.wake_fleet --envoy BIN --wasm dist/idempotency_filter.wasm
        [--samples 60] [--waiters 2] [--rounds 2]

Each sample: an original on A whose upstream takes a random 0.3 to 2.5 s (so that A's
completion falls anywhere in B's polling backoff), then `waiters` duplicates on B, 100 ms
later. Samples run 10 at a time. Per protocol, interleaved over `rounds`:
- wake latency: B's duplicate's response time minus A's response time, as this client sees
  them (p50, p99, max);
- etcd requests per waiter, and per second of waiting: etcd's Txn and Range calls during the
  round (grpc_server_handled_total; the gateway forwards each of its calls to the gRPC server),
  less what the originals cost (a claim and a completion each) and each waiter's first look
  (its park), over the waiters, and over the seconds they were held.
Everything runs on this machine (two Envoys with 2 workers each, etcd, the upstream, the
client): the numbers compare the two protocols, they are not a capacity figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
from pathlib import Path

from bench import OUT_DIR
from bench.report import WAKE_FLEET_SECTION, update_section
from bench.wake_latency import held_duplicates, percentile
from idemkit.bootstrap import etcd_cluster
from idemkit.client import new_key
from idemkit.envoy import OrdersProxy
from idemkit.etcd import Etcd
from idemkit.process import Upstream, fresh_log_dir

BODY = b'{"n":1}'
BATCH = 10


def config(protocol: str) -> dict:
    return {
        "store": {"type": "etcd", "cluster": "etcd", "prefix": f"/bench-wake-{protocol}/",
                  "protocol": protocol},
        "max_waiters_per_key": 50,
        "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                    "concurrent": "wait", "wait_timeout": "10s", "processing_timeout": "30s"}],
    }


def etcd_requests(etcd) -> float:
    return sum(etcd.metric("grpc_server_handled_total", grpc_method=m) for m in ("Txn", "Range"))


def sample(a, b, upstream, rng, waiters, out):
    headers = {"idempotency-key": new_key(), "content-type": "application/json",
               "x-delay-ms": str(rng.randint(300, 2500))}
    (r0, t0), held = held_duplicates(a, b, upstream, headers, waiters, pause_s=0.1)
    for r, began, t1 in held:
        ok = r.status == 201 and r.replayed and r.body == r0.body
        out.append({"ok": ok, "latency_ms": (t1 - t0) * 1000.0, "held_s": t1 - began})


def measure(protocol, envoy_bin, wasm, etcd, upstream, samples, waiters, seed):
    rng = random.Random(seed)
    pair = [
        OrdersProxy(envoy_bin, upstream.port, config(protocol), wasm_path=Path(wasm).resolve(),
                    name=f"wake-{name}-{protocol}", component_log_level="wasm:info",
                    extra_clusters=[etcd_cluster([etcd.client_port], grpc=protocol == "grpc")],
                    log_dir=fresh_log_dir(f"wake-{name}-{protocol}", OUT_DIR)).start()
        for name in ("a", "b")
    ]
    try:
        a, b = pair
        # Warm both: leases granted, the watch stream's first open not in the numbers.
        for proxy in pair:
            proxy.post("/orders", BODY, {"idempotency-key": new_key(), "content-type": "application/json"})
        results = []
        before = etcd_requests(etcd)
        for start in range(0, samples, BATCH):
            batch = [threading.Thread(target=sample, args=(a, b, upstream, random.Random(rng.random()),
                                                           waiters, results))
                     for _ in range(min(BATCH, samples - start))]
            for t in batch:
                t.start()
            for t in batch:
                t.join(60)
        requests = etcd_requests(etcd) - before
    finally:
        for proxy in pair:
            proxy.stop()
    lat = [r["latency_ms"] for r in results if r["ok"]]
    held_s = sum(r["held_s"] for r in results)
    waiting_requests = requests - 2 * samples - len(results)
    return {
        "protocol": protocol, "waiters": len(results), "errors": sum(1 for r in results if not r["ok"]),
        "p50_ms": round(percentile(lat, 50), 1), "p99_ms": round(percentile(lat, 99), 1),
        "max_ms": round(max(lat), 1) if lat else None,
        "etcd_requests_per_waiter": round(waiting_requests / max(1, len(results)), 2),
        "etcd_requests_per_waiter_s": round(waiting_requests / held_s, 3) if held_s else None,
        "held_s_per_waiter": round(held_s / max(1, len(results)), 2),
    }


def markdown(results: list[dict], command: str) -> str:
    rows = [
        "| round | store.protocol | waiters | wake p50 ms | wake p99 ms | max ms | etcd requests per waiter | per waiter per s held |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(f"| {r['round']} | {r['protocol']} | {r['waiters']} | {r['p50_ms']} | {r['p99_ms']} | "
                    f"{r['max_ms']} | {r['etcd_requests_per_waiter']} | {r['etcd_requests_per_waiter_s']} |")
    return "\n".join([
        "## Wait mode across a fleet: polling or etcd's Watch",
        "",
        f"`{command}` (bench/wake_fleet.py): two Envoys (2 workers each) on one etcd, this machine. "
        "Each sample: an original on A whose upstream takes a random 0.3 to 2.5 s, then waiters on B "
        "100 ms later, 10 samples at a time; wake latency is B's response end minus A's, as the client "
        "sees them. etcd requests: Txn and Range during the round, less the originals' claim and "
        "completion and each waiter's first look, per waiter and per second it was held. Over the JSON "
        "gateway a waiter polls (50 ms doubling to 1 s); over gRPC its worker watches the record and "
        "it looks once when the watch is confirmed and once when the record changes.",
        "",
        *rows,
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--waiters", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--report", default="BENCHMARKS.md", help="the file whose wake-fleet section to write")
    ap.add_argument("--no-report", action="store_true", help="print only")
    args = ap.parse_args()
    upstream = Upstream("wake-fleet-upstream", log_dir=fresh_log_dir("wake-fleet-upstream", OUT_DIR)).start()
    etcd = Etcd("wake-fleet-etcd", log_dir=fresh_log_dir("wake-fleet-etcd", OUT_DIR), durable=True).start()
    failed, results = False, []
    try:
        for r in range(args.rounds):
            for protocol in ("json", "grpc") if r % 2 == 0 else ("grpc", "json"):
                result = measure(protocol, args.envoy, args.wasm, etcd, upstream, args.samples,
                                 args.waiters, seed=r)
                print("round %d:" % r, json.dumps(result), flush=True)
                results.append(dict(result, round=r))
                failed |= bool(result["errors"])
    finally:
        etcd.stop()
        upstream.stop()
    if not failed and not args.no_report:
        command = "make bench-wake-fleet" + (f" BENCH_ARGS='--samples {args.samples} --waiters {args.waiters} "
                                             f"--rounds {args.rounds}'"
                                             if (args.samples, args.waiters, args.rounds) != (60, 2, 2) else "")
        update_section(args.report, WAKE_FLEET_SECTION, markdown(results, command))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
