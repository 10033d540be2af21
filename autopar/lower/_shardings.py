"""A `Plan`'s inputs as `NamedSharding`s, for a hand-written `jax.jit` ("ejecting" a plan),
`jax.device_put`, or a checkpoint restore target."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from autopar.cluster._mesh import replicated, to_partition_spec
from autopar.graph import abstract_args
from autopar.lower._spmd import jax_mesh
from autopar.lower._stacked import stacked_sharding


def plan_shardings(plan, like: Sequence[Any], devices: Sequence | None = None) -> tuple:
    """One pytree of `NamedSharding` per positional argument, shaped like `like`.

    **Arguments:**
    - `plan`: an `autopar.Plan`; a multi-stage plan puts each leaf on the mesh of the stage
      that holds it.
    - `like`: the step's positional arguments (arrays or `jax.ShapeDtypeStruct`s), as a
      tuple: their pytree structure is the result's.
    - `devices`: `devices[i]` is the plan's device `i`; default the local devices.

    **Returns:** a tuple with one pytree per argument, usable as
    ``jax.jit(step, in_shardings=...)`` and with ``jax.device_put``.

    **Example:**

    ```python
    in_sh = plan.shardings(like=(state, batch))       # or autopar.lower.plan_shardings
    state, batch = jax.device_put((state, batch), in_sh)
    new_state, metrics = jax.jit(train_step, in_shardings=in_sh)(state, batch)
    ```
    """
    if not isinstance(like, (tuple, list)):
        raise TypeError(
            f"like must be the tuple of the step's positional arguments, got "
            f"{type(like).__name__}; e.g. plan.shardings(like=(state, batch))"
        )
    like = tuple(like)
    _, paths = abstract_args(None, like, plan.arg_names or ("state", "batch"))
    by_path = shardings_by_path(plan, devices)
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise ValueError(
            f"the plan has no input at {', '.join(missing[:5])}: these arguments are not the "
            "ones the plan was made for; pass those, or plan again for these"
        )
    treedef = jax.tree.structure(like)
    return tuple(jax.tree.unflatten(treedef, [by_path[p] for p in paths]))


def shardings_by_path(plan, devices: Sequence | None = None) -> dict[str, NamedSharding]:
    """`NamedSharding` of every input, keyed by its pytree path (the paths `explain`
    prints); each on the mesh of the stage holding it. A stacked leaf the plan holds in
    pieces on several stages (`Plan.split_inputs`) appears once, under the caller's path,
    with the sharding of the whole array over those stages (`stacked_sharding`: the stage
    meshes stacked on a leading ``"stage"`` axis that splits the layer dim); its pieces'
    own shardings stay under their paths ``<path>[a:b]``."""
    meshes = [jax_mesh(stage.mesh, devices) for stage in plan.stages]
    found = {
        i.path: NamedSharding(
            meshes[i.stage], to_partition_spec(i.spec or replicated(len(i.shape)))
        )
        for i in plan.inputs
    }
    for path, pieces in plan.split_inputs().items():
        found[path] = stacked_sharding([found[i.path] for i in pieces])
    return found

