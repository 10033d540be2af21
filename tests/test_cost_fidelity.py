"""Issue 14, "Predictions you can trust": the cost model against hand computation on the
DGX profiles: dot precision, collectives over NIC rails, GEMM efficiency by shape, fusion."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import (
    collective_time,
    compute_time,
    device_flops,
    fusion_boundary_bytes,
    gemm_efficiency,
    group_collective_latency,
    intra_link,
    kind_bandwidth_scale,
    network_link,
    rate_dtype,
)
from autopar.graph import fusion_kind, fusion_traffic, trace
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


def test_rate_dtype_of_typed_prng_keys_is_uint32():
    """NumPy rejects ``key<fry>``; a key's arithmetic runs on its uint32 key data."""
    key = jax.random.key(0)
    assert rate_dtype("random_split", [key.dtype], key.dtype) == "uint32"
    assert rate_dtype("random_bits", ["key<fry>"], "uint32") == "uint32"
    assert rate_dtype("dot_general", ["key<fry>", "float32"], "float32") == "uint32"


def test_typed_key_ops_get_costed_strategies(a100):
    """Every node of a step that splits a typed key gets a strategy (no TypeError)."""

    def step(key, x):
        k1, _ = jax.random.split(key)
        return x * jax.random.uniform(k1, x.shape)

    graph = trace(step, jax.random.key(0), jnp.ones((4, 4)))
    assert any("key<" in str(graph.vars[v].dtype) for v in graph.invars)
    for node in graph.nodes:
        assert _replicated(graph, node, a100).compute_cost >= 0


