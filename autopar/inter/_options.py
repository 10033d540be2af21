"""`StageOptions`: how the stage DP searches, handed to `choose_stages` as one record.

The search (`autopar.search`) builds one from `PlanOptions` and the cluster once per
search; tests and benchmarks build their own to compare (every field has the default the
search uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.choices import (
    MEMORY_LEVELS,
    REMAT_OPTIONS,
    SCHEDULES,
    MemoryLevels,
    RematOption,
    check_choice,
)
from autopar.inter._submesh import SubmeshShape
from autopar.intra import ShardOptions


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """How the stage DP searches.

    **Arguments** (all keyword, all optional):
    - `shard`: the layer ILPs' options (`ShardOptions`: method, memory budget, solver).
    - `schedule`: the schedule whose activations in flight the memory model counts
      ("gpipe" or "1f1b"; the search maps zero bubble, interleaving and "auto" to 1F1B).
    - `num_stages`, `submeshes` (`SubmeshShape`s a stage may use), `logical_shapes`:
      fix parts of the search (None: every value).
    - `remat`: what layers recompute ("auto": chosen per layer where a stage would not
      fit otherwise; "none", "selective", "full").
    - `memory_levels`: how the layer plans of a stage that does not fit get leaner
      (`autopar.inter._levels`): "price" (a price on the footprint, one unconstrained
      solve per level) or "limit" (a footprint limit row, each a harder MIP).
    - `prune_by_bound`: cut off stages that cannot be part of a plan as fast as the best
      even plan (`_stage_costs._bound_by_even_plans`); False costs every stage (the same
      answer, more solves).
    - `lower_bounds`: skip the logical mesh shapes and leaner memory levels whose layers'
      fastest plans already lose (`_stage_fit._lower_bound`, `DOMINANCE_MARGIN`); False
      uses no lower bound at all: every shape and level the DP asks about is solved (the
      reference the pruned search is checked against; the same answer, more solves).
    - `memory_floors`: skip the (layer range, logical mesh) pairs whose memory floor
      exceeds the budget before solving their leaner levels
      (`autopar.inter._memory_bound.stage_memory_floor`; with `lower_bounds` only); False
      walks them (the same answer, more solves).
    - `every_mesh_shape`: where `logical_shapes` is None, also the shapes
      `logical_mesh_shapes` leaves out (a several-host stage whose axes would both cross
      hosts); the reference that rule is checked against.
    """

    shard: ShardOptions = field(default_factory=ShardOptions)
    schedule: str = "1f1b"
    num_stages: int | None = None
    submeshes: tuple[SubmeshShape, ...] | None = None
    logical_shapes: tuple[tuple[int, ...], ...] | None = None
    remat: RematOption = "auto"
    memory_levels: MemoryLevels = "price"
    prune_by_bound: bool = True
    lower_bounds: bool = True
    every_mesh_shape: bool = False
    memory_floors: bool = True

    def __post_init__(self):
        if self.submeshes is not None:
            object.__setattr__(self, "submeshes", tuple(self.submeshes))
        if self.logical_shapes is not None:
            object.__setattr__(self, "logical_shapes",
                               tuple(tuple(s) for s in self.logical_shapes))
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("remat", self.remat, REMAT_OPTIONS)
        check_choice("memory_levels", self.memory_levels, MEMORY_LEVELS)
