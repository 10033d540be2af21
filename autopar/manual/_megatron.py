"""`megatron_plan`: a Megatron-LM style plan (DP x TP, PP outermost) scored by the cost model.

In: a train step and abstract arguments (or its traced `OpGraph`), a `Cluster` and the
degrees dp, tp, pp. Out: a `Plan` that runs like any plan
(``autopar.autoparallel(step, plan=plan)``).

The parameters get Megatron's layout (Shoeybi et al. 2019; REFERENCES.md "Megatron-LM
plans"): attention QKV and MLP first linear split by columns, attention output and MLP
second linear by rows, the token embedding (and so a tied output layer) by vocabulary,
everything small replicated; the roles come from the dataflow (`_dataflow.py`). MoE
experts are split over the data axis (expert parallelism, as GShard and Megatron-DeepSpeed
do: each data-parallel rank holds E/dp experts and tokens travel by all-to-all), with the
expert FFN split over "model" like a dense MLP. The batch is split on "data"; optimizer
state takes its parameter's spec (optax's ``mu``/``nu`` trees repeat the parameter paths),
split once more over "data" with the distributed optimizer (ZeRO-1). Every other variable
is then placed by the intra-op ILP (`plan_on_mesh`'s problem with `fixed=specs`) at least
cost, with the state kept where it lies (`plan_keeping_state`).

Rank order (REFERENCES.md): TP innermost, so the devices of one "model" group are
consecutive (inside a host), then DP, then PP outermost: stage s owns devices
``s*dp*tp ... (s+1)*dp*tp - 1``, each stage with the same dp x tp layout.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from autopar._planning import input_infos, resolve_cluster, tied_state
from autopar.cluster._mesh import LogicalMesh, Spec, replicated, spec_str
from autopar.graph import OpGraph, Role, trace
from autopar.intra._ilp import evaluate, solve
from autopar.intra._options import ShardOptions
from autopar.intra._planner import _to_plan
from autopar.intra._problem import build_problem
from autopar.intra._sharding_plan import ShardingPlan
from autopar.manual._dataflow import Kind, Placement, classify_parameters
from autopar.plan import Plan, Stage

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES = ("gpipe", "1f1b")
# Path components under which a state tree keeps its parameters (see autopar.graph.trace).
PARAM_TREE_KEY = "params"
# Inputs a Megatron plan never reshards (see `plan_keeping_state`).
PINNED_ROLES = (Role.PARAM, Role.OPT_STATE, Role.BATCH)


class MeshAxis(str, enum.Enum):
    """Mesh axis names of a Megatron stage mesh, major to minor."""

    DATA = "data"
    MODEL = "model"


AXIS_NAMES = (MeshAxis.DATA.value, MeshAxis.MODEL.value)


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """The degrees and options of one Megatron-style plan.

    **Arguments:**
    - `dp`, `tp`, `pp`: data-, tensor- and pipeline-parallel degrees; dp·tp·pp devices.
    - `sequence_parallel`: split layer-norm regions on the sequence (with TP).
    - `distributed_optimizer`: shard optimizer state over "data" (ZeRO-1).
    - `num_microbatches`, `schedule`: the pipeline schedule ("gpipe" or "1f1b").
    """

    dp: int
    tp: int
    pp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    num_microbatches: int = 1
    schedule: Schedule = "1f1b"

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        """The plan's method string, e.g. ``megatron(dp=4,tp=2,pp=1)``."""
        extras = "".join(
            flag
            for flag, on in (
                (",sp", self.sequence_parallel),
                (",zero1", self.distributed_optimizer),
                (f",mb={self.num_microbatches}", self.num_microbatches > 1),
            )
            if on
        )
        return f"megatron(dp={self.dp},tp={self.tp},pp={self.pp}{extras})"


