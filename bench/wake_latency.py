"""Wait mode's wake-up latency: the time from the original's completion to a held duplicate's
response, across Envoy's worker threads (issue 4). Part of `make bench`.

Each sample: an original request (upstream delay 50 ms) on its own connection, then W
duplicates on fresh connections (Envoy spreads connections over its workers), held by the
filter until the original completes. Latency = waiter's response time - original's response
time, both seen by this client, so it includes the client's own scheduling (an upper bound of
the filter's wake-up path: shared-queue message, on_queue_ready, recheck, local reply).

bench/run.py runs it (`make bench`, `make bench-smoke`) and puts the result in BENCHMARKS.md.
Alone, it only prints (from the repository root):
    python -m bench.wake_latency --envoy BIN --wasm dist/idempotency_filter.wasm
        [--samples 150] [--waiters 4] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from bench import OUT_DIR
from idemkit.client import new_key
from idemkit.envoy import OrdersProxy
from idemkit.process import Upstream, fresh_log_dir, wait_until

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


def held_duplicates(original_proxy, waiter_proxy, upstream, headers, waiters, pause_s=0.0):
    """One sample: the original on `original_proxy`, and once the upstream has it (and `pause_s`
    later) `waiters` duplicates on fresh connections to `waiter_proxy`, held until it completes.
    Returns the original's (response, end time) and each duplicate's (response, start, end)."""
    key = headers["idempotency-key"]
    done = {}

    def original():
        r = original_proxy.post("/orders", b'{"n":1}', headers, timeout=30)
        done["original"] = (r, time.monotonic())

    t = threading.Thread(target=original)
    t.start()
    wait_until(lambda: upstream.executions(key) == 1, 10, what="the original upstream")
    if pause_s:
        time.sleep(pause_s)
    held = []

    def waiter():
        began = time.monotonic()
        r = waiter_proxy.post("/orders", b'{"n":1}', headers, timeout=30)
        held.append((r, began, time.monotonic()))

    ws = [threading.Thread(target=waiter) for _ in range(waiters)]
    for w in ws:
        w.start()
    t.join(30)
    for w in ws:
        w.join(30)
    return done["original"], held


def measure(envoy, upstream, samples, waiters):
    lat_ms = []
    errors = 0
    for _ in range(samples):
        headers = {"idempotency-key": new_key(), "content-type": "application/json", "x-delay-ms": "50"}
        (r0, t0), held = held_duplicates(envoy, envoy, upstream, headers, waiters)
        for r, _, t1 in held:
            if r.status != 201 or not r.replayed or r.body != r0.body:
                errors += 1
            else:
                lat_ms.append((t1 - t0) * 1000.0)
    return lat_ms, errors


def run(envoy_bin: str, wasm: str, samples: int = 150, waiters: int = 4,
        concurrency: int = 2) -> tuple[dict, list[float]]:
    """Start the demo upstream and a wait-mode Envoy (logs in bench/.out), measure, stop them.
    Returns the summary and the latencies (ms)."""
    upstream = Upstream("wake-upstream", log_dir=fresh_log_dir("wake-upstream", OUT_DIR)).start()
    try:
        envoy = OrdersProxy(envoy_bin, upstream.port, CONFIG, wasm_path=Path(wasm).resolve(),
                            name="wake-envoy", concurrency=concurrency,
                            component_log_level="wasm:info",
                            log_dir=fresh_log_dir("wake-envoy", OUT_DIR)).start()
        try:
            lat, errors = measure(envoy, upstream, samples, waiters)
        finally:
            envoy.stop()
    finally:
        upstream.stop()
    result = {
        "samples": len(lat), "errors": errors, "originals": samples, "waiters_per_sample": waiters,
        "concurrency": concurrency,
        "p50_ms": round(percentile(lat, 50), 3), "p99_ms": round(percentile(lat, 99), 3),
        "max_ms": round(max(lat), 3) if lat else None,
        "mean_ms": round(statistics.fmean(lat), 3) if lat else None,
    }
    return result, lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--waiters", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a few samples; fail only if the harness fails")
    args = ap.parse_args()
    if args.smoke:
        args.samples = 5
    result, lat = run(args.envoy, args.wasm, args.samples, args.waiters, args.concurrency)
    print("wait-mode wake-up latency:", json.dumps(result))
    if args.verbose:
        print([round(x) for x in lat])
    if result["errors"] or not lat:
        print("wake-up measurement failed: %d bad responses" % result["errors"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
