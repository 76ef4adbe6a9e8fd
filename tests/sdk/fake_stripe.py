#!/usr/bin/env python3
"""A fake Stripe API for the SDK tests (tests/sdk): the upstream behind Envoy and the filter.

It answers what Stripe's SDKs send for a create call, `POST /v1/<resource>` with a form-encoded
body (`email=...&metadata[order]=42`), with the JSON object Stripe would return: 200,
{"id": "<prefix>_<execution>...", "object": <type>, "livemode": false, "created": ..., fields of
the form}, and a `request-id` header. Every such request is an *execution*, counted per
`idempotency-key` and remembered with the id it minted, so a test can tell whether the SDK's
retry reached it again (it must not: the filter answers retries).

The failure the SDKs must recover from is a slow first attempt: `metadata[sleep_ms]=N` makes the
execution sleep N ms before it answers (the execution is counted at once). With an SDK timeout
below N, the client gives up on an answer that the upstream did produce, and retries with the
same key. The answer is not lost: the filter stored it (a detached route carries the call
upstream on its own), so the retry gets it back.

Admin endpoints (not executions):
    GET  /_admin/executions            {"total": n, "by_key": {key: count}}
    GET  /_admin/executions?key=K      {"key": K, "count": c, "ids": [id of each execution]}
    GET  /_admin/objects?id=ID         {"id": ID, "key": the idempotency-key that created it}
    GET  /_admin/health                200

Standard library only.

    python3 tests/sdk/fake_stripe.py [--port 0]

The first line on stdout names the bound address: fake_stripe listening on http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading
import time
import urllib.parse

# /v1/<resource> -> (id prefix, "object" of the answer); other resources get "obj".
RESOURCES = {
    "customers": ("cus", "customer"),
    "payment_intents": ("pi", "payment_intent"),
    "charges": ("ch", "charge"),
    "refunds": ("re", "refund"),
}


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0
        self.by_key: dict[str, list[str]] = {}
        self.key_of: dict[str, str] = {}


STATE = State()


def form_to_object(pairs: list[tuple[str, str]]) -> dict:
    """`a=1&metadata[b]=2` -> {"a": "1", "metadata": {"b": "2"}} (one level of brackets, which
    is all the tests send)."""
    out: dict = {}
    for name, value in pairs:
        if "[" in name and name.endswith("]"):
            outer, inner = name[:-1].split("[", 1)
            out.setdefault(outer, {})[inner] = value
        else:
            out[name] = value
    return out


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-stripe"

    def log_message(self, fmt, *args):  # one line per request on stderr, for failure reports
        sys.stderr.write("%s %s\n" % (time.strftime("%H:%M:%S"), fmt % args))

    def _send(self, status: int, doc: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/_admin/health":
            return self._send(200, {"ok": True})
        if url.path == "/_admin/executions":
            with STATE.lock:
                if "key" in query:
                    ids = list(STATE.by_key.get(query["key"], []))
                    return self._send(200, {"key": query["key"], "count": len(ids), "ids": ids})
                return self._send(200, {"total": STATE.total,
                                        "by_key": {k: len(v) for k, v in STATE.by_key.items()}})
        if url.path == "/_admin/objects" and "id" in query:
            with STATE.lock:
                if query["id"] in STATE.key_of:
                    return self._send(200, {"id": query["id"], "key": STATE.key_of[query["id"]]})
        self._send(404, {"error": {"type": "invalid_request_error", "message": "no such path"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "v1":
            return self._send(404, {"error": {"type": "invalid_request_error",
                                              "message": "Unrecognized request URL"}})
        prefix, kind = RESOURCES.get(parts[1], ("obj", parts[1]))
        fields = form_to_object(urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True))
        key = self.headers.get("idempotency-key", "")
        with STATE.lock:
            STATE.total += 1
            n = STATE.total
            obj_id = "%s_%06dfake%08x" % (prefix, n, int(time.time() * 1000) & 0xFFFFFFFF)
            STATE.by_key.setdefault(key, []).append(obj_id)
            STATE.key_of[obj_id] = key
        sleep_ms = int(fields.get("metadata", {}).get("sleep_ms", "0") or 0)
        if sleep_ms:
            time.sleep(sleep_ms / 1000)
        doc = {"id": obj_id, "object": kind, "livemode": False, "created": int(time.time())}
        doc.update(fields)
        try:
            self._send(200, doc, {"request-id": "req_fake%06d" % n})
        except (BrokenPipeError, ConnectionResetError):
            pass  # whoever called went away: the execution happened all the same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print("fake_stripe listening on http://%s:%d" % (host, port), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
