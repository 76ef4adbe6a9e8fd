"""deploy/oci/sbom.py (issue 47): the module's SBOM, CycloneDX 1.5, beside the OCI image. It lists
exactly the crates compiled into the Wasm module (not the test kit's optional dependencies, not
build scripts or dev-dependencies), each with its purl, license and the checksum Cargo.lock pins,
and names the module by the digest `make oci` annotates the image with; the same tree gives the
same bytes."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

from idemkit import REPO_ROOT
from manifests import crate_version

SCRIPT = REPO_ROOT / "deploy" / "oci" / "sbom.py"


def _sbom(tmp_path, filter_wasm, name="sbom.json") -> tuple[dict, bytes]:
    out = tmp_path / name
    proc = subprocess.run([sys.executable, str(SCRIPT), "--wasm", str(filter_wasm), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), out.read_bytes()


def test_the_sbom_lists_what_the_module_is_built_from(tmp_path, filter_wasm):
    doc, first = _sbom(tmp_path, filter_wasm)
    assert (doc["bomFormat"], doc["specVersion"]) == ("CycloneDX", "1.5")
    me = doc["metadata"]["component"]
    assert (me["name"], me["version"]) == ("idempotency-filter", crate_version())
    assert me["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(filter_wasm.read_bytes()).hexdigest()}]
    names = {c["name"] for c in doc["components"]}
    # The module's own dependencies (sha2 and what it needs, log), and nothing the tests bring.
    assert {"sha2", "log", "digest"} <= names
    assert not names & {"h2", "tokio", "http", "bytes", "stateright", "wasmi", "idempotency-filter"}, names
    lock = (REPO_ROOT / "Cargo.lock").read_text()
    for c in doc["components"]:
        assert c["purl"] == "pkg:cargo/%s@%s" % (c["name"], c["version"]) == c["bom-ref"]
        assert c["licenses"] and c["licenses"][0]["expression"], c
        [h] = c["hashes"]
        block = re.search(r'name = "%s"\nversion = "%s"\n[^\[]*checksum = "([0-9a-f]{64})"'
                          % (re.escape(c["name"]), re.escape(c["version"])), lock)
        assert block and h == {"alg": "SHA-256", "content": block.group(1)}, c
    assert doc["dependencies"] == [{"ref": me["bom-ref"], "dependsOn": [c["bom-ref"] for c in doc["components"]]}]
    _, again = _sbom(tmp_path, filter_wasm, "again.json")
    assert again == first
