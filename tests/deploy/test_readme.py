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

import pytest

from idemkit import REPO_ROOT
from idemkit.terminal import PASTE_MODES, SHELLS, Terminal

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
    # The shadow outcomes (`shadow_*`) exist only in shadow mode: the per-rule count is the rest,
    # and the section says both.
    shadow = {n for n in names if n.startswith("shadow_")}
    m = re.search(r"that is (\d+) series\s+per rule \((\d+) in shadow mode", section)
    assert m and (int(m.group(1)), int(m.group(2))) == (len(names - shadow), len(names)), (m and m.group(0), len(names))


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


# ---- the docs' shell blocks, pasted whole into bash and zsh (macOS's default shell) -----------

# Where a reader finds shell blocks to paste: the top-level documents and docs/.
SHELL_DOCS = [README, REPO_ROOT / "ARCHITECTURE.md", REPO_ROOT / "BENCHMARKS.md", *_docs()[1:]]
_SHELL_FENCE = re.compile(r"^```(?:sh|bash|shell|console|zsh)\n(.*?)^```", re.M | re.S)
# The commands the docs' blocks run, each a stand-in that appends its arguments to $ARGV_LOG, one
# call a line, in one write (a background call's line cannot interleave with the foreground
# one's); printf, since zsh's echo reads the backslashes in the arguments. A block that runs
# anything else fails the test (command not found) until its command has a stand-in here.
_STUBBED = ("make", "docker", "skopeo", "curl", "sleep", "grep", "kubectl", "python3")
_STUBS = ("_argv() { local s; s=$(printf '[%s]' \"$@\"); printf '%s\\n' \"$s\" >> \"$ARGV_LOG\"; }; "
          + " ".join("%s() { _argv %s \"$@\"; };" % (c, c) for c in _STUBBED))
# $RANDOM seeded, so a block's `K=order-$RANDOM` gives the same key pasted as run as a script;
# each shell has its own sequence, and its first values are named in the comparison.
_SEED = "RANDOM=4242"


def _shell_blocks() -> list[tuple[str, str]]:
    """(where, text) of every shell block in the docs."""
    out = []
    for doc in SHELL_DOCS:
        text = doc.read_text()
        for n, m in enumerate(_SHELL_FENCE.finditer(text), 1):
            line = text.count("\n", 0, m.start()) + 1
            out.append(("%s:%d (block %d)" % (doc.relative_to(REPO_ROOT), line, n), m.group(1)))
    return out


def _random_names(shell: str) -> dict[str, str]:
    out = subprocess.run([shell, "-c", _SEED + "; echo $RANDOM $RANDOM $RANDOM"], capture_output=True,
                         text=True, timeout=10, check=True).stdout.split()
    return {value: "$RANDOM%d" % i for i, value in enumerate(out, 1)}


def _calls(log, shell: str) -> list[str]:
    """The stand-ins' lines, sorted (a background call and a foreground one race), the seeded
    random values named."""
    names = _random_names(shell)
    text = log.read_text() if log.exists() else ""
    text = re.sub(r"(?<!\d)\d+(?!\d)", lambda m: names.get(m.group(0), m.group(0)), text)
    return sorted(text.splitlines())


def _as_a_script(block: str, log) -> list[str]:
    """What `block` runs as a bash script (comments are comments there): the reference."""
    proc = subprocess.run(["bash", "-c", _SEED + "; " + _STUBS + "\n" + block + "\nwait"],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "ARGV_LOG": str(log)})
    assert proc.returncode == 0 and not proc.stderr, (block, proc.returncode, proc.stderr)
    return _calls(log, "bash")


def test_the_docs_shell_blocks_are_found():
    blocks = _shell_blocks()
    where = [w for w, _ in blocks]
    assert len(blocks) >= 4, where
    assert any(w.startswith("README.md") and "K=order-$RANDOM" in b for w, b in blocks), where
    assert any(w.startswith("docs/DEPLOYMENT.md") and "docker compose" in b for w, b in blocks), where
    # An unquoted `?` is a glob in zsh ("no matches found"): one line at least holds one, quoted.
    assert any("?key=" in b for _, b in blocks), where
    # A block of commands without a shell tag would escape this test.
    for doc in SHELL_DOCS:
        for m in re.finditer(r"^```\n(.*?)^```", doc.read_text(), re.M | re.S):
            assert not re.search(r"^\s*(?:\$ )?(?:%s) " % "|".join(_STUBBED), m.group(1), re.M), (
                doc, m.group(1))


def test_the_command_lines_in_the_shipped_files_headers_carry_no_comment():
    """The command lines a reader copies from a shipped file's header (`#   make run`) hold no
    `# ...` of their own: pasted into an interactive zsh, its words would be arguments. What
    they do is said in the prose above them."""
    files = [*sorted((REPO_ROOT / "envoy").glob("*.yaml")), *sorted((REPO_ROOT / "deploy").rglob("*.yaml")),
             *sorted((REPO_ROOT / "istio").rglob("*.yaml"))]
    commands = re.compile(r"^#\s{2,}((?:make|curl|docker|kubectl|istioctl|skopeo|etcd) .*)$", re.M)
    found = {f.relative_to(REPO_ROOT).as_posix(): commands.findall(f.read_text()) for f in files}
    assert sum(map(len, found.values())) >= 8, found
    commented = [(f, line) for f, lines in found.items() for line in lines if " #" in line]
    assert not commented, commented


@pytest.mark.parametrize("mode", PASTE_MODES)
@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_every_shell_block_of_the_docs_pastes_whole_into_an_interactive_shell(shell, mode, tmp_path):
    """Every shell block of the docs pasted whole, as a user pastes it, into `bash --norc -i` and
    `zsh -f -i` (no `interactivecomments`: a `#` there starts no comment, so `make run  # ...`
    gives make the words of the comment, and an apostrophe in it opens a quote that swallows
    the next lines), typed and as a bracketed paste, through a pseudo-terminal: the shell
    reports no error and runs exactly the commands, with exactly the arguments, that the block
    runs as a bash script. The commands are stand-ins (no Docker here, no registry); what the
    quick start's lines answer against `make run`, pasted the same way, is
    tests/e2e/operations/test_demo.py's."""
    if shutil.which(SHELLS[shell][0]) is None:
        pytest.fail("%s not found (`make zsh` installs it)" % shell, pytrace=False)
    failures = []
    for n, (where, block) in enumerate(_shell_blocks()):
        expected = _as_a_script(block, tmp_path / ("script-%d.log" % n))
        log = tmp_path / ("pasted-%d.log" % n)
        with Terminal(shell, env={"ARGV_LOG": str(log)}) as term:
            term.type(_SEED + "; " + _STUBS + "\n")
            try:
                term.paste_block(block, bracketed=mode == "bracketed", timeout=15)
            except AssertionError as exc:
                failures.append("%s: %s" % (where, exc))
                continue
            errors = term.errors()
            got = _calls(log, SHELLS[shell][0])
            if errors or got != expected:
                failures.append("%s:\n  errors: %s\n  ran:      %s\n  expected: %s\n  the terminal showed:\n%s"
                                % (where, errors, got, expected, term.text()))
    assert not failures, "\n\n".join(failures)
