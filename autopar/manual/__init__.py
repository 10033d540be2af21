"""Hand-written (manual) plans: Megatron-LM style layouts and their grid search.

In: a train step, abstract arguments and a cluster. Out: `Plan`s scored by the same cost
model as the automatic planner, to compare against it (`autopar.report.compare`).
"""

from autopar.manual._dataflow import Kind, Placement, classify_parameters
from autopar.manual._grid import GridResult, megatron_configs, megatron_grid_search
from autopar.manual._megatron import (
    MegatronConfig,
    MeshAxis,
    describe_layout,
    megatron_plan,
    megatron_plan_for_graph,
    megatron_specs,
)

__all__ = [
    "GridResult",
    "Kind",
    "MegatronConfig",
    "MeshAxis",
    "Placement",
    "classify_parameters",
    "describe_layout",
    "megatron_configs",
    "megatron_grid_search",
    "megatron_plan",
    "megatron_plan_for_graph",
    "megatron_specs",
]
