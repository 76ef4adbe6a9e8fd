"""The memory phase (`make bench-memory`, and the end of `make bench`): one proxy Envoy with the
filter, ttl 5 s and capacity 100,000, fed 1,000,000 distinct keys while its RSS is sampled; its
section of BENCHMARKS.md is bench/report_memory.py's. It measures whether RSS levels off once the
store is written over, and the bound per record docs/OPERATIONS.md states.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from bench import log, rel
from bench.envoys import ORDERS, bench_envoy, checked, filter_config, proxy_config, upstream_config, wasm_filter
from bench.report_memory import ENTRY_BYTES, QUOTA_BYTES, SLOT_OVERHEAD
from idemkit.bootstrap import MiB
from idemkit.envoy import SWEPT_STAT

if TYPE_CHECKING:
    from bench.harness import Bench


def run(b: Bench) -> dict[str, Any]:
    """The memory phase's result (b.memory): the samples, RSS idle and at its peak, growth over
    the last third, the filter's counters and the bound per record."""
    a = b.args
    if b.upstream is None:
        b.upstream = bench_envoy("upstream", upstream_config(), a.envoy)
        b.start([b.upstream])
    ttl = "5s"
    cfg = filter_config(ttl=ttl, processing_timeout=ttl)
    env = bench_envoy("mem", proxy_config(b.upstream.port, [wasm_filter(rel(a.wasm), "idempotency", cfg)]), a.envoy,
                      concurrency=a.memory_concurrency)
    b.start([env])
    time.sleep(0.5)
    idle = env.memory_kib()
    heap_idle = env.allocator()
    total = a.memory_requests
    log(f"  memory: {total:,} requests with distinct keys, {a.connections} connections, ttl {ttl}, "
        f"capacity 100000; RSS sampled every {a.memory_interval:g}s")
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        m = env.memory_kib()
        try:
            rq = env.counter("http.ingress_http.downstream_rq_total", settle=False)
            st = env.outcomes(settle=False)
            swept = env.counter(SWEPT_STAT, settle=False)
        except OSError:
            rq, st, swept = -1, {}, 0
        samples.append({
            "t": round(time.monotonic() - t0, 2),
            "requests": rq,
            "rss_kib": m.get("VmRSS", 0),
            "hwm_kib": m.get("VmHWM", 0),
            "stored": st.get("stored", 0),
            "store_full": st.get("store_full", 0),
            "swept": swept,
        })

    def sampler() -> None:
        while not stop.wait(a.memory_interval):
            try:
                sample()
            except OSError:
                return

    sample()
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    cpu0 = env.cpu_seconds()
    # 503 store_full is tolerated here (not in the smoke run): with ttl 5s about (rate x 5 s)
    # records are live, and a bucket of 8 now and then holds 8 of them. They are counted and
    # must match the filter's own store_full counter.
    expect = "201" if a.smoke else "201,503"
    try:
        r = b.loadgen.run(env.port, ORDERS, requests=total, duration=a.memory_max_seconds,
                          key_prefix=b.fresh_prefix("mem"), expect=expect, label="memory")
    finally:
        stop.set()
        th.join()
    cpu = env.cpu_seconds() - cpu0
    time.sleep(0.3)
    sample()
    checked(env, env.check_alive)
    counters = env.outcomes()
    swept = env.counter(SWEPT_STAT)
    heap_end = env.allocator()
    env.stop()
    b.check_result("memory", r, "memory phase", fatal=a.smoke)
    if r["requests"] < total:
        b.problem(f"memory phase: {r['requests']:,} of {total:,} requests completed "
                  f"(stopped by the {a.memory_max_seconds:g} s cap)", a.smoke)
    full_503 = r["statuses"].get("503", 0)
    if full_503 != counters.get("store_full", 0):
        b.problem(f"memory phase: {full_503} answers 503 but the filter counted "
                  f"{counters.get('store_full', 0)} store_full", a.smoke)

    rss = [s["rss_kib"] for s in samples]
    # RSS once as many records were written as the store holds, and at the end.
    after_cap = next((s for s in samples if s["requests"] >= 100000), None)
    cap_growth = ((samples[-1]["rss_kib"] - after_cap["rss_kib"]) / after_cap["rss_kib"]
                  if after_cap and after_cap["rss_kib"] else float("nan"))
    third = samples[len(samples) * 2 // 3:] if len(samples) >= 3 else samples
    base = third[0]["rss_kib"] if third else 0
    growth = (max(s["rss_kib"] for s in third) - base) / base if base else float("nan")
    # The bound docs/OPERATIONS.md states: capacity x (bucket entry + slot + response + quota counters)
    # + fixed cost (bench/report_memory.py's constants).
    stored_headers = sum(
        6 + len(k) + len(v)
        for k, v in b.upstream_headers_for_bound()
    )
    slot = 45 + 4 + stored_headers + 1024
    per_record = ENTRY_BYTES + SLOT_OVERHEAD + QUOTA_BYTES + stored_headers + 1024
    memory = {
        "requests": total,
        "result": r,
        "samples": samples,
        "idle_kib": idle,
        "heap_idle": heap_idle,
        "heap_end": heap_end,
        "peak_rss_kib": max(rss) if rss else 0,
        "last_third_growth": growth,
        "after_capacity": after_cap,
        "after_capacity_growth": cap_growth,
        # Judged only when the store was written over at least twice.
        "levels_off": (growth < 0.05 if growth == growth else False) if r["requests"] >= 200000 else None,
        "counters": counters,
        "swept": swept,
        "cpu_us_per_req": cpu / max(1, r["requests"]) * 1e6,
        "slot_bytes": slot,
        "per_record": per_record,
        "bound_records_mib": 100000 * per_record / MiB,
        "ttl": ttl,
    }
    log(f"  memory: {r['requests']:,} requests in {r['elapsed_s']:.1f}s ({r['ok_rps']:.0f}/s), "
        f"statuses {r['statuses']}; RSS idle {idle.get('VmRSS', 0) / 1024:.1f} MiB -> peak {max(rss) / 1024:.1f} MiB; "
        f"last third grows {growth:.1%}")
    for s in samples:
        log(f"    t={s['t']:7.2f}s requests={s['requests']:>9,} RSS={s['rss_kib'] / 1024:8.1f} MiB "
            f"stored={s['stored']:>9,} store_full={s['store_full']:>5,} swept={s['swept']:>9,}")
    return memory
