"""The house rules that a reader can check without running anything: the architecture
(no import circle; the send side and the receive side never import each other; engines take
their errors from ``errors``, not the session; no module imports another's private name or
goes through a package's face; at most 12 modules at the top), no module over 700 lines
(``LINE_LIMITS`` names the few held to another limit),
a README whose "How a sync flows" names only functions that exist, and no merge
conflict left in a file. Each architecture rule is also run on a small planted package,
where it must fail.

Imports are read with ``ast`` from every module, function-level ones included; those under
``if TYPE_CHECKING:`` are left out (they never run). Relative imports are resolved, and
``from weightsync import x`` counts as an import of ``weightsync.x`` where that is a module.
Importing ``a.b`` also runs ``a/__init__.py``, but that edge is not drawn: a package's face
re-exports its submodules, so every submodule would close a circle through it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "weightsync"
MAX_LINES = 700
#: modules held to a limit of their own, by path under the package: the session's two
#: classes read the same for every transport (what varies lives in stages beside them)
LINE_LIMITS = {"sender/sender.py": 500, "receiver/receiver.py": 500}
MAX_TOP_LEVEL = 12
README = PACKAGE.parent / "README.md"


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


def _modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _from_imports(root: Path):
    """``(importer, imported module or package, names, line)`` for every ``from X import``
    and ``import X`` of the package's own modules (the reader of ``import_graph``)."""
    paths = _modules(root)
    top = root.name
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == top or alias.name.startswith(top + "."):
                        yield name, alias.name, [], node.lineno
                continue
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            if base == top or base.startswith(top + "."):
                yield name, base, [alias.name for alias in node.names], node.lineno


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _defined(path: Path) -> set[str]:
    """The names a module defines itself (not those it imports)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return found


def _error_names(root: Path) -> set[str]:
    errors = root / "errors.py"
    if not errors.exists():
        return set()
    return {n.name for n in ast.parse(errors.read_text()).body if isinstance(n, ast.ClassDef)}


def violations(root: Path = PACKAGE) -> dict[str, list[str]]:
    """Every broken house rule of the package at ``root``: rule -> what breaks it."""
    top = root.name
    paths = _modules(root)
    packages = {m for m, p in paths.items() if p.name == "__init__.py"}
    errors = _error_names(root)
    found: dict[str, list[str]] = {
        "circle": [],
        "sides": [],
        "engine errors": [],
        "private": [],
        "face": [],
        "size": [],
        "top level": [],
    }
    graph = import_graph(root)
    found["circle"] = [_path_of(c, graph) for c in circles(graph)]
    sides = (f"{top}.sender", f"{top}.receiver")
    for importer, base, names, line in _from_imports(root):
        where = f"{importer}:{line}"
        targets = [f"{base}.{n}" if f"{base}.{n}" in paths else base for n in names] or [base]
        for a, b in (sides, sides[::-1]):
            if _within(importer, a) and any(_within(t, b) for t in targets):
                found["sides"].append(f"{where} imports {b}")
        if _within(importer, f"{top}.engines") and _within(base, f"{top}.session"):
            if caught := sorted(set(names) & errors):
                found["engine errors"].append(
                    f"{where} takes {', '.join(caught)} from {base} (use {top}.errors)"
                )
        for n, t in zip(names, targets):
            if t == base and n.startswith("_") and not n.startswith("__") and base != importer:
                found["private"].append(f"{where} imports {base}.{n}")
        if importer in packages:  # a face re-exports its own modules
            continue
        for n, t in zip(names or [""], targets):
            if (t in packages and n not in _defined(paths[t])) or t == f"{top}.endpoints":
                found["face"].append(
                    f"{where} imports {n or t} through {t} (import from the defining module)"
                )
    for name, path in paths.items():
        limit = LINE_LIMITS.get(path.relative_to(root).as_posix(), MAX_LINES)
        if (n := len(path.read_text().splitlines())) > limit:
            found["size"].append(f"{name}: {n} lines (at most {limit})")
    top_level = sorted(p.name for p in root.glob("*.py"))
    if len(top_level) > MAX_TOP_LEVEL:
        found["top level"].append(f"{len(top_level)} modules at the top: {', '.join(top_level)}")
    return found


def test_the_package_keeps_the_house_rules():
    graph = import_graph()
    assert "weightsync.sender.sender" in graph and "weightsync.engines.base" in graph  # the reader found it
    broken = {rule: items for rule, items in violations().items() if items}
    assert not broken, "house rules broken:\n" + "\n".join(
        f"{r}: {i}" for r, items in broken.items() for i in items
    )


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


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return root


HEALTHY = {
    "errors.py": "class SyncError(Exception):\n    pass\n",
    "plan.py": "def capacity():\n    return 1\n",
    "session/channel.py": "from pkg.errors import SyncError\n",
    "sender/sender.py": "from pkg.plan import capacity\nfrom pkg.session.channel import SyncError\n",
    "receiver/receiver.py": "from pkg.plan import capacity\n",
    "engines/nccl.py": "from pkg.errors import SyncError\nfrom pkg.session import channel\n",
}


@pytest.mark.parametrize(
    "rule, planted",
    [
        ("circle", {"plan.py": "def capacity():\n    from pkg.sender import sender\n"}),
        ("sides", {"receiver/receiver.py": "from pkg.sender.sender import capacity\n"}),
        ("sides", {"sender/sender.py": "def f():\n    from pkg.receiver import receiver\n"}),
        ("engine errors", {"engines/nccl.py": "from pkg.session.channel import SyncError\n"}),
        ("private", {"receiver/receiver.py": "from pkg.plan import _hidden\n"}),
        ("face", {"receiver/receiver.py": "from pkg.session import SyncError\n"}),
        ("face", {"sender/sender.py": "from pkg.endpoints import Receiver\n"}),
        ("size", {"plan.py": "x = 1\n" * (MAX_LINES + 1)}),
        ("top level", {f"m{i}.py": "" for i in range(MAX_TOP_LEVEL)}),
    ],
)
def test_each_rule_fails_on_a_planted_violation(tmp_path, rule, planted):
    assert not any(violations(_plant(tmp_path / "healthy", HEALTHY)).values())
    found = violations(_plant(tmp_path / "planted", {**HEALTHY, **planted}))
    assert found[rule], f"the {rule!r} rule missed {planted}"
    assert not [r for r, items in found.items() if items and r != rule], found


def test_a_module_of_line_limits_is_held_to_its_own_limit(tmp_path):
    """Each module of ``LINE_LIMITS`` may have its own limit's lines, not one more; the
    others keep ``MAX_LINES``."""
    for rel, limit in LINE_LIMITS.items():
        at = violations(_plant(tmp_path / "at", {**HEALTHY, rel: "x = 1\n" * limit}))
        assert not at["size"], (rel, at["size"])
        over = violations(_plant(tmp_path / "over", {**HEALTHY, rel: "x = 1\n" * (limit + 1)}))
        assert over["size"] == [f"pkg.{rel[:-3].replace('/', '.')}: {limit + 1} lines (at most {limit})"]
    other = violations(
        _plant(tmp_path / "other", {**HEALTHY, "sender/packer.py": "x = 1\n" * (MAX_LINES + 1)})
    )
    assert other["size"] == [f"pkg.sender.packer: {MAX_LINES + 1} lines (at most {MAX_LINES})"]


# ------------------------------------------------------------------- the README's sync flow
def _flow_names() -> list[str]:
    """The dotted names (``module.function``, ``Class.method``) in backticks in the
    README's "How a sync flows"."""
    text = README.read_text()
    section = text.split("### How a sync flows", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return sorted(set(re.findall(r"`([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", section)))


def _resolves(dotted: str) -> bool:
    """``dotted`` names a module's attribute (a module path relative to ``weightsync``, or
    a class of a module, then attributes)."""
    parts = dotted.split(".")
    for module in [
        m for m in _modules(PACKAGE) if m.split(".")[-1] == parts[0] or m.endswith("." + parts[0])
    ]:
        obj = importlib.import_module(module)
        if all((obj := getattr(obj, p, None)) is not None for p in parts[1:]):
            return True
    for module in _modules(PACKAGE):  # Class.method: a class defined in some module
        mod_path = _modules(PACKAGE)[module]
        if f"class {parts[0]}" in mod_path.read_text():
            obj = getattr(importlib.import_module(module), parts[0], None)
            if obj is not None and all((obj := getattr(obj, p, None)) is not None for p in parts[1:]):
                return True
    return False


def test_every_function_the_readme_flow_names_exists():
    names = _flow_names()
    assert len(names) >= 15, names  # the reader found the section
    missing = [n for n in names if not _resolves(n)]
    assert not missing, f"README's 'How a sync flows' names what does not exist: {missing}"


def test_no_file_holds_a_merge_conflict_left_unresolved():
    """A merge's conflict markers once sat in docs/reliability.md for rounds: the project's
    code, tests, docs and build files are read for them."""
    root = PACKAGE.parent
    files = [
        *PACKAGE.rglob("*.py"),
        *(root / "tests").rglob("*.py"),
        *(root / "docs").rglob("*.md"),
        *root.glob("*.md"),
        *root.glob("*.toml"),
        root / "Makefile",
    ]
    assert len(files) > 50, files
    marker = re.compile(r"^(<{7}|>{7}) ", re.M)
    conflicted = [str(f.relative_to(root)) for f in files if marker.search(f.read_text(errors="replace"))]
    assert not conflicted, f"unresolved merge conflicts in {conflicted}"


# ------------------------------------------------------------ the private APIs we rely on
DEVELOPERS = PACKAGE.parent / "DEVELOPERS.md"
NOQA_SLF = re.compile(r"#.*noqa: SLF001(?: -- (?P<why>.*))?$")
LIBRARY_VERSION = re.compile(r"\b(torch|vLLM) \d+\.\d+\b")


def private_rows(text: str) -> list[tuple[str, set[str], str]]:
    """``(file, the attribute cell's names, library and version)`` of each row of the table
    in the "Private APIs we rely on" section of DEVELOPERS.md."""
    section = text.split("## Private APIs we rely on", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), set(re.findall(r"\w+", cells[1])), cells[2]))
    return rows


