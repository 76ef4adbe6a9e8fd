"""C13, C16 when the Envoy that claimed a key dies while its request is upstream: no outcome is
ever written, the claim's lease ends in etcd, and a retry lands on another Envoy of the fleet.

On a rule with `unknown_outcome: "refuse"` (the default, written out here) the retry gets 502
`outcome-unknown`, and so does every later one: the upstream may have executed, so the key is
never executed again. On a `takeover` rule the retry takes the record over and the upstream
executes it a second time, as C13 says. On a rule with `reconcile` (C23) the retry asks the
upstream's lookup, finds the answer the upstream committed after Envoy a died, and gets it
replayed: one execution. Envoy a is killed with SIGKILL: no callback, no drain, nothing written.
"""

from __future__ import annotations

import signal
import threading

import pytest

import harness
from harness import key_headers, new_key

BODY = b'{"amount":42}'
ETCD_NAME = "etcd-crash"
FILTER_CONFIG = {
    "store": harness.etcd_store(prefix="/e2e-crash/"),
    "routes": [
        {"name": "pay", "match": {"prefix": "/pay"}, "require_key": True,
         "unknown_outcome": "refuse", "processing_timeout": "2s"},
        {"name": "orders", "match": {"prefix": "/orders"}, "require_key": True,
         "processing_timeout": "2s", "unknown_outcome": "takeover"},
        {"name": "rpay", "match": {"prefix": "/rpay"}, "require_key": True,
         "processing_timeout": "3s", "reconcile": {"path": "/_lookup/{key}", "timeout": "1s"}},
    ],
}


def start_envoy(envoy_bin, filter_wasm, upstream, etcd, name):
    return harness.Envoy(
        envoy_bin, upstream.port, FILTER_CONFIG, wasm_path=filter_wasm, name=name,
        extra_clusters=[harness.etcd_cluster([etcd.client_port])], route_timeout="15s",
    ).start()


@pytest.fixture
def crashing_pair(envoy_bin, filter_wasm, upstream, etcd):
    pair = [start_envoy(envoy_bin, filter_wasm, upstream, etcd, n) for n in ("crash-a", "crash-b")]
    yield pair
    for proxy in pair:
        proxy.stop()


def claim_then_crash(a, upstream, path: str, key: str, delay_ms: str = "8000") -> None:
    """Sends `key` to Envoy a with a slow upstream, waits until the upstream executes it, then
    kills Envoy a (SIGKILL): the claim stays in etcd without an outcome."""
    def send():
        try:
            a.post(path, BODY, key_headers(key, x_delay_ms=delay_ms), timeout=20)
        except OSError:
            pass  # Envoy a dies under it

    threading.Thread(target=send, daemon=True).start()
    harness.wait_until(lambda: upstream.executions(key) == 1, 10, what="the upstream to execute it")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)


def after_the_lease(b, path: str, key: str):
    """Envoy b's answer to a retry once the claim's lease has ended (409 until then)."""
    answers = []

    def ended():
        answers.append(b.post(path, BODY, key_headers(key)))
        return answers[-1].status != 409

    harness.wait_until(ended, 20, interval=0.25, what="the claim's lease to end")
    return answers[-1]


def test_a_refuse_rule_never_executes_again_after_the_claiming_envoy_died(crashing_pair, upstream):
    a, b = crashing_pair
    key = new_key()
    claim_then_crash(a, upstream, "/pay", key)
    retry = after_the_lease(b, "/pay", key)
    harness.assert_problem(retry, 502, "outcome-unknown")
    assert retry.header("retry-after") is None
    again = b.post("/pay", BODY, key_headers(key))
    harness.assert_problem(again, 502, "outcome-unknown")
    assert upstream.executions(key) == 1
    assert b.idem("unknown_refused") == 2


def test_a_takeover_rule_executes_again_after_the_claiming_envoy_died(crashing_pair, upstream):
    a, b = crashing_pair
    key = new_key()
    claim_then_crash(a, upstream, "/orders", key)
    retry = after_the_lease(b, "/orders", key)
    assert retry.status == 201 and not retry.replayed, retry
    assert upstream.executions(key) == 2


def test_a_reconcile_rule_replays_what_the_upstream_committed_after_the_claiming_envoy_died(
    crashing_pair, upstream
):
    a, b = crashing_pair
    key = new_key()
    # The upstream commits its answer a second later, with nobody left to take it.
    claim_then_crash(a, upstream, "/rpay", key, delay_ms="1000")
    harness.wait_until(lambda: upstream.committed(key) == 1, 10, what="the upstream to commit")
    retry = after_the_lease(b, "/rpay", key)
    assert retry.status == 201 and retry.replayed, retry
    assert retry.header("idempotent-reconciled") == "true", retry
    again = b.post("/rpay", BODY, key_headers(key))
    assert again.status == 201 and again.body == retry.body, again
    assert (upstream.executions(key), upstream.lookups(key)) == (1, 1)
    assert b.idem("reconciled_found") == 1
