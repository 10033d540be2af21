"""Predicted compute per microbatch of Megatron's pure data-parallel GPT plan (issue 14).

Run: ``python benchmarks/investigations/predict_gpt_compute.py [model] [num_hosts]
[microbatches]``
(defaults: 1.3B, 4 hosts of dgx-a100-80g = 32 GPUs, 32 microbatches of a 1024 batch).
Prints the predicted compute, communication and resharding per microbatch, and the time the
matmuls alone take at 70% of the bf16 peak (the issue's yardstick).
"""

from __future__ import annotations

import sys
from pathlib import Path

import autopar
from autopar.cost import compute_time, rate_dtype
from autopar.graph import trace
from autopar.manual import MegatronConfig, megatron_plan_for_graph
from autopar.search import microbatch_args

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_large import Row, model_step  # noqa: E402


def main(model: str = "1.3B", num_hosts: int = 4, microbatches: int = 32) -> None:
    row = Row("gpt", model, num_hosts)
    step, args = model_step(row)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=num_hosts)
    n = cluster.num_devices
    graph = trace(step, *microbatch_args(args, (1,), microbatches), batch_argnums=(1,))
    dot_flops = sum(nd.flops for nd in graph.nodes if nd.primitive == "dot_general")
    config = MegatronConfig(dp=n, tp=1, pp=1, num_microbatches=microbatches)
    plan = megatron_plan_for_graph(graph, cluster, config)
    cost = plan.stages[0].sharding.cost
    print(f"gpt-{model} dp={n} microbatches={microbatches} on {cluster.name} x{num_hosts}")
    print(f"  compute per microbatch        {cost.compute:.4f} s")
    print(f"  communication per microbatch  {cost.communication:.4f} s")
    print(f"  resharding per microbatch     {cost.resharding:.4f} s")
    print(f"  matmuls alone at 0.7 x 312 TFLOP/s  {dot_flops / n / (0.7 * 312e12):.4f} s")
    dots = [nd for nd in graph.nodes if nd.primitive == "dot_general"]
    table = sum(
        compute_time(nd.flops / n, 0, cluster, rate_dtype(nd.primitive, [
            graph.vars[v].dtype for v in nd.inputs], "float32"), matmul=True)
        for nd in dots
    )
    print(f"  matmuls alone at the profile's GEMM efficiency table  {table:.4f} s")
    print(f"  predicted step time           {plan.predicted_step_time:.4f} s")


if __name__ == "__main__":
    main(*(t(a) for t, a in zip((str, int, int), sys.argv[1:])))
