"""`autopar.score`: a hand-written jax.jit sharding priced as a Plan, compared with autopar's."""

import re
import sys
from pathlib import Path

import jax
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402


def fsdp(state, batch, mesh):
    def leaf(x):
        return NamedSharding(mesh, P("data") if x.ndim >= 2 and x.shape[0] % 8 == 0 else P())

    return jax.tree.map(leaf, state), jax.tree.map(lambda x: NamedSharding(mesh, P("data")), batch)


def test_score_of_hand_fsdp_and_compare_ranks_differences():
    cfg, optimizer = gpt.CONFIGS["tiny"], optax.adamw(1e-2)
    step = gpt.make_train_step(cfg, optimizer)
    args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 16))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    shardings = fsdp(*args, mesh)
    theirs = autopar.score(step, *args, shardings=shardings)
    assert theirs.method == "yours" and theirs.predicted_step_time > 0
    assert theirs.stages[0].mesh.shape == (8,)
    for info in theirs.inputs:  # every pin unchanged
        if info.role == "param" and len(info.shape) >= 2 and info.shape[0] % 8 == 0:
            assert info.spec[0] == ("x",), (info.path, info.spec)
    ours = autopar.plan(step, *args, method="shard")
    text = autopar.compare([theirs, ours])
    assert "yours" in text.splitlines()[0]
    ranked = re.findall(r"^  \d\. (.+?): ", text, flags=re.M)
    assert len(ranked) >= 3, text
    assert "layouts changed: parameters" in text
