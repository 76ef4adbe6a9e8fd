"""What the three pytest suites share (tests/e2e, tests/deploy, tests/sdk): paths from the
environment, fresh log directories, the Envoy binary and the filter module as session fixtures
(a missing one fails the tests that need it, naming the make target that provides it; nothing
is skipped), and the tails of live processes' logs attached to a failed test's report.

A conftest imports the fixtures by name (pytest finds them in its namespace) and calls the rest
from its own hooks. Only the suites import this module: idemkit itself needs no pytest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from idemkit import REPO_ROOT, process
from idemkit.envoy import default_binary


def env_path(var: str, default: Path) -> Path:
    """A path from the environment variable `var` (relative ones from the repository root
    unless they exist as given), else `default`."""
    raw = os.environ.get(var)
    if not raw:
        return default
    path = Path(raw)
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    return path


def fresh_logs(log_root: Path) -> None:
    """An empty (gitignored) log directory for this run, where processes started by the tests
    write their logs."""
    shutil.rmtree(log_root, ignore_errors=True)
    log_root.mkdir(parents=True, exist_ok=True)
    process.Process.log_root = log_root


@pytest.fixture(scope="session")
def envoy_bin() -> Path:
    raw = os.environ.get("ENVOY_BIN")
    path = env_path("ENVOY_BIN", Path()) if raw else default_binary()
    if path is None or not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail("Envoy binary not found (ENVOY_BIN=%r): run `make tools` or set ENVOY_BIN" % (raw,),
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def filter_wasm() -> Path:
    path = env_path("FILTER_WASM", REPO_ROOT / "dist" / "idempotency_filter.wasm")
    if not path.is_file():
        pytest.fail("filter module not found at %s: run `make build` or set FILTER_WASM" % path, pytrace=False)
    return path.resolve()


def attach_process_logs(report) -> None:
    """For a failed test (setup or call), the tail of every live process's log (each once) as
    sections of its report."""
    if not report.failed or report.when not in ("setup", "call"):
        return
    seen = set()
    for proc in list(process.LIVE):
        if id(proc) in seen:
            continue
        seen.add(id(proc))
        try:
            text = proc.failure_report()
        except Exception as exc:  # noqa: BLE001 - never hide the real failure
            text = "(could not collect: %r)" % (exc,)
        report.sections.append(("%s: %s" % (type(proc).__name__.lower(), proc.name), text))
