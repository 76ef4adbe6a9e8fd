#!/usr/bin/env python3
"""The module's SBOM (issue 47): `make sbom` writes dist/idempotency_filter.cdx.json, a CycloneDX
1.5 document of exactly the crates compiled into the Wasm module (Cargo's own view: `cargo tree
-e normal --target wasm32-wasip1`, so no build script, test or optional dependency), each with
its version, its purl, its license as Cargo.toml states it, and the SHA-256 Cargo.lock pins for
it; the module itself as the document's component, with its SHA-256 (the layer `make oci` puts
in the image). Deterministic: no timestamp, no serial number, components in name order, so the
same tree gives the same bytes. Standard library only (and cargo).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "idempotency-filter"


def module_crates(cargo: str = "cargo") -> list[tuple[str, str, str]]:
    """[(name, version, license)] of the crates the Wasm module is built from, itself first."""
    out = subprocess.run(
        [cargo, "tree", "-e", "normal", "--target", "wasm32-wasip1", "-p", PACKAGE, "--prefix", "none",
         "--format", "{p}|{l}", "--locked"],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True, timeout=300).stdout
    seen: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        spec, _, license_ = line.partition("|")
        m = re.match(r"(\S+) v(\S+)", spec)
        if m:
            seen.setdefault((m.group(1), m.group(2)), license_.replace(" (*)", "").strip())
    return [(n, v, l) for (n, v), l in seen.items()]


def lock_checksums(lock: Path = REPO_ROOT / "Cargo.lock") -> dict[tuple[str, str], str]:
    """{(name, version): sha256} of the registry packages Cargo.lock pins."""
    out = {}
    for block in lock.read_text().split("[[package]]"):
        name = re.search(r'^name = "([^"]+)"', block, re.M)
        version = re.search(r'^version = "([^"]+)"', block, re.M)
        checksum = re.search(r'^checksum = "([0-9a-f]{64})"', block, re.M)
        if name and version and checksum:
            out[(name.group(1), version.group(1))] = checksum.group(1)
    return out


def bom(crates: list[tuple[str, str, str]], checksums: dict[tuple[str, str], str], wasm: Path | None) -> dict:
    def licenses(expr: str) -> list[dict]:
        return [{"expression": expr}] if expr else []

    (own,) = [c for c in crates if c[0] == PACKAGE]
    component = {"type": "application", "bom-ref": "pkg:cargo/%s@%s" % own[:2], "name": PACKAGE,
                 "version": own[1], "purl": "pkg:cargo/%s@%s" % own[:2], "licenses": licenses(own[2])}
    if wasm is not None:
        component["hashes"] = [{"alg": "SHA-256", "content": hashlib.sha256(wasm.read_bytes()).hexdigest()}]
    components = []
    for name, version, license_ in sorted(c for c in crates if c[0] != PACKAGE):
        purl = "pkg:cargo/%s@%s" % (name, version)
        entry = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
                 "licenses": licenses(license_)}
        if (name, version) in checksums:
            entry["hashes"] = [{"alg": "SHA-256", "content": checksums[(name, version)]}]
        components.append(entry)
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {"component": component,
                     "tools": {"components": [{"type": "application", "name": "deploy/oci/sbom.py"}]}},
        "components": components,
        "dependencies": [{"ref": component["bom-ref"], "dependsOn": [c["bom-ref"] for c in components]}],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wasm", type=Path, help="the built module, whose SHA-256 the document names")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "dist" / "idempotency_filter.cdx.json")
    ap.add_argument("--cargo", default="cargo")
    a = ap.parse_args(argv)
    doc = bom(module_crates(a.cargo), lock_checksums(), a.wasm)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print("%s: %d components" % (a.out, len(doc["components"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
