"""Lowering: a plan and devices in, compiled SPMD executables out."""

from autopar.lower._hlo import count_collectives
from autopar.lower._spmd import jax_mesh, local_devices, lower_sharding_plan

__all__ = ["count_collectives", "jax_mesh", "local_devices", "lower_sharding_plan"]
