"""Issue 47, part 6: what a large store costs to start. A local store of 1,000,000 records makes
its 1.7 million shared-data keys in Envoy's canary root on the main thread, each set once without
reading it first (the namespace is new) and without the quota keys a configuration without
`quota` never uses; Envoy is LIVE and serves, and a configuration push that keeps the capacity
makes none again. How long it takes is measured, not asserted here: `make bench-start`
(OPERATIONS.md, "Storage and memory")."""

from __future__ import annotations

import json

import harness
from harness import new_key_replay_and_mismatch

CAPACITY = 1_000_000


def test_a_store_of_a_million_records_starts_and_serves(envoy_bin, filter_wasm, upstream):
    config = {"store": {"type": "local", "capacity": CAPACITY},
              "routes": [{"name": "orders", "match": {"prefix": "/orders"}, "require_key": True}]}
    proxy = harness.Envoy(envoy_bin, upstream.port, config, wasm_path=filter_wasm, name="large-store")
    proxy.start(timeout=120)
    try:
        assert proxy.admin("/ready").body.strip() == b"LIVE"
        line = next(l for l in proxy.log_text().splitlines() if "local store: %d records" % CAPACITY in l)
        # 187,500 buckets of 9 keys (the bucket and its 8 snapshot slots: no quota keys), 2,930
        # fill shards, the sweep cursor and the two global keys, made once by the canary.
        assert "(1690433 keys created)" in line, line
        new_key_replay_and_mismatch(proxy)
    finally:
        proxy.stop()
