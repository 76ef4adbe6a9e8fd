"""A request held for its body that ends before any of it arrives is counted and explained.

The classic deployment mistake: the Wasm filter's config without
`allow_on_headers_stop_iteration: true` (set to false, or dropped: Istio 1.27 builds its
EnvoyFilter patches with a go-control-plane that lacks the field and drops it; Istio's WasmPlugin
cannot set it). Envoy then turns the filter's pause at the request headers into "stop
everything": the body never reaches the filter, the request hangs until the HCM's
`stream_idle_timeout` (2 s here) and the client gets Envoy's own 504. Nothing executes either
way; what the filter adds is that the operator can see why: the counter `body_never_received`
and, since Envoy did receive the body the filter never got, one error line per worker that names
the missing setting and the Istio floor (concurrency 1: "once" is checked on one worker).

The same counter moves, honestly, when a client sends its headers and leaves before its body
(the default fixture, with the setting right): Envoy received no body then, so that is a warning
(at most once a minute per worker) that only says what to suspect, never the error.
"""

from __future__ import annotations

import json
import re
import time

import pytest

import harness
from harness import key_headers, new_key
from idemkit.client import build_request, send_and_disconnect

FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}],
}
ENVOY_OPTIONS = {"concurrency": 1}

BODY = b'{"item":"book","qty":1}'
IDLE_TIMEOUT_S = 2
# a line the filter logged at warning level (or above), not Envoy echoing its config
_FILTER_WARNING = re.compile(r"\]\[(warning|error|critical)\]\[wasm\].*wasm log")
_FILTER_ERROR = re.compile(r"\]\[error\]\[wasm\].*wasm log")


def _lines(envoy, level=_FILTER_WARNING):
    return [l for l in envoy.log_text().splitlines()
            if level.search(l) and "allow_on_headers_stop_iteration" in l]


def _without_stop_iteration(envoy_bin, upstream, filter_wasm, how):
    """An Envoy whose Wasm filter config has `allow_on_headers_stop_iteration` set to false, or
    dropped (the field absent, as Istio 1.27 delivers an EnvoyFilter that sets it)."""
    proxy = harness.Envoy(envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm,
                          name="no-stop-iteration-" + how, concurrency=1)
    hcm = proxy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["stream_idle_timeout"] = "%ds" % IDLE_TIMEOUT_S
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "idempotency")
    if how == "dropped":
        del wasm["typed_config"]["config"]["allow_on_headers_stop_iteration"]
    else:
        wasm["typed_config"]["config"]["allow_on_headers_stop_iteration"] = False
    return proxy


@pytest.mark.parametrize("how", ["dropped", "false"])
def test_without_allow_on_headers_stop_iteration_requests_hang_and_the_filter_says_why(
        envoy_bin, upstream, filter_wasm, how):
    with _without_stop_iteration(envoy_bin, upstream, filter_wasm, how) as proxy:
        if how == "dropped":
            assert "allow_on_headers_stop_iteration" not in json.dumps(proxy.config)
        # A client that leaves before its body: Envoy got no body either, so no error (yet).
        head = build_request("POST", "/orders", dict(key_headers(new_key()), **{"content-length": str(len(BODY))}))
        send_and_disconnect(proxy.port, head)
        proxy.wait_counter("body_never_received", 1)
        assert _lines(proxy, _FILTER_ERROR) == [], proxy.log_text()
        keys = [new_key(), new_key()]
        for n, key in enumerate(keys, start=1):
            started = time.monotonic()
            resp = proxy.post("/orders", BODY, key_headers(key), timeout=IDLE_TIMEOUT_S + 10)
            waited = time.monotonic() - started
            # Envoy's stream timeout, not an answer of the filter's: the request hung.
            assert resp.status == 504, resp
            assert waited >= IDLE_TIMEOUT_S - 0.5, waited
            assert upstream.executions(key) == 0
            proxy.wait_counter("body_never_received", 1 + n)
            # The first body Envoy kept from the filter: one error line, and only one.
            errors = _lines(proxy, _FILTER_ERROR)
            assert len(errors) == 1, errors
        assert proxy.idem("claimed") == 0
        line = errors[0]
        for words in ("route rule orders", "%d bytes" % len(BODY), "stream_idle_timeout",
                      "lacks allow_on_headers_stop_iteration: true", "body_never_received",
                      "Istio >= 1.28", "once per worker"):
            assert words in line, (words, line)
        # With the client gone early, the warning of the ambiguous case came first; then only
        # the error: the lines that name the setting are exactly these two.
        lines = _lines(proxy)
        assert len(lines) == 2 and lines[1] == line and "[warning]" in lines[0], lines


def test_a_client_gone_before_its_body_is_counted_and_nothing_claimed(envoy, upstream):
    before = envoy.outcomes()
    key = new_key()
    # The headers announce a body; the client leaves before sending it.
    head = build_request("POST", "/orders", dict(key_headers(key), **{"content-length": str(len(BODY))}))
    send_and_disconnect(envoy.port, head)
    envoy.wait_counter("body_never_received", before["body_never_received"] + 1)
    envoy.wait_idle()
    after = envoy.outcomes()
    assert after["claimed"] == before["claimed"]
    assert upstream.executions(key) == 0
    # The key was never claimed: the same request, sent whole, executes once.
    resp = envoy.post("/orders", BODY, key_headers(key))
    assert resp.status == 201 and not resp.replayed, resp
    assert upstream.executions(key) == 1
    # Envoy received no body either: no error about the setting, which is right here.
    assert _lines(envoy, _FILTER_ERROR) == [], envoy.log_text()


def test_a_request_with_its_body_is_not_counted(envoy, upstream):
    before = envoy.outcomes()
    resp = envoy.post("/orders", BODY, key_headers(new_key()))
    assert resp.status == 201, resp
    envoy.wait_counter("stored", before["stored"] + 1)
    envoy.wait_idle()
    assert envoy.outcomes()["body_never_received"] == before["body_never_received"]
