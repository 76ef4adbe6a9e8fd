"""Wait mode's wake-up latency: the time from the original's completion to a held duplicate's
response, across Envoy's worker threads (issue 4). Part of `make bench`.

Each sample: an original request (upstream delay 50 ms) on its own connection, then W
duplicates on fresh connections (Envoy spreads connections over its workers), held by the
filter until the original completes. Latency = waiter's response time - original's response
time, both seen by this client, so it includes the client's own scheduling (an upper bound of
the filter's wake-up path: shared-queue message, on_queue_ready, recheck, local reply).

Usage (from the repository root): python -m bench.wake_latency --envoy BIN --wasm dist/idempotency_filter.wasm
       [--samples 150] [--waiters 4] [--append BENCHMARKS.md] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from idemkit import REPO_ROOT
from idemkit.client import new_key
from idemkit.envoy import OrdersProxy
from idemkit.process import Upstream, fresh_log_dir, wait_until

LOG_ROOT = REPO_ROOT / "bench" / ".out"  # gitignored (bench/.gitignore)

CONFIG = {
    "store": {"type": "local", "capacity": 100000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
                "concurrent": "wait", "wait_timeout": "10s"}],
}


def percentile(values, q):
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, int(round(q / 100.0 * (len(ordered) - 1)))))
    return ordered[k]


def measure(envoy, upstream, samples, waiters):
    lat_ms = []
    errors = 0
    for _ in range(samples):
        key = new_key()
        headers = {"idempotency-key": key, "content-type": "application/json", "x-delay-ms": "50"}
        done = {}

        def original():
            r = envoy.post("/orders", b'{"n":1}', headers, timeout=30)
            done["original"] = (r, time.monotonic())

        t = threading.Thread(target=original)
        t.start()
        wait_until(lambda: upstream.executions(key) == 1, 10, what="the original upstream")
        results = []

        def waiter():
            r = envoy.post("/orders", b'{"n":1}', headers, timeout=30)
            results.append((r, time.monotonic()))

        ws = [threading.Thread(target=waiter) for _ in range(waiters)]
        for w in ws:
            w.start()
        t.join(30)
        for w in ws:
            w.join(30)
        r0, t0 = done["original"]
        for r, t1 in results:
            if r.status != 201 or not r.replayed or r.body != r0.body:
                errors += 1
            else:
                lat_ms.append((t1 - t0) * 1000.0)
    return lat_ms, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--waiters", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--append", help="append a section to this Markdown file")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a few samples; fail only if the harness fails")
    args = ap.parse_args()
    if args.smoke:
        args.samples = 5
    upstream = Upstream("wake-upstream", log_dir=fresh_log_dir("wake-upstream", LOG_ROOT)).start()
    envoy = OrdersProxy(args.envoy, upstream.port, CONFIG, wasm_path=Path(args.wasm).resolve(),
                        name="wake-envoy", concurrency=args.concurrency,
                        component_log_level="wasm:info",
                        log_dir=fresh_log_dir("wake-envoy", LOG_ROOT)).start()
    try:
        lat, errors = measure(envoy, upstream, args.samples, args.waiters)
    finally:
        envoy.stop()
        upstream.stop()
    result = {
        "samples": len(lat), "errors": errors, "waiters_per_sample": args.waiters,
        "concurrency": args.concurrency,
        "p50_ms": round(percentile(lat, 50), 3), "p99_ms": round(percentile(lat, 99), 3),
        "max_ms": round(max(lat), 3) if lat else None,
        "mean_ms": round(statistics.fmean(lat), 3) if lat else None,
    }
    print("wait-mode wake-up latency:", json.dumps(result))
    if args.verbose:
        print([round(x) for x in lat])
    if errors or not lat:
        print("wake-up measurement failed: %d bad responses" % errors, file=sys.stderr)
        return 1
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(
                "\n## Wait mode: wake-up latency\n\n"
                "Time from the original's response to a held duplicate's response (`bench/wake_latency.py`): "
                "Envoy `--concurrency %d` with a wait-mode route, %d samples x %d duplicates on fresh "
                "connections (spread over the workers), upstream delay 50 ms, measured by the client.\n\n"
                "| samples | p50 ms | p99 ms | max ms |\n|---:|---:|---:|---:|\n| %d | %.3f | %.3f | %.3f |\n\n"
                "The wake-up is a message on each worker's shared queue, handled in `on_queue_ready` "
                "on the waiter's own thread; the 1 s fallback recheck would show as ~1000 ms.\n"
                % (args.concurrency, args.samples, args.waiters, len(lat), result["p50_ms"],
                   result["p99_ms"], result["max_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
