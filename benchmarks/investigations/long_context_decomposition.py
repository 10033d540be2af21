"""Why autopar's long-context plan and the grid's best differ: both plans of one
`bench_long_moe` row priced by the same cost model, decomposed side by side.

    python benchmarks/investigations/long_context_decomposition.py --row llama-8B-32k@8 \
        --grid tp=2,cp=4,mb=32

Prints, for the grid's configuration (`megatron_plan`, as `bench_long_moe`'s grid prices
it) and for `autopar.plan`'s own plan of the row's step (plus, with ``--auto-options``,
plans under fixed options, e.g. ``num_microbatches=32``):

- the step split (`autopar.report.time_split`): compute, recompute, communication by
  collective kind, pipeline bubble; microbatches, memory per device;
- per stage: mesh, CP algorithm and degree, remat, memory parts;
- per layer of each plan's stages (the layer plans the stage was stitched from): compute,
  collectives, resharding per microbatch, the CP split, the memory level, and for one
  transformer layer its compute and collectives by kind of node (attention's dots by
  role, its scale/mask/softmax, the other matmuls, the rest);
- the grid's attention core per layer as charged (the local piece times cp x the
  algorithm's computed share, `cost.context_core_time`) and, for the ring, the same ring
  as autopar's planner prices it (`ring_core_seconds`);
- `autopar.report.explain_differences` (the largest differences, ranked).

Plans only (shapes; nothing runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from autopar.cluster import Cluster, LogicalMesh  # noqa: E402
from autopar.cost import context_compute_fraction, context_core_time  # noqa: E402
from autopar.graph import trace  # noqa: E402
from autopar.inter._layer_table import LayerCostTable  # noqa: E402
from autopar.intra._attention_roles import attention_components  # noqa: E402
from autopar.intra._context import sequence_length  # noqa: E402
from autopar.intra._ring_strategies import (  # noqa: E402
    ring_core_nodes,
    ring_core_seconds,
    ring_core_strategies,
    ring_dots,
    ring_strategies,
)
from autopar.intra._strategies import (  # noqa: E402
    CostContext,
    node_signature,
    node_strategies,
)
from autopar.manual import AttentionShape, megatron_plan  # noqa: E402
from autopar.manual._context_experts import layer_graphs  # noqa: E402
from autopar.report import time_split  # noqa: E402
from autopar.report._differences import explain_differences  # noqa: E402
from autopar.search import microbatch_args  # noqa: E402
from autopar.search import plan as autopar_plan  # noqa: E402
from benchmarks.bench_long_moe import PROFILE, ROWS, model_step  # noqa: E402


def _grid_config(text: str) -> dict:
    """``tp=2,cp=4,mb=32[,pp=1][,recompute=full]`` -> `megatron_plan` keywords."""
    names = {"mb": "num_microbatches", "alg": "cp_algorithm"}
    out = dict(dp=1, tp=1, pp=1, cp=1, num_microbatches=1, recompute="none")
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        key = names.get(key, key)
        out[key] = value if key in ("recompute", "cp_algorithm") else int(value)
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def print_split(name: str, p) -> None:
    split = time_split(p)
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in split.parts().items() if v > 0)
    print(f"{name}: {p.predicted_step_time:.2f} s per step, {p.num_microbatches} mb, "
          f"{split.memory_per_device / 2**30:.1f} GiB per device")
    print(f"  step: {parts}")
    for i, stage in enumerate(p.stages):
        cost = stage.sharding.cost
        context = stage.sharding.context_parallel
        remat = sorted({str(r) for r in stage.remat}) or ["none"]
        print(f"  stage {i} layers {stage.layers}: mesh {tuple(stage.mesh.shape)}, "
              f"CP {context.algorithm} x{context.degree}, remat {'/'.join(remat)}; per "
              f"microbatch compute {_ms(cost.compute)} + collectives "
              f"{_ms(cost.communication)} + resharding {_ms(cost.resharding)}; "
              f"recompute {_ms(stage.recompute_time)}")
        kinds = ", ".join(f"{k} {n:g} x / {b / 2**30:.2f} GiB"
                          for k, (n, b) in sorted(cost.collectives.items()))
        print(f"    collectives per microbatch: {kinds}")
        if stage.memory_parts is not None:
            parts = stage.memory_parts
            print("    memory: " + ", ".join(
                f"{f} {getattr(parts, f) / 2**30:.1f} GiB"
                for f in ("state", "gradients", "activations", "working", "update",
                          "total")) + f" ({parts.in_flight:g} microbatches in flight)")


class LayerRecorder:
    """Records the layer plans each stage is stitched from
    (`autopar.inter._layer_table.LayerCostTable.stage_plan`): per call, the mesh shape,
    the memory level and per layer its `LayerCost` and plan."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __enter__(self):
        self._original = original = LayerCostTable.stage_plan
        calls = self.calls

        def recording(table, graph, stage_part, stage, layer_range, shape, mesh, tied,
                      level=0):
            layers = [(k, table.cost(k, shape, level), table.solved_plan(k, shape, level))
                      for k in range(*layer_range)]
            calls.append((tuple(shape), level, layers))
            return original(table, graph, stage_part, stage, layer_range, shape, mesh, tied,
                            level)

        LayerCostTable.stage_plan = recording
        return self

    def __exit__(self, *exc):
        LayerCostTable.stage_plan = self._original


