"""Releases (CONTRIBUTING.md, "Releasing"): one version everywhere. Cargo.toml's package version
is the newest release of CHANGELOG.md (Keep a Changelog form: `## [Unreleased]` on top, then
`## [X.Y.Z] - YYYY-MM-DD`, newest first, sections of its six kinds), the tag `make oci` gives the
image, the tag of every image reference in istio/ (whose digest test_oci.py checks), the version
the shipped docs tell to push, and what the module reports (src/build_info.rs takes it from the
build; tests/e2e/operations/test_build_info.py reads it from a real Envoy). Breaking changes are
marked BREAKING in the CHANGELOG and where they are documented, and no document speaks of
"this release" any more, which names no version."""

from __future__ import annotations

import datetime
import json
import re
import subprocess

from idemkit import REPO_ROOT
from manifests import ISTIO_DIR, crate_version

CHANGELOG = REPO_ROOT / "CHANGELOG.md"
CONFIGURATION = REPO_ROOT / "docs" / "CONFIGURATION.md"
OPERATIONS = REPO_ROOT / "docs" / "OPERATIONS.md"
SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
SEMVER = r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"


def _releases() -> list[tuple[str, str, str]]:
    """[(version, date, body)] of CHANGELOG.md, newest first."""
    text = CHANGELOG.read_text()
    heads = list(re.finditer(r"^## \[([^\]]+)\](?: - (\S+))?$", text, re.M))
    assert heads and heads[0].group(1) == "Unreleased" and heads[0].group(2) is None, \
        "CHANGELOG.md must open with `## [Unreleased]`"
    out = []
    for i, m in enumerate(heads[1:], 1):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        out.append((m.group(1), m.group(2), text[m.end():end]))
    return out


def _key(version: str) -> tuple[int, ...]:
    m = re.fullmatch(SEMVER, version)
    assert m, "not MAJOR.MINOR.PATCH: %s" % version
    return tuple(int(g) for g in m.groups())


def test_the_changelog_is_in_keep_a_changelog_form():
    releases = _releases()
    assert len(releases) >= 2
    keys = [_key(v) for v, _, _ in releases]
    assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys), keys
    dates = [datetime.date.fromisoformat(d) for _, d, _ in releases]
    assert dates == sorted(dates, reverse=True), dates
    for version, _, body in releases:
        kinds = re.findall(r"^### (.+)$", body, re.M)
        assert kinds and set(kinds) <= SECTIONS, (version, kinds)
        assert len(kinds) == len(set(kinds)), (version, kinds)
    unreleased = CHANGELOG.read_text().split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    assert set(re.findall(r"^### (.+)$", unreleased, re.M)) <= SECTIONS


def test_one_version_everywhere(oci_layout):
    version = crate_version()
    newest = _releases()[0][0]
    # A release, or between releases the next one's pre-release: a build of unreleased changes
    # never reports a released version (issue 47).
    dev = re.fullmatch(SEMVER + r"-dev", version)
    assert version == newest or (dev and tuple(int(g) for g in dev.groups()) > _key(newest)), \
        "Cargo.toml's version %s is neither CHANGELOG.md's newest release %s nor a later -dev" % (version, newest)
    if dev:
        unreleased = CHANGELOG.read_text().split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
        assert re.search(r"^- ", unreleased, re.M), "a -dev version with nothing under [Unreleased]"
    # Cargo.lock and the fuzz workspace's lock record the same version of the package.
    for lock in ("Cargo.lock", "fuzz/Cargo.lock"):
        m = re.search(r'name = "idempotency-filter"\nversion = "([^"]+)"', (REPO_ROOT / lock).read_text())
        assert m and m.group(1) == version, lock
    # The image make oci wrote, its tag and its version annotation.
    index = json.loads((oci_layout / "index.json").read_text())
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == [version]
    # Every image reference in istio/ carries the tag (and the digest: test_oci.py).
    for path in sorted(ISTIO_DIR.glob("*/*.yaml")):
        tags = re.findall(r"oci://\S*?/idempotency-filter:([^@\s]+)@sha256:", path.read_text())
        assert tags and set(tags) == {version}, (path, tags)
    # What the docs tell to build and push: the newest release (from its tag's checkout).
    for doc in ("docs/DEPLOYMENT.md", "deploy/oci/build.py"):
        text = (REPO_ROOT / doc).read_text()
        named = re.findall(r"(?:oci:dist/oci:|idempotency-filter:)(%s)(?![\w.-])" % SEMVER.replace("(", "(?:"), text)
        assert named and set(named) == {newest}, (doc, named)
    # The module reports the version it was built as.
    source = (REPO_ROOT / "src" / "build_info.rs").read_text()
    assert 'pub const VERSION: &str = env!("CARGO_PKG_VERSION");' in source


def test_breaking_changes_are_marked_in_the_changelog_and_the_docs():
    _, _, newest = next(r for r in _releases() if r[0] == "0.2.0")
    breaking = re.findall(r"^- \*\*BREAKING[^*]*\*\*", newest, re.M)
    assert len(breaking) >= 5, breaking
    for what in ("unknown_outcome", "quotas", "claim", "router control headers", "metric names"):
        assert any(what in b for b in breaking), what
    config = CONFIGURATION.read_text()
    assert "\n## Breaking changes\n" in config
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)`.*$", config, re.M)}
    for field in ("routes[].unknown_outcome", "quota.per_tenant", "principal.jwt_payload"):
        assert "**BREAKING (0.2.0)" in rows[field], field
    assert "**Changed names (BREAKING in 0.2.0" in OPERATIONS.read_text()
    # "Before this release" names no version: every such note says which one.
    docs = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=REPO_ROOT, check=True,
                          capture_output=True).stdout.decode().split("\0")
    vague = [d for d in docs if d and "this release" in (REPO_ROOT / d).read_text()]
    assert not vague, vague
