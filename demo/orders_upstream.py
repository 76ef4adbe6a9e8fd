#!/usr/bin/env python3
"""A tiny "orders" API that counts how often it really executes a request.

It is the upstream behind Envoy in the demo (`make run`) and in the end-to-end tests
(tests/e2e): the idempotency filter is correct when a retried request does NOT reach it again.
Standard library only.

Every request whose path is not under /_admin/ is an *execution*: it increments a global counter
and a per-key counter (key = raw value of the incoming `idempotency-key` header, "" if none) and
is remembered (method, path, sha256 of the body). Default answer: 201 with

    {"order_id": <execution number>, "path": ..., "method": ..., "received_bytes": <body length>}

and headers content-type: application/json, x-execution: <n>, set-cookie: session=<n>.
A HEAD request gets the headers of that answer (content-length included) without the body; a
204 or 304 gets its headers without content-length or body.

Test knobs (request headers, all optional):
    x-delay-ms: N            sleep N ms before answering (the execution is counted at once)
    x-status: NNN            answer with that status instead of 201
    x-fail-first: NNN        answer the key's first execution with that status, later ones normally
    x-response-bytes: N      a body of exactly N bytes (see response_body())
    x-trailers: 1            chunked answer in several chunks with a trailer x-checksum
    x-chunked: 1             chunked answer without trailers
    x-reset: before-headers  read the request, then drop the connection without answering
    x-reset: mid-body        send the headers (with content-length) and half the body, then drop
    x-body-pause-ms: N       send the headers (with content-length) and half the body, pause N ms,
                             then the rest (a response Envoy has only in part for a while)
    x-content-type: VALUE    answer with content-type VALUE instead of the default
    x-no-content-type: 1     answer without a content-type header

Lookup by key (not an execution), what a `routes[].reconcile` of the filter asks:
    GET  /_lookup/<key>                the key's first committed answer (its status, content-type,
                                       x-execution and body); 202 {"status": "processing"} while an
                                       execution of the key is still running and none committed
                                       (docs/CONTRACT.md asks upstream authors for exactly this: a
                                       404 then would let a retry execute beside it); 404 only if
                                       no execution of the key committed one and none is running.
                                       An execution commits its answer when it is about to send
                                       it: after x-delay-ms, never with x-reset: before-headers
                                       (read, then dropped uncommitted).

Admin endpoints (not executions):
    GET  /_admin/executions            {"total": n, "by_key": {key: count}, "by_path": {path: count}}
    GET  /_admin/executions?key=K      {"key": K, "count": c}
    GET  /_admin/committed?key=K       {"key": K, "count": executions of K that committed an
                                        answer (see /_lookup/)}
    GET  /_admin/executions?path=P     {"path": P, "count": c}
    GET  /_admin/requests[?key=K]      [{"n", "method", "path", "key", "body_sha256", "received_bytes",
                                        "headers": [[lowercase name, value], ...]}]
    POST /_admin/reset                 zero everything
    POST /_admin/lookup-fail?count=N[&status=S]
                                       the next N lookups answer S (default 500)
    POST /_admin/lookup-while-running?status=S
                                       what a lookup answers while an execution of its key runs
                                       (default 202; 404 makes the broken lookup the filter must
                                       survive: tests/e2e/contract/test_claim_renewal.py)
    GET  /_admin/lookups[?key=K]       {"total": n, "by_key": {key: count}} or {"key": K, "count": c}
    GET  /_admin/health                200

Keys and paths in queries are percent-encoded latin-1 (header values are latin-1 on the wire).

    python3 demo/orders_upstream.py [--host 127.0.0.1] [--port 8080] [--verbose]

--port 0 binds a free port; the first line on stdout always names the bound address:
    orders_upstream listening on http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.server
import json
import socket
import struct
import sys
import threading
import time
import urllib.parse

KEY_HEADER = "idempotency-key"
_PATTERN = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-\n"
_MAX_REMEMBERED = 20000


def response_body(execution: int, size: int) -> bytes:
    """The deterministic body of `x-response-bytes: size` for execution number `execution`."""
    head = b"execution=%d;" % execution
    if size <= 0:
        return b""
    reps = size // len(_PATTERN) + 2
    return (head + _PATTERN * reps)[:size]


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.by_key: dict[str, int] = collections.Counter()
        self.by_path: dict[str, int] = collections.Counter()
        self.requests: collections.deque = collections.deque(maxlen=_MAX_REMEMBERED)
        # key -> (status, headers, body) of its first committed answer
        self.answers: dict[str, tuple[int, list[tuple[str, str]], bytes]] = {}
        self.lookups: dict[str, int] = collections.Counter()
        self.committed: dict[str, int] = collections.Counter()
        # key -> executions of it under way (started, not yet answered or dropped)
        self.running: dict[str, int] = collections.Counter()
        self.lookup_fail = (0, 500)
        self.while_running = 202

    def commit(self, key: str, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        with self.lock:
            self.committed[key] += 1
            self.answers.setdefault(key, (status, list(headers), body))

    def record(self, method: str, path: str, key: str, body: bytes,
               headers: list[tuple[str, str]] | None = None) -> int:
        with self.lock:
            self.total += 1
            n = self.total
            self.by_key[key] += 1
            self.by_path[path.split("?", 1)[0]] += 1
            self.requests.append(
                {
                    "n": n,
                    "method": method,
                    "path": path,
                    "key": key,
                    "body_sha256": hashlib.sha256(body).hexdigest(),
                    "received_bytes": len(body),
                    "headers": [[k.lower(), v] for k, v in (headers or [])],
                }
            )
            return n


STATE = State()


class _Drop(Exception):
    """Abort the connection without a (complete) answer."""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "orders-upstream/1"
    verbose = False

    # ---- plumbing -------------------------------------------------------------------------

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        if self.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), format % args))

    def _read_body(self) -> bytes:
        te = (self.headers.get("transfer-encoding") or "").lower()
        if "chunked" in te:
            chunks = []
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise _Drop("eof in chunk size")
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    # trailers, up to the empty line
                    while True:
                        t = self.rfile.readline(65537)
                        if t in (b"\r\n", b"\n", b""):
                            break
                    break
                data = self.rfile.read(size)
                if len(data) != size:
                    raise _Drop("eof in chunk")
                chunks.append(data)
                self.rfile.readline(3)  # CRLF after the chunk
            return b"".join(chunks)
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            raise _Drop("eof in body")
        return body

    def _abort(self) -> None:
        """Drop the connection with a TCP reset (SO_LINGER 0)."""
        try:
            self.wfile.flush()
        except OSError:
            pass
        try:
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        except OSError:
            pass
        self.close_connection = True
        raise _Drop("reset")

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if status in (204, 304) or 100 <= status < 200:
            self.end_headers()
            return
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        body = json.dumps(obj, sort_keys=True).encode()
        self._send(status, [("content-type", "application/json")], body)

    # ---- dispatch -------------------------------------------------------------------------

    def _handle(self) -> None:
        try:
            body = self._read_body()
            path = self.path
            if path.startswith("/_admin/"):
                self._admin(path, body)
            elif path.startswith("/_lookup/"):
                self._lookup(urllib.parse.unquote(path[len("/_lookup/"):].split("?", 1)[0], "latin-1"))
            else:
                self._execute(path, body)
        except _Drop:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle

    def _admin(self, path: str, body: bytes) -> None:
        url = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True, encoding="latin-1")
        if url.path == "/_admin/health":
            self._json(200, {"ok": True})
        elif url.path == "/_admin/reset" and self.command == "POST":
            with STATE.lock:
                STATE.reset()
            self._json(200, {"reset": True})
        elif url.path == "/_admin/executions":
            with STATE.lock:
                if "key" in query:
                    key = query["key"][0]
                    self._json(200, {"key": key, "count": STATE.by_key.get(key, 0)})
                elif "path" in query:
                    p = query["path"][0]
                    self._json(200, {"path": p, "count": STATE.by_path.get(p, 0)})
                else:
                    self._json(
                        200,
                        {
                            "total": STATE.total,
                            "by_key": dict(STATE.by_key),
                            "by_path": dict(STATE.by_path),
                        },
                    )
        elif url.path == "/_admin/lookup-fail" and self.command == "POST":
            count = int(query.get("count", ["1"])[0])
            status = int(query.get("status", ["500"])[0])
            with STATE.lock:
                STATE.lookup_fail = (count, status)
            self._json(200, {"count": count, "status": status})
        elif url.path == "/_admin/lookup-while-running" and self.command == "POST":
            status = int(query.get("status", ["202"])[0])
            with STATE.lock:
                STATE.while_running = status
            self._json(200, {"status": status})
        elif url.path == "/_admin/committed":
            key = query.get("key", [""])[0]
            with STATE.lock:
                self._json(200, {"key": key, "count": STATE.committed.get(key, 0)})
        elif url.path == "/_admin/lookups":
            with STATE.lock:
                if "key" in query:
                    key = query["key"][0]
                    self._json(200, {"key": key, "count": STATE.lookups.get(key, 0)})
                else:
                    self._json(200, {"total": sum(STATE.lookups.values()), "by_key": dict(STATE.lookups)})
        elif url.path == "/_admin/requests":
            with STATE.lock:
                reqs = list(STATE.requests)
            if "key" in query:
                reqs = [r for r in reqs if r["key"] == query["key"][0]]
            self._json(200, reqs)
        else:
            self._json(404, {"error": "unknown admin endpoint"})

    def _lookup(self, key: str) -> None:
        with STATE.lock:
            STATE.lookups[key] += 1
            failing, fail_status = STATE.lookup_fail
            if failing > 0:
                STATE.lookup_fail = (failing - 1, fail_status)
            answer = STATE.answers.get(key)
            running, while_running = STATE.running.get(key, 0), STATE.while_running
        if failing > 0:
            self._json(fail_status, {"error": "lookup failing on purpose"})
        elif answer is None and running > 0:
            # Not final: the filter keeps the record as it is and asks again later.
            self._json(while_running, {"status": "processing", "key": key})
        elif answer is None:
            self._json(404, {"error": "no execution of this key committed an answer", "key": key})
        else:
            status, headers, payload = answer
            kept = [(n, v) for n, v in headers if n in ("content-type", "x-execution")]
            self._send(status, kept, payload)

    def _execute(self, path: str, body: bytes) -> None:
        keys = self.headers.get_all(KEY_HEADER) or []
        key = ", ".join(keys)
        n = STATE.record(self.command, path, key, body, list(self.headers.items()))
        with STATE.lock:
            STATE.running[key] += 1
        try:
            self._execution(n, key, path, body)
        finally:
            with STATE.lock:
                STATE.running[key] -= 1

    def _execution(self, n: int, key: str, path: str, body: bytes) -> None:
        with STATE.lock:
            first_of_key = STATE.by_key[key] == 1

        delay_ms = int(self.headers.get("x-delay-ms") or 0)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)

        reset = (self.headers.get("x-reset") or "").strip().lower()
        if reset == "before-headers":
            self._abort()

        status = int(self.headers.get("x-status") or 201)
        if first_of_key and self.headers.get("x-fail-first"):
            status = int(self.headers.get("x-fail-first"))
        headers = [("x-execution", str(n)), ("set-cookie", "session=%d" % n)]
        size_hdr = self.headers.get("x-response-bytes")
        if size_hdr is not None:
            payload = response_body(n, int(size_hdr))
            headers.insert(0, ("content-type", "application/octet-stream"))
        else:
            payload = json.dumps(
                {
                    "order_id": n,
                    "path": path,
                    "method": self.command,
                    "received_bytes": len(body),
                },
                sort_keys=True,
            ).encode()
            headers.insert(0, ("content-type", "application/json"))
        if self.headers.get("x-no-content-type") == "1":
            headers = [h for h in headers if h[0] != "content-type"]
        elif self.headers.get("x-content-type") is not None:
            headers[0] = ("content-type", self.headers.get("x-content-type"))
        STATE.commit(key, status, headers, payload)

        if reset == "mid-body":
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload[: len(payload) // 2])
            self._abort()

        pause_ms = int(self.headers.get("x-body-pause-ms") or 0)
        if pause_ms > 0 and status not in (204, 304) and status >= 200:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            half = len(payload) // 2
            self.wfile.write(payload[:half])
            self.wfile.flush()
            time.sleep(pause_ms / 1000.0)
            self.wfile.write(payload[half:])
            return

        trailers = self.headers.get("x-trailers") == "1"
        chunked = trailers or self.headers.get("x-chunked") == "1"
        if chunked and status not in (204, 304) and status >= 200:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("transfer-encoding", "chunked")
            if trailers:
                self.send_header("trailer", "x-checksum")
            self.end_headers()
            step = max(1, len(payload) // 3 + 1)
            for i in range(0, len(payload), step):
                piece = payload[i : i + step]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n")
            if trailers:
                digest = hashlib.sha256(payload).hexdigest()
                self.wfile.write(b"x-checksum: sha256=%s\r\n" % digest.encode())
            self.wfile.write(b"\r\n")
            return

        self._send(status, headers, payload)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, _Drop)):
            return
        super().handle_error(request, client_address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)

    Handler.verbose = args.verbose
    server = Server((args.host, args.port), Handler)
    host, port = server.server_address[:2]
    print("orders_upstream listening on http://%s:%d" % (host, port), flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
