"""A bad filter configuration stops Envoy from starting, and the log names the offending field
(no contract row: a promise to the operator). Plus: the shipped envoy/envoy.yaml passes
`envoy --mode validate`.

Wait-mode bounds are refused at start. With a `concurrent: "wait"` rule, waiters
that could hold more than 256 MiB of request bodies per worker (`max_waiters` x the largest
`max_request_bytes` of the wait rules) are refused naming `max_waiters`; a `wait_timeout` over
5 minutes is refused naming `routes[0].wait_timeout`. Exactly at the bounds (and with a large
body limit on a reject rule only) the configuration starts."""

from __future__ import annotations

import copy
import re
import subprocess

import pytest

import harness
from harness import MiB

FILTER_CONFIG = None  # this module starts its own Envoys

VALID = {
    "key_header": "idempotency-key",
    "store": {"type": "local", "capacity": 1000},
    "routes": [{"name": "orders", "match": {"prefix": "/orders", "methods": ["POST"]},
                "ttl": "24h", "processing_timeout": "30s",
                "store_statuses": ["2xx", "3xx", "4xx"],
                "release_statuses": ["5xx", "408", "425", "429"]}],
}


def _mutate(fn):
    cfg = copy.deepcopy(VALID)
    fn(cfg)
    return cfg


BAD = {
    "unknown-top-level-field": (_mutate(lambda c: c.update(colour="blue")), ["colour"]),
    "unknown-route-field": (_mutate(lambda c: c["routes"][0].update(colour="blue")),
                            ["routes[0]", "colour"]),
    "bad-ttl": (_mutate(lambda c: c["routes"][0].update(ttl="10x")), ["routes[0].ttl"]),
    "bad-processing-timeout": (_mutate(lambda c: c["routes"][0].update(processing_timeout="5 s")),
                               ["routes[0].processing_timeout"]),
    "bad-status-pattern": (_mutate(lambda c: c["routes"][0].update(store_statuses=["6xx"])),
                           ["routes[0].store_statuses"]),
    "zero-max-request-bytes": (_mutate(lambda c: c["routes"][0].update(max_request_bytes=0)),
                               ["routes[0].max_request_bytes"]),
    "bad-key-header-name": (_mutate(lambda c: c.update(key_header="idempotency key")),
                            ["key_header"]),
    "problem-status-out-of-range": (_mutate(lambda c: c.update(problem_statuses={"mismatch": 200})),
                                    ["problem_statuses.mismatch"]),
    "processing-timeout-over-ttl": (_mutate(lambda c: c["routes"][0].update(ttl="10s",
                                                                            processing_timeout="1m")),
                                    ["routes[0].processing_timeout"]),
    "empty-routes": (_mutate(lambda c: c.update(routes=[])), ["routes"]),
    # 100000 waiters x 64 MiB bodies: far more than 256 MiB per worker
    "wait-bodies-over-256mib": (_mutate(lambda c: (c.update(max_waiters=100000),
                                                   c["routes"][0].update(concurrent="wait",
                                                                         max_request_bytes=64 * MiB))),
                                ["max_waiters"]),
    # one waiter past the bound: 5 x 64 MiB = 320 MiB
    "wait-bodies-just-over-256mib": (_mutate(lambda c: (c.update(max_waiters=5),
                                                        c["routes"][0].update(concurrent="wait",
                                                                              max_request_bytes=64 * MiB))),
                                     ["max_waiters"]),
    "wait-timeout-over-5m": (_mutate(lambda c: c["routes"][0].update(concurrent="wait",
                                                                     wait_timeout="1h")),
                             ["routes[0].wait_timeout"]),
    # A detached call still running when its lease ends could be taken over and run twice.
    "detached-upstream-timeout-at-the-lease": (
        _mutate(lambda c: c["routes"][0].update(execution="detached", upstream_timeout="30s")),
        ["routes[0].upstream_timeout"]),
    "unknown-execution": (_mutate(lambda c: c["routes"][0].update(execution="background")),
                          ["routes[0].execution"]),
    "unknown-outcome-value": (_mutate(lambda c: c["routes"][0].update(unknown_outcome="retry")),
                              ["routes[0].unknown_outcome", '"takeover" or "refuse"']),
    "not-json": ("{not json", []),
}

# A line the filter itself logged at warning level or above (not Envoy echoing the config).
_FILTER_ERROR = re.compile(r"\]\[(warning|error|critical)\]\[wasm\].*wasm log")


def _start(envoy_bin, filter_wasm, cfg, name):
    return harness.Envoy(envoy_bin, 1, cfg, wasm_path=filter_wasm, name=name, concurrency=1)


def test_valid_baseline_starts(envoy_bin, filter_wasm):
    with _start(envoy_bin, filter_wasm, VALID, "config-valid") as proxy:
        assert proxy.admin("/ready").status == 200


def test_wait_bounds_at_the_limit_start(envoy_bin, filter_wasm):
    # Guard for the two refusals above (passes today too): exactly 256 MiB of waiting bodies
    # (4 x 64 MiB) and a wait_timeout of exactly 5 minutes start; a 64 MiB reject rule with
    # many waiters does not count (only wait rules hold bodies).
    cfg = copy.deepcopy(VALID)
    cfg["max_waiters"] = 4
    cfg["routes"][0].update(concurrent="wait", wait_timeout="5m", max_request_bytes=64 * MiB)
    cfg["routes"].append({"name": "big-reject", "match": {"prefix": "/big"},
                          "max_request_bytes": 64 * MiB})
    with _start(envoy_bin, filter_wasm, cfg, "config-wait-at-limit") as proxy:
        assert proxy.admin("/ready").status == 200


@pytest.mark.parametrize("value", ["takeover", "refuse"])
def test_unknown_outcome_values_start(envoy_bin, filter_wasm, value):
    cfg = _mutate(lambda c: c["routes"][0].update(unknown_outcome=value))
    with _start(envoy_bin, filter_wasm, cfg, "config-unknown-outcome-" + value) as proxy:
        assert proxy.admin("/ready").status == 200


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_fails_to_start(envoy_bin, filter_wasm, case):
    cfg, needles = BAD[case]
    proxy = _start(envoy_bin, filter_wasm, cfg, "config-" + case).spawn()
    try:
        rc = proxy.wait_exit(10)
        assert rc is not None, "Envoy is still running with a bad configuration"
        assert rc != 0
        lines = [l for l in proxy.log_text().splitlines() if _FILTER_ERROR.search(l)]
        assert lines, "no error logged by the filter"
        if needles:
            naming = [l for l in lines if all(n in l for n in needles)]
            assert naming, "no filter error line names %s:\n%s" % (needles, "\n".join(lines))
    finally:
        proxy.stop()


SHIPPED_CONFIGS = sorted(p.name for p in (harness.REPO_ROOT / "envoy").glob("*.yaml"))


def test_every_config_is_tested():
    # A shipped config that the test below does not see would go stale unnoticed.
    assert {"envoy.yaml", "envoy-etcd.yaml"} <= set(SHIPPED_CONFIGS), SHIPPED_CONFIGS


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_shipped_envoy_yaml_validates(envoy_bin, filter_wasm, tmp_path, name):
    text = (harness.REPO_ROOT / "envoy" / name).read_text()
    assert "dist/idempotency_filter.wasm" in text
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(text.replace("dist/idempotency_filter.wasm", str(filter_wasm)))
    proc = subprocess.run([str(envoy_bin), "--mode", "validate", "-c", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "OK" in proc.stdout + proc.stderr