def megatron_plan(
    step_fn: Callable,
    *abstract_args: Any,
    cluster: Any,
    dp: int,
    tp: int,
    pp: int = 1,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    num_microbatches: int = 1,
    schedule: Schedule = "1f1b",
    donate_argnums: Sequence[int] = (0,),
    batch_argnums: Sequence[int] = (1,),
    overrides: Mapping[str, Any] | None = None,
    memory_budget: float | None = None,
) -> Plan:
    """A Megatron-LM style plan of `step_fn` with dp x tp x pp devices.

    **Arguments:**
    - `step_fn`, `abstract_args`: the train step and its arguments (arrays or
      `jax.ShapeDtypeStruct` pytrees).
    - `cluster`: a `Cluster`, a profile name or path, or None for the local devices; its
      first dp·tp·pp devices are used and there must be exactly that many.
    - `dp`, `tp`, `pp`, `sequence_parallel`, `distributed_optimizer`, `num_microbatches`,
      `schedule`: see `MegatronConfig`.
    - `donate_argnums`, `batch_argnums`: as in `autopar.autoparallel`.
    - `overrides`: ``{input path: spec}`` for inputs the dataflow cannot place or that
      you want elsewhere; a spec is a `PartitionSpec` or a tuple with an entry per
      dimension (None, an axis name "data"/"model", or a tuple of them).
    - `memory_budget`: bytes per device; default: the cluster's device memory.

    **Returns:** the `Plan` (method ``megatron(dp=..,tp=..,pp=..)``).

    **Example:**

    ```python
    plan = megatron_plan(step, state, batch, cluster="dgx-a100-80g", dp=2, tp=4)
    step = autopar.autoparallel(step, plan=plan)
    ```
    """
    config = MegatronConfig(
        dp=dp, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
        distributed_optimizer=distributed_optimizer, num_microbatches=num_microbatches,
        schedule=schedule,
    )
    cluster = resolve_cluster(cluster)
    check_devices(cluster, config)
    start = time.perf_counter()
    graph = trace(step_fn, *abstract_args, batch_argnums=tuple(batch_argnums))
    trace_time = time.perf_counter() - start
    plan = megatron_plan_for_graph(
        graph, cluster, config, donate_argnums=donate_argnums, overrides=overrides,
        memory_budget=memory_budget,
    )
    plan.timings["trace"] = trace_time
    return plan


def megatron_plan_for_graph(
    graph: OpGraph,
    cluster: Any,
    config: MegatronConfig,
    *,
    donate_argnums: Sequence[int] = (0,),
    overrides: Mapping[str, Any] | None = None,
    memory_budget: float | None = None,
) -> Plan:
    """`megatron_plan` for an already traced step (the grid search traces once).

    **Returns:** the `Plan`. Raises ValueError for a device-count mismatch or a parameter
    it cannot place, `MemoryBudgetError` when the layout does not fit, and
    NotImplementedError for features the planner cannot express yet.
    """
    cluster = resolve_cluster(cluster)
    check_devices(cluster, config)
    if config.sequence_parallel:
        raise NotImplementedError(
            "sequence_parallel=True needs the layer-norm regions' activations pinned split "
            "on the sequence dimension over 'model', but plan_on_mesh pins graph inputs only "
            "(fixed=...), not activations; use sequence_parallel=False"
        )
    specs = megatron_specs(graph, config, overrides)
    tied = tied_state(graph, tuple(donate_argnums))
    options = ShardOptions(method="shard", memory_budget=memory_budget)
    start = time.perf_counter()
    stages = build_stages(graph, cluster, config, specs, tied, options)
    timings = {"intra_op_ilp": time.perf_counter() - start}
    first = stages[0].sharding
    return Plan(
        method=config.name,
        cluster=cluster.to_json(),
        stages=stages,
        inputs=input_infos(graph, first),
        graph_fingerprint=first.graph_fingerprint,
        num_microbatches=config.num_microbatches,
        schedule=config.schedule,
        warnings=tuple(w for s in stages for w in s.sharding.warnings),
        timings=timings,
    )


