"""Regenerate the golden plans in ``tests/golden/`` (MaxText-style sharding dumps).

Plans each example model at a small size on fixed logical meshes, (8,) and (2, 4), with the
``cpu-local`` profile and ``method="shard"`` (operator parallelism on one mesh; no search
over meshes or pipeline stages, so a golden file changes only when the sharding planner
does). Each file holds the spec chosen for every input leaf, keyed and sorted by pytree
path, plus the mesh shape and method:

```json
{"mesh_shape": [2, 4], "method": "shard", "model": "gpt-tiny", ...,
 "specs": {"batch/tokens": "P('x', None)", "params/layers/0/mlp/w1": "P(None, 'y')", ...}}
```

``tests/test_golden.py`` plans again and diffs against these files. After an intended change
to the planner, regenerate and review the diff in version control:

    python scripts/regenerate_golden.py            # every case
    python scripts/regenerate_golden.py gpt_2x4    # some cases
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere in the checkout
    sys.path.insert(0, str(REPO))

GOLDEN_DIR = REPO / "tests" / "golden"
PROFILE = "cpu-local"
METHOD = "shard"
BATCH_SIZE = 8
MESH_SHAPES = ((8,), (2, 4))
REGENERATE_COMMAND = "python scripts/regenerate_golden.py"


@dataclass(frozen=True)
class GoldenModel:
    """An example at its "tiny" size, with some fields changed to keep planning fast."""

    label: str
    family: str
    changes: tuple[tuple[str, int], ...] = ()

    def config(self):
        from autopar.app._examples import load_example

        return dataclasses.replace(load_example(self.family).CONFIGS["tiny"], **dict(self.changes))


# Two layers keep GPT's and MoE's ILPs small while still showing that identical layers get
# identical specs (and, for MoE, one dense and one mixture-of-experts layer).
GOLDEN_MODELS = (
    GoldenModel("mlp", "mlp"),
    GoldenModel("gpt", "gpt", (("num_layers", 2),)),
    GoldenModel("moe", "moe", (("num_layers", 2),)),
    GoldenModel("wide_resnet", "wide_resnet"),
)


@dataclass(frozen=True)
class GoldenCase:
    """One golden file: a model on one mesh shape."""

    model: GoldenModel
    mesh_shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.model.label}_{'x'.join(map(str, self.mesh_shape))}"

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.json"


GOLDEN_CASES = tuple(GoldenCase(m, s) for m in GOLDEN_MODELS for s in MESH_SHAPES)


def golden_plan(case: GoldenCase, solver: str = "auto") -> dict:
    """Plan `case` with the MILP `solver` (never from the plan cache) and return its golden
    record (see the module docstring)."""
    import optax

    from autopar.app._examples import LEARNING_RATE, load_example
    from autopar.cluster import Cluster
    from autopar.cluster._mesh import spec_str
    from autopar.search import plan

    module = load_example(case.model.family)
    config = case.model.config()
    optimizer = optax.adamw(LEARNING_RATE)
    result = plan(
        module.make_train_step(config, optimizer),
        module.abstract_state(config, optimizer),
        module.abstract_batch(config, BATCH_SIZE),
        cluster=Cluster.from_profile(PROFILE),
        method=METHOD,
        mesh_shape=case.mesh_shape,
        solver=solver,
        cache=False,
    )
    assert result.num_stages == 1, f"method {METHOD!r} gave {result.num_stages} stages"
    return {
        "model": f"{case.model.family}-tiny" + "".join(f", {k}={v}" for k, v in case.model.changes),
        "profile": PROFILE,
        "batch_size": BATCH_SIZE,
        "method": result.method,
        "mesh_shape": list(result.stages[0].mesh.shape),
        "specs": {i.path: spec_str(i.spec) for i in sorted(result.inputs, key=lambda i: i.path)},
    }


def dumps(record: dict) -> str:
    """The file text of a golden record: sorted keys, one spec per line."""
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def diff_records(expected: dict, found: dict) -> list[str]:
    """Readable differences between a golden record and a new one; empty when equal."""
    lines = [
        f"{key}: golden {expected.get(key)!r}, now {found.get(key)!r}"
        for key in sorted((set(expected) | set(found)) - {"specs"})
        if expected.get(key) != found.get(key)
    ]
    old, new = expected.get("specs", {}), found.get("specs", {})
    for path in sorted(set(old) | set(new)):
        if path not in new:
            lines.append(f"{path}: golden {old[path]}, now missing (input removed?)")
        elif path not in old:
            lines.append(f"{path}: not in the golden file, now {new[path]}")
        elif old[path] != new[path]:
            lines.append(f"{path}: golden {old[path]}, now {new[path]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", metavar="CASE",
                        help=f"cases to regenerate (default: all): "
                        f"{', '.join(c.name for c in GOLDEN_CASES)}")
    args = parser.parse_args(argv)
    known = {c.name: c for c in GOLDEN_CASES}
    unknown = [name for name in args.cases if name not in known]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for case in [known[name] for name in args.cases] or GOLDEN_CASES:
        start = time.perf_counter()
        record = golden_plan(case)
        previous = json.loads(case.path.read_text()) if case.path.is_file() else None
        case.path.write_text(dumps(record))
        changes = "new" if previous is None else f"{len(diff_records(previous, record))} changes"
        seconds = time.perf_counter() - start
        print(f"wrote {case.path.relative_to(REPO)} ({changes}, {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
