"""Llama 3 405B's published layout in autopar's memory model, by part and device group
(issue 44, item 3).

    python benchmarks/investigations/llama405_memory.py [--row llama3-405b-8k] [--zero1]

Scores the `validate_public` row's `MegatronConfig` (TP8 PP16 DP64, interleaved with
V = 8, sequence parallelism, distributed optimizer with the gradients sharded too, ZeRO-2
as Llama 3's FSDP ran (Dubey et al. 2024, sec. 3.3.2); `--zero1` keeps whole gradient
sums, Megatron's distributed optimizer; 32 microbatches of 8,192 tokens) with
the memory check lifted and prints, per device group (pipeline rank), what it holds per
device: state, gradient sums, kept activations of the chunk-microbatches in flight,
the largest chunk's working memory and the optimizer update's working memory (which never
coincides with the activations), against the profile's device memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import validate_public as vp  # noqa: E402

GIB = 2**30


def main() -> None:
    from autopar.cluster import Cluster
    from autopar.graph import trace
    from autopar.manual import MegatronConfig, megatron_plan_for_graph
    from autopar.search import microbatch_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama3-405b-8k")
    parser.add_argument("--zero1", action="store_true",
                        help="whole gradient sums (ZeRO-1) where the row has ZeRO-2")
    args = parser.parse_args()
    run = next(r for r in vp.RUNS if r.key == args.row)
    start = time.perf_counter()
    step, step_args = vp._step(run)
    m = run.num_microbatches
    graph = trace(step, *microbatch_args(step_args, (1,), m), batch_argnums=(1,))
    cluster = Cluster.from_profile(run.profile, num_hosts=run.num_gpus // 8)
    config = MegatronConfig(
        dp=run.dp, tp=run.tp, pp=run.pp, num_microbatches=m,
        sequence_parallel=run.sequence_parallel,
        distributed_optimizer=run.distributed_optimizer, recompute=run.recompute,
        zero2=run.zero2 and not args.zero1,
        schedule=run.schedule, virtual_stages=run.virtual_stages,
        even_chunks=run.virtual_stages == 1)
    plan = megatron_plan_for_graph(graph, cluster, config, memory_budget=vp.UNLIMITED)
    print(f"{run.key}: {config.name}, {cluster.device_memory / GIB:.0f} GiB per device; "
          f"predicted step {plan.predicted_step_time:.2f} s")
    print("| group | chunks' layers | state | gradients | activations | in flight | working "
          "| update | total GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g, stage in enumerate(plan.stages[:plan.num_device_groups]):
        p = stage.memory_parts
        layers = [plan.stages[s].layers for s in range(g, len(plan.stages),
                                                         plan.num_device_groups)]
        print(f"| {g} | {layers[0]}..{layers[-1]} | {p.state / GIB:.2f} | "
              f"{p.gradients / GIB:.2f} | {p.activations / GIB:.2f} | {p.in_flight:g} | "
              f"{p.working / GIB:.2f} | {p.update / GIB:.2f} | {p.total / GIB:.2f} |")
    worst = max(plan.stages, key=lambda st: st.memory_parts.total).memory_parts
    print(f"worst device group: {worst.total / GIB:.2f} GiB "
          f"({'fits' if worst.total <= cluster.device_memory else 'does not fit'}); "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