def check_devices(cluster, config: MegatronConfig) -> None:
    """Raise ValueError unless dp·tp·pp is the cluster's number of devices."""
    if config.num_devices != cluster.num_devices:
        raise ValueError(
            f"dp*tp*pp = {config.dp}*{config.tp}*{config.pp} = {config.num_devices} devices, "
            f"but cluster {cluster.name!r} has {cluster.num_devices} "
            f"({cluster.num_hosts} host(s) x {cluster.devices_per_host}); choose degrees "
            f"whose product is {cluster.num_devices}"
        )


def stage_mesh(cluster, config: MegatronConfig, stage: int) -> LogicalMesh:
    """The (dp, tp) mesh of pipeline stage `stage`: PP outermost, TP innermost."""
    per_stage = config.dp * config.tp
    first = stage * per_stage
    assert 0 <= stage < config.pp, f"stage {stage} out of range for pp={config.pp}"
    assert first + per_stage <= cluster.num_devices, "check_devices must run first"
    return LogicalMesh.create(
        (config.dp, config.tp), range(first, first + per_stage), AXIS_NAMES
    )


def build_stages(graph, cluster, config, specs, tied, options) -> tuple[Stage, ...]:
    """The plan's stages: the one place that needs pipeline support for pp > 1.

    Each stage is "layers split evenly into pp stages, each on `stage_mesh(cluster,
    config, s)` with the same `specs` for the inputs it uses".
    """
    if config.pp > 1 or config.num_microbatches > 1:
        raise NotImplementedError(
            f"Megatron plans with pp={config.pp} pipeline stages and num_microbatches="
            f"{config.num_microbatches} need the pipeline runtime, which is not available "
            "yet; use pp=1 and num_microbatches=1"
        )
    sharding = plan_keeping_state(
        graph, cluster, stage_mesh(cluster, config, 0), options, tied, fixed=specs
    )
    return (Stage((0, 1), sharding),)


def plan_keeping_state(graph, cluster, mesh, options, tied, fixed) -> ShardingPlan:
    """`plan_on_mesh` where parameters, optimizer state and the batch never move.

    Megatron communicates activations and gradients only: a column-parallel weight is
    multiplied where it lies, never all-gathered, and each data-parallel rank reads only
    its own part of the batch. Left free, the ILP may find it cheaper to gather small
    weights (ZeRO-3 style) or the whole batch (no data parallelism), which are other
    plans. So every resharding of such an input towards a consumer gets a penalty larger
    than any plan's whole cost; the ILP then places the remaining operators at least cost
    around the pinned inputs. The predicted costs are those of the unpenalised problem.
    """
    built = build_problem(graph, mesh, cluster, options, tied, fixed)
    penalised, forbidden = _penalise_moving_state(built, graph)
    solution = solve(penalised, time_limit=options.time_limit, solver=options.solver)
    plan = _to_plan(graph, mesh, cluster, built, solution.choices, tied)
    moved = sorted(
        {built.ilp_nodes[u].name for (u, v), mask in forbidden
         if mask[solution.choices[u], solution.choices[v]]}
    )
    warnings = tuple(plan.warnings) + tuple(
        f"{name} is resharded for a consumer that has no strategy using it in place"
        for name in moved
    )
    stats = dict(
        plan.stats,
        solve_time=solution.stats.solve_time,
        objective=evaluate(built.problem, solution.choices),
        status=solution.status,
        num_ilp_nodes=solution.stats.num_nodes,
        solver=solution.stats.solver,
    )
    return replace(plan, warnings=warnings, stats=stats)


def _penalise_moving_state(built, graph: OpGraph):
    """The problem with every move of a `PINNED_ROLES` input penalised, and the
    forbidden (edge, mask) pairs."""
    problem = built.problem
    state = {
        i for i, n in enumerate(built.ilp_nodes)
        if n.var is not None and graph.vars[n.var].role in PINNED_ROLES
    }
    # An upper bound on any plan's cost: each node and edge at its dearest.
    bound = sum(float(c.max()) for c in problem.node_costs if len(c)) + sum(
        float(m.max()) for m in problem.edge_costs if m.size
    )
    costs = list(problem.edge_costs)
    forbidden = []
    for e, ((u, v), matrix) in enumerate(zip(problem.edges, problem.edge_costs)):
        if u in state and (matrix > 0).any():
            mask = matrix > 0
            costs[e] = matrix + mask * bound
            forbidden.append(((u, v), mask))
    return replace(problem, edge_costs=tuple(costs)), forbidden


