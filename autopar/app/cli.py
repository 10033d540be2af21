"""The ``autopar`` command line.

Each subcommand is two small functions: ``_add_<name>(subparsers)`` declares its arguments
and ``_run_<name>(args) -> int`` runs it; `build_parser` lists the ``_add_*`` functions.
Subcommands import JAX-heavy modules inside ``_run_*``, after the process set-up they need.

    autopar profile [--out FILE.json] [--quick] [--devices N] [--clock wall|cpu-per-core]
                    [--coordinator HOST:PORT --num-processes P --process-id I]
    autopar demo [--out-dir DIR] [--steps N] [--method M] [--mesh-shape 2,4] [--no-pictures]
    autopar plan --model NAME [--profile P] [--hosts H] [--devices-per-host D] [--batch B]
                 [--seq-len N] [--method M] [--mesh-shape 2,4] [--microbatches N|auto]
                 [--schedule S] [--remat R] [--memory-budget 40GiB]
                 [--out FILE.json] [--layout FILE.png] [--quiet | --verbose]
    autopar launch -n N [--devices-per-process K] [--log-dir DIR] -- python script.py ...
    autopar compare --model NAME [--profile P] [--hosts H] [--devices-per-host D]
                    [--batch B] [--seq-len N] [--memory-budget 40GiB] [--yours FILE]
                    [--configs dp2tp4,dp8tp1] [--no-auto] [--quiet | --verbose]
    autopar space --model NAME [--profile P] [--hosts H] [--devices-per-host D]
                  [--batch B] [--seq-len N] [--memory-budget 40GiB] [--budgets 0.5,0.75]
                  [--out DIR] [--quiet | --verbose]

Progress messages of the planner (the ``autopar`` logger, INFO) go to stderr; ``--quiet``
shows only warnings and errors, ``--verbose`` also the planner's details (DEBUG).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

# On a machine without an accelerator, the CLI measures this many virtual CPU devices.
DEFAULT_CPU_DEVICES = 8
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def main(argv: list[str] | None = None) -> int:
    """Run the ``autopar`` command line with `argv` (default: ``sys.argv[1:]``).

    **Returns:** the exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    import logging

    from autopar._progress import show_progress

    level = {"quiet": logging.WARNING, "verbose": logging.DEBUG}.get(
        getattr(args, "output", None), logging.INFO)
    try:
        with show_progress(level=level):
            return args.run(args)
    except ValueError as e:  # a user mistake: the message says what to do
        parser.exit(2, f"autopar: error: {e}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Alpa-style automatic data, operator and pipeline parallelism for JAX.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_command in (_add_profile, _add_demo, _add_plan, _add_compare, _add_space,
                        _add_launch):
        add_command(subparsers)
    return parser


def _add_profile(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure the local devices into a cost profile JSON",
        description=(
            "Measure matmul FLOP/s, memory bandwidth and collective latency/bandwidth of the "
            "local devices and write a cost profile that Cluster.from_profile(path) loads. "
            "Without an accelerator, runs on --devices virtual CPU devices. Under "
            "jax.distributed (several processes), also measures the inter-host level."
        ),
    )
    parser.add_argument(
        "--out",
        metavar="FILE.json",
        help="where to write the profile (default: $AUTOPAR_PROFILE, else "
        "~/.cache/autopar/local-profile.json: where Cluster.local() looks)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and repeats (a few seconds)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help=f"measure the first N devices of each process; on CPU, make N virtual devices "
        f"(default: all devices; {DEFAULT_CPU_DEVICES} on CPU)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu-per-core"),
        default="wall",
        help="time by the wall clock (default), or by this process's CPU seconds over the "
        "cores a program keeps busy: on a machine shared with other jobs, the time with the "
        "machine to yourself",
    )
    parser.add_argument(
        "--gemm-shapes",
        action="store_true",
        help="on CPU, also time GEMMs by shape (a 16..1024 grid of M, N, K; about 80 s); "
        "accelerators always do",
    )
    group = parser.add_argument_group(
        "several hosts",
        "run the same command on every host (or process) to also measure the inter-host "
        "level; every process writes process 0's figures",
    )
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0, for jax.distributed.initialize")
    group.add_argument("--num-processes", type=int, metavar="P", help="number of processes")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")
    parser.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    if args.devices is not None and args.devices < 1:
        raise SystemExit(f"autopar profile: --devices must be >= 1, got {args.devices}")
    use_virtual_cpu_devices(args.devices or DEFAULT_CPU_DEVICES)
    if args.coordinator:
        _initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    from autopar.cluster import local_profile_path
    from autopar.profile import FULL, QUICK, measure_profile

    out = args.out or local_profile_path()
    start = time.perf_counter()
    options = dataclasses.replace(QUICK if args.quick else FULL, clock=args.clock,
                                  gemm_shapes_on_cpu=args.gemm_shapes)
    result = measure_profile(options, devices=_devices(args.devices))
    result = _with_task_overhead(result)
    result.save(out)
    cluster = result.cluster
    print(
        f"wrote {out} in {time.perf_counter() - start:.1f} s: "
        f"{cluster.num_hosts} host(s) x {cluster.devices_per_host} {cluster.device_kind}, "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in cluster.peak_flops.items())
        + f", memory {cluster.hbm_bandwidth / 1e9:.2f} GB/s"
        + "".join(
            f", {name} {link.bandwidth / 1e9:.3f} GB/s + {link.latency * 1e6:.1f} us per step"
            for name, link in (("intra-host", cluster.intra_host),
                               ("inter-host", cluster.inter_host))
        )
    )
    return 0


