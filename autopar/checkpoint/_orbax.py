"""`save` and `restore` with orbax's `StandardCheckpointer` (the `checkpoint` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from autopar.distributed import place
from autopar.graph import abstract_args
from autopar.lower import shardings_by_path
from autopar.plan import Plan

INSTALL_HINT = 'checkpoints need orbax: pip install "autopar[checkpoint]" (orbax-checkpoint)'


def _checkpointer():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return ocp.StandardCheckpointer()


def save(path: str | Path, state: Any) -> Path:
    """Write `state` (a pytree of arrays, sharded or not) to the directory `path`.

    Every process writes the shards it holds; the call returns once the checkpoint is
    complete on disk. `path` must not exist yet (orbax never overwrites a checkpoint).

    **Returns:** the absolute path written.
    """
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(
            f"{path} exists already; save each checkpoint to a new directory (e.g. one per "
            "step), or delete the old one first"
        )
    checkpointer = _checkpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    return path


def restore(path: str | Path, like: Any, target: Any = None, argnum: int = 0) -> Any:
    """Read a checkpoint written by `save` onto the shardings of another plan.

    **Arguments:**
    - `path`: the directory `save` wrote.
    - `like`: what the state will train under next: a decorated step (`autoparallel`)
      that has run once, or a `Plan`.
    - `target`: the state's structure, shapes and dtypes (arrays or
      `jax.ShapeDtypeStruct`s, e.g. `abstract_state(...)`); default: argument `argnum` of
      the decorated step's last call. Required with a `Plan`.
    - `argnum`: which positional argument of the step the state is (default 0).

    **Returns:** the state as `jax.Array`s laid out as the plan wants them (each leaf on
    its stage's devices for a pipelined plan).
    """
    plan, target = _plan_and_target(like, target, argnum)
    names = plan.arg_names or ("state", "batch")
    abstract, paths = abstract_args(None, (target,), (names[argnum],))
    by_path = shardings_by_path(plan)
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise ValueError(
            f"the plan has no state leaf at {', '.join(missing[:5])}: the target is not the "
            f"state (argument {argnum}) the plan was made for; pass that structure as target="
        )
    shardings = [by_path[p] for p in paths]
    if all(s.is_fully_addressable for s in shardings):
        restore_as = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(abstract, shardings)
        ]
        return _checkpointer().restore(Path(path).absolute(), _like(target, restore_as))
    # Several processes, and leaves on devices of other processes (a pipelined plan's
    # stages): orbax cannot build an array with no shard here, so every process reads each
    # whole leaf onto one of its own devices and builds the global array from it.
    # (Memory: one full leaf at a time per process, on the host.)
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    local = _checkpointer().restore(Path(path).absolute(), _like(target, [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here) for a in abstract
    ]))
    return _like(target, [
        place(np.asarray(x), s) for x, s in zip(jax.tree.leaves(local), shardings)
    ])


def _like(target: Any, leaves: list) -> Any:
    return jax.tree.unflatten(jax.tree.structure(target), leaves)


def _plan_and_target(like: Any, target: Any, argnum: int) -> tuple[Plan, Any]:
    if isinstance(like, Plan):
        if target is None:
            raise TypeError(
                "restore(path, like=plan) needs target=: the state's structure and shapes "
                "(arrays or jax.ShapeDtypeStruct), which a plan does not keep"
            )
        return like, target
    plan = getattr(like, "plan", None)
    if not callable(like) or plan is None:
        raise TypeError(
            f"like must be a step decorated with autopar.autoparallel or a Plan, got "
            f"{type(like).__name__}"
        )
    if target is None:
        graph = like.graph
        args = jax.tree.unflatten(graph.in_tree, [
            jax.ShapeDtypeStruct(graph.vars[v].shape, graph.vars[v].dtype) for v in graph.invars
        ])
        target = args[argnum]
    return plan, target
