"""autopar.graph.trace: flattening, FLOPs, roles and paths, evaluate, errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar.graph import Role, trace
from autopar.graph._flops import CALL_JAXPR_PARAM, FLOP_RULES, elementwise_flops
from autopar.graph._markers import value_and_grad as autopar_value_and_grad
from autopar.graph._trace import path_str
from examples import gpt

INLINED_NAMES = set(CALL_JAXPR_PARAM)


def _abstract_layer(cfg):
    params = jax.eval_shape(lambda k: gpt.init_params(cfg, k), jax.random.key(0))
    return params["layers"][0]


@functools.cache
def _tiny_gpt_train(batch_size=4):
    """A tiny GPT config, adamw, real state and batch (made once, with jit: fast)."""
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_layers=2, num_heads=2)
    optimizer = optax.adamw(1e-2)
    state = jax.jit(lambda key: gpt.init_state(cfg, optimizer, key))(jax.random.key(0))
    batch = jax.jit(lambda key: gpt.make_batch(cfg, batch_size, key))(jax.random.key(1))
    return cfg, optimizer, state, batch


def _roles_by_path(graph):
    return {graph.vars[v].path: graph.vars[v].role for v in graph.invars}


def _max_abs_diff(a, b):
    diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)
    return max(jax.tree.leaves(diffs))


# ---- FLOPs --------------------------------------------------------------------------


def test_gpt_block_flops_match_transformer_formula():
    b, s, h = 2, 256, 512
    cfg = gpt.GPTConfig(vocab_size=128, seq_len=s, hidden=h, num_layers=1, num_heads=8)
    graph = trace(
        functools.partial(gpt.block, cfg=cfg),
        _abstract_layer(cfg),
        jax.ShapeDtypeStruct((b, s, h), jnp.float32),
    )
    formula = 24 * b * s * h**2 + 4 * b * s**2 * h  # REFERENCES.md, transformer arithmetic
    matmul_flops = sum(n.flops for n in graph.nodes if n.primitive == "dot_general")
    assert matmul_flops == formula  # the formula counts exactly the matmuls
    assert abs(graph.total_flops - formula) / formula < 0.02


def test_train_step_flops_are_three_times_forward():
    cfg = gpt.GPTConfig(vocab_size=128, seq_len=64, hidden=256, num_layers=2, num_heads=4)
    optimizer = optax.adamw(1e-3)
    state = gpt.abstract_state(cfg, optimizer)
    batch = gpt.abstract_batch(cfg, 8)
    forward = trace(functools.partial(gpt.loss_fn, cfg=cfg), state.params, batch)
    step = trace(gpt.make_train_step(cfg, optimizer), state, batch)
    ratio = step.total_flops / forward.total_flops
    assert abs(ratio - 3.0) / 3.0 < 0.05, ratio
    # A plain loss function: every parameter leaf is a PARAM, its path after "params".
    assert forward.num_params == cfg.num_params
    assert {v.path for v in forward.inputs_with_role(Role.PARAM)} == {
        "params/" + path_str(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(state.params)
    }


def test_large_gpt_traces_abstractly_with_formula_flops():
    cfg = gpt.CONFIGS["6.7B"]  # 32 layers of h=4096: nothing may be allocated
    optimizer = optax.adamw(1e-4)
    b, s, h, layers, vocab = 2, cfg.seq_len, cfg.hidden, cfg.num_layers, cfg.vocab_size
    graph = trace(
        gpt.make_train_step(cfg, optimizer),
        gpt.abstract_state(cfg, optimizer),
        gpt.abstract_batch(cfg, b),
    )
    assert graph.name == "train_step"
    assert graph.num_params == cfg.num_params
    assert abs(graph.num_params / 6.7e9 - 1) < 0.03
    # REFERENCES.md: forward = l·(24bsh² + 4bs²h) + 2bshV; a training step is 3×.
    forward = layers * (24 * b * s * h**2 + 4 * b * s**2 * h) + 2 * b * s * h * vocab
    assert abs(graph.total_flops / (3 * forward) - 1) < 0.02


def test_dot_general_and_conv_rules_are_exact():
    lhs = jax.ShapeDtypeStruct((3, 4, 5), jnp.float32)
    rhs = jax.ShapeDtypeStruct((3, 5, 6), jnp.float32)
    graph = trace(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), lhs, rhs, batch_argnums=())
    (dot,) = [n for n in graph.nodes if n.primitive == "dot_general"]
    assert dot.flops == 2 * 3 * 4 * 6 * 5  # 2 · batch · M · N · K

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, window_strides=(1, 1), padding="VALID", feature_group_count=2
        )

    x = jax.ShapeDtypeStruct((2, 4, 8, 8), jnp.float32)  # N C H W, 2 groups of 2 features
    w = jax.ShapeDtypeStruct((6, 2, 3, 3), jnp.float32)  # O I H W
    graph = trace(conv, x, w, batch_argnums=(0,))
    (node,) = graph.nodes
    assert node.primitive == "conv_general_dilated"
    assert node.flops == 2 * (2 * 6 * 6 * 6) * 2 * 9  # 2 · outputs · features/group · kernel


def test_default_rules():
    assert FLOP_RULES["reshape"]([], [], {}) == 0.0
    graph = trace(lambda x: (jnp.exp(x).T, x.sum()), jnp.ones((3, 5)), batch_argnums=())
    by_prim = {n.primitive: n for n in graph.nodes}
    assert "exp" not in FLOP_RULES and by_prim["exp"].flops == 15  # elementwise default
    assert by_prim["transpose"].flops == 0
    assert by_prim["reduce_sum"].flops == 15  # input size
    assert by_prim["exp"].bytes_read == 60 and by_prim["exp"].bytes_written == 60
    assert elementwise_flops([], [jax.ShapeDtypeStruct((2, 3), jnp.float32)], {}) == 6


def test_control_flow_flops_include_bodies():
    w = jnp.ones((8, 8))

    def fn(c, xs):
        c, _ = jax.lax.scan(lambda c, x: (c @ w, None), c, xs)
        c = jax.lax.cond(c.sum() > 0, lambda a: a @ w @ w, lambda a: a @ w, c)
        return jax.lax.while_loop(lambda a: a.sum() < 0, lambda a: a @ w, c)

    graph = trace(fn, jnp.ones((4, 8)), jnp.ones((5,)), batch_argnums=(1,), name="loops")
    assert graph.name == "loops"
    by_prim = {n.primitive: n for n in graph.nodes}
    body = 2 * 4 * 8 * 8
    assert by_prim["scan"].flops == 5 * body  # body × length
    assert by_prim["cond"].flops == 2 * body  # the most expensive branch
    assert by_prim["while"].flops == body + 4 * 8 + 1  # body + condition (sum, compare)
    # Bytes: the node's own inputs (w, c, xs) and outputs (c), plus 5 × the body's dot.
    assert by_prim["scan"].bytes_read == (64 + 32 + 5) * 4 + 5 * (32 + 64) * 4
    assert by_prim["scan"].bytes_written == 32 * 4 + 5 * 32 * 4


# ---- structure: inlining, remat, markers, real vs abstract --------------------------


@jax.custom_vjp
def _scaled_sin(x):
    return jnp.sin(x) * 2.0


def _scaled_sin_fwd(x):
    return _scaled_sin(x), jnp.cos(x)


def _scaled_sin_bwd(cos_x, g):
    return (2.0 * g * cos_x,)


_scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


@jax.jit
def _inner_jit(x):
    return jax.jit(lambda y: y * 3.0)(x) + 1.0


def _nested_loss(w, x):
    h = jax.nn.relu(x @ w)  # relu is a custom_jvp function wrapping a jit
    h = jax.checkpoint(lambda a: jnp.tanh(a) * jnp.exp(a))(h)
    h = _scaled_sin(_inner_jit(h))
    return jnp.mean(h**2)


@pytest.mark.parametrize("differentiate", [False, True])
def test_calls_are_inlined_and_remat_marked(differentiate):
    fn = jax.value_and_grad(_nested_loss) if differentiate else _nested_loss
    w, x = jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.linspace(0, 1, 8).reshape(2, 4)
    graph = trace(fn, w, x)
    primitives = {n.primitive for n in graph.nodes}
    assert not primitives & INLINED_NAMES, primitives & INLINED_NAMES
    assert {"sin", "tanh", "exp", "max"} <= primitives
    remat = {n.primitive for n in graph.nodes if n.remat}
    assert "tanh" in remat and "dot_general" not in remat and "sin" not in remat
    np.testing.assert_allclose(
        np.concatenate([np.ravel(o) for o in graph.evaluate([w, x])]),
        np.concatenate([np.ravel(o) for o in jax.tree.leaves(fn(w, x))]),
        rtol=1e-6,
    )


def test_real_and_abstract_args_give_the_same_graph():
    cfg, optimizer, state, batch = _tiny_gpt_train()
    step = gpt.make_train_step(cfg, optimizer)
    real = trace(step, state, batch)
    abstract = trace(step, gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 4))

    def signature(graph):
        nodes = [(n.primitive, n.inputs, n.outputs, n.flops, n.remat) for n in graph.nodes]
        variables = [(v.shape, v.dtype, v.role, v.path, v.producer) for v in graph.vars]
        return nodes, variables, graph.invars, graph.outvars

    assert signature(real) == signature(abstract)
    assert sorted(real.to_networkx().edges, key=str) == sorted(
        abstract.to_networkx().edges, key=str
    )


def test_layer_markers_and_source_locations():
    cfg, optimizer, state, batch = _tiny_gpt_train()
    cfg = dataclasses.replace(cfg, layer_markers=True)
    graph = trace(gpt.make_train_step(cfg, optimizer), state, batch)
    counts = [n.primitive for n in graph.nodes]
    assert counts.count("layer_boundary") == 2 * cfg.num_layers  # forward + backward
    assert counts.count("grad_boundary") == 1
    dots = [n for n in graph.nodes if n.primitive == "dot_general"]
    assert all(n.source and n.source.startswith("gpt.py:") for n in dots)
    assert "nodes per primitive" in graph.summary()
    assert graph.to_networkx().number_of_nodes() == len(graph.nodes) + len(graph.invars)


# ---- roles and paths ----------------------------------------------------------------


def test_gpt_adamw_roles_and_paths():
    cfg, optimizer, state, batch = _tiny_gpt_train()
    graph = trace(gpt.make_train_step(cfg, optimizer), state, batch)
    roles = _roles_by_path(graph)
    param_paths = [path_str(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(state.params)]
    assert "params/layers/1/mlp/w1" in roles
    expected = {f"params/{p}": Role.PARAM for p in param_paths}
    expected |= {f"opt_state/0/{m}/{p}": Role.OPT_STATE for m in ("mu", "nu") for p in param_paths}
    expected |= {"opt_state/0/count": Role.OTHER}
    expected |= {"batch/tokens": Role.BATCH, "batch/targets": Role.BATCH}
    assert roles == expected
    assert graph.num_params == cfg.num_params
    # Input order is jax.tree.leaves((state, batch)) order.
    state_paths = [path_str(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(state)]
    batch_paths = [f"batch/{path_str(kp)}" for kp, _ in jax.tree_util.tree_leaves_with_path(batch)]
    assert [graph.vars[v].path for v in graph.invars] == state_paths + batch_paths


def test_flax_train_state_roles_and_paths():
    import flax.linen as nn
    from flax.training import train_state

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.tanh(nn.Dense(8)(x)))

    model = Model()
    variables = model.init(jax.random.key(0), jnp.ones((1, 4)))
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.sgd(0.1, momentum=0.9)
    )

    def train_step(state, batch):
        def loss(variables):
            return jnp.mean((state.apply_fn(variables, batch["x"]) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    batch = {"x": jnp.ones((3, 4)), "y": jnp.zeros((3, 2))}
    graph = trace(train_step, state, batch)
    roles = _roles_by_path(graph)
    leaves = [path_str(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(variables)]
    expected = {f"params/{p}": Role.PARAM for p in leaves}
    expected |= {f"opt_state/0/trace/{p}": Role.OPT_STATE for p in leaves}
    expected |= {"step": Role.OTHER, "batch/x": Role.BATCH, "batch/y": Role.BATCH}
    assert roles == expected
    assert "params/params/Dense_0/kernel" in roles


@pytest.mark.parametrize("value_and_grad", [jax.value_and_grad, autopar_value_and_grad])
def test_roles_from_dataflow_without_path_hints(value_and_grad):
    def loss(weights, batch):
        h = jnp.tanh(batch["x"] @ weights["w1"] + weights["b1"])
        return jnp.mean((h @ weights["w2"] + weights["b2"] - batch["y"]) ** 2)

    def train_step(weights, momentum, batch, step):
        value, grads = value_and_grad(loss)(weights, batch)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        weights = jax.tree.map(lambda w, m: w - 0.1 * m, weights, momentum)
        return weights, momentum, step + 1, value

    weights = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 2)), "b2": 0.0}
    batch = {"x": jnp.ones((3, 4)), "y": jnp.zeros((3, 2))}
    graph = trace(train_step, weights, weights, batch, 0, batch_argnums=(2,))
    roles = _roles_by_path(graph)
    expected = {f"weights/{k}": Role.PARAM for k in weights}
    expected |= {f"momentum/{k}": Role.OPT_STATE for k in weights}
    expected |= {"batch/x": Role.BATCH, "batch/y": Role.BATCH, "step": Role.OTHER}
    assert roles == expected


def test_path_str_formats_keys_attributes_and_indices():
    tree = {"opt": (optax.ScaleByAdamState(count=1, mu=[2.0], nu=[3.0]),)}
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert paths == ["opt/0/count", "opt/0/mu/0", "opt/0/nu/0"]


# ---- evaluate -----------------------------------------------------------------------


def test_evaluate_reproduces_gpt_train_step():
    cfg, optimizer, state, batch = _tiny_gpt_train()
    step = gpt.make_train_step(cfg, optimizer)
    graph = trace(step, state, batch)
    flat = jax.tree.leaves((state, batch))
    jitted = jax.tree.unflatten(graph.out_tree, jax.jit(graph.evaluate)(flat))
    expected = jax.jit(step)(state, batch)
    assert jax.tree.structure(jitted) == jax.tree.structure(expected)
    assert _max_abs_diff(jitted, expected) == 0.0  # the same XLA program, bit for bit
    assert float(expected[1]["loss"]) > 0.0
    # (Run op by op, graph.evaluate and step differ by ~1e-6: the jitted helpers inside
    # jnp/optax get fused differently. test_evaluate_reproduces_scan_and_cond runs eagerly.)


def test_evaluate_reproduces_scan_and_cond():
    def fn(c, xs):
        c, ys = jax.lax.scan(lambda c, x: (jnp.sin(c) + x, c * x), c, xs)
        return jax.lax.cond(c.sum() > 0, lambda a: a * 2.0, lambda a: -a, c), ys

    for c in (jnp.linspace(0.1, 1.0, 4), -jnp.linspace(2.0, 3.0, 4)):
        xs = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
        graph = trace(fn, c, xs)
        out = jax.tree.unflatten(graph.out_tree, graph.evaluate([c, xs]))
        assert _max_abs_diff(out, fn(c, xs)) == 0.0


# ---- bad inputs ---------------------------------------------------------------------


def test_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="expects a callable.*got dict"):
        trace({"not": "a function"}, jnp.ones(2))


def test_untraceable_arguments_are_a_value_error():
    def fn(a, b):
        return a @ b

    with pytest.raises(ValueError, match="(?s)dot_general.*ShapeDtypeStruct pytrees"):
        trace(fn, jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="could not trace"):
        trace(fn, jnp.ones((2, 3)), batch_argnums=())


def test_non_array_leaf_names_its_path():
    with pytest.raises(TypeError, match="'batch/name' is a str"):
        trace(lambda state, batch: state, jnp.ones(2), {"name": "tokens"})


def test_batch_argnums_out_of_range():
    with pytest.raises(ValueError, match=r"batch_argnums=\(3,\) does not fit 2"):
        trace(lambda a, b: a + b, 1.0, 2.0, batch_argnums=(3,))


def test_bfloat16_parameters_are_parameters():
    import optax

    from autopar.graph import Role, trace
    from examples import gpt

    cfg = dataclasses.replace(gpt.CONFIGS["tiny"], dtype="bfloat16")
    opt = optax.sgd(0.1)
    graph = trace(gpt.make_train_step(cfg, opt), gpt.abstract_state(cfg, opt),
                  gpt.abstract_batch(cfg, 2))
    roles = {graph.vars[v].path: graph.vars[v].role for v in graph.invars}
    assert roles["params/wte"] is Role.PARAM
