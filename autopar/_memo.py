"""The owner of autopar's memo tables: each declared once, dropped when its search ends.

The planner memoizes what it computes many times over (fusion groups per graph, resharding
times per mesh, bytes per sharded tensor, node facts per graph, ...). Each such table is a
plain dict, a `weakref.WeakKeyDictionary` or an `lru_cache`'d function at the module that
fills it, and is declared here once with its name and what it keys on:

- ``scope="search"``: filled during a search and dropped when the outermost search ends
  (`search_scope`, which `autopar.plan` / `search`, `megatron_plan` and
  `megatron_grid_search` open). Nested scopes (a grid search planning one configuration
  after another) drop nothing until the outermost one ends.
- ``scope="process"``: valid across searches (keyed by pure shapes, dtypes or mesh axes),
  kept, and bounded: a `limit` on its entries (the module clears it when it grows past
  it) or an `lru_cache` with a `maxsize`.

A memo only saves recomputation: a plan is the same with a warm table or an empty one
(`tests/test_memo.py` checks it). `clear_all` empties every table (for tests and for
measuring a cold search).

**Example:**

```python
_FACTS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.node_facts", "graph -> facts of its nodes")

@memo("cost.phase_shares", "schedule, stages", maxsize=4096)
def phase_shares(schedule, stages): ...
```
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

Scope = Literal["search", "process"]
SCOPES: tuple[Scope, ...] = ("search", "process")


@dataclass(frozen=True)
class Memo:
    """One declared memo table.

    **Arguments:**
    - `name`: ``"part.table"``, unique.
    - `keys`: what it keys on, in words.
    - `scope`: ``"search"`` (dropped when the outermost search ends) or ``"process"``.
    - `table`: the dict, weak dict or `lru_cache`'d function.
    - `limit`: the most entries a process-wide dict holds before its module clears it;
      None for a search-scoped table or an `lru_cache` (whose `maxsize` bounds it).
    """

    name: str
    keys: str
    scope: Scope
    table: Any
    limit: int | None = None

    def clear(self) -> None:
        if hasattr(self.table, "cache_clear"):
            self.table.cache_clear()
        else:
            self.table.clear()

    def __len__(self) -> int:
        if hasattr(self.table, "cache_info"):
            return self.table.cache_info().currsize
        return len(self.table)


_REGISTRY: dict[str, Memo] = {}
_LOCK = threading.Lock()
_depth = 0


def declare(table: Any, name: str, keys: str, *, scope: Scope = "search",
            limit: int | None = None) -> Any:
    """Declare `table` (a dict, weak dict or `lru_cache`'d function) as memo `name`,
    keyed on `keys`; returns `table`. A process-wide table must be bounded: a `limit`, or
    an `lru_cache` with a `maxsize`."""
    if scope not in SCOPES:
        raise ValueError(f"memo {name!r}: scope must be one of {SCOPES}, got {scope!r}")
    if not (hasattr(table, "clear") or hasattr(table, "cache_clear")):
        raise TypeError(f"memo {name!r}: a table needs clear() or cache_clear(), "
                        f"got {type(table).__name__}")
    if scope == "process" and limit is None:
        maxsize = table.cache_parameters()["maxsize"] if hasattr(table, "cache_info") else None
        if maxsize is None:
            raise ValueError(
                f"memo {name!r} is process-wide but unbounded: give it a `limit` (and clear "
                "it past that) or an lru_cache maxsize, or declare it scope='search'"
            )
    if name in _REGISTRY and _REGISTRY[name].table is not table:
        raise ValueError(f"memo {name!r} is declared twice; memo names must be unique")
    _REGISTRY[name] = Memo(name, keys, scope, table, limit)
    return table


def memo(name: str, keys: str, *, maxsize: int, scope: Scope = "process") -> Callable:
    """A decorator: `functools.lru_cache(maxsize)` declared as memo `name`."""

    def wrap(fn: Callable) -> Callable:
        return declare(functools.lru_cache(maxsize=maxsize)(fn), name, keys, scope=scope)

    return wrap


def per_graph(name: str, keys: str) -> Callable:
    """A decorator: `fn(graph)` computed once per graph object, in a weak-keyed table
    declared as search-scoped memo `name` (a graph freed takes its entry with it)."""

    def wrap(fn: Callable) -> Callable:
        table = declare(weakref.WeakKeyDictionary(), name, keys)

        @functools.wraps(fn)
        def once(graph):
            held = table.get(graph)
            if held is None:
                held = table[graph] = fn(graph)
            return held

        return once

    return wrap


def tables(scope: Scope | None = None) -> tuple[Memo, ...]:
    """The declared memos (of `scope`, or all), by name."""
    return tuple(m for _, m in sorted(_REGISTRY.items())
                 if scope is None or m.scope == scope)


def sizes(scope: Scope | None = None) -> dict[str, int]:
    """Entries per declared memo (of `scope`, or all)."""
    return {m.name: len(m) for m in tables(scope)}


def clear(scope: Scope) -> None:
    """Empty every memo of `scope`."""
    for m in tables(scope):
        m.clear()


def clear_all() -> None:
    """Empty every declared memo, process-wide ones included."""
    for m in tables():
        m.clear()


def in_search() -> bool:
    """Whether a search scope is open."""
    return _depth > 0


@contextlib.contextmanager
def search_scope() -> Iterator[None]:
    """The scope of one search: when the outermost one ends (returns or raises), every
    ``scope="search"`` memo is emptied. Scopes nest; searches running at once in threads
    share the outermost one."""
    global _depth
    with _LOCK:
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                clear("search")


def search_scoped(fn: Callable) -> Callable:
    """A decorator: run `fn` inside a `search_scope`."""

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with search_scope():
            return fn(*args, **kwargs)

    return scoped
