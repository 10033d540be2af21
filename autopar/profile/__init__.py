"""Measuring this machine into a cost profile (``autopar profile``).

In: the local JAX devices (all processes' under ``jax.distributed``). Out: a
`ProfileResult` holding a `Cluster` of measured figures (FLOP/s per dtype, memory
bandwidth, alpha-beta links fitted by `autopar.cost.fit_link`), saved as a profile JSON
that `Cluster.from_profile` loads. Sits after `cost`: it fits the cost model's formulas.
"""

from autopar.profile._measure import (
    FULL,
    QUICK,
    ProfileOptions,
    ProfileResult,
    measure_profile,
    time_collective,
)

__all__ = [
    "FULL",
    "QUICK",
    "ProfileOptions",
    "ProfileResult",
    "measure_profile",
    "time_collective",
]