def node_split(plan, graph, cluster) -> dict[str, list[float]]:
    """A layer plan's compute and collective seconds per microbatch by kind of node: the
    attention's dots by ring role (`ring_dots`), the other matmuls, the rest; each node's
    chosen strategy priced again (`node_strategies`, the ring's twins where chosen)."""
    ctx = CostContext(cluster, plan.mesh)
    dots = ring_dots(graph, sequence_length(graph))
    core = ring_core_nodes(dots)
    ring = plan.context_parallel.algorithm == "ring"
    out: dict[str, list[float]] = {}
    for node in graph.nodes:
        name = plan.node_strategies[node.id]
        sig = node_signature(node, graph)
        if sig is None or not name:
            continue
        strategies = node_strategies(node, graph, sig, ctx)
        if node.id in dots and name.endswith(" ring"):
            role, roles = dots[node.id]
            strategies = ring_strategies(node, graph, role, roles, strategies, ctx, True)
        elif node.id in core and ring:
            strategies = ring_core_strategies(node, core[node.id], strategies, plan.mesh)
        chosen = next((x for x in strategies if x.name == name), None)
        if chosen is None:
            continue
        kind = (f"attention {dots[node.id][0]}" if node.id in dots
                else "attention scale/mask/softmax" if node.id in core
                else "other matmuls" if node.primitive == "dot_general" else "other ops")
        entry = out.setdefault(kind, [0.0, 0.0])
        entry[0] += chosen.compute_cost
        entry[1] += chosen.comm_cost
    return out


def print_layers(p, recorder: LayerRecorder, cluster, layers_shown=(1,)) -> None:
    """The layer plans of `p`'s stages (the last stitch calls, one per stage), runs of
    equal layers folded."""
    for s, (shape, level, layers) in enumerate(recorder.calls[-p.num_stages:]):
        print(f"  stage {s} on {shape} at memory level {level}, per layer and microbatch:")
        rows = []
        for k, cost, (plan, _) in layers:
            c, context = plan.cost, plan.context_parallel
            key = (f"latency {_ms(cost.latency)} (compute {_ms(c.compute)}, collectives "
                   f"{_ms(c.communication)}, resharding {_ms(c.resharding)}), CP "
                   f"{context.algorithm} x{context.degree}, state "
                   f"{cost.state_memory / 2**30:.2f} GiB, gradients "
                   f"{cost.gradient_memory / 2**30:.2f} GiB, kept activations "
                   f"{cost.activation_memory / 2**30:.2f} GiB, peak "
                   f"{cost.memory / 2**30:.1f} GiB")
            if rows and rows[-1][1] == key:
                rows[-1][0].append(k)
            else:
                rows.append(([k], key))
        for ks, key in rows:
            span = f"{ks[0]}" if len(ks) == 1 else f"{ks[0]}-{ks[-1]}"
            print(f"    layer {span}: {key}")
        for k, _, (plan, solved_on) in layers:
            if k not in layers_shown:
                continue
            split = node_split(plan, solved_on, cluster)
            print(f"    layer {k} by node (compute / collectives, as each chosen strategy "
                  "prices them): " + "; ".join(
                      f"{kind} {_ms(c)} / {_ms(m)}" for kind, (c, m) in sorted(split.items())))


