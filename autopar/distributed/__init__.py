"""Multi-host runs on JAX's own multi-controller runtime.

Every process runs the same script: `initialize()` joins the run (from the environment
`autopar launch` or a cluster script sets), `global_batch` builds the global batch from each
process's rows, `@autopar.autoparallel` derives the same plan on every process (checked) and
runs the stages whose devices each process owns, and `to_host` reads results on every
process. See docs/multihost.md.
"""

from autopar.distributed._arrays import (
    TRANSFER_PATHS,
    copy_to_devices,
    gather,
    global_batch,
    place,
    settle_transfers,
    to_host,
    transfer,
)
from autopar.distributed._env import (
    LOST_PROCESS_EXIT_CODE,
    ProcessInfo,
    initialize,
    is_multiprocess,
    process_info_from_env,
)
from autopar.distributed._launch import LaunchResult, launch
from autopar.distributed._plans import agree_on_plan, differing_processes, plan_digest

__all__ = [
    "TRANSFER_PATHS",
    "copy_to_devices",
    "LOST_PROCESS_EXIT_CODE",
    "LaunchResult",
    "ProcessInfo",
    "agree_on_plan",
    "differing_processes",
    "gather",
    "global_batch",
    "initialize",
    "is_multiprocess",
    "launch",
    "place",
    "plan_digest",
    "process_info_from_env",
    "settle_transfers",
    "to_host",
    "transfer",
]
