"""Does the model fit at all? A check before the search, in well under a second.

In: the step's arguments (arrays or `jax.ShapeDtypeStruct`s), the cluster and the
options. Out: nothing, or a `DoesNotFitError` (a `MemoryBudgetError`) whose message says,
in GiB per part (parameters, gradients, optimizer state, activations), what the model
needs against what the cluster holds, and the fixes.

The bound is optimistic (`autopar.cost._lower_bound`): every part is split over all the
devices the method lets split it (all of them for "auto", "shard" and "zero3"), the
gradients are as large as the parameters, and the activations are at least one
microbatch's input at the largest microbatch count the search would try. A model this
check lets through may still not fit (the search then says where); one it stops cannot
fit under any plan, so the search, which would spend minutes finding that out stage by
stage, never starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from autopar.cluster import Cluster
from autopar.cost._lower_bound import least_devices, least_memory_per_device
from autopar.cost._units import format_gib
from autopar.graph import abstract_args, dtype_itemsize
from autopar.graph._trace import OPT_STATE_KEYS, PARAM_KEYS, _is_float
from autopar.intra import MemoryBudgetError

PARTS = ("parameters", "gradients", "optimizer state", "other state", "activations")

# Which parts each method may split over the devices (the others it keeps whole on each).
SPLIT_BY_METHOD = {
    "data": frozenset({"activations"}),
    "zero2": frozenset({"gradients", "optimizer state", "activations"}),
}


class DoesNotFitError(MemoryBudgetError):
    """The model cannot fit the cluster under any plan (`check_fits`); `parts` holds the
    bytes of each part in all, `budget` the bytes per device, `least_memory` the least any
    plan needs per device."""

    def __init__(self, message: str, budget: float, least: float, parts: dict | None = None):
        ValueError.__init__(self, message)
        self.budget, self.least_memory, self.kind = budget, least, "peak"
        self.parts = dict(parts or {})

    def __reduce__(self):
        return type(self), (str(self), self.budget, self.least_memory, self.parts)


def state_parts(fn, args: Sequence[Any], batch_argnums: Sequence[int]) -> dict[str, float]:
    """Bytes in all of each part of the step's inputs, by leaf path and role as `trace`
    names them: parameters (a ``params`` path), their gradients (as large), optimizer
    state (``opt_state``), other state, and the batch (under "activations")."""
    leaves, paths = abstract_args(fn, tuple(args))
    with_path = _leaf_arguments(args)
    parts = dict.fromkeys(PARTS, 0.0)
    for leaf, path, argnum in zip(leaves, paths, with_path):
        nbytes = math.prod(leaf.shape) * dtype_itemsize(str(leaf.dtype))
        keys = set(path.split("/"))
        if argnum in batch_argnums:
            parts["activations"] += nbytes
        elif _is_float(str(leaf.dtype)) and keys & OPT_STATE_KEYS:
            parts["optimizer state"] += nbytes
        elif _is_float(str(leaf.dtype)) and keys & PARAM_KEYS:
            parts["parameters"] += nbytes
            parts["gradients"] += nbytes
        else:
            parts["other state"] += nbytes
    return parts


def _leaf_arguments(args: Sequence[Any]) -> list[int]:
    """The positional argument of every leaf, in flattening order."""
    import jax

    return [i for i, a in enumerate(args) for _ in range(len(jax.tree.leaves(a)))]


def check_fits(fn, args: Sequence[Any], cluster: Cluster, options) -> None:
    """Raise `DoesNotFitError` when no plan of `options.method` can hold the step's state
    and one microbatch's input on `cluster` under the memory budget."""
    parts = state_parts(fn, args, options.batch_argnums)
    num_devices = cluster.num_devices
    budget = options.memory_budget_for(cluster)
    counts = _microbatch_counts(args, options) if options.method == "auto" else [1]
    per_input = dict(parts, activations=parts["activations"] / max(counts))
    split = SPLIT_BY_METHOD.get(options.method, frozenset(PARTS))
    holders = {p: num_devices if p in split else 1 for p in PARTS}
    least = least_memory_per_device(per_input, holders)
    if least <= budget:
        return
    raise DoesNotFitError(_message(per_input, holders, least, budget, cluster, options,
                                   max(counts)), budget, least, per_input)


def _microbatch_counts(args, options) -> list[int]:
    rows = None
    for i in options.batch_argnums:
        for leaf in _leaves(args[i] if i < len(args) else ()):
            shape = getattr(leaf, "shape", ())
            if shape:
                rows = shape[0]
                break
    try:
        return options.microbatch_counts(rows)
    except ValueError:
        return [1]  # the batch does not split: the search says so


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _message(parts, holders, least, budget, cluster: Cluster, options, count) -> str:
    n = cluster.num_devices
    what = (f"the {n} devices of the cluster ({cluster.num_hosts} x "
            f"{cluster.devices_per_host} {cluster.name})")
    lines = [
        f"cannot fit: no plan holds this step on {what}. Even with every part split over "
        f"as many devices as method={options.method!r} allows, a device needs at least "
        f"{format_gib(least)} against a memory budget of {format_gib(budget)} per device "
        f"({format_gib(budget * n)} in all):",
    ]
    total = sum(parts.values())
    for part in PARTS:
        if part != "activations" and parts[part] < total * 1e-3:
            continue  # a step counter, a key: nothing to act on
        note = (f"split over {holders[part]} devices" if holders[part] > 1
                else "whole on every device")
        if part == "activations":
            note += f"; at least one microbatch's input, at {count} microbatch(es)"
        lines.append(f"  {part:<16} {format_gib(parts[part]):>12} in all, "
                     f"{format_gib(parts[part] / holders[part]):>12} per device ({note})")
    state = sum(b for p, b in parts.items() if p != "activations")
    fixes = []
    if holders["parameters"] == 1 or holders["optimizer state"] == 1:
        fixes.append("ZeRO: method='zero3' (or 'auto') splits the parameters, gradients "
                      "and optimizer state over all devices instead of copying them")
    needed = least_devices(state, budget)
    fixes.append(f"more devices: at least {needed} of these "
                 f"({math.ceil(needed / cluster.devices_per_host)} hosts of "
                 f"{cluster.devices_per_host}) to hold the state alone")
    fixes.append("rematerialisation (remat='full') and a smaller batch or more "
                 "microbatches shrink only the activations "
                 f"({format_gib(parts['activations'] / holders['activations'])} per device "
                 "here)")
    fixes.append("a smaller model, or the state in a narrower dtype (bfloat16 "
                 "parameters and optimizer moments halve them)")
    if options.memory_budget is not None:
        fixes.append(f"a larger memory_budget (it is {format_gib(budget)}; the devices "
                     f"have {format_gib(cluster.device_memory)})")
    return "\n".join(lines) + "\nFixes: " + "; ".join(fixes) + "."
