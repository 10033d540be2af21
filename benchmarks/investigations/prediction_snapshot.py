"""Did a change move any prediction? Full-precision predicted step times and plan hashes.

A refactoring check: plans a fixed set of steps on three profiles (the local GPT's one-mesh,
Megatron and pipelined plans on `cpu-local-measured`; GPT-125M `method="auto"` and two
Megatron plans on two DGX A100 hosts; a scanned Llama with `schedule="auto"` on one DGX
H100) and prints each plan's predicted step time (its `repr`, every digit) and a hash of its
JSON less the timings. Run it before and after a change and compare the files: a change
that should not move predictions leaves them byte-identical.

Usage (about 6 minutes on 2 cores)::

    python -m benchmarks.investigations.prediction_snapshot --save before.json
    ... change ...
    python -m benchmarks.investigations.prediction_snapshot --compare before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["AUTOPAR_PLAN_CACHE"] = "0"  # plan every time: the point is the search
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

import optax  # noqa: E402

import autopar  # noqa: E402
from examples import gpt, llama  # noqa: E402


def plan_hash(plan) -> str:
    """A short hash of the plan's JSON, its planning timings left out."""
    data = plan.to_json()
    data.pop("timings", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def plans():
    """(name, a function making the plan), in a fixed order."""
    opt = optax.adamw(1e-3)
    local = dataclasses.replace(gpt.CONFIGS["small-test"], layer_markers=True)
    step = gpt.make_train_step(local, opt)
    args = (gpt.abstract_state(local, opt), gpt.abstract_batch(local, 16))
    cpu = autopar.Cluster.from_profile("cpu-local-measured")
    for method in ("shard", "data", "zero2", "zero3"):
        yield f"local {method} (8,)", lambda m=method: autopar.plan(
            step, *args, cluster=cpu, method=m, mesh_shape=(8,), cache=False)
    yield "local shard (2, 4)", lambda: autopar.plan(
        step, *args, cluster=cpu, method="shard", mesh_shape=(2, 4), cache=False)
    for dp, tp, pp, m in ((8, 1, 1, 1), (4, 2, 1, 1), (2, 2, 2, 4)):
        yield f"local megatron dp{dp} tp{tp} pp{pp}", lambda dp=dp, tp=tp, pp=pp, m=m: (
            autopar.megatron_plan(step, *args, cluster=cpu, dp=dp, tp=tp, pp=pp,
                                  num_microbatches=m))
    for stages in (2, 4):
        yield f"local auto {stages} stages", lambda s=stages: autopar.plan(
            step, *args, cluster=cpu, num_stages=s, num_microbatches=4, cache=False)
    big = dataclasses.replace(gpt.CONFIGS["125M"], layer_markers=True)
    big_step = gpt.make_train_step(big, opt)
    big_args = (gpt.abstract_state(big, opt), gpt.abstract_batch(big, 32))
    a100 = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    yield "gpt-125M auto, 2 x dgx-a100-80g", lambda: autopar.plan(
        big_step, *big_args, cluster=a100, cache=False)
    for dp, tp, pp, m in ((4, 4, 1, 1), (2, 4, 2, 8)):
        yield f"gpt-125M megatron dp{dp} tp{tp} pp{pp}", lambda dp=dp, tp=tp, pp=pp, m=m: (
            autopar.megatron_plan(big_step, *big_args, cluster=a100, dp=dp, tp=tp, pp=pp,
                                  num_microbatches=m))
    small = llama.CONFIGS["small-test"]
    yield "llama small-test auto schedule, dgx-h100", lambda: autopar.plan(
        llama.make_train_step(small, opt), llama.abstract_state(small, opt),
        llama.abstract_batch(small, 32), cluster=autopar.Cluster.from_profile("dgx-h100"),
        schedule="auto", cache=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="write the snapshot to this JSON file")
    parser.add_argument("--compare", help="compare with a snapshot saved before; exit 1 "
                        "when a prediction or plan differs")
    args = parser.parse_args()
    found = {}
    for name, make in plans():
        plan = make()
        found[name] = [repr(plan.predicted_step_time), plan_hash(plan)]
        print(f"{name}: {found[name][0]} s  plan {found[name][1]}", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(found, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        moved = sorted(n for n in set(before) | set(found) if before.get(n) != found.get(n))
        print("identical" if not moved else "moved: " + ", ".join(moved))
        sys.exit(1 if moved else 0)


if __name__ == "__main__":
    main()
