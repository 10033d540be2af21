"""Issue 14, "Predictions you can trust": the cost model against hand computation on the
DGX profiles: dot precision, collectives over NIC rails, GEMM efficiency by shape, fusion."""

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import rate_dtype
from autopar.graph import trace
from autopar.intra._strategies import CostContext, node_signature, node_strategies

GiB = 2**30


@pytest.fixture(scope="module")
def a100():
    return Cluster.from_profile("dgx-a100-80g")


def _replicated(graph, node, cluster):
    """The replicated strategy of `node` on one device of `cluster`."""
    ctx = CostContext(cluster, LogicalMesh.create((1,), axis_names=("x",)))
    return node_strategies(node, graph, node_signature(node, graph), ctx)[0]


def _dots(graph):
    return [n for n in graph.nodes if n.primitive == "dot_general"]


# ---- 1. dot precision -----------------------------------------------------------------


def test_rate_dtype_from_operands():
    assert rate_dtype("dot_general", ["bfloat16", "bfloat16"], "float32") == "bfloat16"
    assert rate_dtype("dot_general", ["bfloat16", "float32"], "float32") == "float32"
    assert rate_dtype("conv_general_dilated", ["float16", "float16"], "float32") == "float16"
    assert rate_dtype("add", ["bfloat16", "bfloat16"], "float32") == "float32"


def test_bf16_dot_with_f32_accumulation_costs_bf16_rate(a100):
    n = 4096
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)

    def f(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    graph = trace(f, x, x)
    (dot,) = _dots(graph)
    assert graph.vars[dot.outputs[0]].dtype == "float32"
    # By hand: 2·4096³ FLOPs at the bf16 rate; the bytes (two bf16 operands, one f32
    # result: 2·4096²·2 + 4096²·4 = 134 MB, 67 us at 2 TB/s) do not bind.
    flops = 2 * n**3
    bf16_rate = a100.flops("bfloat16")
    assert _replicated(graph, dot, a100).compute_cost == pytest.approx(flops / bf16_rate)
    assert flops / a100.flops("float32") == pytest.approx(2 * flops / bf16_rate)
