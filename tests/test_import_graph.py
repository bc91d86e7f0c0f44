"""No import cycles inside python/tiercel.

A cycle makes the modules' load order matter (the first one imported sees the other
half-built), hides which module owns a concept, and is usually a sign that shared vocabulary
sits too high. This test reads the package's source with `ast` (nothing is imported, so it
runs without torch, jax or the compiled core), builds the graph of imports between its
modules, imports inside functions included, and fails on every cycle, naming its modules.

Imports under `if TYPE_CHECKING:` are left out: they never run, and annotations may point
anywhere. A submodule's implicit import of its package's `__init__` is left out too: it is
how Python loads packages, not a dependency the code chose.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "tiercel"
#: The compiled bindings (`tiercel._core`): a module of the package with no .py file, which
#: may not even be built here.
EXTENSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["maturin"]["module-name"]


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of `package` (a directory)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    if package == PACKAGE:
        found[EXTENSION] = package / "_core.abi3.so"
    return found


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, int]]:
    """Every import statement that can run, with its line: module level, in functions, in
    classes, in try/except; not those under `if TYPE_CHECKING:`."""
    found: list[tuple[ast.Import | ast.ImportFrom, int]] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for other in child.orelse:
                    walk_one(other)
                continue
            walk_one(child)

    def walk_one(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, node.lineno))
        walk(node)

    walk(tree)
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The package module `name` loads: itself, or the nearest package above it that exists."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(known: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    known = modules() if known is None else known
    graph: dict[str, dict[str, int]] = {m: {} for m in known}
    for mod, path in known.items():
        if path.suffix != ".py":
            continue
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node, line in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    if node.level > 1:
                        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import name` loads pkg.name when it is a module, else pkg itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                dep = _resolve(target, known)
                if dep is not None and dep != mod:
                    graph[mod].setdefault(dep, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each
    sorted, and for each one a concrete cycle through it (see `a_cycle`)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # Iterative would be longer; the package is far below the recursion limit.
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One cycle inside a strongly connected component, from its first module back to it
    (breadth-first, so the shortest one through that module)."""
    start, inside = component[0], set(component)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in inside:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is no cycle")


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    known = modules()
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        rel = known[a].relative_to(PACKAGE.parent.parent)
        steps.append(f"{a} -> {b} ({rel}:{graph[a][b]})")
    return "; ".join(steps)


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    report = [f"{', '.join(c)}: e.g. {describe(graph, a_cycle(graph, c))}" for c in found]
    assert not found, ("import cycles in python/tiercel (move the shared names into a module below both):\n  "
                       + "\n  ".join(report))


def test_the_check_finds_a_cycle(tmp_path: Path) -> None:
    """The test above cannot pass by seeing nothing: a made-up package with a cycle through an
    import inside a function, and one only under TYPE_CHECKING, is judged as it should be."""
    pkg = tmp_path / "tiercel"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n    return x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n"
                              "x = 1\nimport tiercel.a\n")
    (pkg / "d.py").write_text("from .c import x\n")
    graph = import_graph(modules(pkg))
    assert graph["tiercel.c"] == {"tiercel.a": 5}
    assert cycles(graph) == [["tiercel.a", "tiercel.c", "tiercel.sub.b"]]
    assert a_cycle(graph, cycles(graph)[0]) == ["tiercel.a", "tiercel.sub.b", "tiercel.c", "tiercel.a"]