def _with_task_overhead(result):
    """`result` with `dispatch_overhead` the pipeline runtime's host time per task and
    `task_device_overhead` its device threads' CPU per task and device, measured through
    it (`measure_task_overhead`); the trivial call's figure stays in `measured`.
    Unchanged where the probe does not run (one device, several processes)."""
    from autopar.app._task_overhead import measure_task_overhead
    from autopar.profile._measure import ProfileResult, _log_to_stderr

    overhead = measure_task_overhead(result.cluster, _log_to_stderr)
    if overhead is None:
        return result
    cluster = dataclasses.replace(result.cluster, dispatch_overhead=overhead.host,
                                  task_device_overhead=overhead.device)
    measured = {**result.measured, "trivial_call_dispatch": result.cluster.dispatch_overhead}
    return ProfileResult(cluster, result.note, measured)


def _devices(per_process: int | None) -> list:
    """The first `per_process` devices of every process (all if None), in cluster order."""
    from autopar.cluster import local_devices

    devices = local_devices()
    if per_process is None:
        return devices
    by_process: dict[int, list] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    if any(len(owned) < per_process for owned in by_process.values()):
        raise SystemExit(
            f"autopar profile: --devices {per_process} but a process has only "
            f"{min(len(owned) for owned in by_process.values())} devices "
            "(JAX was already initialised with fewer)"
        )
    return [d for owned in by_process.values() for d in owned[:per_process]]


def _initialize_distributed(coordinator: str, num_processes: int | None,
                            process_id: int | None) -> None:
    """Join the other processes with ``jax.distributed`` (gloo collectives on CPU)."""
    if num_processes is None or process_id is None:
        raise SystemExit("autopar profile: --coordinator needs --num-processes and --process-id")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def _add_demo(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="plan and train a small GPT on the local devices, beside one device",
        description=(
            "Plan a small GPT (examples/gpt.py) with @autopar.autoparallel on the local "
            f"devices ({DEFAULT_CPU_DEVICES} virtual CPU devices without an accelerator), "
            "print the plan, train a few steps beside the same step on one device, and "
            "write plan.json, plan_explain.txt and plan_layout.png. Exits with 1 if the "
            "losses differ by more than a float32 tolerance."
        ),
    )
    parser.add_argument("--out-dir", default=".", metavar="DIR",
                        help="where to write the plan and its pictures (default: .)")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="training steps (default: 5)")
    parser.add_argument("--method", default="auto", choices=_methods(),
                        help="the autoparallel method (default: auto)")
    parser.add_argument("--mesh-shape", type=_mesh_shape, default=None, metavar="2,4",
                        help="fix the logical mesh shape (default: try every shape)")
    parser.add_argument("--no-pictures", action="store_true",
                        help="do not draw plan_layout.png (no matplotlib needed)")
    _add_output_flags(parser)
    parser.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    use_virtual_cpu_devices(DEFAULT_CPU_DEVICES)
    from autopar.app._demo import DEFAULT_STEPS, LOSS_TOLERANCE, run_demo

    start = time.perf_counter()
    result = run_demo(
        args.out_dir,
        num_steps=DEFAULT_STEPS if args.steps is None else args.steps,
        method=args.method,
        mesh_shape=args.mesh_shape,
        pictures=not args.no_pictures,
    )
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0 if result.max_difference <= LOSS_TOLERANCE else 1


