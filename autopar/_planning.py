"""`autopar.plan`: trace a train step and search for a plan, without running anything."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax

from autopar._markers import auto_layers
from autopar.graph import OpGraph, Role, trace
from autopar.graph._trace import path_str
from autopar.intra._options import ShardOptions
from autopar.intra._planner import plan_sharding
from autopar.intra._sharding_plan import graph_fingerprint
from autopar.plan import InputInfo, Plan, Stage

log = logging.getLogger("autopar")

Method = Literal["auto", "shard", "data", "zero2", "zero3"]
Schedule = Literal["gpipe", "1f1b"]
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
    # pipeline options (method="auto")
    num_microbatches: int | Literal["auto"] = "auto"
    schedule: Schedule = "1f1b"
    num_stages: int | None = None
    submeshes: tuple[tuple[int, int], ...] | None = None  # allowed (hosts, devices per host)
    logical_shapes: tuple[tuple[int, ...], ...] | None = None  # allowed stage mesh shapes
    num_layers: int = 8  # layers cut automatically when the model has no layer marks

    def __post_init__(self):
        # Callers may pass lists; keep the frozen options hashable plain tuples.
        def tuples(value, depth):
            if value is None:
                return None
            return tuple(tuples(v, depth - 1) for v in value) if depth else value

        for name, depth in (("mesh_shape", 1), ("donate_argnums", 1), ("batch_argnums", 1),
                            ("submeshes", 2), ("logical_shapes", 2)):
            object.__setattr__(self, name, tuples(getattr(self, name), depth))
        if self.method not in METHODS:
            raise ValueError(
                f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}"
            )
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown schedule {self.schedule!r}; use 'gpipe' or '1f1b'")
        m = self.num_microbatches
        if m != "auto" and (not isinstance(m, int) or m < 1):
            raise ValueError(f"num_microbatches must be a positive int or 'auto', got {m!r}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")


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
    num_microbatches: int | Literal["auto"] = "auto",
    schedule: Schedule = "1f1b",
    num_stages: int | None = None,
    submeshes: Sequence[tuple[int, int]] | None = None,
    logical_shapes: Sequence[tuple[int, ...]] | None = None,
    cache: Any = None,
) -> Plan:
    """Plan `fn(*args)` on a cluster without running it (a dry run; no devices needed).

    **Arguments:**
    - `args`: arrays or `jax.ShapeDtypeStruct` pytrees, as `fn` takes them.
    - `cluster`: a `Cluster`, a profile name or path (`"dgx-a100-80g"`), or None for the
      local devices.
    - the rest as in `autopar.autoparallel`; `num_stages`, `submeshes` ((hosts, devices per
      host) pairs a stage may use) and `logical_shapes` fix parts of the pipeline search.
    - `cache`: a `PlanCache`, False for none, None for the default on-disk cache
      (``AUTOPAR_PLAN_CACHE=0`` turns it off).

    **Returns:** the `Plan`.

    **Example:**

    ```python
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    plan = autopar.plan(train_step, abstract_state, abstract_batch, cluster=cluster)
    print(plan.explain())
    ```
    """
    options = PlanOptions(
        method=method, memory_budget=memory_budget, mesh_shape=mesh_shape,
        donate_argnums=donate_argnums, batch_argnums=batch_argnums,
        num_microbatches=num_microbatches, schedule=schedule, num_stages=num_stages,
        submeshes=submeshes, logical_shapes=logical_shapes,
    )
    cluster = resolve_cluster(cluster)
    result, _ = search(fn, args, cluster, options, cache)
    return result


# ---- the full search: operator parallelism and pipeline stages -----------------------------

MAX_MICROBATCH_CANDIDATES = 3


def batch_size(graph: OpGraph) -> int | None:
    """Rows of the batch (dim 0 of the batch inputs), or None without batch inputs."""
    sizes = {graph.vars[v].shape[0] for v in graph.invars
             if graph.vars[v].role is Role.BATCH and graph.vars[v].shape}
    if len(sizes) > 1:
        raise ValueError(
            f"batch inputs have different leading sizes {sorted(sizes)}; every batch leaf "
            "must have the batch as its first dimension"
        )
    return sizes.pop() if sizes else None


def microbatch_args(args: Sequence[Any], batch_argnums: Sequence[int], num_microbatches: int):
    """Abstract arguments with every batch leaf cut to one microbatch."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp_shape(x), x.dtype), tuple(args))
    out = list(abstract)
    for i in batch_argnums:
        if i >= len(out):
            continue

        def cut(x, i=i):
            if not x.shape:
                return x
            if x.shape[0] % num_microbatches:
                raise ValueError(
                    f"the batch argument {i} has {x.shape[0]} rows, which is not divisible "
                    f"by num_microbatches={num_microbatches}; choose a number of "
                    f"microbatches that divides {x.shape[0]}"
                )
            return jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype)

        out[i] = jax.tree.map(cut, out[i])
    return tuple(out)


