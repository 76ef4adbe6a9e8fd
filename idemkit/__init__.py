"""idemkit: the Python kit shared by the end-to-end tests (tests/e2e), the benchmarks (bench/)
and the demo (`make run`). Standard library only.

    idemkit.client     HTTP client: http.client requests and a raw HTTP/1.1 client
    idemkit.process    processes: wait_until, the demo upstream (demo/orders_upstream.py)
    idemkit.envoy      a real Envoy process: start, readiness, admin, stats, /proc CPU and memory
    idemkit.bootstrap  Envoy bootstrap builder (clusters, routes, the Wasm filter, jwt_authn, ...)
    idemkit.terminal   an interactive bash or zsh in a pseudo-terminal, to paste the docs' blocks into

Imported from the repository root: pytest finds it through `pythonpath` in tests/e2e/pytest.ini,
the bench and the demo run as modules from the root (`python -m bench.run`, `python -m demo.run`).
"""

import importlib.util
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def module_version() -> str:
    """The crate's version (Cargo.toml), which the module reports in idempotency_build_info."""
    with open(REPO_ROOT / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["package"]["version"]


def module_revision() -> str:
    """The source revision `make build` gave the module of this checkout (deploy/oci/revision.py):
    12 hex digits, or `unknown`."""
    spec = importlib.util.spec_from_file_location("oci_revision", REPO_ROOT / "deploy" / "oci" / "revision.py")
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)
    return revision.revision()
