"""A request's outcome on its trace span (`publish_outcome`; no contract row: an operations
promise, issue 22 item 11).

Envoy's `tracing.custom_tags` read the filter state the filter publishes, so the span of every
protected request says how it ended and which record it touched, as the access log does
(test_access_log.py): a new key `stored`, its retry `replayed` under the same record tag, another
body `mismatch`. Checked with Envoy's own Zipkin tracer, sending its spans (JSON v2) to a
collector this module runs on loopback.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import harness

TAG = "idempotency.outcome"


class Collector(ThreadingHTTPServer):
    """A Zipkin collector: keeps every span POSTed to /api/v2/spans."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def tags_of(self, key: str) -> list[str | None]:
        """The outcome tag of each span of a request with idempotency key `key`, in start order."""
        with self.lock:
            spans = [s for s in self.spans if (s.get("tags") or {}).get("key") == key]
        return [s["tags"].get(TAG) for s in sorted(spans, key=lambda s: s.get("timestamp", 0))]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            body = b""
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()  # the blank line after the last chunk
        else:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
        server = self.server
        assert isinstance(server, Collector)
        if self.path == "/api/v2/spans":
            with server.lock:
                server.spans.extend(json.loads(body))
        self.send_response(202)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


COLLECTOR = Collector()
FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "publish_outcome": True,
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}
ENVOY_OPTIONS = {
    "tracing": harness.zipkin_tracing("zipkin", [
        {"tag": TAG, "value": "%FILTER_STATE(wasm.idempotency.outcome:PLAIN)%"},
        {"tag": "key", "request_header": {"name": "idempotency-key"}},
    ]),
    "extra_clusters": [harness.cluster("zipkin", COLLECTOR.server_address[1])],
}


def traced(key: str, count: int) -> list[str | None]:
    """The outcome tags of `key`'s spans once `count` have arrived (Envoy's Zipkin tracer sends
    its spans in batches of 5 or every 5 s)."""
    deadline = time.monotonic() + 15
    while True:
        tags = COLLECTOR.tags_of(key)
        if len(tags) >= count or time.monotonic() > deadline:
            return tags
        time.sleep(0.2)


def test_a_new_key_its_replay_and_a_mismatch_tag_their_spans_with_the_outcome_and_one_record(envoy, upstream):
    key = harness.new_key_replay_and_mismatch(envoy)
    tags = traced(key, 3)
    assert len(tags) == 3, tags
    harness.assert_published_under_one_record(tags, ["stored", "replayed", "mismatch"])
