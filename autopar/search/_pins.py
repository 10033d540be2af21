"""Pins: the user's shardings for some of the step's arguments, as constraints of the search.

In: `PlanOptions.constraints` and the traced graph. Out: `resolve_pins`, a function of a
logical mesh giving the spec each pinned input must take there (the ILP's `fixed`), after
every pin was checked against the arguments (before anything is planned or run).

Two forms:

- a pytree like the arguments (as `jax.jit`'s `in_shardings`: a tuple with one entry per
  positional argument), whose leaves are `NamedSharding`, `PartitionSpec` or None (free);
  a leaf where the arguments hold a subtree applies to the whole subtree.
- `LogicalPins(mesh, rules, axes)`, MaxText style: `axes` maps parameter path patterns
  (`fnmatch`, matched against paths like ``state/params/layers_0/mlp/w1``) to one logical
  axis name per dimension; `rules` maps logical axis names to mesh axes.

A `NamedSharding`'s axes are its mesh's; a bare `PartitionSpec` names the axes of the mesh
of the constraints' `NamedSharding`s, or, with none, the planner's logical axes ("x", "y").
Axes map onto each logical mesh the planner tries as annotations do
(`autopar.intra._rules_annotations.axis_map`); a mesh that cannot hold them is skipped.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.cluster import DEFAULT_AXIS_NAMES, LogicalMesh, Spec
from autopar.graph import OpGraph, Role
from autopar.intra._rules_annotations import axis_map


@dataclass(frozen=True)
class LogicalPins:
    """Pins by parameter path and logical axis names (MaxText's logical axis rules).

    **Arguments:**
    - `mesh`: the user's mesh: a `jax.sharding.Mesh` or a dict of axis sizes in order,
      e.g. ``{"fsdp": 4, "tensor": 2}``.
    - `rules`: (logical axis, mesh axis or tuple of mesh axes or None) pairs, e.g.
      ``[("embed", "fsdp"), ("mlp", "tensor")]``; a logical axis with no rule is unsplit.
    - `axes`: path pattern -> one logical axis name (or None) per dimension, e.g.
      ``{"*/mlp/w1": ("embed", "mlp"), "*/mlp/w2": ("mlp", "embed")}``; the first pattern
      matching a leaf's path wins; leaves matched by none are free.

    **Example:**

    ```python
    pins = autopar.search.LogicalPins(
        mesh={"fsdp": 4, "tensor": 2},
        rules=[("embed", "fsdp"), ("mlp", "tensor")],
        axes={"*/w1": ("embed", "mlp"), "*/w2": ("mlp", "embed")},
    )
    plan = autopar.plan(step, state, batch, constraints=pins)
    ```
    """

    mesh: object
    rules: Sequence[tuple[str, object]]
    axes: Mapping[str, tuple[str | None, ...]]

    def mesh_sizes(self) -> dict[str, int]:
        if isinstance(self.mesh, Mapping):
            return {str(k): int(v) for k, v in self.mesh.items()}
        return dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))

    def spec_for(self, path: str, ndim: int) -> tuple | None:
        """The PartitionSpec entries for a leaf at `path`, or None when no pattern matches."""
        for pattern, logical in self.axes.items():
            if fnmatch.fnmatchcase(path, pattern):
                if len(logical) != ndim:
                    raise ValueError(
                        f"pin {pattern!r} gives {len(logical)} logical axes {tuple(logical)} "
                        f"to {path}, which has {ndim} dimensions; give one name (or None) "
                        "per dimension"
                    )
                rules = dict(self.rules)
                return tuple(None if name is None else rules.get(name) for name in logical)
        return None


@dataclass(frozen=True)
class _Pin:
    var: int
    path: str
    shape: tuple[int, ...]
    mesh: dict[str, int] | None  # None: the logical mesh's own axis names
    entries: tuple

    def spec_on(self, mesh: LogicalMesh) -> Spec:
        if self.mesh is None:
            mapping = {a: (a,) for a in mesh.axis_names}
            unknown = {a for e in self.entries for a in _names(e)} - set(mapping)
            if unknown:  # another mesh rank than the pin's: this logical mesh cannot hold it
                from autopar.intra._rules_annotations import AnnotationMismatch

                raise AnnotationMismatch(
                    f"{self.path}: the pin {PartitionSpec(*self.entries)} names axes "
                    f"{sorted(unknown)} this logical mesh lacks"
                )
        else:
            from autopar.intra._rules_annotations import AnnotationMismatch

            try:
                mapping = axis_map(self.mesh, mesh)
            except AnnotationMismatch as err:
                raise AnnotationMismatch(
                    f"{self.path}: the pin {PartitionSpec(*self.entries)}: {err}") from None
        return tuple(
            sum((mapping[a] for a in _names(self.entries[d] if d < len(self.entries) else None)),
                ())
            for d in range(len(self.shape))
        )


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def resolve_pins(graph: OpGraph, constraints) -> Callable[[LogicalMesh], dict[int, Spec]] | None:
    """`fixed` for the planner: logical mesh -> {input var: spec}; None without pins.

    Raises a ValueError naming the argument leaf, the pin and the reason for a pin that no
    mesh can hold (an axis its mesh does not have, a dimension its axes do not divide)."""
    if constraints is None:
        return None
    pins = _logical_pins(graph, constraints) if isinstance(constraints, LogicalPins) \
        else _tree_pins(graph, constraints)
    for pin in pins:
        _check(pin)

    def fixed(mesh: LogicalMesh) -> dict[int, Spec]:
        return {pin.var: pin.spec_on(mesh) for pin in pins}

    fixed.pins = tuple(pins)  # for `autopar.search._pin_memory`'s error
    return fixed


def _inputs(graph: OpGraph):
    return [graph.vars[v] for v in graph.invars]


def _tree_pins(graph: OpGraph, constraints) -> list[_Pin]:
    if not isinstance(constraints, (tuple, list)) or len(constraints) != len(graph.arg_names):
        raise TypeError(
            f"constraints must be a tuple with one entry per positional argument of the step "
            f"({len(graph.arg_names)}: {', '.join(graph.arg_names)}), as jax.jit's "
            f"in_shardings, or an autopar.search.LogicalPins; got {type(constraints).__name__}"
        )
    inputs = _inputs(graph)
    index_tree = jax.tree.unflatten(graph.in_tree, range(len(inputs)))
    meshes = {
        tuple(leaf.mesh.shape.items())
        for leaf in jax.tree.leaves(constraints, is_leaf=_is_leaf)
        if isinstance(leaf, NamedSharding)
    }
    if len(meshes) > 1:
        raise ValueError(
            f"the constraints' NamedShardings are on {len(meshes)} different meshes "
            f"{sorted(meshes)}; give every pin the same mesh"
        )
    common = dict(next(iter(meshes))) if meshes else None
    pins: list[_Pin] = []

    def collect(pin, subtree):
        if pin is None:
            return
        if isinstance(pin, NamedSharding):
            mesh, entries = dict(pin.mesh.shape), tuple(pin.spec)
        else:
            mesh, entries = common, tuple(pin)
        for i in jax.tree.leaves(subtree):
            var = inputs[i]
            if var.role is Role.CONST:
                continue
            pins.append(_Pin(graph.invars[i], var.path or f"input {i}", tuple(var.shape),
                             mesh, entries))

    try:
        jax.tree.map(collect, tuple(constraints), index_tree, is_leaf=_is_leaf)
    except ValueError as err:
        raise ValueError(
            "constraints must have the arguments' structure (or a prefix of it), with "
            f"PartitionSpec / NamedSharding / None leaves: {err}"
        ) from None
    return pins


def _logical_pins(graph: OpGraph, pins: LogicalPins) -> list[_Pin]:
    sizes = pins.mesh_sizes()
    found = []
    for v, var in zip(graph.invars, _inputs(graph)):
        if var.role is Role.CONST or var.path is None:
            continue
        entries = pins.spec_for(var.path, len(var.shape))
        if entries is not None:
            found.append(_Pin(v, var.path, tuple(var.shape), sizes, entries))
    if not found:
        paths = [graph.vars[v].path for v in graph.invars if graph.vars[v].path][:4]
        raise ValueError(
            f"no argument path matches the patterns {list(pins.axes)}; paths look like "
            f"{paths}"
        )
    return found


def _check(pin: _Pin) -> None:
    """A ValueError naming the leaf, the pin and why, for a pin no mesh can hold."""
    sizes = pin.mesh if pin.mesh is not None else None
    shown = PartitionSpec(*pin.entries)
    if len(pin.entries) > len(pin.shape):
        raise ValueError(
            f"cannot pin {pin.path} (shape {pin.shape}) to {shown}: the spec has "
            f"{len(pin.entries)} entries for {len(pin.shape)} dimensions"
        )
    used: list[str] = []
    for d, entry in enumerate(pin.entries):
        names = _names(entry)
        used += names
        if sizes is None:
            unknown = [a for a in names if a not in DEFAULT_AXIS_NAMES]
            if unknown:
                raise ValueError(
                    f"cannot pin {pin.path} (shape {pin.shape}) to {shown}: axis "
                    f"{unknown[0]!r} is no mesh axis; a bare PartitionSpec names the "
                    f"planner's logical axes {DEFAULT_AXIS_NAMES} unless the constraints "
                    "hold a NamedSharding giving the mesh"
                )
            continue
        unknown = [a for a in names if a not in sizes]
        if unknown:
            raise ValueError(
                f"cannot pin {pin.path} (shape {pin.shape}) to {shown}: the mesh "
                f"{sizes} has no axis {unknown[0]!r}"
            )
        split = math.prod(sizes[a] for a in names)
        if pin.shape[d] % split:
            raise ValueError(
                f"cannot pin {pin.path} (shape {pin.shape}) to {shown}: dimension {d} of "
                f"size {pin.shape[d]} does not divide into {split} parts over {names}"
            )
    if len(set(used)) != len(used):
        raise ValueError(f"cannot pin {pin.path} to {shown}: a mesh axis is used twice")
