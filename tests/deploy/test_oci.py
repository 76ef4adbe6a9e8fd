"""`make oci`: the module as an OCI image layout (deploy/oci/build.py), checked with skopeo, a
standard OCI tool from Debian. The form is the Wasm image spec's compat variant, which Istio's
image fetcher takes: one tar+gzip layer holding plugin.wasm. skopeo reads the layout, reports the
media types, and copies it out verifying every blob's digest; the plugin.wasm inside is the
module byte for byte, and rebuilding gives the same digests."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from idemkit import REPO_ROOT
from manifests import crate_version

BUILD = REPO_ROOT / "deploy" / "oci" / "build.py"


def _skopeo(skopeo: str, *args: str) -> str:
    proc = subprocess.run([skopeo, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def ref(oci_layout) -> str:
    return "oci:%s:%s" % (oci_layout, crate_version())


def test_the_tag_is_the_crate_version(oci_layout):
    index = json.loads((oci_layout / "index.json").read_text())
    names = [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]]
    assert names == [crate_version()]


def test_skopeo_reads_an_image_of_one_layer(skopeo, ref, oci_layout):
    info = json.loads(_skopeo(skopeo, "inspect", ref))
    index = json.loads((oci_layout / "index.json").read_text())
    assert info["Digest"] == index["manifests"][0]["digest"]
    assert len(info["Layers"]) == 1
    assert (info["Os"], info["Architecture"]) == ("wasip1", "wasm")


def test_media_types_and_module_digest(skopeo, ref, filter_wasm):
    manifest = json.loads(_skopeo(skopeo, "inspect", "--raw", ref))
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    [layer] = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["annotations"]["io.github.idempotency-filter.module.digest"] == _sha256(filter_wasm.read_bytes())


def test_the_layer_holds_the_module_byte_for_byte(skopeo, ref, filter_wasm, tmp_path):
    # skopeo copy checks every blob against its digest on the way out.
    out = tmp_path / "copied"
    _skopeo(skopeo, "--insecure-policy", "copy", "--quiet", ref, "dir:%s" % out)
    manifest = json.loads((out / "manifest.json").read_text())
    [layer] = manifest["layers"]
    blob = (out / layer["digest"].split(":", 1)[1]).read_bytes()
    assert _sha256(blob) == layer["digest"] and len(blob) == layer["size"]
    tar_bytes = gzip.decompress(blob)
    config = json.loads((out / manifest["config"]["digest"].split(":", 1)[1]).read_text())
    assert config["rootfs"]["diff_ids"] == [_sha256(tar_bytes)]
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["plugin.wasm"] and members[0].isfile()
        module = tar.extractfile(members[0]).read()
    assert module == filter_wasm.read_bytes()


def test_the_build_is_reproducible(oci_layout, filter_wasm, tmp_path):
    again = tmp_path / "again"
    subprocess.run([sys.executable, str(BUILD), "--wasm", str(filter_wasm), "--out", str(again),
                    "--tag", crate_version()], check=True, capture_output=True, timeout=60)
    files = sorted(p.relative_to(oci_layout).as_posix() for p in oci_layout.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again).as_posix() for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (oci_layout / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_not_a_module_is_refused(tmp_path):
    bogus = tmp_path / "bogus.wasm"
    bogus.write_bytes(b"not wasm")
    proc = subprocess.run([sys.executable, str(BUILD), "--wasm", str(bogus), "--out",
                           str(tmp_path / "out"), "--tag", "x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "not a Wasm module" in proc.stderr
    assert not (tmp_path / "out").exists()