# ---- the layout of the inputs -----------------------------------------------------------


def megatron_specs(
    graph: OpGraph, config: MegatronConfig, overrides: Mapping[str, Any] | None = None
) -> dict[int, Spec]:
    """The spec of every non-constant input of `graph` on a (dp, tp) stage mesh.

    **Arguments:**
    - `graph`: the traced step.
    - `config`: supplies dp, tp and `distributed_optimizer`.
    - `overrides`: ``{input path: spec}``, taking precedence.

    **Returns:** ``{input var id: spec}`` (axes of size 1 left out).
    """
    by_path = _check_overrides(graph, overrides or {})
    placements = classify_parameters(graph)
    specs: dict[int, Spec] = {}
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is Role.CONST:
            continue
        if var.path in by_path:
            specs[v] = by_path[var.path]
        elif var.role is Role.PARAM:
            specs[v] = param_spec(var.path or f"input {v}", var.shape, placements[v], config)
        elif var.role is Role.BATCH:
            specs[v] = _batch_spec(var, config)
        else:
            specs[v] = replicated(len(var.shape))
    _state_specs(graph, specs, set(by_path), config)
    return {v: _drop_unit_axes(spec, config) for v, spec in specs.items()}


def param_spec(path: str, shape: tuple[int, ...], placement: Placement, config) -> Spec:
    """Resolve a mesh-independent `Placement` to a spec on a (dp, tp) mesh."""
    spec: list[tuple[str, ...]] = [()] * len(shape)
    if placement.kind is Kind.UNPLACED:
        if config.tp > 1:
            raise ValueError(_cannot_place(path, shape, placement.reason))
        return tuple(spec)
    if placement.expert_dim is not None and shape[placement.expert_dim] % config.dp == 0:
        spec[placement.expert_dim] = (MeshAxis.DATA.value,)
    if placement.model_dim is not None and config.tp > 1:
        dim = placement.model_dim
        if shape[dim] % config.tp:
            raise ValueError(
                _cannot_place(
                    path, shape,
                    f"as a {placement.kind.value} weight its dim {dim} ({shape[dim]}) would be "
                    f"split over tp={config.tp} devices, which does not divide it",
                )
            )
        spec[dim] = (MeshAxis.MODEL.value,)
    return tuple(spec)


def _cannot_place(path: str, shape, why: str) -> str:
    return (
        f"cannot place parameter {path} of shape {tuple(shape)}: {why}. Pass "
        f"overrides={{{path!r}: spec}} (e.g. P(None, 'model') or P() for replicated), "
        "or choose a tp that divides it"
    )


def _batch_spec(var, config: MegatronConfig) -> Spec:
    if not var.shape or config.dp == 1:
        return replicated(len(var.shape))
    if var.shape[0] % config.dp:
        raise ValueError(
            f"batch input {var.path} has {var.shape[0]} examples on dim 0, which dp="
            f"{config.dp} does not divide; choose a batch size that is a multiple of dp"
        )
    return ((MeshAxis.DATA.value,),) + replicated(len(var.shape) - 1)


def _state_specs(graph: OpGraph, specs: dict[int, Spec], overridden: set, config) -> None:
    """Optimizer state takes its parameter's spec (matched by path suffix and shape);
    with the distributed optimizer it is also split over "data"."""
    params = {
        _param_key(graph.vars[v].path): v
        for v in graph.invars
        if graph.vars[v].role is Role.PARAM and graph.vars[v].path
    }
    lengths = sorted({len(k) for k in params}, reverse=True)
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is not Role.OPT_STATE or var.path in overridden:
            continue
        parts = tuple(var.path.split("/")) if var.path else ()
        match = next(
            (params[parts[-n:]] for n in lengths
             if n <= len(parts) and parts[-n:] in params
             and graph.vars[params[parts[-n:]]].shape == var.shape),
            None,
        )
        spec = specs[match] if match is not None else replicated(len(var.shape))
        if config.distributed_optimizer:
            spec = _zero1(spec, var.shape, config)
        specs[v] = spec


