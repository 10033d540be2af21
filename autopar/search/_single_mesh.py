"""The one-mesh plan: operator parallelism only (methods "shard", "data", "zero2", "zero3").

In: the step's graph at full batch, a cluster and `PlanOptions`. Out: a one-stage `Plan`
run as one `jax.jit` (runtime "spmd").
"""

from __future__ import annotations

import dataclasses
import logging
import time

from autopar.graph import OpGraph, tied_state
from autopar.intra import MemoryBudgetError, ShardOptions, peak_live_bytes, plan_sharding
from autopar.intra._planner import mesh_shapes
from autopar.intra._ring_strategies import ring_buffer_temporaries
from autopar.plan import Plan, Stage, input_infos
from autopar.search._microbatch import batch_size
from autopar.search._options import PlanOptions
from autopar.search._pin_memory import pin_memory_error
from autopar.search._pins import resolve_pins

log = logging.getLogger("autopar")


def shard_options(options: PlanOptions, cluster, method: str = "shard") -> ShardOptions:
    """The single-mesh planner's options, with the memory budget resolved for `cluster`."""
    return ShardOptions(
        method=method, memory_budget=options.memory_budget_for(cluster),
        time_limit=options.ilp_time_limit, solver=options.solver,
        annotations=options.annotations,
        context_parallel=options.context_parallel,
        moe_overlap=options.moe_overlap,
        moe_dispatch=options.moe_dispatch,
    )


def plan_one_mesh(graph: OpGraph, cluster, options: PlanOptions) -> Plan:
    """Search operator parallelism for a traced graph on one mesh of the whole cluster."""
    method = "shard" if options.method == "auto" else options.method
    if method in ("data", "zero2", "zero3"):
        _check_data_parallel_batch(graph, cluster.num_devices, method)
    fixed = resolve_pins(graph, options.constraints)  # checked before any planning
    start = time.perf_counter()
    tied = tied_state(graph, options.donate_argnums)
    try:
        sharding = plan_sharding(
            graph, cluster, options=shard_options(options, cluster, method),
            tied=tied, mesh_shape=options.mesh_shape, fixed=fixed,
        )
    except MemoryBudgetError as err:
        if fixed is None:
            raise
        shapes = [options.mesh_shape] if options.mesh_shape is not None else \
            mesh_shapes(cluster.num_devices)
        raise pin_memory_error(err, graph, fixed.pins, shapes) from err
    sharding = _with_live_peak(graph, sharding, tied if options.donate_argnums else (),
                               cluster)
    seconds = time.perf_counter() - start
    log.info("intra-op planning: %.2f s, mesh %s", seconds, sharding.mesh.shape)
    return Plan(
        method=options.method,
        cluster=cluster.to_json(),
        stages=(Stage((0, 1), sharding),),
        inputs=input_infos(graph, sharding),
        graph_fingerprint=sharding.graph_fingerprint,
        warnings=tuple(sharding.warnings),
        timings={"intra_op_ilp": seconds},
        arg_names=graph.arg_names,
    )


def _with_live_peak(graph: OpGraph, sharding, tied, cluster=None) -> object:
    """The plan with its predicted peak memory per device from the liveness of the chosen
    layouts (`peak_live_bytes`: donated state reused, fused values never written, resharded
    operands as temporaries) in place of the ILP's coarser bound; checked against XLA's
    `memory_analysis()` in tests/test_memory_xla.py."""
    peak = peak_live_bytes(
        graph, sharding.var_specs, sharding.mesh, donated=[u for _, u in tied],
        operand_specs=sharding.operand_specs,
        fused_attention=getattr(cluster, "fused_attention", False),
        extra=ring_buffer_temporaries(graph, sharding.var_specs, sharding.node_strategies,
                                      sharding.mesh),
    )
    return dataclasses.replace(
        sharding, cost=dataclasses.replace(sharding.cost, memory_per_device=peak)
    )


def _check_data_parallel_batch(graph: OpGraph, num_devices: int, method: str) -> None:
    """The data-parallel methods split the batch over every device: its rows must divide."""
    rows = batch_size(graph)
    if rows is not None and rows % num_devices:
        raise ValueError(
            f"method={method!r} splits the batch over all {num_devices} devices, but the batch "
            f"has {rows} rows; use a batch size divisible by {num_devices}, or method='shard' "
            "or 'auto' (which may split other dimensions instead)"
        )
