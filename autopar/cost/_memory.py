"""Stage memory by part: what a pipeline stage holds per device at its peak.

In: the `LayerCost`s of a stage's layers (bytes per device of each layer's state,
accumulated gradients, kept activations per microbatch and working memory) and the
microbatches its schedule keeps in flight (`in_flight_microbatches`). Out: `StageMemory`,
the predicted peak split into the parts the runtime measures the same way
(`autopar.runtime._memory`), so that a prediction and a measurement compare part by part.
`stage_memory` (the figure the stage DP checks against the budget) is its `total`.
A layer's own parts (`LayerCost.state_memory`, `gradient_memory`, `activation_memory`)
are the bytes per device of its tensors as its plan splits them (`sharded_bytes`,
`gradient_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autopar.cost._compute import bytes_per_device
from autopar.cost._layer_cost import LayerCost

MEMORY_PARTS = ("state", "gradients", "activations", "working")

# A tensor as its plan holds it: (shape, dtype, spec on the plan's logical mesh).
Tensor = tuple


def sharded_bytes(tensors: Iterable[Tensor], mesh) -> float:
    """Bytes per device of `tensors`, each (shape, dtype, spec) split over `mesh` as its
    spec says (`bytes_per_device`): a layer's parameters and optimizer state
    (`LayerCost.state_memory`), or what its forward keeps for its backward for one
    microbatch (`LayerCost.activation_memory`).

    **Example:** a (1024, 4096) float32 weight split 4 ways on a (2, 4) mesh and its
    replicated (4096,) bias: 4 MiB + 16 KiB per device.
    """
    return sum(bytes_per_device(shape, dtype, spec, mesh) for shape, dtype, spec in tensors)


def gradient_bytes(tensors: Iterable[Tensor], mesh) -> float:
    """Bytes per device of a layer's gradients as they are accumulated over microbatches
    (`LayerCost.gradient_memory`): each (shape, dtype, spec) at the spec of its running
    sum (a deferred reduction's unreduced partial sum is whole on the summed axes)."""
    total = 0.0
    for shape, dtype, spec in tensors:
        total += bytes_per_device(shape, dtype, spec, mesh)
    return total


@dataclass(frozen=True)
class StageMemory:
    """A stage's predicted peak bytes per device, by part.

    - `state`: parameters and optimizer state of its layers;
    - `gradients`: the running gradient sums (one per gradient, for the whole step);
    - `activations`: the kept activations of the `in_flight` microbatches its schedule
      holds at once (`in_flight` x one microbatch's);
    - `working`: the working memory of the one layer running at a time (the largest:
      values live only inside a layer's forward or backward, at its peak);
    - `update`: the working memory of the optimizer update (the largest layer's), which
      runs once per step after the last microbatch's backward has freed every kept
      activation (1F1B, interleaved and GPipe alike; Narayanan et al. 2021, sec. 2.2: the
      "pipeline flush" before the optimizer step), so the peak is the larger of the two
      moments, never their sum.
    """

    state: float
    gradients: float
    activations: float
    working: float
    in_flight: float = 1.0
    update: float = 0.0

    @property
    def total(self) -> float:
        return self.state + self.gradients + max(self.activations + self.working, self.update)

    @property
    def activations_per_microbatch(self) -> float:
        return self.activations / self.in_flight if self.in_flight else 0.0

    def scaled(self, factor: float) -> StageMemory:
        """Every part times `factor` (a device group holding `factor` such chunks)."""
        return StageMemory(self.state * factor, self.gradients * factor,
                           self.activations * factor, self.working * factor,
                           self.in_flight * factor, self.update * factor)

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in (*MEMORY_PARTS, "in_flight", "update")}

    @staticmethod
    def from_json(d: dict) -> StageMemory:
        return StageMemory(*(float(d[name]) for name in (*MEMORY_PARTS, "in_flight")),
                           update=float(d.get("update", 0.0)))


