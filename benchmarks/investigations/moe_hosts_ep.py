"""Why does the search split the expert widths, not the experts, across two DGX H100
hosts?

    python -m benchmarks.investigations.moe_hosts_ep [--batch 8]

Two DeepSeek-V3 layers (256 routed experts 7168 -> 2048, top-8, a shared expert; 1,024
tokens a sequence, bf16) planned on one (4, 4) mesh of 2 `dgx-h100` hosts (the x axis
spans the hosts) twice: searched freely, and with every expert weight pinned split over
experts on both axes (`constraints=`; the rest searched). Prints each plan's predicted
step, its compute / collectives / resharding, its collectives by kind (count, bytes) and
the expert weights' specs, then each grouped GEMM's expert-parallel strategy costs.

Reading it: the expert-parallel plan dispatches the routed rows once per expert MLP and
combines them once (`autopar.intra._moe_regions`; each grouped GEMM's strategy carries its
share), as DeepSeek-V3 and Megatron-Core do. What it still pays beyond them is the token
permutation: the sorted rows are gathered from the tokens of every device (an all-gather
of the tokens before the gather) and scattered back with a resharding all-to-all after the
scatter-add, where Megatron-Core permutes each device's own tokens before its dispatch.
With batch 8: 39.4 ms searched (expert widths split) against 43.9 ms with experts
pinned (48.2 ms priced with a dispatch and a combine per grouped GEMM); batch 16: 61.1
against 66.1 ms; batch 32: 103.8 against 109.5 ms.

Rerun with one dispatch per expert MLP (``moe_dispatch="mlp"``, the default): the same
39.4 against 43.9 ms, so the search still keeps the experts whole. The differences it
prints: the EP plan saves 4.4 ms of compute, 4.9 ms of reduce-scatter and 3.0 ms of
all-reduce, and pays 9.8 ms more all-to-all (41 against 1) and 7.0 ms more all-gather
(41 against 23, 1.49 against 0.73 GB). The layouts it prints say where: in the EP plan
the gather of the sorted rows (65,536 x 7,168, split over both axes) and its backward
scatter-add read and write the 8,192 tokens in another layout, so every layer moves the
tokens across both hosts before its dispatch and after its combine, on top of the
region's own dispatch/combine. That is what the model's global permutation (one
`argsort` over all the step's routed copies) costs when partitioned; it is priced as
XLA runs it, so no pricing term is wrong. Megatron-Core sorts each device's own tokens
and sends only its routed copies; doing that here needs the permutation's gather and
scatter-add lowered as a local sort plus the dispatch all-to-all, not a cost change.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

import autopar  # noqa: E402
from autopar.graph import trace  # noqa: E402
from autopar.intra._scan import opened_body  # noqa: E402
from autopar.intra._strategies import CostContext  # noqa: E402
from autopar.intra._strategies_moe import expert_parallel_strategies  # noqa: E402
from autopar.report._differences import explain_differences  # noqa: E402
from examples import moe_dropless as moe  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(moe.CONFIGS["deepseek-v3"], num_layers=2, vocab_size=32000,
                              seq_len=1024, dtype="bfloat16")
    optimizer = optax.adamw(1e-3)
    step = moe.make_train_step(cfg, optimizer)
    state, batch = moe.abstract_state(cfg, optimizer), moe.abstract_batch(cfg, args.batch)
    cluster = autopar.Cluster.from_profile("dgx-h100", num_hosts=2)

    def experts_over_experts(path, leaf):
        if "experts" in jax.tree_util.keystr(path) and leaf.ndim == 4:
            return PartitionSpec(None, ("x", "y"), None, None)
        return None

    pins = (jax.tree_util.tree_map_with_path(experts_over_experts, state), None)
    graph = trace(step, state, batch)
    plans = []
    for label, extra in (("searched", {}), ("experts pinned over experts",
                                            {"constraints": pins})):
        plan = autopar.plan(step, state, batch, cluster=cluster, method="shard",
                            mesh_shape=(4, 4), cache=False, **extra)
        cost = plan.stages[0].sharding.cost
        print(f"{label}: {plan.predicted_step_time * 1e3:.1f} ms predicted (compute "
              f"{cost.compute * 1e3:.1f}, collectives {cost.communication * 1e3:.1f}, "
              f"resharding {cost.resharding * 1e3:.1f} ms)")
        print("  collectives: " + ", ".join(
            f"{kind} {int(n)} x, {nbytes / 1e9:.2f} GB"
            for kind, (n, nbytes) in sorted(cost.collectives.items())))
        print("  expert weights: " + ", ".join(
            f"{i.path.rsplit('/', 1)[-1]} {i.spec}" for i in plan.inputs
            if i.path.startswith("params/layers/experts/")))
        print("  token permutation and grouped GEMMs (layer scan body: node, result spec):")
        print("\n".join(_permutation_layouts(plan, graph)))
        plans.append(plan)
    print(explain_differences(*plans, first_graph=graph, second_graph=graph,
                              devices_per_host=cluster.devices_per_host, top=8))
    sharding = plan.stages[0].sharding
    ctx = CostContext(cluster, sharding.mesh)
    print("expert-parallel strategies per grouped GEMM (compute + collectives, ms):")
    for body_plan in sharding.scan_bodies:
        body = opened_body(graph.nodes[body_plan.node].params)
        for node in body.nodes:
            if node.primitive != "ragged_dot_general":
                continue
            shapes = [body.vars[v].shape for v in node.inputs[:2]]
            costs = ", ".join(f"{s.name} {s.compute_cost * 1e3:.3f} + {s.comm_cost * 1e3:.3f}"
                              for s in expert_parallel_strategies(node, body, ctx))
            print(f"  {shapes}: {costs}")


def _permutation_layouts(plan, graph) -> list[str]:
    """The result layout of each sort, gather, scatter-add and grouped GEMM of the layer
    scan's body (forward and backward), where the token permutation shows: a gather of
    the sorted rows whose token operand is whole reads every device's tokens."""
    out = []
    for body_plan in plan.stages[0].sharding.scan_bodies:
        body = opened_body(graph.nodes[body_plan.node].params)
        for index, node in enumerate(body.nodes):
            if node.primitive in ("sort", "gather", "scatter-add", "ragged_dot_general"):
                v = node.outputs[0]
                out.append(f"    {index:4d} {node.primitive:<19} {body.vars[v].shape} "
                           f"{body_plan.var_specs[v]}")
    return out


if __name__ == "__main__":
    main()
