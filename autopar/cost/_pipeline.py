"""Pipeline formulas: step latency, bubble, microbatches in flight, stage memory.

In: per-stage (or per-layer) predicted seconds and bytes, the schedule, the number of
stages and microbatches. Out: seconds, fractions, counts and bytes. The stage DP, `Plan`,
the Megatron scorer, `compare`, the reports and the benchmarks all call these, so every
prediction of a pipeline uses the same formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.choices import SCHEDULES, Schedule, check_choice


def pipeline_latency(stage_times: Sequence[float], num_microbatches: int) -> float:
    """Seconds per step of a pipeline whose stages take `stage_times` per microbatch.

    Alpa's latency (Zheng et al. 2022, REFERENCES.md "Stage DP"): the first microbatch
    passes every stage, each later one adds the slowest stage,
    ``sum_i t_i + (B - 1) * max_j t_j``. One stage accumulating B microbatches takes
    ``B * t``; one stage and one microbatch, ``t``.

    **Example:** ``pipeline_latency([1.0, 2.0], 4) == 9.0``.
    """
    if not stage_times:
        raise ValueError("a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    return sum(stage_times) + (num_microbatches - 1) * max(stage_times)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B pipeline: (p - 1) / (m + p - 1).

    For p stages and m microbatches (Narayanan et al. 2021; REFERENCES.md "Megatron-LM
    plans"). One stage has no bubble.

    **Example:** ``bubble_fraction(4, 8) == 3 / 11``.
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a pipeline needs at least one stage and one microbatch, got "
            f"{num_stages} stage(s) and {num_microbatches} microbatch(es)"
        )
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def in_flight_microbatches(schedule: Schedule, num_microbatches: int, stages_from_here: int) -> int:
    """Microbatches whose activations a stage holds at once: all of them with GPipe; with
    1F1B one per stage from this one to the last, min(m, p - i) on stage i of p
    (Narayanan et al. 2021; REFERENCES.md "Pipeline schedules")."""
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, stages_from_here)


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

    @property
    def transient_memory(self) -> float:
        """Working memory beyond state and kept activations, needed one layer at a time."""
        return max(
            0.0, self.memory - self.state_memory - self.activation_memory - self.gradient_memory
        )


def stage_memory(costs: Sequence[LayerCost], in_flight: int) -> float:
    """Bytes per device of a stage of these layers: the state and accumulated gradients of
    every layer, the kept activations of every microbatch in flight, and the working memory
    of the one layer running at a time."""
    memory = sum(
        c.state_memory + c.gradient_memory + in_flight * c.activation_memory for c in costs
    )
    return memory + max(c.transient_memory for c in costs)


def memory_budget(cluster, requested: float | None = None) -> float:
    """Bytes per device a plan may use: `requested`, or else the cluster's device memory."""
    if requested is not None:
        return float(requested)
    return float(cluster.device_memory)
