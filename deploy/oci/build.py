#!/usr/bin/env python3
"""Write the filter's Wasm module as an OCI image layout that Istio's WasmPlugin can pull, without
a container engine: `make oci` (or `python3 deploy/oci/build.py --wasm W --out DIR --tag T`).

The form is the Wasm image spec's *compat* variant: one `application/vnd.oci.image.layer.v1.tar+gzip`
layer holding `plugin.wasm`, an ordinary OCI image config, and the manifest annotation
`module.wasm.image/variant: compat`. Istio's image fetcher (pkg/wasm/imagefetcher.go) takes this
form first; its other form, the *oci* variant with the Wasm artifact media types, must have exactly
two layers (a runtime config beside the module), and skopeo 1.9 refuses `skopeo inspect` on an
artifact config anyway. See docs/DEPLOYMENT.md, "The OCI image" and "Istio".

The manifest carries the OCI annotations `org.opencontainers.image.version`, `.source` and
`.licenses`, from Cargo.toml's [package] (version, repository, license), also as the config's
labels (what `skopeo inspect` shows). `.revision` (the git commit) only with `--revision`: the
image the Istio manifests pin by digest is built without it, since a digest that depends on the
commit could never be pinned in that same commit (CONTRIBUTING.md). No `.created`: a timestamp
would change the digest at every build.

Everything is deterministic, so one module always gives the same digests: the tar entry has
mtime 0, uid/gid 0, mode 0644 and no user names; gzip has mtime 0 and no file name; JSON is
written with sorted keys and no spaces. Push the layout with any OCI tool, e.g.
    skopeo copy --preserve-digests oci:dist/oci:0.2.0 docker://registry.example.com/filters/idempotency-filter:0.2.0
Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
from pathlib import Path

CARGO_TOML = Path(__file__).resolve().parents[2] / "Cargo.toml"

PLUGIN_FILE = "plugin.wasm"
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
VARIANT_ANNOTATION = "module.wasm.image/variant"
# The module's own digest, so that a reader of the manifest can check it without unpacking
# (the layer digest is that of the gzipped tar, not of the module).
MODULE_DIGEST_ANNOTATION = "io.github.idempotency-filter.module.digest"
# The OCI image spec's pre-defined annotation keys (annotations.md).
VERSION_ANNOTATION = "org.opencontainers.image.version"
SOURCE_ANNOTATION = "org.opencontainers.image.source"
LICENSES_ANNOTATION = "org.opencontainers.image.licenses"
REVISION_ANNOTATION = "org.opencontainers.image.revision"


def package_fields(cargo_toml: Path = CARGO_TOML) -> dict[str, str]:
    """The string fields of Cargo.toml's [package] table (`key = "value"` lines), read without a
    TOML parser so that any Python 3 runs this file."""
    fields: dict[str, str] = {}
    table = None
    for line in cargo_toml.read_text().splitlines():
        header = re.match(r"^\[([^\]]+)\]\s*$", line)
        if header:
            table = header.group(1).strip()
        elif table == "package":
            m = re.match(r'^([A-Za-z0-9_-]+)\s*=\s*"([^"\\]*)"\s*(#.*)?$', line)
            if m:
                fields[m.group(1)] = m.group(2)
    return fields


def image_annotations(revision: str | None = None, cargo_toml: Path = CARGO_TOML) -> dict[str, str]:
    """The OCI annotations of the image: version, source and licenses from Cargo.toml, and the
    revision only when one is given."""
    package = package_fields(cargo_toml)
    out = {
        VERSION_ANNOTATION: package["version"],
        SOURCE_ANNOTATION: package["repository"],
        LICENSES_ANNOTATION: package["license"],
    }
    if revision:
        out[REVISION_ANNOTATION] = revision
    return out


def _json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(module: bytes) -> bytes:
    """An uncompressed tar with one regular file, plugin.wasm, and nothing that varies by machine."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(PLUGIN_FILE)
        info.size = len(module)
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(module))
    return buf.getvalue()


def gzip_bytes(data: bytes) -> bytes:
    buf = io.BytesIO()
    # filename="" and mtime=0 keep the header free of the build's path and time.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buf.getvalue()


def build(module: bytes, tag: str, annotations: dict[str, str] | None = None) -> dict[str, bytes]:
    """The layout's files (relative path -> bytes): oci-layout, index.json and blobs/sha256/*.
    `annotations` (image_annotations()) go on the manifest and, as labels, on the config."""
    annotations = dict(annotations or {})
    tar = layer_tar(module)
    layer = gzip_bytes(tar)
    config = _json({
        "architecture": "wasm",
        "os": "wasip1",
        "config": {"Labels": annotations} if annotations else {},
        "rootfs": {"type": "layers", "diff_ids": [_digest(tar)]},
    })
    manifest = _json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": _digest(config), "size": len(config)},
        "layers": [{
            "mediaType": LAYER_MEDIA_TYPE,
            "digest": _digest(layer),
            "size": len(layer),
            "annotations": {"org.opencontainers.image.title": PLUGIN_FILE},
        }],
        "annotations": {
            **annotations,
            VARIANT_ANNOTATION: "compat",
            MODULE_DIGEST_ANNOTATION: _digest(module),
        },
    })
    index = _json({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": _digest(manifest),
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    })
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": index}
    for blob in (layer, config, manifest):
        files["blobs/sha256/" + hashlib.sha256(blob).hexdigest()] = blob
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wasm", required=True, type=Path, help="the module (dist/idempotency_filter.wasm)")
    ap.add_argument("--out", required=True, type=Path, help="the layout directory (replaced)")
    ap.add_argument("--tag", help="the reference name in index.json (default: Cargo.toml's version)")
    ap.add_argument("--revision", default="",
                    help="org.opencontainers.image.revision, e.g. a git commit (default: none, as the pinned image)")
    a = ap.parse_args(argv)
    module = a.wasm.read_bytes()
    if module[:4] != b"\0asm":
        print("%s is not a Wasm module" % a.wasm, file=sys.stderr)
        return 1
    annotations = image_annotations(a.revision or None)
    tag = a.tag or annotations[VERSION_ANNOTATION]
    files = build(module, tag, annotations)
    # A fresh directory: blobs of an earlier module must not linger beside the new index.
    shutil.rmtree(a.out, ignore_errors=True)
    for rel, data in files.items():
        path = a.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    manifest_digest = json.loads(files["index.json"])["manifests"][0]["digest"]
    print("%s: oci:%s:%s manifest %s (module %s, %d bytes%s)"
          % (a.out, a.out, tag, manifest_digest, _digest(module), len(module),
             ", revision %s" % a.revision if a.revision else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
