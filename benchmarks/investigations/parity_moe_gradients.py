"""Is the pipelined MoE's gradient the one-device gradient, up to rounding?

    python benchmarks/investigations/parity_moe_gradients.py 23 73 36  # MoE sweep seeds

For each sweep seed (run in this one process of 8 devices), compares per parameter leaf the
gradient the parallel program computes at step 1 (the step returns it next to the loss; the
plan is the seed's: same method, stages, microbatches, schedule, remat) with:

- the one-device float32 gradient (`jax.jit(grad)`, the sweep's reference program);
- the float64 gradient of the same function (the MoE module run with every float32 cast
  made float64): the exact value to ~1e-16, against which both float32 gradients have a
  rounding error;
- the one-device float32 gradient under equivalent reduction orders: the batch's routing
  groups permuted (the loss is a mean over tokens and over routing groups, so the function
  is unchanged; only the order of every sum over tokens changes) and the batch taken as 2
  or 4 microbatches whose gradients are averaged (what a pipeline does).

It also checks that the microbatched function *is* the one-device function: in float64 the
mean of the microbatch losses / gradients equals the full batch's to ~1e-15 (the MoE's
routing groups are `expert_group_size` = 32 tokens = 2 rows and microbatches are
contiguous rows, so every group stays whole; capacity is computed per group, and the
load-balancing loss is a mean over groups, so it is linear over microbatches).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUM_PERMUTATIONS = 8


def load_sweep():
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["AUTOPAR_PLAN_CACHE"] = "0"
    spec = importlib.util.spec_from_file_location("parity_sweep", ROOT / "benchmarks" /
                                                  "parity_sweep.py")
    ps = importlib.util.module_from_spec(spec)
    sys.modules["parity_sweep"] = ps
    spec.loader.exec_module(ps)
    return ps


class _Float64Numpy:
    """`jax.numpy` with float32 meaning float64, for running examples/moe.py in float64."""

    def __init__(self, jnp):
        self._jnp = jnp

    def __getattr__(self, name):
        if name == "float32":
            return self._jnp.float64
        return getattr(self._jnp, name)


def main(seeds: list[int]) -> None:
    ps = load_sweep()
    import jax
    import numpy as np
    import optax

    import autopar
    from autopar.distributed import to_host
    from examples import moe

    cfg = dataclasses.replace(moe.CONFIGS["tiny"], layer_markers=True)
    _, state0, batch = ps.build("moe")
    params = state0.params
    names = [jax.tree_util.keystr(k) for k, _ in
             jax.tree_util.tree_flatten_with_path(params)[0]]
    device = jax.local_devices()[0]
    leaves = lambda tree: [np.asarray(x, np.float64) for x in jax.tree.leaves(to_host(tree))]  # noqa: E731

    grad = jax.jit(jax.value_and_grad(moe.loss_fn), static_argnums=2)
    loss_ref, g_ref = grad(jax.device_put(params, device), jax.device_put(batch, device), cfg)
    g_ref = leaves(g_ref)

    def microbatched(p, b, m):
        rows = b["tokens"].shape[0] // m
        parts = [jax.value_and_grad(moe.loss_fn)(
            p, jax.tree.map(lambda x, i=i: x[i * rows:(i + 1) * rows], b), cfg)
            for i in range(m)]
        loss = sum(x[0] for x in parts) / m
        return loss, jax.tree.map(lambda *g: sum(g) / m, *[x[1] for x in parts])

    # float64: the same function, every float32 cast of the module made float64.
    jax.config.update("jax_enable_x64", True)
    saved = moe.jnp
    moe.jnp = _Float64Numpy(saved)
    try:
        p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
        loss64, g64 = jax.value_and_grad(moe.loss_fn)(p64, batch, cfg)
        g64 = leaves(g64)
        micro64 = {m: microbatched(p64, batch, m) for m in (2, 4)}
    finally:
        moe.jnp = saved
        jax.config.update("jax_enable_x64", False)
    for m, (loss, g) in micro64.items():
        print(f"float64, {m} microbatches averaged vs the whole batch: loss "
              f"{abs(float(loss) - float(loss64)):.1e}, largest gradient difference "
              f"{max(float(np.abs(a - b).max()) for a, b in zip(leaves(g), g64)):.1e}")

    # Equivalent reduction orders on one device (float32).
    group_rows = cfg.expert_group_size // cfg.seq_len
    groups = ps.BATCH_SIZE // group_rows
    rng = np.random.default_rng(0)
    variants = {}
    for k in range(NUM_PERMUTATIONS):
        order = rng.permutation(groups)
        rows = np.concatenate([np.arange(g * group_rows, (g + 1) * group_rows) for g in order])
        permuted = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows], batch)
        variants[f"groups permuted #{k}"] = leaves(grad(params, permuted, cfg)[1])
    for m in (2, 4):
        fn = jax.jit(lambda p, b, m=m: microbatched(p, b, m))
        variants[f"{m} microbatches"] = leaves(fn(params, batch)[1])

    def err(a, b):
        return [float(np.abs(x - y).max()) for x, y in zip(a, b)]

    ref_err64 = err(g_ref, g64)
    spread = [max(col) for col in zip(*[err(v, g_ref) for v in variants.values()])]
    spread64 = [max(col) for col in zip(*[err(v, g64) for v in variants.values()])]
    print(f"one-device float32 loss {float(loss_ref):.8f}, float64 {float(loss64):.8f}")

    optimizer = optax.adamw(ps.LEARNING_RATE, eps=ps.ADAM_EPS)

    def step(state, batch):  # the sweep's MoE step, its gradients returned too
        loss, grads = autopar.value_and_grad(moe.loss_fn)(state.params, batch, cfg)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new = optax.apply_updates(state.params, updates)
        return moe.TrainState(new, opt_state), {"loss": loss, "grads": grads}

    for seed in seeds:
        config = ps.config_for(seed)
        if config.model != "moe":
            raise ValueError(f"seed {seed} draws {config.describe()}; pick an MoE seed")
        options = config.options()
        par = autopar.autoparallel(step, **options)
        _, metrics = par(state0, batch)
        g_par = leaves(metrics["grads"])
        print(f"\nseed {seed}: {config.describe()} (one process here); plan: "
              f"{par.plan.num_stages} stage(s), {par.plan.num_microbatches} microbatch(es); "
              f"loss {float(to_host(metrics)['loss']):.8f}")
        par_ref, par64 = err(g_par, g_ref), err(g_par, g64)
        print("leaf | max|g| | parallel-ref | ref-f64 | parallel-f64 | one-device spread "
              "(vs ref) | spread (vs f64)")
        worst = sorted(range(len(names)), key=lambda i: -par_ref[i] / max(spread[i], 1e-30))
        for i in sorted(worst[:6]) + [names.index("['layers'][0]['attn']['bq']")]:
            print(f"{names[i]} | {np.abs(g64[i]).max():.2e} | {par_ref[i]:.2e} | "
                  f"{ref_err64[i]:.2e} | {par64[i]:.2e} | {spread[i]:.2e} | {spread64[i]:.2e}")
        ratio = [a / max(b, 1e-30) for a, b in zip(par64, spread64)]
        print(f"largest (parallel-f64)/(one-device spread vs f64) over leaves: {max(ratio):.2f} "
              f"({names[int(np.argmax(ratio))]}); largest parallel-ref "
              f"{max(par_ref):.2e}, largest one-device spread {max(spread):.2e}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main([int(s) for s in sys.argv[1:]] or [23, 73])
