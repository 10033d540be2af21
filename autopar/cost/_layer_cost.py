"""What one layer costs on one stage mesh: the record the stage DP adds up.

In: a layer's plan priced by the rest of `cost` (seconds per microbatch, bytes per device).
Out: `LayerCost`, which `_memory` sums into a stage's memory and `_remat` turns into the
cost of the same layer with a recompute.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs on one stage mesh, per microbatch: the numbers the stage DP
    adds up (`stage_memory`, `pipeline_latency`)."""

    latency: float  # predicted seconds per microbatch (forward + backward + its update)
    memory: float  # bytes per device at the layer's peak (state + live activations)
    activation_memory: float  # bytes per device kept from forward to backward
    state_memory: float = 0.0  # parameters and optimizer state, bytes per device
    # The layer's gradients, summed over microbatches until the update (deferred ones
    # unreduced, so at their per-device partial-sum size), bytes per device.
    gradient_memory: float = 0.0
    # Working memory of the layer's optimizer update beyond its state and gradient sums,
    # bytes per device: the update runs once per step after the last microbatch's backward,
    # when no kept activations are held, so it never adds to them (`StageMemory.total`).
    # `memory` is the peak of the forward and backward alone.
    update_memory: float = 0.0

    @property
    def transient_memory(self) -> float:
        """Working memory beyond state and kept activations, needed one layer at a time."""
        return max(
            0.0, self.memory - self.state_memory - self.activation_memory - self.gradient_memory
        )
