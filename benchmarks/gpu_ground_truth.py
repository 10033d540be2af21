"""Ground truth on one GPU (issue 14, item 8): measure a cost profile and GPT train steps
there, then set the cost model's predicted step time beside the measured one.

Two parts, so that the GPU is held only while measuring:

``measure`` (on the GPU machine)::

    PYTHONPATH=. python benchmarks/gpu_ground_truth.py measure --out DIR

runs ``autopar profile --devices 1`` (written to ``DIR/profile.json``), then times the
train step of examples/gpt.py in bfloat16 with fp32 master weights and AdamW moments
(``GPTConfig(dtype="bfloat16", master_dtype="float32")``, the step jitted with its state
donated) for each of `STEPS` (model, batch) in turn, until ``--budget`` seconds have
passed. Per step: compile time, XLA's memory analysis, the peak bytes the device held, the
median of `TIMED_STEPS` steps each waited for, and the mean of as many steps run back to
back (the throughput a training loop gets, dispatch hidden behind the GPU). The first two
steps also leave a profiler trace (perfetto JSON) and their optimized HLO in DIR.
Everything goes to ``DIR/steps.json``, written after every step.

``predict`` (anywhere, no GPU)::

    PYTHONPATH=. python benchmarks/gpu_ground_truth.py predict DIR [--profile P]

traces the same steps, plans each on one device of the profile measured there (or `P`)
and prints predicted and measured step time side by side, with XLA's and the planner's
memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (model, batch) in the order measured: the two of the issue first, then more sizes and a
# larger batch, each a check the first two did not see.
STEPS = (("350M", 8), ("1.3B", 8), ("125M", 8), ("760M", 8), ("350M", 16), ("2.6B", 4))
TIMED_STEPS = 10
WARMUP_STEPS = 3
TRACED = 2  # the first steps of STEPS also leave a trace and their HLO


def _config(model: str):
    from examples import gpt

    return dataclasses.replace(gpt.CONFIGS[model], dtype="bfloat16", master_dtype="float32")


def _train_step(model: str, batch: int):
    """The train step and its abstract (state, batch), as measured and as predicted."""
    import optax

    from examples import gpt

    cfg = _config(model)
    optimizer = optax.adamw(1e-4)
    step = gpt.make_train_step(cfg, optimizer)
    return cfg, optimizer, step, (gpt.abstract_state(cfg, optimizer),
                                  gpt.abstract_batch(cfg, batch))


# ---- measure (on the GPU) -------------------------------------------------------------


def measure(out: Path, budget: float, profile: bool, steps=STEPS) -> None:
    import jax

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    record = {"device_kind": device.device_kind, "platform": device.platform,
              "jax": jax.__version__, "steps": [], "started": time.strftime("%F %T")}
    _log(f"device {device.device_kind} ({device.platform}), jax {jax.__version__}")
    if profile:
        from autopar.app import cli

        t = time.perf_counter()
        cli.main(["profile", "--devices", "1", "--out", str(out / "profile.json")])
        record["profile_seconds"] = round(time.perf_counter() - t, 1)
    for i, (model, batch) in enumerate(steps):
        elapsed = time.perf_counter() - start
        if elapsed > budget:
            _log(f"budget of {budget:.0f} s spent ({elapsed:.0f} s): skipping {model} b{batch}")
            continue
        try:
            row = _measure_step(model, batch, out if i < TRACED else None)
        except Exception as e:  # noqa: BLE001 - keep what was measured, report the rest
            row = {"model": model, "batch": batch, "error": f"{type(e).__name__}: {e}"}
            _log(f"{model} b{batch} failed: {row['error']}")
        record["steps"].append(row)
        (out / "steps.json").write_text(json.dumps(record, indent=1))
    record["seconds"] = round(time.perf_counter() - start, 1)
    (out / "steps.json").write_text(json.dumps(record, indent=1))


def _measure_step(model: str, batch: int, keep: Path | None) -> dict:
    import jax

    from examples import gpt

    cfg, optimizer, step, _ = _train_step(model, batch)
    device = jax.devices()[0]
    state = jax.jit(lambda key: gpt.init_state(cfg, optimizer, key))(jax.random.key(0))
    data = jax.jit(lambda key: gpt.make_batch(cfg, batch, key))(jax.random.key(1))
    t = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0,)).lower(state, data).compile()
    row = {"model": model, "batch": batch, "params": cfg.num_params,
           "compile_seconds": round(time.perf_counter() - t, 1)}
    row["xla_memory"] = _memory_analysis(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row["xla_flops"] = float((cost or {}).get("flops", 0.0))
    for _ in range(WARMUP_STEPS):
        state, metrics = compiled(state, data)
    jax.block_until_ready(state)
    waited = []
    for _ in range(TIMED_STEPS):
        t = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(state)
        waited.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(TIMED_STEPS):
        state, metrics = compiled(state, data)
    jax.block_until_ready(state)
    row["back_to_back_seconds"] = (time.perf_counter() - t) / TIMED_STEPS
    row["waited_seconds"] = waited
    row["median_waited_seconds"] = statistics.median(waited)
    row["loss"] = float(metrics["loss"])
    row["peak_bytes_in_use"] = (device.memory_stats() or {}).get("peak_bytes_in_use")
    _log(f"{model} b{batch}: {row['back_to_back_seconds'] * 1e3:.2f} ms back to back, "
         f"{row['median_waited_seconds'] * 1e3:.2f} ms waited, compile "
         f"{row['compile_seconds']} s, loss {row['loss']:.3f}")
    if keep is not None:
        name = f"{model}-b{batch}"
        with gzip.open(keep / f"hlo-{name}.txt.gz", "wt") as f:
            f.write(compiled.as_text())
        try:
            row["trace"] = _trace(compiled, state, data, keep / f"trace-{name}.json.gz")
        except Exception as e:  # noqa: BLE001 - a trace is a diagnostic, not the figure
            row["trace_error"] = f"{type(e).__name__}: {e}"
    del state, compiled
    return row


def _trace(compiled, state, data, path: Path) -> str:
    """Run 3 steps under the JAX profiler; keep its perfetto trace at `path`."""
    import jax

    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(3):
            state, _ = compiled(state, data)
        jax.block_until_ready(state)
    found = sorted(Path(folder).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {folder}")
    shutil.copy(found[-1], path)
    return path.name


def _memory_analysis(compiled) -> dict:
    analysis = compiled.memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {n: getattr(analysis, n, None) for n in names}


def _log(line: str) -> None:
    print(f"[gpu_ground_truth] {line}", file=sys.stderr, flush=True)


# ---- predict (anywhere) ---------------------------------------------------------------


def predict(measured_dir: Path, profile: str | None) -> list[dict]:
    import autopar
    from autopar.graph import trace
    from autopar.manual import MegatronConfig, megatron_plan_for_graph

    record = json.loads((measured_dir / "steps.json").read_text())
    cluster = autopar.Cluster.from_profile(profile or measured_dir / "profile.json",
                                           num_hosts=1, devices_per_host=1)
    print(f"{record['device_kind']}, jax {record['jax']}; profile {cluster.name} "
          f"({profile or measured_dir / 'profile.json'})")
    print(f"{'model':>6} {'batch':>5} {'measured ms':>11} {'predicted ms':>12} {'pred/meas':>9}"
          f" {'XLA GiB':>8} {'planner GiB':>11}")
    rows = []
    for row in record["steps"]:
        if "error" in row:
            print(f"{row['model']:>6} {row['batch']:>5}  failed: {row['error']}")
            continue
        _, _, step, args = _train_step(row["model"], row["batch"])
        graph = trace(step, *args, batch_argnums=(1,))
        plan = megatron_plan_for_graph(
            graph, cluster, MegatronConfig(dp=1, tp=1, pp=1, num_microbatches=1))
        measured = row["back_to_back_seconds"]
        xla = row["xla_memory"]
        xla_bytes = (xla["argument_size_in_bytes"] + xla["output_size_in_bytes"]
                     - xla["alias_size_in_bytes"] + xla["temp_size_in_bytes"])
        predicted_memory = plan.stages[0].sharding.cost.memory_per_device
        out = {"model": row["model"], "batch": row["batch"], "measured": measured,
               "predicted": plan.predicted_step_time, "xla_bytes": xla_bytes,
               "planner_bytes": predicted_memory}
        out["parts"] = predicted_parts(graph, cluster)
        if row.get("trace"):
            out["trace"] = trace_kernels(measured_dir / row["trace"])
        rows.append(out)
        print(f"{row['model']:>6} {row['batch']:>5} {measured * 1e3:>11.2f} "
              f"{out['predicted'] * 1e3:>12.2f} {out['predicted'] / measured:>9.3f} "
              f"{xla_bytes / 2**30:>8.2f} {predicted_memory / 2**30:>11.2f}")
    print("\nBy part, ms per step (predicted: matmuls / other operators / launches of the "
          "kernels counted; measured: the trace's GEMM kernels / other kernels / span - busy)")
    for out in rows:
        p, t = out["parts"], out.get("trace")
        line = (f"{out['model']:>6} b{out['batch']:<3} predicted {p['matmul'] * 1e3:8.2f} / "
                f"{p['other'] * 1e3:8.2f} / {p['launch'] * 1e3:6.2f} ({p['kernels']} kernels)")
        if t:
            line += (f"   measured {t['gemm'] * 1e3:8.2f} / {t['other'] * 1e3:8.2f} / "
                     f"{(t['span'] - t['busy']) * 1e3:6.2f} ({t['kernels']:.0f} kernels)")
        print(line)
    return rows


def _steps(text: str) -> tuple[tuple[str, int], ...]:
    pairs = [item.split(":") for item in text.split(",") if item]
    if not pairs or any(len(p) != 2 or not p[1].isdigit() for p in pairs):
        raise argparse.ArgumentTypeError(f"expected MODEL:BATCH,... (e.g. 350M:8), got {text!r}")
    return tuple((model, int(batch)) for model, batch in pairs)


def predicted_parts(graph, cluster) -> dict:
    """The one-device prediction of `graph` by part: seconds of the matmuls, of all other
    operators, and of the kernels' launches (`kernel_overhead` times the kernels the
    fusion model counts, `autopar.graph.kernel_roots`), each node at its replicated
    strategy's compute cost."""
    from autopar.cluster import LogicalMesh
    from autopar.cost import MATMUL_PRIMITIVES, kernel_launch_time
    from autopar.graph import kernel_roots
    from autopar.intra._strategies import CostContext, node_signature, node_strategies

    ctx = CostContext(cluster, LogicalMesh.create((1,), axis_names=("x",)))
    parts = {"matmul": 0.0, "other": 0.0}
    roots = kernel_roots(graph, cluster.fused_attention)
    for node in graph.nodes:
        strategies = node_strategies(node, graph, node_signature(node, graph), ctx)
        seconds = min(s.compute_cost for s in strategies) if strategies else 0.0
        if node.id in roots:
            seconds -= kernel_launch_time(cluster, 1)
        parts["matmul" if node.primitive in MATMUL_PRIMITIVES else "other"] += seconds
    parts["kernels"] = len(roots)
    parts["launch"] = kernel_launch_time(cluster, len(roots))
    return parts


