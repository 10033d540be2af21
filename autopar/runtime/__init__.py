"""Runtime: execute a pipelined plan (schedules, microbatches, cross-stage transfers)."""

from autopar.runtime._pipeline import PipelineExecutable, TaskRecord, overlap_fraction
from autopar.runtime._schedule import dispatch_order, stage_order

__all__ = [
    "PipelineExecutable",
    "TaskRecord",
    "dispatch_order",
    "overlap_fraction",
    "stage_order",
]
