"""Draws deploy/grafana/dashboard.png: the panels of idempotency-dashboard.json, their PromQL
evaluated (idemkit.promql) over scrapes of a real Envoy's /stats/prometheus while a minute of
demo traffic runs through it, without Prometheus or Grafana.

    PYTHONPATH=. python deploy/grafana/render.py [--seconds 60] [--out deploy/grafana/dashboard.png]

Needs matplotlib (not a test dependency: `pip install matplotlib` into any venv), the module
(`make build`) and Envoy (`make tools`). The Envoy runs the filter with envoy/envoy.yaml's stats
tags and a small store (capacity 300, ttl 20 s) so that a minute shows the store filling up,
refusing, and being swept; series at 0 throughout are left out of the picture.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import uuid
from pathlib import Path

from idemkit import REPO_ROOT, promql
from idemkit.bootstrap import shipped_stats_config
from idemkit.envoy import OrdersProxy, default_binary
from idemkit.process import Upstream

DASHBOARD = Path(__file__).resolve().parent / "idempotency-dashboard.json"
CAPACITY, TTL_S = 300, 20
FILTER_CONFIG = {
    "store": {"type": "local", "capacity": CAPACITY},
    "routes": [
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True, "ttl": "%ds" % TTL_S,
         "processing_timeout": "5s"},
        {"name": "payments", "match": {"prefix": "/payments"}, "require_key": True, "ttl": "%ds" % TTL_S, "processing_timeout": "5s",
         "concurrent": "wait", "wait_timeout": "1s"},
    ],
}
VARIABLES = {"route": ".*", "__rate_interval": "10s", "ttl": "%ds" % TTL_S, "capacity": str(CAPACITY)}


def _key() -> str:
    return uuid.uuid4().hex


def traffic(envoy, stop: threading.Event, t0: float) -> list[threading.Thread]:
    """Demo traffic: orders with retries and a few mismatches, duplicates of slow calls (409 on
    orders, held on payments), a burst of new keys that fills the store, unmatched requests."""
    def every(period: float, fn) -> threading.Thread:
        def run() -> None:
            while not stop.is_set():
                try:
                    fn()
                except OSError:
                    pass
                stop.wait(period)
        return threading.Thread(target=run, daemon=True)

    def orders() -> None:
        headers = {"idempotency-key": _key(), "content-type": "application/json"}
        envoy.post("/orders", b'{"qty":1}', headers)
        if random.random() < 0.4:
            envoy.post("/orders", b'{"qty":1}', headers)
        if random.random() < 0.05:
            envoy.post("/orders", b'{"qty":2}', headers)

    def duplicate(path: str, delay_ms: int, copies: int) -> None:
        headers = {"idempotency-key": _key(), "content-type": "application/json"}
        slow = threading.Thread(target=envoy.post, args=(path, b"{}", dict(headers, **{"x-delay-ms": str(delay_ms)})),
                                daemon=True)
        slow.start()
        time.sleep(0.2)
        for _ in range(copies):
            threading.Thread(target=envoy.post, args=(path, b"{}", headers), daemon=True).start()
        slow.join()

    def burst() -> None:
        if 25 <= time.monotonic() - t0 <= 35:
            for _ in range(10):
                envoy.post("/orders", b"{}", {"idempotency-key": _key()})

    return [every(0.1, orders), every(2.0, lambda: duplicate("/orders", 800, 1)),
            every(1.5, lambda: duplicate("/payments", 600, 2)), every(5.0, lambda: duplicate("/payments", 2000, 1)),
            every(0.2, burst), every(0.5, lambda: envoy.post("/elsewhere", b"{}"))]


def scrape_while(envoy, seconds: float) -> list[tuple[float, dict]]:
    stop = threading.Event()
    t0 = time.monotonic()
    history = [(0.0, promql.parse_scrape(envoy.prometheus(settle=False)))]
    threads = traffic(envoy, stop, t0)
    for th in threads:
        th.start()
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        history.append((time.monotonic() - t0, promql.parse_scrape(envoy.prometheus(settle=False))))
    stop.set()
    for th in threads:
        th.join(timeout=5)
    return history


def legend(fmt: str, labels: frozenset) -> str:
    d = dict(labels)
    out = fmt
    for k, v in d.items():
        out = out.replace("{{%s}}" % k, v)
    return out.replace("{{instance}}", "envoy").strip() or "value"


def draw(history: list[tuple[float, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.6 * rows), dpi=72)
    window = promql._duration(VARIABLES["__rate_interval"])
    first = next(i for i, (t, _) in enumerate(history) if t >= window)
    times = [t for t, _ in history[first:]]
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            node = promql.parse(promql.substitute(target["expr"], VARIABLES))
            lines: dict[frozenset, list[float]] = {}
            for n, at in enumerate(range(first, len(history))):
                vec = promql.evaluate(node, history, at)
                vec = vec if isinstance(vec, dict) else {frozenset(): vec}
                for k, v in vec.items():
                    lines.setdefault(k, [float("nan")] * (len(history) - first))[n] = v
            for k, ys in sorted(lines.items(), key=lambda kv: sorted(kv[0])):
                if any(y for y in ys if y == y):
                    ax.plot(times, ys, label=legend(target["legendFormat"], k), linewidth=1.4)
        ax.set_title(panel["title"], fontsize=10, loc="left")
        unit = panel["fieldConfig"]["defaults"]["unit"]
        ax.set_ylabel({"percentunit": "share", "reqps": "req/s", "ops": "/s", "short": "count"}[unit], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5, loc="upper left", ncol=2, framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "no events (0 throughout)", ha="center", va="center", transform=ax.transAxes,
                    fontsize=8, color="grey")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    fig.suptitle("Idempotency filter: deploy/grafana/idempotency-dashboard.json over a minute of demo traffic "
                 "(capacity %d, ttl %d s)" % (CAPACITY, TTL_S), fontsize=11)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "dashboard.png")
    ap.add_argument("--wasm", type=Path, default=REPO_ROOT / "dist" / "idempotency_filter.wasm")
    a = ap.parse_args()
    up = Upstream("grafana-render-orders").start()
    envoy = None
    try:
        envoy = OrdersProxy(default_binary(), up.port, FILTER_CONFIG, a.wasm, name="grafana-render",
                            log_level="warn", component_log_level="wasm:info",
                            stats_config=shipped_stats_config(REPO_ROOT / "envoy" / "envoy.yaml")).start()
        history = scrape_while(envoy, a.seconds)
    finally:
        if envoy is not None:
            envoy.stop()
        up.stop()
    draw(history, a.out)
    print("wrote %s (%d scrapes)" % (a.out, len(history)))


if __name__ == "__main__":
    main()
