"""One process of the multi-host tests; started by `autopar launch` (tests/test_multihost.py).

Trains the tiny GPT (with layer marks) for a few steps under each requested plan and writes,
per plan, `<out>/<mode>_process<i>.json` with the losses, the plan JSON (without wall-clock times)
and whether the processes first derived different plans.

    python tests/multihost_worker.py --out DIR [--modes pipeline,shard,...] [--steps 3]
                                     [--die-process P --die-step S]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.distributed import global_batch, initialize, to_host  # noqa: E402
from autopar.distributed._plans import shared_json  # noqa: E402

GLOBAL_BATCH = 8
LEARNING_RATE = 1e-2
# The plans under test; the runs in tests/test_multihost.py use the same options.
PLAN_OPTIONS = {
    "pipeline": dict(num_stages=2, submeshes=[(1, 4)], num_microbatches=2),
    "shard": dict(method="shard", mesh_shape=(2, 4)),
    # The new schedules across processes: zero bubble (B and W on each process's stage),
    # interleaved 1F1B (4 chunks alternating between the processes' devices).
    "zero_bubble": dict(num_stages=2, submeshes=[(1, 4)], num_microbatches=4,
                        schedule="zero_bubble"),
    "interleaved": dict(num_stages=2, submeshes=[(1, 4)], num_microbatches=4,
                        schedule="interleaved_1f1b", virtual_stages=2),
}
# 4 stages of 2 devices (two per process) with 8 microbatches under each schedule, on the
# tiny GPT with 8 layers (interleaving needs 4 x 2 chunks) and 16 rows (2 per microbatch).
FOUR_STAGE_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}
for _schedule, _v in FOUR_STAGE_SCHEDULES.items():
    PLAN_OPTIONS[f"4stages_{_schedule}"] = dict(
        num_stages=4, submeshes=[(1, 2)], logical_shapes=[(2,)], num_microbatches=8,
        schedule=_schedule, **({"virtual_stages": _v} if _v > 1 else {}),
    )
FOUR_STAGE_LAYERS = 8
FOUR_STAGE_BATCH = 16


def model_for(mode: str) -> tuple[dict, int]:
    """(GPT config changes, global batch) of a mode's run."""
    if mode.startswith("4stages_"):
        return {"num_layers": FOUR_STAGE_LAYERS}, FOUR_STAGE_BATCH
    return {}, GLOBAL_BATCH


def initial_state(cfg, optimizer):
    """The GPT's state of key 0 as one compiled program (op by op, the initialisers compile
    dozens of small programs); the workers and tests/test_multihost.py's references start
    from it alike."""
    import jax

    from examples import gpt

    return jax.jit(lambda key: gpt.init_state(cfg, optimizer, key))(jax.random.key(0))


# "disagree": process 0 asks for the shard plan above, the others for a 1-D mesh; every
# process must end up running process 0's plan.
OTHER_PROCESSES_DISAGREE = dict(method="shard", mesh_shape=(8,))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default="pipeline,shard,disagree,zero_bubble,interleaved")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--die-process", type=int, default=None)
    parser.add_argument("--die-step", type=int, default=None)
    args = parser.parse_args()
    info = initialize()
    if os.environ.get("AUTOPAR_TEST_DUMP_AFTER"):  # debugging a hang: dump every stack
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["AUTOPAR_TEST_DUMP_AFTER"]))
    import jax
    import numpy as np
    import optax

    import autopar
    from examples import gpt

    optimizer = optax.adamw(LEARNING_RATE, eps=1e-6)
    made: dict = {}  # mode -> its decorated step
    states: dict = {}  # GPT config changes -> the initial state (no plan donates it)
    for mode in args.modes.split(","):
        changes, global_rows = model_for(mode)
        cfg = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True, **changes)
        step = gpt.make_train_step(cfg, optimizer)
        full = jax.tree.map(np.asarray, gpt.make_batch(cfg, global_rows, jax.random.key(1)))
        rows = global_rows // info.num_processes
        mine = slice(info.process_id * rows, (info.process_id + 1) * rows)
        key = tuple(sorted(changes.items()))
        if key not in states:
            states[key] = initial_state(cfg, optimizer)
        state = states[key]
        batch = global_batch(jax.tree.map(lambda x, mine=mine: x[mine], full))
        if mode == "checkpoint":
            _checkpoint_across_plans(step, state, batch, args, info, made)
            continue
        options = PLAN_OPTIONS["shard" if mode == "disagree" else mode]
        if mode == "disagree" and info.process_id > 0:
            options = OTHER_PROCESSES_DISAGREE
        par = made[mode] = autopar.autoparallel(step, donate_argnums=(), **options)
        warnings = _WarningLog()
        logging.getLogger("autopar").addHandler(warnings)
        losses = []
        for i in range(args.steps):
            if args.die_process == info.process_id and args.die_step == i:
                print(f"process {info.process_id}: killing myself at step {i}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            state, metrics = par(state, batch)
            losses.append(float(to_host(metrics)["loss"]))
            print(f"process {info.process_id} {mode} step {i}: loss {losses[-1]:.6f}",
                  flush=True)
        plan = shared_json(par.plan.to_json())  # without wall-clock times
        out = Path(args.out) / f"{mode}_process{info.process_id}.json"
        logging.getLogger("autopar").removeHandler(warnings)
        disagreed = any("derived a different plan" in m for m in warnings.messages)
        out.write_text(json.dumps({"losses": losses, "plan": plan, "plans_disagreed": disagreed},
                                  sort_keys=True))


def _checkpoint_across_plans(step, state, batch, args, info, made: dict) -> None:
    """3 steps under the shard plan, save, restore under the pipeline plan, 3 more steps;
    writes the 6 losses to `<out>/checkpoint_process<i>.json`."""
    import autopar

    # The steps the "shard" and "pipeline" modes planned, when they ran (planning is most
    # of the time): a decorated step keeps only its compiled plans between calls.
    first = made.get("shard") or autopar.autoparallel(
        step, donate_argnums=(), **PLAN_OPTIONS["shard"]
    )
    second = made.get("pipeline") or autopar.autoparallel(
        step, donate_argnums=(), **PLAN_OPTIONS["pipeline"]
    )
    losses = []
    for _ in range(3):
        state, metrics = first(state, batch)
        losses.append(float(to_host(metrics)["loss"]))
    path = Path(args.out) / "checkpoint_step3"  # the same folder for every process
    autopar.checkpoint.save(path, state)
    second(state, batch)  # plan and compile the second plan (its result is not kept)
    state = autopar.checkpoint.restore(path, like=second)
    for _ in range(3):
        state, metrics = second(state, batch)
        losses.append(float(to_host(metrics)["loss"]))
    out = Path(args.out) / f"checkpoint_process{info.process_id}.json"
    out.write_text(json.dumps({"losses": losses, "stages": second.plan.num_stages}))


class _WarningLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


if __name__ == "__main__":
    main()
