"""The user's own sharding annotations: rules for `sharding_constraint`, `reshard`, `mesh_cast`.

In: an equation of one of `ANNOTATION_PRIMITIVES` (``jax.lax.with_sharding_constraint``,
flax's ``nn.with_logical_constraint`` which lowers to it, ``jax.sharding.reshard``,
``jax.sharding.mesh_cast``) and a logical mesh. Out: an identity signature (every dimension
may be split as its operand is), and, through `annotated_strategies`, what the planner does
with the user's spec under `ShardOptions.annotations`:

- "keep": the node keeps only the strategy of the user's spec: a hard constraint.
- "hint": every other strategy pays the resharding into the user's spec (the lowered program
  still applies the user's constraint after the plan's layout, so that is what it costs).
- "ignore": nothing here; the search strips the annotations before tracing
  (`autopar.graph.without_annotations`), so the plan is the plan of the step without them.

The user's spec names the axes of the user's mesh; `user_spec_on` maps it onto the plan's
logical mesh by axis names and sizes: the user's mesh axes (of size > 1), in order, take
consecutive runs of the logical mesh's axes whose sizes multiply to theirs. A user's mesh
``{"data": 2, "model": 4}`` maps onto the logical mesh ``(x=2, y=4)`` as data -> x,
model -> y, and ``{"data": 8}`` onto ``(x=2, y=4)`` as data -> (x, y); on ``(x=8,)`` the
first cannot be held (`AnnotationMismatch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from autopar.cluster import LogicalMesh, Spec
from autopar.graph import ANNOTATION_PRIMITIVES
from autopar.intra._rules import OpInfo, register
from autopar.intra._signature import Signature

__all__ = ["ANNOTATION_PRIMITIVES", "AnnotationMismatch", "annotated_strategies"]


class AnnotationMismatch(ValueError):
    """A user's sharding (annotation or pin) that a logical mesh cannot hold."""


@register(*sorted(ANNOTATION_PRIMITIVES))
def _annotation(op: OpInfo) -> Signature:
    labels = tuple(f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature((labels,), (labels,))


def user_sharding(params: Mapping) -> tuple[dict[str, int], tuple, frozenset] | None:
    """(the user's mesh axis sizes, PartitionSpec entries, unconstrained dims) of an
    annotation's params; None when it names no mesh (a bare PartitionSpec under a context
    mesh that was not recorded)."""
    sharding = params.get("sharding", params.get("dst_sharding"))
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is None or spec is None or not getattr(mesh, "axis_names", ()):
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return sizes, tuple(spec), frozenset(params.get("unconstrained_dims", ()) or ())


def axis_map(user_axes: Mapping[str, int], mesh: LogicalMesh) -> dict[str, tuple[str, ...]]:
    """Each user mesh axis -> the logical mesh axes that stand for it (see the module
    docstring); raises `AnnotationMismatch` when the logical mesh cannot hold the user's."""
    logical = [(a, n) for a, n in zip(mesh.axis_names, mesh.shape) if n > 1]
    shape = dict(zip(mesh.axis_names, mesh.shape))
    mapping: dict[str, tuple[str, ...]] = {}
    i = 0
    for name, size in user_axes.items():
        if size == 1:
            mapping[name] = ()
            continue
        run: list[str] = []
        while i < len(logical) and math.prod(shape[a] for a in run) < size:
            run.append(logical[i][0])
            i += 1
        if math.prod(shape[a] for a in run) != size:
            raise AnnotationMismatch(
                f"the user's mesh {dict(user_axes)} cannot be matched on the plan's logical "
                f"mesh {shape}: axis {name!r} of size {size} is no run of its axes"
            )
        mapping[name] = tuple(run)
    if i != len(logical):
        raise AnnotationMismatch(
            f"the user's mesh {dict(user_axes)} has {math.prod(user_axes.values())} devices, "
            f"the plan's logical mesh {shape} {math.prod(mesh.shape)}"
        )
    return mapping


def user_spec_on(
    user_axes: Mapping[str, int], entries: Sequence, ndim: int, mesh: LogicalMesh
) -> Spec:
    """The user's PartitionSpec `entries` (for a value of `ndim` dimensions) as a `Spec` of
    the logical mesh; unconstrained entries count as unsplit here (callers mask them)."""
    mapping = axis_map(user_axes, mesh)
    spec: list[tuple[str, ...]] = []
    for d in range(ndim):
        entry = entries[d] if d < len(entries) else None
        names = () if entry is None or not isinstance(entry, (str, tuple)) else (
            (entry,) if isinstance(entry, str) else tuple(entry))
        axes: tuple[str, ...] = ()
        for name in names:
            if name not in mapping:
                raise AnnotationMismatch(
                    f"axis {name!r} of the spec {tuple(entries)} is not an axis of its mesh "
                    f"{dict(user_axes)}"
                )
            axes += mapping[name]
        spec.append(axes)
    return tuple(spec)


def wanted_spec(params: Mapping, ndim: int, mesh: LogicalMesh):
    """(the spec the annotation asks for on `mesh`, the dims it leaves free) or None."""
    found = user_sharding(params)
    if found is None:
        return None
    sizes, entries, free = found
    spec = user_spec_on(sizes, entries, ndim, mesh)
    return spec, free


def matches(spec: Spec, wanted: Spec, free: frozenset) -> bool:
    """Whether `spec` is the user's `wanted` on every dimension not left free."""
    return all(d in free or tuple(s) == tuple(w) for d, (s, w) in enumerate(zip(spec, wanted)))


def annotated_strategies(node, var, strategies: list, mesh: LogicalMesh, mode: str,
                         reshard_seconds) -> list:
    """The strategies of an annotation node under `mode` ("keep" or "hint"; see the module
    docstring). `var` is its result variable (for the error's shape); `reshard_seconds(src,
    dst)` prices a resharding of it. Raises `AnnotationMismatch` under "keep" when the
    user's spec cannot be held on `mesh`."""
    try:
        found = wanted_spec(node.params, len(var.shape), mesh)
    except AnnotationMismatch as err:
        if mode == "hint":
            return strategies
        raise AnnotationMismatch(f"{_where(node)}: {err}") from None
    if found is None:
        return strategies
    wanted, free = found
    if mode == "keep":
        kept = [s for s in strategies if matches(s.out_specs[0], wanted, free)]
        if not kept:
            raise AnnotationMismatch(
                f"{_where(node)} asks for {wanted} on a value of shape {tuple(var.shape)}, "
                f"which the logical mesh {dict(zip(mesh.axis_names, mesh.shape))} cannot "
                "split evenly"
            )
        return kept
    from dataclasses import replace

    return [
        s if matches(s.out_specs[0], wanted, free)
        else replace(s, compute_cost=s.compute_cost + reshard_seconds(s.out_specs[0], wanted))
        for s in strategies
    ]


def _where(node) -> str:
    source = getattr(node, "source", None)
    at = f" at {source}" if source else ""
    return f"the step's {node.primitive} #{node.id}{at}"