def _add_plan(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan an example model on a virtual cluster (a dry run, no devices needed)",
        description=(
            "Plan a named example model on a cluster described by a cost profile, with "
            "autopar.plan on abstract arguments (nothing is allocated), print the plan and "
            "write it as JSON. Models are <family>-<size>: gpt, moe, wide_resnet, mlp or llama "
            "and a size of that example's CONFIGS, e.g. gpt-1.3B, moe-tiny, wide_resnet-250M, "
            "mlp-tiny, llama-8B. Large models can take long to plan."
        ),
    )
    _add_model_flags(parser, "e.g. gpt-1.3B, moe-380M, wide_resnet-tiny, mlp-tiny, llama-8B")
    parser.add_argument("--method", default="auto", choices=_methods(),
                        help="the planning method (default: auto)")
    parser.add_argument("--mesh-shape", type=_mesh_shape, default=None, metavar="2,4",
                        help="fix the logical mesh shape (default: try every shape)")
    _add_sequence_flag(parser)
    _add_planning_flags(parser)
    parser.add_argument("--out", default="plan.json", metavar="FILE.json",
                        help="where to write the plan (default: plan.json)")
    parser.add_argument("--layout", default=None, metavar="FILE.png",
                        help="also draw the layout picture there (needs matplotlib)")
    _add_output_flags(parser)
    parser.set_defaults(run=_run_plan)


def _add_model_flags(parser, model_help: str) -> None:
    """The flags naming an example model and the virtual cluster it is planned on (`plan`,
    `compare`, `space`): --model, --profile, --hosts, --devices-per-host, --batch."""
    parser.add_argument("--model", required=True, metavar="NAME", help=model_help)
    parser.add_argument("--profile", default="dgx-a100-80g", metavar="P",
                        help="a cost profile name or JSON path (default: dgx-a100-80g)")
    parser.add_argument("--hosts", type=int, default=None, metavar="H",
                        help="number of hosts (default: the profile's)")
    parser.add_argument("--devices-per-host", type=int, default=None, metavar="D",
                        help="devices per host (default: the profile's)")
    parser.add_argument("--batch", type=int, default=8, metavar="B",
                        help="global batch size (default: 8)")


def _check_host_counts(args: argparse.Namespace) -> None:
    """--hosts and --devices-per-host, when given, are at least 1."""
    for flag, value in (("--hosts", args.hosts), ("--devices-per-host", args.devices_per_host)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def _add_sequence_flag(parser) -> None:
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help="tokens per sequence (gpt, llama, moe; default: the size's own, "
                        "e.g. 2048 for gpt-1.3B)")


def _add_planning_flags(parser) -> None:
    """The planning options a user tries first (`autopar.PlanOptions`)."""
    from autopar.choices import REMAT_OPTIONS, SCHEDULE_OPTIONS

    parser.add_argument("--microbatches", type=_microbatches, default="auto",
                        metavar="N|auto",
                        help="microbatches per step, a number dividing the batch, or auto "
                        "(default: auto, searched)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULE_OPTIONS,
                        help="the pipeline schedule (default: 1f1b)")
    parser.add_argument("--remat", default="auto", choices=REMAT_OPTIONS,
                        help="what layers recompute in the backward (default: auto, only "
                        "where a stage would not fit otherwise)")
    _add_memory_budget_flag(parser)


def _add_memory_budget_flag(parser) -> None:
    parser.add_argument("--memory-budget", type=_memory, default=None, metavar="40GiB",
                        help="memory per device plans may use, with a unit: 40GiB, 512MiB, "
                        "80GB (default: the profile's device memory)")


def _add_output_flags(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quiet", "-q", dest="output", action="store_const", const="quiet",
                       help="print only the result, warnings and errors")
    group.add_argument("--verbose", "-v", dest="output", action="store_const",
                       const="verbose", help="also the planner's details and every "
                       "parameter's layout")


