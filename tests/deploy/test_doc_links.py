"""Every relative link in the repository's Markdown resolves to a file or directory that exists:
inline links `[text](target)` in every tracked `*.md` file, and paths below `docs/` named in prose
(`see docs/ETCD.md`): once a benchmark section writer replaced the README's three references to
docs/ETCD.md with a benchmark sentence, and nothing noticed. And since the README's details live in
docs/, a link's `#anchor` must name a heading of the file it points to (GitHub's heading ids), in
README.md, ARCHITECTURE.md and docs/*.md alike. The alerting rules' runbook links
(deploy/prometheus/alerts.yaml, `runbook_url`) are checked the same way: each names a section of
docs/OPERATIONS.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from idemkit import REPO_ROOT

ALERT_RULES = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"

# An inline link's target: up to the first ')' or whitespace-then-title; targets with spaces are
# taken whole up to ')', so a broken one is reported rather than skipped.
_LINK = re.compile(r"\]\(([^)\n]*)\)")
_DOCS_MENTION = re.compile(r"(?<![\w/.-])(docs/[^\s)\]`'\",;:]*)")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)


def _markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=REPO_ROOT, check=True,
                         capture_output=True).stdout.decode()
    return [REPO_ROOT / p for p in out.split("\0") if p]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _targets(text: str) -> list[str]:
    targets = []
    for raw in _LINK.findall(text):
        target = raw.strip()
        if target.startswith("<") and ">" in target:
            target = target[1:target.index(">")]
        elif re.search(r'\s+"[^"]*"$', target):  # [text](path "title")
            target = re.sub(r'\s+"[^"]*"$', "", target)
        if target and not _EXTERNAL.match(target):
            targets.append(target)
    return targets


def _anchors(md: Path) -> set[str]:
    """The ids GitHub gives the headings of `md`: lower-cased, punctuation but `-` and `_`
    dropped, spaces turned into `-`; a repeated id gets `-1`, `-2`, ..."""
    ids: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", _without_code_blocks(md.read_text()), re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def _broken(md: Path) -> list[str]:
    text = _without_code_blocks(md.read_text())
    broken = []
    for target in _targets(text) + re.findall(r"\]\((#[^)\s]*)\)", text):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path) if path else md
        if path and not dest.exists():
            broken.append(f"link ({target})")
        elif anchor and dest.suffix == ".md" and dest.is_file() and anchor not in _anchors(dest):
            broken.append(f"anchor ({target})")
    for mention in _DOCS_MENTION.findall(text):
        path = mention.rstrip(".").split("#", 1)[0]  # a link's anchor is checked above
        if not (REPO_ROOT / path).exists() and not (md.parent / path).exists():
            broken.append(f"mention {mention}")
    return broken


def test_there_is_markdown_to_check():
    names = {p.relative_to(REPO_ROOT).as_posix() for p in _markdown_files()}
    assert {"README.md", "ARCHITECTURE.md", "docs/ETCD.md", "docs/FINGERPRINT.md", "docs/CONFIGURATION.md",
            "docs/CONTRACT.md", "docs/DEPLOYMENT.md", "docs/OPERATIONS.md", "docs/SECURITY.md"} <= names, sorted(names)


def test_every_relative_link_in_the_markdown_resolves():
    problems = {p.relative_to(REPO_ROOT).as_posix(): b for p in _markdown_files() if (b := _broken(p))}
    assert not problems, problems


def test_the_checker_sees_a_broken_link():
    bad = "see [docs/ETCD.md](docs/new key 463 req/s (one member).md) and docs/new key.md.\n"
    assert _targets(bad) == ["docs/new key 463 req/s (one member"]
    assert _DOCS_MENTION.findall(bad) == ["docs/ETCD.md", "docs/new", "docs/new"]
    assert _targets("[a](https://x.example) [b](#anchor) [c](docs/ETCD.md#data-model)") == [
        "docs/ETCD.md#data-model"]


def test_the_checker_sees_a_broken_anchor(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# The etcd store (a fleet of Envoys)\n\n## What the upstream's answer does\n\n"
                   "```\n# not a heading\n```\n\n## Metrics\n\n## Metrics\n\n"
                   "[a](#the-etcd-store-a-fleet-of-envoys) [b](#what-the-upstreams-answer-does) "
                   "[c](#metrics-1) [d](doc.md#metrics) [e](#not-a-heading) [f](doc.md#storage) [g](#metrics-2)\n")
    assert _anchors(doc) == {"the-etcd-store-a-fleet-of-envoys", "what-the-upstreams-answer-does", "metrics",
                             "metrics-1"}
    assert _broken(doc) == ["anchor (doc.md#storage)", "anchor (#not-a-heading)", "anchor (#metrics-2)"]


def _runbook_links(rules: Path = ALERT_RULES) -> dict[str, str]:
    """{alert: its runbook_url}."""
    doc = yaml.safe_load(rules.read_text())
    return {r["alert"]: r.get("annotations", {}).get("runbook_url", "")
            for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _broken_runbooks(links: dict[str, str]) -> dict[str, str]:
    """The links that are not `docs/OPERATIONS.md#<a heading there>`."""
    operations = REPO_ROOT / "docs" / "OPERATIONS.md"
    broken = {}
    for alert, url in links.items():
        path, _, anchor = url.partition("#")
        if path != "docs/OPERATIONS.md" or not anchor or anchor not in _anchors(operations):
            broken[alert] = url
    return broken


def test_every_alert_runbook_link_names_a_section_of_operations():
    links = _runbook_links()
    assert len(links) >= 8, links
    assert not _broken_runbooks(links), _broken_runbooks(links)


def test_the_checker_sees_a_broken_runbook_link(tmp_path):
    rules = tmp_path / "alerts.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"alert": "Good", "expr": "up", "annotations": {"runbook_url": "docs/OPERATIONS.md#idempotencystoreerrors"}},
        {"alert": "NoSection", "expr": "up", "annotations": {"runbook_url": "docs/OPERATIONS.md#no-such-section"}},
        {"alert": "OtherFile", "expr": "up", "annotations": {"runbook_url": "docs/ETCD.md#data-model"}},
        {"alert": "None", "expr": "up"},
        {"record": "a:b", "expr": "up"}]}]}))
    assert _broken_runbooks(_runbook_links(rules)) == {
        "NoSection": "docs/OPERATIONS.md#no-such-section", "OtherFile": "docs/ETCD.md#data-model", "None": ""}