def test_bf16_dot_with_f32_accumulation_costs_bf16_rate(a100):
    n = 4096
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)

    def f(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    graph = trace(f, x, x)
    (dot,) = _dots(graph)
    assert graph.vars[dot.outputs[0]].dtype == "float32"
    # By hand: 2·4096³ FLOPs at the bf16 rate, 312 TFLOP/s x 0.8 (the profile's GEMM
    # efficiency at size 4096); the bytes (two bf16 operands, one f32 result:
    # 2·4096²·2 + 4096²·4 = 134 MB, 67 us at 2 TB/s) do not bind. 0.55 ms, where the f32
    # (TF32, 156 TFLOP/s) rate would give 1.1 ms.
    flops = 2 * n**3
    by_hand = flops / (312e12 * 0.8)
    assert _replicated(graph, dot, a100).compute_cost == pytest.approx(by_hand)


# ---- 2. collectives over NIC rails ------------------------------------------------------


def test_all_reduce_over_two_dgx_a100_hosts_is_hierarchical(a100):
    cluster = a100.with_shape(2, 8)
    mesh = LogicalMesh.create((16,), axis_names=("x",))
    # NCCL on 2 DGX A100 (8 GPUs each, one 25 GB/s HDR NIC per GPU), S = 1 GiB:
    #   reduce-scatter inside each host:  7/8 · 2**30 / 300e9  = 3.131 ms, 7 steps · 5 us
    #   all-reduce across the 2 hosts of S/8 per GPU, each GPU on its own rail:
    #                                     2·1/2 · 2**30/8 / 25e9 = 5.369 ms, 2 steps · 10 us
    #   all-gather inside each host:      7/8 · 2**30 / 300e9  = 3.131 ms, 7 steps · 5 us
    #   total 11.63 ms + 0.09 ms = 11.72 ms   (one ring at one NIC: 2·15/16·2**30/25e9 = 80.5 ms)
    by_hand = 2 * (7 / 8 * GiB / 300e9 + 7 * 5e-6) + (GiB / 8 / 25e9 + 2 * 10e-6)
    assert by_hand == pytest.approx(11.72e-3, rel=1e-3)
    predicted = collective_time("all_reduce", GiB, cluster, mesh, "x")
    assert predicted == pytest.approx(by_hand, rel=0.10)


def test_hierarchical_reduce_scatter_plus_all_gather_is_all_reduce(a100):
    cluster = a100.with_shape(4, 8)
    mesh = LogicalMesh.create((32,), axis_names=("x",))
    parts = sum(
        collective_time(k, GiB, cluster, mesh, "x") for k in ("reduce_scatter", "all_gather")
    )
    assert parts == pytest.approx(collective_time("all_reduce", GiB, cluster, mesh, "x"))


def test_dgx_h100_rails(a100):
    h100 = Cluster.from_profile("dgx-h100", num_hosts=2)
    mesh = LogicalMesh.create((16,), axis_names=("x",))
    # as above with NVLink 4 (450 GB/s) and NDR (50 GB/s per rail)
    by_hand = 2 * (7 / 8 * GiB / 450e9 + 7 * 5e-6) + (GiB / 8 / 50e9 + 2 * 10e-6)
    assert collective_time("all_reduce", GiB, h100, mesh, "x") == pytest.approx(by_hand)


def test_profile_without_rails_keeps_per_device_network(a100):
    """No `nics_per_host`: `inter_host.bandwidth` is each device's share, as before."""
    plain = dataclasses.replace(a100, nics_per_host=None).with_shape(8, 8)
    assert network_link(plain) == plain.inter_host
    mesh = LogicalMesh.create((8,), [host * 8 for host in range(8)], ("x",))
    expected = 2 * 7 / 8 * GiB / 25e9 + 2 * 7 * 10e-6
    assert collective_time("all_reduce", GiB, plain, mesh, "x") == pytest.approx(expected)


def test_one_nic_per_host_is_shared():
    """p3.16xlarge: one 3.125 GB/s NIC for 8 GPUs; the cross-host level of 2 hosts moves
    S/8 per GPU at 3.125/8 GB/s, i.e. S at 3.125 GB/s per host."""
    v100 = Cluster.from_profile("p3.16xlarge-v100", num_hosts=2)
    mesh = LogicalMesh.create((16,), axis_names=("x",))
    by_hand = 2 * (7 / 8 * GiB / 150e9 + 7 * 5e-6) + (GiB / 8 / (3.125e9 / 8) + 2 * 50e-6)
    assert collective_time("all_reduce", GiB, v100, mesh, "x") == pytest.approx(by_hand)


def test_nics_per_host_round_trips_and_is_checked(a100, tmp_path):
    assert Cluster.from_json(a100.to_json()) == a100
    data = {**a100.to_json(), "nics_per_host": 0}
    with pytest.raises(ValueError, match="nics_per_host must be an integer >= 1"):
        Cluster.from_json(data)


# ---- 3. GEMM efficiency by size -----------------------------------------------------------


def test_gemm_efficiency_interpolates_the_profile_table(a100):
    # dgx-a100-80g.json: 1024 -> 0.45, 2048 -> 0.7, 8192 -> 0.82 (size = (M·N·K)^(1/3))
    assert gemm_efficiency(a100, 2 * 1024**3) == pytest.approx(0.45)
    assert gemm_efficiency(a100, 2 * 8192**3) == pytest.approx(0.82)
    assert gemm_efficiency(a100, 2 * 65536**3) == pytest.approx(0.82)  # held beyond the end
    between = 2 * (1024 * 2**0.5) ** 3  # halfway in log(size)
    assert gemm_efficiency(a100, between) == pytest.approx((0.45 + 0.7) / 2)
    # a skinny 4096 x 4096 x 64 GEMM counts as size 1024
    assert gemm_efficiency(a100, 2 * 4096 * 4096 * 64) == pytest.approx(0.45)


def test_small_gemms_far_below_peak_large_ones_near_it(a100):
    def seconds(n):
        return compute_time(2 * n**3, 0, a100, "bfloat16", matmul=True)

    assert seconds(256) == pytest.approx(2 * 256**3 / (312e12 * 0.06))
    assert seconds(8192) == pytest.approx(2 * 8192**3 / (312e12 * 0.82))
    # elementwise FLOPs keep the flat matmul_efficiency
    assert compute_time(1e12, 0, a100, "bfloat16") == pytest.approx(1e12 / (312e12 * 0.7))


def test_without_table_every_gemm_at_matmul_efficiency(a100):
    flat = dataclasses.replace(a100, gemm_efficiency=None)
    assert gemm_efficiency(flat, 2 * 256**3) == 0.7
    assert Cluster.from_json(a100.to_json()) == a100
    assert "gemm_efficiency" not in flat.to_json()
    with pytest.raises(ValueError, match="gemm_efficiency sizes must be > 0 and increasing"):
        Cluster.from_json({**a100.to_json(), "gemm_efficiency": [[512, 0.5], [256, 0.2]]})
    with pytest.raises(ValueError, match=r"gemm_efficiency fractions must be in \(0, 1\]"):
        Cluster.from_json({**a100.to_json(), "gemm_efficiency": [[512, 1.5]]})


def test_profiler_fits_the_table_from_its_matmul_sizes():
    from autopar.profile._fit import gemm_table as _gemm_table

    measured = {"float32": {256: 1e9, 512: 2e9, 1024: 4e9}, "bfloat16": {256: 1e9, 512: 1e9}}
    # sizes both dtypes measured; float32 at 1/4 and 2/4 of its best, bfloat16 at 1 and 1
    assert _gemm_table(measured) == ((256.0, 0.625), (512.0, 0.75))
    assert _gemm_table({"float32": {256: 1e9}}) is None


def _k_grid(small: float, large: float):
    """A `gemm_shapes` grid over sizes 64 and 4096 whose fraction depends on K only."""
    return tuple((m, n, k, small if k == 64 else large)
                 for m in (64, 4096) for n in (64, 4096) for k in (64, 4096))


def test_gemm_efficiency_by_shape_from_the_profile_grid(a100):
    from autopar.cost import shape_efficiency

    table = _k_grid(0.2, 0.8)
    assert shape_efficiency(table, (4096, 4096, 64)) == pytest.approx(0.2)
    assert shape_efficiency(table, (4096, 4096, 512)) == pytest.approx(0.5)  # halfway in log
    assert shape_efficiency(table, (10**6, 8, 10**6)) == pytest.approx(0.8)  # clamped
    shaped = dataclasses.replace(a100, gemm_shapes=table)
    # a 4096 x 4096 x 64 GEMM: by size (1024) 0.45 on dgx-a100-80g, by shape 0.2
    flops = 2 * 4096 * 4096 * 64
    assert gemm_efficiency(shaped, flops) == pytest.approx(0.45)  # shape unknown
    assert gemm_efficiency(shaped, flops, (4096, 4096, 64)) == pytest.approx(0.2)
    assert Cluster.from_json(shaped.to_json()) == shaped


def test_dot_strategies_use_their_shape_per_device(a100):
    """The planner prices a dot by its (M, N, K) per device: x[4096, 64] @ w[64, 4096]
    on one device runs at the grid's K=64 fraction; batch dimensions count in M."""
    shaped = dataclasses.replace(a100, gemm_shapes=_k_grid(0.2, 0.8))
    bf16 = jnp.bfloat16
    graph = trace(lambda x, w: x @ w, jax.ShapeDtypeStruct((4096, 64), bf16),
                  jax.ShapeDtypeStruct((64, 4096), bf16))
    (dot,) = _dots(graph)
    flops = 2 * 4096 * 4096 * 64
    # compute-bound: 2.1 GFLOP at 0.2 of 312 TFLOP/s is 34 us, its 33 MiB of bytes 17 us
    assert _replicated(graph, dot, shaped).compute_cost == pytest.approx(
        flops / (312e12 * 0.2))
    graph = trace(lambda x, w: jnp.einsum("bmk,bkn->bmn", x, w),
                  jax.ShapeDtypeStruct((16, 256, 4096), bf16),
                  jax.ShapeDtypeStruct((16, 4096, 4096), bf16))
    (dot,) = _dots(graph)  # M = 16 x 256 = 4096, N = K = 4096: the grid's 0.8
    assert _replicated(graph, dot, shaped).compute_cost == pytest.approx(
        2 * 16 * 256 * 4096 * 4096 / (312e12 * 0.8))


def test_gemm_shapes_must_be_a_full_grid(a100):
    table = [list(row) for row in _k_grid(0.2, 0.8)]
    with pytest.raises(ValueError, match="gemm_shapes must hold every combination"):
        Cluster.from_json({**a100.to_json(), "gemm_shapes": table[:-1]})
    table[0][3] = 1.5
    with pytest.raises(ValueError, match=r"gemm_shapes fractions must be in \(0, 1\]"):
        Cluster.from_json({**a100.to_json(), "gemm_shapes": table})
    with pytest.raises(ValueError, match="rows of 4 numbers"):
        Cluster.from_json({**a100.to_json(), "gemm_shapes": [[64, 64, 0.5]]})


# ---- 4. fusion-aware compute ---------------------------------------------------------------


def _gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def test_dot_bias_gelu_costs_the_dot_plus_one_pass(a100):
    m, k, n = 8192, 1024, 4096
    bf16 = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct((k, n), bf16),
            jax.ShapeDtypeStruct((n,), bf16))
    graph = trace(lambda x, w, b: _gelu(x @ w + b), *args)
    assert len(graph.nodes) > 8  # the dot, the bias broadcast and add, the GELU's ops
    total = sum(_replicated(graph, node, a100).compute_cost for node in graph.nodes)
    out_bytes = m * n * 2
    # By hand: the dot reads x and w and would write its output (roofline, compute-bound:
    # 2·8192·4096·1024 / (312e12 · 0.8) = 275 us); one more pass over the output (64 MiB at
    # 2 TB/s = 34 us) is the most the bias and GELU may add in bytes, with the bias vector
    # read once, plus their own FLOPs (about 12 ops x 33.5 M, 2 us).
    dot_alone = compute_time(2 * m * n * k, (m * k + k * n) * 2 + out_bytes, a100, bf16,
                             matmul=True)
    elementwise_flops = sum(nd.flops for nd in graph.nodes if nd.primitive != "dot_general")
    one_pass = (out_bytes + n * 2) / a100.hbm_bandwidth
    assert total <= dot_alone + one_pass + elementwise_flops / device_flops(a100, bf16)
    # Unfused, every one of the ~12 elementwise ops would read and write the output.
    unfused_passes = sum(
        node.primitive != "dot_general" for node in graph.nodes
    ) * 2 * out_bytes / a100.hbm_bandwidth
    assert total < dot_alone + unfused_passes / 4


