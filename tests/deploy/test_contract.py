"""The contract's promises and the tests that prove them. docs/CONTRACT.md numbers the promises
(C1, C2, ...) in its table "The promises", one row per row of the README's contract table, which
carries the same IDs in its first column. A test that proves a promise cites its ID in a
docstring (Python: module, class or function; Rust: `///` or `//!` in a test file, tests/*.rs,
tests/*/tests/*.rs (a workspace member's own tests, as tests/module-abi's), src/**/tests/*.rs or
src/**/tests.rs, or inside a `#[cfg(test)] mod tests { ... }` block of any other source file, whose
production docs around it never count).

Checked here: both tables hold the same IDs in the same order, each once; every ID is cited by at
least one test; no test cites an ID that is not in the tables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from idemkit import REPO_ROOT

README = REPO_ROOT / "README.md"
CONTRACT = REPO_ROOT / "docs" / "CONTRACT.md"

_ID = re.compile(r"\bC\d+\b")
_ROW_ID = re.compile(r"^\|\s*(C\d+)\s*\|", re.M)


def _section(text: str, heading: str) -> str:
    """From the line `heading` to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index("\n" + heading + "\n") + 1
    ends = [i for i in (text.find("\n" + "#" * n + " ", start + len(heading)) for n in range(1, len(level) + 1))
            if i >= 0]
    return text[start:min(ends) if ends else len(text)]


def readme_ids() -> list[str]:
    return _ROW_ID.findall(_section(README.read_text(), "## HTTP contract"))


def contract_ids() -> list[str]:
    return _ROW_ID.findall(_section(CONTRACT.read_text(), "## The promises"))


def _python_docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return [d for n in nodes if (d := ast.get_docstring(n, clean=False))]


