"""Processes the kit starts, and waiting for them: `wait_until`, the base class that stops a
process and keeps the registry of live ones (for failure reports), and `Upstream`, the demo
orders upstream (demo/orders_upstream.py) as a subprocess.

Every process binds 127.0.0.1; ports are chosen by the kernel (port 0) and read back, so there
is no port race, unless the caller asks for a fixed port (the demo) or the process cannot report
its port (etcd: `free_port`, which at least never hands out one port twice).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from idemkit import REPO_ROOT
from idemkit.client import Response, request

UPSTREAM_SCRIPT = REPO_ROOT / "demo" / "orders_upstream.py"

# Live processes, newest last; the e2e conftest dumps their logs into the report of a failed test.
LIVE: list["Process"] = []


# Every port free_port handed out in this process.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and never handed out before by this
    process. The kernel may give the same port to two binds in a row once the first socket is
    closed: an etcd asked for a client and a peer port got one port for both and failed to
    start (CI, bench-smoke)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh free port on 127.0.0.1 after 100 tries")


class ClosedPort:
    """A port that refuses connections for as long as this object lives: the socket is bound
    (so nobody else gets the port) but never listens, so a connect gets ECONNREFUSED."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()


class DyingUpstream:
    """An upstream host that dies mid-request: refuses connections (like `ClosedPort`) until
    `arm()`, after which it accepts one connection, reads one request off it (counted in
    `executions`: it ran), stops listening and then resets that connection without an answer,
    so a retry of it is refused: an Envoy route retry policy's second attempt fails to connect."""

    def __init__(self) -> None:
        self._sock = self._bound(0)
        self.port = self._sock.getsockname()[1]
        self.executions = 0
        self._served = threading.Event()

    @staticmethod
    def _bound(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        return sock

    def arm(self) -> None:
        """Accept and kill the next request; `wait_served` says when that is done."""
        self._served.clear()
        self._sock.listen(1)
        threading.Thread(target=self._serve, args=(self._sock,), daemon=True).start()

    def wait_served(self, timeout: float = 10.0) -> None:
        if not self._served.wait(timeout):
            raise AssertionError("DyingUpstream: no request came within %s s" % timeout)

    def _serve(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        # Stop listening first: the retry that the reset sets off must find the port refusing.
        listener.close()
        self._sock = self._bound(self.port)
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            while length and len(body) < int(length.group(1)):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            self.executions += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        finally:
            conn.close()
            self._served.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class Blackhole:
    """A port whose connects time out, as to a host that is gone (SYNs dropped): a listener with
    an accept queue of one, filled by a connection nobody accepts, so Linux drops every further
    SYN. `open(to_port)`: the host is back, every connection from then on (and the queued one)
    is accepted and piped to 127.0.0.1:`to_port`."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port = self._listener.getsockname()[1]
        self._open: list[socket.socket] = [socket.create_connection(("127.0.0.1", self.port), timeout=2)]
        # Full: one more connect must not complete (else the kernel's queue is larger than asked).
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.settimeout(0.3)
        try:
            probe.connect(("127.0.0.1", self.port))
            raise RuntimeError("Blackhole: a second connection was accepted into the queue")
        except (socket.timeout, BlockingIOError):
            pass
        finally:
            probe.close()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def open(self, to_port: int) -> None:
        thread = threading.Thread(target=self._accept, args=(to_port,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self, to_port: int) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", to_port), timeout=5)
            except OSError:
                conn.close()
                continue
            for sock in (conn, upstream):
                sock.settimeout(None)
                self._open.append(sock)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        for sock in [self._listener] + self._open:
            with contextlib.suppress(OSError):
                sock.close()


class Fatal(Exception):
    """Raised inside a wait_until predicate: stop waiting at once."""


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> Any:
    """Poll `predicate` until it returns a truthy value (returned) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (Fatal, AssertionError):
            raise
        except Exception as exc:  # noqa: BLE001 - polled condition may fail while starting
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(
                "timed out after %.1fs waiting for %s%s"
                % (timeout, what, " (last error: %r)" % last_exc if last_exc else "")
            )
        time.sleep(interval)


def tail(path: Path | None, lines: int = 200) -> str:
    if path is None or not path.exists():
        return "(no file)"
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", "replace").splitlines()
    return "\n".join(text[-lines:]) if text else "(empty)"



def fresh_log_dir(name: str, root: Path) -> Path:
    """A new directory below `root` named after `name` (plus a random suffix)."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9_.-]", "_", name) + "-", dir=root))


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """Run time of every live thread of `pid` so far, in ns (schedstat: finer than stat's ticks,
    which are 10 ms: a few hundred requests' worth at the etcd store's rates)."""
    total = 0
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, task)) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            pass  # a thread that ended between listdir and open
    return total


class Process:
    """A subprocess of the kit. Subclasses set `proc` and say what to show when a test fails.
    `log_root`: where a process without an explicit log directory keeps its logs."""

    name = "process"
    proc: subprocess.Popen | None = None
    log_root = Path(tempfile.gettempdir()) / "idemkit-logs"

    def _log_dir(self, log_dir: Path | None) -> Path:
        return log_dir or fresh_log_dir(self.name, self.log_root)

    def failure_report(self) -> str:
        raise NotImplementedError

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (all threads), from /proc/<pid>/stat."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields[0] is field 3 (state): utime is field 14, stime field 15.
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def cpu_ns(self) -> int:
        """The process's run time so far in ns (`cpu_ns`)."""
        assert self.proc is not None
        return cpu_ns(self.proc.pid)

    def _register(self) -> None:
        LIVE.append(self)

    def _unregister(self) -> None:
        with contextlib.suppress(ValueError):
            LIVE.remove(self)

    def _terminate(self, grace: float = 5.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._unregister()
        return proc.returncode


class Upstream(Process):
    """demo/orders_upstream.py as a subprocess on a free port (or on `port`). A subclass may run
    another upstream through `script`: one that takes --host and --port, prints
    "... listening on http://HOST:PORT" first and answers GET /_admin/health (tests/sdk's fake
    Stripe API)."""

    script: Path = UPSTREAM_SCRIPT

    def __init__(self, name: str = "upstream", log_dir: Path | None = None, port: int = 0) -> None:
        self.name = name
        self.log_dir = self._log_dir(log_dir)
        self.stdout_path = self.log_dir / "upstream.stdout"
        self.stderr_path = self.log_dir / "upstream.stderr"
        self.requested_port = port
        self.port = 0

    def start(self, timeout: float = 10.0) -> "Upstream":
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", str(self.script), "--host", "127.0.0.1",
                 "--port", str(self.requested_port)],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
            )
        self._register()

        def bound_port():
            if self.proc.poll() is not None:
                raise Fatal("upstream exited with %s" % self.proc.returncode)
            m = re.search(rb"listening on http://[^:]+:(\d+)", self.stdout_path.read_bytes())
            return int(m.group(1)) if m else 0

        try:
            self.port = wait_until(bound_port, timeout, what="the upstream to bind")
            wait_until(lambda: self._get("/_admin/health").status == 200, timeout,
                       what="upstream /_admin/health")
        except Exception:
            self.stop()
            raise RuntimeError("upstream did not start:\n" + self.failure_report())
        return self

    def _get(self, path: str, method: str = "GET") -> Response:
        return request(self.port, method, path, timeout=5)

    def executions(self, key: str | None = None):
        """Executions of `key` (int), or without a key the whole {"total", "by_key", ...}."""
        if key is None:
            return self._get("/_admin/executions").json()
        q = urllib.parse.quote(key, safe="", encoding="latin-1")
        return self._get("/_admin/executions?key=" + q).json()["count"]

    def committed(self, key: str) -> int:
        """Executions of `key` that committed an answer (reached the point of sending it)."""
        q = urllib.parse.quote(key, safe="", encoding="latin-1")
        return self._get("/_admin/committed?key=" + q).json()["count"]

    def lookups(self, key: str) -> int:
        """Lookups of `key` (`GET /_lookup/<key>`, what a rule's `reconcile` asks)."""
        q = urllib.parse.quote(key, safe="", encoding="latin-1")
        return self._get("/_admin/lookups?key=" + q).json()["count"]

    def fail_lookups(self, count: int, status: int = 500) -> None:
        """The next `count` lookups answer `status`."""
        assert self._get("/_admin/lookup-fail?count=%d&status=%d" % (count, status), "POST").status == 200

    def lookup_while_running(self, status: int) -> None:
        """What a lookup answers while an execution of its key runs (202; 404 is the broken
        lookup that lets a retry execute beside it)."""
        assert self._get("/_admin/lookup-while-running?status=%d" % status, "POST").status == 200

    def path_executions(self, path: str) -> int:
        q = urllib.parse.quote(path, safe="", encoding="latin-1")
        return self._get("/_admin/executions?path=" + q).json()["count"]

    def total(self) -> int:
        return self.executions()["total"]

    def requests(self, key: str | None = None) -> list[dict]:
        if key is None:
            return self._get("/_admin/requests").json()
        q = urllib.parse.quote(key, safe="", encoding="latin-1")
        return self._get("/_admin/requests?key=" + q).json()

    def reset(self) -> None:
        assert self._get("/_admin/reset", "POST").status == 200

    def stderr_text(self) -> str:
        return self.stderr_path.read_text("utf-8", "replace") if self.stderr_path.exists() else ""

    def failure_report(self) -> str:
        rc = self.proc.poll() if self.proc else None
        return "upstream port=%s running=%s\n--- %s (tail) ---\n%s" % (
            self.port,
            rc is None,
            self.stderr_path,
            tail(self.stderr_path, 100),
        )

    def stop(self) -> None:
        self._terminate(grace=3)
