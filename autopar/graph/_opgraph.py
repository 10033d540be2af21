"""The operator graph: one node per primitive equation of a flattened jaxpr.

Plain data. Variables are dense integer ids; every literal and closed-over constant is a
variable of role ``CONST`` holding its value, so node inputs are always variable ids.
Nested jit/pjit, custom_jvp/custom_vjp calls and remat are inlined by the tracer; scan,
while and cond stay single nodes whose equation params still hold their bodies.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Role(str, enum.Enum):
    """What a variable is, for reports and for planning options such as ZeRO."""

    PARAM = "param"
    OPT_STATE = "opt_state"
    BATCH = "batch"
    OTHER = "other"  # a graph input that is none of the above (step counter, rng key, ...)
    ACTIVATION = "activation"  # produced by a node
    CONST = "const"  # literal or closed-over constant


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element; typed PRNG keys (``key<fry>``) count as their uint32 data."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import jax.numpy as jnp

        try:
            return jnp.dtype(dtype).itemsize
        except TypeError:
            return 8  # a threefry key: two uint32 words


@dataclass(frozen=True, eq=False)
class Var:
    """One value of the graph.

    **Arguments:**
    - `id`: dense index into `OpGraph.vars`.
    - `shape`, `dtype`: the abstract value (`dtype` is a numpy dtype name, e.g. "float32").
    - `role`: see `Role`.
    - `path`: pytree path of a graph input, like ``params/layers_3/mlp/w1``; else None.
    - `producer`: id of the node that computes it; None for inputs and constants.
    - `value`: the numpy value of a CONST variable; else None.
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    role: Role
    path: str | None = None
    producer: int | None = None
    value: Any = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * dtype_itemsize(self.dtype)


@dataclass(frozen=True, eq=False)
class Node:
    """One primitive application.

    `prim` is the JAX primitive and `params` its equation params, so that `OpGraph.evaluate`
    can re-run the node; everything else is plain data.
    """

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any] = field(repr=False)
    flops: float
    bytes_read: float
    bytes_written: float
    prim: Any = field(default=None, repr=False)
    remat: bool = False
    source: str | None = None  # "file.py:line" of the user code that created it, if known


