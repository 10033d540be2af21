"""Join the other processes of a multi-host run, from the environment `autopar launch` sets.

Every process runs the same script. `initialize()` reads where the coordinator is, how many
processes there are and which one this is, and calls `jax.distributed.initialize` with the
settings JAX's CPU backend needs for several processes (gloo collectives, a socket for
transfers between processes). Under `autopar launch` it also starts a watchdog that stops
this process, naming the lost one, as soon as the launcher sees another process die.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

COORDINATOR_ENV = "AUTOPAR_COORDINATOR"  # host:port of process 0's coordination service
NUM_PROCESSES_ENV = "AUTOPAR_NUM_PROCESSES"
PROCESS_ID_ENV = "AUTOPAR_PROCESS_ID"
TRANSFER_ADDRESS_ENV = "AUTOPAR_TRANSFER_ADDRESS"  # host:port of this process's transfer socket
STATUS_FILE_ENV = "AUTOPAR_STATUS_FILE"  # written by `autopar launch` when a process is lost
LAUNCHER_PID_ENV = "AUTOPAR_LAUNCHER_PID"  # the launcher; its children stop if it goes away

# Seconds without a heartbeat after which JAX's coordination service declares a process
# dead and stops the others. JAX's default is 100 s; 10 s keeps a lost process from
# hanging the rest for long while tolerating a busy machine.
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 10
# How often the watchdog looks at the launcher's status file.
WATCHDOG_POLL_SECONDS = 0.2
# Exit status of a process stopped because another process was lost (EX_SOFTWARE, sysexits.h).
LOST_PROCESS_EXIT_CODE = 70


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in a multi-process run."""

    coordinator: str
    num_processes: int
    process_id: int
    transfer_address: str


def process_info_from_env(env: dict | None = None) -> ProcessInfo:
    """Read `AUTOPAR_COORDINATOR`, `AUTOPAR_NUM_PROCESSES`, `AUTOPAR_PROCESS_ID` and
    `AUTOPAR_TRANSFER_ADDRESS` (optional).

    **Arguments:**
    - `env`: the environment (default `os.environ`).

    **Returns:** a `ProcessInfo`.
    """
    env = os.environ if env is None else env
    missing = [k for k in (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV) if k not in env]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: autopar.distributed.initialize() reads where the "
            "coordinator is and which process this is from the environment. Start the script "
            "with `autopar launch -n N -- python script.py`, or set "
            f"{COORDINATOR_ENV}=host:port, {NUM_PROCESSES_ENV}=N and {PROCESS_ID_ENV}=i "
            "yourself (see docs/multihost.md for SLURM and SSH)"
        )
    coordinator = env[COORDINATOR_ENV]
    num_processes = _int_env(env, NUM_PROCESSES_ENV)
    process_id = _int_env(env, PROCESS_ID_ENV)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{PROCESS_ID_ENV}={process_id} must be in 0..{NUM_PROCESSES_ENV}-1 and "
            f"{NUM_PROCESSES_ENV}={num_processes} at least 1"
        )
    transfer = env.get(TRANSFER_ADDRESS_ENV) or default_transfer_address(coordinator)
    return ProcessInfo(coordinator, num_processes, process_id, transfer)


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None


