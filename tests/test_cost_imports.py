"""The cost model's modules import each other without a cycle.

`autopar/cost/` is the one place that prices (issue 43); its modules form a tree of
formulas, each importing only the ones it builds on. Every import counts, at module level
or inside a function, so a lazy import cannot hide a cycle; a package's `__init__` is a
module like the others (importing ``autopar.cost`` from inside `cost/` reaches all of it).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "autopar"
COST = ROOT / "cost"


def module_name(path: Path, root: Path = ROOT) -> str:
    """``autopar.cost._links`` for cost/_links.py, ``autopar.cost`` for cost/__init__.py."""
    parts = ("autopar", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The modules of `known` that the file at `path` imports, at any depth: for
    ``from package import name`` the submodule ``package.name`` where it is one, else the
    package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_name(path, root).split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known


def import_graph(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `package` (a folder under `root`) it imports."""
    paths = {module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    return {name: imported_modules(path, set(paths), root) - {name}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def test_no_import_cycle_inside_cost():
    graph = import_graph(COST)
    assert "autopar.cost._collective" in graph and "autopar.cost.backends" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "cost/ modules import each other in a cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_lazy_cycle(tmp_path):
    package = tmp_path / "autopar" / "cost"
    (package / "backends").mkdir(parents=True)
    (package / "__init__.py").write_text("from autopar.cost._a import f\n")
    (package / "_a.py").write_text("from autopar.cost.backends import g\n")
    (package / "backends" / "__init__.py").write_text("from ._b import g\n")
    (package / "backends" / "_b.py").write_text("def g():\n    from .. import _a\n")
    graph = import_graph(package, tmp_path / "autopar")
    assert graph["autopar.cost"] == {"autopar.cost._a"}
    assert find_cycle(graph) == ["autopar.cost._a", "autopar.cost.backends",
                                 "autopar.cost.backends._b", "autopar.cost._a"]
