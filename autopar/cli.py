"""The ``autopar`` command line.

Each subcommand is two small functions: ``_add_<name>(subparsers)`` declares its arguments
and ``_run_<name>(args) -> int`` runs it; `build_parser` lists the ``_add_*`` functions.
Subcommands import JAX-heavy modules inside ``_run_*``, after the process set-up they need.

    autopar profile [--out FILE.json] [--quick] [--devices N]
                    [--coordinator HOST:PORT --num-processes P --process-id I]
"""

from __future__ import annotations

import argparse
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
    try:
        return args.run(args)
    except ValueError as e:  # a user mistake: the message says what to do
        parser.exit(2, f"autopar: error: {e}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Alpa-style automatic data, operator and pipeline parallelism for JAX.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_command in (_add_profile,):
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
    from autopar.cluster._cluster import local_profile_path
    from autopar.cluster._profile import FULL, QUICK, measure_profile

    out = args.out or local_profile_path()
    start = time.perf_counter()
    result = measure_profile(QUICK if args.quick else FULL, devices=_devices(args.devices))
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


def _devices(per_process: int | None) -> list:
    """The first `per_process` devices of every process (all if None), in cluster order."""
    from autopar.cluster._cluster import local_devices

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