def test_fusion_traffic_of_dot_bias_gelu():
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    b = jax.ShapeDtypeStruct((16,), jnp.float32)
    graph = trace(lambda x, w, b: _gelu(x @ w + b), x, w, b)
    traffic = fusion_traffic(graph)
    (dot,) = _dots(graph)
    assert traffic.reads[dot.id] == (True, True) and traffic.writes[dot.id] == (False,)
    written = [n.primitive for n in graph.nodes if any(traffic.writes[n.id])]
    assert written == [graph.nodes[-1].primitive]  # only the GELU's last op writes


def test_values_read_after_a_reduction_or_by_the_backward_are_written():
    # x - mean(x): the reduction sits between the producer of x and the subtraction
    graph = trace(lambda a: (a * 2) - jnp.mean(a * 2, axis=-1, keepdims=True),
                  jax.ShapeDtypeStruct((8, 128), jnp.float32), batch_argnums=())
    traffic = fusion_traffic(graph)
    doubled = [n for n in graph.nodes if n.primitive == "mul"]
    assert any(traffic.writes[n.id] == (True,) for n in doubled)
    # the backward of tanh(x @ w) reads the forward's tanh output after a dot
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) @ w.T)

    graph = trace(jax.grad(loss), jax.ShapeDtypeStruct((16, 16), jnp.float32),
                  jax.ShapeDtypeStruct((4, 16), jnp.float32))
    traffic = fusion_traffic(graph)
    (tanh,) = [n for n in graph.nodes if n.primitive == "tanh"]
    assert traffic.writes[tanh.id] == (True,)


def test_fusion_kinds_registry():
    assert fusion_kind("dot_general") == "matmul"
    assert fusion_kind("reduce_sum") == "reduce"
    assert fusion_kind("scan") == "kernel"
    assert fusion_kind("some_new_elementwise_op") == "elementwise"  # the default


def test_kernel_roots_count_the_kernels_xla_runs():
    from autopar.graph import kernel_roots

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    b = jax.ShapeDtypeStruct((32,), jnp.float32)
    # bias add and tanh run in the dot's epilogue: one kernel, rooted at the tanh
    graph = trace(lambda x, w, b: jnp.tanh(x @ w + b), x, w, b)
    assert [graph.nodes[i].primitive for i in kernel_roots(graph)] == ["tanh"]
    # two chained dots: two kernels
    graph = trace(lambda x, w: (x @ w) @ w, x, w)
    assert len(kernel_roots(graph)) == 2
    # an elementwise chain into a reduction: one input fusion
    graph = trace(lambda x: jnp.sum(jnp.exp(x) * 2.0), x, batch_argnums=())
    assert len(kernel_roots(graph)) == 1


