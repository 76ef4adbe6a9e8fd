#!/usr/bin/env python3
"""Pin the image `make oci` built in the Istio manifests: `make pin` (or
`python3 deploy/oci/pin.py --layout dist/oci`); `make pin-check` (`--check`) only says whether the
pin is current, and fails when it is not.

Every image reference to the filter in istio/*/*.yaml (a WasmPlugin's `url`, an EnvoyFilter's
`http_uri.uri`), `oci://<registry>/<path>/idempotency-filter[:<tag>][@sha256:<digest>]`, becomes
`oci://<registry>/<path>/idempotency-filter:<version>@sha256:<manifest digest>`, the registry and
path left as they are. Istio pulls by the digest (go-containerregistry ignores the tag beside a
digest, and istio-agent keys its module cache by it), so a tag rebuilt in place can never leave a
pod on another module; the tag is there for people.

The digest follows the module's bytes: every change to the Rust code (or Cargo.toml, Cargo.lock,
the toolchain) moves it. A released version's tag is never pinned to another digest than the one
it was released with: between releases the crate's version is a pre-release (`0.3.0-dev`), and
pinning a released version (one CHANGELOG.md dates) over another digest is refused, since every
pod and registry that holds `:<version>` would then hold two modules under one name. So the flow is: change the code, `make pin`, commit istio/ with the change
(CONTRIBUTING.md). tests/deploy/test_oci.py fails, naming this command, while a manifest pins
another digest than the one `make oci` builds. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ISTIO_DIR = REPO_ROOT / "istio"
CHANGELOG = REPO_ROOT / "CHANGELOG.md"
IMAGE = "idempotency-filter"
# oci://, then the repository up to the image name, then an optional tag and digest.
REFERENCE = re.compile(
    r"(?P<repo>oci://[^\s\"'@]*?/" + re.escape(IMAGE) + r")"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?(?![\w.@:/-])")


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def manifests(istio_dir: Path = ISTIO_DIR) -> list[Path]:
    return sorted(istio_dir.glob("*/*.yaml"))


def references(text: str) -> list[re.Match]:
    return list(REFERENCE.finditer(text))


def built(layout: Path) -> tuple[str, str]:
    """(tag, manifest digest) of the one image in the layout `make oci` wrote."""
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    return entry["annotations"]["org.opencontainers.image.ref.name"], entry["digest"]


def released(changelog: Path = CHANGELOG) -> set[str]:
    """The versions CHANGELOG.md dates (`## [X.Y.Z] - YYYY-MM-DD`): released, so their tags are final."""
    if not changelog.is_file():
        return set()
    return set(re.findall(r"^## \[([^\]]+)\] - \d{4}-\d{2}-\d{2}$", changelog.read_text(), re.M))


def repinned(refs: list[re.Match], tag: str, digest: str, final: set[str]) -> list[str]:
    """The references that pin the released `tag` to another digest than `digest`."""
    return [m.group(0) for m in refs
            if tag in final and m.group("tag") == tag and m.group("digest") not in (None, digest)]


def next_dev(version: str) -> str:
    """The pre-release after `version`: its next minor, `-dev` (`0.2.0` -> `0.3.0-dev`)."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version)
    return "%s.%d.0-dev" % (m.group(1), int(m.group(2)) + 1) if m else version + "-dev"


def pinned_text(text: str, tag: str, digest: str) -> str:
    return REFERENCE.sub(lambda m: "%s:%s@%s" % (m.group("repo"), tag, digest), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", type=Path, default=REPO_ROOT / "dist" / "oci",
                    help="the image layout make oci wrote (default dist/oci)")
    ap.add_argument("--istio", type=Path, default=ISTIO_DIR, help="the manifests' directory (default istio/)")
    ap.add_argument("--check", action="store_true", help="change nothing; fail if a manifest is not pinned to the layout")
    ap.add_argument("--changelog", type=Path, default=CHANGELOG, help="where released versions are dated")
    a = ap.parse_args(argv)
    if not (a.layout / "index.json").is_file():
        print("no OCI image layout at %s: run make oci" % a.layout, file=sys.stderr)
        return 1
    tag, digest = built(a.layout)
    final = released(a.changelog)
    moved = [(path, r) for path in manifests(a.istio) for r in repinned(references(path.read_text()), tag, digest, final)]
    if moved:
        for path, r in moved:
            print("%s pins %s" % (_shown(path), r), file=sys.stderr)
        print("%s is a released version (CHANGELOG.md): its tag is never pinned to another digest (%s). "
              "Set Cargo.toml's version to the next pre-release (say %s) and run `make pin`"
              % (tag, digest, next_dev(tag)), file=sys.stderr)
        return 1
    stale, found = [], 0
    for path in manifests(a.istio):
        text = path.read_text()
        refs = references(text)
        found += len(refs)
        new = pinned_text(text, tag, digest)
        if new == text:
            continue
        stale.append((path, [m.group(0) for m in refs]))
        if not a.check:
            path.write_text(new)
    if found == 0:
        print("no %s image reference in %s/*/*.yaml" % (IMAGE, a.istio), file=sys.stderr)
        return 1
    if a.check:
        if stale:
            for path, refs in stale:
                print("%s pins %s" % (_shown(path), ", ".join(refs)), file=sys.stderr)
            print("make oci built %s:%s@%s: run `make pin` and commit istio/ (CONTRIBUTING.md)"
                  % (IMAGE, tag, digest), file=sys.stderr)
            return 1
        print("istio/: %d references pin %s:%s@%s" % (found, IMAGE, tag, digest))
        return 0
    for path, _ in stale:
        print("pinned %s" % _shown(path))
    print("istio/: %d references pin %s:%s@%s%s" % (found, IMAGE, tag, digest, "" if stale else " (unchanged)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
