"""A `Plan`'s inputs as `NamedSharding`s, for a hand-written `jax.jit` ("ejecting" a plan)."""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import NamedSharding

from autopar.cluster._mesh import to_partition_spec
from autopar.lower._spmd import jax_mesh


def plan_shardings(plan, devices: Sequence | None = None) -> dict[str, NamedSharding]:
    """`NamedSharding` of every input of a one-stage plan, keyed by pytree path.

    **Arguments:**
    - `plan`: an `autopar.Plan` with one stage.
    - `devices`: `devices[i]` is the plan's device `i`; default the local devices.

    **Example:**

    ```python
    sh = autopar.lower.plan_shardings(plan)   # or plan.shardings()
    state = jax.device_put(state, ...)        # place leaves with sh[path]
    ```
    """
    if len(plan.stages) != 1:
        raise ValueError(
            "shardings() describes a one-stage plan; this plan has "
            f"{len(plan.stages)} pipeline stages. Use stage.sharding per stage instead."
        )
    mesh = jax_mesh(plan.stages[0].mesh, devices)
    return {i.path: NamedSharding(mesh, to_partition_spec(i.spec)) for i in plan.inputs}
