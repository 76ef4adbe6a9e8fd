"""etcd for the tests: `Etcd`, one member (or a member of an `EtcdCluster`) on free loopback
ports with a temporary data directory (on tmpfs unless `durable`), removed when it stops;
`DelayProxy`, a TCP proxy in front of etcd that holds each answer back for a while (an etcd
slower than the filter's timeout). The binary is Debian's etcd-server (`make etcd` installs
it); a missing binary fails, it never skips.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from idemkit.client import request
from idemkit.process import Fatal, Process, free_port, tail, wait_until


def etcd_binary() -> Path:
    """The etcd binary: ETCD_BIN, else `etcd` on PATH."""
    raw = os.environ.get("ETCD_BIN") or shutil.which("etcd")
    if not raw or not os.access(raw, os.X_OK):
        raise RuntimeError("etcd not found (ETCD_BIN, PATH): run `make etcd` (apt-get install etcd-server)")
    return Path(raw)


class Etcd(Process):
    """One etcd member on 127.0.0.1. Alone (`peers` None) it is a cluster of one; in an
    `EtcdCluster` every member is told about the others."""

    def __init__(self, name: str = "etcd", log_dir: Path | None = None,
                 client_port: int | None = None, peer_port: int | None = None,
                 extra_args: list[str] | None = None, binary: Path | str | None = None,
                 durable: bool = False) -> None:
        self.name = name
        # Data on disk (True: the benchmarks, where etcd's fsync is part of the cost measured) or
        # on tmpfs where the machine has one (tests: a slow disk's fsync, seconds on CI, would
        # turn into the store's timeouts, and no test depends on etcd's durability).
        self.durable = durable
        # Another etcd than ETCD_BIN / PATH's (e.g. the current release next to Debian's).
        self.binary = binary
        # More etcd flags (e.g. `--auth-token jwt,...`).
        self.extra_args = list(extra_args or [])
        self.log_dir = self._log_dir(log_dir)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.data_dir: Path | None = None
        self.log_path = self.log_dir / ("%s.log" % name)

    @property
    def peer_url(self) -> str:
        return "http://127.0.0.1:%d" % self.peer_port

    @property
    def client_url(self) -> str:
        return "http://127.0.0.1:%d" % self.client_port

    def spawn(self, initial_cluster: str | None = None, state: str = "new") -> "Etcd":
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="idemkit-etcd-", dir=self._data_root()))
        cmd = [
            str(self.binary or etcd_binary()),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster or "%s=%s" % (self.name, self.peer_url),
            "--initial-cluster-state", state,
            "--initial-cluster-token", "idemkit",
            # Quick elections: the leader-loss test waits for one.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
        ] + self.extra_args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self._register()
        return self

    def _data_root(self) -> str | None:
        shm = "/dev/shm"
        if not self.durable and os.path.isdir(shm) and os.access(shm, os.W_OK):
            return shm
        return None  # the temporary directory

    def start(self, timeout: float = 20.0) -> "Etcd":
        self.spawn()
        try:
            self.wait_ready(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        def healthy():
            if self.proc is None or self.proc.poll() is not None:
                raise Fatal("etcd exited:\n" + tail(self.log_path, 40))
            return self.healthy()

        wait_until(healthy, timeout, interval=0.05, what="etcd %s /health" % self.name)

    def healthy(self) -> bool:
        try:
            resp = request(self.client_port, "GET", "/health", timeout=2)
        except OSError:
            return False
        return resp.status == 200 and json.loads(resp.body).get("health") == "true"

    def post(self, path: str, doc: dict, timeout: float = 5.0, token: str | None = None) -> dict:
        """One gateway call (`token`: sent as `authorization`, once auth is on); must be a 200."""
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = token
        resp = request(self.client_port, "POST", path, body=json.dumps(doc).encode(),
                       headers=headers, timeout=timeout)
        assert resp.status == 200, resp
        return json.loads(resp.body)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` in etcd's /metrics whose labels include `labels`."""
        resp = request(self.client_port, "GET", "/metrics", timeout=5)
        assert resp.status == 200, resp
        total = 0.0
        wanted = ['%s="%s"' % kv for kv in labels.items()]
        for line in resp.body.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, _, value = line.rpartition(" ")
                if all(w in head for w in wanted):
                    total += float(value)
        return total

    def keys(self, prefix: str) -> list[str]:
        """Every key under `prefix` (decoded)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        doc = self.post("/v3/kv/range", {
            "key": base64.b64encode(prefix.encode()).decode(),
            "range_end": base64.b64encode(end.encode()).decode(),
            "keys_only": True,
        })
        return [base64.b64decode(kv["key"]).decode("latin-1") for kv in doc.get("kvs", [])]

    def status(self) -> dict:
        return self.post("/v3/maintenance/status", {})

    def stop(self, remove_data: bool = True) -> int | None:
        rc = self._terminate(grace=5)
        if remove_data and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None
        return rc

    def kill(self) -> None:
        """SIGKILL, data kept (a crash; `spawn(..., state="existing")` brings it back)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._unregister()

    def failure_report(self) -> str:
        rc = self.proc.poll() if self.proc else None
        return "etcd %s client=%d running=%s\n--- %s (tail) ---\n%s" % (
            self.name, self.client_port, rc is None, self.log_path, tail(self.log_path, 60))


class EtcdCluster:
    """`size` etcd members on loopback that form one cluster."""

    def __init__(self, size: int = 3, name: str = "etcd") -> None:
        self.members = [Etcd("%s%d" % (name, i)) for i in range(size)]

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        initial = ",".join("%s=%s" % (m.name, m.peer_url) for m in self.members)
        try:
            for m in self.members:
                m.spawn(initial)
            for m in self.members:
                m.wait_ready(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def leader(self) -> Etcd:
        def find():
            for m in self.members:
                if m.proc is None or m.proc.poll() is not None:
                    continue
                try:
                    st = m.status()
                except (OSError, AssertionError):
                    continue
                if st.get("leader") and st["leader"] == st.get("header", {}).get("member_id"):
                    return m
            return None

        return wait_until(find, 15, interval=0.1, what="an etcd leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 to `target_port` that holds every chunk of the answer back
    `delay` seconds (0: pass-through). `cut` makes etcd unreachable through it (nothing sent
    reaches etcd) until `mend`. A thread per connection; `close` stops everything."""

    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._track(client)
            self._track(upstream)
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, None), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delay: float | None) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                wait = self.delay if delay is None else delay
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """A network cut between the Envoy and etcd: every connection dropped, new ones closed
        at once, so no request reaches etcd (unlike a delay, which holds back only answers)."""
        self._cut.set()
        self.drop_connections()

    def mend(self) -> None:
        self._cut.clear()

    def drop_connections(self) -> None:
        """Cuts every connection made so far (as a crashed etcd or a network cut does); new
        ones are still accepted."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass
