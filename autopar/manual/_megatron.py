"""`megatron_plan`: a Megatron-LM style plan (DP x TP, PP outermost) scored by the cost model.

In: a train step and abstract arguments (or its traced `OpGraph`), a `Cluster` and the
degrees dp, tp, pp. Out: a `Plan` that runs like any plan
(``autopar.autoparallel(step, plan=plan)``).

The parameters get Megatron's layout (Shoeybi et al. 2019; REFERENCES.md "Megatron-LM
plans"): attention QKV and MLP first linear split by columns, attention output and MLP
second linear by rows, the token embedding (and so a tied output layer) by vocabulary,
everything small replicated; the roles come from the dataflow (`_dataflow.py`) and become
specs in `_layout.py`. MoE experts are split over the data axis (expert parallelism, as
GShard and Megatron-DeepSpeed do: each data-parallel rank holds E/dp experts and tokens
travel by all-to-all), with the expert FFN split over "model" like a dense MLP. Every
other variable is then placed by the intra-op ILP (`plan_on_mesh`'s problem with
`fixed=specs`) at least cost, with the pinned inputs kept where they lie
(`plan_keeping_state`). The forward residual stream (layer norms, residual and bias adds,
embedding output) is pinned too (`_sequence.py`): whole on "model" as Megatron's tensor
parallelism leaves it, or, with sequence parallelism (Korthikanti et al. 2022), split on
the sequence over "model", so that the ILP turns each block's all-reduce into a
reduce-scatter and all-gathers the block input.

Rank order (REFERENCES.md): TP innermost, so the devices of one "model" group are
consecutive (inside a host), then DP, then PP outermost: stage s owns devices
``s*dp*tp ... (s+1)*dp*tp - 1``, each stage with the same dp x tp layout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from autopar._memo import search_scoped
from autopar.choices import Remat
from autopar.cluster._mesh import LogicalMesh, Spec, replicated
from autopar.cost import (
    boundary_transfer_time,
    bytes_per_device,
    check_ulysses_heads,
    device_group_memory,
    distributed_optimizer_param_bytes,
    in_flight_microbatches,
)
from autopar.cost import memory_budget as device_budget
from autopar.graph import OpGraph, Role, tied_state, trace
from autopar.graph._opgraph import dtype_itemsize
from autopar.inter import assign_layers, partition
from autopar.inter._choose import recompute_time
from autopar.inter._layer_pricing import boundary_bytes
from autopar.inter._stage_fit import choose_remat
from autopar.inter._stitch import fingerprint_of
from autopar.intra import ContextParallelError, MemoryBudgetError
from autopar.intra._ilp import evaluate, solve
from autopar.intra._options import ShardOptions
from autopar.intra._planner import _to_plan
from autopar.intra._problem import build_problem
from autopar.intra._sharding_plan import ShardingPlan
from autopar.manual._context_experts import (
    AttentionShape,
    MoEShape,
    context_args,
    context_terms,
    expert_terms,
    local_attention_core,
    with_terms,
)
from autopar.manual._dataflow import classify_parameters
from autopar.manual._layout import (
    AXIS_NAMES,
    MegatronConfig,
    MeshAxis,
    Schedule,
    megatron_specs,
)
from autopar.manual._sequence import pin_activations, residual_specs
from autopar.manual._zero2 import zero2_stage
from autopar.plan import Plan, Stage, input_infos
from autopar.search import microbatch_args, resolve_cluster

# Inputs a Megatron plan never reshards (see `plan_keeping_state`).
PINNED_ROLES = (Role.PARAM, Role.OPT_STATE, Role.BATCH)


@search_scoped
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
    recompute: Remat = "none",
    virtual_stages: int = 1,
    even_chunks: bool = True,
    donate_argnums: Sequence[int] = (0,),
    batch_argnums: Sequence[int] = (1,),
    overrides: Mapping[str, Any] | None = None,
    memory_budget: float | None = None,
    cp: int = 1,
    cp_algorithm: str = "ring",
    ep: int | None = None,
    etp: int | None = None,
    attention: AttentionShape | None = None,
    moe: MoEShape | None = None,
    zero2: bool = False,
) -> Plan:
    """A Megatron-LM style plan of `step_fn` with dp x cp x tp x pp devices.

    **Arguments:**
    - `step_fn`, `abstract_args`: the train step and its arguments (arrays or
      `jax.ShapeDtypeStruct` pytrees).
    - `cluster`: a `Cluster`, a profile name or path, or None for the local devices; its
      first dp·tp·pp devices are used and there must be exactly that many.
    - `dp`, `tp`, `pp`, `sequence_parallel`, `distributed_optimizer`, `num_microbatches`,
      `schedule`, `recompute`, `virtual_stages`, `even_chunks`: see `MegatronConfig`.
    - `donate_argnums`, `batch_argnums`: as in `autopar.autoparallel`.
    - `overrides`: ``{input path: spec}`` for inputs the dataflow cannot place or that
      you want elsewhere; a spec is a `PartitionSpec` or a tuple with an entry per
      dimension (None, an axis name "data"/"model", or a tuple of them).
    - `memory_budget`: bytes per device; default: the cluster's device memory.
    - `cp`, `cp_algorithm`, `ep`, `etp`, `zero2`: see `MegatronConfig`; `attention`, `moe`: see
      `megatron_plan_for_graph` (with cp > 1 the step is traced at one CP rank's shapes,
      `context_args`, and the plan is priced, not run).

    **Returns:** the `Plan` (method ``megatron(dp=..,tp=..,pp=..)``, with ``,sp`` under
    sequence parallelism). Raises ValueError when dp·tp·pp is not the number of devices,
    a parameter cannot be placed (naming it and the `overrides` fix), pp exceeds the
    layers marked with `autopar.layer_boundary`, or sequence parallelism cannot apply
    (tp = 1, tp not dividing the sequence, no (batch, sequence) input); and
    `MemoryBudgetError` when the layout does not fit.

    **Example:**

    ```python
    plan = megatron_plan(step, state, batch, cluster="dgx-a100-80g", dp=2, tp=4)
    step = autopar.autoparallel(step, plan=plan)
    ```
    """
    config = MegatronConfig(
        dp=dp, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
        distributed_optimizer=distributed_optimizer, num_microbatches=num_microbatches,
        schedule=schedule, recompute=recompute, virtual_stages=virtual_stages,
        even_chunks=even_chunks, cp=cp, cp_algorithm=cp_algorithm, ep=ep, etp=etp,
        zero2=zero2,
    )
    cluster = resolve_cluster(cluster)
    check_devices(cluster, config)
    start = time.perf_counter()
    graph = _traced(step_fn, abstract_args, tuple(batch_argnums), config)
    trace_time = time.perf_counter() - start
    plan = megatron_plan_for_graph(
        graph, cluster, config, donate_argnums=donate_argnums, overrides=overrides,
        memory_budget=memory_budget, attention=attention, moe=moe,
    )
    plan.timings["trace"] = trace_time
    return plan


def _traced(step_fn: Callable, abstract_args, batch_argnums: tuple, config: MegatronConfig):
    """`step_fn` traced as `config` runs it: at one CP rank's shapes (`context_args`) and,
    pipelined or accumulating, at one microbatch (what the pipeline runtime runs)."""
    args = context_args(abstract_args, batch_argnums, config.cp)
    if config.pp > 1 or config.num_microbatches > 1:
        args = microbatch_args(args, batch_argnums, config.num_microbatches)
    return trace(step_fn, *args, batch_argnums=batch_argnums)


def megatron_plan_for_graph(
    graph: OpGraph,
    cluster: Any,
    config: MegatronConfig,
    *,
    donate_argnums: Sequence[int] = (0,),
    overrides: Mapping[str, Any] | None = None,
    memory_budget: float | None = None,
    solve_cache: dict | None = None,
    attention: AttentionShape | None = None,
    moe: MoEShape | None = None,
) -> Plan:
    """`megatron_plan` for an already traced step (the grid search traces once).

    With ``config.cp > 1`` the step must be traced at one CP rank's shapes
    (`context_args`: batch × cp, sequence / cp) and `attention` given: the plan is made
    on the (dp·cp, tp) mesh and CP's attention work, K/V traffic and buffers are added
    per stage (`_context_experts.py`). With `moe` the step is the MoE model's dense proxy
    (`MoEShape.proxy_ffn`) and EP's all-to-alls and expert memory are added.

    `solve_cache`: a dict kept across calls on the same `graph` object (the grid search
    passes one): each layer's ILP is keyed by everything it is built from (the layer's
    variables, mesh shape, pinned specs, ties, weights, options), so configurations that
    share a layer problem solve it once.

    **Returns:** the `Plan`. Raises ValueError and `MemoryBudgetError` as
    `megatron_plan` does.
    """
    cluster = resolve_cluster(cluster)
    check_devices(cluster, config)
    config.check_microbatches()
    check_context_experts(graph, config, attention, moe)
    stages, ilp_time = _megatron_stages(graph, cluster, config, donate_argnums, overrides,
                                        memory_budget, solve_cache, attention, moe)
    return _megatron_result(graph, cluster, config, stages, {"intra_op_ilp": ilp_time})


def _megatron_stages(graph: OpGraph, cluster, config: MegatronConfig, donate_argnums,
                     overrides, memory_budget, solve_cache, attention, moe):
    """The stages of `config`'s plan, planned on its (dp·cp, tp) data mesh with CP's and
    EP's terms added; (stages, seconds spent building and adding them)."""
    outer, config = config, config.data_config()
    specs = megatron_specs(graph, config, overrides)
    pinned = residual_specs(graph, config)
    tied = tied_state(graph, tuple(donate_argnums))
    budget = device_budget(cluster, memory_budget)
    # An MoE's dense proxy holds k experts per layer where EP leaves E/ep: when that is
    # fewer, the proxy is checked against the budget plus what EP frees (the stages are
    # checked against the real budget once the expert terms are added).
    relief = _proxy_relief(outer, moe)
    options = ShardOptions(method="shard",
                           memory_budget=budget + relief if relief else memory_budget)
    start = time.perf_counter()
    try:
        stages = build_stages(graph, cluster, config, specs, tied, options, pinned=pinned,
                              solve_cache=solve_cache)
    except ValueError as err:  # name the configuration asked for, not its (dp·cp, tp) plan
        if type(err) is not ValueError or config is outer:
            raise
        raise ValueError(str(err).replace(config.name, outer.name)) from err
    stages = add_context_experts(stages, graph, cluster, outer, attention, moe, budget)
    return stages, time.perf_counter() - start


def _megatron_result(graph: OpGraph, cluster, config: MegatronConfig, stages,
                     timings: dict) -> Plan:
    """The `Plan` of `config`'s `stages`: a pipeline's inputs as their first readers hold
    them, a one-mesh plan's as its stage does."""
    first = stages[0].sharding
    pipelined = _layer_wise(graph, config)
    priced = (f"{config.name}: context parallelism is priced, not run: the plan holds one "
              "CP rank's shapes (batch x cp, sequence / cp)",) if config.cp > 1 else ()
    if config.zero2:
        priced += (f"{config.name}: ZeRO-2 is priced, not run: the pipeline runtime keeps "
                   "whole gradient sums (ZeRO-1) and reduces them once per step",)
    return Plan(
        method=config.name,
        cluster=cluster.to_json(),
        stages=stages,
        inputs=_pipeline_inputs(graph, stages) if pipelined else input_infos(graph, first),
        graph_fingerprint=fingerprint_of(graph) if pipelined else first.graph_fingerprint,
        num_microbatches=config.num_microbatches,
        schedule=config.schedule,
        warnings=tuple(dict.fromkeys(w for s in stages for w in s.sharding.warnings))
        + priced,
        timings=timings,
        runtime="pipeline" if pipelined else "spmd",
        arg_names=graph.arg_names,
    )


def _pipeline_inputs(graph: OpGraph, stages) -> tuple:
    """Each input as the first stage that reads it holds it."""
    from autopar.plan import InputInfo

    infos = []
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is Role.CONST:
            continue
        holder = next(
            (i for i, st in enumerate(stages) if st.sharding.var_specs[v] is not None), 0
        )
        spec = stages[holder].sharding.var_specs[v] or ((),) * len(var.shape)
        infos.append(InputInfo(var.path or f"input{v}", var.shape, var.dtype, var.role.value,
                               spec, holder))
    return tuple(infos)


def check_devices(cluster, config: MegatronConfig) -> None:
    """Raise ValueError unless dp·cp·tp·pp is the cluster's number of devices."""
    if config.num_devices != cluster.num_devices:
        degrees = "dp*tp*pp" if config.cp == 1 else "dp*cp*tp*pp"
        values = (f"{config.dp}*{config.tp}*{config.pp}" if config.cp == 1 else
                  f"{config.dp}*{config.cp}*{config.tp}*{config.pp}")
        raise ValueError(
            f"{degrees} = {values} = {config.num_devices} devices, "
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


def build_stages(
    graph, cluster, config, specs, tied, options, *, pinned: Mapping[int, Spec] | None = None,
    solve_cache: dict | None = None,
) -> tuple[Stage, ...]:
    """The plan's stages.

    A pipelined Megatron plan is the layers split evenly into pp stages, stage s on
    `stage_mesh(cluster, config, s)` with the same `specs` for the inputs it uses, run
    with `config.num_microbatches` and `config.schedule` (`_pipeline_stages`); otherwise
    one SPMD stage on the (dp, tp) mesh.

    **Arguments:** the traced `graph`, the `cluster`, the `config`, the input `specs`
    (`megatron_specs`), the `tied` state pairs, the ILP `options`, and the `pinned`
    activation specs (`residual_specs`).

    **Returns:** the `Stage`s, in pipeline order.
    """
    pinned = dict(pinned or {})
    if _layer_wise(graph, config):
        return _pipeline_stages(graph, cluster, config, specs, tied, options, pinned,
                                solve_cache)
    if config.zero2:
        raise ValueError(
            "zero2=True is priced per pipeline stage, but this step has no "
            "autopar.layer_boundary marks (or no autopar.value_and_grad) and runs as one "
            "SPMD stage, whose one gradient reduction per step ZeRO-1 already shards; mark "
            "the layer edges or use zero2=False"
        )
    if config.recompute != "none":
        raise ValueError(
            f"recompute={config.recompute!r} runs on the pipeline runtime, which plans per "
            "layer, but this step has no autopar.layer_boundary marks (or no "
            "autopar.value_and_grad); mark the layer edges (for the GPT example: "
            "GPTConfig(layer_markers=True)) or use recompute='none'"
        )
    sharding = plan_keeping_state(
        graph, cluster, stage_mesh(cluster, config, 0), options, tied, fixed=specs,
        pinned=pinned,
    )
    return (Stage((0, 1), sharding),)


def _layer_wise(graph: OpGraph, config: MegatronConfig) -> bool:
    """Plan per layer and run on the pipeline runtime: with pipeline stages, with
    microbatches, or whenever the model marks its layers (planning then scales to billions
    of parameters: each distinct layer is solved once)."""
    marked = any(n.primitive == "layer_boundary" for n in graph.nodes)
    boundary = any(n.primitive == "grad_boundary" for n in graph.nodes)
    return config.pp > 1 or config.num_microbatches > 1 or (marked and boundary)


def _pipeline_stages(graph, cluster, config, specs, tied, options, pinned,
                     solve_cache=None) -> tuple[Stage, ...]:
    """pp stages of consecutive layers (split as evenly as the layer marks allow), each on
    its dp x tp submesh with the same Megatron layout, run by the pipeline runtime.

    Each distinct layer is solved once on the (dp, tp) mesh with its inputs pinned to the
    Megatron layout (and its residual stream to `pinned`), and a stage's plan is stitched
    from its layers' plans (the same layer-wise planning as `method="auto"`), so large
    models plan in seconds.
    """
    # Looked up when called (tests record the tables it makes).
    from autopar.inter import LayerCostTable

    layers = assign_layers(graph)
    bounds = _chunk_bounds(layers.num_layers, config)
    solve = _pinned_solver(graph, cluster, specs, options, pinned, solve_cache)
    table = LayerCostTable(
        graph, layers, cluster, options, tied, num_microbatches=config.num_microbatches,
        solve=solve, axis_names=AXIS_NAMES,
    )
    part = partition(graph, layers, bounds)
    # Activations entering a stage from the one before (and their gradients back), as the
    # stage DP of method="auto" charges them (`boundary_transfer_time`).
    crossing = boundary_bytes(graph, layers)
    stages = [
        _pipeline_stage(table, graph, part, s, layer_range, cluster, config, options, tied,
                        crossing)
        for s, layer_range in enumerate(bounds)
    ]
    return tuple(_device_groups_fit(stages, cluster, config, options))


def _device_groups_fit(stages, cluster, config, options) -> list:
    """`stages` (one per chunk) with each chunk's memory the device group's that holds it
    (`device_group_memory` of the group's v chunks), checked against the budget: a
    ValueError naming the fix when a group does not fit."""
    budget = device_budget(cluster, options.memory_budget)
    result = list(stages)
    for group in range(config.pp):
        members = range(group, len(stages), config.pp)
        parts = device_group_memory([stages[s].memory_parts for s in members])
        if parts.total > budget:
            raise ValueError(
                f"the Megatron layout {config.name} does not fit device group {group} "
                f"({len(members)} chunk(s)) in {budget / 2**30:.2f} GiB per device: it "
                f"needs {parts.total / 2**30:.2f} GiB (state {parts.state / 2**30:.2f}, "
                f"gradients {parts.gradients / 2**30:.2f}, activations "
                f"{parts.activations / 2**30:.2f} for {parts.in_flight:g} chunk-"
                f"microbatch(es) in flight ({config.schedule}), working "
                f"{parts.working / 2**30:.2f}); use a larger tp or pp, more microbatches, "
                "sequence parallelism, recompute, or a larger memory budget"
            )
        for s in members:
            result[s] = replace(result[s], predicted_memory=parts.total, memory_parts=parts)
    return result


def _chunk_bounds(num_layers: int, config: MegatronConfig) -> list[tuple[int, int]]:
    """The layer range of each of the pp·v chunks (interleaved: chunk s on the devices of
    stage s mod pp), split as evenly as the layer marks allow; a ValueError naming the fix
    when the layers cannot make them."""
    chunks = config.pp * config.virtual_stages
    if chunks > num_layers:
        raise ValueError(
            f"pp={config.pp} stages of {config.virtual_stages} chunk(s) need at least "
            f"{chunks} layers but the step has "
            f"{num_layers}; mark the layer edges with autopar.layer_boundary (for the "
            "GPT example: GPTConfig(layer_markers=True)) or use a smaller pp"
        )
    # Megatron counts the marked (transformer) layers: n marks cut the step into n + 1
    # pieces, the embedding and the head riding with the first and last layer.
    num_marked = max(num_layers - 1, 1)
    if config.virtual_stages > 1 and num_marked % chunks and config.even_chunks:
        raise ValueError(
            f"pp={config.pp} x virtual_stages={config.virtual_stages} = {chunks} model chunks "
            f"must divide the {num_marked} marked layers (Megatron's interleaved schedule); "
            "choose pp and virtual_stages whose product divides the number of layers, or "
            "pass even_chunks=False to split them as evenly as the marks allow"
        )
    if config.even_chunks and num_layers > num_marked:
        # Megatron-LM gives every stage num_layers / pp transformer layers, the embedding
        # riding with the first and the output head (the piece after the last mark) with
        # the last (Narayanan et al. 2021, sec. 2; Shoeybi et al. 2019): the head is no
        # transformer layer of its own in the split. Counting it as one (n + 1 pieces
        # over the chunks) gave some middle stage an extra layer: 129 pieces of the 1T
        # model over 64 stages made one stage 3 layers for Megatron's 2, and the
        # pipeline runs at its slowest stage.
        edges = [round(i * num_marked / chunks) for i in range(chunks)] + [num_layers]
    else:
        edges = [round(i * num_layers / chunks) for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:])]


def _pinned_solver(graph, cluster, specs, options, pinned, solve_cache):
    """`solve(sub_graph, mesh, ties, weights)` for a `LayerCostTable`: the layer planned
    with its inputs pinned to the Megatron layout `specs` and its residual stream to
    `pinned` (`plan_keeping_state`), each distinct problem once per `solve_cache`."""

    def solve(sub, mesh, ties, weights):
        invars = set(sub.invars)
        fixed = {v: spec for v, spec in specs.items() if v in invars}
        key = None
        if solve_cache is not None:
            own = {v for n in sub.nodes for v in n.outputs} | invars
            key = (
                id(graph), tuple(sub.invars), tuple(sub.outvars), len(sub.nodes),
                mesh.shape, mesh.axis_names, tuple(sorted(fixed.items())),
                tuple(sorted((v, s) for v, s in pinned.items() if v in own)),
                tuple(ties), repr(sorted((weights or {}).items())), options,
            )
            if key in solve_cache:
                return solve_cache[key]
        try:
            plan = plan_keeping_state(
                sub, cluster, mesh, options, ties, fixed, weights, pinned=pinned
            )
        except MemoryBudgetError as err:
            if isinstance(err, ContextParallelError):
                raise
            # Over the budget by the ILP's linear bound (every value of the layer held at
            # once: at 131,072 tokens the 70B's first layer), which is no verdict: the
            # stage is checked against the budget by the liveness of its layout with the
            # activations in flight (`_pipeline_stage`, `_device_groups_fit`), as
            # method="auto"'s stages are.
            plan = plan_keeping_state(
                sub, cluster, mesh, replace(options, memory_budget=_LIFTED_BUDGET), ties,
                fixed, weights, pinned=pinned,
            )
        if key is not None:
            solve_cache[key] = plan
        return plan

    return solve


# Bytes per device: a layer ILP's memory limit lifted (`_pinned_solver`).
_LIFTED_BUDGET = 1e18


def _pipeline_stage(table, graph, part, s: int, layer_range, cluster, config, options, tied,
                    crossing) -> Stage:
    """Chunk `s` of the pipeline: its layers' plans stitched on its stage's mesh, with the
    configured recompute, checked against the memory budget with the activations its
    schedule keeps in flight (the memory model of method="auto"'s stage DP)."""
    shape = (config.dp, config.tp)
    budget = device_budget(cluster, options.memory_budget)
    for k in range(*layer_range):
        if table.cost(k, shape) is None:
            raise ValueError(
                f"the Megatron layout {config.name} does not fit layer {k} in "
                f"{budget / 2**30:.2f} GiB per device; use a larger tp or pp, more "
                "microbatches, more devices, or a larger memory budget"
            )
    # State, accumulated gradients, and the activations of every microbatch the schedule
    # keeps in flight, with the configured recompute of every layer.
    group = s % config.pp
    in_flight = in_flight_microbatches(
        config.schedule, config.num_microbatches, config.pp - group,
        config.virtual_stages, config.pp,
    )
    fit = choose_remat(
        table, range(*layer_range), shape, 0, in_flight, budget / config.virtual_stages,
        config.recompute,
    )
    sharding = table.stage_plan(
        graph, part, s, layer_range, shape, stage_mesh(cluster, config, group), tied
    )
    # Megatron's distributed optimizer keeps the master weights split over data-parallel
    # ranks and a compute-dtype copy whole (`distributed_optimizer_param_bytes`), where
    # the traced step keeps its master weights whole and casts them for each use.
    parts = replace(fit.parts, state=fit.parts.state - _master_weight_relief(
        part.stage_graphs[s], sharding, config))
    seconds = recompute_time(table, range(*layer_range), (shape, 0, fit.remat))
    if config.zero2:  # gradients sharded over data, reduce-scattered per microbatch
        sharding, parts = zero2_stage(part, s, sharding, parts, cluster, config, seconds)
    # The device group holds all its chunks: `_device_groups_fit` sums them.
    memory = parts.total
    if memory > budget:
        raise ValueError(
            f"the Megatron layout {config.name} does not fit stage {s} (layers "
            f"{layer_range[0]}..{layer_range[1] - 1}) in {budget / 2**30:.2f} GiB per "
            f"device: it needs {memory / 2**30:.2f} GiB with the activations of "
            f"{in_flight} microbatch(es) in flight ({config.schedule}); use a larger tp "
            "or pp, more microbatches, sequence parallelism, recompute, or a larger "
            "memory budget"
        )
    remat = fit.remat if any(r != "none" for r in fit.remat) else ()
    transfer = boundary_transfer_time(
        crossing[layer_range[0]], cluster, config.dp * config.tp
    ) if s > 0 else 0.0
    return Stage(layer_range, sharding, remat, seconds, memory, transfer,
                 memory_parts=parts)


def _master_weight_relief(sub: OpGraph, sharding: ShardingPlan,
                          config: MegatronConfig) -> float:
    """Bytes per device the distributed optimizer saves on a chunk's parameters against
    the traced step's whole master weights: for each parameter the step casts to a
    narrower float before use (bf16 compute, fp32 master), its whole master bytes less
    `distributed_optimizer_param_bytes` over the dp x cp ranks Megatron-Core splits the
    optimizer over. 0 without the distributed optimizer or for parameters used at their
    own precision (Megatron's 8 + 8/d bytes per fp32 parameter: as traced)."""
    shards = config.dp * config.cp
    if not config.distributed_optimizer or shards == 1:
        return 0.0
    consumers = sub.consumers()
    relief = 0.0
    for v in dict.fromkeys(sub.invars):
        var, spec = sub.vars[v], sharding.var_specs[v]
        if var.role is not Role.PARAM or spec is None or not var.shape:
            continue
        own = dtype_itemsize(var.dtype)
        casts = [sub.vars[sub.nodes[n].outputs[0]].dtype for n in consumers[v]
                 if sub.nodes[n].primitive == "convert_element_type"]
        narrower = [dtype_itemsize(d) for d in casts
                    if "float" in str(d) and dtype_itemsize(d) < own]
        if not narrower:
            continue
        master = bytes_per_device(var.shape, var.dtype, spec, sharding.mesh)
        relief += master - distributed_optimizer_param_bytes(
            master, min(narrower), own, shards)
    return relief


def plan_keeping_state(
    graph, cluster, mesh, options, tied, fixed, weights=None, *,
    pinned: Mapping[int, Spec] | None = None,
) -> ShardingPlan:
    """`plan_on_mesh` where parameters, optimizer state and the batch never move.

    Megatron communicates activations and gradients only: a column-parallel weight is
    multiplied where it lies, never all-gathered, and each data-parallel rank reads only
    its own part of the batch. Left free, the ILP may find it cheaper to gather small
    weights (ZeRO-3 style) or the whole batch (no data parallelism), which are other
    plans; or slice replicated optimizer state for free and update it sharded, then gather
    it back (ZeRO style, what `distributed_optimizer` asks for explicitly). So every
    consumer strategy that takes such an input in another spec than its own gets a
    penalty larger than any plan's whole cost; the ILP then places the remaining operators
    at least cost around the pinned inputs. The predicted costs are those of the
    unpenalised problem.

    Variables in `pinned` take their spec strictly: strategies giving them another are
    removed before the solve (`pin_activations`; this is how Megatron's residual-stream
    layout, with or without sequence parallelism, is expressed). A value whose node
    cannot produce its spec at all is left free and named in the plan's warnings.

    **Arguments:** as `autopar.intra.plan_on_mesh` (`weights` as `build_problem`'s);
    `fixed` must pin every input of a `PINNED_ROLES` role (here: `megatron_specs`);
    `pinned` maps variable ids, results or inputs (those not in `graph`'s problem are
    skipped), to the only spec each may take.

    **Returns:** the `ShardingPlan`; its warnings name any pinned input that had to be
    resharded because a consumer has no strategy taking it as it is.
    """
    built = build_problem(graph, mesh, cluster, options, tied, fixed, weights)
    if pinned:
        built = pin_activations(built, graph, pinned, where_possible=True)
    penalised, forbidden = _penalise_moving_state(built, graph)
    penalised = _penalise_model_stacks(penalised, built, graph, weights or {})
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
    """The problem with every change of spec of a `PINNED_ROLES` input penalised, and the
    forbidden (edge, mask) pairs."""
    problem = built.problem
    nodes = built.ilp_nodes
    pinned = {
        i for i, n in enumerate(nodes)
        if n.var is not None and graph.vars[n.var].role in PINNED_ROLES
    }
    bound = _cost_bound(problem)
    costs = list(problem.edge_costs)
    forbidden = []
    for e, (u, v, operand) in enumerate(_operand_edges(built, graph)):
        if u not in pinned:
            continue
        ndim = len(graph.vars[nodes[u].var].shape)
        src = [s.out_specs[0] for s in nodes[u].strategies]
        dst = [s.in_specs[operand] or replicated(ndim) for s in nodes[v].strategies]
        mask = np.array([[a != b for b in dst] for a in src])
        if mask.any():
            costs[e] = problem.edge_costs[e] + mask * bound
            forbidden.append(((u, v), mask))
    return replace(problem, edge_costs=tuple(costs)), forbidden


def _cost_bound(problem) -> float:
    """An upper bound on any plan's cost: each node and edge at its dearest."""
    return sum(float(c.max()) for c in problem.node_costs if len(c)) + sum(
        float(m.max()) for m in problem.edge_costs if m.size
    )


def _penalise_model_stacks(problem, built, graph: OpGraph, weights):
    """`problem` with every strategy that keeps a matrix's gradient as partial sums over
    the "model" axis until the update penalised.

    With microbatches, a weight gradient's reduction is deferred to the end of the step
    (`autopar.inter.passes._deferred`): the stage accumulates partial sums and reduces
    them once. Its cost then weighs 1/microbatches (`step_weights`), so around pinned
    layouts the ILP likes a strategy that contracts over the model-split sequence and
    defers the reduce-scatter -- and keeps, per device, a stack the size of the whole
    gradient shard before the model split (GPT-3 175B, tp 8: the tied embedding's grows
    from 150 MiB to 1,200 MiB per device). Megatron-LM never makes those partial sums:
    its column- and row-parallel weight gradients are complete per model rank (the
    sequence-parallel input is all-gathered for the backward, Korthikanti et al. 2022
    section 4.2.2); only the small vectors replicated over "model" (layer-norm weights,
    row-parallel biases) are summed over it, once per step. Data-parallel partial sums
    stay deferred, as Megatron's gradient buffers (and its distributed optimizer's
    reduce-scatter) keep them.

    The deferred roots are the nodes `step_weights` gives a reduction weight below one
    at full node weight."""
    model = MeshAxis.MODEL.value
    roots = {n for n, w in weights.items() if w[0] == 1.0 and w[1] < 1.0}
    if not roots:
        return problem
    bound = _cost_bound(problem)
    costs = list(problem.node_costs)
    for i, ilp_node in enumerate(built.ilp_nodes):
        if ilp_node.node not in roots:
            continue
        node = graph.nodes[ilp_node.node]
        if sum(d > 1 for d in graph.vars[node.outputs[0]].shape) < 2:
            continue  # a vector: Megatron sums these over "model" once per step too
        mask = np.array([
            any(model in c.axes for c in s.collectives) for s in ilp_node.strategies
        ])
        if mask.any() and not mask.all():
            costs[i] = problem.node_costs[i] + mask * bound
    return replace(problem, node_costs=tuple(costs))


def _operand_edges(built, graph: OpGraph) -> list[tuple[int, int, int]]:
    """(producer, consumer, operand index) of each operand edge of the built problem, in
    the order `build_problem` made them (tie edges follow and are left out)."""
    edges = []
    for index, ilp_node in enumerate(built.ilp_nodes):
        if ilp_node.node is None:
            continue
        for operand, v in enumerate(graph.nodes[ilp_node.node].inputs):
            if graph.vars[v].role is not Role.CONST:
                edges.append((built.source_of[v][0], index, operand))
    made = list(built.problem.edges[: len(edges)])
    assert made == [(u, v) for u, v, _ in edges], (
        "build_problem changed how it orders edges; update _operand_edges to match"
    )
    return edges


def check_context_experts(graph: OpGraph, config: MegatronConfig,
                          attention: AttentionShape | None, moe: MoEShape | None) -> None:
    """Raise ValueError, before anything is planned, when CP or EP cannot be priced on
    this step: cp > 1 without `attention`; a traced MoE (parameters with an expert
    dimension) with an ep other than its data axis or an etp other than tp; `moe` whose
    experts ep does not divide."""
    if config.cp > 1 and attention is None:
        raise ValueError(
            f"cp={config.cp} prices attention over the whole sequence, which needs the "
            "model's attention shape: pass attention=AttentionShape(num_heads, "
            "num_kv_heads, head_dim, num_layers) and trace the step with context_args"
        )
    if config.cp > 1 and config.cp_algorithm == "ulysses":
        check_ulysses_heads(attention.num_heads // config.tp,
                            max(1, attention.num_kv_heads // config.tp), config.cp)
    if moe is not None:
        if moe.num_experts % config.expert_parallel:
            raise ValueError(
                f"ep={config.expert_parallel} must divide the {moe.num_experts} routed "
                "experts (num_experts % ep == 0, each EP rank holding the same number); "
                "choose an ep dividing the number of experts"
            )
        return
    traced_experts = any(p.expert_dim is not None
                         for p in classify_parameters(graph).values())
    data = config.dp * config.cp
    laid_out = config.ep in (None, data) and config.etp in (None, config.tp)
    if traced_experts and not laid_out:
        raise ValueError(
            f"this step's experts are traced, and its Megatron stage mesh splits them over "
            f"its one data axis of dp*cp = {data} devices and their FFN over tp; ep="
            f"{config.ep}, etp={config.etp} cannot be laid out. Use ep=None or ep={data} "
            "and etp=None, or price the model as a dense proxy with moe=MoEShape(...)"
        )


def add_context_experts(stages, graph: OpGraph, cluster, config: MegatronConfig,
                        attention: AttentionShape | None, moe: MoEShape | None,
                        budget: float) -> tuple[Stage, ...]:
    """`stages` with what CP (`context_terms`) and EP on a dense proxy (`expert_terms`)
    add per microbatch, each stage's share by the attention layers it holds; raises
    `MemoryBudgetError`-like ValueError when the added memory no longer fits."""
    if config.cp == 1 and moe is None:
        return stages
    micro_batch, seq_len = _sequences(graph, config)
    counts = _attention_layers(graph, stages, seq_len // config.cp,
                               attention.num_heads if attention is not None else None)
    core = (local_attention_core(graph, cluster, stages[0].mesh, seq_len // config.cp,
                                 _layer_wise(graph, config)) if config.cp > 1 else None)
    # Where no attention's roles can be named, the core is its dots by formula: say so.
    by_formula = (f"{config.name}: context parallelism's attention core is priced by formula "
                  "(its dots only, no score-sized element-wise work): no attention's query, "
                  "key and score could be named in the traced step",)
    out, before = [], 0
    for s, (stage, layers) in enumerate(zip(stages, counts)):
        terms = []
        if config.cp > 1:
            terms.append(context_terms(config, cluster, attention, micro_batch, seq_len,
                                       layers, s, core))
            if core is None and layers:
                stage = replace(stage, sharding=replace(
                    stage.sharding, warnings=tuple(stage.sharding.warnings) + by_formula))
        if moe is not None:
            dense = moe.num_layers - moe.num_moe_layers
            moe_layers = max(0, min(before + layers, moe.num_layers) - max(before, dense))
            zero1 = (config.dp * config.cp * config.tp
                     // (config.expert_parallel * config.expert_tensor_parallel)
                     if config.distributed_optimizer else 1)
            terms.append(expert_terms(config, cluster, moe, micro_batch, seq_len, moe_layers,
                                      s, stage.sharding.cost.compute, zero1))
        before += layers
        for term in terms:
            stage = with_terms(stage, term)
        if stage.memory_per_device > budget:
            raise ValueError(
                f"the Megatron layout {config.name} does not fit stage {s} in "
                f"{budget / 2**30:.2f} GiB per device: it needs "
                f"{stage.memory_per_device / 2**30:.2f} GiB with context-parallel K/V "
                "buffers and expert weights; use a larger tp, cp, ep or pp, or recompute"
            )
        out.append(stage)
    return tuple(out)


def _proxy_relief(config: MegatronConfig, moe: MoEShape | None) -> float:
    """Bytes per device a stage's MoE layers hold fewer than their dense proxy (0 when EP
    leaves as many experts or more): the proxy's k experts split tp ways against E/ep
    split etp ways, with their training state, over the most MoE layers a stage holds."""
    if moe is None:
        return 0.0
    from autopar.cost import expert_weight_bytes, weight_and_gradient_bytes

    proxy = expert_weight_bytes(moe.top_k, moe.hidden, moe.expert_ffn, 1, 1, config.tp,
                                moe.gated)
    real = expert_weight_bytes(moe.num_experts, moe.hidden, moe.expert_ffn, 1,
                               config.expert_parallel, config.expert_tensor_parallel,
                               moe.gated)
    layers = -(-moe.num_moe_layers // (config.pp * config.virtual_stages))
    return (max(0.0, proxy - real) * layers * weight_and_gradient_bytes(moe.itemsize)
            * config.virtual_stages)


def _sequences(graph: OpGraph, config: MegatronConfig) -> tuple[int, int]:
    """(sequences per data-parallel rank per microbatch, full sequence length) from the
    step's (batch, sequence) inputs, traced at one CP rank's shapes."""
    shapes = [graph.vars[v].shape for v in graph.invars
              if graph.vars[v].role is Role.BATCH and len(graph.vars[v].shape) >= 2]
    if not shapes:
        raise ValueError(
            "context and expert parallelism price (batch, sequence) inputs, and this step "
            "has none; pass the tokens as a batch input of shape (batch, sequence)"
        )
    batch, local = max(shapes)[:2]
    return max(1, batch // (config.dp * config.cp)), local * config.cp


def _attention_layers(graph: OpGraph, stages, local_seq: int,
                      num_heads: int | None = None) -> list[int]:
    """Attention layers per stage: forward dot products whose result has two dimensions
    of the (local) sequence length s and whose operands one each (``q·kᵀ``, the scores),
    one per attention layer (with `num_heads`, only results of batch · heads · s² elements,
    so that a hidden size equal to s is not taken for one), counted in the stage's layers
    (all of them in a one-stage plan; without layer marks, half of them: the backward's
    ``dO·vᵀ`` has that form too)."""
    batch = max((graph.vars[v].shape[0] for v in graph.invars
                 if graph.vars[v].role is Role.BATCH and graph.vars[v].shape), default=1)
    scores = [n for n in graph.nodes if n.primitive == "dot_general"
              and _square(graph.vars[n.outputs[0]].shape, local_seq)
              and all(graph.vars[v].shape.count(local_seq) == 1 for v in n.inputs)
              and (num_heads is None or math.prod(graph.vars[n.outputs[0]].shape)
                   == batch * num_heads * local_seq ** 2)]
    try:
        layers = assign_layers(graph)
    except ValueError:
        layers = None
    if layers is None or layers.num_layers == 1:  # no marks: forward and backward as one
        return [len(scores) // 2] + [0] * (len(stages) - 1)
    per_layer: dict[int, int] = {}
    for n in scores:
        if layers.phase[n.id] == "forward":
            per_layer[layers.layer[n.id]] = per_layer.get(layers.layer[n.id], 0) + 1
    if len(stages) == 1 and stages[0].layers == (0, 1):
        return [sum(per_layer.values())]
    return [sum(per_layer.get(k, 0) for k in range(*st.layers)) for st in stages]


def _square(shape, size: int) -> bool:
    return len(shape) >= 3 and tuple(shape).count(size) >= 2