def default_transfer_address(coordinator: str) -> str:
    """This host's address with a free port: loopback when the coordinator is local."""
    host = coordinator.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{free_port(host)}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, below the OS's ephemeral range.

    The port is picked here but bound later, by another process (the coordinator, or a
    process's transfer socket, which JAX opens when its backend starts). A port from the
    ephemeral range could meanwhile be handed by the OS to one of the many sockets the
    processes open on port 0 (gloo opens a listener per communicator), and a peer's packets
    would then reach the wrong server: a CI run saw JAX's transfer socket server abort on a
    packet it did not know ("socket-server.cc ... Implement"). The OS never assigns a port
    below its ephemeral range on its own, so one from there stays ours once it is free.
    Falls back to a port the OS picks when no such port is free.
    """
    low = _ephemeral_range()[0]
    first = max(_FIRST_UNASSIGNED_PORT, low - _PORT_WINDOW)
    if first < low:
        draw = random.SystemRandom()
        for _ in range(_PORT_TRIES):
            port = draw.randrange(first, low)
            if _can_bind(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Ports are drawn from [max(this, ephemeral low - _PORT_WINDOW), ephemeral low).
_FIRST_UNASSIGNED_PORT = 10000
_PORT_WINDOW = 16000
_PORT_TRIES = 64
_LINUX_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default when the range cannot be read (the IANA range 49152-65535 elsewhere).
_DEFAULT_EPHEMERAL_RANGE = (32768, 60999)


def _ephemeral_range() -> tuple[int, int]:
    """The (low, high) ports the OS assigns to sockets bound to port 0."""
    try:
        low, high = (int(v) for v in _LINUX_PORT_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_RANGE


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def initialize(
    info: ProcessInfo | None = None,
    *,
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
) -> ProcessInfo:
    """Join a multi-process run: `jax.distributed.initialize` with CPU-ready settings.

    Call it first thing in the script, before any other JAX call. It sets
    `jax_cpu_collectives_implementation="gloo"` (collectives between processes on CPU) and
    `jax_cross_host_transfer_socket_address` (arrays moved between processes by
    `jax.device_put`), then connects to the coordinator. An uncaught exception then ends the
    process at once (status 1) instead of waiting for the others at JAX's shutdown barrier.
    Under `autopar launch` it also starts a
    watchdog thread that exits this process with status 70 and a message naming the lost
    process as soon as another process dies.

    **Arguments:**
    - `info`: where this process sits; default `process_info_from_env()`.
    - `heartbeat_timeout_seconds`: JAX's coordination service stops every process this
      long after one stops answering.

    **Returns:** the `ProcessInfo` used.

    **Example:**

    ```python
    import autopar.distributed as apd
    apd.initialize()  # reads AUTOPAR_COORDINATOR, AUTOPAR_NUM_PROCESSES, AUTOPAR_PROCESS_ID
    ```
    """
    import jax

    info = process_info_from_env() if info is None else info
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", info.transfer_address)
    jax.distributed.initialize(
        info.coordinator,
        num_processes=info.num_processes,
        process_id=info.process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    )
    sys.excepthook = _exit_on_uncaught_exception
    status_file = os.environ.get(STATUS_FILE_ENV)
    if status_file:
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0")) or None
        start_watchdog(Path(status_file), info.process_id, launcher)
    return info


def _exit_on_uncaught_exception(kind, value, traceback) -> None:
    """Print the error and leave at once: on a normal exit JAX waits at its shutdown barrier
    for every other process, so a failed process would linger instead of being seen as lost."""
    sys.__excepthook__(kind, value, traceback)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def start_watchdog(
    status_file: Path, process_id: int, launcher_pid: int | None = None
) -> threading.Thread:
    """A daemon thread that exits the process once `status_file` says a process was lost,
    or once the launcher `launcher_pid` is gone (this process's parent changed).

    It runs while the main thread waits inside XLA (which releases the GIL), so a process
    blocked on a collective with a dead peer still stops.
    """

    def watch() -> None:
        while True:
            text = status_file.read_text().strip() if status_file.exists() else ""
            if launcher_pid is not None and os.getppid() != launcher_pid:
                text = text or f"the launcher (pid {launcher_pid}) is gone"
            if text:
                print(
                    f"autopar: process {process_id} stops because {text}",
                    file=sys.stderr, flush=True,
                )
                os._exit(LOST_PROCESS_EXIT_CODE)
            time.sleep(WATCHDOG_POLL_SECONDS)

    thread = threading.Thread(target=watch, name="autopar-watchdog", daemon=True)
    thread.start()
    return thread


def is_multiprocess() -> bool:
    """True when JAX runs as one of several processes (after `jax.distributed.initialize`)."""
    import jax

    return jax.process_count() > 1
