"""`@autopar.autoparallel`: plan on the first call, then run the compiled plan."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar._planning import Method, PlanOptions, make_plan, resolve_cluster
from autopar.graph import OpGraph, trace
from autopar.lower import lower_sharding_plan
from autopar.plan import Plan

log = logging.getLogger("autopar")


@dataclass
class _Compiled:
    graph: OpGraph
    plan: Plan
    fn: Callable
    in_shardings: list
    out_shardings: list


class AutoParallel:
    """A train step wrapped by `autopar.autoparallel`; call it like the original."""

    def __init__(self, fn: Callable, options: PlanOptions, cluster: Any, plan: Any):
        if not callable(fn):
            raise TypeError(
                f"autoparallel expects a function, got {type(fn).__name__}; decorate the "
                "train step: @autopar.autoparallel def train_step(state, batch): ..."
            )
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options
        self._cluster_arg = cluster
        self._fixed_plan = Plan.load(plan) if isinstance(plan, str) else plan
        self._compiled: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self.num_traces = 0  # how many times the step was traced and planned

    @property
    def plan(self) -> Plan:
        """The `Plan` used by the last call."""
        if self._last is None:
            raise ValueError("no plan yet: call the function once (or use autopar.plan)")
        return self._last.plan

    @property
    def graph(self) -> OpGraph:
        if self._last is None:
            raise ValueError("not traced yet: call the function once")
        return self._last.graph

    def _key(self, leaves, treedef) -> Any:
        return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)

    def _compile(self, args) -> _Compiled:
        self.num_traces += 1
        options = self._options
        start = time.perf_counter()
        graph = trace(self._fn, *args, batch_argnums=options.batch_argnums)
        trace_time = time.perf_counter() - start
        if self._fixed_plan is not None:
            plan = self._fixed_plan
            plan.check_graph(graph)
        else:
            cluster = resolve_cluster(self._cluster_arg)
            plan = make_plan(graph, cluster, options)
            plan.timings["trace"] = trace_time
        if plan.num_stages != 1:
            raise NotImplementedError(
                f"this plan has {plan.num_stages} pipeline stages; running pipelined plans "
                "is not supported yet. Use method='shard', 'data', 'zero2' or 'zero3'."
            )
        donate = _flat_indices(graph.in_tree, options.donate_argnums)
        fn, in_sh, out_sh = lower_sharding_plan(graph, plan.stages[0].sharding, None, donate)
        return _Compiled(graph, plan, fn, in_sh, out_sh)

    def __call__(self, *args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        key = self._key(leaves, treedef)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(args)
            self._compiled[key] = compiled
        self._last = compiled
        placed = [
            x if _has_sharding(x, s) else jax.device_put(x, s)
            for x, s in zip(leaves, compiled.in_shardings)
        ]
        out = compiled.fn(*placed)
        return jax.tree.unflatten(compiled.graph.out_tree, out)


def _has_sharding(x: Any, sharding) -> bool:
    current = getattr(x, "sharding", None)
    return current is not None and current.is_equivalent_to(sharding, x.ndim)


def _flat_indices(in_tree, argnums: Sequence[int]) -> list[int]:
    """Flat leaf indices belonging to the positional arguments `argnums`."""
    args = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
    return sorted(i for a in argnums if a < len(args) for i in jax.tree.leaves(args[a]))


def autoparallel(
    fn: Callable | None = None,
    *,
    cluster: Any = None,
    method: Method = "auto",
    num_microbatches: int | str = "auto",
    schedule: str = "1f1b",
    memory_budget: float | None = None,
    donate_argnums: Sequence[int] = (0,),
    batch_argnums: Sequence[int] = (1,),
    plan: Plan | str | None = None,
    mesh_shape: tuple[int, ...] | None = None,
) -> Any:
    """Parallelise a single-device train step over the devices it is given.

    **Arguments:**
    - `cluster`: a `Cluster`, a profile name or path; None uses the local devices.
    - `method`: "auto" (search), "shard" (operator parallelism on one mesh), "data",
      "zero2", "zero3".
    - `num_microbatches`, `schedule`: pipeline options (used by pipelined plans).
    - `memory_budget`: bytes per device; default from the cluster.
    - `donate_argnums`: arguments whose buffers the step may reuse (the state);
      `batch_argnums`: arguments holding the batch.
    - `plan`: a `Plan` or a path to a saved one: reuse it, no search.
    - `mesh_shape`: fix the logical mesh shape, e.g. (2, 4).

    **Example:**

    ```python
    @autopar.autoparallel
    def train_step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
        ...
    state, metrics = train_step(state, batch)
    print(train_step.plan.explain())
    ```
    """
    options = PlanOptions(
        method=method,
        memory_budget=memory_budget,
        mesh_shape=None if mesh_shape is None else tuple(mesh_shape),
        donate_argnums=tuple(donate_argnums),
        batch_argnums=tuple(batch_argnums),
    )
    del num_microbatches, schedule  # used once pipelined plans run (see Plan)

    def wrap(f: Callable) -> AutoParallel:
        return AutoParallel(f, options, cluster, plan)

    return wrap if fn is None else wrap(fn)
