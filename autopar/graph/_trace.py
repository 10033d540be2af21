"""`trace`: a function and example arguments in, a flat `OpGraph` out.

The arguments are turned into `jax.ShapeDtypeStruct`s and the function is traced with
`jax.make_jaxpr`, so nothing is allocated: a GPT-3 175B train step traces on a laptop.
The jaxpr is then flattened in the `eval_jaxpr` shape (an env, one loop, recursion into
sub-jaxprs): `jit`/`pjit`, `closed_call`, `core_call`, `custom_jvp_call`,
`custom_vjp_call` and `remat2` (jax.checkpoint) are inlined, the nodes that come from a
checkpoint being marked `remat=True`; `scan`, `while` and `cond` stay single nodes.

**Paths.** Every input leaf gets a path: the `/`-joined pytree keys (`path_str`), after the
argument's name (the parameter name of `fn`, else ``arg<i>``). An argument that is a state
tree, i.e. has a top-level ``params`` entry, is not prefixed, so paths read
``params/layers/3/mlp/w1``, ``opt_state/0/mu/layers/3/mlp/w1`` and ``batch/tokens``.

**Roles.** For each input leaf, in order:

1. a leaf of an argument in `batch_argnums` is `BATCH`;
2. a leaf whose dtype is not floating (step counters, rng keys, masks) is `OTHER`;
3. a path with an optimizer-state component (``opt_state``, ``optimizer_state``) is
   `OPT_STATE`; else a path with a ``params`` component is `PARAM` (this covers optax
   states, whose ``mu``/``nu`` trees repeat the parameter paths, and flax variables);
4. otherwise dataflow decides: a leaf is `PARAM` if it influences the gradient. With an
   `autopar.value_and_grad` boundary, that is: it is an ancestor of a top-level
   ``grad_boundary`` node. Without one, it is an ancestor of a contraction, reduction or
   control-flow node (a loss always reduces; optimizer states only feed elementwise
   updates). Every other float leaf is `OPT_STATE`. Known limit of the fallback: an
   optimizer that takes norms of its own state (e.g. LAMB) needs the path hint.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core

from autopar._memo import declare
from autopar.graph import _flops
from autopar.graph._collector import collector_paused
from autopar.graph._opgraph import Node, OpGraph, Role, Var

# Equations inlined by the tracer are those that just run a sub-jaxpr (see _flops).
INLINED = _flops.CALL_JAXPR_PARAM
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})
GRAD_BOUNDARY = "grad_boundary"

# Path components that say what a leaf is (rule 3 of the module docstring).
OPT_STATE_KEYS = frozenset({"opt_state", "optimizer_state"})
PARAM_KEYS = frozenset({"params"})

# Nodes whose inputs count as "reaching the loss" when there is no grad boundary (rule 4).
LOSS_SEED_PRIMITIVES = frozenset(
    {"dot_general", "conv_general_dilated", "scan", "while", "cond"}
    | {name for name, rule in _flops.FLOP_RULES.items() if rule is _flops.reduction_flops}
)


def trace(
    fn: Callable, *args: Any, batch_argnums: Sequence[int] | int = (1,), name: str | None = None
) -> OpGraph:
    """Trace `fn(*args)` into an `OpGraph` with one node per primitive equation.

    **Arguments:**
    - `fn`: the function, typically a train step ``(state, batch) -> (state, metrics)``.
    - `args`: pytrees of arrays or `jax.ShapeDtypeStruct` (or a mix); only shapes and
      dtypes are used.
    - `batch_argnums`: positions of the arguments whose leaves are the batch.
    - `name`: the graph's name; default `fn.__name__`.

    **Returns:** an `OpGraph` whose `evaluate(jax.tree.leaves(args))` reproduces `fn`.

    **Example:**

    ```python
    graph = trace(train_step, abstract_state, abstract_batch)
    print(graph.summary())
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"trace expects a callable as its first argument, got {type(fn).__name__}; "
            "pass the function itself, e.g. trace(train_step, state, batch)."
        )
    batch_argnums = _check_argnums(batch_argnums, len(args))
    with collector_paused():  # see `autopar.graph._collector`
        return _traced(fn, args, batch_argnums, name)


def _traced(fn, args, batch_argnums, name) -> OpGraph:
    """`trace`'s graph of `fn(*args)` (`batch_argnums` checked)."""
    arg_names = _arg_names(fn, len(args))
    leaves, paths, in_tree = _flatten_args(args, arg_names)
    abstract = jax.tree.unflatten(in_tree, [_abstractify(x, p) for x, p in zip(leaves, paths)])
    closed, out_shape = _make_jaxpr(fn, abstract)

    builder = _GraphBuilder()
    invars = [builder.new_var(v.aval, Role.OTHER) for v in closed.jaxpr.invars]
    outvars = builder.inline(closed.jaxpr, closed.consts, invars, remat=False)
    graph = OpGraph(
        vars=builder.vars,
        nodes=builder.nodes,
        invars=tuple(invars),
        outvars=tuple(outvars),
        in_tree=in_tree,
        out_tree=jax.tree.structure(out_shape),
        name=name or getattr(fn, "__name__", None) or "fn",
        arg_names=tuple(arg_names),
    )
    _assign_roles(graph, paths, batch_argnums)
    return graph


def trace_jaxpr(jaxpr: Any, name: str = "body") -> OpGraph:
    """The `OpGraph` of a jaxpr already traced, such as a `scan` body (`params["jaxpr"]`).

    Flattened as `trace` flattens a step (nested calls and remat inlined, control flow
    kept whole); the inputs are `ACTIVATION` variables without paths. The same jaxpr gives
    the same graph, variable and node ids included, every time (the planner and the
    lowering each rebuild a scan body's graph and meet on those ids).
    """
    consts = jaxpr.consts if isinstance(jaxpr, core.ClosedJaxpr) else ()
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
    builder = _GraphBuilder()
    invars = [builder.new_var(v.aval, Role.ACTIVATION) for v in jaxpr.invars]
    with collector_paused():
        outvars = builder.inline(jaxpr, consts, invars, remat=False)
    return OpGraph(builder.vars, builder.nodes, tuple(invars), tuple(outvars), name=name)


# ---- arguments ----------------------------------------------------------------------


def path_str(keypath: Sequence[Any]) -> str:
    """Format a pytree key path as ``a/b/3/c``.

    **Arguments:**
    - `keypath`: entries as given by `jax.tree_util.tree_flatten_with_path`.

    **Returns:** dict keys, attribute names and sequence indices joined by ``/``.
    """
    parts = []
    for entry in keypath:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
            parts.append(str(entry.key))
        else:
            parts.append(str(entry))
    return "/".join(parts)


def _check_argnums(batch_argnums: Sequence[int] | int, num_args: int) -> tuple[int, ...]:
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    for i in argnums:
        if not isinstance(i, int) or not -num_args <= i < num_args:
            raise ValueError(
                f"batch_argnums={batch_argnums!r} does not fit {num_args} argument(s): "
                f"each entry must be an int in [0, {num_args}); pass the positions of the "
                "batch arguments, e.g. batch_argnums=(1,) for train_step(state, batch), "
                "or batch_argnums=() when there is no batch."
            )
    return tuple(i % num_args for i in argnums)


def _arg_names(fn: Callable, num_args: int) -> list[str]:
    """Positional parameter names of `fn`, ``arg<i>`` where they cannot be found."""
    names: list[str] = []
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return [names[i] if i < len(names) else f"arg{i}" for i in range(num_args)]


def abstract_args(
    fn: Callable | None, args: tuple, arg_names: Sequence[str] = ()
) -> tuple[list[jax.ShapeDtypeStruct], list[str]]:
    """Every leaf of `args` as a `jax.ShapeDtypeStruct`, with its path (as `trace` names
    it after `fn`'s parameters, or after `arg_names`). Raises a TypeError naming the leaf
    that is not an array, a Python scalar or a `ShapeDtypeStruct`; reads nothing of the
    arrays but their shapes and dtypes."""
    names = list(arg_names) if fn is None else _arg_names(fn, len(args))
    names += [f"arg{i}" for i in range(len(names), len(args))]
    leaves, paths, _ = _flatten_args(args, names)
    return [_abstractify(x, p) for x, p in zip(leaves, paths)], paths


def _flatten_args(args: tuple, arg_names: list[str]) -> tuple[list, list[str], Any]:
    """Leaves of `args`, their paths (see the module docstring) and the tree."""
    with_path, in_tree = jax.tree_util.tree_flatten_with_path(args)
    state_like = {kp[0].idx for kp, _ in with_path if len(kp) > 1 and _is_params_key(kp[1])}
    leaves, paths = [], []
    for keypath, leaf in with_path:
        argnum, rest = keypath[0].idx, path_str(keypath[1:])
        if argnum in state_like:
            paths.append(rest)
        else:
            paths.append(f"{arg_names[argnum]}/{rest}" if rest else arg_names[argnum])
        leaves.append(leaf)
    return leaves, paths, in_tree


def _is_params_key(entry: Any) -> bool:
    return path_str([entry]) in PARAM_KEYS


def _abstractify(x: Any, path: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct((), jax.numpy.result_type(x), weak_type=True)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(
            np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False))
        )
    raise TypeError(
        f"the argument leaf at '{path}' is a {type(x).__name__}, not an array; every "
        "leaf must be an array, a Python scalar or a jax.ShapeDtypeStruct. Close over "
        "non-array settings instead (e.g. functools.partial(fn, cfg=cfg)) or register the "
        "containing class as a pytree with that field static."
    )


def _make_jaxpr(fn: Callable, abstract_args: tuple) -> tuple[core.ClosedJaxpr, Any]:
    # A fresh function object each time: JAX caches traces by function and argument
    # shapes, and would hand back a trace made outside `autopar.auto_layers` (whose layer
    # marks depend on that context, not on the shapes).
    def fresh(*args):
        return fn(*args)

    try:
        return jax.make_jaxpr(fresh, return_shape=True)(*abstract_args)
    except Exception as err:  # any failure of the user's function to trace
        raise ValueError(
            f"trace could not trace {getattr(fn, '__name__', fn)!r} with the given "
            f"arguments: {type(err).__name__}: {err}\nPass arrays or jax.ShapeDtypeStruct "
            "pytrees that match the function's signature (same number of positional "
            "arguments, same tree structure, shapes and dtypes it expects)."
        ) from err


# ---- flattening -------------------------------------------------------------------


class _GraphBuilder:
    """Accumulates `Var`s and `Node`s while walking (and inlining) jaxprs."""

    def __init__(self) -> None:
        self.vars: list[Var] = []
        self.nodes: list[Node] = []
        self._literals: dict[tuple, int] = {}
        self._consts: dict[int, int] = {}

    def new_var(self, aval: Any, role: Role, producer: int | None = None, value=None) -> int:
        var = Var(
            id=len(self.vars),
            shape=tuple(getattr(aval, "shape", ())),
            dtype=_dtype_name(aval),
            role=role,
            producer=producer,
            value=value,
        )
        self.vars.append(var)
        return var.id

    def inline(
        self, jaxpr: core.Jaxpr, consts: Sequence[Any], in_ids: Sequence[int], remat: bool
    ) -> list[int]:
        """Emit nodes for `jaxpr` applied to variables `in_ids`; returns its output ids."""
        env: dict[Any, int] = {}

        def read(atom: Any) -> int:
            return self._literal(atom) if isinstance(atom, core.Literal) else env[atom]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self._const(v.aval, c)
        for v, i in zip(jaxpr.invars, in_ids, strict=True):
            env[v] = i
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            if name in INLINED:
                sub = eqn.params[INLINED[name]]
                sub_consts = sub.consts if isinstance(sub, core.ClosedJaxpr) else ()
                sub_jaxpr = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
                outs = self.inline(sub_jaxpr, sub_consts, ins, remat or name in REMAT_PRIMITIVES)
            else:
                outs = self._add_node(eqn, ins, remat)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o  # DropVars too: harmless, never read
        return [read(a) for a in jaxpr.outvars]

    def _add_node(self, eqn: core.JaxprEqn, ins: list[int], remat: bool) -> list[int]:
        """One `Node` for `eqn` (reading `ins`); its output variable ids. FLOPs as
        `_flops.eqn_flops` counts them and bytes as `_flops.eqn_traffic` (plus the
        operands' and results' own bytes for a call), from the avals read once here."""
        node_id = len(self.nodes)
        outs = [self.new_var(v.aval, Role.ACTIVATION, producer=node_id) for v in eqn.outvars]
        name, params = eqn.primitive.name, eqn.params
        in_avals = [a.aval for a in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        traffic = _flops.body_traffic(name, params)
        self.nodes.append(
            Node(
                id=node_id,
                primitive=name,
                inputs=tuple(ins),
                outputs=tuple(outs),
                params=params,
                flops=_flops.flops(name, in_avals, out_avals, params),
                bytes_read=sum(map(_flops.aval_nbytes, in_avals)) + traffic.bytes_read,
                bytes_written=sum(map(_flops.aval_nbytes, out_avals)) + traffic.bytes_written,
                prim=eqn.primitive,
                remat=remat,
                source=_source(eqn),
            )
        )
        return outs

    def _literal(self, lit: core.Literal) -> int:
        val = lit.val
        if np.ndim(val) == 0:
            # The raw bytes keep -0.0 apart from 0.0 and let nan be shared.
            key = (_dtype_name(lit.aval), np.asarray(val).tobytes())
            if key not in self._literals:
                self._literals[key] = self.new_var(lit.aval, Role.CONST, value=val)
            return self._literals[key]
        return self.new_var(lit.aval, Role.CONST, value=val)

    def _const(self, aval: Any, value: Any) -> int:
        if id(value) not in self._consts:
            self._consts[id(value)] = self.new_var(aval, Role.CONST, value=value)
        return self._consts[id(value)]


def _dtype_name(aval: Any) -> str:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return str(aval)  # e.g. an effect token
    if dtype not in _DTYPE_NAMES:
        if len(_DTYPE_NAMES) >= _DTYPE_NAMES_LIMIT:
            _DTYPE_NAMES.clear()
        extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        _DTYPE_NAMES[dtype] = str(dtype) if extended else np.dtype(dtype).name  # "key<fry>"
    return _DTYPE_NAMES[dtype]


_DTYPE_NAMES_LIMIT = 1024
_DTYPE_NAMES: dict[Any, str] = declare(
    {}, "graph.dtype_names", "dtype -> name", scope="process", limit=_DTYPE_NAMES_LIMIT)


def _source(eqn: core.JaxprEqn) -> str | None:
    """``file.py:line`` of the user frame that created `eqn`, if JAX recorded one."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}"


# ---- roles ------------------------------------------------------------------------


def _assign_roles(graph: OpGraph, paths: list[str], batch_argnums: tuple[int, ...]) -> None:
    """Set `role` and `path` of every input variable in place (rules in the module doc)."""
    argnums = _leaf_argnums(graph.in_tree)
    needs_dataflow = []
    roles: list[Role] = []
    for k, (v, path) in enumerate(zip(graph.invars, paths, strict=True)):
        role = _role_from_path(graph.vars[v], path, argnums[k] in batch_argnums)
        if role is None:
            needs_dataflow.append(k)
        roles.append(role)
    if needs_dataflow:
        reaching = _inputs_reaching_loss(graph)
        for k in needs_dataflow:
            roles[k] = Role.PARAM if graph.invars[k] in reaching else Role.OPT_STATE
    for v, path, role in zip(graph.invars, paths, roles):
        graph.vars[v] = replace(graph.vars[v], role=role, path=path)


def _leaf_argnums(in_tree: Any) -> list[int]:
    """For every flat leaf of the argument tuple, the position of its argument."""
    args = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
    argnums = [0] * in_tree.num_leaves
    for argnum, arg in enumerate(args):
        for leaf in jax.tree.leaves(arg):
            argnums[leaf] = argnum
    return argnums


def _role_from_path(var: Var, path: str, is_batch: bool) -> Role | None:
    """Rules 1-3; None when only dataflow can tell."""
    if is_batch:
        return Role.BATCH
    if not _is_float(var.dtype):
        return Role.OTHER
    parts = set(path.split("/"))
    if parts & OPT_STATE_KEYS:
        return Role.OPT_STATE
    if parts & PARAM_KEYS:
        return Role.PARAM
    return None


def _is_float(dtype: str) -> bool:
    try:
        # jax's issubdtype knows bfloat16 and the float8 types are floating (numpy's does not)
        return bool(jax.numpy.issubdtype(jax.numpy.dtype(dtype), jax.numpy.inexact))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def _inputs_reaching_loss(graph: OpGraph) -> set[int]:
    """Input variables that are ancestors of the gradient (rule 4)."""
    seeds = [n for n in graph.nodes if n.primitive == GRAD_BOUNDARY]
    if not seeds:
        seeds = [n for n in graph.nodes if n.primitive in LOSS_SEED_PRIMITIVES]
    stack = [v for n in seeds for v in n.inputs]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        producer = graph.vars[v].producer
        if producer is not None:
            stack.extend(graph.nodes[producer].inputs)
    return seen & set(graph.invars)