def _microbatches(text: str) -> int | str:
    """``"auto"`` or a positive int, for ``--microbatches``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of microbatches; write a positive integer dividing "
            "the batch, e.g. 4, or auto")
    return value


def _memory(text: str) -> float:
    """``"40GiB"`` -> bytes, for ``--memory-budget``."""
    from autopar.cost._units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _planning_options(args: argparse.Namespace) -> dict:
    """The `PlanOptions` keywords the planning flags set."""
    options = dict(num_microbatches=args.microbatches, schedule=args.schedule,
                   remat=args.remat, memory_budget=args.memory_budget)
    if args.schedule == "interleaved_1f1b":
        options["virtual_stages"] = 2
    return options


def _warn(message: str) -> None:
    print(f"autopar: warning: {message}", file=sys.stderr)


def _run_plan(args: argparse.Namespace) -> int:
    from autopar.app._examples import named_model
    from autopar.cluster import Cluster
    from autopar.search import plan

    _check_host_counts(args)
    from autopar.report._why import batch_warnings

    model = named_model(args.model, args.batch, seq_len=args.seq_len)
    cluster = Cluster.from_profile(args.profile, args.hosts, args.devices_per_host)
    start = time.perf_counter()
    result = plan(model.train_step, model.abstract_state, model.abstract_batch,
                  cluster=cluster, method=args.method, mesh_shape=args.mesh_shape,
                  **_planning_options(args))
    if args.output != "quiet":
        print(result.explain(detail=2 if args.output == "verbose" else 1))
    for warning in batch_warnings(result):
        _warn(warning)
    result.save(args.out)
    written = [args.out]
    if args.layout:
        from autopar.report import plot_layout

        written.append(str(plot_layout(result, args.layout)))
    sequence = f", sequence {args.seq_len}" if args.seq_len else ""
    print(f"planned {args.model} (batch {args.batch}{sequence}) on {cluster.num_hosts} x "
          f"{cluster.devices_per_host} {cluster.name} in {time.perf_counter() - start:.1f} s: "
          f"predicted {result.predicted_step_time * 1e3:.4g} ms per step; "
          f"wrote {', '.join(written)}")
    return 0


def _methods() -> tuple[str, ...]:
    from autopar.choices import METHODS

    return METHODS


def _mesh_shape(text: str) -> tuple[int, ...]:
    """``"2,4"`` -> ``(2, 4)``, for ``--mesh-shape``."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a mesh shape; write sizes separated by commas, e.g. 2,4"
        ) from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"mesh sizes must be >= 1, got {text!r}")
    return shape


def _add_compare(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="autopar's plan beside the best Megatron-style plan of an example model, and why",
        description=(
            "Plan a named example model on a virtual cluster with autopar and with the full "
            "Megatron-LM grid (dp x tp x pp x sequence parallelism x distributed optimizer x "
            "recompute x interleaving x microbatches, pruned by Megatron's rules, each "
            "configuration planned on the step traced at its microbatch size); print both "
            "plans side by side, the layout each chose per layer group, the predicted time "
            "split, and the largest differences in seconds. With --configs, only those "
            "Megatron configurations are planned. A dry run on abstract arguments; nothing "
            "is allocated. The model is traced with its layers marked (layer_boundary)."
        ),
    )
    _add_model_flags(parser, "e.g. gpt-1.3B, moe-380M (see `autopar plan --help`)")
    parser.add_argument("--configs", type=_megatron_configs, default=None,
                        metavar="dp2tp4,dp8tp2pp4mb64,sp,zero1",
                        help="Megatron configurations dp<D>tp<T>[pp<P>][mb<M>], each followed "
                        "by its options sp, zero1, recompute=selective|full, interleaved=V, "
                        "all comma separated (default: the full grid)")
    parser.add_argument("--microbatch-sizes", type=_mesh_shape, default=None, metavar="1,2,4,8",
                        help="examples per microbatch per data-parallel rank the grid tries "
                        "(default: 1,2,4,8)")
    parser.add_argument("--auto-microbatches", type=int, default=None, metavar="M",
                        help="fix autopar's number of microbatches (default: searched)")
    parser.add_argument("--no-auto", action="store_true",
                        help="leave out the automatic plan (faster; no explanation)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write both Gantt charts and both layouts there (needs matplotlib)")
    parser.add_argument("--yours", default=None, metavar="FILE",
                        help="your own sharding of this model, as a plan saved by "
                        "autopar.score(...).save(FILE): shown first, with what autopar's "
                        "plan changes in it")
    _add_sequence_flag(parser)
    _add_memory_budget_flag(parser)
    _add_output_flags(parser)
    parser.set_defaults(run=_run_compare)


