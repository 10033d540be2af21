"""One Llama-8B layer at 32,768 tokens (batch 1) on one DGX H100: autopar's ring plans
against Megatron context-parallel configurations, priced by the same cost model, each
with its step split into compute, collectives and resharding.

    python benchmarks/investigations/long_context_one_layer.py

Separates the ring's per-layer price from what the stage search does with 32 layers
(memory levels, microbatches): `docs/benchmarks.md`'s long-context rows compare whole
models, and `long_context_decomposition.py` splits them by stage, layer and kind of node.
Plans only (shapes; nothing runs).
"""

from __future__ import annotations

import dataclasses
import time

import optax

import autopar
from autopar.cluster import Cluster
from autopar.manual import AttentionShape, megatron_plan
from examples import llama


def main() -> None:
    cfg = dataclasses.replace(llama.CONFIGS["8B"], num_layers=1, seq_len=32768,
                              dtype="bfloat16", master_dtype="float32")
    optimizer = optax.adamw(1e-4)
    step = llama.make_train_step(cfg, optimizer)
    args = (llama.abstract_state(cfg, optimizer), llama.abstract_batch(cfg, 1))
    cluster = Cluster.from_profile("dgx-h100")
    attention = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)

    def show(name, p, seconds):
        cost = p.stages[0].sharding.cost
        print(f"{name}: {p.predicted_step_time * 1e3:.1f} ms per step = compute "
              f"{cost.compute * 1e3:.1f} + collectives {cost.communication * 1e3:.1f} + "
              f"resharding {cost.resharding * 1e3:.1f} (+ the rest of the step); planned "
              f"in {seconds:.0f} s", flush=True)

    for tp, cp in ((2, 4), (1, 8)):
        start = time.perf_counter()
        # (megatron_plan traces at one CP rank's shapes itself: `context_args`)
        p = megatron_plan(step, *args, cluster=cluster, dp=1, tp=tp,
                          cp=cp, sequence_parallel=tp > 1, distributed_optimizer=True,
                          attention=attention, memory_budget=1e15)
        show(f"megatron tp{tp} cp{cp} (ring)", p, time.perf_counter() - start)
    for shape in ((8,), (4, 2)):
        start = time.perf_counter()
        p = autopar.plan(step, *args, cluster=cluster, method="shard", mesh_shape=shape,
                         context_parallel="ring", cache=False)
        context = p.stages[0].sharding.context_parallel
        show(f"autopar mesh {shape}, {context.algorithm} CP x{context.degree}", p,
             time.perf_counter() - start)


if __name__ == "__main__":
    main()
