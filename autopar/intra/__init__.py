"""Intra-operator planning: per-primitive sharding rules, the ILP, the `ShardingPlan`.

In: an `OpGraph`, a `Cluster` and a device set. Out: a `ShardingPlan` with a spec for every
variable on the cheapest logical mesh.
"""

from autopar.intra import _strategies_moe  # noqa: F401  (expert-parallel strategies)
from autopar.intra._context import ContextParallelError
from autopar.intra._ilp import MemoryBudgetError, ShardingProblem, Solution, solve
from autopar.intra._liveness import peak_live_bytes
from autopar.intra._options import ShardOptions
from autopar.intra._planner import mesh_shapes, plan_on_mesh, plan_sharding
from autopar.intra._registry import SHARDING_RULES
from autopar.intra._reshard import reshard_time
from autopar.intra._rules import register
from autopar.intra._sharding_plan import PredictedCost, ShardingPlan, graph_fingerprint

__all__ = [
    "SHARDING_RULES",
    "ContextParallelError",
    "MemoryBudgetError",
    "PredictedCost",
    "ShardOptions",
    "ShardingPlan",
    "ShardingProblem",
    "Solution",
    "graph_fingerprint",
    "mesh_shapes",
    "peak_live_bytes",
    "plan_on_mesh",
    "plan_sharding",
    "register",
    "reshard_time",
    "solve",
]
