"""Where a pipelined local plan's CPU time goes (issue 14, the local check's pipelined plans).

Plans GPT `small-test` (batch 16) on the 8 virtual CPU devices as `auto 2 stages`
(`bench_local.local_plans`), then prints the predicted step time, the CPU time per step
dispatched asynchronously (as the runtime runs it) and with every task run one at a time
(the runtime's `record_memory` path, which blocks after each task), in two interleaved
rounds of 10 steps, and one recorded step's tasks (`record_timeline`, wall clock).

Usage: ``python benchmarks/investigations/local_pipeline_probe.py``
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
_HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/investigations
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]

from bench_local import _cluster, _gpt_arrays, _Timer  # noqa: E402

from autopar.runtime import PipelineExecutable  # noqa: E402
from autopar.search import plan  # noqa: E402


def main() -> None:
    step, state, batch = _gpt_arrays("small-test", 16)
    p = plan(step, state, batch, cluster=_cluster("cpu-local"), num_stages=2,
             num_microbatches=4, cache=False)
    timer = _Timer(step, state, batch, p, time.process_time)
    asynchronous = PipelineExecutable.__call__

    def one_at_a_time(self, flat_args, record=False, record_memory=False):
        return asynchronous(self, flat_args, record_memory=True)

    print(f"predicted {p.predicted_step_time * 1e3:.1f} ms per step")
    for r in range(2):
        for name, call in (("async", asynchronous), ("one task at a time", one_at_a_time)):
            PipelineExecutable.__call__ = call
            seconds = statistics.median(timer._step() for _ in range(10))
            print(f"round {r}: {name}: {seconds * 1e3:.1f} ms CPU time per step")
    PipelineExecutable.__call__ = asynchronous
    (timer.state, _), timeline = timer.run.record_timeline(timer.state, batch)
    for task in timeline:
        print(f"stage {task.stage} {task.kind} {task.microbatch}: start "
              f"{task.start * 1e3:.1f} ms, {task.duration * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
