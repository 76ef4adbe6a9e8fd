"""The README against the product: every problem the request-flow diagram (mermaid) names is one
the filter sends, with the status the filter gives it, so the picture cannot drift from the
contract table and `src/problem.rs`; every problem `src/problem.rs` defines is in the contract
table, and every counter `src/metrics.rs` defines is in the metrics section."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from idemkit import REPO_ROOT


def _mermaid_blocks() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
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
    text = (REPO_ROOT / "README.md").read_text()
    table = text[text.index("## HTTP contract"):text.index("### What the upstream")]
    for status, name in re.findall(r"\b([45]\d\d) ([a-z]+(?:-[a-z]+)+)", _mermaid_blocks()[0]):
        assert re.search(rf"\*\*{status}\*\* problem `{name}`", table), (
            f"the diagram says {status} {name}; the contract table does not")


def _section(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end)]


def test_every_problem_the_filter_sends_is_in_the_contract_table():
    text = (REPO_ROOT / "README.md").read_text()
    table = _section(text, "## HTTP contract", "### What the upstream")
    missing = sorted(n for n in _problem_names() if not re.search(rf"\*\*[45]\d\d\*\* problem `{n}`", table))
    assert not missing, f"problems src/problem.rs defines that the contract table lacks: {missing}"


def test_every_counter_is_in_the_metrics_section():
    source = (REPO_ROOT / "src" / "metrics.rs").read_text()
    names = set(re.findall(r'Counter::\w+ => "([a-z_]+)"', source))
    assert len(names) >= 20, names
    section = _section((REPO_ROOT / "README.md").read_text(), "## Metrics", "## Storage and memory")
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"counters src/metrics.rs defines that README's Metrics section lacks: {missing}"
    m = re.search(r"that is (\d+) series\s+per rule", section)
    assert m and int(m.group(1)) == len(names), (m and m.group(0), len(names))


# ---- the README's shell lines in bash and zsh (macOS's default shell) ------------------------

# curl, sleep and grep stand-ins: each call prints its arguments, one call per line, in one
# write (a line's background call must not interleave with the foreground one's); printf, since
# zsh's echo reads the backslashes in the arguments.
_STUBS = ("curl() { local s; s=$(printf '[%s]' \"$@\"); printf '%s\\n' \"$s\"; }; sleep() { :; }; "
          "grep() { local s; s=$(printf '[%s]' grep \"$@\"); printf '%s\\n' \"$s\"; }; ")


def _shell_lines() -> list[str]:
    """Every curl line a reader copies: the README's sh blocks, and the compose file's recipe."""
    text = (REPO_ROOT / "README.md").read_text()
    lines = [l for b in re.findall(r"```sh\n(.*?)```", text, re.S) for l in b.splitlines()
             if l.startswith("curl ")]
    compose = (REPO_ROOT / "deploy" / "compose" / "docker-compose.yaml").read_text()
    lines += [l[len("#   "):] for l in compose.splitlines() if l.startswith("#   curl ")]
    return lines


def _argv(shell: str, line: str) -> list[str]:
    proc = subprocess.run([shell, "-c", _STUBS + line + "; wait"], capture_output=True, text=True,
                          timeout=30, env={"PATH": os.environ["PATH"], "K": "order-1"})
    assert proc.returncode == 0 and not proc.stderr, (shell, line, proc.returncode, proc.stderr)
    return sorted(proc.stdout.splitlines())


def test_every_readme_curl_line_runs_the_same_in_bash_and_zsh():
    """An unquoted `?` is a glob in zsh ("no matches found"): every line must give curl the same
    arguments in both shells."""
    zsh = shutil.which("zsh")
    assert zsh, "zsh not found (`make deploy-test` installs it)"
    lines = _shell_lines()
    assert len(lines) >= 9 and any("?key=" in l for l in lines), lines
    for line in lines:
        assert _argv(zsh, line) == _argv("bash", line), line
