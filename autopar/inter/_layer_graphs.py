"""What identifies a layer's graph, and the ties that reach into it.

In: a layer's `OpGraph` (cut out of the whole step: it keeps the step's variable ids) and
the step's tied (output, input) state pairs. Out: `structural_fingerprint`, equal for
layers of the same structure (their ILPs are solved once), and `_tied_in`, the pairs whose
output the layer makes and whose input it reads.
"""

from __future__ import annotations

import hashlib

from autopar._memo import per_graph
from autopar.graph import OpGraph, Role
from autopar.graph._collector import collector_paused
from autopar.graph._jaxpr_text import params_text


@per_graph("inter.structural_fingerprints", "graph -> its structural fingerprint")
@collector_paused()  # see `autopar.graph._collector`
def structural_fingerprint(graph: OpGraph) -> str:
    """A hash of a sub-graph up to renaming of its variables; once per graph (every
    `LayerCostTable` of one step's per-layer partition, one per configuration of the
    Megatron grid, asks about the same layer sub-graphs)."""
    names: dict[int, int] = {}

    def name(v: int) -> str:
        var = graph.vars[v]
        if var.role is Role.CONST:
            return f"c{var.shape}{var.dtype}"
        if v not in names:
            names[v] = len(names)
        return f"v{names[v]}"

    h = hashlib.sha256()
    for v in graph.invars:
        var = graph.vars[v]
        h.update(f"{name(v)}:{var.shape}{var.dtype}{var.role.value};".encode())
    for node in graph.nodes:
        ins = ",".join(name(v) for v in node.inputs)
        outs = ",".join(f"{name(v)}{graph.vars[v].shape}" for v in node.outputs)
        params = params_text(node.params)  # sorted(map(str, node.params.items()))
        h.update(f"{node.primitive}{params}({ins})->{outs};".encode())
    h.update(",".join(name(v) for v in graph.outvars).encode())
    return h.hexdigest()


def _tied_in(graph: OpGraph, tied) -> list[tuple[int, int]]:
    produced = {v for n in graph.nodes for v in n.outputs}
    invars = set(graph.invars)
    return [(o, i) for o, i in tied if o in produced and i in invars]