def jnp_shape(x) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def _microbatch_candidates(options: PlanOptions, rows: int | None) -> list[int]:
    if options.num_microbatches != "auto":
        if rows is not None and rows % options.num_microbatches:
            raise ValueError(
                f"the batch has {rows} rows, which is not divisible by num_microbatches="
                f"{options.num_microbatches}; choose a number of microbatches that divides "
                f"{rows}"
            )
        return [options.num_microbatches]
    if rows is None:
        return [1]
    # One microbatch (no pipeline bubble to fill, no accumulation), and the largest few
    # powers of two that divide the batch (the bubble shrinks as microbatches grow).
    powers = [b for b in (2, 4, 8, 16, 32, 64) if rows % b == 0 and b <= rows]
    return [1, *powers[-(MAX_MICROBATCH_CANDIDATES - 1):]]


def search(fn: Callable, args: Sequence[Any], cluster, options: PlanOptions, cache=None):
    """Trace and plan `fn(*args)`. Returns `(plan, graph)`, `graph` traced at the size the
    plan runs at (one microbatch for a pipelined plan, the whole batch otherwise).

    `cache`: a `PlanCache` (None: the default on-disk cache, `False`: none). A hit skips the
    search; the key covers the traced program, the cluster, the options and autopar's code.
    """
    from autopar._cache import PlanCache, cache_key
    from autopar._progress import phase

    timings: dict[str, float] = {}
    with phase("trace", timings):
        graph = trace(fn, *args, batch_argnums=options.batch_argnums)
    if cache is None:
        cache = PlanCache(version=code_version())
    key = None
    if cache:
        key = cache_key(
            graph_fingerprint(graph), cluster.to_json(), dataclasses.asdict(options),
            code_version(),
        )
        cached = cache.get(key)
        if cached is not None:
            log.info("plan cache hit: %s", cache.path(key))
            return cached, graph_for_plan(fn, args, cached, options, graph)
    with phase("search", timings):
        plan, run_graph = _search(fn, args, cluster, options, graph, timings["trace"])
    plan.timings.update({k: v for k, v in timings.items() if k not in plan.timings})
    if cache and key is not None:
        cache.put(key, plan)
    return plan, run_graph


def graph_for_plan(fn, args, plan: Plan, options: PlanOptions, full_graph=None) -> OpGraph:
    """The graph a plan runs: the whole step, or one microbatch of it for the pipeline."""
    if plan.runtime == "spmd" and full_graph is not None:
        return full_graph
    run_args = args
    if plan.runtime == "pipeline":
        run_args = microbatch_args(args, options.batch_argnums, plan.num_microbatches)
    with auto_layers(plan.auto_layers):
        graph = trace(fn, *run_args, batch_argnums=options.batch_argnums)
    plan.check_graph(graph)
    return graph


_CODE_VERSION: str | None = None