@dataclass(eq=False)
class OpGraph:
    """A flattened train step.

    `invars` are the flat leaves of the traced arguments in `jax.tree.flatten` order
    (`in_tree` rebuilds them); `outvars` likewise for the outputs (`out_tree`).
    """

    vars: list[Var]
    nodes: list[Node]
    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    in_tree: Any = None
    out_tree: Any = None
    name: str = "fn"
    # The step's positional parameter names, which the input paths are named after.
    arg_names: tuple[str, ...] = ()
    # A step whose stacked layer leaves were cut into pieces (`split_stacked`): how its
    # inputs and outputs map to the caller's leaves (a `StackedSplit`); None otherwise.
    stacked: Any = None

    # ---- queries -----------------------------------------------------------------------

    def consumers(self) -> list[list[int]]:
        """For every variable, the ids of the nodes that read it (in program order); an
        empty tuple for a variable no node reads. (A layer's graph keeps the whole step's
        variable table, most of which its nodes never read: one shared empty tuple for
        those instead of a list each, 0.14 s a call on an unscanned Llama-8B's layers.)"""
        users: list = [()] * len(self.vars)
        for node in self.nodes:
            for v in dict.fromkeys(node.inputs):
                if users[v]:
                    users[v].append(node.id)
                else:
                    users[v] = [node.id]
        return users

    def inputs_with_role(self, *roles: Role) -> list[Var]:
        return [self.vars[v] for v in self.invars if self.vars[v].role in roles]

    @property
    def total_flops(self) -> float:
        return float(sum(n.flops for n in self.nodes))

    @property
    def param_bytes(self) -> int:
        return sum(v.nbytes for v in self.inputs_with_role(Role.PARAM))

    @property
    def num_params(self) -> int:
        return sum(v.size for v in self.inputs_with_role(Role.PARAM))

    def summary(self, top: int = 12) -> str:
        """A short text summary: nodes per primitive, FLOPs, parameter and state bytes."""
        counts = Counter(n.primitive for n in self.nodes)
        roles = Counter()
        role_bytes = Counter()
        for v in self.invars:
            roles[self.vars[v].role.value] += 1
            role_bytes[self.vars[v].role.value] += self.vars[v].nbytes
        lines = [
            f"OpGraph '{self.name}': {len(self.nodes)} nodes, {len(self.vars)} variables",
            f"  total FLOPs      {self.total_flops:.4g}",
            f"  parameters       {self.num_params:,} ({_fmt_bytes(self.param_bytes)})",
        ]
        for role in Role:
            if roles[role.value]:
                lines.append(
                    f"  inputs {role.value:<10}{roles[role.value]:>6} "
                    f"({_fmt_bytes(role_bytes[role.value])})"
                )
        lines.append("  nodes per primitive:")
        for prim, n in counts.most_common(top):
            lines.append(f"    {prim:<24}{n:>6}")
        if len(counts) > top:
            lines.append(f"    ... {len(counts) - top} more primitives")
        return "\n".join(lines)

    def to_networkx(self):
        """A `networkx.MultiDiGraph`: nodes are node ids, an edge per variable passed along.

        Graph inputs appear as nodes named ``("in", var_id)``.
        """
        import networkx as nx

        g = nx.MultiDiGraph(name=self.name)
        for v in self.invars:
            var = self.vars[v]
            g.add_node(("in", v), role=var.role.value, path=var.path, shape=var.shape)
        for node in self.nodes:
            g.add_node(node.id, primitive=node.primitive, flops=node.flops)
            for v in node.inputs:
                var = self.vars[v]
                if var.producer is not None:
                    g.add_edge(var.producer, node.id, var=v, nbytes=var.nbytes)
                elif var.role is not Role.CONST:
                    g.add_edge(("in", v), node.id, var=v, nbytes=var.nbytes)
        return g

    # ---- interpretation ----------------------------------------------------------------

    def run_nodes(
        self,
        env: dict[int, Any],
        nodes: Sequence[Node],
        on_input: Callable[[Node, list[Any]], list[Any]] | None = None,
        on_output: Callable[[Node, list[Any]], list[Any]] | None = None,
    ) -> None:
        """Run `nodes` in order, reading and writing values in `env` (var id -> value)."""
        for node in nodes:
            ins = [
                self.vars[v].value if self.vars[v].role is Role.CONST else env[v]
                for v in node.inputs
            ]
            if on_input is not None:
                ins = on_input(node, ins)
            outs = node.prim.bind(*ins, **node.params)
            outs = list(outs) if node.prim.multiple_results else [outs]
            if on_output is not None:
                outs = on_output(node, outs)
            for v, x in zip(node.outputs, outs):
                env[v] = x

    def evaluate(
        self,
        flat_args: Sequence[Any],
        on_output: Callable[[Node, list[Any]], list[Any]] | None = None,
        nodes: Sequence[Node] | None = None,
        on_input: Callable[[Node, list[Any]], list[Any]] | None = None,
    ) -> list[Any]:
        """Run the graph on flat arguments (arrays or tracers), in the `eval_jaxpr` shape.

        `on_input(node, ins)` and `on_output(node, outs)` may replace a node's operands and
        results (the lowering uses them to add sharding constraints).
        """
        assert len(flat_args) == len(self.invars), (
            f"expected {len(self.invars)} flat arguments, got {len(flat_args)}"
        )
        env: dict[int, Any] = dict(zip(self.invars, flat_args))
        self.run_nodes(env, self.nodes if nodes is None else nodes, on_input, on_output)
        return [
            self.vars[v].value if self.vars[v].role is Role.CONST else env[v]
            for v in self.outvars
        ]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
