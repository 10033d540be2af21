"""Runtime: execute a pipelined plan (schedules, microbatches, cross-stage transfers)."""

from autopar.runtime._memory import MemorySample, live_bytes_per_device, peak_live_bytes
from autopar.runtime._pipeline import PipelineExecutable, TaskRecord, overlap_fraction
from autopar.runtime._schedule import dispatch_order, stage_order

__all__ = [
    "MemorySample",
    "PipelineExecutable",
    "TaskRecord",
    "dispatch_order",
    "live_bytes_per_device",
    "overlap_fraction",
    "peak_live_bytes",
    "stage_order",
]
