"""autopar's parts form a line: each imports only parts declared before it.

The order is the data flow (autopar/__init__.py's docstring). Every import counts, at
module level or inside a function, so a lazy import cannot hide a reach back.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "autopar"

# Base modules first, then the data flow; `__init__` (the facade) may import anything.
ORDER = (
    "choices", "_version", "_progress", "_memo",
    "graph", "cluster", "cost", "profile", "intra", "errors", "inter", "plan", "search",
    "manual",
    "lower", "distributed", "checkpoint", "runtime", "report", "space", "app",
)


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: Path, root: Path = ROOT) -> set[str]:
    """The autopar parts a file imports, absolute or relative, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.relative_to(root).parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                names = [".".join(("autopar", *base, *([node.module] if node.module else [])))]
            elif node.module:
                names = [node.module]
            if names == ["autopar"]:  # `from autopar import x`: x is a part
                names = [f"autopar.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "autopar" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_part_is_declared():
    parts = {part_of(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert parts <= set(ORDER), f"declare these parts in ORDER: {sorted(parts - set(ORDER))}"


def test_no_part_imports_a_later_one():
    rank = {name: i for i, name in enumerate(ORDER)}
    reaching_back = []
    for path in sorted(ROOT.rglob("*.py")):
        src = part_of(path)
        if src == "__init__":
            continue
        for dst in imported_parts(path):
            if dst != src and dst in rank and rank[dst] > rank[src]:
                reaching_back.append(f"{path.relative_to(ROOT.parent)} ({src}) imports {dst}")
    assert not reaching_back, "parts import later parts:\n  " + "\n  ".join(reaching_back)


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    module = tmp_path / "autopar" / "plan" / "_probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def f():\n    from autopar.report import explain\n    from .. import lower\n"
    )
    assert imported_parts(module, tmp_path / "autopar") == {"report", "lower"}
