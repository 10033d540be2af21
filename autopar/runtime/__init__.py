"""Runtime: execute a pipelined plan (schedules, microbatches, cross-stage transfers)."""

from autopar.cost._schedule import (
    dependencies,
    device_orders,
    dispatch_order,
    interleaved_order,
    stage_order,
)
from autopar.runtime._memory import (
    MemorySample,
    live_bytes_per_device,
    peak_live_bytes,
    peak_sample,
    task_working_bytes,
)
from autopar.runtime._pipeline import (
    PipelineExecutable,
    TaskRecord,
    overlap_fraction,
    split_backward,
)

__all__ = [
    "MemorySample",
    "PipelineExecutable",
    "TaskRecord",
    "dependencies",
    "device_orders",
    "dispatch_order",
    "interleaved_order",
    "live_bytes_per_device",
    "overlap_fraction",
    "peak_live_bytes",
    "peak_sample",
    "task_working_bytes",
    "split_backward",
    "stage_order",
]