def _load_yours(path, graph_for):
    """The plan saved at `path` (`autopar.score(...).save`), checked against this model's
    step (a ValueError naming the mismatch); None without a path."""
    if path is None:
        return None
    from autopar.plan import Plan

    yours = Plan.load(path)
    for stage in yours.stages:
        stage.sharding.check_graph(graph_for(yours.num_microbatches))
    return yours


def _run_compare(args: argparse.Namespace) -> int:
    from autopar.app._examples import named_model
    from autopar.cluster import Cluster
    from autopar.graph import trace
    from autopar.report import compare
    from autopar.search import microbatch_args, plan

    model = named_model(args.model, args.batch, layer_markers=True, seq_len=args.seq_len)
    cluster = Cluster.from_profile(args.profile, args.hosts, args.devices_per_host)
    budget = {"memory_budget": args.memory_budget}
    start = time.perf_counter()
    abstract = (model.abstract_state, model.abstract_batch)
    graphs = {}

    def graph_for(m):  # the step traced at the microbatch size of m microbatches
        if m not in graphs:
            graphs[m] = trace(model.train_step, *microbatch_args(abstract, (1,), m))
        return graphs[m]

    seconds = {}
    hands = _megatron_plans(args, model, cluster, budget, graphs, graph_for, seconds)
    auto = None
    if not args.no_auto:
        t = time.perf_counter()
        options = dict(budget) if args.auto_microbatches is None else {
            "num_microbatches": args.auto_microbatches, **budget}
        auto = plan(model.train_step, *abstract, cluster=cluster, **options)
        seconds["autopar"] = time.perf_counter() - t
    yours = _load_yours(args.yours, graph_for)
    plans = ([yours] if yours else []) + hands + ([auto] if auto is not None else [])
    if not plans:
        raise ValueError("no plan to compare: every configuration was skipped (see above)")
    print(compare(plans, flops=graph_for(1).total_flops))
    _print_why(args, hands, auto, yours, graph_for, cluster, seconds)
    print("planning time: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
          + f"; compare in all {time.perf_counter() - start:.1f} s")
    print(f"compared {len(plans)} plan(s) of {args.model} on {cluster.num_hosts} x "
          f"{cluster.devices_per_host} {cluster.name}")
    return 0


def _megatron_plans(args, model, cluster, budget, graphs, graph_for, seconds) -> list:
    """`compare`'s hand-written plans, fastest first: the best of the Megatron grid (its
    table printed), or each of `args.configs` that applies; their planning time added to
    `seconds`."""
    from autopar.manual import megatron_grid_search, megatron_plan_for_graph

    t = time.perf_counter()
    if args.configs is None:
        sizes = args.microbatch_sizes or (1, 2, 4, 8)
        hand, grid = megatron_grid_search(
            model.train_step, model.abstract_state, model.abstract_batch, cluster=cluster,
            num_heads=getattr(model.config, "num_heads", None), microbatch_sizes=sizes,
            num_layers=getattr(model.config, "num_layers", None), traces=graphs, **budget)
        seconds["Megatron grid"] = time.perf_counter() - t
        _print_grid(grid)
        return [hand]
    hands = []
    for config in args.configs:
        try:
            hand = megatron_plan_for_graph(graph_for(config.num_microbatches), cluster,
                                           config, **budget)
        except (ValueError, NotImplementedError) as err:
            print(f"skipped {config.name}: {err}")
            continue
        hands.append(hand)
        print(f"{config.name}: predicted {hand.predicted_step_time!r} s")
    seconds["Megatron configs"] = time.perf_counter() - t
    hands.sort(key=lambda p: p.predicted_step_time)
    return hands


