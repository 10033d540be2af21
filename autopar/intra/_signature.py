"""Dimension signatures: how an operator's tensor dimensions relate, einsum style.

A sharding rule describes a primitive by labelling the dimensions of its inputs and
outputs. Dimensions with the same label are split together: splitting label ``m`` of a
matmul over mesh axis ``x`` splits the lhs rows and the output rows the same way. A label
that appears in inputs but in no output is a reduction: splitting it leaves each device
with a partial result that a collective must reduce (``reductions[label]`` names the
reduction, "sum" for a contracting dimension). A dimension labelled ``None`` is never split.

From a signature and a logical mesh, `enumerate_assignments` lists every way to give mesh
axes to labels: each mesh axis goes to at most one label, a label may take several axes
(in mesh order), and every dimension carrying a label must divide evenly. On a mesh of
more than two axes (of size > 1) only the assignments of its two-axis views are listed
(`MAX_AXIS_RUNS`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autopar.cluster import LogicalMesh, Spec

Labels = tuple[str | None, ...]


@dataclass(frozen=True)
class Signature:
    """Dimension labels of one operator.

    **Arguments:**
    - `inputs`: per operand, a label per dimension, or None for an operand that is always
      used whole (replicated), such as gather indices' index vector or a constant.
    - `outputs`: per result, a label per dimension.
    - `reductions`: labels absent from the outputs, mapped to their reduction kind.
    """

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    reductions: Mapping[str, str] = field(default_factory=dict)

    def labels(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for labels in (*self.inputs, *self.outputs):
            for label in labels or ():
                if label is not None:
                    seen.setdefault(label)
        return tuple(seen)


Assignment = Mapping[str, tuple[str, ...]]  # label -> mesh axes, major to minor

# On a mesh of three or more axes (of size > 1), an assignment gives the axes, in mesh
# order, to at most this many runs of neighbours that share a label (or are all left
# unused): the assignments of the mesh's two-axis views, (x*y, z) and (x, y*z) for
# (x, y, z), which each node may pick from independently. All (labels + 1)^axes
# assignments made the ILP of a 4-layer GPT on a (2, 2, 2) mesh 39.5 million variables
# (Alpa's count; up to 306 strategies per node, against 46 on (2, 4)), too large to build
# or solve; the two-axis views give up only strategies that split three different
# labels (or one label on the middle axis alone) in one node.
MAX_AXIS_RUNS = 2


def _num_runs(choice: Sequence[str | None]) -> int:
    """Runs of equal neighbours in `choice` (a label, or None, per mesh axis)."""
    return 1 + sum(a != b for a, b in zip(choice, choice[1:])) if choice else 0


def label_sizes(
    sig: Signature, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]
) -> dict[str, int]:
    """The size of every label; a label must have one size wherever it appears."""
    sizes: dict[str, set[int]] = {}
    for labels, shape in itertools.chain(zip(sig.inputs, in_shapes), zip(sig.outputs, out_shapes)):
        if labels is None:
            continue
        assert len(labels) == len(shape), f"labels {labels} do not match shape {shape}"
        for label, size in zip(labels, shape):
            if label is not None:
                sizes.setdefault(label, set()).add(int(size))
    return {label: min(s) for label, s in sizes.items()}


def _dims_of_label(
    sig: Signature, in_shapes, out_shapes
) -> dict[str, list[int]]:
    """Every dimension size that carries each label (all must divide evenly)."""
    dims: dict[str, list[int]] = {}
    for labels, shape in itertools.chain(zip(sig.inputs, in_shapes), zip(sig.outputs, out_shapes)):
        for label, size in zip(labels or (), shape):
            if label is not None:
                dims.setdefault(label, []).append(int(size))
    return dims


def enumerate_assignments(
    sig: Signature,
    in_shapes: Sequence[tuple[int, ...]],
    out_shapes: Sequence[tuple[int, ...]],
    mesh: LogicalMesh,
) -> list[dict[str, tuple[str, ...]]]:
    """All valid ways to give mesh axes (of size > 1) to labels, in a deterministic order
    (on a mesh of more than two such axes, those of its two-axis views: `MAX_AXIS_RUNS`).

    The first assignment is always the empty one (everything replicated).
    """
    dims = _dims_of_label(sig, in_shapes, out_shapes)
    labels = [label for label in sig.labels() if label in dims]
    axes = [a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1]
    sizes = mesh.sizes()
    results: list[dict[str, tuple[str, ...]]] = []
    for choice in itertools.product([None, *labels], repeat=len(axes)):
        if len(axes) > 2 and _num_runs(choice) > MAX_AXIS_RUNS:
            continue
        grouped: dict[str, list[str]] = {}
        for axis, label in zip(axes, choice):
            if label is not None:
                grouped.setdefault(label, []).append(axis)
        # A label that takes several axes takes them in mesh order only: the other
        # orders give the same split with devices permuted, which a mesh shape of its
        # own already covers.
        assignment = {label: tuple(group) for label, group in grouped.items()}
        if all(
            all(d % math.prod(sizes[a] for a in ax) == 0 for d in dims[label])
            for label, ax in assignment.items()
        ):
            results.append(assignment)
    return results


def spec_for(labels: Labels | None, ndim: int, assignment: Assignment) -> Spec:
    """The spec of one tensor under an assignment."""
    if labels is None:
        return ((),) * ndim
    return tuple(tuple(assignment.get(label, ())) if label is not None else () for label in labels)


def reduced_axes(sig: Signature, assignment: Assignment) -> dict[str, tuple[str, ...]]:
    """Reduction kind -> mesh axes over which partial results must be reduced."""
    out: dict[str, tuple[str, ...]] = {}
    for label, kind in sig.reductions.items():
        if label in assignment:
            out[kind] = out.get(kind, ()) + tuple(assignment[label])
    return out
