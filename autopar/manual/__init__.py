"""Hand-written (manual) plans: Megatron-LM style layouts and their grid search.

In: a train step, abstract arguments and a cluster. Out: `Plan`s scored by the same cost
model as the automatic planner, to compare against it (`autopar.report.compare`).

- `_dataflow.py`: each parameter's Megatron role from how the step uses it;
- `_layout.py`: `MegatronConfig` and the specs of all inputs on a (dp, tp) mesh;
- `_sequence.py`: the residual stream's layout (with or without sequence parallelism)
  and the ILP restricted to it;
- `_megatron.py`: `megatron_plan`, the ILP around the pinned inputs, the stages;
- `_context_experts.py`: context parallelism (cp) and expert parallelism (ep, etp) priced
  on the plan of one CP rank's shapes / an MoE's dense proxy;
- `_grid.py`: `megatron_grid_search` over dp × tp × pp × sequence parallelism × ZeRO-1 ×
  recompute × interleaving × microbatches, pruned by Megatron's rules.
"""

from autopar.manual._context_experts import (
    AttentionShape,
    MoEShape,
    context_args,
)
from autopar.manual._dataflow import Kind, Placement, classify_parameters
from autopar.manual._grid import (
    GridResult,
    megatron_candidates,
    megatron_configs,
    megatron_grid_search,
)
from autopar.manual._layout import (
    MegatronConfig,
    MeshAxis,
    describe_layout,
    megatron_specs,
    normalize_spec,
)
from autopar.manual._megatron import (
    build_stages,
    megatron_plan,
    megatron_plan_for_graph,
    plan_keeping_state,
    stage_mesh,
)
from autopar.manual._sequence import (
    ResidualStream,
    kept_activation_bytes,
    pin_activations,
    residual_specs,
    residual_stream,
)

__all__ = [
    "AttentionShape",
    "MoEShape",
    "context_args",
    "GridResult",
    "Kind",
    "MegatronConfig",
    "MeshAxis",
    "Placement",
    "ResidualStream",
    "build_stages",
    "classify_parameters",
    "describe_layout",
    "kept_activation_bytes",
    "megatron_candidates",
    "megatron_configs",
    "megatron_grid_search",
    "megatron_plan",
    "megatron_plan_for_graph",
    "megatron_specs",
    "normalize_spec",
    "pin_activations",
    "plan_keeping_state",
    "residual_specs",
    "residual_stream",
    "stage_mesh",
]
