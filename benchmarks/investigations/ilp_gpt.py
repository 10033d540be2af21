"""ILP build and solve time for GPT train graphs on a (2, 4) mesh.

Prints, for one GPT-2-small layer's train graph (forward, backward and its update, as the
layer-wise planner solves it) and for a whole GPT-2-small train step (12 layers, as
`method="shard"` solves it): nodes, ILP variables before and after follower merging, build
and solve seconds.

    python benchmarks/investigations/ilp_gpt.py [--layers 12] [--skip-full]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import optax  # noqa: E402

from autopar.cluster import Cluster, LogicalMesh  # noqa: E402
from autopar.graph import (
    tied_state,  # noqa: E402
    trace,  # noqa: E402
)
from autopar.inter._layer_graphs import _tied_in  # noqa: E402
from autopar.inter._layer_table import LayerCostTable  # noqa: E402
from autopar.inter.passes._layers import assign_layers  # noqa: E402
from autopar.intra import ShardOptions, plan_on_mesh  # noqa: E402
from examples import gpt  # noqa: E402


def report(name, graph, plan):
    s = plan.stats
    print(
        f"{name:<28} nodes {len(graph.nodes):>6}  ILP vars {s['num_variables_before_merge']:>9,}"
        f" -> {s['num_variables']:>8,}  build {s['build_time']:6.2f} s  "
        f"solve {s['solve_time']:6.2f} s  ({s['status']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args()
    cfg = dataclasses.replace(gpt.CONFIGS["125M"], num_layers=args.layers, layer_markers=True)
    opt = optax.adamw(1e-4)
    cluster = Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    mesh = LogicalMesh.create((2, 4))
    step = gpt.make_train_step(cfg, opt)
    abstract = (gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, args.batch))
    graph = trace(step, *abstract)
    tied = tied_state(graph, (0,))
    table = LayerCostTable(graph, assign_layers(graph), cluster, ShardOptions(), tied)
    layer = table.per_layer.stage_graphs[1]
    plan = plan_on_mesh(layer, cluster, mesh, ShardOptions(), _tied_in(layer, tied))
    report("one GPT-2-small layer", layer, plan)
    if not args.skip_full:
        start = time.perf_counter()
        plan = plan_on_mesh(graph, cluster, mesh, ShardOptions(), tied)
        report(f"GPT-2-small, {args.layers} layers", graph, plan)
        print(f"  total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
