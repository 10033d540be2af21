"""A stacked leaf held in pieces on several stages, as one array for the caller.

A plan that cuts a scanned layer stack over pipeline stages (`Plan.scan_ranges`) holds
each stacked leaf ``w`` (leading dim L) as pieces ``w[a:b]``, one per stage, each on its
stage's mesh. The caller sees one `jax.Array` of the whole shape, laid out on the devices
of those stages: a mesh ``("stage", *stage axes)`` stacking the stage meshes, the leading
dim split over ``"stage"`` (and within a stage as its piece is), i.e. every device holds
exactly what its stage's piece puts there. Passing such an array in and getting it back
moves no data: the pieces are views of its shards (`pieces_of`, `join_pieces`).

This needs pieces of one length on stage meshes of one shape, which the search ensures.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STAGE_AXIS = "stage"


def stacked_sharding(pieces: Sequence[NamedSharding]) -> NamedSharding:
    """The whole leaf's sharding from its pieces' (one per stage, in range order): the
    stage meshes stacked along a new leading ``"stage"`` axis, the leading dim split over
    it, the rest as the first piece has it."""
    meshes = [p.mesh for p in pieces]
    names = meshes[0].axis_names
    if any(m.axis_names != names or m.devices.shape != meshes[0].devices.shape for m in meshes):
        raise ValueError(
            "the pieces of a stacked leaf are on stage meshes of different shapes "
            f"({[dict(m.shape) for m in meshes]}); they cannot form one array: plan with "
            "logical_shapes=[...] so that the stages' meshes agree"
        )
    assert STAGE_AXIS not in names, f"mesh axis {STAGE_AXIS!r} is reserved for the stages"
    mesh = Mesh(np.stack([m.devices for m in meshes]), (STAGE_AXIS, *names))
    spec = list(pieces[0].spec)
    first = spec[0] if spec else None
    rest = () if first is None else ((first,) if isinstance(first, str) else tuple(first))
    lead = (STAGE_AXIS, *rest) if rest else STAGE_AXIS
    return NamedSharding(mesh, PartitionSpec(lead, *spec[1:]))


def _on(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    current = getattr(x, "sharding", None)
    if current is not None and current.is_equivalent_to(sharding, x.ndim):
        return x
    return jax.device_put(x, sharding)


def pieces_of(x, ranges, pieces: Sequence[NamedSharding]) -> list:
    """The pieces ``x[a:b]`` of a whole stacked leaf, each on its stage's sharding. When
    `x` is laid out as `stacked_sharding(pieces)` (as returned by the step), each piece is
    assembled from `x`'s own shards, no copy; otherwise sliced and placed."""
    whole = stacked_sharding(pieces)
    laid_out = isinstance(x, jax.Array) and x.sharding.is_equivalent_to(whole, x.ndim)
    if not laid_out:
        return [jax.device_put(x[a:b], s) for (a, b), s in zip(ranges, pieces)]
    shards = {shard.device: shard.data for shard in x.addressable_shards}
    out = []
    for (a, b), s in zip(ranges, pieces):
        shape = (b - a, *x.shape[1:])
        out.append(jax.make_array_from_single_device_arrays(
            shape, s, [shards[d] for d in s.addressable_devices_indices_map(shape)]
        ))
    return out


def join_pieces(pieces: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> jax.Array:
    """One array of the whole leaf from its pieces (one per stage, in range order), laid
    out as `stacked_sharding(shardings)`; each piece first moved to its `shardings` entry
    if it is not there (within its stage)."""
    pieces = [_on(p, s) for p, s in zip(pieces, shardings)]
    whole = stacked_sharding(shardings)
    shape = (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:])
    shards = [shard.data for p in pieces for shard in p.addressable_shards]
    return jax.make_array_from_single_device_arrays(shape, whole, shards)
