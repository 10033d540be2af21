"""Microbatches: the batch's size and the arguments cut to one microbatch.

In: the step's arguments (arrays or `jax.ShapeDtypeStruct` pytrees) or its traced graph.
Out: the batch's rows, or abstract arguments of one microbatch, which the pipeline search
and the Megatron scorer trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from autopar.graph import OpGraph, Role


def batch_size(graph: OpGraph) -> int | None:
    """Rows of the batch (dim 0 of the batch inputs), or None without batch inputs."""
    sizes = {graph.vars[v].shape[0] for v in graph.invars
             if graph.vars[v].role is Role.BATCH and graph.vars[v].shape}
    if len(sizes) > 1:
        raise ValueError(
            f"batch inputs have different leading sizes {sorted(sizes)}; every batch leaf "
            "must have the batch as its first dimension"
        )
    return sizes.pop() if sizes else None


def microbatch_args(args: Sequence[Any], batch_argnums: Sequence[int], num_microbatches: int):
    """Abstract arguments with every batch leaf cut to one microbatch."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(getattr(x, "shape", ())), x.dtype), tuple(args)
    )
    out = list(abstract)
    for i in batch_argnums:
        if i >= len(out):
            continue

        def cut(x, i=i):
            if not x.shape:
                return x
            if x.shape[0] % num_microbatches:
                raise ValueError(
                    f"the batch argument {i} has {x.shape[0]} rows, which is not divisible "
                    f"by num_microbatches={num_microbatches}; choose a number of "
                    f"microbatches that divides {x.shape[0]}"
                )
            return jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype)

        out[i] = jax.tree.map(cut, out[i])
    return tuple(out)
