"""ZeRO-2 in the Megatron scorer: a pipeline chunk's gradients sharded over "data".

`MegatronConfig(zero2=True)` (with the distributed optimizer's ZeRO-1 sharding of the
optimizer state) keeps each data-parallel rank's 1/(dp·cp) of the gradient sums and
reduce-scatters every microbatch's fresh gradients while it computes, as Llama 3's FSDP
did (Dubey et al. 2024, sec. 3.3.2: "shards the optimizer states and gradients").
`zero2_stage` turns a chunk priced as ZeRO-1 into ZeRO-2, by the formulas of
`autopar.cost._zero2`:

- memory: the gradient sums become `zero2_gradient_bytes`' kept share, and the bucket in
  flight (the chunk's largest gradient, whole) joins the working memory of the chunk that
  runs (one at a time: `device_group_memory` takes the largest);
- time: each microbatch adds `zero2_exposed_reduction` of one reduce-scatter of the
  chunk's gradients over "data" (`collective_time`), under the chunk's compute per
  microbatch (forward, backward and recompute: what the device group runs between two
  of the chunk's reduce-scatters in the steady state). The plan's
  once-per-step deferred reduction is kept: it stands for the last microbatch's
  reduce-scatter, which has no backward left to run under.

Priced, not run: the pipeline runtime keeps whole gradient sums (ZeRO-1); the plan says
so in its warnings.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost import (
    bytes_per_device,
    collective_time,
    zero2_exposed_reduction,
    zero2_gradient_bytes,
)
from autopar.inter.passes._deferred import stacked_layout
from autopar.intra._problem import unstacked_spec
from autopar.manual._layout import MeshAxis


def largest_gradient_bytes(part, s: int, sharding) -> float:
    """Bytes per device of the largest gradient chunk `s` accumulates (as
    `autopar.inter._layer_pricing._gradient_bytes` holds each: a deferred reduction's
    partial sum whole on its summed axes)."""
    sub = part.stage_graphs[s]
    stacked = stacked_layout(sub, sharding, part.deferrable)
    produced = {v for n in sub.nodes for v in n.outputs}
    largest = 0.0
    for v in set(part.grad_vars) & produced:
        var, spec = sub.vars[v], sharding.var_specs[v]
        if spec is None or not var.shape:
            continue
        if v in stacked:
            spec = unstacked_spec(spec, stacked[v])
        largest = max(largest, bytes_per_device(var.shape, var.dtype, spec, sharding.mesh))
    return largest


def zero2_stage(part, s: int, sharding, parts, cluster, config, table_recompute: float):
    """(sharding plan, `StageMemory`) of chunk `s` under ZeRO-2, from its ZeRO-1 ones.

    **Arguments:** the `Partition` `part` and chunk index `s`, the chunk's stitched
    `sharding` plan and memory `parts` (ZeRO-1: whole gradient sums), the `cluster`, the
    (dp·cp, tp) `config` it is planned with, and `table_recompute`, the chunk's recompute
    seconds per microbatch.
    """
    shards = config.dp * config.cp
    kept, in_flight = zero2_gradient_bytes(parts.gradients,
                                           largest_gradient_bytes(part, s, sharding), shards)
    whole = parts.gradients  # what each microbatch's backward makes and reduce-scatters
    parts = replace(parts, gradients=kept, working=parts.working + in_flight)
    cost = sharding.cost
    seconds = collective_time("reduce_scatter", whole, cluster, sharding.mesh,
                              MeshAxis.DATA.value) if shards > 1 else 0.0
    exposed = zero2_exposed_reduction(seconds, cost.compute + table_recompute,
                                      cluster.overlap)
    collectives = dict(cost.collectives)
    if seconds:
        n, nbytes = collectives.get("reduce_scatter", (0.0, 0.0))
        collectives["reduce_scatter"] = (n + 1.0, nbytes + whole)
    cost = replace(cost, communication=cost.communication + exposed,
                   collectives=collectives)
    return replace(sharding, cost=cost), parts
