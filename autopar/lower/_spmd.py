"""Lower a `ShardingPlan` to one `jax.jit` program on its mesh.

The graph is re-run by `OpGraph.evaluate` inside `jax.jit`; arguments and results get the
plan's shardings, and every result the plan pins gets a `with_sharding_constraint`. A scan
whose body the planner opened (scanned layers, `ShardingPlan.scan_bodies`) runs as a
`jax.lax.scan` of its body graph with the body's constraints inside. XLA's SPMD
partitioner then inserts the collectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from autopar.cluster._mesh import LogicalMesh, replicated, to_partition_spec
from autopar.graph import OpGraph, Role
from autopar.intra._scan import opened_body
from autopar.lower._experts import with_expert_dispatch
from autopar.lower._ring_lowering import with_ring_attention


def local_devices() -> list:
    """All devices, ordered as cluster device ids: by process, then by device id."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def jax_mesh(mesh: LogicalMesh, devices: Sequence | None = None) -> Mesh:
    """The `jax.sharding.Mesh` of a logical mesh; `devices[i]` is cluster device `i`."""
    devices = local_devices() if devices is None else list(devices)
    if max(mesh.device_ids) >= len(devices):
        raise ValueError(
            f"the plan uses device ids up to {max(mesh.device_ids)} but only "
            f"{len(devices)} devices are present; plan for this cluster, or run on the "
            "cluster the plan was made for"
        )
    grid = np.array([devices[i] for i in mesh.device_ids], dtype=object).reshape(mesh.shape)
    return Mesh(grid, mesh.axis_names)


def named_shardings(specs, graph_vars, mesh: Mesh) -> list[NamedSharding]:
    return [
        NamedSharding(mesh, to_partition_spec(replicated(len(v.shape)) if s is None else s))
        for s, v in zip(specs, graph_vars)
    ]


def lower_sharding_plan(
    graph: OpGraph,
    plan,
    devices: Sequence | None = None,
    donate_flat: Sequence[int] = (),
):
    """A jitted function of the flat arguments that runs `graph` as `plan` says.

    **Arguments:**
    - `plan`: a `ShardingPlan` for `graph`.
    - `devices`: cluster device id -> jax device (default `local_devices()`).
    - `donate_flat`: flat argument indices whose buffers may be reused.

    **Returns:** `(fn, in_shardings, out_shardings)`.
    """
    plan.check_graph(graph)
    mesh = jax_mesh(plan.mesh, devices)
    graph = with_ring(with_expert_dispatch(with_scan_bodies(graph, plan, mesh), plan, mesh),
                      plan, plan, mesh)
    graph = with_planned_reshards(graph, plan, mesh)
    in_vars = [graph.vars[v] for v in graph.invars]
    out_vars = [graph.vars[v] for v in graph.outvars]
    in_shardings = named_shardings([plan.var_specs[v] for v in graph.invars], in_vars, mesh)
    out_shardings = named_shardings(plan.output_specs(graph), out_vars, mesh)
    on_input, on_output = constraint_hooks(plan, mesh)

    def run(*flat_args):
        # The plan's mesh is the program's, whatever mesh the caller set (`jax.set_mesh`
        # of an explicit mesh, under which a step's `jax.sharding.reshard` traces).
        if jax.sharding.get_abstract_mesh().empty:
            return graph.evaluate(flat_args, on_output, on_input=on_input)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return graph.evaluate(flat_args, on_output, on_input=on_input)

    fn = jax.jit(
        run,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnums=tuple(donate_flat),
    )
    return fn, in_shardings, out_shardings


def constraint_hooks(plan, mesh: Mesh):
    """`on_input`/`on_output` hooks that pin the plan's specs inside a traced program."""
    pinned = {
        v: NamedSharding(mesh, to_partition_spec(plan.var_specs[v]))
        for v in plan.constrained
        if plan.var_specs[v] is not None
    }
    operands: dict[int, dict[int, NamedSharding]] = {}
    for node_id, index, spec in plan.operand_specs:
        operands.setdefault(node_id, {})[index] = NamedSharding(mesh, to_partition_spec(spec))

    def on_output(node, outs):
        return [
            jax.lax.with_sharding_constraint(x, pinned[v]) if v in pinned else x
            for v, x in zip(node.outputs, outs)
        ]

    def on_input(node, ins):
        wanted = operands.get(node.id)
        if not wanted:
            return ins
        return [
            jax.lax.with_sharding_constraint(x, wanted[i]) if i in wanted else x
            for i, x in enumerate(ins)
        ]

    return on_input, on_output


