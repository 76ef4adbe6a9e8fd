"""One run of `python -m bench.run`: `Bench`, what every phase of it reads and writes (the
arguments, the Envoys started, the scenarios, each phase's results, the problems met), with the
helpers every phase uses (start and stop Envoys, fresh keys, report a problem). The phases are
modules of their own that take a Bench (bench/rounds.py, bench/fill.py, bench/memory.py; wait
mode's wake-up latency in bench/run.py); the report (bench/report.py) reads it."""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from bench import HarnessError, loadavg, log
from bench.envoys import checked
from bench.load import Loadgen
from bench.scenarios import Scenario
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd


class Bench:
    """One run. rounds.setup adds `upstream_headers` (the upstream's answer, for the memory
    bound) and `filter_configs` (the filter's configuration per scenario id, for the report)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.loadgen = Loadgen(args.loadgen, args.connections)
        self.upstream: Envoy | None = None
        self.processes: list[Envoy] = []
        self.scenarios: list[Scenario] = []
        self.open_rate: float | None = None
        # The rate of the equal-load phase: the local and the etcd store's scenarios at one rate.
        self.equal_rate: float | None = None
        self.memory: dict[str, Any] | None = None
        self.wake: dict[str, Any] | None = None  # bench/wake_latency.py's result
        self.wake_failed = False
        self.failures: list[str] = []
        self.key_counter = 0
        self.started = time.time()
        self.loadavg_start = loadavg()
        self.new_key_ttl = args.new_key_ttl
        self.etcd: Etcd | None = None
        self.fill: dict[str, Any] | None = None  # bench/fill.py's refusal curve

    # ---- helpers -------------------------------------------------------------------------

    def fresh_prefix(self, what: str) -> str:
        self.key_counter += 1
        return f"{self.run_id}-{what}-{self.key_counter}"

    def start(self, envoys: list[Envoy]) -> None:
        for e in envoys:
            self.processes.append(e)
            e.spawn()
        for e in envoys:
            checked(e, e.wait_ready, 60.0)

    def stop_all(self) -> None:
        for e in reversed(self.processes):
            e.stop()
        self.stop_etcd()

    def stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()  # its temporary data directory goes with it
            self.etcd = None

    def sid(self, sid: int) -> Scenario | None:
        return next((s for s in self.scenarios if s.sid == sid), None)

    def problem(self, msg: str, fatal: bool) -> None:
        """A harness problem: logged and listed in the report; `fatal` stops the run."""
        log("  !! " + msg)
        self.failures.append(msg)
        if fatal:
            raise HarnessError(msg)

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
            self.problem(f"{sc_name} {what}: " + "; ".join(problems), fatal)

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
