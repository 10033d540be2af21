"""Graph passes of the pipeline planner: an `OpGraph` in, its layer structure out.

- `assign_layers` (`_layers`): which layer each equation belongs to, from the
  `layer_boundary` marks (forward and matching backward);
- `cluster_layers` / `auto_layers` (`_clustering`, `_auto_layers`): Alpa's layer
  construction for models without marks;
- `scan_layers` (`_scan_layers`): layers from the iterations of a scan over stacked
  layers, the scan run as one sub-scan per range of iterations;
- `partition` (`_partition`): the step cut into per-stage forward, backward and update
  segments for given layer ranges; `split_backward` a backward segment into its
  input-gradient and weight-gradient parts (zero bubble), `phase_times` their FLOPs;
- `deferrable_gradients` and friends (`_deferred`): weight gradients kept as unreduced
  per-device partial sums over the microbatches and reduced once per step;
- `recompute` / `with_remat` (`_remat`): what a layer's remat choice drops and reruns, and
  the segments rewritten to rerun it in the backward.
"""

from autopar.inter.passes._auto_layers import auto_layers
from autopar.inter.passes._clustering import cluster_layers, cluster_layers_detailed, cut_bytes
from autopar.inter.passes._deferred import (
    NOTHING_DEFERRED,
    Deferrable,
    deferrable_gradients,
    gradient_roots,
    operand_spec,
    stacked_layout,
    step_weights,
)
from autopar.inter.passes._layers import (
    LayerAssignment,
    accumulated_values,
    ancestors,
    assign_layers,
)
from autopar.inter.passes._partition import (
    Partition,
    Segment,
    partition,
    phase_times,
    split_backward,
)
from autopar.inter.passes._remat import (
    NO_RECOMPUTE,
    Recompute,
    attention_core,
    recompute,
    with_remat,
)
from autopar.inter.passes._scan_layers import layer_scan, per_iteration, scan_layers

__all__ = [
    "NOTHING_DEFERRED",
    "NO_RECOMPUTE",
    "Recompute",
    "attention_core",
    "recompute",
    "with_remat",
    "Deferrable",
    "LayerAssignment",
    "Partition",
    "Segment",
    "accumulated_values",
    "ancestors",
    "assign_layers",
    "auto_layers",
    "cluster_layers",
    "cluster_layers_detailed",
    "cut_bytes",
    "deferrable_gradients",
    "gradient_roots",
    "layer_scan",
    "operand_spec",
    "partition",
    "per_iteration",
    "phase_times",
    "scan_layers",
    "split_backward",
    "stacked_layout",
    "step_weights",
]
