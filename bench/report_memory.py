"""The memory section of BENCHMARKS.md: the 1,000,000-key phase (bench/memory.py),
its bound, the bucket-fill estimate and the memory per live record."""

from __future__ import annotations

from pathlib import Path

from bench.load import parse_duration_s

# Every RSS sample of the memory phase: a CSV next to the report, not hundreds of lines in it.
SAMPLES_CSV = "bench/results/memory-samples.csv"


def write_samples(m: dict, repo: Path) -> Path:
    """All samples of the memory phase as `bench/results/memory-samples.csv` under `repo`."""
    path = repo / SAMPLES_CSV
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["t_s,requests,rss_kib,stored,store_full,swept"]
    lines += [f"{x['t']:.2f},{x['requests']},{x['rss_kib']},{x.get('stored', 0)},{x.get('store_full', 0)},"
              f"{x.get('swept', 0)}" for x in m["samples"]]
    path.write_text("\n".join(lines) + "\n")
    return path

MEMORY_HEADING = "## Memory under unique keys"
ENTRY_HEADER = 45  # bytes of a slot value before its snapshot (docs/OPERATIONS.md: Storage and memory)
TARGET_OVERHEAD = 128  # issue 11: at most the snapshot's bytes plus 128 B per live record
# The bound per unit of capacity of docs/OPERATIONS.md (Storage and memory): a bucket entry, a slot's own
# bytes, the stored response, two quota counters.
ENTRY_BYTES = 117
SLOT_OVERHEAD = 118
QUOTA_BYTES = 72


def store_keys(capacity: int) -> int:
    """Shared-data keys the local store creates (docs/OPERATIONS.md): 10 per bucket, a fill key per 64
    buckets, two more; 1.5 entry positions per unit of capacity, 8 per bucket."""
    buckets = -(-capacity * 3 // 16)
    return buckets * 10 + -(-buckets // 64) + 2


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
    L.append(f"Bound (docs/OPERATIONS.md): capacity x ({ENTRY_BYTES} B bucket entry + {SLOT_OVERHEAD} B slot + stored response + "
             f"{QUOTA_BYTES} B of quota counters) + fixed cost. Here the stored response is the kept response headers "
             f"(6 B + name + value each: content-type, date, server, x-envoy-upstream-service-time) and the 1024-byte "
             f"body, so 100000 x {m['per_record']} B = **{m['bound_records_mib']:.0f} MiB** of record bytes (before "
             f"allocator overhead), on top of the fixed cost: this Envoy's RSS right after start (Envoy, the V8 VMs, and "
             f"all {store_keys(100000):,} shared-data keys created empty) = **{idle:.1f} MiB**. "
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
    rate = r["ok_rps"]
    live = rate * parse_duration_s(m["ttl"])
    refused = m["counters"].get("store_full", 0)
    L.append(f"Refusals. About rate x ttl = {rate:.0f}/s x {m['ttl']} = {live:,.0f} records are live at a time "
             f"({live / 100000:.0%} of the capacity), while the sweep takes a shard of 64 buckets a second, so most "
             f"records in the store have ended and are not yet swept; a claim whose shard counts no room reclaims them "
             f"from the shard's other buckets. `503 store_full`: {refused:,} of {r['requests']:,} "
             f"({refused / max(1, r['requests']):.1e}). How refusals grow with live records is the refusal curve above.")
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
        L.append(f"All {len(samples)} samples: [`{SAMPLES_CSV}`]({SAMPLES_CSV}).")
        L.append("")
    return L


def per_record(m: dict) -> dict:
    """Memory per record the store holds, from the memory phase: (RSS at end - RSS after start)
    / records held - snapshot bytes. After ten times its capacity in new keys, the store holds
    `capacity` records: the live ones and those that ended and wait for the sweep or for a claim
    to reuse their place; both keep their slot's bytes until then."""
    end = m["samples"][-1]
    held = min(100000, end["stored"])
    growth = (end["rss_kib"] - m["idle_kib"].get("VmRSS", 0)) * 1024
    snapshot = m["slot_bytes"] - ENTRY_HEADER
    out = {
        "held": held,
        "growth_bytes": growth,
        "snapshot": snapshot,
        "per_record": growth / held - snapshot if held > 0 else float("nan"),
    }
    # The same growth as Envoy's allocator sees it (runs before the allocator was read lack it).
    h0, h1 = m.get("heap_idle"), m.get("heap_end")
    if h0 and h1 and held > 0:
        allocated = h1["allocated"] - h0["allocated"]
        kept_free = sum(h1.get(k, 0) - h0.get(k, 0) for k in ("pageheap_free", "total_thread_cache"))
        out.update({
            "allocated_bytes": allocated,
            "allocated_per_record": allocated / held - snapshot,
            "kept_free_per_record": kept_free / held,
            "rest_per_record": (growth - allocated - kept_free) / held,
        })
    return out


def per_record_markdown(m: dict) -> list[str]:
    p = per_record(m)
    return [
        f"Memory per record (issue 11 target: at most the snapshot's bytes + {TARGET_OVERHEAD} B): RSS at end - RSS "
        f"after start = {p['growth_bytes'] / 2**20:.1f} MiB for the {p['held']:,} records the store holds once full "
        f"(live, or ended and not yet swept or reused); snapshot {p['snapshot']:,} B (slot value without its "
        f"{ENTRY_HEADER} B entry header). (RSS growth / records held) - snapshot = **{p['per_record']:+,.0f} B**. This "
        "is the bound of docs/OPERATIONS.md measured: entry, slot and quota bytes, plus what Envoy's shared-data map and the "
        "allocator add when a million writes replace values of every size (RSS is a high-water mark). The refusal "
        "curve's phase (ttl 24 h, every record live, written once) measures the records alone.",
        "",
    ] + allocator_markdown(p)


def allocator_markdown(p: dict) -> list[str]:
    if "allocated_per_record" not in p:
        return []
    return [
        f"The same growth as Envoy's allocator reports it (admin `/memory`, tcmalloc, right after start and at the "
        f"end): live objects grew {p['allocated_bytes'] / 2**20:.1f} MiB, **snapshot {p['allocated_per_record']:+,.0f} B** "
        f"per record held: the bytes the records really occupy. Of these, the record format itself is "
        f"{ENTRY_BYTES + ENTRY_HEADER} B (the {ENTRY_BYTES} B bucket entry and the slot's {ENTRY_HEADER} B header); the "
        "rest is the allocator rounding each shared-data value up to its size class (a slot value of about 1.2 KB takes "
        "the next class up) and what the other values (fill and quota counters, the bucket's unused bytes) hold. So 128 B "
        "is below what the record format alone needs. Free memory the allocator keeps for reuse grew "
        f"{p['kept_free_per_record']:+,.0f} B per record, and {p['rest_per_record']:+,.0f} B per record is neither "
        "(allocator metadata, V8's memory, pages touched and not returned).",
        "",
    ]


def target(m: dict) -> tuple[str, str, bool | None]:
    p = per_record(m)
    return (f"memory per record <= snapshot + {TARGET_OVERHEAD} B (1,000,000-key phase, RSS growth / records held)",
            f"snapshot {p['per_record']:+,.0f} B ({p['held']:,} records held at the end)",
            # Judged, like the RSS curve, only when the store was written over at least twice.
            (p["per_record"] <= TARGET_OVERHEAD if p["per_record"] == p["per_record"] else None)
            if m.get("levels_off") is not None else None)
