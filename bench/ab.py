"""One path's CPU per request, this build against the module at BENCH_BEFORE, with the bias of
one Envoy process taken out: `make bench-ab BENCH_BEFORE=<commit>`.

A single pair of proxy Envoys carries a bias of its own. Running the same module as both (an A/A
run) read 1.006 to 1.013 for 16 interleaved rounds of a replay, and one pair of different
modules read 1.030 one way round and 0.994 with the two Envoys swapped: about the 3% a change
may cost, so one pair cannot tell whether a change kept it. Each of `--pairs` pairs here is two
fresh proxy Envoys (one per module, started in turn, "before" first in every other pair) in
front of one upstream, measured in `--rounds` interleaved rounds (the order flips every round);
the ratio is the median over every round of every pair, and each pair's own median is printed,
so a pair that disagrees with the rest shows.

Paths (`--path`, repeatable): `replay` (64 stored keys, cycled), `new` (a new key per request,
ttl 2 s as make bench's scenario 4), `pass` (POST /other, which no rule matches). CPU is the
proxy's utime + stime (/proc/<pid>/stat, all threads) over the requests it answered. The table
goes into BENCHMARKS.md's section of that name (`--no-report`: printed only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench import HarnessError, log, rel
from bench.envoys import ORDERS, OTHER, bench_envoy, checked, filter_config, proxy_config, upstream_config, wasm_filter
from bench.load import Loadgen
from bench.report import AB_HEADING, AB_SECTION, update_section
from idemkit.process import cpu_ns

PATHS = {
    # name: (request path, filter configuration, keys)
    "replay": (ORDERS, lambda: filter_config(), "replay"),
    "new": (ORDERS, lambda: filter_config(ttl="2s", processing_timeout="2s"), "unique"),
    "pass": (OTHER, lambda: filter_config(), "unique"),
    # A new key per request carried by the root's callout (`execution: "detached"`).
    "detached": (ORDERS, lambda: filter_config(ttl="2s", processing_timeout="2s", execution="detached"), "unique"),
}


def ratio_summary(after: list[float], before: list[float]) -> dict[str, float]:
    """Per-round ratios after/before (rounds paired in order): their median, mean and spread."""
    ratios = [a / b for a, b in zip(after, before) if b > 0]
    if not ratios:
        return {"median": float("nan"), "mean": float("nan"), "sd": float("nan"), "n": 0}
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    return {"median": statistics.median(ratios), "mean": statistics.mean(ratios), "sd": sd, "n": len(ratios)}


class Side:
    def __init__(self, label: str, wasm: str) -> None:
        self.label, self.wasm = label, wasm
        self.envoy = None
        self.tag = ""
        self.cpu_us: list[float] = []


def measure(lg: Loadgen, side: Side, path: str, keys: str, seconds: float, tag: str) -> float:
    env = side.envoy
    kwargs = ({"key_set": (f"{tag}-stored", 64), "expect_header": "idempotent-replayed: true"}
              if keys == "replay" else {"key_prefix": f"{tag}-{time.time_ns()}"})
    c0 = cpu_ns(env.proc.pid)
    r = lg.run(env.port, path, duration=seconds, label=tag, **kwargs)
    c1 = cpu_ns(env.proc.pid)
    if r["errors"] or r["requests"] == 0:
        raise HarnessError(f"{tag}: {r['errors']} of {r['requests']} requests failed: {r['first_error']}")
    return (c1 - c0) / 1000 / r["requests"]


def run_path(a: argparse.Namespace, lg: Loadgen, upstream_port: int, name: str) -> dict:
    path, config, keys = PATHS[name]
    after, before = Side("after", a.wasm), Side(a.before_label, a.before_wasm)
    per_pair = []
    for pair in range(a.pairs):
        sides = [before, after] if pair % 2 == 0 else [after, before]
        started = []
        try:
            for s in sides:
                tag = f"ab-{name}-{pair}-{'b' if s is before else 'a'}"
                s.envoy = bench_envoy(tag, proxy_config(upstream_port, [wasm_filter(rel(s.wasm), tag, config())]),
                                      a.envoy)
                started.append(s.envoy)
                s.envoy.spawn()
                checked(s.envoy, s.envoy.wait_ready, 60.0)
                s.tag = tag
                if keys == "replay":
                    r = lg.run(s.envoy.port, path, requests=64, key_set=(f"{tag}-stored", 64), connections=1)
                    if r["ok"] != 64:
                        raise HarnessError(f"{tag}: stored {r['ok']} of 64 keys")
                lg.run(s.envoy.port, path, duration=1.0, label=f"{tag} warm-up",
                       **({"key_set": (f"{tag}-stored", 64)} if keys == "replay" else {"key_prefix": f"{tag}-w"}))
            first = len(after.cpu_us)
            for rnd in range(a.rounds):
                for s in (sides if rnd % 2 == 0 else sides[::-1]):
                    s.cpu_us.append(measure(lg, s, path, keys, a.seconds, s.tag))
            pair_ratio = ratio_summary(after.cpu_us[first:], before.cpu_us[first:])["median"]
            per_pair.append(pair_ratio)
            log(f"  {name}, pair {pair + 1}: after/before CPU per request {pair_ratio:.3f}")
        finally:
            for e in started:
                e.stop()
    return {"after": statistics.median(after.cpu_us), "before": statistics.median(before.cpu_us),
            "ratio": ratio_summary(after.cpu_us, before.cpu_us), "pairs": per_pair}


def markdown(results: dict[str, dict], a: argparse.Namespace) -> str:
    L = [AB_HEADING, "",
         f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `make bench-ab BENCH_BEFORE={a.before_label}` "
         f"(`bench/ab.py`: {a.pairs} pairs of proxy Envoys x {a.rounds} interleaved rounds x {a.seconds:g} s, "
         f"{a.connections} connections, closed loop): the proxy's CPU per request, median over rounds. One pair "
         "alone is biased by about 1% (the same module as both read 1.006 to 1.013), so each pair's own "
         "ratio is shown beside the median of all rounds.",
         "",
         f"| path | {a.before_label} µs | this build µs | after/before (median of rounds) | mean ± sd | "
         "each pair |",
         "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        q = r["ratio"]
        L.append(f"| {name} | {r['before']:.1f} | {r['after']:.1f} | **{q['median']:.3f}** | "
                 f"{q['mean']:.3f} ± {q['sd']:.3f} | {', '.join(f'{p:.3f}' for p in r['pairs'])} |")
    return "\n".join(L)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--before-wasm", required=True)
    ap.add_argument("--before-label", default="before")
    ap.add_argument("--loadgen", required=True)
    ap.add_argument("--path", action="append", choices=sorted(PATHS), help="replay, new, pass, detached (default: the first three)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--report", default="BENCHMARKS.md")
    ap.add_argument("--no-report", action="store_true")
    a = ap.parse_args(argv)
    lg = Loadgen(a.loadgen, a.connections)
    up = bench_envoy("ab-upstream", upstream_config(), a.envoy)
    results = {}
    try:
        up.spawn()
        checked(up, up.wait_ready, 60.0)
        for name in a.path or ["replay", "new", "pass"]:
            results[name] = run_path(a, lg, up.port, name)
    finally:
        up.stop()
    text = markdown(results, a)
    log("\n" + text)
    if not a.no_report:
        update_section(a.report, AB_SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
