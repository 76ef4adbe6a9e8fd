"""The source revision the module reports (deploy/oci/revision.py, docs/OPERATIONS.md "Which
version runs"): the commit that last changed the module's sources, the same in every clone of a
commit, whatever its depth, and `unknown` for sources no commit has. Each case builds a small
git repository of its own (git is what CI's clone came with); this checkout's record is checked
last: the pinned module must be rebuilt byte for byte by a clone that cannot ask git."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from idemkit import REPO_ROOT

SCRIPT = REPO_ROOT / "deploy" / "oci" / "revision.py"
sys.path.insert(0, str(SCRIPT.parent))
import revision  # noqa: E402 (deploy/oci/revision.py, standard library only)

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_NOSYSTEM": "1",
           "HOME": "/nonexistent"}


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, env=GIT_ENV, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _commit(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", message)
    return _git(root, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    (root / "src" / "store").mkdir(parents=True)
    (root / "src" / "lib.rs").write_text("pub fn f() {}\n")
    (root / "src" / "store" / "mod.rs").write_text("// a store\n")
    (root / "Cargo.toml").write_text('[package]\nname = "x"\nversion = "0.3.0-dev"\n')
    (root / "Cargo.lock").write_text("version = 3\n")
    (root / "rust-toolchain.toml").write_text('[toolchain]\nchannel = "1.0.0"\n')
    (root / "README.md").write_text("x\n")
    (root / "deploy" / "oci").mkdir(parents=True)
    _git(root, "init", "-q")
    return root


def test_the_revision_is_the_commit_that_last_changed_the_sources(repo):
    sources = _commit(repo, "the sources")
    assert revision.revision(repo) == sources[:12]
    # A commit of anything else (docs, the pin) keeps the revision, and so the module's bytes.
    (repo / "README.md").write_text("y\n")
    _commit(repo, "docs")
    assert revision.revision(repo) == sources[:12]
    # Every source path counts: the manifest, the lock file, the toolchain, a nested module.
    for path in ("Cargo.lock", "rust-toolchain.toml", "src/store/mod.rs"):
        (repo / path).write_text((repo / path).read_text() + "\n")
        assert revision.revision(repo) == "unknown", path
        again = _commit(repo, "change " + path)
        assert revision.revision(repo) == again[:12], path


@pytest.mark.parametrize("change", ["edit", "new file", "deleted"])
def test_sources_no_commit_has_are_unknown(repo, change):
    _commit(repo, "the sources")
    if change == "edit":
        (repo / "src" / "lib.rs").write_text("pub fn g() {}\n")
    elif change == "new file":
        (repo / "src" / "extra.rs").write_text("// not committed\n")
    else:
        (repo / "src" / "store" / "mod.rs").unlink()
    assert revision.revision(repo) == "unknown"
    assert subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo)], capture_output=True,
                          text=True, timeout=30).stdout == "unknown\n"
    # Nothing is recorded for them: a pin would not survive their commit.
    refused = subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), "--record"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "commit them" in refused.stderr
    assert not (repo / revision.RECORD).exists()


def _pinned(repo: Path) -> str:
    """The sources committed, then the record written and committed after them, as make pin does."""
    sources = _commit(repo, "the sources")
    assert subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), "--record"], timeout=30).returncode == 0
    _commit(repo, "pin")
    assert subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), "--check"], timeout=30).returncode == 0
    return sources[:12]


def test_a_shallow_clone_takes_the_revision_its_record_names(repo, tmp_path):
    sources = _pinned(repo)
    clone = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", repo.as_uri(), str(clone)], check=True, env=GIT_ENV,
                   timeout=30)
    assert _git(clone, "rev-parse", "--is-shallow-repository") == "true"
    # git alone would name the pin commit (in a clone of depth 1 it looks as if it changed every file).
    assert _git(clone, "log", "-1", "--format=%H", "--", "src")[:12] != sources
    assert revision.revision(clone) == sources
    # Sources changed in the clone are no longer the recorded ones.
    (clone / "src" / "lib.rs").write_text("pub fn g() {}\n")
    assert revision.revision(clone) == "unknown"


def test_a_source_archive_takes_the_revision_its_record_names(repo, tmp_path):
    sources = _pinned(repo)
    archive = tmp_path / "archive"
    shutil.copytree(repo, archive, ignore=shutil.ignore_patterns(".git"))
    assert revision.revision(archive) == sources
    (archive / "Cargo.lock").write_text("version = 4\n")
    assert revision.revision(archive) == "unknown"


def test_a_stale_record_fails_the_check_naming_make_pin(repo):
    _pinned(repo)
    (repo / "src" / "lib.rs").write_text("pub fn g() {}\n")
    _commit(repo, "new code, not pinned")
    stale = subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), "--check"], capture_output=True,
                           text=True, timeout=30)
    assert stale.returncode == 1 and "make pin" in stale.stderr


def test_this_checkout_records_the_sources_of_the_pinned_module():
    """deploy/oci/pinned-sources names the sources' commit and digest, as make pin wrote them with
    the pin (test_oci.py checks the digest): a shallow clone of this commit builds the same module."""
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    fields = revision.read_record(REPO_ROOT)
    assert fields["revision"] != "unknown" and len(fields["revision"]) == 12, fields
