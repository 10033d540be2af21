"""A plan that fails by memory with pins: which pinned tensors hold the memory.

In: the `MemoryBudgetError` of a search with pins (`autopar.search._pins.resolve_pins`),
the traced graph and the logical mesh shapes tried. Out: `PinMemoryError`, the same error
(a `MemoryBudgetError`: callers that catch one still do) whose message names the largest
pinned tensors, each with its pin and its bytes per device under it, beside the budget and
the least memory any plan holding the pins reaches.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from autopar.cluster._mesh import LogicalMesh
from autopar.cost._compute import bytes_per_device
from autopar.cost._units import format_gib
from autopar.graph import OpGraph
from autopar.intra._ilp_problem import MemoryBudgetError
from autopar.intra._rules_annotations import AnnotationMismatch

# Pinned tensors the message names, largest per device first.
NAMED_PINS = 3


class PinMemoryError(MemoryBudgetError):
    """No plan holding the pins fits the memory budget (module docstring)."""

    def __init__(self, budget: float, least: float, kind: str, detail: str):
        super().__init__(budget, least, kind)
        self.detail = detail
        self.args = (f"{detail}\n{self.args[0]}",)

    def __reduce__(self):
        return type(self), (self.budget, self.least_memory, self.kind, self.detail)


def pin_memory_error(err: MemoryBudgetError, graph: OpGraph, pins, shapes) -> PinMemoryError:
    """`err` with the pinned tensors that hold the memory named (module docstring): on the
    first of the logical mesh `shapes` that holds every pin, each pin's bytes per device
    (`bytes_per_device`), the largest `NAMED_PINS`, and all of them together."""
    rows, mesh = [], None
    for shape in shapes:
        mesh = LogicalMesh.create(tuple(shape))
        try:
            rows = [(bytes_per_device(pin.shape, graph.vars[pin.var].dtype, pin.spec_on(mesh),
                                      mesh), pin) for pin in pins]
            break
        except AnnotationMismatch:
            rows = []
    rows.sort(key=lambda row: (-row[0], row[1].path))
    named = "; ".join(
        f"{pin.path} (shape {pin.shape}, {graph.vars[pin.var].dtype}) pinned to "
        f"{PartitionSpec(*pin.entries)}: {format_gib(nbytes)} per device"
        for nbytes, pin in rows[:NAMED_PINS])
    total = sum(nbytes for nbytes, _ in rows)
    where = f" on the logical mesh {mesh.shape}" if rows else ""
    detail = (
        f"the pins do not fit: no plan holding them stays within the {err.kind} budget of "
        f"{format_gib(err.budget)} per device (the least any reaches is "
        f"{format_gib(err.least_memory)}). The largest pinned tensors{where}: {named}; the "
        f"{len(rows)} pinned tensors hold {format_gib(total)} per device together. Split "
        "them over more mesh axes, leave them free (None in constraints=), or raise "
        "memory_budget."
    )
    return PinMemoryError(err.budget, err.least_memory, err.kind, detail)
