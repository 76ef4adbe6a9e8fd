#!/usr/bin/env python3
"""The source revision the module reports (`idempotency_build_info{revision}`): the commit that
last changed the module's sources (SOURCES), its first 12 hex digits, or `unknown`.

`make build` asks this script and hands the answer to rustc (IDEMPOTENCY_REVISION,
src/build_info.rs). It is the sources' commit, not HEAD's: the module's bytes, and so the image
digest istio/ pins, must not move with a commit that changes no source, above all the commit that
pins them (`make pin`, CONTRIBUTING.md).

- In a git checkout with its history: `git log -1 -- SOURCES`, while the sources are as that
  commit has them; sources changed and not committed are `unknown`, never a commit they are not.
- Where git cannot say (a shallow clone, whose oldest commit looks as if it changed every file; a
  source archive; no git): the revision RECORD names, if the sources' digest is the one it
  records. `make pin` writes RECORD beside the pin, so a clone of any depth builds the pinned
  module byte for byte.
- Otherwise `unknown`.

`--record` writes RECORD for the sources as they are (make pin); `--check` fails when RECORD is
not what `--record` would write (make pin-check, tests/deploy/test_oci.py). Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# What the module is built from: the crate's code, its manifest and lock file, and the compiler.
SOURCES = ("src", "Cargo.toml", "Cargo.lock", "rust-toolchain.toml")
RECORD = Path("deploy", "oci", "pinned-sources")  # in the checkout
UNKNOWN = "unknown"
LENGTH = 12


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _files(root: Path) -> list[Path]:
    out = []
    for name in SOURCES:
        path = root / name
        if path.is_dir():
            out.extend(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            out.append(path)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def sources_digest(root: Path = REPO_ROOT) -> str:
    """SHA-256 over every source file's path and bytes, in path order: the same sources give the
    same digest in any checkout, with git or without."""
    h = hashlib.sha256()
    for path in _files(root):
        data = path.read_bytes()
        h.update(b"%s\0%d\0" % (path.relative_to(root).as_posix().encode(), len(data)))
        h.update(data)
    return "sha256:" + h.hexdigest()


def git_revision(root: Path = REPO_ROOT) -> str | None:
    """The sources' commit by git, `unknown` for sources changed since, None when git cannot say."""
    if _git(root, "rev-parse", "--is-shallow-repository") != "false":
        return None
    commit = _git(root, "log", "-1", "--format=%H", "--", *SOURCES)
    if not commit:
        return None
    changed = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *SOURCES)
    if changed is None:
        return None
    return commit[:LENGTH] if changed == "" else UNKNOWN


def read_record(root: Path = REPO_ROOT) -> dict[str, str]:
    record = root / RECORD
    if not record.is_file():
        return {}
    fields = {}
    for line in record.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            fields[name] = value.strip()
    return fields


def recorded_revision(root: Path = REPO_ROOT) -> str | None:
    fields = read_record(root)
    if fields.get("sources") == sources_digest(root) and fields.get("revision"):
        return fields["revision"]
    return None


def revision(root: Path = REPO_ROOT) -> str:
    by_git = git_revision(root)
    if by_git is not None:
        return by_git
    return recorded_revision(root) or UNKNOWN


def record_text(root: Path = REPO_ROOT) -> str:
    return ("# Written by make pin (deploy/oci/revision.py): the commit that last changed the sources\n"
            "# of the module istio/ pins, and their digest, for a build git cannot tell it to.\n"
            "revision %s\nsources %s\n" % (revision(root), sources_digest(root)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO_ROOT, help="the checkout (default: this one)")
    ap.add_argument("--record", action="store_true", help="write deploy/oci/pinned-sources for these sources")
    ap.add_argument("--check", action="store_true", help="fail if deploy/oci/pinned-sources is not current")
    a = ap.parse_args(argv)
    record = a.root / RECORD
    if a.record or a.check:
        want = record_text(a.root)
        if a.check:
            if not record.is_file() or record.read_text() != want:
                print("%s does not record these sources (revision %s): run `make pin` and commit it"
                      % (RECORD, revision(a.root)), file=sys.stderr)
                return 1
            return 0
        if want.splitlines()[2] == "revision " + UNKNOWN:
            print("the sources are not committed (revision unknown): commit them, then run make pin", file=sys.stderr)
            return 1
        record.write_text(want)
        return 0
    print(revision(a.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
