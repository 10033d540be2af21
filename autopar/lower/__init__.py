"""Lowering: a plan and devices in, compiled SPMD executables out.

In: a `ShardingPlan` (or a stage segment of one) and its graph, and JAX devices. Out:
`jax.jit` functions with in/out shardings and `with_sharding_constraint` per the plan, the
`NamedSharding`s of a plan's inputs (`plan_shardings`), and collective counts of compiled
HLO (`count_collectives`); ring attention under `shard_map` (`ring_attention`).
"""

from autopar.lower._hlo import count_collectives
from autopar.lower._ring_attention import ring_attention, zigzag_order
from autopar.lower._shardings import plan_shardings, shardings_by_path
from autopar.lower._spmd import (
    constraint_hooks,
    jax_mesh,
    local_devices,
    lower_segment,
    lower_sharding_plan,
    segment_body,
    stack_spec,
)
from autopar.lower._stacked import join_pieces, pieces_of, stacked_sharding

__all__ = [
    "constraint_hooks",
    "count_collectives",
    "jax_mesh",
    "join_pieces",
    "local_devices",
    "lower_segment",
    "lower_sharding_plan",
    "pieces_of",
    "plan_shardings",
    "ring_attention",
    "segment_body",
    "shardings_by_path",
    "stack_spec",
    "stacked_sharding",
    "zigzag_order",
]
