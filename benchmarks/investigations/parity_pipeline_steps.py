"""Is a parity difference a wrong step or an amplified rounding difference?

    python benchmarks/investigations/parity_pipeline_steps.py zero_bubble:none:2:2 1f1b:none:2:2

For each SCHEDULE:REMAT:STAGES:MICROBATCHES (method "auto" on the sweep's tiny MoE), runs the
parallel step twice per step t: once from the one-device reference's own state before step
t ("one step"), once chained on its own trajectory, and prints the largest parameter (and
optimizer state) difference from the reference after each. A wrong step shows in the one-step
column; rounding differences amplified over the trajectory (AdamW near zero gradients, MoE
expert weights) show only in the chained one. Last, it continues the one-device program from
the parallel run's own state after step 1 and prints how far that lands from the parallel
run after each later step: near zero when everything the chained run adds after step 1 is
the one-device dynamics amplifying step 1's difference. Figures: docs/benchmarks.md,
"Parity sweep".
"""
import importlib.util
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["AUTOPAR_PLAN_CACHE"] = "0"
ROOT = os.path.abspath(os.path.join(__file__, '..', '..', '..'))
sys.path.insert(0, ROOT)
spec = importlib.util.spec_from_file_location("ps", os.path.join(ROOT, "benchmarks",
                                                                 "parity_sweep.py"))
ps = importlib.util.module_from_spec(spec)
sys.modules["ps"] = ps
spec.loader.exec_module(ps)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar.distributed import to_host  # noqa: E402

step, state0, batch = ps.build("moe")
dev = jax.local_devices()[0]
js = jax.jit(step)
refs = [jax.tree.map(np.asarray, state0)]
s = jax.device_put(state0, dev)
for _ in range(ps.NUM_STEPS):
    s, _ = js(s, batch)
    refs.append(jax.tree.map(np.asarray, s))
names = [jax.tree_util.keystr(k) for k, _ in
         jax.tree_util.tree_flatten_with_path(state0.params)[0]]


def largest(got, want):
    diffs = [float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
             for a, b in zip(jax.tree.leaves(to_host(got)), jax.tree.leaves(want))]
    return max(diffs), int(np.argmax(diffs))


for arg in sys.argv[1:]:
    sched, remat, stages, mb = arg.split(":")
    par = autopar.autoparallel(step, method="auto", num_stages=int(stages),
                               num_microbatches=int(mb), schedule=sched, remat=remat,
                               donate_argnums=())
    chain, chained = state0, []
    for t in range(ps.NUM_STEPS):
        one, _ = par(refs[t], batch)
        chain, _ = par(chain, batch)
        chained.append(jax.tree.map(np.asarray, to_host(chain)))
        d1, i1 = largest(one.params, refs[t + 1].params)
        dopt, _ = largest(one.opt_state, refs[t + 1].opt_state)
        dc, ic = largest(chain.params, refs[t + 1].params)
        print(f"{arg} step {t + 1}: one step from the reference's state: max |param diff| "
              f"{d1:.2g} ({names[i1]}), opt_state {dopt:.2g}; chained: {dc:.2g} "
              f"({names[ic]})", flush=True)
    s = jax.device_put(chained[0], dev)
    for t in range(1, ps.NUM_STEPS):
        s, _ = js(s, batch)
        d, i = largest(s.params, chained[t].params)
        dr, _ = largest(chained[t].params, refs[t + 1].params)
        print(f"{arg} step {t + 1}: one device from the parallel run's state after step 1: "
              f"max |param diff| from the parallel run {d:.2g} ({names[i]}); parallel vs the "
              f"reference {dr:.2g}", flush=True)
