"""The e2e suite's harness: the idemkit kit (a real Envoy loading the real filter, in front of the
real demo upstream, no mocks) as the tests use it, plus what only the tests need: the filter's
outcomes, assertions on its problem responses, the upstream's expected bodies, and logs in
tests/e2e/.logs/ (gitignored): one Envoy log per module, the upstream's stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from demo.orders_upstream import response_body
from idemkit import REPO_ROOT, envoy as _envoy, process as _process
from idemkit.bootstrap import (  # noqa: F401 (re-exported for the tests)
    MiB,
    cors_filter,
    cors_policy,
    direct_response,
    etcd_cluster,
    file_access_log,
    text_file_access_log,
    zipkin_tracing,
    cluster,
    filter_http_filter,
    internal_callers,
    jwt_authn_filter,
    local_ratelimit_filter,
    local_ratelimit_route,
    mint_hs256,
    route,
)
from idemkit.client import (  # noqa: F401
    Response,
    build_request,
    new_key,
    raw_exchange,
    raw_request,
    read_partial_and_disconnect,
    read_response,
    request,
    send_and_disconnect,
)
from idemkit.envoy import (  # noqa: F401
    CLAIMS_LOST_STAT, CLAIMS_RENEWED_STAT, ROUTE_STAT, STAT_PREFIX, SWEPT_STAT, UNKNOWN_CLUSTER_STAT,
    UNMATCHED_STAT, WATCH_ENDED_STAT,
    EnvoyStartError,
)
from idemkit.etcd import DelayProxy, EtcdCluster  # noqa: F401
from idemkit.etcd import Etcd as _Etcd
from idemkit.process import (  # noqa: F401
    LIVE, Blackhole, ClosedPort, DyingUpstream, Fatal, free_port, tail, wait_until,
)
from idemkit.testkit import env_path  # noqa: F401 (re-exported for the tests)

LOG_ROOT = Path(__file__).resolve().parent / ".logs"

OUTCOMES = (
    "passed_through",
    "claimed",
    "replayed",
    "mismatch",
    "in_flight",
    "missing_key",
    "invalid_key",
    "released",
    "taken_over",
    "store_full",
    "too_large",
    "stored",
    "response_not_stored",
    "upstream_retried",
    "quota_exceeded",
    "grpc_refused",
    "store_error",
    "store_bypassed",
    "body_never_received",
    "settlement_abandoned",
    "principal_incomplete",
    "outcome_unknown",
    "unknown_refused",
    "router_controls_removed",
    "reconciled_found",
    "reconciled_not_found",
    "reconcile_failed",
    "key_from_header",
    "key_from_json",
    "key_from_fingerprint",
    "result_expired",
)
PROBLEM_TYPE = "urn:idempotency-filter:%s"


def etcd_store(cluster: str = "etcd", **fields) -> dict:
    """The filter's `store` for etcd on the Envoy cluster `cluster` (`etcd_cluster(...)` in
    ENVOY_OPTIONS' extra_clusters); `fields`: prefix, timeout, on_error, protocol ("grpc" needs
    `etcd_cluster(..., grpc=True)`)."""
    return dict({"type": "etcd", "cluster": cluster}, **fields)


class Etcd(_Etcd):
    """An etcd member logging below tests/e2e/.logs."""

    log_root = LOG_ROOT


class Upstream(_process.Upstream):
    """demo/orders_upstream.py on a free port, logging below tests/e2e/.logs."""

    log_root = LOG_ROOT


class Envoy(_envoy.OrdersProxy):
    """A real Envoy in front of the upstream (see idemkit.envoy.OrdersProxy for the
    parameters), logging below tests/e2e/.logs."""

    log_root = LOG_ROOT


@contextlib.contextmanager
def envoy_on_store(kind: str, name: str, envoy_bin, filter_wasm, upstream, filter_config,
                   listeners_for=None, **options):
    """An Envoy whose filter configuration is `filter_config(store)`, with `kind` "local" (the
    local store) or "etcd" (a real etcd started here, its cluster added); both stopped after.
    `listeners_for(store)`: more listeners that name the same store (an admin listener's)."""
    etcd = None
    store = {"type": "local", "capacity": 1000}
    if kind == "etcd":
        etcd = Etcd("etcd-" + name).start()
        store = etcd_store(prefix="/e2e-%s/" % name)
        options["extra_clusters"] = [etcd_cluster([etcd.client_port])]
    if listeners_for is not None:
        options["extra_listeners"] = listeners_for(store)
    proxy = Envoy(envoy_bin, upstream.port, filter_config(store), wasm_path=filter_wasm,
                  name="%s-%s" % (name, kind), **options)
    try:
        yield proxy.start()
    finally:
        proxy.stop()
        if etcd is not None:
            etcd.stop()


def leave_while_upstream_works(port: int, upstream: "Upstream", key: str, data: bytes) -> None:
    """Sends the raw request `data` (for `key`) to `port`, waits until the upstream has counted
    its execution, then resets the connection: the client is gone while the upstream works."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(data)
        wait_until(lambda: upstream.executions(key) == 1, 10, what="the upstream to get it")
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def expected_body(execution: int, size: int) -> bytes:
    """The body the upstream sends for `x-response-bytes: size` in execution `execution`."""
    return response_body(execution, size)


def detached_rule(name: str, prefix: str, lease_s: int, upstream_timeout_s: int, **extra) -> dict:
    """A route rule with a key required and `execution: "detached"`, its lease and
    `upstream_timeout` in whole seconds; `extra`: more rule fields."""
    rule = {"name": name, "match": {"prefix": prefix}, "require_key": True, "execution": "detached",
            "processing_timeout": "%ds" % lease_s, "upstream_timeout": "%ds" % upstream_timeout_s}
    rule.update(extra)
    return rule


def key_headers(key: str, **extra: str) -> dict[str, str]:
    """JSON content-type, `idempotency-key: key`, then `extra` as headers with `_` read as `-`
    (x_delay_ms="50" is `x-delay-ms: 50`); a later name replaces an earlier one."""
    headers = {"content-type": "application/json", "idempotency-key": key}
    headers.update({k.replace("_", "-"): v for k, v in extra.items()})
    return headers


def new_key_replay_and_mismatch(envoy: Envoy, path: str = "/orders") -> str:
    """Sends a new key, its retry and the key again with another body to `path`: 201, the 201
    replayed, 422. Returns the key."""
    key = new_key()
    body = b'{"item":"book","qty":1}'
    first = envoy.post(path, body, key_headers(key))
    again = envoy.post(path, body, key_headers(key))
    other = envoy.post(path, b'{"item":"book","qty":2}', key_headers(key))
    assert (first.status, again.status, other.status) == (201, 201, 422), (first, again, other)
    assert again.replayed, again
    return key


def assert_published_under_one_record(values: list, outcomes: list[str]) -> None:
    """`values` are the published `<outcome> <record tag>` of requests (access log, span tag):
    `outcomes` in order, all under one record tag (12 hex digits)."""
    parts = [(v or "").split(" ") for v in values]
    assert [p[0] for p in parts] == outcomes, values
    tags = {p[1] for p in parts if len(p) == 2}
    assert len(tags) == 1 and re.fullmatch(r"[0-9a-f]{12}", tags.pop()), values


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------
# assertions shared by the tests


def assert_problem(resp: Response, status: int, kind: str) -> dict:
    """`resp` is one of the filter's problem responses (RFC 9457) of type
    urn:idempotency-filter:<kind> with HTTP status `status`; returns the parsed body."""
    assert resp.status == status, resp
    ctype = (resp.header("content-type") or "").split(";")[0].strip().lower()
    assert ctype == "application/problem+json", resp
    doc = json.loads(resp.body)
    assert doc.get("type") == PROBLEM_TYPE % kind, doc
    assert doc.get("status") == status, doc
    assert isinstance(doc.get("title"), str) and doc["title"], doc
    assert isinstance(doc.get("detail"), str) and doc["detail"], doc
    assert not resp.replayed, resp
    return doc


def retry_after_seconds(resp: Response) -> int:
    value = resp.header("retry-after")
    assert value is not None and re.fullmatch(r"\d+", value.strip()), resp
    seconds = int(value)
    assert seconds >= 1, resp
    return seconds


# ---- `make run` ------------------------------------------------------------------------------

DEMO_PORTS = {"upstream": 8080, "Envoy": 10000, "Envoy admin": 9901, "idempotency admin API": 9902}


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open("/proc/%d/stat" % pid) as f:  # a zombie is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


class Demo:
    """`make run`: `python -m demo.run --envoy BIN` (envoy/envoy.yaml on its fixed ports) in its own
    session, as a terminal would run it; its output in lines. Fails (never skips) when another
    demo holds the ports."""

    def __init__(self, envoy_bin) -> None:
        busy = [name for name, port in DEMO_PORTS.items() if listening(port)]
        if busy:
            pytest.fail("ports taken (%s): is a `make run` running?" % ", ".join(busy), pytrace=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "demo.run", "--envoy", str(envoy_bin)],
            cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self._ready(), 90, 0.1, "`make run` to say it is ready")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("demo exited with %s:\n%s" % (self.proc.returncode, self.text()))
        return any("Ctrl-C here stops" in line for line in self.lines)

    def text(self) -> str:
        return "\n".join(self.lines)

    def pids(self) -> dict[str, int]:
        """What it said it started: upstream and Envoy pids."""
        found = {}
        for name in ("upstream", "Envoy"):
            m = re.search(r"^make run:\s+%s\s+http://\S+\s+pid (\d+)" % name, self.text(), re.M)
            assert m, "no pid for %s in:\n%s" % (name, self.text())
            found[name] = int(m.group(1))
        return found

    def stop(self, sig: int, group: bool) -> int:
        if group:
            os.killpg(self.proc.pid, sig)  # Ctrl-C in a terminal: the whole foreground group
        else:
            self.proc.send_signal(sig)  # kill <pid>: the runner alone
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("demo did not exit within 30 s:\n" + self.text())

    def assert_all_gone(self, pids: dict[str, int]) -> None:
        wait_until(lambda: not any(alive(p) for p in pids.values()), 10, 0.1,
                   "the demo's processes to end")
        assert not [name for name, port in DEMO_PORTS.items() if listening(port)], self.text()
        assert "make run: stopped Envoy (pid %d), upstream (pid %d)" % (
            pids["Envoy"], pids["upstream"]) in self.text()