def test_kernel_overhead_charged_once_per_kernel(a100):
    from autopar.cost import kernel_launch_time
    from autopar.graph import kernel_roots

    cluster = dataclasses.replace(a100, kernel_overhead=5e-6)
    assert kernel_launch_time(cluster, 2000) == pytest.approx(0.01)
    assert kernel_launch_time(a100, 2000) == 0.0  # built-in profiles: not measured
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    graph = trace(lambda x, w: jnp.tanh((x @ w) @ w), x, w)
    roots = kernel_roots(graph)
    extra = [_replicated(graph, n, cluster).compute_cost
             - _replicated(graph, n, a100).compute_cost
             for n in graph.nodes]
    assert sum(extra) == pytest.approx(len(roots) * 5e-6)
    assert all(e == pytest.approx(5e-6 if n.id in roots else 0.0)
               for n, e in zip(graph.nodes, extra))


def test_exposed_time_by_hand():
    """A fraction `overlap` of the hideable collectives is hidden, never more than the
    compute they run under."""
    from autopar.cost import exposed_time, hideable_weight

    ms = 1e-3
    assert exposed_time(40 * ms, [6 * ms, 4 * ms], 0.9) == pytest.approx(1 * ms)  # 10 - 9
    assert exposed_time(5 * ms, 10 * ms, 0.9) == pytest.approx(5 * ms)  # 10 - min(9, 5)
    assert exposed_time(40 * ms, 10 * ms, 0.0) == pytest.approx(10 * ms)
    assert hideable_weight(0.8) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="overlap must be in"):
        exposed_time(1.0, 1.0, 1.5)


def test_profile_overlap_hides_the_gradient_reduction_in_the_ilp(a100):
    """The deferred gradient reduction of a layer weighs 1 - overlap of its time in the ILP
    (the same LayerCostTable serves method="auto" and the Megatron scorer); its count stays
    whole for the check against compiled HLO."""
    import optax

    from autopar.graph import tied_state
    from autopar.inter import LayerCostTable, assign_layers
    from autopar.intra._options import ShardOptions
    from examples import gpt

    cfg = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)
    opt = optax.sgd(1e-2)
    graph = trace(gpt.make_train_step(cfg, opt), gpt.abstract_state(cfg, opt),
                  gpt.abstract_batch(cfg, 8), batch_argnums=(1,))
    layers = assign_layers(graph)
    tables = {
        overlap: LayerCostTable(graph, layers, dataclasses.replace(a100, overlap=overlap),
                                ShardOptions(), tied_state(graph, (0,)))
        for overlap in (0.0, 0.75)
    }
    for k in range(layers.num_layers):
        serial, hidden = tables[0.0].weights[k], tables[0.75].weights[k]
        assert serial.keys() == hidden.keys()
        for node, weight in serial.items():
            if len(hidden[node]) == 3:  # a deferred reduction
                assert hidden[node] == (*weight, pytest.approx(0.25))
    assert any(len(w) == 3 for table in tables[0.75].weights for w in table.values())


def test_scan_markers_end_fusions():
    """A loop body is its own computation: what enters a scan's body is read from memory
    and what leaves it is written, and the markers themselves move nothing."""
    from autopar.intra._scan import expand_scans

    def step(ws, x):
        def body(h, w):
            return jnp.tanh(h * w), None

        return jax.lax.scan(body, x, ws)[0]

    graph = trace(step, jnp.ones((3, 4)), jnp.ones((4,)))
    planning = expand_scans(graph, {}, ()).graph
    traffic = fusion_traffic(planning)
    markers = [n for n in planning.nodes if n.primitive.startswith("scan_")]
    assert markers
    for node in markers:
        assert not any(traffic.reads[node.id]) and not any(traffic.writes[node.id])
    mul = next(n for n in planning.nodes if n.primitive == "mul")
    tanh = next(n for n in planning.nodes if n.primitive == "tanh")
    assert all(traffic.reads[mul.id])  # carry and weight slice come from memory
    assert all(traffic.writes[tanh.id])  # the new carry leaves the body


# The llama case in the extended tier (CI time): the option is the same code path in both
# examples, and the default tier traces a mixed-precision GPT twice more below.
@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.extended)])
def test_mixed_precision_option_keeps_fp32_master_state_and_computes_in_bf16(model):
    """``master_dtype="float32"``: 12 bytes of persistent state per parameter (fp32 weights
    and AdamW moments) and every matmul on bf16 operands."""
    import math

    import optax

    from examples import gpt, llama

    module = {"gpt": gpt, "llama": llama}[model]
    small = {"gpt": "tiny", "llama": "tiny"}[model]
    cfg = dataclasses.replace(module.CONFIGS[small], dtype="bfloat16", master_dtype="float32")
    opt = optax.adamw(1e-3)
    state = module.abstract_state(cfg, opt)
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(state.params))
    state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert 12 * num_params <= state_bytes <= 12 * num_params + 64  # + the step count
    graph = trace(module.make_train_step(cfg, opt), state, module.abstract_batch(cfg, 2),
                  batch_argnums=(1,))
    for dot in _dots(graph):
        assert {str(graph.vars[v].dtype) for v in dot.inputs} == {"bfloat16"}, dot


# ---- pipelines of mixed-precision steps (validation against published runs) -----------


def _medium_gpt_graph(master: bool, num_microbatches: int = 2, hidden: int = 512,
                      num_layers: int = 2):
    """A GPT small enough to plan in seconds, with matmuls large enough to be GEMMs."""
    import optax

    from autopar.search import microbatch_args
    from examples import gpt

    cfg = gpt.GPTConfig(1024, 256, hidden, num_layers, 8, dtype="bfloat16",
                        master_dtype="float32" if master else None, layer_markers=True)
    opt = optax.adamw(1e-4)
    args = (gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, 4 * num_microbatches))
    return trace(gpt.make_train_step(cfg, opt), *microbatch_args(args, (1,), num_microbatches),
                 batch_argnums=(1,))