def _rust_doc_lines(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\s*//[/!](.*)$", text, re.M)]


def _rust_docs(path: Path) -> list[str]:
    return _rust_doc_lines(path.read_text())


# What may stand between `#[cfg(test)]` and the `mod` it gates: more attributes (each on one
# line, as rustfmt leaves them, with a comment after it or not), plain comments, a visibility.
_TEST_MOD = re.compile(r"#\[cfg\(test\)\](?:\s|#\[[^\n]*\]|//[^\n]*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def _block_end(text: str, start: int) -> int:
    """The index just past the `}` that closes the `{` at `start`, skipping the braces of Rust's
    comments (line and nested block), strings (raw and byte ones too) and char literals."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if text.startswith("/*", i):
            nest, i = 1, i + 2
            while i < n and nest:
                if text.startswith("/*", i):
                    nest, i = nest + 1, i + 2
                elif text.startswith("*/", i):
                    nest, i = nest - 1, i + 2
                else:
                    i += 1
            continue
        raw = re.compile(r"b?r(#*)\"").match(text, i)
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + raw.group(1)
            i = text.find(close, raw.end())
            i = n if i < 0 else i + len(close)
            continue
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        if c == "'":
            char = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'").match(text, i)
            i = char.end() if char else i + 1  # else a lifetime or a label: 'a
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"no closing brace for the block at {start}")


def _inline_test_docs(path: Path) -> list[str]:
    """The doc lines inside `path`'s inline test modules (`#[cfg(test)] mod tests { ... }`),
    none of the file's other docs."""
    text = path.read_text()
    docs: list[str] = []
    i = 0
    while m := _TEST_MOD.search(text, i):
        end = _block_end(text, m.end() - 1)
        docs += _rust_doc_lines(text[m.end():end - 1])
        i = end
    return docs


_PATH_TEST_MOD = re.compile(r'#\[cfg\(test\)\]\s*#\[path\s*=\s*"([^"]+)"\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*;')


def _path_test_modules(src: Path) -> list[Path]:
    """The files that `#[cfg(test)] #[path = "..."] mod tests;` declarations in the Rust sources
    under `src` name (relative to the declaring file, as rustc reads a non-mod.rs path): test
    modules whatever their file is called."""
    return sorted({(path.parent / m.group(1)).resolve()
                   for path in src.rglob("*.rs") for m in _PATH_TEST_MOD.finditer(path.read_text())})


def _test_files() -> list[Path]:
    tests = REPO_ROOT / "tests"
    src = REPO_ROOT / "src"
    python = [p for p in tests.rglob("*.py") if "node_modules" not in p.parts and ".logs" not in p.parts]
    rust = {*tests.glob("*.rs"), *tests.glob("*/tests/*.rs"), *src.rglob("tests/*.rs"), *src.rglob("tests.rs"),
            *_path_test_modules(src)}
    return sorted(python + list(rust))


def _docs_by_file() -> dict[Path, list[str]]:
    """Every test docstring, by the file it is in: the test files' docs whole, and the docs of
    the inline test modules of every other Rust source file."""
    whole = [p for p in _test_files() if p != Path(__file__).resolve()]
    docs = {p: _python_docstrings(p) if p.suffix == ".py" else _rust_docs(p) for p in whole}
    for path in sorted((REPO_ROOT / "src").rglob("*.rs")):
        if path not in docs and (inline := _inline_test_docs(path)):
            docs[path] = inline
    return docs


def citations() -> dict[str, set[str]]:
    """ID -> the test files (relative to the repository) whose docstrings cite it."""
    cited: dict[str, set[str]] = {}
    for path, docs in _docs_by_file().items():
        for ident in {i for doc in docs for i in _ID.findall(doc)}:
            cited.setdefault(ident, set()).add(path.relative_to(REPO_ROOT).as_posix())
    return cited


def test_the_readme_and_the_contract_doc_number_the_same_promises_in_the_same_order():
    ids = contract_ids()
    assert len(ids) >= 20, ids
    assert len(set(ids)) == len(ids), f"an ID twice in docs/CONTRACT.md: {ids}"
    assert readme_ids() == ids, (readme_ids(), ids)


def test_the_readme_table_gives_every_row_an_id():
    table = _section(README.read_text(), "## HTTP contract")
    rows = [l for l in table.splitlines() if l.startswith("|") and not l.startswith("|---")][1:]
    assert len(rows) == len(readme_ids()), [r[:40] for r in rows if not _ROW_ID.match(r)]


def test_every_promise_is_cited_by_a_test():
    cited = citations()
    missing = [i for i in contract_ids() if i not in cited]
    assert not missing, f"promises no test docstring cites: {missing}"


def test_no_test_cites_a_promise_that_does_not_exist():
    known = set(contract_ids())
    unknown = {i: sorted(files) for i, files in citations().items() if i not in known}
    assert not unknown, f"tests cite IDs docs/CONTRACT.md does not define: {unknown}"


def test_the_checker_reads_docstrings_only(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text('"""C3, C7: module."""\nX = "C99"  # C98\n\n'
                      'def test_a():\n    """C9: a test."""\n\nclass T:\n    """C10"""\n')
    assert sorted(i for d in _python_docstrings(module) for i in _ID.findall(d)) == ["C10", "C3", "C7", "C9"]
    rust = tmp_path / "t.rs"
    rust.write_text("//! C1: file\n/// C21: a test\n// C5 is a comment\nfn t() { let _ = \"C6\"; }\n")
    assert [i for d in _rust_docs(rust) for i in _ID.findall(d)] == ["C1", "C21"]


def test_the_checker_reads_the_docs_of_inline_test_modules_only(tmp_path):
    """Issue 32: a source file's own `#[cfg(test)] mod tests { ... }` is a test module as much as
    a test file is; the production docs around it (and a `{` or `}` in its strings, chars and
    comments) are not."""
    src = tmp_path / "lib.rs"
    src.write_text(
        "//! C1: the module's own doc\n"
        "/// C2: a production function\n"
        "fn f() -> &'static str { \"}}\" }\n"
        "#[cfg(test)]\n"
        "#[allow(clippy::unwrap_used)] // a failing unwrap is a failing test\n"
        "pub(crate) mod tests {\n"
        "    //! C3: the test module's doc\n"
        "    const J: &str = r#\"{\"a\":\"}\"}\"#;\n"
        "    const C: char = '}';\n"
        "    const E: char = '\\'';\n"
        "    fn g<'a>(x: &'a str) -> &'a str { /* } /* { */ } */ x } // }\n"
        "    /// C4: a test\n"
        "    #[test]\n"
        "    fn t() { let _ = (J, C, E, b\"}\", br\"}\", \"\\\"}\"); }\n"
        "}\n"
        "/// C5: production again\n"
        "fn h() {}\n"
        "#[cfg(test)]\n"
        "mod more {\n"
        "    /// C6: a second test module\n"
        "    #[test]\n"
        "    fn u() {}\n"
        "}\n"
        "#[cfg(test)]\n"
        "mod tests_in_a_file;\n"
        "/// C7: after a test module in a file of its own\n"
        "fn k() {}\n")
    assert [i for d in _inline_test_docs(src) for i in _ID.findall(d)] == ["C3", "C4", "C6"]


def test_the_checker_reads_test_modules_named_by_a_path_attribute(tmp_path):
    """Issue 32: a test module in a file `#[path]` names (`watch_tests.rs`) is read like any
    test file; a `#[path]` module outside `#[cfg(test)]` is production code."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "watch.rs").write_text(
        '#[cfg(test)]\n#[path = "watch_tests.rs"]\nmod tests;\n#[path = "wire.rs"]\nmod wire;\n')
    assert _path_test_modules(tmp_path) == [(tmp_path / "store" / "watch_tests.rs").resolve()]
    found = {p.name for p in _test_files()}
    assert {"watch_tests.rs", "grpc_tests.rs"} <= found, sorted(found)


def test_the_checker_reads_the_tests_of_a_workspace_member_under_tests():
    """Issue 48: tests/module-abi (the built module in an emulated Envoy) is a workspace member
    of its own; the promises its tests cite are checked like any test file's."""
    found = {p.relative_to(REPO_ROOT).as_posix() for p in _test_files()}
    assert "tests/module-abi/tests/module.rs" in found, sorted(found)


def test_the_checker_reads_every_inline_test_module_of_the_sources():
    """Every `#[cfg(test)] mod ... {` of src/ is found and its block closed: the count of
    modules read is the count of their openings, each block ends where rustfmt's closing brace
    of the module stands (a `}` alone in the first column)."""
    modules = 0
    for path in sorted((REPO_ROOT / "src").rglob("*.rs")):
        text = path.read_text()
        for m in _TEST_MOD.finditer(text):
            end = _block_end(text, m.end() - 1)
            assert text[:end].endswith("\n}"), f"{path}: the block at {m.start()} ends at {end}"
            modules += 1
    assert modules >= 20, modules


_TEST_REF = re.compile(r"`(test_[a-z0-9_]+\.py)::(test_[a-z0-9_]+)`")


def detached_bypass_rows() -> list[tuple[str, list[tuple[str, str]]]]:
    """The rows of the Detached execution section's bypass table: (what is bypassed, the tests
    named beside it)."""
    section = _section(CONTRACT.read_text(), "## Detached execution")
    table = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| bypassed")]
    return [(row.split("|")[1].strip(), _TEST_REF.findall(row.split("|")[3])) for row in table]


def test_every_bypass_of_a_detached_call_names_a_test_that_exists():
    """Issue 30: the contract lists everything a detached call bypasses, each with the e2e test
    that shows it on a real Envoy; a renamed or deleted test must not leave a row unproved."""
    rows = detached_bypass_rows()
    assert len(rows) >= 8, rows
    contract_tests = REPO_ROOT / "tests" / "e2e" / "contract"
    for bypassed, tests in rows:
        assert tests, f"no test named for {bypassed!r}"
        for module, name in tests:
            path = contract_tests / module
            assert path.is_file(), f"{bypassed!r}: no {path}"
            defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{bypassed!r}: {module} defines no {name}"
    bypassed = " ".join(b for b, _ in rows)
    for must in ("retries", "timeout", "rewrite", "request_headers_to_add", "filter", "trailers", "32 MiB", "cut"):
        assert must in bypassed, f"the bypass table has no row on {must!r}"


def main() -> int:
    """Every test here without pytest, for `make check` (`make contract-check`): the fast loop
    installs nothing (tests/deploy/test_platforms.py), and these checks need only the standard
    library. `make deploy-test` runs them under pytest as well."""
    import inspect
    import tempfile
    import traceback

    tests = [(name, fn) for name, fn in globals().items() if name.startswith("test_") and callable(fn)]
    failed = []
    for name, fn in tests:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                fn(*[Path(tmp) for p in inspect.signature(fn).parameters if p == "tmp_path"])
        except Exception:  # noqa: BLE001 (an assertion or any other error fails the test)
            failed.append(name)
            print(f"FAILED {name}\n{traceback.format_exc()}")
    print(f"{Path(__file__).relative_to(REPO_ROOT)}: {len(tests) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
