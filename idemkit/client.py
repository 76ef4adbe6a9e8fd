"""The HTTP client of the kit: `request` (http.client, one fresh connection per request) and a raw
HTTP/1.1 client (`build_request`, `raw_exchange`, `raw_request`) for what http.client refuses to
send: non-ASCII or control bytes in headers, chunked bodies with trailers, repeated names. Plus
clients that go away in the middle of an exchange. Everything talks to 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import time
import uuid
from typing import Any, Iterable, Sequence

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a TCP reset


def new_key() -> str:
    """A fresh idempotency key: every test uses its own, so tests never see each other."""
    return str(uuid.uuid4())


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
        return next(iter(self.header_all(name)), None)

    def header_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.headers if k.lower() == name]

    def trailer(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.trailers if k.lower() == name), None)

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