def _print_why(args, hands, auto, yours, graph_for, cluster, seconds) -> None:
    """Why autopar's plan differs from the best hand-written one (and its pictures under
    `args.out`), and what it changes in `yours`."""
    from autopar.app._compare import Comparison
    from autopar.report import explain_differences

    if auto is not None and hands:
        hand = hands[0]
        print(f"\nwhy they differ (best Megatron plan {hand.method} vs autopar):")
        print(explain_differences(
            hand, auto, first_graph=graph_for(hand.num_microbatches),
            second_graph=graph_for(auto.num_microbatches),
            devices_per_host=cluster.devices_per_host,
        ))
        if args.out:
            comparison = Comparison(hand, auto, [], graph_for(hand.num_microbatches),
                                    graph_for(auto.num_microbatches), 0.0, seconds,
                                    cluster.devices_per_host)
            written = comparison.write_pictures(args.out)
            print("wrote " + ", ".join(map(str, written)))
    if yours is not None and auto is not None:
        print("\nwhat autopar changes in yours:")
        print(explain_differences(
            yours, auto, first_graph=graph_for(yours.num_microbatches),
            second_graph=graph_for(auto.num_microbatches),
            devices_per_host=cluster.devices_per_host,
        ))


def _print_grid(grid) -> None:
    """The grid's best configurations and a count of the others, by outcome."""
    costed = sorted(((o, c) for c, o in grid if isinstance(o, float)), key=lambda x: x[0])
    print(f"Megatron grid: {len(grid)} configurations, {len(costed)} costed; fastest:")
    for seconds, config in costed[:5]:
        print(f"  {config.name}: {seconds * 1e3:.2f} ms")
    counts: dict[str, int] = {}
    for _, outcome in grid:
        if isinstance(outcome, str):
            key = outcome.split(":")[0]
            counts[key] = counts.get(key, 0) + 1
    if counts:
        print("  not costed: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


def _add_space(subparsers) -> None:
    parser = subparsers.add_parser(
        "space",
        help="the whole priced plan space of an example model and its memory/time frontier",
        description=(
            "Price every configuration of the Megatron-LM grid (feasible or not, with the "
            "reason) and every candidate autopar's search keeps (per microbatch count and "
            "schedule, and for a memory-bound plan under other budgets), each with its "
            "predicted step time, its breakdown and its peak memory per device; print the "
            "memory/time frontier around autopar's plan; with --out, write DIR/space.jsonl "
            "(JSON Lines, docs/space.md) and DIR/space.png (DIR/space.svg without "
            "matplotlib). A dry run on abstract arguments."
        ),
    )
    _add_model_flags(parser, "e.g. gpt-1.3B, llama-8B (see `autopar plan --help`)")
    parser.add_argument("--microbatch-sizes", type=_mesh_shape, default=None, metavar="1,2,4,8",
                        help="examples per microbatch per data-parallel rank the grid tries "
                        "(default: 1,2,4,8)")
    parser.add_argument("--budgets", type=_fractions, default=None, metavar="0.5,0.75",
                        help="also search autopar under these fractions of its plan's peak "
                        "memory (default: 0.5,0.75,1.5 for a memory-bound plan, else none; "
                        "'none' for none)")
    parser.add_argument("--no-megatron", action="store_true",
                        help="leave out the Megatron grid (autopar's candidates only)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write space.jsonl and the picture there")
    _add_sequence_flag(parser)
    _add_memory_budget_flag(parser)
    _add_output_flags(parser)
    parser.set_defaults(run=_run_space)


def _fractions(text: str) -> tuple[float, ...]:
    """``"0.5,0.75"`` -> ``(0.5, 0.75)``; ``"none"`` -> ``()``, for ``--budgets``."""
    if text == "none":
        return ()
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = (0.0,)
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of budget fractions; write positive numbers separated "
            "by commas, e.g. 0.5,0.75,1.5, or none")
    return values


