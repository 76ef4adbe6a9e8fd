"""The benchmarks (`make bench`, `make bench-smoke`, `make bench-memory`; bench/bench.mk), run as
modules from the repository root: `python -m bench.run --help`.

    bench/run.py           command line: runs the phases, writes the raw results and the report
    bench/harness.py       Bench: one run's state, and the helpers every phase uses
    bench/envoys.py        the Envoys every bench tool starts: upstream, proxies, the filter's configuration
    bench/scenarios.py     the numbered scenarios, as the phases and the report both need them
    bench/rounds.py        the main phase: the scenarios in interleaved rounds, equal load, verification
    bench/memory.py        the memory phase (1,000,000 distinct keys, RSS sampled)
    bench/fill.py          the refusal-vs-fill curve (its 45138ec baseline: bench/baseline/)
    bench/load.py          the load generator (bench/loadgen, Rust) and the statistics
    bench/wake_latency.py  wait mode's wake-up latency (run by run.py too)
    bench/profile.py       where a new key's µs go: perf call chains per scenario (make bench-profile)
    bench/module_size.py   where the module's bytes go: a build with names, split by module (make bench-size)
    bench/report.py        BENCHMARKS.md (with report_memory.py and report_more.py: naive filter,
                           etcd); bench/report_svg.py: bench/results.svg
    bench/sections.py      the one section writer: a tool's section of a file lies between its
                           <!-- bench:NAME:begin/end --> markers, and nothing else is touched
                           (tested by bench/test_sections.py, `make bench-unit`)
    bench/test_imports.py  no import circle among these modules (`make bench-unit`)

Rust: bench/loadgen (load generator), bench/noop-filter and bench/naive-filter (Wasm baselines).

Envoy processes, bootstraps and HTTP come from the kit (idemkit/).
"""

from __future__ import annotations

from pathlib import Path

from idemkit import REPO_ROOT as REPO

OUT_DIR = REPO / "bench" / ".out"  # gitignored (bench/.gitignore): configs, logs, raw results


class HarnessError(RuntimeError):
    """The benchmark could not be run as designed (never raised for slow numbers)."""


def log(msg: str = "") -> None:
    print(msg, flush=True)


def rel(p: Path | str) -> str:
    """A path relative to the repository when it is inside it (files never name this machine)."""
    p = Path(p)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    """An unsigned LEB128 integer at `buf[i]` and the offset after it: protobuf's varints
    (bench/etcd_protocol.py) and the Wasm binary format's (bench/module_size.py) alike."""
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i
