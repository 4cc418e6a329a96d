"""The house rules that a reader can check without running anything: no module of the
package over 600 lines, and no import circle inside ``weightsync/``.

Imports are read with ``ast`` from every module, function-level ones included; those under
``if TYPE_CHECKING:`` are left out (they never run). Relative imports are resolved, and
``from weightsync import x`` counts as an import of ``weightsync.x`` where that is a module.
Importing ``a.b`` also runs ``a/__init__.py``, but that edge is not drawn: a package's face
re-exports its submodules, so every submodule would close a circle through it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "weightsync"
MAX_LINES = 600


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, but those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:  # an ``else:`` of it runs
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)

    def resolve(name: str) -> str | None:
        while name and name not in modules:  # ``a.b.C`` (a name in module a.b) -> a.b
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's own package, up level-1 more
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, *([base] if base else [])])
                # ``from a import x``: the submodule a.x where it is one, else the module a
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                resolved = resolve(target)
                if resolved is not None and resolved != name:
                    edges.add(resolved)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _path_of(component: list[str], graph: dict[str, set[str]]) -> str:
    """One loop through the component, for the message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        back = [m for m in nxt if m == start]
        if back and len(path) > 1:
            return " -> ".join([*path, start])
        fresh = [m for m in nxt if m not in seen]
        if not fresh:
            return " -> ".join([*path, nxt[0] if nxt else "?"])
        path.append(fresh[0])
        seen.add(fresh[0])


def test_no_import_circle_inside_the_package():
    graph = import_graph()
    assert "weightsync.sender" in graph and "weightsync.engines.base" in graph  # the reader found the package
    found = circles(graph)
    assert not found, "import circles inside weightsync/:\n" + "\n".join(_path_of(c, graph) for c in found)


def test_no_module_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_reader_sees_function_level_and_relative_imports_and_skips_type_checking(tmp_path):
    """The check itself: a circle made only by a function-level import, a relative import
    or ``from pkg import module`` is found; one under ``if TYPE_CHECKING:`` is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .sub import c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import f\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("import pkg.d\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.d"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