def stage_memory_parts(costs: Sequence[LayerCost], in_flight: float,
                       shared_state: float = 0.0) -> StageMemory:
    """The stage of these layers by part (see `StageMemory`): every layer's state and
    accumulated gradients, `in_flight` times every layer's kept activations, and the
    largest working memory of one layer (`LayerCost.transient_memory`), and the largest
    layer's optimizer-update working memory (`LayerCost.update_memory`). `shared_state`:
    bytes per device of state that more than one of the layers reads (a tied embedding),
    counted in each reader's `state_memory` but held once: taken off the state.

    **Example:** two layers of 10 MB state, 10 MB gradients, 4 MB kept activations and
    1 MB / 3 MB working memory, 2 microbatches in flight: 20 + 20 + 16 + 3 = 59 MB; if
    2 MB of the state is one tied weight both read, 57 MB.
    """
    if shared_state < 0:
        raise ValueError(f"shared_state is bytes counted twice, >= 0; got {shared_state}")
    return StageMemory(
        state=math.fsum(c.state_memory for c in costs) - shared_state,
        gradients=math.fsum(c.gradient_memory for c in costs),
        activations=in_flight * math.fsum(c.activation_memory for c in costs),
        working=max((c.transient_memory for c in costs), default=0.0),
        in_flight=float(in_flight),
        update=max((c.update_memory for c in costs), default=0.0),
    )


def stage_memory(costs: Sequence[LayerCost], in_flight: int) -> float:
    """Bytes per device of a stage of these layers: the state and accumulated gradients of
    every layer, the kept activations of every microbatch in flight, and the working memory
    of the one layer running at a time (the total of `autopar.cost.stage_memory_parts`)."""
    return stage_memory_parts(costs, in_flight).total


def device_group_memory(chunks: Sequence[StageMemory]) -> StageMemory:
    """A device group's memory when it holds several pipeline chunks (the interleaved
    schedule's v model chunks per device; Narayanan et al. 2021, sec. 2.2): the state,
    gradient sums and kept activations of every chunk (each chunk's `in_flight` already
    counts the chunk-microbatches its schedule keeps: `in_flight_microbatches`), and the
    working memory of the one chunk running at a time, the largest.

    **Example:** two chunks of 10 GB state, 2 GB gradients, 30 GB / 20 GB activations and
    5 GB / 3 GB working memory: 20 + 4 + 50 + 5 = 79 GB.
    """
    if not chunks:
        raise ValueError("device_group_memory needs at least one chunk")
    return StageMemory(
        state=math.fsum(c.state for c in chunks),
        gradients=math.fsum(c.gradients for c in chunks),
        activations=math.fsum(c.activations for c in chunks),
        working=max(c.working for c in chunks),
        in_flight=math.fsum(c.in_flight for c in chunks),
        update=max(c.update for c in chunks),
    )


def distributed_optimizer_param_bytes(master_bytes: float, compute_itemsize: int,
                                      master_itemsize: int, shards: int) -> float:
    """Bytes per device of parameters as Megatron-LM's distributed optimizer holds them:
    the model's copy in the compute dtype, whole on every data-parallel rank, and the
    master copy split over the `shards` ranks (the optimizer's moments are split the same
    way and counted with the optimizer state). `master_bytes`: the parameters' bytes per
    device at the master dtype, whole (what a step that keeps its master weights and casts
    them for each use, as a JAX step does, holds).

    Megatron-LM's "Distributed Optimizer" guide (docs/source/api-guide/dist_optimizer.md)
    gives bytes per parameter of 6 + 12/d with bf16 parameters and fp32 gradients (2 for
    the bf16 parameter, 4 for the fp32 gradient buffer, 12/d for the fp32 master copy and
    Adam's two moments over d data-parallel ranks), against 8 + 8/d when the parameters
    themselves are fp32.

    **Example:** 4 GB of fp32 master weights per device cast to bf16, 64 shards:
    2 GB + 62.5 MB = 2.0625 GB.
    """
    if shards < 1 or compute_itemsize <= 0 or master_itemsize <= 0:
        raise ValueError(
            f"distributed_optimizer_param_bytes needs shards >= 1 and positive item sizes; "
            f"got shards={shards}, compute {compute_itemsize}, master {master_itemsize}"
        )
    return master_bytes * compute_itemsize / master_itemsize + master_bytes / shards