def private_uses(root: Path = PACKAGE) -> list[tuple[str, int, str, str]]:
    """``(file, line, private attribute, the noqa's library and version)`` for every private
    attribute on a line of ``root`` marked ``noqa: SLF001``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        marked = {n: m for n, text in enumerate(lines, 1) if (m := NOQA_SLF.search(text))}
        if not marked:
            continue
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")) or node.attr.startswith(
                "__"
            ):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # an object's own attribute (SLF001 leaves it alone too)
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                if line in marked:
                    version = LIBRARY_VERSION.search(marked[line].group("why") or "")
                    found.append((rel, line, node.attr, version.group(0) if version else ""))
                    break
    return found


def unlisted(
    uses: list[tuple[str, int, str, str]], rows: list[tuple[str, set[str], str]], root: Path
) -> list[str]:
    """What breaks the rule: a marked use without a library and version or without its row
    (same file, attribute and version), and a row whose private names its file lacks."""
    problems = []
    for file, line, attr, version in uses:
        if not version:
            problems.append(
                f"{file}:{line}: `noqa: SLF001` names no library and version (`-- torch 2.13: why`)"
            )
        elif not any(f == file and attr in names and version in lib for f, names, lib in rows):
            problems.append(f"{file}:{line}: {attr} ({version}) is not in DEVELOPERS.md's table")
    for file, names, _ in rows:
        path = root.parent / file
        text = path.read_text() if path.exists() else ""
        if stale := sorted(n for n in names if n.startswith("_") and n not in text):
            problems.append(
                f"DEVELOPERS.md's table lists {', '.join(stale)} in {file}, which does not use it"
            )
    return problems


def test_every_private_api_we_rely_on_is_listed_for_whoever_upgrades():
    uses, rows = private_uses(), private_rows(DEVELOPERS.read_text())
    assert len(uses) >= 10 and len(rows) >= 10, (uses, rows)  # the readers found them
    problems = unlisted(uses, rows, PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_private_api_table_check_fails_on_a_planted_drift(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "a.py").write_text(
        "import torch\n"
        "x = torch._C  # noqa: SLF001 -- torch 2.13: listed\n"
        "y = torch._foo  # noqa: SLF001 -- torch 2.13: not listed\n"
        "z = torch._bar  # noqa: SLF001\n"
        "w = (\n    torch._baz  # noqa: SLF001 -- vLLM 0.32: listed, other version\n)\n"
    )
    rows = [
        ("pkg/a.py", {"torch", "_C"}, "torch 2.13"),
        ("pkg/a.py", {"_baz"}, "vLLM 0.31"),
        ("pkg/a.py", {"_gone"}, "x"),
    ]
    problems = unlisted(private_uses(root), rows, root)
    assert problems == [
        "pkg/a.py:3: _foo (torch 2.13) is not in DEVELOPERS.md's table",
        "pkg/a.py:4: `noqa: SLF001` names no library and version (`-- torch 2.13: why`)",
        "pkg/a.py:6: _baz (vLLM 0.32) is not in DEVELOPERS.md's table",
        "DEVELOPERS.md's table lists _gone in pkg/a.py, which does not use it",
    ], problems
