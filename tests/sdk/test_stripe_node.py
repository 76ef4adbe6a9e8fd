"""stripe-node (npm `stripe`, pinned in tests/sdk/node/package.json and its package-lock.json,
installed by `npm ci` in `make sdk-test`) through a real Envoy and the real filter, in front of
the fake Stripe API (fake_stripe.py). node/create.mjs makes one create call with the SDK's own
HTTP client, timeout and retry loop and prints what the SDK got; this module holds that against
the upstream's executions and Envoy's access log (wire.py).

stripe-node keys every v1 POST `stripe-node-retry-<uuid>` (a bare key, which the filter accepts
as such) and retries a timeout, a 409 and a 5xx with it (RequestSender._shouldRetry) after 0.5 s,
then 0.5-1 s, 1-2 s, ... (_getSleepTimeInMS); it ignores retry-after. The pin is the newest
22.x, which runs on Node.js 18 (Debian 12's nodejs, what .ci/run installs where Node.js is
missing); 23.x needs Node.js 20 and retries the same way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import wire


NODE_DIR = Path(__file__).resolve().parent / "node"
TIMEOUT_MS = 1000
MAX_RETRIES = 5


def pinned_version() -> str:
    return json.loads((NODE_DIR / "package.json").read_text())["dependencies"]["stripe"]


@pytest.fixture(scope="module")
def node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node not found: install Node.js (Debian: apt-get install nodejs npm)",
                    pytrace=False)
    installed = NODE_DIR / "node_modules" / "stripe" / "package.json"
    if not installed.is_file():
        pytest.fail("stripe-node is not installed: `make sdk-test` (npm ci in %s)" % NODE_DIR,
                    pytrace=False)
    version = json.loads(installed.read_text())["version"]
    if version != pinned_version():
        pytest.fail("stripe-node %s installed, %s pinned: `make sdk-test` runs npm ci"
                    % (version, pinned_version()), pytrace=False)
    return node


def create(node: str, port: int, resource: str, sleep_ms: int) -> dict:
    """node/create.mjs: one `stripe.<resource>.create(...)`; what the SDK got."""
    proc = subprocess.run(
        [node, "create.mjs", str(port), resource, str(sleep_ms), str(TIMEOUT_MS), str(MAX_RETRIES)],
        cwd=NODE_DIR, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, "create.mjs failed:\n%s\n%s" % (proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def check_sdk_key(result: dict, attempts: list[dict]) -> str:
    """Every attempt the SDK made carried its one generated key, in its own bare form."""
    key = result["idempotency_key"]
    assert key.startswith("stripe-node-retry-"), key
    assert [a["key"] for a in result["attempts"]] == [key] * len(result["attempts"])
    assert len(attempts) == len(result["attempts"]), (result["attempts"], attempts)
    assert all("NodeBindings/%s" % pinned_version() in a["user_agent"] for a in attempts)
    return key


def test_timeout_then_409_then_replay(node, envoy, fake_stripe):
    """C10, C9: /v1/customers (`concurrent: reject`): the upstream takes 2.5 s, the SDK's timeout is 1 s.
    The SDK's retries get 409 request-in-flight until the original's answer is stored, then
    its replay: the customer of the one execution, parsed by the SDK."""
    total = fake_stripe.total()
    before = envoy.filter_counters()
    result = create(node, envoy.port, "customers", 2500)
    customer = result["object"]
    assert result["sdk_version"] == pinned_version()
    assert customer["object"] == "customer" and customer["email"] == "node@example.com"
    assert result["status"] == 200 and result["headers"]["idempotent-replayed"] == "true"
    assert result["request_id"] == "req_fake%06d" % (total + 1)

    key = fake_stripe.key_of(customer["id"])
    assert key == result["idempotency_key"]
    wire.check_one_execution(fake_stripe, customer["id"], key, total)
    envoy.wait_idle()
    attempts = envoy.attempts(key, len(result["attempts"]))
    check_sdk_key(result, attempts)
    wire.check_reject_route(attempts, key, TIMEOUT_MS,
                            wire.counter_delta(before, envoy.filter_counters(), "stripe_customers"))


def test_timeout_then_held_then_replay(node, envoy, fake_stripe):
    """C11: /v1/payment_intents (`concurrent: wait`): the upstream takes 2 s, the SDK's timeout is
    1 s. Its retry at 1.5 s is held by the filter until the original's answer and gets its
    replay: one retry, no 409, the payment intent of the one execution."""
    total = fake_stripe.total()
    before = envoy.filter_counters()
    result = create(node, envoy.port, "paymentIntents", 2000)
    intent = result["object"]
    assert intent["object"] == "payment_intent" and intent["amount"] == "4200"
    assert result["status"] == 200 and result["headers"]["idempotent-replayed"] == "true"
    assert 1900 <= result["elapsed_ms"] < 2500, result["elapsed_ms"]

    key = fake_stripe.key_of(intent["id"])
    assert key == result["idempotency_key"]
    wire.check_one_execution(fake_stripe, intent["id"], key, total)
    envoy.wait_idle()
    attempts = envoy.attempts(key, 2)
    check_sdk_key(result, attempts)
    wire.check_wait_route(attempts, key, TIMEOUT_MS,
                          wire.counter_delta(before, envoy.filter_counters(), "stripe_v1"))
