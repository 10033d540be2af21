"""One dispatch per expert MLP against one per grouped GEMM: predicted and measured on
the local devices.

    python -m benchmarks.investigations.moe_dispatch_once [--rounds 7] [--steps 3] [--batch 16]

The "ep-test" dropless MoE (16 experts of width 256, top-2, hidden 64) on the 8 local CPU
devices, with every grouped GEMM of its layer scans put in the all-to-all
expert-parallel layout over the (8,) mesh by hand (as `benchmarks.investigations.
moe_overlap` does: the CPU profile's search keeps the experts whole). Two lowerings of that
one plan: the expert MLP regions (`autopar.intra._moe_regions`: a dispatch where the
routed rows enter, a combine where they leave, the saved activations kept on their
expert's device: ``moe_dispatch="mlp"``) and a dispatch and a combine around every
grouped GEMM (``moe_dispatch="gemm"``: the same plan with its grouped GEMMs' strategy
names carrying `autopar.intra._strategies_moe.PER_GEMM`, as a search with that option
names them). Both run in interleaved rounds (their
order alternating), each timing `--steps` steps of each; medians compared on the wall
clock and the cpu-per-core clock (`benchmarks.investigations.moe_overlap` says what each
sees). The all-to-alls of each compiled program are counted in its HLO.

Predicted: each grouped GEMM's whole EP strategy's collective seconds on the profile
(`--profile`, default ``cpu-local-measured``), times its scan's trip count, summed, with
``moe_dispatch="mlp"`` and ``"gemm"``. Timing on shared cores is noisy: compare within one run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

import autopar  # noqa: E402
from autopar.intra._strategies import CostContext  # noqa: E402
from autopar.intra._strategies_moe import PER_GEMM, expert_parallel_strategies  # noqa: E402
from autopar.lower import count_collectives  # noqa: E402
from benchmarks.investigations.moe_overlap import (  # noqa: E402
    CLOCKS,
    ep_setup,
    expert_parallel,
    interleaved_times,
)

LOWERINGS = {"per MLP": "mlp", "per GEMM": "gemm"}  # label -> moe_dispatch


def per_gemm(plan):
    """`plan` (from `expert_parallel`) as ``moe_dispatch="gemm"`` names its grouped GEMMs'
    strategies: each with `PER_GEMM`, so the lowering gives each its own exchange."""
    stage = plan.stages[0]
    bodies = tuple(dataclasses.replace(b, strategies=tuple((n, name + PER_GEMM)
                                                           for n, name in b.strategies))
                   for b in stage.sharding.scan_bodies)
    sharding = dataclasses.replace(stage.sharding, scan_bodies=bodies)
    return dataclasses.replace(plan, stages=(dataclasses.replace(stage, sharding=sharding),))


def predicted_a2a(nodes, axes, cluster, mesh, dispatch: str) -> float:
    """All-to-all seconds per step of the whole EP strategies (trip-counted) priced with
    `moe_dispatch=dispatch`."""
    ctx = CostContext(cluster, mesh, moe_overlap="off", moe_dispatch=dispatch)
    name = f"ep:{''.join(axes)}" + (PER_GEMM if dispatch == "gemm" else "")
    total = 0.0
    for trips, body, node in nodes:
        (whole,) = [s for s in expert_parallel_strategies(node, body, ctx) if s.name == name]
        total += trips * whole.comm_cost
    return total


def _hlo_all_to_alls(fn, state, batch) -> int:
    compiled = fn._last  # as tests/helpers.compiled_hlo reads it
    leaves = jax.tree.leaves((state, batch))
    placed = [jax.device_put(x, s) for x, s in zip(leaves, compiled.in_shardings)]
    text = compiled.fn.lower(*placed).compile().as_text()
    return count_collectives(text).get("all_to_all", (0, 0.0))[0]


def main(argv=None) -> None:
    args, step, state, batch, cluster, searched, graph = ep_setup(
        argv, __doc__.splitlines()[0])
    plan, nodes, axes = expert_parallel(searched, graph, overlapped=False)
    plans = {"mlp": plan, "gemm": per_gemm(plan)}
    mesh = searched.stages[0].sharding.mesh
    runs, losses, a2a, counted = {}, {}, {}, {}
    for label, dispatch in LOWERINGS.items():
        runs[label] = autopar.autoparallel(step, plan=plans[dispatch], donate_argnums=(),
                                           cache=False)
        _, metrics = runs[label](state, batch)  # compile
        losses[label] = float(metrics["loss"])
        a2a[label] = predicted_a2a(nodes, axes, cluster, mesh, dispatch)
        counted[label] = _hlo_all_to_alls(runs[label], state, batch)

    times = interleaved_times(runs, state, batch, args.rounds, args.steps)
    print(f"{args.config}, batch {args.batch}, {len(nodes)} grouped GEMMs per step, EP over "
          f"{axes} on 8 CPU devices; profile {args.profile}; load average "
          f"{os.getloadavg()[0]:.1f}")
    for label in runs:
        print(f"  {label:<8}: first-step loss {losses[label]:.6f}, all-to-alls in HLO "
              f"{counted[label]}, predicted all-to-all {a2a[label] * 1e3:.2f} ms per step")
    for clock in CLOCKS:
        once, each = (statistics.median(times[clock, k]) for k in LOWERINGS)
        print(f"  {clock} clock, median of {args.rounds} rounds x {args.steps} steps: "
              f"per MLP {once * 1e3:.2f} ms  per GEMM {each * 1e3:.2f} ms  saving "
              f"{(each - once) * 1e3:+.2f} ms (predicted "
              f"{(a2a['per GEMM'] - a2a['per MLP']) * 1e3:+.2f} ms)")
        for label in runs:
            print(f"    rounds {label:<8}: " + " ".join(f"{t * 1e3:.1f}"
                                                      for t in times[clock, label]))


if __name__ == "__main__":
    main()