# Annotations that carry the user's mesh in their result's type (an explicit mesh's
# `jax.sharding.reshard`): bound as they are, they would put the user's axes into a
# program that runs on the plan's mesh.
_TYPED_ANNOTATIONS = ("reshard", "mesh_cast")
# Equation params that give a result's sharding in its type (`broadcast_in_dim`, `iota`,
# `reshape`, `dot_general`, ... traced under an explicit mesh); None: the plan's layout.
_TYPED_PARAMS = ("sharding", "out_sharding")


def with_planned_reshards(graph: OpGraph, plan, mesh: Mesh) -> OpGraph:
    """`graph` whose `reshard` / `mesh_cast` nodes constrain their operand to the plan's
    spec of their result, on the plan's mesh (`PlannedReshard`), in place of binding the
    user's sharding (the plan already holds it, mapped onto its logical mesh)."""
    nodes = list(graph.nodes)
    changed = False
    for node in graph.nodes:
        if node.primitive in _TYPED_ANNOTATIONS:
            spec = plan.var_specs[node.outputs[0]]
            nodes[node.id] = replace(node, prim=PlannedReshard(mesh, spec))
            changed = True
        elif any(_explicit(node.params.get(k)) for k in _TYPED_PARAMS):
            # Traced under an explicit mesh, the node's result type names its axes.
            params = {**node.params,
                      **{k: None for k in _TYPED_PARAMS if _explicit(node.params.get(k))}}
            nodes[node.id] = replace(node, params=params)
            changed = True
    return replace(graph, nodes=nodes) if changed else graph


def _explicit(sharding) -> bool:
    """Whether `sharding` is on a mesh with an explicit axis (its axes enter the type)."""
    mesh = getattr(sharding, "mesh", None)
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


class PlannedReshard:
    """Stands in for `reshard_p` / `mesh_cast_p` in one node: `bind` pins its operand to
    the plan's spec (None: left as it is)."""

    multiple_results = False

    def __init__(self, mesh: Mesh, spec) -> None:
        self.sharding = None if spec is None else NamedSharding(mesh, to_partition_spec(spec))

    def bind(self, x, **params):
        return x if self.sharding is None else jax.lax.with_sharding_constraint(x, self.sharding)


def with_scan_bodies(graph: OpGraph, plan, mesh: Mesh) -> OpGraph:
    """`graph` whose planned scans run their bodies under the plan's constraints.

    Each scan node with a `BodyPlan` gets a `prim` that runs `jax.lax.scan` over its body
    graph (`opened_body`), every body result pinned to its planned spec, the operands the
    body reshards pinned before use, and each carry returned in its layout on entry.
    """
    bodies = getattr(plan, "scan_bodies", ())
    if not bodies:
        return graph
    nodes = list(graph.nodes)
    for body_plan in bodies:
        node = nodes[body_plan.node]
        assert node.primitive == "scan", f"node {node.id} is a {node.primitive}, not a scan"
        nodes[node.id] = replace(node, prim=PlannedScan(node.params, body_plan, mesh,
                                                        ring_axes(plan)))
    return replace(graph, nodes=nodes)


def ring_axes(plan) -> tuple[str, ...]:
    """The mesh axes of the plan's ring attention; () when it has none."""
    context = getattr(plan, "context_parallel", None)
    if context is None or context.algorithm != "ring":
        return ()
    return tuple(context.axes)


def with_ring(graph: OpGraph, plan, layouts, mesh: Mesh,
              axes: tuple[str, ...] | None = None) -> OpGraph:
    """`graph` with its attention run by the ring kernel when `plan` chose the ring
    (`autopar.lower._ring_lowering`); `layouts` holds the var specs of `graph`."""
    axes = ring_axes(plan) if axes is None else axes
    if not axes:
        return graph
    return with_ring_attention(graph, layouts.var_specs, axes, mesh)


