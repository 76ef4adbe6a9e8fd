"""What the SDK tests check on the wire, the same for every SDK: Envoy's access log (every
attempt the SDK made and what it got), the filter's counters, the fake Stripe API's executions.

The scenario is the one Stripe's SDKs retry for: a create whose first attempt EXECUTED upstream
but whose answer the SDK never got (its own timeout fired first). The SDK retries with the same
Idempotency-Key, and the filter answers every retry: 409 request-in-flight while the original
runs (route `stripe_customers`, `concurrent: reject`; the SDKs retry a 409 after a backoff) or
the retry is held until the original's answer (route `stripe_v1`, `concurrent: wait`), then the
replay of the one execution, which the SDK parses as its result.
"""

from __future__ import annotations

PROBLEM = "application/problem+json"


def counter_delta(before: dict[str, int], after: dict[str, int], route: str) -> dict[str, int]:
    """The route's filter counters that moved between two `filter_counters()` snapshots, keyed
    by outcome (claimed, stored, in_flight, waiting, replayed, ...)."""
    prefix = "route.%s.requests_total." % route
    out = {}
    for name, value in after.items():
        if name.startswith(prefix) and value != before.get(name, 0):
            out[name[len(prefix):]] = value - before.get(name, 0)
    return out


def check_one_execution(fake, obj_id: str, key: str, total_before: int) -> None:
    """The upstream executed the create exactly once, with the SDK's key, and that execution
    minted the object the SDK returned."""
    assert fake.execution_ids(key) == [obj_id], "executions of %s" % key
    assert fake.total() == total_before + 1, "no other execution reached the upstream"


def check_first_attempt_abandoned(attempt: dict, key: str, path: str, timeout_ms: int) -> None:
    """The SDK's first attempt: it gave up after its timeout (Envoy logs the client's
    disconnect, no response sent), while the upstream executed."""
    assert attempt["key"] == key and attempt["path"] == path, attempt
    assert attempt["status"] == 0 and attempt["flags"] == "DC", attempt
    assert attempt["details"] == "downstream_remote_disconnect", attempt
    assert timeout_ms - 100 <= attempt["duration_ms"] <= timeout_ms + 500, attempt


def check_replay(attempt: dict, key: str, path: str) -> None:
    """An attempt the filter answered with the stored answer of the one execution."""
    assert attempt["key"] == key and attempt["path"] == path, attempt
    assert attempt["status"] == 200, attempt
    assert attempt["details"] == "idempotency_replay", attempt
    assert attempt["replayed"] == "true", attempt
    assert attempt["problem"] == "application/json", attempt


def check_conflict(attempt: dict, key: str, path: str) -> None:
    """An attempt the filter answered 409 request-in-flight (the original still ran)."""
    assert attempt["key"] == key and attempt["path"] == path, attempt
    assert attempt["status"] == 409, attempt
    assert attempt["details"] == "idempotency_problem", attempt
    assert attempt["problem"] == PROBLEM, attempt
    assert attempt["replayed"] is None, attempt


def check_reject_route(attempts: list[dict], key: str, timeout_ms: int,
                       delta: dict[str, int]) -> int:
    """`concurrent: reject` (/v1/customers): abandoned first attempt, one or more 409s, then
    the replay; the counters agree. Returns how many 409s the SDK got."""
    path = "/v1/customers"
    assert len(attempts) >= 3, attempts
    check_first_attempt_abandoned(attempts[0], key, path, timeout_ms)
    for attempt in attempts[1:-1]:
        check_conflict(attempt, key, path)
    check_replay(attempts[-1], key, path)
    conflicts = len(attempts) - 2
    assert delta == {"claimed": 1, "stored": 1, "in_flight": conflicts, "replayed": 1}, delta
    return conflicts


def check_wait_route(attempts: list[dict], key: str, timeout_ms: int,
                     delta: dict[str, int]) -> None:
    """`concurrent: wait` (/v1/payment_intents): abandoned first attempt, then ONE retry, held
    by the filter until the original's answer came and answered with its replay; no 409."""
    path = "/v1/payment_intents"
    assert len(attempts) == 2, attempts
    check_first_attempt_abandoned(attempts[0], key, path, timeout_ms)
    check_replay(attempts[1], key, path)
    assert attempts[1]["duration_ms"] >= 200, ("held until the original answered", attempts[1])
    assert delta == {"claimed": 1, "stored": 1, "waiting": 1, "replayed": 1}, delta
