"""`autopar.plan`: trace a train step and search for a plan, without running anything."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax

from autopar.graph import OpGraph, Role, trace
from autopar.graph._trace import path_str
from autopar.intra._options import ShardOptions
from autopar.intra._planner import plan_sharding
from autopar.plan import InputInfo, Plan, Stage

log = logging.getLogger("autopar")

Method = Literal["auto", "shard", "data", "zero2", "zero3"]
METHODS = ("auto", "shard", "data", "zero2", "zero3")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything the search takes besides the function, its arguments and the cluster."""

    method: Method = "auto"
    memory_budget: float | None = None
    mesh_shape: tuple[int, ...] | None = None
    donate_argnums: tuple[int, ...] = (0,)
    batch_argnums: tuple[int, ...] = (1,)
    ilp_time_limit: float = 60.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(
                f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}"
            )


def resolve_cluster(cluster: Any):
    """A `Cluster` from None (local devices), a profile name, a path, or a Cluster."""
    from autopar.cluster import Cluster

    if cluster is None:
        return Cluster.local()
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.from_profile(cluster)
    raise TypeError(
        f"cluster must be None, a Cluster, or a profile name or path, got {type(cluster).__name__}"
    )


def tied_state(graph: OpGraph, donate_argnums: Sequence[int]) -> list[tuple[int, int]]:
    """(output var, input var) pairs where the step returns its updated state.

    The first output (the new state) is matched leaf by leaf, by pytree path, shape and
    dtype, to the first donated argument (the old state), or to argument 0 when nothing is
    donated.
    """
    state_arg = donate_argnums[0] if donate_argnums else 0
    by_path = {
        path[1:]: v
        for v, path in zip(graph.invars, _leaf_paths(graph.in_tree))
        if path and path[0] == state_arg
    }
    pairs = []
    for v, path in zip(graph.outvars, _leaf_paths(graph.out_tree)):
        u = by_path.get(path[1:]) if path and path[0] == 0 else None
        if u is None:
            continue
        a, b = graph.vars[u], graph.vars[v]
        if a.shape == b.shape and a.dtype == b.dtype:
            pairs.append((v, u))
    return pairs


def _leaf_paths(tree) -> list[tuple]:
    """For each leaf of a treedef, its key path as a tuple of plain keys."""
    if tree is None:
        return []
    skeleton = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
    with_path, _ = jax.tree_util.tree_flatten_with_path(skeleton)
    out = [()] * tree.num_leaves
    for keypath, index in with_path:
        out[index] = tuple(path_str([k]) for k in keypath)
        if out[index] and out[index][0].isdigit():
            out[index] = (int(out[index][0]),) + out[index][1:]
    return out


def make_plan(graph: OpGraph, cluster, options: PlanOptions) -> Plan:
    """Search for a plan of a traced graph on a cluster."""
    timings: dict[str, float] = {}
    method = "shard" if options.method == "auto" else options.method
    shard_options = ShardOptions(
        method=method, memory_budget=options.memory_budget, time_limit=options.ilp_time_limit
    )
    tied = tied_state(graph, options.donate_argnums)
    start = time.perf_counter()
    sharding = plan_sharding(
        graph, cluster, options=shard_options, tied=tied, mesh_shape=options.mesh_shape
    )
    timings["intra_op_ilp"] = time.perf_counter() - start
    log.info("intra-op planning: %.2f s, mesh %s", timings["intra_op_ilp"], sharding.mesh.shape)
    warnings = list(sharding.warnings)
    if options.method == "auto":
        warnings.append(
            "method='auto' searched operator parallelism on one stage (pipeline stages "
            "are not searched yet)"
        )
    return Plan(
        method=options.method,
        cluster=cluster.to_json(),
        stages=(Stage((0, 1), sharding),),
        inputs=input_infos(graph, sharding),
        graph_fingerprint=sharding.graph_fingerprint,
        warnings=tuple(warnings),
        timings=timings,
    )


def input_infos(graph: OpGraph, sharding) -> tuple[InputInfo, ...]:
    infos = []
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is Role.CONST:
            continue
        spec = sharding.var_specs[v] or ((),) * len(var.shape)
        infos.append(InputInfo(var.path or f"input{v}", var.shape, var.dtype, var.role.value, spec))
    return tuple(infos)


def plan(
    fn: Callable,
    *args: Any,
    cluster: Any = None,
    method: Method = "auto",
    memory_budget: float | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    donate_argnums: Sequence[int] = (0,),
    batch_argnums: Sequence[int] = (1,),
) -> Plan:
    """Plan `fn(*args)` on a cluster without running it (a dry run; no devices needed).

    **Arguments:**
    - `args`: arrays or `jax.ShapeDtypeStruct` pytrees, as `fn` takes them.
    - `cluster`: a `Cluster`, a profile name or path (`"dgx-a100-80g"`), or None for the
      local devices.
    - the rest as in `autopar.autoparallel`.

    **Returns:** the `Plan`.

    **Example:**

    ```python
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    plan = autopar.plan(train_step, abstract_state, abstract_batch, cluster=cluster)
    print(plan.explain())
    ```
    """
    options = PlanOptions(
        method=method,
        memory_budget=memory_budget,
        mesh_shape=mesh_shape,
        donate_argnums=tuple(donate_argnums),
        batch_argnums=tuple(batch_argnums),
    )
    cluster = resolve_cluster(cluster)
    start = time.perf_counter()
    graph = trace(fn, *args, batch_argnums=options.batch_argnums)
    trace_time = time.perf_counter() - start
    result = make_plan(graph, cluster, options)
    result.timings["trace"] = trace_time
    return result
