"""No import circle among the filter's Rust modules (ARCHITECTURE.md, "Imports run one way").

A module is one file of src/ (`foo/mod.rs` and `foo.rs` are module `foo`). Module A imports B when
a `use` (or a path in the code) of A's non-test part names `crate::`, `super::` or `self::` items
that resolve to B's file, B being neither A's ancestor nor its descendant: a child uses its
parent's types and a parent declares its children, which is nesting, not a circle. Test code
(`#[cfg(test)]` onwards, `tests/` directories, `*_tests.rs`) and the `testing` kit are left out:
they may import anything. A circle among the rest is refused, with the modules in it; so is an import that runs up a
layer (`layer_of`: a feature's plan below the flow, the flow below the worker's runtime)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC = REPO_ROOT / "src"

# The `testing` feature's kit, and the fake host: test code that lives in src/.
_TEST_KIT = {"fake_host", "conformance", "fake", "blocking", "fuzz_checks"}
_PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)(::\{[^;]*?\})?")
_GROUP_HEAD = re.compile(r"(?:^|[{,])\s*([A-Za-z_][A-Za-z0-9_]*)")


def _module_of(path: Path, src: Path) -> tuple[str, ...]:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return tuple(parts)


def _is_test(module: tuple[str, ...]) -> bool:
    return bool(module) and ("tests" in module or module[-1].endswith("_tests") or module[-1] in _TEST_KIT)


def _nested(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    shorter, longer = sorted((a, b), key=len)
    return longer[: len(shorter)] == shorter


def imports(src: Path = SRC) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """Module -> the modules its non-test code imports (nesting left out)."""
    files = {_module_of(p, src): p for p in src.rglob("*.rs")}
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for module, path in files.items():
        if _is_test(module):
            continue
        text = path.read_text()
        text = text[: text.find("#[cfg(test)]")] if "#[cfg(test)]" in text else text
        deps = set()
        for m in _PATH.finditer(text):
            head, segments = m.group(1), m.group(2).strip(":").split("::")
            # `super` from a.rs or a/mod.rs is a's parent; `self` is a.
            base = module if head == "self" else () if head == "crate" else module[:-1]
            candidates = [[*base, *segments]]
            if m.group(3):
                candidates += [[*base, *segments, g] for g in _GROUP_HEAD.findall(m.group(3).strip(":{}"))]
            for c in candidates:
                target = next((tuple(c[:k]) for k in range(len(c), -1, -1) if tuple(c[:k]) in files), None)
                if target is not None and target != module and not _nested(target, module):
                    deps.add(target)
        graph[module] = deps
    return graph


def circles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    found: list[list[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append("/".join(w) or "lib")
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_rust_modules():
    assert circles(imports()) == []


FEATURES = ("admin", "audit", "detached", "reconcile", "wait")


def layer_of(module: tuple[str, ...]) -> int:
    """The layers, from the ground up (ARCHITECTURE.md, "Imports run one way"):
    0: the engine's pure modules and the host seam (`host`);
    1: a feature's plan (`worker/<feature>/`, but for its `flow.rs` and `root.rs`);
    2: the request's flow (`worker/flow/`) and each feature's part of it (`<feature>/flow.rs`);
    3: the worker's runtime (`worker/*.rs`) and each feature's root part (`<feature>/root.rs`);
    4: the raw ABI (`glue`)."""
    if module[:1] == ("glue",):
        return 4
    if module[:1] != ("worker",) or len(module) < 2:
        return 0
    if module[1] == "flow":
        return 2
    if module[1] in FEATURES:
        part = module[2] if len(module) > 2 else ""
        return {"flow": 2, "root": 3}.get(part, 1)
    return 3


def imports_that_run_up(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[str]:
    """Each import of a module on a higher layer, as `from -> to`."""
    return sorted(
        f"{'/'.join(a)} -> {'/'.join(b)}"
        for a, deps in graph.items()
        for b in deps
        if layer_of(b) > layer_of(a)
    )


def test_no_import_runs_up_a_layer():
    assert imports_that_run_up(imports()) == []


def test_the_check_finds_an_import_that_runs_up(tmp_path):
    """The check itself: a feature's plan that reads the flow, and a flow part that reaches
    for the root's, run up; the flow reading a plan does not."""
    worker = tmp_path / "worker"
    for d in (worker / "flow", worker / "wait"):
        d.mkdir(parents=True)
    (tmp_path / "lib.rs").write_text("pub mod worker;\n")
    (worker / "mod.rs").write_text("pub mod flow;\npub mod wait;\nmod plugin;\n")
    (worker / "plugin.rs").write_text("use super::wait::Room;\n")
    (worker / "flow" / "mod.rs").write_text("use crate::worker::wait::Room;\npub struct Flow;\n")
    (worker / "wait" / "mod.rs").write_text("mod flow;\nmod root;\npub struct Room;\n")
    (worker / "wait" / "flow.rs").write_text("use crate::worker::flow::Flow;\n")
    (worker / "wait" / "root.rs").write_text("use crate::worker::plugin::State;\n")
    assert imports_that_run_up(imports(tmp_path)) == []
    (worker / "wait" / "mod.rs").write_text("mod flow;\nmod root;\nuse crate::worker::flow::Flow;\n")
    (worker / "wait" / "flow.rs").write_text("use crate::worker::plugin::State;\n")
    assert imports_that_run_up(imports(tmp_path)) == ["worker/wait -> worker/flow", "worker/wait/flow -> worker/plugin"]


def test_the_check_finds_a_circle(tmp_path):
    """The check itself: two sibling modules that import each other are a circle, a child
    importing its parent is not."""
    (tmp_path / "a").mkdir()
    (tmp_path / "lib.rs").write_text("pub mod a;\npub mod b;\n")
    (tmp_path / "a" / "mod.rs").write_text("mod c;\nuse crate::b::Thing;\n")
    (tmp_path / "a" / "c.rs").write_text("use super::Other;\n")
    (tmp_path / "b.rs").write_text("use crate::a::{Other, c};\npub struct Thing;\n")
    assert circles(imports(tmp_path)) == [["a", "b"]]
    (tmp_path / "b.rs").write_text("pub struct Thing;\n")
    assert circles(imports(tmp_path)) == []


def main() -> int:
    """Both checks without pytest, for `make check`."""
    import tempfile

    failed = 0
    tests = (
        test_no_import_circle_among_the_rust_modules,
        test_the_check_finds_a_circle,
        test_no_import_runs_up_a_layer,
        test_the_check_finds_an_import_that_runs_up,
    )
    for test in tests:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                test(*([Path(tmp)] if test.__name__.startswith("test_the_check") else []))
        except AssertionError as e:
            failed += 1
            print(f"FAILED {test.__name__}: {e}")
    print(f"tests/deploy/test_rust_imports.py: {len(tests) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
