"""The etcd store on one shard and on three (`store.shards`, issue 33): each etcd's CPU per new
key, and the fleet's new keys a second.

    python -m bench.etcd_shards --envoy BIN --wasm dist/idempotency_filter.wasm --loadgen BIN
        [--seconds 8] [--rounds 2] [--connections 8]

Per round, for 1 and then 3 shards (interleaved over `rounds`): fresh durable etcd members (one
per shard), two Envoys (the fleet; one worker each) on the same shard list over gRPC, the
upstream, and one closed-loop load generator per Envoy sending new keys for `seconds`. etcd's
CPU is utime + stime of each member over the run (/proc), divided by the new keys answered 201
(the fleet's), and by those each member holds (its record keys). Everything shares this
machine's cores, so the fleet's rate is bound by the sum of their CPU: the table shows where
etcd's share of it goes, not what separate machines would do.
"""

from __future__ import annotations

import argparse
import base64
import threading
from pathlib import Path

from bench import OUT_DIR
from bench.load import Loadgen
from idemkit.bootstrap import etcd_cluster
from idemkit.envoy import OrdersProxy
from idemkit.etcd import Etcd
from idemkit.process import Upstream, fresh_log_dir

PREFIX = "/bench-shards/"


def config(clusters: list[str]) -> dict:
    return {
        "store": {"type": "etcd", "prefix": PREFIX, "protocol": "grpc", "timeout": "2s",
                  "shards": [{"cluster": c} for c in clusters]},
        "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
    }


def record_keys(etcd: Etcd) -> int:
    prefix = PREFIX + "r/"
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    doc = etcd.post("/v3/kv/range", {"key": base64.b64encode(prefix.encode()).decode(),
                                     "range_end": base64.b64encode(end.encode()).decode(),
                                     "count_only": True})
    return int(doc.get("count", 0))


def measure(shards: int, args, upstream, round_no: int) -> dict:
    names = [f"etcd-{c}" for c in "abc"[:shards]]
    members = [Etcd(f"shards{shards}-{n}-r{round_no}", log_dir=fresh_log_dir(f"shards-{n}", OUT_DIR),
                    durable=True).start() for n in names]
    clusters = [etcd_cluster([m.client_port], name=n, grpc=True) for n, m in zip(names, members)]
    fleet = [OrdersProxy(args.envoy, upstream.port, config(names), wasm_path=Path(args.wasm).resolve(),
                         name=f"shards{shards}-{e}", concurrency=1, component_log_level="wasm:info",
                         extra_clusters=clusters, log_dir=fresh_log_dir(f"shards-envoy-{e}", OUT_DIR)).start()
             for e in ("a", "b")]
    try:
        loadgen = Loadgen(args.loadgen, args.connections)
        # Warm: leases granted, connections open, watch streams not involved (no waiters).
        for i, proxy in enumerate(fleet):
            loadgen.run(proxy.port, "/orders", requests=50, key_prefix=f"warm-{shards}-{round_no}-{i}-", label="warm")
        keys0 = [record_keys(m) for m in members]
        cpu0 = [m.cpu_seconds() for m in members]
        results: list[dict] = [{}, {}]

        def load(i: int) -> None:
            results[i] = loadgen.run(fleet[i].port, "/orders", duration=args.seconds,
                                     key_prefix=f"r{round_no}-s{shards}-{i}-", label=f"envoy {i}")

        threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = [m.cpu_seconds() - c for m, c in zip(members, cpu0)]
        held = [record_keys(m) - k for m, k in zip(members, keys0)]
    finally:
        for proxy in fleet:
            proxy.stop()
        for m in members:
            m.stop()
    answered = sum(int(r.get("ok", 0)) for r in results)
    seconds = max(float(r.get("elapsed_s", args.seconds)) for r in results)
    return {
        "shards": shards, "round": round_no, "new_keys": answered,
        "new_keys_per_s": answered / seconds,
        "etcd_cpu_us_per_new_key": [1e6 * c / max(1, answered) for c in cpu],
        "etcd_cpu_us_per_own_key": [1e6 * c / max(1, h) for c, h in zip(cpu, held)],
        "share": [h / max(1, sum(held)) for h in held],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--loadgen", required=True)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--connections", type=int, default=8)
    args = ap.parse_args()
    upstream = Upstream("shards-upstream", log_dir=fresh_log_dir("shards-upstream", OUT_DIR)).start()
    rows = []
    try:
        for round_no in range(1, args.rounds + 1):
            for shards in (1, 3):
                rows.append(measure(shards, args, upstream, round_no))
    finally:
        upstream.stop()
    print("| round | shards | fleet new keys/s | etcd CPU per new key of the fleet, each member (µs) | all members (µs) | each member per key it holds (µs) | keys per member |")
    print("|---:|---:|---:|---|---:|---|---|")
    for r in rows:
        each = ", ".join("%.0f" % v for v in r["etcd_cpu_us_per_new_key"])
        own = ", ".join("%.0f" % v for v in r["etcd_cpu_us_per_own_key"])
        share = ", ".join("%.0f%%" % (100 * v) for v in r["share"])
        print("| %d | %d | %.0f | %s | %.0f | %s | %s |" % (
            r["round"], r["shards"], r["new_keys_per_s"], each, sum(r["etcd_cpu_us_per_new_key"]), own, share))


if __name__ == "__main__":
    main()
