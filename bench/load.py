"""The load generator and the statistics over its results.

bench/loadgen (Rust, std only) sends the same request in every scenario (POST, a JSON body of
BODY_BYTES, an idempotency-key header) over a fixed number of keep-alive connections, closed
loop or at a fixed rate (open loop), and prints one JSON result with a latency histogram.
"""

from __future__ import annotations

import json
import re
import resource
import statistics
import subprocess

from bench import REPO, HarnessError

BODY_BYTES = 1024  # request body: a JSON object of exactly this size (loadgen --body-bytes)
KEY_HEADER = "idempotency-key"

class Loadgen:
    def __init__(self, binary: str, connections: int) -> None:
        self.binary = binary
        self.connections = connections

    def run(
        self,
        port: int,
        path: str,
        *,
        duration: float = 0.0,
        requests: int | None = None,
        rate: float | None = None,
        key_prefix: str | None = None,
        key_set: tuple[str, int] | None = None,
        expect: str = "201",
        expect_header: str | None = None,
        connections: int | None = None,
        label: str = "",
    ) -> dict:
        cmd = [
            self.binary,
            "--addr", f"127.0.0.1:{port}",
            "--method", "POST",
            "--path", path,
            "--connections", str(connections or self.connections),
            "--duration", str(duration),
            "--body-bytes", str(BODY_BYTES),
            "--header", "content-type: application/json",
            "--key-header", KEY_HEADER,
            "--expect", expect,
            "--label", label,
        ]
        if requests is not None:
            cmd += ["--requests", str(requests)]
        if rate is not None:
            cmd += ["--rate", f"{rate:.1f}"]
        if key_prefix is not None:
            cmd += ["--key-prefix", key_prefix]
        if key_set is not None:
            cmd += ["--key-set", f"{key_set[0]}:{key_set[1]}"]
        if expect_header is not None:
            cmd += ["--expect-header", expect_header]
        # The children's rusage grows by the load generator's CPU only: the Envoys are children
        # too, but are only accounted once waited for, at the end.
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            raise HarnessError(f"loadgen failed (exit {p.returncode}): {p.stderr.strip()}")
        try:
            out = json.loads(p.stdout)
        except ValueError as e:
            raise HarnessError(f"loadgen output is not JSON ({e}): {p.stdout[:300]!r}") from None
        out["loadgen_cpu_s"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        return out


# ------------------------------------------------------------------------------------------
# statistics


def merge_hist(hists: list[list[list[int]]]) -> list[tuple[int, int]]:
    acc: dict[int, int] = {}
    for h in hists:
        for v, c in h:
            acc[v] = acc.get(v, 0) + c
    return sorted(acc.items())


def quantile(hist: list[tuple[int, int]], q: float) -> float:
    total = sum(c for _, c in hist)
    if total == 0:
        return float("nan")
    rank = max(1, min(total, int(-(-q * total // 1))))
    seen = 0
    for v, c in hist:
        seen += c
        if seen >= rank:
            return float(v)
    return float(hist[-1][0])


def spread(values: list[float]) -> dict[str, float]:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    if len(vals) >= 2:
        q = statistics.quantiles(vals, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = vals[0]
    return {"median": statistics.median(vals), "p25": p25, "p75": p75, "min": vals[0], "max": vals[-1], "n": len(vals)}



def merge_status(maps: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return out



def parse_duration_s(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d)", text)
    if not m:
        return float("nan")
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]

