"""The bench's Python modules import one another in one direction only: no circle among
bench/*.py, however it is closed (issue 32). A module that imports its importer, even for a type
hint under `if TYPE_CHECKING:` or inside a function, cannot be read, tested or moved without the
other; and a type-only edge turns into an import-time failure the day it is needed at run time.
So every `import` statement counts here, wherever it stands.
Run by `make bench-unit` (part of `make bench-smoke`, so of `make test`)."""

from __future__ import annotations

import ast
from pathlib import Path

from bench import REPO

BENCH = REPO / "bench"


def _module_name(path: Path, package: str) -> str:
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def imports(directory: Path, package: str = "bench") -> dict[str, set[str]]:
    """Module -> the modules of `package` (the .py files of `directory`, not recursing) it
    imports, from every import statement in it: top level, under `if TYPE_CHECKING:`, in a
    function. `from bench import x` is an import of bench.x when bench/x.py exists, else of
    the package (bench/__init__.py); relative imports are resolved the same way."""
    files = {_module_name(p, package): p for p in sorted(directory.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # `from . import x`, `from .x import y`: within the package
                    base = package + (f".{base}" if base else "")
                if base == package:
                    targets = [f"{package}.{a.name}" if f"{package}.{a.name}" in files else package
                               for a in node.names]
                else:
                    targets = [base]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles a depth-first walk closes, each as the modules along it with the first
    one repeated at the end (a -> b -> a): at least one whenever there is a circle, none exactly
    when the imports form a DAG."""
    found: list[list[str]] = []
    state: dict[str, str] = {}  # "open" while on the walk's path, "done" once fully explored
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_bench_modules_import_each_other_without_a_circle():
    graph = imports(BENCH)
    assert "bench.run" in graph and "bench.report" in graph["bench.run"], graph  # it read the modules
    found = cycles(graph)
    assert not found, "import circles among bench/*.py:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checker_sees_a_circle_closed_by_a_type_only_or_a_local_import(tmp_path):
    (tmp_path / "__init__.py").write_text("from pathlib import Path\nOUT = 1\n")
    (tmp_path / "a.py").write_text("from pkg.b import X\nfrom pkg import OUT\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import Y\n")
    (tmp_path / "c.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "d.py").write_text("from . import b\nfrom .c import f\nimport pkg.a\n")
    graph = imports(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b", "pkg"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"},
                     "pkg.d": {"pkg.b", "pkg.c", "pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (tmp_path / "c.py").write_text("def f():\n    from pkg import OUT\n")
    assert cycles(imports(tmp_path, "pkg")) == []
