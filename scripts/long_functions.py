"""Functions and methods of `autopar/` longer than a limit, longest first (AST, no imports).

A function's length is its lines from ``def`` (decorators left out) to its last line,
docstring and comments included; a nested function counts in its parent's length and on
its own. Used to keep functions to named steps of about 60 lines (issue 43):

    python scripts/long_functions.py               # every function over 60 lines
    python scripts/long_functions.py --top 10      # the ten longest, whatever their length
    python scripts/long_functions.py --limit 80 autopar/inter
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def function_lengths(paths) -> list[tuple[int, str]]:
    """``(lines, "path:line qualified.name")`` for every function under `paths` (files or
    folders of ``.py`` files)."""
    found = []
    for root in paths:
        root = Path(root)
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            _collect(ast.parse(path.read_text()), path, "", found)
    return found


def _collect(node: ast.AST, path: Path, prefix: str, found: list) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                where = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(
                    ROOT) else path
                found.append((child.end_lineno - child.lineno + 1,
                              f"{where}:{child.lineno} {name}"))
            _collect(child, path, name + ".", found)
        else:
            _collect(child, path, prefix, found)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=[ROOT / "autopar"],
                        help="files or folders (default: autopar/)")
    parser.add_argument("--limit", type=int, default=60,
                        help="list functions over this many lines (default 60)")
    parser.add_argument("--top", type=int, default=None,
                        help="list the N longest instead, whatever their length")
    args = parser.parse_args(argv)
    found = sorted(function_lengths(args.paths), key=lambda f: (-f[0], f[1]))
    over = [f for f in found if f[0] > args.limit]
    shown = found[: args.top] if args.top is not None else over
    for lines, where in shown:
        print(f"{lines:5d}  {where}")
    print(f"{len(over)} functions over {args.limit} lines")


if __name__ == "__main__":
    main()
