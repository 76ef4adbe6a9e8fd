"""stripe-python (PyPI `stripe`, pinned in tests/sdk/requirements.txt) through a real Envoy and
the real filter, in front of the fake Stripe API (fake_stripe.py).

stripe-python puts an Idempotency-Key on every POST and retries a timed-out or refused request,
a 409 and a 5xx with the same key (stripe/_http_client.py, `_should_retry`), after 0.5 s, then
0.5-1 s, 1-2 s, ... (`_sleep_time_seconds`); it ignores retry-after. The first attempt here
executes upstream but its answer comes after the SDK's 1 s timeout: the SDK's own retries must
get that one execution's object back, parsed, and never execute it again. What each attempt got
is read from Envoy's access log (wire.py).
"""

from __future__ import annotations

import time

import pytest
import stripe

import wire

TIMEOUT_S = 1.0
MAX_RETRIES = 5


class RecordingClient(stripe.RequestsClient):
    """stripe-python's default HTTP client (requests), unchanged, noting what each attempt of
    the SDK's retry loop got: a status, or the exception that made the SDK retry."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attempts: list[int | str] = []

    def request(self, method, url, headers, post_data=None, **kwargs):
        try:
            content, status, rheaders = super().request(method, url, headers, post_data, **kwargs)
        except stripe.APIConnectionError as exc:
            self.attempts.append(type(exc.__cause__).__name__)
            raise
        self.attempts.append(status)
        return content, status, rheaders


@pytest.fixture
def sdk(envoy):
    http = RecordingClient(timeout=TIMEOUT_S)
    client = stripe.StripeClient(
        "sk_test_fake",
        base_addresses={"api": "http://127.0.0.1:%d" % envoy.port},
        http_client=http,
        max_network_retries=MAX_RETRIES,
    )
    return client, http


def test_pinned_version():
    assert stripe.VERSION == "16.1.0"


def test_create_answered_by_the_upstream(sdk, envoy, fake_stripe):
    """Baseline: a create that answers in time is executed once and gets the upstream's answer
    (carried by the filter's detached call, not a replay), in one attempt."""
    client, http = sdk
    total = fake_stripe.total()
    customer = client.v1.customers.create({"email": "fast@example.com"})
    assert isinstance(customer, stripe.Customer) and customer.email == "fast@example.com"
    key = fake_stripe.key_of(customer.id)
    wire.check_one_execution(fake_stripe, customer.id, key, total)
    assert http.attempts == [200]
    assert "idempotent-replayed" not in customer.last_response.headers
    [attempt] = envoy.attempts(key, 1)
    assert attempt["status"] == 200 and attempt["details"] == "idempotency_detached", attempt
    assert attempt["replayed"] is None, attempt


def test_timeout_then_409_then_replay(sdk, envoy, fake_stripe):
    """C10, C9: /v1/customers (`concurrent: reject`): the upstream takes 2.5 s. The SDK gives up after
    1 s, retries at 1.5 s and gets 409 request-in-flight, retries the 409 after its backoff
    until the original's answer is stored, then gets its replay: the customer of the one
    execution."""
    client, http = sdk
    total = fake_stripe.total()
    before = envoy.filter_counters()
    customer = client.v1.customers.create(
        {"email": "jenny@example.com", "metadata": {"sleep_ms": "2500", "sdk": "stripe-python"}}
    )
    assert isinstance(customer, stripe.Customer)
    assert customer.email == "jenny@example.com" and customer.metadata["sdk"] == "stripe-python"
    assert customer.last_response.code == 200
    assert customer.last_response.headers["idempotent-replayed"] == "true"
    assert customer.last_response.request_id == "req_fake%06d" % (total + 1)

    key = fake_stripe.key_of(customer.id)
    wire.check_one_execution(fake_stripe, customer.id, key, total)
    envoy.wait_idle()
    attempts = envoy.attempts(key, len(http.attempts))
    conflicts = wire.check_reject_route(
        attempts, key, int(TIMEOUT_S * 1000),
        wire.counter_delta(before, envoy.filter_counters(), "stripe_customers"),
    )
    # The SDK's view of the same attempts: its read timed out, then 409s, then the 200.
    assert http.attempts == ["ReadTimeout"] + [409] * conflicts + [200]
    assert all("PythonBindings/16.1.0" in a["user_agent"] for a in attempts)


def test_timeout_then_held_then_replay(sdk, envoy, fake_stripe):
    """C11: /v1/payment_intents (`concurrent: wait`): the upstream takes 2 s. The SDK gives up after
    1 s; its retry at 1.5 s is held by the filter until the original's answer (about 0.5 s)
    and gets its replay: one retry, no 409, the payment intent of the one execution."""
    client, http = sdk
    total = fake_stripe.total()
    before = envoy.filter_counters()
    t0 = time.monotonic()
    intent = client.v1.payment_intents.create(
        {"amount": 4200, "currency": "eur", "metadata": {"sleep_ms": "2000", "sdk": "stripe-python"}}
    )
    elapsed = time.monotonic() - t0
    assert isinstance(intent, stripe.PaymentIntent)
    assert intent.amount == "4200" and intent.currency == "eur"
    assert intent.last_response.headers["idempotent-replayed"] == "true"
    assert 1.9 <= elapsed < 2.5, "answered when the original's answer came, %.2f s" % elapsed

    key = fake_stripe.key_of(intent.id)
    wire.check_one_execution(fake_stripe, intent.id, key, total)
    envoy.wait_idle()
    attempts = envoy.attempts(key, 2)
    wire.check_wait_route(attempts, key, int(TIMEOUT_S * 1000),
                          wire.counter_delta(before, envoy.filter_counters(), "stripe_v1"))
    assert http.attempts == ["ReadTimeout", 200]


def test_inline_route_loses_the_answer(sdk, envoy, fake_stripe):
    """C16, the contrast: /v1/refunds is inline (`unknown_outcome: refuse`). The SDK's timeout resets
    the upstream request with its stream, so the one execution's answer is lost: every retry
    gets 502 outcome-unknown (never a second execution), which the SDK retries as a 5xx until
    its retries run out, then raises. What a detached route avoids."""
    client, http = sdk
    total = fake_stripe.total()
    before = envoy.filter_counters()
    with pytest.raises(stripe.APIError) as raised:
        client.v1.refunds.create(
            {"charge": "ch_1", "metadata": {"sleep_ms": "1500", "sdk": "stripe-python"}},
            options={"max_network_retries": 2},
        )
    assert raised.value.http_status == 502
    assert http.attempts == ["ReadTimeout", 502, 502]

    assert fake_stripe.total() == total + 1, "executed once, never again"
    # The SDK raised, so the key is read from the upstream: the only one that created a refund.
    [key] = [k for k in fake_stripe.executions()["by_key"]
             if fake_stripe.execution_ids(k)[0].startswith("re_")]
    assert len(fake_stripe.execution_ids(key)) == 1
    envoy.wait_idle()
    attempts = envoy.attempts(key, 3)
    wire.check_first_attempt_abandoned(attempts[0], key, "/v1/refunds", int(TIMEOUT_S * 1000))
    for attempt in attempts[1:]:
        assert attempt["status"] == 502 and attempt["problem"] == wire.PROBLEM, attempt
    delta = wire.counter_delta(before, envoy.filter_counters(), "stripe_refunds_inline")
    assert delta == {"claimed": 1, "outcome_unknown": 1, "unknown_refused": 2}, delta
