"""How long a proxy Envoy takes to be ready with a local store of a given capacity (issue 47:
a large store's start): `make bench-start [BENCH_BEFORE=<commit>]`.

The local store creates its shared-data keys once, when its namespace is new: in Envoy's canary
root on the main thread, before any worker configures (a configuration push that keeps the
capacity finds them and creates none). Each round starts a fresh Envoy (--concurrency 2, no
traffic) per build and capacity, in turn (the order flips every round), and times it from spawn
to ready (the admin port's /ready says LIVE and the listener accepts); the median of the rounds
is printed per build and capacity, beside the same Envoy with a store of one record (Envoy's own
start). The filter runs without `quota` (the default), as the product ships.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench import log
from bench.envoys import bench_envoy, filter_config, proxy_config, wasm_filter


def started_in(envoy_bin: str, wasm: str, capacity: int, name: str) -> float:
    cfg = json.loads(filter_config(quota=False))
    cfg["store"]["capacity"] = capacity
    config = proxy_config(1, [wasm_filter(wasm, "idempotency", json.dumps(cfg))])
    envoy = bench_envoy(name, config, envoy_bin, concurrency=2)
    t0 = time.monotonic()
    envoy.start(timeout=300)
    elapsed = time.monotonic() - t0
    envoy.stop()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--before-wasm")
    ap.add_argument("--before-label", default="before")
    ap.add_argument("--capacities", type=int, nargs="+", default=[1, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    builds = [("this build", a.wasm)] + ([(a.before_label, a.before_wasm)] if a.before_wasm else [])
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        order = builds if r % 2 == 0 else builds[::-1]
        for capacity in a.capacities:
            for label, wasm in order:
                t = started_in(a.envoy, wasm, capacity, "start-%d" % capacity)
                times.setdefault((label, capacity), []).append(t)
                log("round %d: %s, capacity %d: ready in %.2f s" % (r + 1, label, capacity, t))
    print("| capacity | " + " | ".join(label for label, _ in builds) + " |")
    print("|---:|" + "---:|" * len(builds))
    for capacity in a.capacities:
        cells = ["%.2f s (%.2f-%.2f)" % (statistics.median(times[(label, capacity)]),
                                         min(times[(label, capacity)]), max(times[(label, capacity)]))
                 for label, _ in builds]
        print("| %s | %s |" % (format(capacity, ","), " | ".join(cells)))
    print("(median of %d rounds to ready, min-max beside; --concurrency 2, local store without quotas)" % a.rounds)


if __name__ == "__main__":
    main()