@pytest.fixture(scope="module")
def mixed_graph():
    return _medium_gpt_graph(master=True)


def test_mixed_precision_casts_run_in_the_layer_that_uses_them(mixed_graph):
    """``params = tree_map(astype(bf16), params)`` at the top of the loss casts every
    weight before the first layer in program order; each cast belongs to the layer that
    reads the weight (and the gradient's cast back to f32 to the layer computing it), so
    no stage ships bf16 weights or gradients to another once per microbatch."""
    from autopar.graph import Role
    from autopar.inter import assign_layers

    graph = mixed_graph
    layers = assign_layers(graph)
    producer = {v: n for n in graph.nodes for v in n.outputs}
    readers = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers.setdefault(v, []).append(node)
    boundary = graph.nodes[layers.grad_boundary]
    casts = grads = 0
    for node in graph.nodes:
        if node.primitive != "convert_element_type" or layers.layer[node.id] is None:
            continue
        (v,), (out,) = node.inputs, node.outputs
        if graph.vars[v].role is Role.PARAM:  # forward cast of a master weight
            used_by = {layers.layer[r.id] for r in readers[out]}
            assert layers.layer[node.id] == min(used_by), graph.vars[v].path
            casts += 1
        elif out in boundary.inputs[1:] and v in producer:  # gradient back to f32
            assert layers.layer[node.id] == layers.layer[producer[v].id]
            grads += 1
    assert casts >= 2 * 12 and grads >= 2 * 12  # every weight of the 2 blocks


def _stage_param_bytes(plan, stage: int, itemsize: int) -> float:
    """Elements per device of the parameters `stage` holds, times `itemsize`."""
    import math

    mesh = plan.stages[stage].sharding.mesh
    total = 0.0
    for info in plan.inputs:
        if info.role != "param" or info.stage != stage:
            continue
        split = math.prod(mesh.axis_size(dim) for dim in info.spec if dim)
        total += math.prod(info.shape) / split * itemsize
    return total


@pytest.mark.extended  # 40 s of planning; the default-tier twin is the test above
def test_mixed_precision_pipeline_stage_costs_its_casts_only(a100):
    """A Megatron pipeline of a mixed-precision step costs, per stage and microbatch, what
    the same step in bf16 costs plus its casts (by hand: each weight read in f32 and
    written in bf16 forward, its gradient read in bf16 and written in f32 backward, 12
    bytes per parameter per device at HBM bandwidth), not the shipping of other layers'
    weights from the first stage. (The last stage is left out: it reads the tied
    embedding, whose one cast runs in the first stage that reads it.)"""
    from autopar.manual import MegatronConfig, megatron_plan_for_graph

    cluster = Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    config = MegatronConfig(dp=2, tp=2, pp=2, num_microbatches=2)
    plans = {master: megatron_plan_for_graph(_medium_gpt_graph(master), cluster, config)
             for master in (False, True)}
    mixed = plans[True]
    for s, (plain, cast) in enumerate(zip(plans[False].stages[:-1], mixed.stages)):
        hand = 3 * _stage_param_bytes(mixed, s, 4) / cluster.hbm_bandwidth
        extra = cast.time_per_microbatch - plain.time_per_microbatch
        assert 0 <= extra <= 1.5 * hand, (s, extra, hand)


