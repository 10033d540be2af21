"""`autopar.score`: price the sharding a user already runs, and what autopar would change.

In: a train step, its arguments, the pytrees of shardings the user gives `jax.jit`
(`in_shardings`) and a cluster. Out: a `Plan` of method "yours", priced by the same cost
model as autopar's own plans, so that `autopar.compare([theirs, autopar.plan(...)])` shows
them side by side; `changes` says what autopar would change and what each change saves.

How the user's sharding becomes a plan: every input the shardings name is pinned to its
spec (`constraints=`, `autopar.search._pins`) on the user's mesh shape, the step's own
`with_sharding_constraint`s are kept, and the sharding ILP chooses the layout of every
other value, as XLA's sharding propagation would, given the same inputs. (The ILP's choice
is the cheapest the cost model knows; XLA's propagation may do worse inside the step, so
the score is a lower bound on what the cost model predicts for the user's program.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.cluster import spec_str
from autopar.graph import abstract_args
from autopar.plan import Plan
from autopar.report import time_split
from autopar.report._explain import _fmt_time
from autopar.search import plan as search_plan

SCORED_METHOD = "yours"


def score(step: Callable, *args: Any, shardings: Any, cluster: Any = None,
          **options: Any) -> Plan:
    """The plan of the user's own sharding, priced by autopar's cost model.

    **Arguments:**
    - `step`, `args`: as for `autopar.plan` (arrays or `jax.ShapeDtypeStruct`s).
    - `shardings`: what the user passes to `jax.jit(in_shardings=...)`: a tuple with one
      pytree per positional argument, of `NamedSharding` (or `PartitionSpec`, None for
      free) leaves.
    - `cluster`: as for `autopar.plan` (None: the local devices).
    - `options`: further `autopar.plan` options (e.g. `memory_budget`).

    **Returns:** a `Plan` of method "yours", one mesh of the user's mesh shape.

    **Example:**

    ```python
    in_sh = (state_shardings, batch_shardings)   # as given to jax.jit
    theirs = autopar.score(train_step, state, batch, shardings=in_sh)
    print(autopar.compare([theirs, autopar.plan(train_step, state, batch)]))
    ```
    """
    shape = _mesh_shape(shardings)
    if shape is not None:
        options.setdefault("mesh_shape", shape)
    plan = search_plan(step, *args, cluster=cluster, method="shard", constraints=shardings,
                       cache=False, **options)
    note = ("scored: the inputs the shardings name are pinned to them; the sharding ILP "
            "chose the layout of every other value")
    return dataclasses.replace(plan, method=SCORED_METHOD, warnings=(*plan.warnings, note))


def _mesh_shape(shardings) -> tuple[int, ...] | None:
    """The user's mesh shape (axes of size 1 left out), from its NamedShardings."""
    for leaf in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)):
        if isinstance(leaf, NamedSharding):
            shape = tuple(n for n in leaf.mesh.shape.values() if n > 1)
            return shape or None
    return None


@dataclasses.dataclass(frozen=True)
class Change:
    """One change autopar would make to the user's sharding, and what it saves.

    `inputs`: (path, the user's spec, autopar's spec) of the leaves it changes (the first
    few); `saved`: seconds per step; `parts`: per part of the step time (compute,
    communication by collective kind, ...), seconds saved (> 0) or added (< 0)."""

    what: str
    inputs: tuple[tuple[str, str, str], ...]
    saved: float
    parts: tuple[tuple[str, float], ...]

    def __str__(self) -> str:
        shown = ", ".join(f"{p} {a} -> {b}" for p, a, b in self.inputs[:3])
        more = f" (+{len(self.inputs) - 3} more)" if len(self.inputs) > 3 else ""
        terms = ", ".join(f"{name} {_signed(-s)}" for name, s in self.parts if abs(s) > 0)
        return (f"autopar re-lays the {self.what}: {shown}{more}: step {_signed(-self.saved)}"
                f" ({terms})")


_ROLE_NAMES = {"param": "parameters", "opt_state": "optimizer state", "batch": "batch"}


def changes(step: Callable, *args: Any, shardings: Any, theirs: Plan, cluster: Any = None,
            **options: Any) -> list[Change]:
    """What autopar would change in the user's sharding, largest saving first.

    For each role of inputs (parameters, optimizer state, batch) whose leaves the user
    pins, the step is scored again with those leaves left free (the rest still pinned):
    the layouts the ILP then gives them are autopar's change, and the difference in
    predicted step time, split into its parts (`autopar.report.time_split`), is what the
    change saves and why.
    """
    shape = _mesh_shape(shardings)
    if shape is not None:
        options.setdefault("mesh_shape", shape)
    idx = jax.tree.unflatten(jax.tree.structure(args), range(len(jax.tree.leaves(args))))
    base = {i.path: i for i in theirs.inputs}
    roles = sorted({i.role for i in theirs.inputs if i.role in _ROLE_NAMES})
    found = []
    for role in roles:
        paths = {i.path for i in theirs.inputs if i.role == role}
        released = _release(step, args, shardings, idx, paths)
        variant = search_plan(step, *args, cluster=cluster, method="shard",
                              constraints=released, cache=False, **options)
        moved = tuple(
            (i.path, spec_str(base[i.path].spec), spec_str(i.spec))
            for i in variant.inputs if i.path in paths and i.spec != base[i.path].spec
        )
        saved = theirs.predicted_step_time - variant.predicted_step_time
        if not moved or saved <= 0:  # nothing moved, or nothing saved by the move
            continue
        a, b = time_split(theirs).parts(), time_split(variant).parts()
        parts = tuple(sorted(((k, a.get(k, 0.0) - b.get(k, 0.0)) for k in {*a, *b}),
                             key=lambda kv: -abs(kv[1])))
        found.append(Change(_ROLE_NAMES[role], moved, saved, parts))
    return sorted(found, key=lambda c: -c.saved)


def _release(step, args, shardings, index_tree, paths: set[str]):
    """`shardings` with the leaves at `paths` made free (None)."""
    _, leaf_paths = abstract_args(step, args)

    def free(pin, subtree):
        leaves = jax.tree.leaves(subtree)
        if leaves and all(leaf_paths[i] in paths for i in leaves):
            return None
        return pin

    is_leaf = lambda x: x is None or isinstance(x, (NamedSharding, PartitionSpec))  # noqa: E731
    return jax.tree.map(free, tuple(shardings), index_tree, is_leaf=is_leaf)


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + _fmt_time(abs(seconds))
