"""C27: behind an Envoy whose bootstrap sets `header_prefix`, the filter knows Envoy's headers by
the prefix its `envoy_header_prefix` names.

Envoy's bootstrap `header_prefix: x-acme` renames every header its router reads or writes:
it marks an upstream answer with `x-acme-upstream-service-time`, and obeys a trusted caller's
`x-acme-retry-on`. Before issue 45 the filter knew only the `x-envoy-*` names, so (both seen on
this module's Envoy then):
- every detached call's answer was taken for Envoy's own reply: 502 `outcome-unknown` for a 201
  the upstream sent, never stored;
- a trusted caller's `x-acme-retry-on: 5xx` with `x-acme-max-retries: 3` made the router send a
  protected request four times to an upstream answering 503.
With `envoy_header_prefix: "x-acme"` a detached call is stored and replayed, and a protected
request goes upstream once, whatever the caller asks. An Envoy whose prefix differs from the
filter's configuration gets one error line naming `envoy_header_prefix` (per worker; this
module's misconfigured Envoy runs one), not one per request.

The listener trusts its callers (`use_remote_address` with an `internal_address_config` that
covers 127.0.0.1), as in test_router_controls.py, so that Envoy keeps their control headers.
"""

from __future__ import annotations

import re

import harness
from harness import assert_problem, key_headers, new_key

PREFIX = "x-acme"


def _routes() -> list:
    return [
        harness.detached_rule("pay", "/pay", 3, 2),
        {"name": "inl", "match": {"prefix": "/inl"}, "require_key": True},
    ]


FILTER_CONFIG = {
    "store": {"type": "local", "capacity": 1000},
    "envoy_header_prefix": PREFIX,
    "routes": _routes(),
}
ENVOY_OPTIONS = {"concurrency": 2, "hcm_options": harness.internal_callers(), "header_prefix": PREFIX}

BODY = b'{"amount":4200,"currency":"EUR"}'
# a line the filter logged at error level, not Envoy echoing anything
_FILTER_ERROR = re.compile(r"\]\[(error|critical)\]\[wasm\].*wasm log")


def _post(envoy, path, key, **extra):
    return envoy.post(path, BODY, key_headers(key, **extra), timeout=15)


def _prefix_errors(envoy) -> list[str]:
    return [line for line in envoy.log_text().splitlines()
            if _FILTER_ERROR.search(line) and "envoy_header_prefix" in line]


def test_envoy_uses_the_prefix_and_trusts_the_caller(envoy, upstream):
    """The premise: on a route the filter does not protect, Envoy's router obeys the caller's
    `x-acme-retry-on` (503, retried: two executions) and marks the answer with its prefix."""
    key = new_key()
    resp = envoy.post("/open", BODY, key_headers(key, **{"x-fail-first": "503", PREFIX + "-retry-on": "5xx"}))
    assert resp.status == 201, resp
    assert upstream.executions(key) == 2
    assert resp.header(PREFIX + "-upstream-service-time") is not None, resp
    assert resp.header("x-envoy-upstream-service-time") is None, resp


def test_a_detached_call_is_stored_and_replayed(envoy, upstream):
    key = new_key()
    first = _post(envoy, "/pay", key)
    assert first.status == 201 and not first.replayed, first
    retry = _post(envoy, "/pay", key)
    assert retry.status == 201 and retry.replayed and retry.body == first.body, retry
    assert upstream.executions(key) == 1


def test_a_caller_cannot_ask_the_router_for_retries_under_the_prefix(envoy, upstream):
    key = new_key()
    controls = {"x-status": "503", PREFIX + "-retry-on": "5xx", PREFIX + "-max-retries": "3"}
    first = _post(envoy, "/inl", key, **controls)
    assert first.status == 503, first
    assert upstream.executions(key) == 1
    (seen,) = upstream.requests(key)
    assert not any(n.startswith(PREFIX + "-retry") for n, _ in seen["headers"]), seen["headers"]


def test_a_caller_cannot_ask_a_detached_call_for_retries_under_the_prefix(envoy, upstream):
    key = new_key()
    controls = {"x-status": "503", PREFIX + "-retry-on": "5xx", PREFIX + "-max-retries": "3"}
    first = _post(envoy, "/pay", key, **controls)
    assert first.status == 503, first
    assert upstream.executions(key) == 1


def test_a_configured_prefix_logs_no_error(envoy):
    assert _prefix_errors(envoy) == []


def test_a_prefix_other_than_envoys_is_one_error_line(envoy_bin, filter_wasm, upstream):
    """The filter left at its default (`x-envoy`) behind the `x-acme` Envoy: a detached call's
    answer is taken for Envoy's own (502 `outcome-unknown`, the safe side: never executed
    again), an inline one is still captured (Envoy's details say it is the upstream's), and the
    filter says what is wrong in one error line naming `envoy_header_prefix` (one worker here),
    not one per request."""
    config = {"store": {"type": "local", "capacity": 1000}, "routes": _routes()}
    proxy = harness.Envoy(envoy_bin, upstream.port, config, wasm_path=filter_wasm,
                          name="header_prefix_mismatch", concurrency=1, header_prefix=PREFIX)
    try:
        proxy.start()
        for _ in range(2):
            key = new_key()
            assert_problem(_post(proxy, "/pay", key), 502, "outcome-unknown")
            assert upstream.executions(key) == 1
            key = new_key()
            assert _post(proxy, "/inl", key).status == 201
            replay = _post(proxy, "/inl", key)
            assert replay.status == 201 and replay.replayed, replay
        lines = _prefix_errors(proxy)
        assert len(lines) == 1, lines
        assert "x-acme-upstream-service-time" in lines[0] and "envoy_header_prefix" in lines[0], lines
    finally:
        proxy.stop()
