"""Lowering: a plan and devices in, compiled SPMD executables out."""

from autopar.lower._hlo import count_collectives
from autopar.lower._spmd import (
    constraint_hooks,
    jax_mesh,
    local_devices,
    lower_segment,
    lower_sharding_plan,
    stack_spec,
)

__all__ = [
    "constraint_hooks",
    "count_collectives",
    "jax_mesh",
    "local_devices",
    "lower_segment",
    "stack_spec",
    "lower_sharding_plan",
]
