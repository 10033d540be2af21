"""Pipeline schedules: the order in which each device group runs its microbatch tasks.

The orders are plain data that the cost model simulates as well as the runtime runs, so they
live in `autopar.cost._schedule` (one definition for both); this module re-exports them for
the runtime.
"""

from autopar.cost._schedule import (
    Task,
    dependencies,
    device_orders,
    dispatch_order,
    interleaved_order,
    stage_order,
)

__all__ = [
    "Task",
    "dependencies",
    "device_orders",
    "dispatch_order",
    "interleaved_order",
    "stage_order",
]
