"""How the stage DP and layer clustering scale.

Run: ``python benchmarks/investigations/stage_dp_scaling.py`` from the repo root. No
JAX, no devices: both algorithms work on numbers.

Stage DP: a GPT-like synthetic cost model (identical layers; a stage of n layers on a
submesh of d devices takes n / d time units plus a tensor-parallel communication term that
grows with log2(d) and is 4x larger across hosts; it fits in memory only if n / d <= 2
layers per device) and a random-cost model (every (range, submesh) latency drawn at random,
the worst case for the number of distinct candidate t_max). "gpt-1f1b" is the GPT-like
model under 1F1B: a stage's memory also counts the activations of the min(B, S - i)
microbatches stage i of S keeps, so the DP passes each stage's position (`num_positions`).
For each: wall time of the
search (callback excluded), stage_cost evaluations, DP passes, and how many DP passes
Alpa's increasing-t_max order would need at least (the candidates t with B * t below the
optimum, which its pruning cannot skip).

Layer clustering: N = 20,000 equations, L = 24 layers, a random chain with skip edges;
median wall time of 5 runs.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from autopar.inter._stage_dp import StageCost, plan_stages  # noqa: E402
from autopar.inter._submesh import submesh_shapes  # noqa: E402
from autopar.inter.passes._clustering import cluster_layers_detailed  # noqa: E402

# Tensor-parallel communication per layer per log2(devices), as a fraction of one layer's
# single-device compute. Cross-host links are taken to be 4x slower than intra-host ones;
# on a DGX A100 the gap is 12x (NVLink 3 300 GB/s vs HDR IB ~25 GB/s per GPU, REFERENCES.md
# "Hardware"), 4x keeps both kinds of plans in play in this toy model.
COMM_PER_LOG2_DEVICES = 0.02
CROSS_HOST_SLOWDOWN = 4.0
LAYERS_PER_DEVICE_LIMIT = 2.0  # memory: at most this many layers' state per device


def gpt_like_cost(submeshes):
    def stage_cost(start, end, index):
        sub = submeshes[index]
        layers, devices = end - start, sub.num_devices
        slowdown = CROSS_HOST_SLOWDOWN if sub.num_hosts > 1 else 1.0
        comm = COMM_PER_LOG2_DEVICES * math.log2(devices) * slowdown
        memory = layers / devices
        return StageCost(layers * (1.0 / devices + comm), memory <= LAYERS_PER_DEVICE_LIMIT, memory)

    return stage_cost


# 1F1B memory by position: a stage i of S keeps min(B, S - i) microbatches of activations,
# each ACTIVATION_PER_LAYER of a layer's state; the DP passes each stage's position.
ACTIVATION_PER_LAYER = 0.05


def gpt_like_1f1b_cost(num_microbatches):
    def make(submeshes):
        base = gpt_like_cost(submeshes)

        def stage_cost(start, end, index, position):
            cost = base(start, end, index)
            in_flight = min(num_microbatches, position)
            memory = cost.memory * (1.0 + ACTIVATION_PER_LAYER * in_flight)
            return StageCost(cost.latency, memory <= LAYERS_PER_DEVICE_LIMIT, memory)

        return stage_cost

    return make


def random_cost(submeshes, seed):
    rng = random.Random(seed)

    def stage_cost(start, end, index):
        devices = submeshes[index].num_devices
        return StageCost((end - start) * rng.uniform(0.5, 1.5) / devices**0.8, True)

    return stage_cost


def recording(stage_cost):
    seen = []

    def wrapped(*key):
        cost = stage_cost(*key)
        seen.append(cost)
        return cost

    return wrapped, seen


def run_stage_dp(name, num_layers, cluster, num_microbatches, make_cost, **options):
    subs = submesh_shapes(*cluster)
    stage_cost, seen = recording(make_cost(subs))
    plan = plan_stages(num_layers, *cluster, stage_cost, num_microbatches, **options)
    candidates = {c.latency for c in seen if c.feasible}
    alpa_runs = sum(num_microbatches * t < plan.latency for t in candidates)
    shapes = sorted({str(subs[j]) for _, _, j in plan.stages})
    print(
        f"{name:10s} L={num_layers:3d} {cluster[0]}x{cluster[1]:<2d} B={num_microbatches:3d} "
        f"{str(options or ''):18s} time {plan.solve_time * 1e3:8.1f} ms  evals "
        f"{plan.num_evaluations:6d}  dp runs {plan.num_dp_runs:3d} (Alpa order >= "
        f"{alpa_runs:5d} of {len(candidates):5d})  stages {len(plan.stages):2d} "
        f"on {','.join(shapes)}"
    )


def run_clustering(num_equations=20_000, num_layers=24, repeats=5):
    rng = np.random.default_rng(0)
    flops = rng.uniform(0.0, 100.0, num_equations)
    chain = np.stack(
        [
            np.arange(num_equations - 1),
            np.arange(1, num_equations),
            rng.integers(1, 1000, num_equations - 1),
        ],
        1,
    )
    starts = np.arange(0, num_equations - 60, 3)
    skips = np.stack(
        [starts, starts + rng.integers(2, 50, len(starts)), rng.integers(1, 999, len(starts))], 1
    )
    edges = np.concatenate([chain, skips]).astype(float)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = cluster_layers_detailed(flops, edges, num_layers)
        times.append(time.perf_counter() - started)
    balance = max(result.layer_flops) / (flops.sum() / num_layers)
    print(
        f"clustering N={num_equations} L={num_layers} ({len(edges)} edges): median "
        f"{statistics.median(times) * 1e3:.1f} ms, largest layer {balance:.2f} x mean, "
        f"max cut {result.max_cut_bytes:.0f} B, delta used {result.delta}"
    )


def main():
    for num_layers, cluster in [(12, (1, 8)), (24, (2, 8)), (48, (8, 8)), (96, (8, 8))]:
        run_stage_dp("gpt-like", num_layers, cluster, 32, gpt_like_cost)
    run_stage_dp("gpt-like", 48, (8, 8), 32, gpt_like_cost, num_stages=8)
    run_stage_dp("gpt-like", 48, (8, 8), 32, gpt_like_cost, max_stages=16)
    for num_layers, cluster in [(24, (2, 8)), (48, (8, 8))]:
        for num_microbatches in (8, 32):
            run_stage_dp("gpt-1f1b", num_layers, cluster, num_microbatches,
                         gpt_like_1f1b_cost(num_microbatches), num_positions=num_microbatches)
    for num_microbatches in (1, 8, 64):
        run_stage_dp("random", 48, (8, 8), num_microbatches, lambda s: random_cost(s, 0))
    run_clustering()


if __name__ == "__main__":
    main()
