"""The one-mesh plan: operator parallelism only (methods "shard", "data", "zero2", "zero3").

In: the step's graph at full batch, a cluster and `PlanOptions`. Out: a one-stage `Plan`
run as one `jax.jit` (runtime "spmd").
"""

from __future__ import annotations

import logging
import time

from autopar.graph import OpGraph, tied_state
from autopar.intra._options import ShardOptions
from autopar.intra._planner import plan_sharding
from autopar.plan import Plan, Stage, input_infos
from autopar.search._microbatch import batch_size
from autopar.search._options import PlanOptions

log = logging.getLogger("autopar")


def shard_options(options: PlanOptions, cluster, method: str = "shard") -> ShardOptions:
    """The single-mesh planner's options, with the memory budget resolved for `cluster`."""
    return ShardOptions(
        method=method, memory_budget=options.memory_budget_for(cluster),
        time_limit=options.ilp_time_limit, solver=options.solver,
    )


def plan_one_mesh(graph: OpGraph, cluster, options: PlanOptions) -> Plan:
    """Search operator parallelism for a traced graph on one mesh of the whole cluster."""
    method = "shard" if options.method == "auto" else options.method
    if method in ("data", "zero2", "zero3"):
        _check_data_parallel_batch(graph, cluster.num_devices, method)
    start = time.perf_counter()
    sharding = plan_sharding(
        graph, cluster, options=shard_options(options, cluster, method),
        tied=tied_state(graph, options.donate_argnums), mesh_shape=options.mesh_shape,
    )
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


def _check_data_parallel_batch(graph: OpGraph, num_devices: int, method: str) -> None:
    """The data-parallel methods split the batch over every device: its rows must divide."""
    rows = batch_size(graph)
    if rows is not None and rows % num_devices:
        raise ValueError(
            f"method={method!r} splits the batch over all {num_devices} devices, but the batch "
            f"has {rows} rows; use a batch size divisible by {num_devices}, or method='shard' "
            "or 'auto' (which may split other dimensions instead)"
        )
