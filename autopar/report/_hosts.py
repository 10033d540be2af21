"""Which matmul weights a plan splits across hosts (tensor parallelism over slow links).

Tensor parallelism sends activations through collectives inside every layer, so Megatron-LM
keeps it inside a host's fast interconnect (Narayanan et al. 2021; REFERENCES.md,
"Megatron-LM plans"). A plan that splits a weight, as the matmul reads it, along a mesh
axis whose devices sit on different hosts pays inter-host bandwidth for it. Weights stored
split but gathered before the matmul (ZeRO-3 style) are not tensor parallelism and are not
reported.
"""

from __future__ import annotations

import numpy as np

from autopar.graph import OpGraph, Role
from autopar.inter import assign_layers, partition

# Ops through which a matmul still reads its weight whole, slice for slice.
_PASS_THROUGH = frozenset({"convert_element_type", "transpose", "reshape", "copy"})


def axes_across_hosts(mesh, devices_per_host: int) -> set[str]:
    """The mesh axes along which neighbouring devices sit on different hosts.

    **Arguments:**
    - `mesh`: a `LogicalMesh` (device ids are cluster device ids).
    - `devices_per_host`: the cluster's devices per host.
    """
    hosts = np.array(mesh.device_ids).reshape(mesh.shape) // devices_per_host
    crossing = set()
    for axis, name in enumerate(mesh.axis_names):
        if mesh.shape[axis] > 1 and np.any(np.diff(hosts, axis=axis) != 0):
            crossing.add(name)
    return crossing


def matmul_weight_splits(plan, graph: OpGraph) -> list[tuple[int, str, tuple[str, ...]]]:
    """The mesh axes each matmul weight is split over where the matmul reads it.

    **Arguments:**
    - `plan`: a `Plan`; `graph`: the graph it runs (`autopar.search.graph_for_plan`: one
      microbatch of the step for a pipelined plan).

    **Returns:** ``(stage, weight path, axes)`` for every matmul operand that is a weight
    (or a converted, transposed or reshaped view of one); ``axes`` is empty when the
    matmul reads the weight whole.
    """
    if plan.runtime == "pipeline":
        layers = assign_layers(graph)
        part = partition(graph, layers, [stage.layers for stage in plan.stages])
        graphs = part.stage_graphs
    else:
        graphs = [graph]
    found = []
    for s, (stage, sub) in enumerate(zip(plan.stages, graphs)):
        sharding = stage.sharding
        operand_specs = {(n, p): spec for n, p, spec in sharding.operand_specs}
        producer = {v: n for n in sub.nodes for v in n.outputs}
        for node in sub.nodes:
            if node.primitive != "dot_general":
                continue
            for p, v in enumerate(node.inputs):
                weight = _weight_behind(sub, producer, v)
                if weight is None:
                    continue
                spec = operand_specs.get((node.id, p)) or sharding.var_specs[v] or ()
                axes = tuple(dict.fromkeys(a for dim in spec for a in dim))
                found.append((s, sub.vars[weight].path or f"input {weight}", axes))
    return found


def weights_split_across_hosts(plan, graph: OpGraph, devices_per_host: int) -> list[str]:
    """Matmul weights that `plan` splits, where the matmul reads them, along a mesh axis
    spanning hosts.

    **Arguments:**
    - `plan`, `graph`: as `matmul_weight_splits`.
    - `devices_per_host`: the cluster's devices per host.

    **Returns:** lines ``"stage S: PATH split on AXIS"``, empty when no weight is.
    """
    crossing = [axes_across_hosts(st.mesh, devices_per_host) for st in plan.stages]
    found = []
    for s, path, axes in matmul_weight_splits(plan, graph):
        across = [a for a in axes if a in crossing[s]]
        if across:
            found.append(f"stage {s}: {path} split on {', '.join(across)}")
    return list(dict.fromkeys(found))


def _weight_behind(graph: OpGraph, producer, v: int) -> int | None:
    """The parameter `v` is (or is a converted/transposed/reshaped view of), else None."""
    while True:
        var = graph.vars[v]
        if var.role is Role.PARAM and len(var.shape) >= 2:
            return v
        node = producer.get(v)
        if node is None or node.primitive not in _PASS_THROUGH or len(node.inputs) != 1:
            return None
        v = node.inputs[0]