def code_version() -> str:
    """autopar's version and a hash of its source, so a code change never reuses a plan."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        import hashlib
        from pathlib import Path

        from autopar import __version__

        h = hashlib.sha256()
        for path in sorted(Path(__file__).parent.rglob("*.py")):
            h.update(path.read_bytes())
        _CODE_VERSION = f"{__version__}+{h.hexdigest()[:12]}"
    return _CODE_VERSION


def _search(fn, args, cluster, options: PlanOptions, graph: OpGraph, trace_time: float):
    from autopar.inter._layers import assign_layers
    from autopar.inter._planner import choose_stages
    from autopar.inter._submesh import SubmeshShape

    if options.method != "auto":
        plan = make_plan(graph, cluster, options)
        plan.timings["trace"] = trace_time
        return plan, graph
    has_marks = any(n.primitive == "layer_boundary" for n in graph.nodes)
    has_boundary = any(n.primitive == "grad_boundary" for n in graph.nodes)
    if not has_boundary or cluster.num_devices == 1:
        plan = make_plan(graph, cluster, options)
        if cluster.num_devices > 1:
            plan = _with_warning(
                plan,
                "pipeline stages not searched: the step does not use autopar.value_and_grad "
                "or autopar.grad, so its gradient boundary is unknown",
            )
        plan.timings["trace"] = trace_time
        return plan, graph
    auto = None if has_marks else options.num_layers

    shard_options = ShardOptions(
        method="shard", memory_budget=options.memory_budget, time_limit=options.ilp_time_limit
    )
    submeshes = None
    if options.submeshes is not None:
        submeshes = [SubmeshShape(h, d) for h, d in options.submeshes]
    best = None
    one_microbatch = None
    last_error: ValueError | None = None
    timings = {"trace": trace_time}
    for num_micro in _microbatch_candidates(options, batch_size(graph)):
        t = time.perf_counter()
        with auto_layers(auto):
            mb_graph = trace(
                fn, *microbatch_args(args, options.batch_argnums, num_micro),
                batch_argnums=options.batch_argnums,
            )
        layers = assign_layers(mb_graph)
        tied = tied_state(mb_graph, options.donate_argnums)
        timings["trace"] += time.perf_counter() - t
        t = time.perf_counter()
        try:
            choice = choose_stages(
                mb_graph, layers, cluster, num_micro, options.schedule, shard_options, tied,
                num_stages=options.num_stages, submeshes=submeshes,
                logical_shapes=options.logical_shapes,
            )
        except ValueError as err:
            last_error = err
            log.info("%d microbatch(es): no plan (%s)", num_micro, str(err).split(";")[0])
            continue
        timings["stage_dp_and_ilps"] = timings.get("stage_dp_and_ilps", 0.0) + (
            time.perf_counter() - t
        )
        log.info(
            "%d microbatch(es): %d stage(s), predicted %.4g s",
            num_micro, len(choice.stage_layers), choice.latency,
        )
        if num_micro == 1:
            one_microbatch = (choice, mb_graph, num_micro)
        if best is None or choice.latency < best[0].latency:
            best = (choice, mb_graph, num_micro)
    if best is None:
        raise last_error
    choice, mb_graph, num_micro = best
    if len(choice.stage_layers) == 1 and num_micro > 1 and one_microbatch is not None and len(
        one_microbatch[0].stage_layers
    ) == 1:
        # One stage: no pipeline, so no microbatches either; plan the whole batch.
        choice, mb_graph, num_micro = one_microbatch
    # (With a number of microbatches the user fixed, one stage keeps them: gradient
    # accumulation over microbatches, as asked.)
    stages = tuple(
        Stage(layers, sp) for layers, sp in zip(choice.stage_layers, choice.stage_plans)
    )
    part = choice.partition
    inputs = []
    for v in mb_graph.invars:
        var = mb_graph.vars[v]
        if var.role is Role.CONST:
            continue
        home = part.home.get(v, 0)
        spec = choice.stage_plans[home].var_specs[v] or ((),) * len(var.shape)
        inputs.append(InputInfo(var.path or f"input{v}", var.shape, var.dtype, var.role.value,
                                spec, home))
    warnings = tuple(dict.fromkeys(w for sp in choice.stage_plans for w in sp.warnings))
    plan = Plan(
        method="auto",
        cluster=cluster.to_json(),
        stages=stages,
        inputs=tuple(inputs),
        graph_fingerprint=graph_fingerprint(mb_graph),
        num_microbatches=num_micro,
        schedule=options.schedule,
        warnings=warnings,
        timings=timings,
        auto_layers=auto,
        runtime="pipeline",
    )
    return plan, mb_graph


def _with_warning(plan: Plan, warning: str) -> Plan:
    return dataclasses.replace(plan, warnings=(*plan.warnings, warning))