def test_recompute_of_a_row_parallel_dot_costs_its_forward_per_device(a100):
    """Full recompute reruns a row-parallel dot (contraction split over "model", the
    output a partial sum, whole on "model") at its forward cost per device: its FLOPs over
    all 8 devices at the bf16 GEMM rate, plus its all-reduce. (Dividing by the output's
    split alone, 2, would charge 4x the FLOPs.)"""
    from autopar.cluster import replicated
    from autopar.inter._layer_pricing import rerun_seconds
    from autopar.intra._sharding_plan import PredictedCost, ShardingPlan

    def f(x, w):
        return jnp.einsum("bsk,kn->bsn", x, w, preferred_element_type=jnp.float32)

    x = jax.ShapeDtypeStruct((8, 512, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
    graph = trace(f, x, w, batch_argnums=())
    (dot,) = _dots(graph)
    mesh = LogicalMesh.create((2, 4), axis_names=("data", "model"))
    ctx = CostContext(a100, mesh)
    row = next(
        s for s in node_strategies(dot, graph, node_signature(dot, graph), ctx)
        if s.in_specs == ((("data",), (), ("model",)), (("model",), ()))
        and s.out_specs == ((("data",), (), ()),)
    )
    specs = [replicated(len(v.shape)) for v in graph.vars]
    specs[dot.inputs[0]], specs[dot.inputs[1]] = row.in_specs
    specs[dot.outputs[0]] = row.out_specs[0]
    plan = ShardingPlan(mesh, tuple(specs), tuple(
        row.name if n.id == dot.id else "replicated" for n in graph.nodes
    ), (), PredictedCost(0.0, 0.0, 0.0, 0.0), "")
    flops = 2 * 8 * 512 * 4096 * 1024 / 8  # per device: split 2 x 4
    hand = flops / (312e12 * gemm_efficiency(a100, flops))
    allreduce = collective_time("all_reduce", 8 * 512 * 1024 * 4 / 2, a100, mesh, "model")
    assert rerun_seconds(graph, plan, [dot.id], a100) == pytest.approx(hand + allreduce,
                                                                        rel=0.05)


def test_megatron_pins_the_residual_gradient_at_layer_edges(mixed_graph):
    """The gradient of the residual stream crosses each layer edge in the stream's layout
    (sequence-split under sequence parallelism), as Megatron's backward hands it on: the
    layer below must not take it whole and leave the gather to the stitched stage."""
    from autopar.manual import MegatronConfig
    from autopar.manual._sequence import forward_nodes, residual_specs

    graph = mixed_graph
    forward = forward_nodes(graph)
    marks = [n for n in graph.nodes
             if n.primitive == "layer_boundary" and n.id not in forward]
    assert marks
    for sp, spec in ((True, (("data",), ("model",), ())), (False, (("data",), (), ()))):
        specs = residual_specs(graph, MegatronConfig(dp=2, tp=2, sequence_parallel=sp))
        for mark in marks:
            for v in (*mark.inputs, *mark.outputs):
                assert specs[v] == spec


def test_fused_attention_keeps_the_scores_on_chip(a100):
    """With a profile's ``fused_attention``, hand-written attention moves only its
    inputs and output through device memory (q, k, v read once, the output written
    once, plus the softmax's per-row statistics), as a FlashAttention kernel does;
    without it, the sequence x sequence scores and probabilities cross device memory
    too."""
    from autopar.graph import attention_core

    def attention(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)

    qkv = jax.ShapeDtypeStruct((2, 4, 512, 64), jnp.bfloat16)
    graph = trace(attention, qkv, qkv, qkv, batch_argnums=())

    def hbm_bytes(fused):
        traffic = fusion_traffic(graph, fused_attention=fused)
        return sum(
            fusion_boundary_bytes([graph.vars[v].nbytes for v in n.inputs],
                                  [graph.vars[v].nbytes for v in n.outputs],
                                  traffic.reads[n.id], traffic.writes[n.id])
            for n in graph.nodes
        )

    tensor = 2 * 4 * 512 * 64 * 2
    stats = 2 * 4 * 512 * 4  # a softmax statistic per row in f32 (max, sum; Flash's lse)
    assert attention_core(graph)
    assert 4 * tensor <= hbm_bytes(True) <= 4 * tensor + 4 * stats
    assert hbm_bytes(False) >= 4 * tensor + 2 * (2 * 4 * 512 * 512 * 2)
    h100 = Cluster.from_profile("dgx-h100")
    assert h100.fused_attention and not a100.fused_attention
    assert Cluster.from_json(h100.to_json()).fused_attention


# ---- 5. combined collectives and in-place updates --------------------------------------


def test_combined_collective_pays_its_share_of_one_latency():
    """By hand on cpu-local-measured, 8 devices (ring: 14 latency steps, 2·7/8 of the bytes
    on the wire): 64 KiB pays the bandwidth in full and 64 KiB / 30 MiB of the latency."""
    from autopar.cost import COMBINE_THRESHOLD_BYTES, combined_collective_time

    # As XLA:GPU's combiner: one latency per merged collective (the profile's own
    # `combined_operand_latency` is XLA:CPU's, which pays per operand: the next test).
    cluster = dataclasses.replace(Cluster.from_profile("cpu-local-measured"),
                                  combined_operand_latency=0.0, collective_latency_by_group=None)
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    link = intra_link(cluster, 8, "all_reduce")  # the profile's all-reduce bandwidth
    nbytes = 64 * 1024
    wire = 2 * 7 / 8 * nbytes / link.bandwidth
    alone = collective_time("all_reduce", nbytes, cluster, mesh, "x")
    assert alone == pytest.approx(wire + 14 * link.latency)
    combined = combined_collective_time("all_reduce", nbytes, cluster, mesh, "x")
    assert combined == pytest.approx(wire + nbytes / COMBINE_THRESHOLD_BYTES * 14 * link.latency)
    # A collective of a whole bucket or more pays a whole latency; kinds XLA does not
    # combine (send_recv) pay as before.
    big = 64 * 2**20
    assert combined_collective_time("all_reduce", big, cluster, mesh, "x") == pytest.approx(
        collective_time("all_reduce", big, cluster, mesh, "x"))
    assert combined_collective_time("send_recv", nbytes, cluster, mesh, "x") == pytest.approx(
        collective_time("send_recv", nbytes, cluster, mesh, "x"))


def test_combined_collective_on_a_runtime_that_pays_per_operand():
    """`combined_operand_latency` s: each merged collective pays s + (1 - s) · its bucket
    share of its latency; at 1 (XLA:CPU, whose tuple all-reduce rendezvouses once per
    operand) exactly what it pays alone. By hand on cpu-local-measured, 8 devices."""
    from autopar.cost import COMBINE_THRESHOLD_BYTES, combined_collective_time

    base = replace_ring(Cluster.from_profile("cpu-local-measured"))
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    link = intra_link(base, 8, "all_reduce")
    nbytes = 64 * 1024
    wire = 2 * 7 / 8 * nbytes / link.bandwidth
    for share in (0.0, 0.5, 1.0):
        cluster = dataclasses.replace(base, combined_operand_latency=share)
        paid = share + (1 - share) * nbytes / COMBINE_THRESHOLD_BYTES
        assert combined_collective_time("all_reduce", nbytes, cluster, mesh, "x") == (
            pytest.approx(wire + paid * 14 * link.latency))
    per_operand = dataclasses.replace(base, combined_operand_latency=1.0)
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        assert combined_collective_time(kind, nbytes, per_operand, mesh, "x") == pytest.approx(
            collective_time(kind, nbytes, per_operand, mesh, "x"))
    with pytest.raises(ValueError, match=r"combined_operand_latency must be in \[0, 1\]"):
        dataclasses.replace(base, combined_operand_latency=1.5)
    # The measured profile keeps its figure through JSON; the GPU profiles leave it out.
    assert base.combined_operand_latency > 0.5
    assert Cluster.from_json(base.to_json()).combined_operand_latency == (
        base.combined_operand_latency)
    assert "combined_operand_latency" not in Cluster.from_profile("dgx-h100").to_json()


def test_collective_latency_measured_inside_programs_replaces_ring_steps():
    """With `collective_latency_by_group`, a collective inside a host pays the measured
    latency of its group size once, plus its bytes on the wire (ring volume over the
    link's bandwidth); a merged operand its `combined_operand_latency` share of it. By
    hand, 8 devices, 64 KiB."""
    from autopar.cost import combined_collective_time

    base = replace_ring(Cluster.from_profile("cpu-local-measured"))
    table = ((2, 60e-6), (4, 130e-6), (8, 275e-6))
    cluster = dataclasses.replace(base, collective_latency_by_group=table)
    nbytes = 64 * 1024
    for n, latency in table:
        mesh = LogicalMesh.create((8 // n, n), axis_names=("g", "x"))
        for kind, wire in (("all_reduce", 2 * (n - 1) / n * nbytes),
                           ("all_gather", (n - 1) / n * nbytes)):
            link = intra_link(cluster, n, kind)
            assert collective_time(kind, nbytes, cluster, mesh, "x") == pytest.approx(
                latency + wire / link.bandwidth)
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    half = dataclasses.replace(cluster, combined_operand_latency=0.5)
    wire = 2 * 7 / 8 * nbytes / intra_link(cluster, 8, "all_reduce").bandwidth
    assert combined_collective_time("all_reduce", nbytes, half, mesh, "x") == pytest.approx(
        0.5 * 275e-6 + 0.5 * nbytes / (30 * 2**20) * 275e-6 + wire)
    # the nearest measured group in log2; JSON keeps the table; bad tables are refused
    assert group_collective_latency(
        dataclasses.replace(cluster, collective_latency_by_group=((2, 1e-4), (8, 3e-4))), 4
    ) == 3e-4
    assert Cluster.from_json(cluster.to_json()).collective_latency_by_group == table
    with pytest.raises(ValueError, match="collective_latency_by_group needs distinct group"):
        dataclasses.replace(cluster, collective_latency_by_group=((1, 1e-4),))
    # without the table (the GPU profiles): ring steps times the link's latency
    assert group_collective_latency(base, 8) is None


def replace_ring(cluster: Cluster) -> Cluster:
    """`cluster` charging every collective its ring steps' latencies."""
    return dataclasses.replace(cluster, collective_latency_by_group=None)


def test_combined_bucket_count_by_hand():
    from autopar.cost import combined_bucket_count

    MiB = 2**20
    assert combined_bucket_count([]) == 0
    assert combined_bucket_count([20 * MiB, 20 * MiB, MiB]) == 2
    assert combined_bucket_count([40 * MiB, MiB]) == 2
    assert combined_bucket_count([1024] * 300) == 2  # at most 256 operands per bucket


def test_in_place_update_runs_at_the_in_place_bandwidth():
    """An elementwise node whose result is donated state costs its bytes at
    `inplace_bandwidth`; without the field (GPU profiles) at `hbm_bandwidth`."""
    from autopar.intra._strategies import step_effects

    def step(w, g):
        return w - 0.1 * g, jnp.sum(g * g)

    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    graph = trace(step, x, x)
    new_w = graph.outvars[0]
    tied = [(new_w, graph.invars[0])]
    effects = step_effects(graph, tied)
    update = graph.nodes[graph.vars[new_w].producer]
    assert update.id in effects.in_place
    reduce = next(n for n in graph.nodes if n.primitive == "reduce_sum")
    assert reduce.id not in effects.in_place
    # the bytes' rates alone: the profile's kernel_overhead, the same for both, left out
    cluster = dataclasses.replace(Cluster.from_profile("cpu-local-measured"), kernel_overhead=0.0)
    mesh = LogicalMesh.create((1,), axis_names=("x",))
    plain = CostContext(cluster, mesh)
    ctx = CostContext(cluster, mesh, effects.combinable, effects.in_place)
    sig = node_signature(update, graph)
    fresh = node_strategies(update, graph, sig, plain)[0].compute_cost
    in_place = node_strategies(update, graph, sig, ctx)[0].compute_cost
    assert fresh / in_place == pytest.approx(cluster.inplace_bandwidth / cluster.hbm_bandwidth)
    no_field = dataclasses.replace(cluster, inplace_bandwidth=None)
    ctx_gpu = CostContext(no_field, mesh, effects.combinable, effects.in_place)
    assert node_strategies(update, graph, sig, ctx_gpu)[0].compute_cost == pytest.approx(fresh)


def test_a_reduction_summed_again_before_the_update_is_combinable():
    """A partial sum that only further sums and elementwise work follow (a bias gradient
    summed over the batch, reshaped and summed again before the optimizer update) can
    wait for the step's combined reduction: XLA:CPU's HLO of a data-parallel GPT step has
    one all-reduce, none for the bias gradients alone. A reduction a matmul reads is not
    combinable."""
    from autopar.intra._strategies import step_effects

    def step(w, g, a):
        bias = jnp.sum(jnp.sum(g, axis=0).reshape(1, -1), axis=0)
        return w - 0.1 * bias, jnp.sum(g, axis=1) @ a

    g = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    graph = trace(step, jax.ShapeDtypeStruct((32,), jnp.float32), g,
                  jax.ShapeDtypeStruct((64, 8), jnp.float32))
    effects = step_effects(graph, [(graph.outvars[0], graph.invars[0])])
    sums = [n for n in graph.nodes if n.primitive == "reduce_sum"]
    first, second, into_dot = sums[0], sums[1], sums[2]
    assert first.id in effects.combinable and second.id in effects.combinable
    assert into_dot.id not in effects.combinable


def test_inplace_bandwidth_round_trips_and_is_checked():
    cluster = Cluster.from_profile("cpu-local-measured")
    assert Cluster.from_json(cluster.to_json()).inplace_bandwidth == cluster.inplace_bandwidth
    assert "inplace_bandwidth" not in Cluster.from_profile("dgx-a100-80g").to_json()
    with pytest.raises(ValueError, match="inplace_bandwidth"):
        dataclasses.replace(cluster, inplace_bandwidth=-1.0)


def test_data_parallel_gradient_reductions_are_one_all_reduce_per_bucket():
    """The model's count of all-reduces for a data-parallel GPT step (its combined gradient
    reductions in buckets, `combined_bucket_count`, plus the ones it charges alone) is the
    count of all-reduce instructions in XLA's optimized HLO of the step: one, a tuple of
    every gradient and the loss."""
    import optax

    import autopar
    from autopar.cost import combined_bucket_count
    from autopar.graph import tied_state
    from autopar.intra._strategies import step_effects
    from autopar.lower import count_collectives
    from examples import gpt

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    cfg = dataclasses.replace(gpt.CONFIGS["tiny"], num_layers=1)
    opt = optax.adamw(1e-3)
    abstract = (gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, 8))
    # On one mesh axis: on (4, 2) XLA splits a weight gradient's reduction over both axes
    # into one all-reduce per axis, which the model charges as one (not modelled).
    step = autopar.autoparallel(gpt.make_train_step(cfg, opt), method="data", cache=False,
                                cluster=Cluster.from_profile("cpu-local"), mesh_shape=(8,),
                                donate=True)
    last = step._compile(abstract)  # plans and lowers; nothing runs
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            for x, sharding in zip(jax.tree.leaves(abstract), last.in_shardings)]
    hlo = count_collectives(last.fn.lower(*args).compile().as_text())
    plan, graph = last.plan, last.graph
    sharding = plan.stages[0].sharding
    effects = step_effects(graph, tied_state(graph, (0,)))
    ctx = CostContext(Cluster.from_profile("cpu-local"), sharding.mesh, effects.combinable,
                      effects.in_place)
    combined, alone = {}, 0
    for node in graph.nodes:
        name = sharding.node_strategies[node.id]
        sig = node_signature(node, graph)
        chosen = next((s for s in node_strategies(node, graph, sig, ctx) if s.name == name), None) \
            if sig is not None else None
        for c in chosen.collectives if chosen else ():
            if c.kind != "all_reduce":
                continue
            if c.combined:
                combined.setdefault(c.axes, []).append(c.nbytes)
            else:
                alone += 1
    buckets = sum(combined_bucket_count(sizes) for sizes in combined.values())
    assert sum(len(s) for s in combined.values()) >= 6  # one per weight, and the loss
    assert buckets + alone == hlo["all_reduce"][0]


def test_each_collective_kind_at_its_measured_bandwidth():
    """`collective_bandwidth_by_kind` scales the intra-host link's bandwidth per kind: an
    all-to-all at 0.25 moves its wire bytes 4 times slower, its latency unchanged. By hand,
    a group of 4 of 8 devices, 1 MiB."""
    a100 = Cluster.from_profile("dgx-a100-80g")
    cluster = dataclasses.replace(a100, collective_bandwidth_by_kind=(("all_to_all", 0.25),))
    mesh = LogicalMesh.create((2, 4), axis_names=("g", "x"))
    nbytes = 2**20
    link = intra_link(a100, 4)
    wire = 3 / 4 * nbytes  # an all-to-all sends (n-1)/n of its bytes
    plain = collective_time("all_to_all", nbytes, a100, mesh, "x")
    slow = collective_time("all_to_all", nbytes, cluster, mesh, "x")
    assert slow - plain == pytest.approx(wire / (0.25 * link.bandwidth) - wire / link.bandwidth)
    # other kinds, and a profile without the table, unchanged
    assert collective_time("all_reduce", nbytes, cluster, mesh, "x") == pytest.approx(
        collective_time("all_reduce", nbytes, a100, mesh, "x"))
    assert kind_bandwidth_scale(a100, "all_to_all") == 1.0
    from autopar.cluster._cluster import COLLECTIVE_KIND_NAMES
    from autopar.cost import COLLECTIVE_KINDS

    assert set(COLLECTIVE_KIND_NAMES) == set(COLLECTIVE_KINDS)
    assert Cluster.from_json(cluster.to_json()) == cluster
    with pytest.raises(ValueError, match="unknown kind"):
        Cluster.from_json({**a100.to_json(), "collective_bandwidth_by_kind": {"alltoall": 0.3}})
    with pytest.raises(ValueError, match="factors must be finite and > 0"):
        dataclasses.replace(a100, collective_bandwidth_by_kind=(("all_to_all", 0.0),))


def test_profiler_fits_each_kind_against_the_common_fit():
    from autopar.cost import CollectiveSample
    from autopar.profile._fit import kind_scales as _kind_scales

    # all-reduce samples at 2 GB/s, all-to-all ones at 0.5 GB/s, 20 us latency per step
    samples = []
    for kind, bandwidth in (("all_reduce", 2e9), ("all_to_all", 0.5e9)):
        link = dataclasses.replace(Cluster.from_profile("cpu-local").intra_host,
                                   bandwidth=bandwidth, latency=20e-6)
        for nbytes in (2**14, 2**18, 2**22):
            probe = CollectiveSample(kind, 4, float(nbytes), 1.0)
            samples.append(CollectiveSample(kind, 4, float(nbytes), probe.predicted(link)))
    common = dataclasses.replace(Cluster.from_profile("cpu-local").intra_host, bandwidth=1e9)
    scales = dict(_kind_scales(samples, common))
    assert scales["all_reduce"] == pytest.approx(2.0, rel=1e-3)
    assert scales["all_to_all"] == pytest.approx(0.5, rel=1e-3)
    assert "send_recv" not in scales  # no samples of it