def _param_key(path: str) -> tuple[str, ...]:
    """``params/layers/0/w`` -> ``("layers", "0", "w")``: the part optax trees repeat."""
    parts = path.split("/")
    if PARAM_TREE_KEY in parts:
        parts = parts[len(parts) - parts[::-1].index(PARAM_TREE_KEY):]
    return tuple(parts)


def _zero1(spec: Spec, shape, config: MegatronConfig) -> Spec:
    """Also split over "data": the first unsplit dim it divides, else a "model" dim."""
    data = MeshAxis.DATA.value
    if config.dp == 1 or any(data in axes for axes in spec):
        return spec
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if not axes and size % config.dp == 0:
            return spec[:dim] + ((data,),) + spec[dim + 1:]
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes == (MeshAxis.MODEL.value,) and size % (config.dp * config.tp) == 0:
            return spec[:dim] + ((data, MeshAxis.MODEL.value),) + spec[dim + 1:]
    return spec


def _drop_unit_axes(spec: Spec, config: MegatronConfig) -> Spec:
    sizes = {MeshAxis.DATA.value: config.dp, MeshAxis.MODEL.value: config.tp}
    return tuple(tuple(a for a in axes if sizes[a] > 1) for axes in spec)


def _check_overrides(graph: OpGraph, overrides: Mapping[str, Any]) -> dict[str, Spec]:
    """Overrides as specs, checked against the inputs' paths, ranks and axis names."""
    shapes = {graph.vars[v].path: graph.vars[v].shape for v in graph.invars}
    result = {}
    for path, value in overrides.items():
        if path not in shapes:
            known = ", ".join(sorted(p for p in shapes if p)[:8])
            raise ValueError(
                f"overrides names {path!r}, which is not an input of the step; use an "
                f"input path such as: {known}, ..."
            )
        spec = normalize_spec(value, len(shapes[path]), path)
        result[path] = spec
    return result


def normalize_spec(value: Any, ndim: int, path: str = "input") -> Spec:
    """A spec from a `PartitionSpec` or a tuple of None / axis name / tuple of names.

    Trailing dimensions not mentioned are replicated, as in `PartitionSpec`.
    """
    entries = list(value)
    if len(entries) > ndim:
        raise ValueError(
            f"override for {path} has {len(entries)} entries but the input has {ndim} "
            "dimensions; give one entry (None or mesh axes) per dimension"
        )
    spec = []
    for entry in entries + [None] * (ndim - len(entries)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in axes if a not in AXIS_NAMES]
        if unknown:
            raise ValueError(
                f"override for {path} uses mesh axes {unknown}; a Megatron mesh has axes "
                f"{AXIS_NAMES}"
            )
        spec.append(axes)
    return tuple(spec)


@dataclass(frozen=True)
class LayoutRow:
    """One parameter's Megatron role and spec, for reports (`describe_layout`)."""

    path: str
    shape: tuple[int, ...]
    kind: str
    spec: str
    reason: str = field(default="", compare=False)


def describe_layout(graph: OpGraph, config: MegatronConfig) -> list[LayoutRow]:
    """Each parameter's role, spec on the (dp, tp) mesh and the reason, in input order."""
    placements = classify_parameters(graph)
    rows = []
    for v, placement in placements.items():
        var = graph.vars[v]
        path = var.path or f"input {v}"
        try:
            spec = spec_str(_drop_unit_axes(param_spec(path, var.shape, placement, config),
                                            config))
        except ValueError:
            spec = "(cannot place)"
        rows.append(LayoutRow(path, var.shape, placement.kind.value, spec, placement.reason))
    return rows