def _run_space(args: argparse.Namespace) -> int:
    from autopar.app._examples import named_model
    from autopar.cluster import Cluster
    from autopar.space import explore

    _check_host_counts(args)
    model = named_model(args.model, args.batch, layer_markers=True, seq_len=args.seq_len)
    cluster = Cluster.from_profile(args.profile, args.hosts, args.devices_per_host)
    start = time.perf_counter()
    grid = {"num_heads": getattr(model.config, "num_heads", None),
            "num_layers": getattr(model.config, "num_layers", None)}
    if args.microbatch_sizes:
        grid["microbatch_sizes"] = args.microbatch_sizes
    space = explore(model.train_step, model.abstract_state, model.abstract_batch,
                    cluster=cluster, options={"memory_budget": args.memory_budget},
                    grid=grid, budget_fractions=args.budgets, megatron=not args.no_megatron,
                    model=f"{args.model} batch {args.batch}"
                          + (f" seq {args.seq_len}" if args.seq_len else ""),
                    command="autopar " + " ".join(sys.argv[1:]))
    print(space.summary())
    from autopar.report import frontier_lines

    print("\n".join(frontier_lines(space.plan.frontier(), around=4)))
    written = []
    if args.out:
        from pathlib import Path

        written.append(space.write(Path(args.out) / "space.jsonl"))
        try:
            written.append(space.picture(Path(args.out) / "space.png"))
        except ValueError:  # no matplotlib: the hand-written SVG
            written.append(space.picture(Path(args.out) / "space.svg"))
    print(f"explored {args.model} on {cluster.num_hosts} x {cluster.devices_per_host} "
          f"{cluster.name} in {time.perf_counter() - start:.1f} s: {len(space.rows)} rows"
          + (f"; wrote {', '.join(map(str, written))}" if written else ""))
    return 0


def _megatron_configs(text: str) -> list:
    """``"dp2tp4,dp4tp1pp2mb8,sp,zero1"`` -> MegatronConfigs; options follow their config."""
    import re

    from autopar.manual import MegatronConfig

    specs: list[dict] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"dp(\d+)tp(\d+)(?:pp(\d+))?(?:mb(\d+))?", part)
        if m is not None:
            dp, tp, pp, mb = (int(g) if g else 1 for g in m.groups())
            specs.append(dict(dp=dp, tp=tp, pp=pp, num_microbatches=mb))
            continue
        if not specs:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a Megatron configuration; write dp<D>tp<T>[pp<P>][mb<M>] "
                "first, then its options, e.g. dp2tp4 or dp8tp2pp4mb64,sp,zero1"
            )
        option = _megatron_option(part)
        if option is None:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a Megatron configuration nor an option; write "
                "dp<D>tp<T>[pp<P>][mb<M>], e.g. dp2tp4 or dp2tp2pp2mb8, followed by options "
                "sp, zero1, recompute=none|selective|full, interleaved=V"
            )
        specs[-1].update(option)
    try:
        return [MegatronConfig(**spec) for spec in specs]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _megatron_option(text: str) -> dict | None:
    if text == "sp":
        return {"sequence_parallel": True}
    if text == "zero1":
        return {"distributed_optimizer": True}
    key, _, value = text.partition("=")
    if key == "recompute" and value:
        return {"recompute": value}
    if key == "interleaved" and value.isdigit():
        return {"virtual_stages": int(value),
                "schedule": "interleaved_1f1b" if int(value) > 1 else "1f1b"}
    return None


def _add_launch(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a script as N local processes of one multi-host JAX run",
        description=(
            "Start N processes of COMMAND on this machine as one multi-host run: each gets "
            "AUTOPAR_COORDINATOR, AUTOPAR_NUM_PROCESSES, AUTOPAR_PROCESS_ID and its own "
            "AUTOPAR_TRANSFER_ADDRESS, which autopar.distributed.initialize() reads. If a "
            "process dies, the others are stopped with a message naming it, and the exit "
            "status is the lost process's. See docs/multihost.md for SLURM and SSH."
        ),
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True, metavar="N",
                        help="number of processes")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                        help="give each process K virtual CPU devices (sets XLA_FLAGS and "
                        "JAX_PLATFORMS=cpu; default: leave the devices alone)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="write process i's output to DIR/process_i.log")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command after --, e.g. -- python train.py")
    parser.set_defaults(run=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    from autopar.distributed import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    result = launch(command, args.num_processes, args.devices_per_process,
                    log_dir=args.log_dir)
    print(f"autopar launch: {result.message}", file=sys.stderr)
    return result.exit_code


def use_virtual_cpu_devices(num_devices: int) -> None:
    """Give JAX's CPU platform `num_devices` devices, if its backend is not yet running.

    Sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` for this process, replacing
    any count already there. The flag only shapes the host CPU platform: on a machine with
    an accelerator, JAX's default devices stay the accelerators. Done here, in the CLI,
    never at ``import autopar``.
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if
             not f.startswith(CPU_DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{CPU_DEVICE_COUNT_FLAG}={num_devices}"])


if __name__ == "__main__":
    sys.exit(main())
