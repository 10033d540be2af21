"""Why the MoE parity seeds 7 and 13 once differed from one device (docs/benchmarks.md,
"Parity sweep"): reproduces the figures quoted there.

    python benchmarks/investigations/parity_moe_rounding.py 13     # or 7
    python benchmarks/investigations/parity_moe_rounding.py 23 selective  # remat drawn

Trains the sweep's MoE configuration `seed` (drawn without remat, as in the first sweep) and
the one-device reference for `NUM_STEPS` steps, keeping every step's parameters and the
reference's gradients; then prints, for each parameter element past rtol/atol 1e-5, its
gradient per step and the difference per step; recomputes the top-2 dispatch of both MoE
layers from each run's parameters before every step (identical or not, the largest gate
difference, the closest top-3 gate gap); and the one-device run's own change when every
initial parameter moves by one float32 rounding step (`parity_sweep.one_device_pair`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(seed: int) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["AUTOPAR_PLAN_CACHE"] = "0"
    spec = importlib.util.spec_from_file_location("parity_sweep", ROOT / "benchmarks" /
                                                  "parity_sweep.py")
    ps = importlib.util.module_from_spec(spec)
    sys.modules["parity_sweep"] = ps
    spec.loader.exec_module(ps)
    import jax
    import numpy as np

    import autopar
    from autopar.distributed import to_host
    from examples import moe

    config = ps.config_for(seed, remats=())
    if len(sys.argv) > 2:  # the remat the sweep drew now, e.g. "selective"
        config = dataclasses.replace(config, remat=sys.argv[2])
    if config.model != "moe":
        raise ValueError(f"seed {seed} draws {config.describe()}; pick an MoE seed (7, 13)")
    print(config.describe(), "(run in this one process of 8 devices)"
          if config.num_processes > 1 else "")
    step, state0, batch = ps.build("moe")
    cfg = dataclasses.replace(moe.CONFIGS["tiny"], layer_markers=True)
    grad = jax.jit(jax.grad(moe.loss_fn), static_argnums=2)

    def run(fn, state, with_grads=True):
        params, grads, losses = [], [], []
        for _ in range(ps.NUM_STEPS):
            if with_grads:
                gradients = grad(state.params, batch, cfg)
                grads.append([np.asarray(g) for g in jax.tree.leaves(gradients)])
            state, metrics = fn(state, batch)
            losses.append(float(to_host(metrics)["loss"]))
            params.append([np.asarray(x) for x in jax.tree.leaves(to_host(state.params))])
        return params, grads, losses

    device = jax.local_devices()[0]
    ref_p, ref_g, ref_l = run(jax.jit(step), jax.device_put(state0, device))
    par_p, _, par_l = run(autopar.autoparallel(step, **config.options()), state0, False)
    print("losses, one device:", ref_l, "\nlosses, parallel:  ", par_l)
    names = [jax.tree_util.keystr(k) for k, _ in
             jax.tree_util.tree_flatten_with_path(state0.params)[0]]
    last, flagged = ps.NUM_STEPS - 1, []
    for i, (x, y) in enumerate(zip(par_p[last], ref_p[last])):
        for index in zip(*np.nonzero(np.abs(x - y) > ps.RTOL * np.abs(y) + ps.PARAM_ATOL)):
            print(f"past rtol/atol: leaf {i} {names[i]} element {tuple(map(int, index))}")
            flagged.append((i, index))
            for t in range(ps.NUM_STEPS):
                print(f"  step {t + 1}: gradient {ref_g[t][i][index]:+.3e} (leaf's largest "
                      f"{np.abs(ref_g[t][i]).max():.2e}), parameter difference "
                      f"{par_p[t][i][index] - ref_p[t][i][index]:+.3e}")

    recorded, original = [], moe.top2_gating

    def spy(gates, capacity):
        gating = original(gates, capacity)
        recorded.append((np.asarray(gating.dispatch), np.asarray(gates)))
        return gating

    def routes(leaves):
        recorded.clear()
        moe.top2_gating = spy
        try:
            with jax.disable_jit():
                moe.forward(jax.tree.unflatten(jax.tree.structure(state0.params), leaves),
                            batch["tokens"], cfg)
        finally:
            moe.top2_gating = original
        return list(recorded)

    start = jax.tree.leaves(state0.params)
    for t in range(ps.NUM_STEPS):
        a = routes(start if t == 0 else ref_p[t - 1])
        b = routes(start if t == 0 else par_p[t - 1])
        for layer, ((da, ga), (db, gb)) in enumerate(zip(a, b)):
            gap = np.min(np.diff(np.sort(ga, axis=-1), axis=-1)[..., -2:])
            print(f"step {t + 1}, MoE layer {layer}: dispatch identical "
                  f"{np.array_equal(da, db)}, largest gate difference "
                  f"{np.abs(ga - gb).max():.2e}, closest top-3 gates {gap:.2e} apart")
    reference, perturbed = ps.one_device_pair("moe")
    sensitivity = ps.reference_sensitivity(reference, perturbed)
    print(f"one-device run, initial parameters moved by one rounding step: per-leaf largest "
          f"change max {max(sensitivity):.2g}, median {float(np.median(sensitivity)):.2g}")
    for i, index in flagged:
        print(f"  at leaf {i} element {tuple(map(int, index))}: "
              f"{abs(perturbed[1][i][index] - reference[1][i][index]):.2g} (leaf's largest "
              f"{sensitivity[i]:.2g})")
    for i in sorted(range(len(sensitivity)), key=lambda i: -sensitivity[i])[:4]:
        print(f"  leaf {i} {names[i]}: {sensitivity[i]:.2g}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 13)
