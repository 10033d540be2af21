"""`autopar launch`: start N local processes of one script as a multi-host run.

Each child gets the environment `autopar.distributed.initialize()` reads (coordinator
address, number of processes, its id, its own transfer port) and, with
`devices_per_process`, XLA flags giving it that many virtual CPU devices. The launcher
watches its children: when one dies with a non-zero status, it records which one in a status
file that every child's watchdog reads (so the others stop at once, naming it), then kills
whatever is still running after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autopar.distributed._env import (
    COORDINATOR_ENV,
    LAUNCHER_PID_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    STATUS_FILE_ENV,
    TRANSFER_ADDRESS_ENV,
    free_port,
)

LOOPBACK = "127.0.0.1"
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# How often the launcher checks its children.
POLL_SECONDS = 0.1
# After a process is lost, how long the others get to stop by themselves (their watchdogs
# exit within a fraction of a second) before the launcher kills them.
DEFAULT_GRACE_SECONDS = 10.0
DEFAULT_HASH_SEED = "0"


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: `exit_code` 0 when every process succeeded; else the first
    failure's status (128 + signal number for a process killed by a signal), with
    `lost_process` naming it. `exit_codes` holds every process's status, reported the same
    way; `stop_seconds` how long the others took to end after the loss was seen."""

    exit_code: int
    lost_process: int | None
    message: str
    exit_codes: tuple[int, ...] = ()  # every process's status, as `exit_code` reports it
    stop_seconds: float = 0.0  # from seeing the lost process to every process ending


def child_env(
    base: dict, process_id: int, num_processes: int, coordinator: str, transfer_address: str,
    status_file: str, devices_per_process: int | None,
) -> dict:
    """The environment of child `process_id`.

    **Returns:** a copy of `base` with the `AUTOPAR_*` variables set and, when
    `devices_per_process` is given, `XLA_FLAGS` asking for that many CPU devices and
    `JAX_PLATFORMS=cpu`.
    """
    env = dict(base)
    env.update({
        COORDINATOR_ENV: coordinator,
        NUM_PROCESSES_ENV: str(num_processes),
        PROCESS_ID_ENV: str(process_id),
        TRANSFER_ADDRESS_ENV: transfer_address,
        STATUS_FILE_ENV: status_file,
        LAUNCHER_PID_ENV: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",  # output of a process that dies is not lost in a buffer
    })
    # The same hash seed everywhere, so that set iteration order, and with it the plan,
    # is the same on every process (autopar still adopts process 0's plan if not).
    env.setdefault("PYTHONHASHSEED", DEFAULT_HASH_SEED)
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith(CPU_DEVICE_COUNT_FLAG)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{CPU_DEVICE_COUNT_FLAG}={devices_per_process}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None = None,
    *,
    log_dir: str | os.PathLike | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
) -> LaunchResult:
    """Run `command` as `num_processes` local processes of one multi-host run.

    **Arguments:**
    - `command`: the program and its arguments, e.g. `["python", "train.py"]`.
    - `num_processes`: how many processes (hosts) to start.
    - `devices_per_process`: virtual CPU devices per process (None: leave XLA_FLAGS alone).
    - `log_dir`: write process i's stdout and stderr to `log_dir/process_i.log` instead of
      this terminal.
    - `grace_seconds`: after a process is lost, how long the others may take to stop.

    **Returns:** a `LaunchResult`.
    """
    if not command:
        raise ValueError("no command to launch; write it after --, e.g. "
                         "`autopar launch -n 2 -- python train.py`")
    if num_processes < 1:
        raise ValueError(f"the number of processes must be at least 1, got {num_processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"--devices-per-process must be at least 1, got {devices_per_process}")
    coordinator = f"{LOOPBACK}:{free_port(LOOPBACK)}"
    with tempfile.TemporaryDirectory(prefix="autopar-launch-") as scratch:
        status_file = str(Path(scratch) / "status")
        children = []
        for i in range(num_processes):
            env = child_env(os.environ, i, num_processes, coordinator,
                            f"{LOOPBACK}:{free_port(LOOPBACK)}", status_file, devices_per_process)
            out = None
            if log_dir is not None:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                out = open(Path(log_dir) / f"process_{i}.log", "w")  # noqa: SIM115
            children.append(subprocess.Popen(list(command), env=env, stdout=out,
                                             stderr=subprocess.STDOUT if out else None))
            if out is not None:
                out.close()  # the child holds its own descriptor
        try:
            return _watch(children, Path(status_file), grace_seconds)
        except KeyboardInterrupt:
            _kill_all(children)
            raise


def _watch(children: list[subprocess.Popen], status_file: Path, grace: float) -> LaunchResult:
    while True:
        codes = [c.poll() for c in children]
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            lost, code = failed[0]
            message = f"process {lost} (pid {children[lost].pid}) {_describe(code)}"
            status_file.write_text(message + "\n")
            print(f"autopar launch: {message}; stopping the other processes",
                  file=sys.stderr, flush=True)
            seen = time.monotonic()
            while time.monotonic() < seen + grace and any(c.poll() is None for c in children):
                time.sleep(POLL_SECONDS)
            _kill_all(children)
            return LaunchResult(
                _exit_status(code), lost, message,
                tuple(_exit_status(c.returncode) for c in children), time.monotonic() - seen,
            )
        if all(code == 0 for code in codes):
            return LaunchResult(0, None, f"all {len(children)} processes finished",
                                (0,) * len(children))
        time.sleep(POLL_SECONDS)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _kill_all(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()
