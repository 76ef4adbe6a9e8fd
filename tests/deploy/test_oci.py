"""`make oci`: the module as an OCI image layout (deploy/oci/build.py), checked with skopeo, a
standard OCI tool from Debian. The form is the Wasm image spec's compat variant, which Istio's
image fetcher takes: one tar+gzip layer holding plugin.wasm. skopeo reads the layout, reports the
media types, and copies it out verifying every blob's digest; the plugin.wasm inside is the
module byte for byte, and rebuilding gives the same digests. The image carries the OCI
annotations version, source and licenses (from Cargo.toml), and a revision only when asked.

And the pin (deploy/oci/pin.py, `make pin`): every image reference in istio/*/*.yaml names the
image `make oci` built, by its manifest digest, which a copy with `skopeo copy
--preserve-digests` (as a push) keeps; `make pin-check` fails on a stale pin, naming `make pin`,
and `make pin` mends it."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from idemkit import REPO_ROOT
from manifests import ISTIO_DIR, crate_version, package_field

BUILD = REPO_ROOT / "deploy" / "oci" / "build.py"
PIN = REPO_ROOT / "deploy" / "oci" / "pin.py"
sys.path.insert(0, str(PIN.parent))
import pin  # noqa: E402 (deploy/oci/pin.py, standard library only)


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


def _manifest_digest(oci_layout: Path) -> str:
    return json.loads((oci_layout / "index.json").read_text())["manifests"][0]["digest"]


def test_the_oci_annotations_come_from_cargo_toml(skopeo, ref):
    manifest = json.loads(_skopeo(skopeo, "inspect", "--raw", ref))
    expected = {
        "org.opencontainers.image.version": crate_version(),
        "org.opencontainers.image.source": package_field("repository"),
        "org.opencontainers.image.licenses": package_field("license"),
    }
    annotations = manifest["annotations"]
    assert {k: annotations.get(k) for k in expected} == expected, annotations
    assert expected["org.opencontainers.image.source"].startswith("https://")
    # The pinned image has no revision (a commit could never pin its own digest) and no
    # creation time (the digest would change at every build).
    assert "org.opencontainers.image.revision" not in annotations
    assert "org.opencontainers.image.created" not in annotations
    # The same as the config's labels, which is what `skopeo inspect` shows.
    assert json.loads(_skopeo(skopeo, "inspect", ref))["Labels"] == expected


def test_a_revision_only_when_asked_and_then_another_digest(skopeo, oci_layout, filter_wasm, tmp_path):
    out = tmp_path / "with-revision"
    revision = "0123456789abcdef0123456789abcdef01234567"
    subprocess.run([sys.executable, str(BUILD), "--wasm", str(filter_wasm), "--out", str(out),
                    "--revision", revision], check=True, capture_output=True, timeout=60)
    manifest = json.loads(_skopeo(skopeo, "inspect", "--raw", "oci:%s:%s" % (out, crate_version())))
    assert manifest["annotations"]["org.opencontainers.image.revision"] == revision
    assert _manifest_digest(out) != _manifest_digest(oci_layout)


def _pinned(istio_dir: Path = ISTIO_DIR) -> dict[str, list[tuple[str, str | None, str | None]]]:
    """{manifest: [(repository, tag, digest) of each image reference]}"""
    return {p.relative_to(istio_dir).as_posix(): [(m.group("repo"), m.group("tag"), m.group("digest"))
                                                 for m in pin.references(p.read_text())]
            for p in pin.manifests(istio_dir)}


def test_the_istio_manifests_pin_the_digest_make_oci_builds(oci_layout):
    """The one check a developer meets after changing the Rust code: the module's bytes moved the
    digest, and istio/ must follow (`make pin`, then commit istio/ with the change)."""
    built = _manifest_digest(oci_layout)
    manifest = json.loads((oci_layout / "blobs" / "sha256" / built.split(":", 1)[1]).read_text())
    module = manifest["annotations"]["io.github.idempotency-filter.module.digest"]
    pinned = _pinned()
    assert sorted(pinned) == ["gateway/envoyfilter.yaml", "gateway/wasmplugin.yaml",
                              "mesh/envoyfilter.yaml", "mesh/wasmplugin.yaml",
                              "workloads/namespace-envoyfilter.yaml", "workloads/payments-envoyfilter.yaml"]
    stale = {rel: refs for rel, refs in pinned.items()
             if not refs or any(r[1:] != (crate_version(), built) for r in refs)}
    assert not stale, (
        "The pinned image is stale: run `make pin` and commit istio/ with your change "
        "(CONTRIBUTING.md). make oci built idempotency-filter:%s@%s (module %s), but %s. If the code "
        "did not change, the toolchain did: rust-toolchain.toml and the Makefile's WASM_OPT_VERSION fix it."
        % (crate_version(), built, module,
           "; ".join("%s pins %s" % (rel, ", ".join("%s:%s@%s" % r for r in refs) or "nothing")
                     for rel, refs in sorted(stale.items()))))


def test_a_copy_that_keeps_digests_has_the_pinned_digest(skopeo, ref, oci_layout, tmp_path):
    # What a push with `skopeo copy --preserve-digests` (docs/DEPLOYMENT.md) stores under the
    # manifest digest, here into a directory instead of a registry.
    out = tmp_path / "pushed"
    _skopeo(skopeo, "--insecure-policy", "copy", "--quiet", "--preserve-digests", ref, "dir:%s" % out)
    assert _sha256((out / "manifest.json").read_bytes()) == _manifest_digest(oci_layout)


def test_pin_check_fails_on_a_stale_pin_and_pin_mends_it(oci_layout, tmp_path):
    istio = tmp_path / "istio"
    shutil.copytree(ISTIO_DIR, istio)
    stale = "sha256:" + "0" * 64
    doc = istio / "mesh" / "wasmplugin.yaml"
    doc.write_text(pin.REFERENCE.sub(lambda m: "%s:0.0.1@%s" % (m.group("repo"), stale), doc.read_text()))

    def run(*args):
        return subprocess.run([sys.executable, str(PIN), "--layout", str(oci_layout), "--istio", str(istio), *args],
                              capture_output=True, text=True, timeout=60)

    check = run("--check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "mesh/wasmplugin.yaml pins" in check.stderr and stale in check.stderr
    assert "run `make pin`" in check.stderr
    assert doc.read_text().count(stale) == 1  # --check changes nothing
    mend = run()
    assert mend.returncode == 0, mend.stderr
    assert run("--check").returncode == 0
    # Only the references moved: each file is the repository's with the built image's reference.
    tag, digest = pin.built(oci_layout)
    assert (tag, digest) == (crate_version(), _manifest_digest(oci_layout))
    for path in pin.manifests(istio):
        original = (ISTIO_DIR / path.relative_to(istio)).read_text()
        assert path.read_text() == pin.pinned_text(original, tag, digest), path


def _layout(root: Path, tag: str, digest: str) -> Path:
    """A stand-in for the layout `make oci` writes: only its index, which pin.py reads."""
    root.mkdir(parents=True)
    entry = {"digest": digest, "annotations": {"org.opencontainers.image.ref.name": tag}}
    (root / "index.json").write_text(json.dumps({"manifests": [entry]}))
    return root


def test_a_released_tag_is_never_pinned_to_another_digest(tmp_path, capsys):
    """Issue 47: `:0.2.0` was re-pinned to a dozen digests. A version CHANGELOG.md dates is final:
    `make pin` refuses to move it, and says to take the next pre-release; a pre-release moves
    freely, and a first pin of a release (from its pre-release) is the release."""
    old, new = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text("# Changelog\n\n## [Unreleased]\n\n## [0.2.0] - 2026-12-05\n\n### Added\n\n- x\n")
    manifest = tmp_path / "istio" / "mesh" / "plugin.yaml"
    manifest.parent.mkdir(parents=True)

    layouts = iter(range(100))

    def pin_with(tag: str, pinned: str) -> int:
        """`make pin` of an image tagged `tag` (digest `new`) over a manifest pinning `pinned`."""
        manifest.write_text("url: oci://r.example/f/idempotency-filter:%s\n" % pinned)
        layout = _layout(tmp_path / ("layout-%d" % next(layouts)), tag, new)
        return pin.main(["--layout", str(layout), "--istio", str(tmp_path / "istio"), "--changelog", str(changelog)])

    assert pin_with("0.2.0", "0.2.0@" + old) == 1
    assert "0.2.0@" + old in manifest.read_text()
    assert "0.3.0-dev" in capsys.readouterr().err
    assert pin_with("0.3.0-dev", "0.3.0-dev@" + old) == 0
    assert manifest.read_text() == "url: oci://r.example/f/idempotency-filter:0.3.0-dev@%s\n" % new
    assert pin_with("0.2.0", "0.2.0-dev@" + old) == 0
    assert pin_with("0.2.0", "0.2.0@" + new) == 0
