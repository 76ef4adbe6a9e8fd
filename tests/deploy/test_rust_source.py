"""Two rules of the Rust source that a compiler does not enforce (ARCHITECTURE.md, "Invariants
worth knowing").

- No two public types of one name: a `pub` (or `pub(crate)`, `pub(super)`) struct, enum, union,
  trait or type alias is named once in src/, so that a name in a review, a log line or a doc
  means one thing. Test code is left out, as in test_rust_imports.py: a test's helper may share a
  name.
- Every `unsafe` (block, fn, impl, trait, extern block) in src/, test code too, is preceded by a
  `// SAFETY:` comment saying why it is sound: the comment lines right above the line that
  holds it (attributes and doc lines may sit between) must contain `SAFETY:`.

Standard library only, like the citations: run by `make contract-check`, in `make check`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_rust_imports import SRC, _is_test, _module_of  # noqa: E402

_PUB_TYPE = re.compile(
    r"^\s*pub(?:\([a-z: ]+\))?\s+(?:struct|enum|union|trait|type)\s+([A-Za-z_][A-Za-z0-9_]*)", re.M)


def _product_code(src: Path):
    """(module path, its non-test text) for every file of src/ that is not test code."""
    for path in sorted(src.rglob("*.rs")):
        if _is_test(_module_of(path, src)):
            continue
        text = path.read_text()
        yield path.relative_to(src), text[: text.find("#[cfg(test)]")] if "#[cfg(test)]" in text else text


def duplicate_public_types(src: Path = SRC) -> dict[str, list[str]]:
    """Each public type name declared in more than one place, with where."""
    seen: dict[str, list[str]] = {}
    for path, text in _product_code(src):
        for m in _PUB_TYPE.finditer(text):
            seen.setdefault(m.group(1), []).append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}")
    return {name: places for name, places in seen.items() if len(places) > 1}


_UNSAFE = re.compile(r"\bunsafe\s*(?:\{|fn\b|impl\b|trait\b|extern\b)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def unsafe_without_safety_comment(src: Path = SRC) -> list[str]:
    """Each `unsafe` whose line is not preceded by a `// SAFETY:` comment, as path:line."""
    missing = []
    for path in sorted(src.rglob("*.rs")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = _STRING.sub('""', line).split("//", 1)[0]
            if not _UNSAFE.search(code):
                continue
            above = []
            for prev in reversed(lines[:i]):
                stripped = prev.strip()
                if not (stripped.startswith("//") or stripped.startswith("#[")):
                    break
                above.append(stripped)
            if not any(l.startswith("//") and not l.startswith("///") and "SAFETY:" in l for l in above):
                missing.append(f"{path.relative_to(src)}:{i + 1}")
    return missing


def test_no_two_public_types_of_one_name():
    found = duplicate_public_types()
    assert found == {}, f"public types of one name (rename one, in domain words): {found}"


def test_the_check_finds_a_duplicate_type(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "lib.rs").write_text("pub mod a;\npub mod b;\n")
    (tmp_path / "a" / "mod.rs").write_text("pub enum Move { A }\npub(crate) struct Kept;\n")
    (tmp_path / "b.rs").write_text(
        "/// pub struct Kept in a comment is no declaration\npub(super) type Move = u8;\nstruct Kept;\n"
        "#[cfg(test)]\nmod tests {\n    pub struct Kept;\n}\n")
    assert duplicate_public_types(tmp_path) == {"Move": ["a/mod.rs:1", "b.rs:2"]}


def test_every_unsafe_says_why_it_is_sound():
    missing = unsafe_without_safety_comment()
    assert missing == [], f"unsafe without a // SAFETY: comment above it: {missing}"


def test_the_check_finds_an_unsafe_without_its_reason(tmp_path):
    (tmp_path / "lib.rs").write_text(
        "fn a() {\n"
        "    // SAFETY: why.\n"
        "    unsafe { f() };\n"
        "    let s = \"unsafe { in a string }\"; // unsafe { in a comment }\n"
        "    // Some other comment.\n"
        "    check(unsafe { g() })\n"
        "}\n"
        "/// # Safety\n"
        "/// a doc is for callers, not the reason the body is sound\n"
        "unsafe fn h() {}\n"
        "// SAFETY: why.\n"
        "#[inline]\n"
        "unsafe fn k() {}\n")
    assert unsafe_without_safety_comment(tmp_path) == ["lib.rs:6", "lib.rs:10"]


def main() -> int:
    """The checks without pytest, for `make check`."""
    import tempfile

    tests = [
        test_no_two_public_types_of_one_name,
        test_the_check_finds_a_duplicate_type,
        test_every_unsafe_says_why_it_is_sound,
        test_the_check_finds_an_unsafe_without_its_reason,
    ]
    failed = 0
    for test in tests:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                test(*([Path(tmp)] if "tmp_path" in test.__code__.co_varnames else []))
        except AssertionError as e:
            failed += 1
            print(f"FAILED {test.__name__}: {e}")
    print(f"tests/deploy/test_rust_source.py: {len(tests) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
