#!/usr/bin/env python3
"""Benchmarks: what the idempotency filter costs, side by side with Envoy alone, in one run.

Started by `make bench` / `make bench-smoke` / `make bench-memory` (bench/bench.mk) as
`python -m bench.run` from the repository root; Python 3.11 standard library and the kit
(idemkit/). Everything binds 127.0.0.1; nothing is fetched.

The phases: the scenarios (bench/scenarios.py: Envoy alone, a no-op filter, the filter on the
local store several ways, a naive idempotency filter, the filter on a real etcd several ways),
each its own proxy Envoy in front of one fast upstream Envoy, run in interleaved closed-loop rounds,
then open loop at one fixed rate and the equal-load pairs (bench/rounds.py); the refusal-vs-fill
curve (bench/fill.py); the memory phase (bench/memory.py: 1,000,000 distinct keys, RSS sampled);
wait mode's wake-up latency (bench/wake_latency.py). The load generator is bench/loadgen (Rust,
std only): the same request (POST, ~1 KiB JSON body, an idempotency-key header), the same
connection count, in every scenario. Throughput ratios are computed per round and summarised as
the median with IQR and min/max; percentiles come from the histograms merged over all rounds.

This program alone writes BENCHMARKS.md and bench/results.svg (bench/report.py).

Exit status: 0 when the harness worked (whatever the numbers); 1 when it did not (an Envoy did not
start or died, the load generator reported errors or unexpected statuses in a scenario that must
have none, a run completed zero requests, the wake-up measurement got a wrong answer); 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import OUT_DIR, REPO, HarnessError, log, rel
from bench import fill, memory, report, rounds, wake_latency
from bench.harness import Bench

KiB = 1024


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envoy", required=True, help="the Envoy binary")
    p.add_argument("--wasm", default="dist/idempotency_filter.wasm")
    p.add_argument("--noop-wasm", default="target/wasm32-wasip1/release/noop_filter.wasm")
    p.add_argument("--naive-wasm", default="target/wasm32-wasip1/release/naive_filter.opt.wasm",
                   help="the naive idempotency filter (bench/naive-filter), scenario 6; '' to leave it out")
    p.add_argument("--loadgen", default="target/release/loadgen")
    p.add_argument("--before-wasm", default=None,
                   help="the filter built at an earlier commit: its etcd new key runs as scenario 11")
    p.add_argument("--before-label", default="before", help="that commit, for the report")
    p.add_argument("--etcd", choices=["on", "off"], default="on",
                   help="scenarios 7, 8 and 10 to 13: the filter on a real etcd (started and stopped here)")
    p.add_argument("--fill", choices=["on", "off", "only"], default="on",
                   help="the refusal-vs-fill curve (bench/fill.py); 'only': nothing else, no report")
    p.add_argument("--fill-capacity", type=int, default=20000)
    p.add_argument("--fill-batches", type=int, default=200, help="batches per capacity's worth of keys")
    p.add_argument("--fill-save", default=None,
                   help="write the curve to this JSON file (bench/baseline/refusal-curve-<commit>.json)")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--duration", type=float, default=1.5, help="seconds per scenario per round")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds per scenario before the rounds")
    p.add_argument("--open-rounds", type=int, default=4, help="open-loop rounds (0: skip)")
    p.add_argument("--open-fraction", type=float, default=0.5,
                   help="open-loop rate as a fraction of the slowest closed-loop median")
    p.add_argument("--new-key-ttl", default="1s", help="scenario 4's ttl (see BENCHMARKS.md)")
    p.add_argument("--memory", choices=["on", "off", "only"], default="on")
    p.add_argument("--memory-requests", type=int, default=1_000_000)
    p.add_argument("--memory-interval", type=float, default=2.0)
    p.add_argument("--memory-concurrency", type=int, default=1,
                   help="worker threads of the memory phase's Envoy")
    p.add_argument("--memory-max-seconds", type=float, default=540.0,
                   help="stop the memory phase after this long even if not all requests were sent")
    p.add_argument("--wake", choices=["on", "off"], default="on",
                   help="measure wait mode's wake-up latency (not with --memory only)")
    p.add_argument("--wake-samples", type=int, default=150)
    p.add_argument("--wake-waiters", type=int, default=4)
    p.add_argument("--wake-concurrency", type=int, default=2)
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds of everything; fails on any harness problem; writes its report "
                        "into bench/.out/ (never BENCHMARKS.md)")
    p.add_argument("--report", default="BENCHMARKS.md")
    p.add_argument("--svg", default="bench/results.svg")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--command", default=None, help="the command line to print in the report")
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.duration, a.warmup, a.open_rounds = 1, 0.5, 0.3, 1
        a.memory_requests = min(a.memory_requests, 5000)
        a.memory_interval = 0.5
        a.wake_samples = 5
        a.fill_capacity, a.fill_batches = min(a.fill_capacity, 1000), 40
        # The report is rendered (so the smoke run covers its code) where nobody reads it.
        a.report, a.svg = str(OUT_DIR / "BENCHMARKS.smoke.md"), str(OUT_DIR / "results.smoke.svg")
    if a.fill == "only":
        a.memory, a.wake, a.etcd = "off", "off", "off"
    for name in ("wasm", "noop_wasm", "naive_wasm", "before_wasm", "loadgen", "envoy"):
        if not getattr(a, name):
            continue
        path = Path(getattr(a, name))
        if not path.is_absolute():
            path = (REPO / path)
        if not path.exists():
            p.error(f"--{name.replace('_', '-')}: {rel(path)} does not exist (run the bench.mk targets)")
        setattr(a, name, str(path))
    if a.rounds < 1 or a.duration <= 0 or a.connections < 1:
        p.error("--rounds, --duration and --connections must be positive")
    if a.fill_capacity < 8 or not 1 <= a.fill_batches <= a.fill_capacity:
        p.error("--fill-capacity must be >= 8 and --fill-batches between 1 and it")
    return a



def main(argv: list[str]) -> int:
    a = parse_args(argv)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    b = Bench(a)
    command = invocation(argv, a.command)
    t0 = time.monotonic()
    wasm_kib = os.path.getsize(a.wasm) / KiB
    log(f"bench: run {b.run_id}; {rel(a.wasm)} {wasm_kib:.1f} KiB; logs and raw results in {rel(OUT_DIR)}/"
        + ("; SMOKE (numbers mean nothing)" if a.smoke else ""))
    try:
        if a.memory != "only" and a.fill != "only":
            rounds.setup(b)
            rounds.run(b)
            for s in b.scenarios:
                if s.envoy:
                    s.envoy.stop()
            b.stop_etcd()
        if a.fill != "off" and a.memory != "only":
            b.fill = fill.run(b)
            if a.fill_save:
                fill.save(b.fill, a.fill_save, git_commit())
        if a.memory != "off":
            b.memory = memory.run(b)
        b.stop_all()
        if a.wake == "on" and a.memory != "only":
            wake(b)
    except HarnessError as e:
        log(f"bench: HARNESS FAILURE: {e}")
        b.stop_all()
        return 1
    except KeyboardInterrupt:
        b.stop_all()
        return 130
    finally:
        b.stop_all()

    raw = {
        "run_id": b.run_id,
        "args": {k: (rel(v) if isinstance(v, str) and v.startswith("/") else v) for k, v in vars(a).items()},
        "open_rate": b.open_rate,
        "scenarios": [
            {"sid": s.sid, "name": s.name, "closed": [{k: v for k, v in r.items() if k != "histogram_us"} for r in s.closed],
             "open": [{k: v for k, v in r.items() if k != "histogram_us"} for r in s.open], "cpu_s": s.cpu,
             "upstream_cpu_s": s.up_cpu, "rss_end_kib": s.rss_end, "verification": getattr(s, "verification", None)}
            for s in b.scenarios
        ],
        "memory": {k: v for k, v in (b.memory or {}).items() if k != "result"} | (
            {"result": {k: v for k, v in b.memory["result"].items() if k != "histogram_us"}} if b.memory else {}),
        "wake": b.wake,
        "fill": b.fill,
        "failures": b.failures,
    }
    (OUT_DIR / ("smoke.json" if a.smoke else "results.json")).write_text(json.dumps(raw, indent=1))

    if a.fill != "only":
        report.publish(b, command)
    log(f"bench: done in {time.monotonic() - t0:.0f}s" + (f"; {len(b.failures)} harness problem(s)" if b.failures else ""))
    if (a.smoke and b.failures) or b.wake_failed:
        return 1
    return 0


def wake(b: Bench) -> None:
    """Wait mode's wake-up latency (bench/wake_latency.py) into b.wake; a wrong answer is a
    harness problem that fails the run (the report is still written, without the section)."""
    a = b.args
    log(f"  wake-up latency: {a.wake_samples} samples x {a.wake_waiters} duplicates, "
        f"Envoy --concurrency {a.wake_concurrency}")
    try:
        result, _ = wake_latency.run(a.envoy, a.wasm, a.wake_samples, a.wake_waiters, a.wake_concurrency)
    except (RuntimeError, OSError) as e:  # a process that did not start, a timeout
        result = {"samples": 0, "errors": 0, "failure": str(e)}
    log("  wait-mode wake-up latency: " + json.dumps(result))
    if result["errors"] or not result["samples"]:
        msg = (f"wake-up measurement: {result['errors']} bad responses, {result['samples']} good"
               + (f" ({result['failure']})" if "failure" in result else ""))
        b.problem(msg, fatal=False)
        b.wake_failed = True
    else:
        b.wake = result


def git_commit() -> str:
    try:
        p = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=REPO)
        return p.stdout.strip() or "?"
    except OSError:
        return "?"


def invocation(argv: list[str], make_command: str | None) -> str:
    """The command line for the report: no path of this machine in it (the Envoy binary is
    named by the Makefile variable that found it; other paths relative to the repository)."""
    out: list[str] = []
    prev = ""
    for x in argv:
        if x == make_command and prev == "--command":
            out.pop()
        elif prev == "--envoy":
            out.append("$(ENVOY_BIN)")
        elif x.startswith("/"):
            out.append(shlex.quote(rel(x)))
        else:
            out.append(shlex.quote(x))
        prev = x
    run = "$(VENV_PY) -m bench.run " + " ".join(out)
    return f"`{make_command}` (which runs `{run}`)" if make_command else f"`{run}`"



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
