"""A request's outcome in the access log (`publish_outcome`; no contract row: an operations promise).

With `publish_outcome: true` the filter sets the filter state `wasm.idempotency.outcome` of every
protected request to `<outcome> <scope tag>` (the tag its own log lines use), rewritten at each
outcome counted while the stream is there, so the access log's
`%FILTER_STATE(wasm.idempotency.outcome:PLAIN)%` shows how the request ended: a new key
`stored`, its retry `replayed` under the same tag, another body `mismatch`, a request without
its key `missing_key -` (no record), traffic no rule protects `-` (nothing set, no host call).
Checked in a real Envoy's file access log.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import harness
from harness import key_headers, new_key

LOG_PATH = Path(harness.LOG_ROOT) / "test_access_log.access.log"
FORMAT = "%REQ(:PATH)% %REQ(IDEMPOTENCY-KEY)% %RESPONSE_CODE% idem=[%FILTER_STATE(wasm.idempotency.outcome:PLAIN)%]\n"

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "publish_outcome": True,
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}
LOG_PATH.parent.mkdir(parents=True, exist_ok=True)
LOG_PATH.unlink(missing_ok=True)
ENVOY_OPTIONS = {"access_log": [harness.text_file_access_log(LOG_PATH, FORMAT)]}

BODY = b'{"item":"book","qty":1}'
LINE = re.compile(r"^(\S+) (\S+) (\d+) idem=\[(.*)\]$")


def logged(path: str, key: str, count: int) -> list[tuple[str, str]]:
    """(status, published value) of the access log lines for `path` and `key`, once `count` are
    there (Envoy writes its access log asynchronously, flushed within a second)."""
    deadline = time.monotonic() + 5
    while True:
        lines = LOG_PATH.read_text().splitlines() if LOG_PATH.exists() else []
        found = [(m.group(3), m.group(4)) for m in map(LINE.match, lines)
                 if m and m.group(1) == path and m.group(2) == key]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_new_key_its_replay_and_a_mismatch_are_in_the_access_log_under_one_tag(envoy, upstream):
    key = harness.new_key_replay_and_mismatch(envoy)
    lines = logged("/orders", key, 3)
    assert [status for status, _ in lines] == ["201", "201", "422"], lines
    harness.assert_published_under_one_record([value for _, value in lines], ["stored", "replayed", "mismatch"])


def test_a_refusal_without_a_record_and_unprotected_traffic(envoy, upstream):
    missing = envoy.post("/orders", BODY, {"content-type": "application/json"})
    assert missing.status == 400
    assert logged("/orders", "-", 1)[-1] == ("400", "missing_key -")
    key = new_key()
    plain = envoy.post("/other", BODY, key_headers(key))
    assert plain.status == 201
    assert logged("/other", key, 1) == [("201", "-")]