def grid_core(grid, recorder: LayerRecorder, cluster, config: dict, row, step,
              step_args, layer: int = 1) -> None:
    """The grid's attention core per layer and microbatch as it is charged: its local
    trace's dots and scale/mask/softmax at one CP rank's (s/cp)^2 piece (the layer plan's
    nodes priced again, `node_split`) and the rank's real core,
    `cost.context_core_time` (cp x `context_compute_fraction` of the algorithm times the
    local core, dots and element-wise work alike: as autopar's ring twins price the
    ring), which `context_terms` charges."""
    cp, algorithm = config["cp"], config.get("cp_algorithm", "ring")
    if cp == 1:
        return
    shape, level, layers = recorder.calls[-1]
    k, _, (plan, solved_on) = next(x for x in layers if x[0] == layer)
    split = node_split(plan, solved_on, cluster)
    dots = sum(c for kind, (c, _) in split.items()
               if kind.startswith("attention") and "softmax" not in kind)
    softmax = split.get("attention scale/mask/softmax", [0.0])[0]
    charged = context_core_time(dots + softmax, algorithm, cp)
    print(f"  grid attention core per layer and microbatch (layer {k}): local dots "
          f"{_ms(dots)} + local scale/mask/softmax {_ms(softmax)}; charged {_ms(charged)} "
          f"(cp x context_compute_fraction({algorithm!r}, {cp}) = "
          f"{cp * context_compute_fraction(algorithm, cp):.3g} x the local core)")
    if algorithm != "ring":
        return
    # The same ring as autopar's planner prices it: the step at the whole sequence (one
    # microbatch), queries over a context axis of cp, heads over tp, on the layer's
    # sub-graph (`ring_core_seconds`).
    args = microbatch_args(step_args, (1,), config["num_microbatches"])
    full = trace(step, *args, batch_argnums=(1,))
    sub = next(g for g in layer_graphs(full) if attention_components(g, row.seq_len))
    dp, tp = config["dp"], config["tp"]
    mesh = LogicalMesh.create((dp, cp, tp), range(dp * cp * tp),
                              ("data", "context", "model"))
    ring = ring_core_seconds(sub, cluster, mesh, row.seq_len, "context")
    print(f"  the same ring as autopar's planner prices it (ring_core_seconds): "
          f"{_ms(ring)}; grid / autopar {charged / ring:.4f} (the grid scales its local "
          "piece, GEMM efficiency and kernel launches with it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama-8B-32k@8")
    parser.add_argument("--grid", default="tp=2,cp=4,mb=32",
                        help="the grid's configuration: tp=..,cp=..,mb=..[,pp=..,dp=..,"
                        "recompute=..]")
    parser.add_argument("--auto-options", action="append", default=[],
                        help="plan with these `autopar.plan` options instead of its defaults, "
                        "e.g. num_microbatches=32 (repeatable; one plan each; '' for the "
                        "defaults)")
    parser.add_argument("--grid-only", action="store_true",
                        help="decompose the grid's plan alone (no autopar.plan)")
    args = parser.parse_args()
    row = next(r for r in ROWS if r.key == args.row)
    cfg, step, step_args = model_step(row)
    cluster = Cluster.from_profile(PROFILE, num_hosts=row.num_hosts)
    attention = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               cfg.num_layers)
    start = time.perf_counter()
    with LayerRecorder() as recorder:
        grid = megatron_plan(step, *step_args, cluster=cluster, sequence_parallel=True,
                             distributed_optimizer=True, attention=attention,
                             **_grid_config(args.grid))
    print(f"[grid planned in {time.perf_counter() - start:.0f} s]")
    print_split(f"grid {grid.method}", grid)
    print_layers(grid, recorder, cluster)
    config = _grid_config(args.grid)
    grid_core(grid, recorder, cluster, config, row, step, step_args)
    plans = []
    for text in [] if args.grid_only else args.auto_options or [""]:
        options = {}
        for item in filter(None, text.split(",")):
            key, value = item.split("=")
            options[key] = int(value) if value.isdigit() else value
        start = time.perf_counter()
        with LayerRecorder() as recorder:
            p = autopar_plan(step, *step_args, cluster=cluster, cache=False, **options)
        print(f"[autopar {options or 'default'} planned in "
              f"{time.perf_counter() - start:.0f} s]")
        print_split(f"autopar {options or 'default'}", p)
        print_layers(p, recorder, cluster)
        plans.append(p)
        print(explain_differences(grid, p, top=5))


if __name__ == "__main__":
    main()
