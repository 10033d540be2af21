"""The sections of docs/benchmarks.md each product benchmark owns.

Every benchmark's section lies between ``<!-- BEGIN benchmark:NAME -->`` and
``<!-- END benchmark:NAME -->``. `write_section` replaces one section (or appends it when
the page has none yet) and leaves the rest of the page as it is, with a line stating the
commit, date, command and machine that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
TITLE = "# Benchmarks\n"


def begin(name: str) -> str:
    return f"<!-- BEGIN benchmark:{name} -->"


def end(name: str) -> str:
    return f"<!-- END benchmark:{name} -->"


def commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout ("-dirty" with uncommitted changes to
    autopar/, examples/ or benchmarks/), or "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "autopar", "examples",
             "benchmarks"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changes else "")


def command() -> str:
    """The command line this process runs (as ``python -m benchmarks NAME ...`` when started
    through `benchmarks.__main__`)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if not argv0.startswith("python"):
        argv0 = "python " + os.path.relpath(argv0, ROOT) if argv0 else "python"
    return " ".join([argv0, *map(shlex.quote, sys.argv[1:])]).strip()


def machine() -> str:
    """This machine in a few words: CPU model and cores (the cores this process may use)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} CPU cores ({model})"


def stamp(command_line: str, machine_text: str | None = None) -> str:
    return (f"*Produced at commit `{commit()}` on {datetime.date.today().isoformat()} by "
            f"`{command_line}` on {machine_text or machine()}.*")


def write_section(name: str, markdown: str, command_line: str | None = None,
                  path: Path | str = DOCS, machine_text: str | None = None,
                  produced: str | None = None) -> None:
    """Replace benchmark `name`'s section of `path` with `markdown` (which starts with its
    ``## `` heading), stamped under the heading with the commit, date, `command_line`
    (default: this process's) and machine; append it when the page has no such section.
    `produced`: a stamp line of one's own instead (figures carried over from other runs)."""
    path = Path(path)
    lines = markdown.strip("\n").split("\n")
    line = produced or stamp(command_line or command(), machine_text)
    if lines[0].startswith("#"):
        lines[1:1] = ["", line]
    else:
        lines[:0] = [line, ""]
    block = "\n".join([begin(name), *lines, end(name)])
    page = path.read_text() if path.exists() else TITLE
    start, stop = page.find(begin(name)), page.find(end(name))
    if start >= 0 and stop > start:
        page = page[:start] + block + page[stop + len(end(name)):]
    else:
        page = page.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)


def read_section(name: str, path: Path | str = DOCS) -> str | None:
    """Benchmark `name`'s section of `path` without its markers, or None."""
    page = Path(path).read_text() if Path(path).exists() else ""
    start, stop = page.find(begin(name)), page.find(end(name))
    if start < 0 or stop < start:
        return None
    return page[start + len(begin(name)):stop].strip("\n")