class PlannedScan:
    """Stands in for `scan_p` in one node: `bind` runs the planned body in a `lax.scan`."""

    multiple_results = True

    def __init__(self, params: Mapping, body_plan, mesh: Mesh,
                 ring: tuple[str, ...] = ()) -> None:
        self.body = with_ring(with_expert_dispatch(opened_body(params), body_plan, mesh),
                              None, body_plan, mesh, ring)
        self.body_plan = body_plan
        self.mesh = mesh

    def bind(self, *operands, **params):
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        consts = list(operands[:num_consts])
        init = list(operands[num_consts : num_consts + num_carry])
        xs = list(operands[num_consts + num_carry :])
        on_input, on_output = constraint_hooks(self.body_plan, self.mesh)
        out_shardings = [
            None if spec is None or not spec else NamedSharding(self.mesh, to_partition_spec(spec))
            for spec in self.body_plan.out_specs
        ]

        def step(carry, x):
            outs = self.body.evaluate([*consts, *carry, *x], on_output, on_input=on_input)
            outs = [
                x if sh is None else jax.lax.with_sharding_constraint(x, sh)
                for x, sh in zip(outs, out_shardings)
            ]
            return outs[:num_carry], outs[num_carry:]

        carry, ys = jax.lax.scan(
            step, init, xs, length=params["length"], reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry, *ys]


def lower_segment(
    graph: OpGraph,
    plan,
    nodes: Sequence[int],
    inputs: Sequence[int],
    outputs: Sequence[int],
    mesh: Mesh,
    *,
    accumulate: Sequence[int] = (),
    scale: dict[int, float] | None = None,
    output_specs: dict | None = None,
    stacked: Mapping[int, tuple[str, ...]] | None = None,
):
    """A jitted function running some nodes of `graph` as `plan` says.

    **Arguments:**
    - `nodes`: node ids of `graph` to run, in order; `inputs`/`outputs`: variable ids.
    - `accumulate`: outputs to add to running sums, passed as extra trailing arguments
      (their buffers are donated).
    - `scale`: input variable -> factor applied on entry (e.g. 1/microbatches for
      accumulated gradients).
    - `output_specs`: output variable -> spec overriding the plan's.
    - `stacked`: variable -> mesh axes, for values kept as a stack of unreduced partial sums
      (see `autopar.inter.passes._deferred`): a new leading dimension split over those axes, one
      partial sum per device. Nodes producing them run per device (`shard_map`) or per
      slice (`vmap`); a stacked input is summed on entry (the deferred reduction).

    **Returns:** `(fn, in_shardings, out_shardings)`; `fn(*inputs, *sums) -> outputs`.
    """
    run, in_shardings, out_shardings, sum_shardings = segment_body(
        graph, plan, nodes, inputs, outputs, mesh, accumulate=accumulate, scale=scale,
        output_specs=output_specs, stacked=stacked,
    )
    donate = tuple(range(len(inputs), len(inputs) + len(sum_shardings)))
    fn = jax.jit(
        run,
        in_shardings=in_shardings + sum_shardings,
        out_shardings=out_shardings,
        donate_argnums=donate,
    )
    return fn, in_shardings, out_shardings


def segment_body(
    graph: OpGraph,
    plan,
    nodes: Sequence[int],
    inputs: Sequence[int],
    outputs: Sequence[int],
    mesh: Mesh,
    *,
    accumulate: Sequence[int] = (),
    scale: dict[int, float] | None = None,
    output_specs: dict | None = None,
    stacked: Mapping[int, tuple[str, ...]] | None = None,
    constrain: bool = False,
):
    """The traceable function `lower_segment` jits, for composing several segments into
    one program (a one-stage pipeline's whole step, `autopar.runtime._fused`). Arguments
    as `lower_segment`'s; with `constrain`, every input and result is pinned to its
    sharding by `with_sharding_constraint` (what `jax.jit`'s in/out shardings do for a
    segment run on its own).

    **Returns:** `(run, in_shardings, out_shardings, sum_shardings)`;
    `run(*inputs, *sums) -> outputs`.
    """
    scale = scale or {}
    output_specs = output_specs or {}
    stacked = dict(stacked or {})
    on_input, on_output = constraint_hooks(plan, mesh)
    graph = with_expert_dispatch(with_scan_bodies(graph, plan, mesh), plan, mesh)
    node_list = [graph.nodes[i] for i in nodes]
    if ring_axes(plan):  # the segment's attention by the ring kernel
        node_list = with_ring(replace(graph, nodes=node_list, invars=tuple(inputs),
                                      outvars=tuple(outputs)), plan, plan, mesh).nodes
    accumulate = [v for v in outputs if v in set(accumulate)]
    sharding = _sharding_of(graph, plan, mesh, stacked)
    in_shardings = [sharding(v) for v in inputs]
    out_shardings = [sharding(v, output_specs.get(v)) for v in outputs]
    sum_shardings = [sharding(v) for v in accumulate]
    num_inputs = len(inputs)

    def run(*args):
        env = {}
        if constrain:
            args = [
                jax.lax.with_sharding_constraint(x, sh)
                for x, sh in zip(args, in_shardings + sum_shardings)
            ]
        for v, x in zip(inputs, args[:num_inputs]):
            if v in stacked:  # the deferred reduction of partial sums
                x = jax.lax.with_sharding_constraint(x.sum(axis=0), sharding(v, stack=False))
            env[v] = x * np.asarray(scale[v], x.dtype) if v in scale else x
        _run_nodes(graph, plan, mesh, node_list, env, stacked, sharding, on_input, on_output)
        sums = dict(zip(accumulate, args[num_inputs:]))
        outs = [env[v] + sums[v] if v in sums else env[v] for v in outputs]
        if constrain:
            outs = [jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(outs, out_shardings)]
        return outs

    return run, in_shardings, out_shardings, sum_shardings


