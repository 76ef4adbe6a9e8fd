"""bench/results.svg: throughput and p99 per scenario, the memory curve and the refusal-vs-fill
curve (next to the one kept in bench/baseline/), drawn by hand from a computed report
(bench/report_model.py's `ReportData`; no plotting library: the bench is standard library only)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from bench import fill as fill_phase

if TYPE_CHECKING:
    from bench.report_model import ReportData


def render(rep: ReportData) -> str:
    """A hand-written SVG: throughput and p99 per scenario, and the memory curve."""
    b = rep.b
    mem = b.memory
    W = 940
    panel_w, top, bottom = 390, 80, 320
    # The legend lists the scenarios two to a row below the bar charts; the panels below it move
    # down by what a longer list needs.
    legend_end = bottom + 42 + (len(b.scenarios) + 1) // 2 * 18
    shift = max(0, legend_end + 12 - 440)
    H = (440 if not mem else 740) + shift
    fill_top = H + 40  # the refusal curve's panel, below the others
    if b.fill:
        H += 320
    colors = {1: "#6b7280", 2: "#9ca3af", 3: "#60a5fa", 4: "#2563eb", 5: "#16a34a", 6: "#f59e0b",
              7: "#7c3aed", 8: "#a855f7", 9: "#0891b2", 10: "#c4b5fd",
              11: "#ddd6fe", 12: "#5b21b6", 13: "#d8b4fe", 14: "#1e40af",
              15: "#bfdbfe", 16: "#93c5fd", 17: "#86efac", 18: "#67e8f9"}

    def esc(t: str) -> str:
        return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="#ffffff"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
        f'idempotency filter vs Envoy alone: {b.args.connections} connections, '
        f'{b.args.rounds} interleaved rounds x {b.args.duration:g} s per scenario</text>',
    ]

    def nice_max(v: float) -> float:
        """A round axis maximum: a multiple of a 1-2-5 step, with at most 6 intervals."""
        if v <= 0 or v != v:
            return 1.0
        exp = 10.0 ** math.floor(math.log10(v / 6))
        for m in (1, 2, 5, 10):
            step = m * exp
            if math.ceil(v / step) <= 6:
                return math.ceil(v / step) * step
        return math.ceil(v / (10 * exp)) * 10 * exp

    def tick_step(vmax: float) -> float:
        exp = 10.0 ** math.floor(math.log10(vmax / 6))
        for m in (1, 2, 5, 10):
            if vmax / (m * exp) <= 6 + 1e-9:
                return m * exp
        return vmax / 4

    def axes(x0: float, y_top: float, y_bottom: float, width: float, vmax: float, fmt) -> None:
        h = y_bottom - y_top
        step = tick_step(vmax)
        n = int(round(vmax / step))
        for i in range(n + 1):
            v = step * i
            y = y_bottom - h * v / vmax
            parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + width}" y2="{y:.1f}" stroke="#e5e7eb"/>')
            parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#374151">{fmt(v)}</text>')
        parts.append(f'<line x1="{x0}" y1="{y_bottom}" x2="{x0 + width}" y2="{y_bottom}" stroke="#111827"/>')

    def bars(x0: float, title: str, values: dict[int, float], whiskers: dict[int, tuple[float, float]] | None,
             fmt, second: dict[int, float] | None = None, second_label: str = "") -> None:
        allv = list(values.values()) + [w[1] for w in (whiskers or {}).values()] + list((second or {}).values())
        vmax = nice_max(max([v for v in allv if v == v] or [1]))
        h = bottom - top
        parts.append(f'<text x="{x0 + panel_w / 2}" y="{top - 34}" text-anchor="middle" font-size="13">{esc(title)}</text>')
        axes(x0, top, bottom, panel_w, vmax, fmt)
        slot = panel_w / max(1, len(values))
        bw = slot * (0.36 if second else 0.6)
        for i, (sid, v) in enumerate(values.items()):
            cx = x0 + slot * (i + 0.5)
            bx = cx - (bw if second else bw / 2)
            if v == v:
                y = bottom - h * v / vmax
                label_y = min(y, bottom - h * whiskers[sid][1] / vmax) if whiskers and sid in whiskers else y
                parts.append(f'<rect x="{bx:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{bottom - y:.1f}" fill="{colors[sid]}"/>')
                parts.append(f'<text x="{bx + bw / 2:.1f}" y="{label_y - 5:.1f}" text-anchor="middle" font-size="10">{fmt(v)}</text>')
            if whiskers and sid in whiskers:
                lo, hi = whiskers[sid]
                ylo, yhi = bottom - h * lo / vmax, bottom - h * hi / vmax
                wx = bx + bw / 2
                parts.append(f'<line x1="{wx:.1f}" y1="{ylo:.1f}" x2="{wx:.1f}" y2="{yhi:.1f}" stroke="#111827"/>')
                for yy in (ylo, yhi):
                    parts.append(f'<line x1="{wx - 5:.1f}" y1="{yy:.1f}" x2="{wx + 5:.1f}" y2="{yy:.1f}" stroke="#111827"/>')
            if second and sid in second and second[sid] == second[sid]:
                v2 = second[sid]
                y2 = bottom - h * v2 / vmax
                parts.append(f'<rect x="{cx:.1f}" y="{y2:.1f}" width="{bw:.1f}" height="{bottom - y2:.1f}" '
                             f'fill="{colors[sid]}" fill-opacity="0.35" stroke="{colors[sid]}"/>')
                parts.append(f'<text x="{cx + bw / 2:.1f}" y="{y2 - 4:.1f}" text-anchor="middle" font-size="10">{fmt(v2)}</text>')
            parts.append(f'<text x="{cx:.1f}" y="{bottom + 16}" text-anchor="middle" font-weight="bold">{sid}</text>')
        if second:
            parts.append(f'<rect x="{x0 + 20}" y="{top - 24}" width="10" height="10" fill="#2563eb"/>'
                         f'<text x="{x0 + 34}" y="{top - 15}" font-size="10">closed loop (each at saturation)</text>'
                         f'<rect x="{x0 + 210}" y="{top - 24}" width="10" height="10" fill="#2563eb" fill-opacity="0.35" stroke="#2563eb"/>'
                         f'<text x="{x0 + 224}" y="{top - 15}" font-size="10">{esc(second_label)}</text>')

    rps = {sid: r["rps"]["median"] for sid, r in rep.rows.items()}
    wh = {sid: (r["rps"]["min"], r["rps"]["max"]) for sid, r in rep.rows.items()}
    bars(70, "Throughput, req/s (median of rounds; whiskers min..max)", rps, wh, lambda v: f"{v:,.0f}")
    p99 = {sid: r["p99"] / 1000 for sid, r in rep.rows.items()}
    p99o = {sid: r["open_p99"] / 1000 for sid, r in rep.rows.items()} if b.open_rate else None
    bars(530, "p99 latency, ms", p99, None, lambda v: f"{v:.2f}", p99o,
         f"open loop, {b.open_rate:.0f} req/s" if b.open_rate else "")
    legend_y = bottom + 42
    for i, sc in enumerate(b.scenarios):
        x = 40 + (i % 2) * 450
        y = legend_y + (i // 2) * 18
        parts.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colors[sc.sid]}"/>')
        parts.append(f'<text x="{x + 18}" y="{y}" font-size="11">{sc.sid} {esc(sc.title)}</text>')

    if mem and mem["samples"]:
        samples = mem["samples"]
        x0, y_top, y_bottom, width = 70, 480 + shift, 670 + shift, 830
        parts.append(f'<text x="{x0 + width / 2}" y="{y_bottom + 34}" text-anchor="middle" fill="#374151">'
                     'requests sent (each with a new key)</text>')
        xs = [max(0, x["requests"]) for x in samples]
        ys = [x["rss_kib"] / 1024 for x in samples]
        xmax = nice_max(max(xs) or 1)
        bound = mem["idle_kib"].get("VmRSS", 0) / 1024 + mem["bound_records_mib"]
        ymax = nice_max(max(max(ys), bound) * 1.08)
        parts.append(f'<text x="{x0 + width / 2}" y="{y_top - 22}" text-anchor="middle" font-size="13">'
                     f'Memory under unique keys: Envoy RSS (MiB) vs requests with distinct keys '
                     f'(capacity 100000, ttl {esc(mem["ttl"])})</text>')
        axes(x0, y_top, y_bottom, width, ymax, lambda v: f"{v:.0f}")
        h = y_bottom - y_top
        xstep = tick_step(xmax)
        for i in range(int(round(xmax / xstep)) + 1):
            v = xstep * i
            x = x0 + width * v / xmax
            parts.append(f'<text x="{x:.1f}" y="{y_bottom + 16}" text-anchor="middle" fill="#374151">{v:,.0f}</text>')
        yb = y_bottom - h * bound / ymax
        parts.append(f'<line x1="{x0}" y1="{yb:.1f}" x2="{x0 + width}" y2="{yb:.1f}" stroke="#dc2626" stroke-dasharray="6 4"/>')
        parts.append(f'<text x="{x0 + width - 4}" y="{yb - 5:.1f}" text-anchor="end" fill="#dc2626" font-size="11">'
                     f'bound: fixed cost + capacity x {mem["per_record"]} B = {bound:.0f} MiB</text>')
        cap_x = x0 + width * 100000 / xmax
        if 100000 <= xmax:
            parts.append(f'<line x1="{cap_x:.1f}" y1="{y_top}" x2="{cap_x:.1f}" y2="{y_bottom}" stroke="#9ca3af" stroke-dasharray="3 3"/>')
            parts.append(f'<text x="{cap_x + 4:.1f}" y="{y_top + 12}" fill="#6b7280" font-size="10">100,000 requests (= capacity)</text>')
        pts = " ".join(f"{x0 + width * xv / xmax:.1f},{y_bottom - h * yv / ymax:.1f}" for xv, yv in zip(xs, ys))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#2563eb" stroke-width="2"/>')
        for xv, yv in zip(xs, ys):
            parts.append(f'<circle cx="{x0 + width * xv / xmax:.1f}" cy="{y_bottom - h * yv / ymax:.1f}" r="2" fill="#2563eb"/>')
    if b.fill:
        refusal_panel(parts, b.fill, fill_phase.baseline(), fill_top, axes, esc)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def refusal_panel(parts: list[str], f: dict, base: dict | None, y_top: float, axes, esc) -> None:
    """Share of new keys refused (503 store_full) per fill band, this run and the baseline."""
    x0, width = 70, 830
    y_bottom = y_top + 220
    h = y_bottom - y_top
    parts.append(f'<text x="{x0 + width / 2}" y="{y_top - 18}" text-anchor="middle" font-size="13">'
                 f'Refusals as the store fills: new keys refused (503 store_full) per fill band '
                 f'(live records / capacity; capacity {f["capacity"]:,}, ttl 24h)</text>')
    axes(x0, y_top, y_bottom, width, 100.0, lambda v: f"{v:.0f}%")
    n = len(f["bands"])
    slot = width / n
    for i, x in enumerate(f["bands"]):
        parts.append(f'<text x="{x0 + slot * (i + 0.5):.1f}" y="{y_bottom + 16}" text-anchor="middle" '
                     f'fill="#374151" font-size="10">{esc(x["band"])}</text>')
    parts.append(f'<text x="{x0 + width / 2}" y="{y_bottom + 34}" text-anchor="middle" fill="#374151">'
                 'fill when the key arrived (live records / capacity)</text>')
    tx = x0 + slot * 9
    parts.append(f'<line x1="{tx:.1f}" y1="{y_top}" x2="{tx:.1f}" y2="{y_bottom}" stroke="#dc2626" stroke-dasharray="3 3"/>')
    parts.append(f'<text x="{tx - 4:.1f}" y="{y_top + 12}" text-anchor="end" fill="#dc2626" font-size="10">'
                 'target: &lt; 0.1% below 90%</text>')
    series = [(f["bands"], "#2563eb", "", "this run")]
    if base and len(base.get("bands", [])) == n:
        series.append((base["bands"], "#6b7280", ' stroke-dasharray="6 4"',
                       f"commit {base.get('commit', '?')} (capacity {base['capacity']:,})"))
    for k, (bands, color, dash, label) in enumerate(series):
        pts = [(x0 + slot * (i + 0.5), y_bottom - h * x["rate"]) for i, x in enumerate(bands) if x.get("rate") is not None]
        if pts:
            parts.append(f'<polyline points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in pts)}" fill="none" '
                         f'stroke="{color}" stroke-width="2"{dash}/>')
            for px, py in pts:
                parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>')
        ly = y_top + 14 + 16 * k
        parts.append(f'<line x1="{x0 + 12}" y1="{ly - 4}" x2="{x0 + 36}" y2="{ly - 4}" stroke="{color}" stroke-width="2"{dash}/>'
                     f'<text x="{x0 + 42}" y="{ly}" font-size="11">{esc(label)}</text>')
