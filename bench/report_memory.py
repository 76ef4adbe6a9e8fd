"""The memory section of BENCHMARKS.md: the 1,000,000-key phase (bench/phases.py, memory_phase),
its bound, the bucket-fill estimate and the memory per live record."""

from __future__ import annotations

import math

from bench.load import parse_duration_s

MEMORY_HEADING = "## Memory under unique keys"
ENTRY_HEADER = 45  # bytes of a slot value before its snapshot (README: record layout)
TARGET_OVERHEAD = 128  # issue 11: at most the snapshot's bytes plus 128 B per live record


def memory_markdown(m: dict, note: str = "") -> list[str]:
    r = m["result"]
    L = [MEMORY_HEADING, ""]
    if note:
        L += [note, ""]
    idle = m["idle_kib"].get("VmRSS", 0) / 1024
    L.append(f"One more proxy Envoy with the filter (local store capacity 100000, ttl `{m['ttl']}`, "
             f"processing_timeout `{m['ttl']}`) takes {m['requests']:,} requests, each with a new key, "
             f"closed loop, {r['connections']} connections: {r['requests']:,} answered in {r['elapsed_s']:.1f} s "
             f"({r['ok_rps']:.0f}/s); statuses {', '.join(f'{k}: {n:,}' for k, n in sorted(r['statuses'].items()))}. "
             f"Filter counters (non-zero): {', '.join(f'{k} {n:,}' for k, n in sorted(m['counters'].items()) if n)}; "
             f"records swept {m['swept']:,}.")
    L.append("")
    L.append(f"Bound (README): capacity x (record entry 93 B in its bucket + snapshot slot value) + fixed cost. "
             f"Here a slot value is 45 B + 4 B body length + the kept response headers (6 B + name + value each: "
             f"content-type, date, server, x-envoy-upstream-service-time) + the 1024-byte body = about {m['slot_bytes']} B, "
             f"so 100000 x {m['per_record']} B = **{m['bound_records_mib']:.0f} MiB** of record bytes (before allocator "
             f"overhead), on top of the fixed cost: this Envoy's RSS right after start (Envoy, the V8 VMs, and all "
             f"{100000 // 8 * 9 + 2:,} shared-data keys created empty) = **{idle:.1f} MiB**. "
             f"Bound = about **{idle + m['bound_records_mib']:.0f} MiB**.")
    L.append("")
    ac = m.get("after_capacity")
    L.append(f"Peak RSS in this phase: **{m['peak_rss_kib'] / 1024:.1f} MiB**. The last third of the samples grows "
             f"**{m['last_third_growth']:+.1%}** ("
             + {True: "levels off", False: "still growing", None: "too few requests to judge"}[m["levels_off"]]
             + "; target < 5%)"
             + (f"; from the first sample after 100,000 requests ({ac['rss_kib'] / 1024:.1f} MiB at {ac['requests']:,}) "
                f"to the end: {m['after_capacity_growth']:+.1%}" if ac else "")
             + f". Envoy CPU per request here: {m['cpu_us_per_req']:.1f} µs. The curve is the third panel of "
             "`bench/results.svg`.")
    L.append("")
    L.extend(per_record_markdown(m))
    # Bucket fill: a key can only go to its hash's bucket (8 entries), so store_full starts long
    # before `capacity` records are live. With L live records in B buckets, a new key is refused
    # with probability ~ P(Poisson(L / B) >= 8).
    rate = r["ok_rps"]
    live = rate * parse_duration_s(m["ttl"])
    L.append(f"Bucket fill. A key can only be placed in its hash's bucket of 8, so `503 store_full` starts long "
             f"before 100000 records are live: with L live records in 12500 buckets a new key is refused with "
             f"probability about P(Poisson(L/12500) >= 8). Here L is about rate x ttl = {rate:.0f}/s x {m['ttl']} = "
             f"{live:,.0f} records, which predicts {poisson_tail(live / 12500, 8):.1e} of new keys refused; measured "
             f"{m['counters'].get('store_full', 0):,} of {r['requests']:,} "
             f"({m['counters'].get('store_full', 0) / max(1, r['requests']):.1e}). The same estimate for other loads:")
    L.append("")
    L.append("| live records (share of capacity) | new keys refused as store_full |")
    L.append("|---:|---:|")
    for share in (0.05, 0.10, 0.25, 0.50, 0.75):
        x = poisson_tail(100000 * share / 12500, 8)
        L.append(f"| {int(100000 * share):,} ({share:.0%}) | {f'{x:.2%}' if x >= 1e-4 else f'{x:.1e}'} |")
    L.append("")
    samples = m["samples"]
    step = max(1, -(-len(samples) // 30))
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    L.append(f"RSS curve ({'every sample' if step == 1 else f'every {step}th sample, all of them below'}):")
    L.append("")
    L.append("| t (s) | requests | RSS MiB | stored | store_full | swept |")
    L.append("|---:|---:|---:|---:|---:|---:|")
    for x in shown:
        L.append(f"| {x['t']:.1f} | {x['requests']:,} | {x['rss_kib'] / 1024:.1f} | {x['stored']:,} | {x['store_full']:,} | {x['swept']:,} |")
    L.append("")
    if step > 1:
        L.append("<details><summary>all samples (t s, requests, RSS KiB)</summary>")
        L.append("")
        L.append("```")
        for x in samples:
            L.append(f"{x['t']:.2f} {x['requests']} {x['rss_kib']}")
        L.append("```")
        L.append("")
        L.append("</details>")
        L.append("")
    return L


def poisson_tail(lam: float, k: int) -> float:
    """P(X >= k) for X ~ Poisson(lam)."""
    if lam != lam or lam <= 0:
        return 0.0
    term, cdf = math.exp(-lam), 0.0
    for i in range(k):
        cdf += term
        term *= lam / (i + 1)
    return max(0.0, 1.0 - cdf)


def per_record(m: dict) -> dict:
    """Memory per live record from the memory phase: (RSS at end - RSS after start) / live
    records - snapshot bytes. Live records at the end = those stored within the last ttl (the
    stored counter's growth over the last ttl of the samples; nothing older is live)."""
    samples = m["samples"]
    ttl = parse_duration_s(m["ttl"])
    end = samples[-1]
    older = [s for s in samples if s["t"] <= end["t"] - ttl]
    live = end["stored"] - (older[-1]["stored"] if older else 0)
    growth = (end["rss_kib"] - m["idle_kib"].get("VmRSS", 0)) * 1024
    snapshot = m["slot_bytes"] - ENTRY_HEADER
    return {
        "live": live,
        "growth_bytes": growth,
        "snapshot": snapshot,
        "per_live": growth / live - snapshot if live > 0 else float("nan"),
    }


def per_record_markdown(m: dict) -> list[str]:
    p = per_record(m)
    return [
        f"Memory per live record (issue 11 target: at most the snapshot's bytes + {TARGET_OVERHEAD} B): "
        f"RSS at end - RSS after start = {p['growth_bytes'] / 2**20:.1f} MiB; live records at the end (stored within "
        f"the last ttl) {p['live']:,}; snapshot {p['snapshot']:,} B (slot value without its {ENTRY_HEADER} B entry "
        f"header). (RSS growth / live records) - snapshot = **{p['per_live']:+,.0f} B**. RSS is a high-water mark: "
        "the memory of the records that expired and were swept during the phase stays with the process (the "
        "allocator keeps it for the next records), so with a 5 s ttl this figure counts far more records than are "
        "live. The refusal curve's phase (ttl 24 h, nothing expires, every record live) measures the same quantity "
        "without that effect.",
        "",
    ]


def target(m: dict) -> tuple[str, str, bool | None]:
    p = per_record(m)
    return (f"memory per live record <= snapshot + {TARGET_OVERHEAD} B (1,000,000-key phase, RSS growth / live records)",
            f"snapshot {p['per_live']:+,.0f} B ({p['live']:,} live at the end)",
            # Judged, like the RSS curve, only when the store was written over at least twice.
            (p["per_live"] <= TARGET_OVERHEAD if p["per_live"] == p["per_live"] else None)
            if m.get("levels_off") is not None else None)
