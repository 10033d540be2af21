"""Pipeline parallelism: an `OpGraph` traced at microbatch size in, stages out.

In: the graph (with `layer_boundary` marks, or cut automatically), a `Cluster`, the number
of microbatches and `StageOptions` (the schedule, the single-mesh planner's options, ...).
Out: a `PipelineChoice`: layer ranges on submeshes, each stage's logical mesh shape and
its `ShardingPlan` (the `plan`/`search` parts turn it into a `Plan`).

- `passes/`: graph passes (layers, automatic layers, per-stage partition, deferred
  gradient reductions);
- `_submesh`: the submesh shapes a stage may take and how they pack onto hosts;
- `_stage_dp`: Alpa's dynamic program over layer ranges x submeshes;
- `_layer_table`: layer costs from the intra-op ILPs (`LayerCostTable`), each layer
  structure solved once per mesh (`_layer_graphs`: its fingerprint; `_ilp_driver`: the
  ILPs solved side by side; `_compact_specs`: the plans kept small; `_repricing`: costs
  found on another microbatch count's layouts);
- `_layer_pricing`: a layer's plan handed to `autopar.cost`'s formulas (bytes by part,
  recompute seconds, the bytes a stage boundary moves);
- `_levels`: memory levels, leaner layer plans for stages that do not fit;
- `_range_cache`: figures shared by layer ranges of equal content;
- `_stage_fit`: a stage's layers at the fastest level and remat choice that fit;
- `_stage_costs`: the stage DP's cost callback, pruned by a plan known to exist;
- `_options`: `StageOptions`, how the stage DP searches, handed over as one record;
- `_choose`: `choose_stages`, which runs the DP and plans each chosen stage;
- `_stitch`: one `ShardingPlan` for a stage from its layers' plans.
"""

from autopar.inter._choose import (
    PLANNING_PHASES,
    PipelineChoice,
    choose_stages,
    plan_chosen_stages,
)
from autopar.inter._layer_table import LayerCostTable, layer_cost_table
from autopar.inter._levels import LEVEL_FRACTIONS, LEVEL_PRICES
from autopar.inter._options import StageOptions
from autopar.inter._stage_brute import brute_force_stages
from autopar.inter._stage_dp import StageCost, StagePlan, plan_stages
from autopar.inter._stitch import stitch
from autopar.inter._submesh import (
    SubmeshShape,
    assign_devices,
    logical_mesh_shapes,
    submesh_shapes,
)
from autopar.inter.passes import (
    LayerAssignment,
    Partition,
    accumulated_values,
    ancestors,
    assign_layers,
    auto_layers,
    layer_scan,
    operand_spec,
    partition,
    scan_layers,
    stacked_layout,
    with_remat,
)

__all__ = [
    "LEVEL_FRACTIONS",
    "LEVEL_PRICES",
    "LayerAssignment",
    "LayerCostTable",
    "Partition",
    "PLANNING_PHASES",
    "PipelineChoice",
    "StageCost",
    "StageOptions",
    "StagePlan",
    "SubmeshShape",
    "accumulated_values",
    "ancestors",
    "assign_devices",
    "assign_layers",
    "auto_layers",
    "brute_force_stages",
    "choose_stages",
    "layer_cost_table",
    "layer_scan",
    "plan_chosen_stages",
    "scan_layers",
    "logical_mesh_shapes",
    "operand_spec",
    "partition",
    "with_remat",
    "plan_stages",
    "stacked_layout",
    "stitch",
    "submesh_shapes",
]