def _sharding_of(graph: OpGraph, plan, mesh: Mesh, stacked: Mapping[int, tuple[str, ...]]):
    """`sharding(v, spec=None, stack=True)`: the `NamedSharding` of `v` at `spec` (None:
    the plan's; replicated where it has none), as its stack of partial sums when `v` is
    stacked (unless `stack` is False)."""

    def sharding(v, spec=None, stack=True):
        spec = plan.var_specs[v] if spec is None else spec
        if spec is None:
            spec = replicated(len(graph.vars[v].shape))
        if stack and v in stacked:
            spec = stack_spec(spec, stacked[v])
        return NamedSharding(mesh, to_partition_spec(spec))

    return sharding


def _run_nodes(graph: OpGraph, plan, mesh: Mesh, node_list, env: dict, stacked, sharding,
               on_input, on_output) -> None:
    """Run `node_list` into `env`: a node making a stacked value per device or per slice
    (`_run_stacked`); a stack read by a node that needs its sum reduced first."""
    for node in node_list:
        if any(v in stacked for v in node.outputs):
            _run_stacked(graph, plan, mesh, node, env, stacked, sharding)
            continue
        for v in node.inputs:
            if v in stacked and v in env and env[v].ndim > len(graph.vars[v].shape):
                # A stack read by an op that needs the sum: reduce it here.
                env[v] = jax.lax.with_sharding_constraint(
                    env[v].sum(axis=0), sharding(v, stack=False)
                )
        graph.run_nodes(env, [node], on_input, on_output)




def stack_spec(spec, axes: tuple[str, ...]):
    """The spec of a stack of partial sums over `axes` whose sum has layout `spec`: a new
    leading dimension split over `axes`, the other dimensions as in `spec` without them."""
    return ((*axes,), *(tuple(a for a in dim if a not in axes) for dim in spec))


def _run_stacked(graph: OpGraph, plan, mesh: Mesh, node, env: dict, stacked, sharding) -> None:
    """Run `node`, whose result is a stack of partial sums.

    A partial-sum producer runs per device (`shard_map`): each device applies the operation
    to its own shards, and its result is its slice of the stack. A linear op on stacks runs
    per slice (`vmap`). Either way nothing is communicated.
    """
    from autopar.inter import operand_spec

    (out,) = node.outputs
    ins = [
        graph.vars[v].value if graph.vars[v].role is Role.CONST else env[v] for v in node.inputs
    ]

    def local(*xs):
        return node.prim.bind(*xs, **node.params)

    if all(v in stacked for v in node.inputs if graph.vars[v].role is not Role.CONST) and any(
        v in stacked for v in node.inputs
    ):
        axes = [0 if v in stacked else None for v in node.inputs]
        result = jax.vmap(local, in_axes=axes)(*ins)
    else:
        in_specs = tuple(
            PartitionSpec() if graph.vars[v].role is Role.CONST
            else to_partition_spec(operand_spec(graph, plan, node.id, p))
            for p, v in enumerate(node.inputs)
        )
        out_spec = sharding(out).spec
        result = jax.shard_map(
            lambda *xs: local(*xs)[None], mesh=mesh, in_specs=in_specs, out_specs=out_spec,
            check_vma=False,
        )(*ins)
    env[out] = jax.lax.with_sharding_constraint(result, sharding(out))
