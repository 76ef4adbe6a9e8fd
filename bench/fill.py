"""The refusal-vs-fill curve (issue 11): how many new keys the local store refuses (503
store_full) as it fills up to its `capacity`, and whether a full store keeps its live records.

One proxy Envoy with the filter, a small `capacity` (default 20,000) and a 24 h ttl, so nothing
expires and the live records are exactly the keys stored so far. New keys go in small batches
(capacity / 200 each by default, 8 connections); each batch's answers (201 stored, 503 refused) are counted
in the fill band (0-10%, ..., 90-100%, and 100%+) that the store was in when the batch started.
The phase stops once the store has taken `BEYOND` x capacity more requests after reaching
capacity, or after `MAX_SENT` x capacity requests in all (a store that never reaches 100% live
records). Then the first batch's keys are sent again: each must be replayed, never executed
again, which shows that refusing was the only answer to a full store (no live record evicted).

The same phase at commit 45138ec is kept in bench/baseline/ (`BASELINE`) and drawn next to the
live curve; `--fill only --fill-save PATH` measures a new one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import REPO, log, rel
from bench.envoys import (FILTER_CONFIG, ORDERS, bench_envoy, checked, proxy_config, upstream_config,
                          wasm_filter)

if TYPE_CHECKING:
    from bench.harness import Bench

FILL_HEADING = "## Refusals as the store fills"
BASELINE = REPO / "bench" / "baseline" / "refusal-curve-45138ec.json"
BANDS = [f"{10 * i}-{10 * (i + 1)}%" for i in range(10)] + ["100%+"]
MAX_SENT = 3.0  # stop after this many x capacity requests in all
BEYOND = 0.1  # once full, this many x capacity more requests (the "100%+" band)


def band_of(fill: float) -> int:
    return 10 if fill >= 1.0 else max(0, min(9, int(fill * 10)))


def fill_config(capacity: int) -> str:
    cfg = json.loads(json.dumps(FILTER_CONFIG))
    cfg["store"]["capacity"] = capacity
    cfg["quota"] = {"per_tenant": capacity, "per_principal": capacity}
    cfg["routes"][0]["ttl"] = "24h"
    return json.dumps(cfg, separators=(",", ":"))


def run(b: Bench) -> dict[str, Any]:
    """The curve, into a dict (also what --fill-save writes)."""
    a = b.args
    cap = a.fill_capacity
    if b.upstream is None:
        b.upstream = bench_envoy("upstream", upstream_config(), a.envoy)
        b.start([b.upstream])
    cfg = fill_config(cap)
    env = bench_envoy("fill", proxy_config(b.upstream.port, [wasm_filter(rel(a.wasm), "idempotency", cfg)]), a.envoy)
    b.start([env])
    time.sleep(0.3)
    rss0 = env.memory_kib().get("VmRSS", 0)
    batch = max(1, cap // a.fill_batches)
    log(f"  refusal curve: capacity {cap:,}, ttl 24h, batches of {batch} new keys, {a.connections} connections")
    sent = stored = refused = 0
    bands = [{"band": name, "requests": 0, "refused": 0} for name in BANDS]
    points: list[list[float]] = []  # [fill at batch start, refused share of the batch]
    first_prefix = ""
    beyond = 0
    t0 = time.monotonic()
    while sent < MAX_SENT * cap and beyond < BEYOND * cap:
        fill = stored / cap
        prefix = b.fresh_prefix("fill")
        first_prefix = first_prefix or prefix
        r = b.loadgen.run(env.port, ORDERS, requests=batch, key_prefix=prefix, expect="201,503",
                          label="fill", connections=min(a.connections, batch))
        if r["errors"] or r["requests"] != batch:
            b.problem(f"refusal curve: batch at fill {fill:.1%}: {r['requests']} answers, {r['errors']} errors "
                      f"(first: {r['first_error']})", fatal=True)
        ok, no = r["statuses"].get("201", 0), r["statuses"].get("503", 0)
        sent += batch
        stored += ok
        refused += no
        k = band_of(fill)
        bands[k]["requests"] += batch
        bands[k]["refused"] += no
        if k == 10:
            beyond += batch
        points.append([round(fill, 5), round(no / batch, 5)])
    elapsed = time.monotonic() - t0
    time.sleep(0.3)
    checked(env, env.check_alive)
    counters = env.outcomes()
    rss1 = env.memory_kib().get("VmRSS", 0)
    # No live record was evicted to make room: the first batch (all stored, at 0% fill) replays.
    again = b.loadgen.run(env.port, ORDERS, requests=batch, key_set=(first_prefix, batch),
                          expect_header="idempotent-replayed: true", label="fill replay first batch",
                          connections=min(a.connections, batch))
    env.stop()
    if counters.get("stored", 0) != stored or counters.get("store_full", 0) != refused:
        b.problem(f"refusal curve: saw {stored} stored / {refused} refused, the filter counted "
                  f"{counters.get('stored', 0)} / {counters.get('store_full', 0)}", fatal=a.smoke)
    for x in bands:
        x["rate"] = x["refused"] / x["requests"] if x["requests"] else None
    result = {
        "capacity": cap,
        "batch": batch,
        "sent": sent,
        "stored": stored,
        "refused": refused,
        "elapsed_s": round(elapsed, 1),
        "bands": bands,
        "points": points,
        "first_batch_replayed": again["ok"] if not again["errors"] else 0,
        "first_batch": batch,
        "rss_start_kib": rss0,
        "rss_end_kib": rss1,
        # What a record's snapshot holds here (as in the memory phase's bound): body length, the
        # kept response headers (6 B + name + value each), the body.
        "snapshot_bytes": 4 + sum(6 + len(k) + len(v) for k, v in b.upstream_headers_for_bound()) + 1024,
    }
    log(f"  refusal curve: {sent:,} new keys in {elapsed:.1f}s, {stored:,} stored ({stored / cap:.1%} of capacity), "
        f"{refused:,} refused; first batch replayed {result['first_batch_replayed']}/{batch}")
    log("    " + " | ".join(f"{x['band']} {fmt_rate(x['rate'])}" for x in bands))
    if result["first_batch_replayed"] != batch:
        b.problem(f"refusal curve: only {result['first_batch_replayed']} of the first {batch} keys replayed "
                  f"(first error: {again['first_error']})", fatal=a.smoke)
    return result


def save(result: dict, path: str, commit: str) -> None:
    p = Path(path) if Path(path).is_absolute() else REPO / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump(dict(result, commit=commit, measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))))
    log(f"  refusal curve saved to {rel(p)}")


def dump(d: dict) -> str:
    """One line per field, each value compact: small, and diffs stay readable."""
    fields = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in d.items()]
    return "{\n" + ",\n".join(fields) + "\n}\n"


def baseline() -> dict | None:
    try:
        return json.loads(BASELINE.read_text())
    except (OSError, ValueError):
        return None


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "not reached"
    if x == 0:
        return "0"
    return f"{x:.2%}" if x >= 1e-3 else f"{x:.3%}"


def markdown(f: dict, base: dict | None) -> list[str]:
    L = [FILL_HEADING, ""]
    L.append(f"One more proxy Envoy with the filter, local store `capacity` {f['capacity']:,}, ttl `24h` (nothing "
             f"expires, so live records = keys stored), fed new keys in batches of {f['batch']} "
             f"(`bench/fill.py`): {f['sent']:,} new keys in {f['elapsed_s']:.0f} s, {f['stored']:,} stored "
             f"({f['stored'] / f['capacity']:.1%} of capacity), {f['refused']:,} refused with `503 store_full`. "
             "A batch counts in the band of the fill (live records / capacity) at its start; the phase stops "
             f"once the store took {BEYOND:g} x capacity requests at 100% or after {MAX_SENT:g} x capacity in all.")
    L.append("")
    has_base = base is not None and base.get("capacity")
    L.append("| fill (live / capacity) | new keys | refused (this run) |"
             + (f" refused at {base.get('commit', '?')} (capacity {base['capacity']:,}) |" if has_base else ""))
    L.append("|---|---:|---:|" + ("---:|" if has_base else ""))
    for i, x in enumerate(f["bands"]):
        row = f"| {x['band']} | {x['requests']:,} | {fmt_rate(x['rate'])} |"
        if has_base:
            row += f" {fmt_rate(base['bands'][i]['rate'])} |"
        L.append(row)
    L.append("")
    ok = f["first_batch_replayed"] == f["first_batch"]
    L.append(f"After the fill, the first {f['first_batch']} keys (stored at 0% fill) sent again: "
             f"{f['first_batch_replayed']} replayed" + (" (no live record was evicted to make room)." if ok
                                                         else " (**records were lost**)."))
    m = memory(f)
    if m:
        L.append(f"Memory per live record (every record here is live; snapshot {f['snapshot_bytes']:,} B): RSS grew "
                 f"{m['growth'] / 2**20:.1f} MiB from start to end for {f['stored']:,} records, "
                 f"**snapshot {m['added']:+,.0f} B** each. The store's fixed cost (its {f['capacity']:,} slots' "
                 "shared-data keys, created empty at start) is in the RSS at start, not here; and RSS moves in pages "
                 "and allocator arenas, so below some 10,000 records this figure is mostly noise.")
    L.append("")
    L.append("The curve is the last panel of `bench/results.svg`"
             + (f", next to the one measured at commit {base.get('commit', '?')} (bench/baseline/)." if has_base else "."))
    L.append("")
    return L


def memory(f: dict) -> dict | None:
    if not (f.get("rss_end_kib") and f["stored"] and f.get("snapshot_bytes")):
        return None
    growth = (f["rss_end_kib"] - f["rss_start_kib"]) * 1024
    return {"growth": growth, "added": growth / f["stored"] - f["snapshot_bytes"]}


def targets(f: dict) -> list[tuple[str, str, bool | None]]:
    # Judged on the worst band below 90%: "below 90% fill" holds at every fill up to there.
    below = [x for x in f["bands"][:9] if x["requests"]]
    worst = max(below, key=lambda x: x["rate"], default=None)
    reached = bool(f["bands"][8]["requests"])
    out = [("new keys refused at every fill below 90% < 0.1% (worst 10% band)",
            (f"{fmt_rate(worst['rate'])} at {worst['band']} ({worst['refused']:,} of {worst['requests']:,})"
             if worst else "no data") + ("" if reached else "; 80-90% never reached"),
            (worst["rate"] < 0.001 and reached) if worst else None)]
    top = f["bands"][10]
    out.append(("at 100% fill only refusals, no live record evicted",
                (f"{fmt_rate(top['rate'])} refused at 100%+" if top["requests"] else "100% never reached")
                + f"; first {f['first_batch']} keys replayed {f['first_batch_replayed']}",
                bool(top["requests"]) and top["refused"] == top["requests"]
                and f["first_batch_replayed"] == f["first_batch"]))
    return out


