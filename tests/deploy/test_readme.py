"""The README and docs/ against the product: every problem the request-flow diagram (mermaid)
names is one the filter sends, with the status the filter gives it, so the picture cannot drift
from the contract table and `src/problem.rs`; every problem `src/problem.rs` defines is in the
README's contract table, and every counter `src/metrics.rs` defines is in the metrics section of
docs/OPERATIONS.md. And: the README fits on a screen, the rest is in docs/, and
the etcd store's fields are tabled in one place."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from idemkit import REPO_ROOT

README = REPO_ROOT / "README.md"
OPERATIONS = REPO_ROOT / "docs" / "OPERATIONS.md"
CONFIGURATION = REPO_ROOT / "docs" / "CONFIGURATION.md"


def _docs() -> list:
    """The README and every document under docs/."""
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _mermaid_blocks() -> list[str]:
    text = README.read_text()
    return re.findall(r"```mermaid\n(.*?)```", text, flags=re.S)


def _problem_names() -> set[str]:
    source = (REPO_ROOT / "src" / "problem.rs").read_text()
    return set(re.findall(r'Kind::\w+ => "([a-z-]+)"', source))


def test_readme_has_one_request_flow_diagram():
    blocks = _mermaid_blocks()
    assert len(blocks) == 1, "README.md should carry one mermaid request-flow diagram"
    assert blocks[0].lstrip().startswith("flowchart"), blocks[0][:80]


def test_every_problem_in_the_diagram_is_one_the_filter_sends():
    names = _problem_names()
    assert len(names) >= 8, f"problem kinds not found in src/problem.rs: {names}"
    diagram = _mermaid_blocks()[0]
    # "<status> <problem-name>" pairs, e.g. "409 request-in-flight"
    shown = re.findall(r"\b([45]\d\d) ([a-z]+(?:-[a-z]+)+)", diagram)
    assert shown, "the diagram names no problem answers"
    unknown = sorted({name for _, name in shown} - names)
    assert not unknown, f"the diagram names problems the filter never sends: {unknown}"


def test_statuses_in_the_diagram_match_the_contract_table():
    table = _h2_section(README.read_text(), "## HTTP contract")
    for status, name in re.findall(r"\b([45]\d\d) ([a-z]+(?:-[a-z]+)+)", _mermaid_blocks()[0]):
        assert re.search(rf"\*\*{status}\*\* problem `{name}`", table), (
            f"the diagram says {status} {name}; the contract table does not")


def _h2_section(text: str, heading: str) -> str:
    """From the line `heading` to the next `## ` heading (or the end of the text)."""
    start = text.index("\n" + heading + "\n") + 1
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def test_every_problem_the_filter_sends_is_in_the_contract_table():
    table = _h2_section(README.read_text(), "## HTTP contract")
    missing = sorted(n for n in _problem_names() if not re.search(rf"\*\*[45]\d\d\*\* problem `{n}`", table))
    assert not missing, f"problems src/problem.rs defines that the contract table lacks: {missing}"


def test_every_counter_is_in_the_metrics_section():
    source = (REPO_ROOT / "src" / "metrics.rs").read_text()
    names = set(re.findall(r'Counter::\w+ => "([a-z_]+)"', source))
    assert len(names) >= 20, names
    section = _h2_section(OPERATIONS.read_text(), "## Metrics")
    assert "## Storage and memory" not in section and len(section) > 2000, section[:200]
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"counters src/metrics.rs defines that the Metrics section of docs/OPERATIONS.md lacks: {missing}"
    m = re.search(r"that is (\d+) series\s+per rule", section)
    assert m and int(m.group(1)) == len(names), (m and m.group(0), len(names))


def test_the_readme_fits_on_a_screen_and_links_the_docs():
    """The README holds what the filter is, the quick start, the contract
    table and links; the rest lives in docs/, and the README links every document there."""
    text = README.read_text()
    assert len(text.splitlines()) < 250, len(text.splitlines())
    for doc in _docs()[1:]:
        assert f"](docs/{doc.name})" in text, f"README.md does not link docs/{doc.name}"


def test_the_etcd_store_fields_are_tabled_once_in_the_configuration_doc():
    """One table of the etcd store's fields, in docs/CONFIGURATION.md; docs/ETCD.md links it."""
    fields = ("cluster", "prefix", "timeout", "on_error", "replay_cache")
    rows = {}
    for doc in [*_docs(), REPO_ROOT / "ARCHITECTURE.md"]:
        for line in doc.read_text().splitlines():
            m = re.match(r"\|\s*`(?:store\.)?([a-z_]+)`\s*\|", line)
            if m and m.group(1) in fields:
                rows.setdefault(m.group(1), []).append(doc.relative_to(REPO_ROOT).as_posix())
    assert rows == {f: ["docs/CONFIGURATION.md"] for f in fields}, rows
    assert "](CONFIGURATION.md#the-etcd-store)" in (REPO_ROOT / "docs" / "ETCD.md").read_text()
    assert "\n## The etcd store\n" in CONFIGURATION.read_text()


# ---- the docs' shell lines in bash and zsh (macOS's default shell) ---------------------------

# curl, sleep and grep stand-ins: each call prints its arguments, one call per line, in one
# write (a line's background call must not interleave with the foreground one's); printf, since
# zsh's echo reads the backslashes in the arguments.
_STUBS = ("curl() { local s; s=$(printf '[%s]' \"$@\"); printf '%s\\n' \"$s\"; }; sleep() { :; }; "
          "grep() { local s; s=$(printf '[%s]' grep \"$@\"); printf '%s\\n' \"$s\"; }; ")


def _shell_lines() -> list[str]:
    """Every curl line a reader copies: the sh blocks of the README and of docs/*.md (the
    compose recipe is docs/DEPLOYMENT.md's), and the compose file's recipe."""
    lines = [l for doc in _docs() for b in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S)
             for l in b.splitlines() if l.startswith("curl ")]
    compose = (REPO_ROOT / "deploy" / "compose" / "docker-compose.yaml").read_text()
    lines += [l[len("#   "):] for l in compose.splitlines() if l.startswith("#   curl ")]
    return lines


def _argv(shell: str, line: str) -> list[str]:
    proc = subprocess.run([shell, "-c", _STUBS + line + "; wait"], capture_output=True, text=True,
                          timeout=30, env={"PATH": os.environ["PATH"], "K": "order-1"})
    assert proc.returncode == 0 and not proc.stderr, (shell, line, proc.returncode, proc.stderr)
    return sorted(proc.stdout.splitlines())


def test_every_curl_line_of_the_docs_runs_the_same_in_bash_and_zsh():
    """An unquoted `?` is a glob in zsh ("no matches found"): every line must give curl the same
    arguments in both shells."""
    zsh = shutil.which("zsh")
    assert zsh, "zsh not found (`make deploy-test` installs it)"
    lines = _shell_lines()
    assert len(lines) >= 9 and any("?key=" in l for l in lines), lines
    for line in lines:
        assert _argv(zsh, line) == _argv("bash", line), line