# Substrings of the names of GEMM kernels (cuBLAS, cuBLASLt, CUTLASS, XLA's Triton GEMM
# fusions) in a GPU trace.
GEMM_KERNEL_NAMES = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "triton_gemm")


def trace_kernels(path: Path, steps: int = 3) -> dict | None:
    """Per step, from a perfetto trace `_trace` kept: the GPU kernels launched, the
    seconds they ran (GEMMs apart) and the span from the first kernel's start to the last
    one's end. None if the trace holds no GPU process."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
    if not kernels:
        return None
    def is_gemm(e):
        text = (e.get("name", "") + " " + json.dumps(e.get("args", {}))).lower()
        return any(k in text for k in GEMM_KERNEL_NAMES)
    busy = sum(e["dur"] for e in kernels) * 1e-6
    gemm = sum(e["dur"] for e in kernels if is_gemm(e)) * 1e-6
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) * 1e-6
    return {"kernels": len(kernels) / steps, "busy": busy / steps, "gemm": gemm / steps,
            "other": (busy - gemm) / steps, "span": span / steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="on the GPU: a profile and GPT steps")
    m.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-measured")))
    m.add_argument("--budget", type=float, default=300.0,
                   help="seconds after which no further step is started")
    m.add_argument("--no-profile", action="store_true", help="steps only")
    m.add_argument("--steps", type=_steps, default=STEPS, metavar="350M:8,1.3B:8",
                   help="(model, batch) pairs to time, in order (default: %(default)s)")
    p = sub.add_parser("predict", help="predicted against measured step time")
    p.add_argument("measured", type=Path, help="the folder `measure` wrote")
    p.add_argument("--profile", default=None, help="default: the folder's profile.json")
    p.add_argument("--write-docs", action="store_true",
                   help="replace docs/benchmarks.md's gpu_ground_truth section with this "
                   "comparison (stamped with commit, date, command and machine)")
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.out, args.budget, not args.no_profile, args.steps)
        return
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        predict(args.measured, args.profile)
    print(out.getvalue(), end="")
    if args.write_docs:
        from benchmarks._results import write_section

        write_section("gpu_ground_truth",
                      f"{DOCS_INTRO}\n```\n{out.getvalue().rstrip()}\n```\n",
                      machine_text=f"the measurements of {args.measured} (the GPU machine "
                      "named on its first line), predicted on " + _machine())


def _machine() -> str:
    from benchmarks._results import machine

    return machine()


DOCS_INTRO = """## Ground truth on one GPU

The train step of examples/gpt.py in bfloat16 with fp32 master weights and AdamW moments,
timed on one GPU (`measure`), beside the step time the cost model predicts on one device
of the profile `autopar profile` measured on the same GPU (`predict`).

How to read it: *pred/meas* is the prediction over the measurement (1 is exact); the
parts split both sides into matmuls, other operators and launches, so a miss can be
placed.
"""


if __name__ == "__main__":
    main()
