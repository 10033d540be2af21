"""Plan Llama-8B at a long sequence on a virtual DGX H100 cluster and print what the plan
chose: CP algorithm and degree per stage, peak memory per device, predicted step time and
planning time.

    python benchmarks/investigations/long_context_plan.py --seq-len 131072 --hosts 8 \
        --batch 8 --context-parallel auto

Planning runs on the CPU of this machine (shapes only; nothing is allocated).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import optax

import autopar
from examples import llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8B")
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context-parallel", default="auto")
    parser.add_argument("--method", default="auto")
    args = parser.parse_args()
    cfg = dataclasses.replace(
        llama.CONFIGS[args.model], seq_len=args.seq_len, scan_layers=True, remat_layers=True,
        attention="dot_product_attention", dtype="bfloat16", master_dtype="float32",
    )
    optimizer = optax.adamw(1e-4)
    state = llama.abstract_state(cfg, optimizer)
    batch = llama.abstract_batch(cfg, args.batch)
    cluster = autopar.Cluster.from_profile("dgx-h100", num_hosts=args.hosts)
    start = time.perf_counter()
    plan = autopar.plan(llama.make_train_step(cfg, optimizer), state, batch, cluster=cluster,
                        method=args.method, context_parallel=args.context_parallel)
    seconds = time.perf_counter() - start
    print(f"{args.model} seq {args.seq_len} batch {args.batch} on {cluster.num_devices} "
          f"H100 ({args.hosts} hosts), context_parallel={args.context_parallel!r}, "
          f"method={args.method!r}")
    print(f"planning time {seconds:.1f} s")
    print(f"predicted step time {plan.predicted_step_time:.3f} s, "
          f"{plan.num_stages} stage(s), {plan.num_microbatches} microbatch(es)")
    for i, stage in enumerate(plan.stages):
        print(f"stage {i}: mesh {stage.mesh.shape}, CP {stage.sharding.context_parallel}, "
              f"peak {stage.memory_per_device / 2**30:.1f} GiB/device")
    for w in plan.warnings:
        print("warning:", w)


if __name__ == "__main__":
    main()
