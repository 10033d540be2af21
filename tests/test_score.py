"""`autopar.score`: a hand-written jax.jit sharding priced as a Plan, compared with autopar's."""

import re
import sys
from pathlib import Path

import jax
import optax
import pytest
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


@pytest.mark.extended  # about 15 s of CPU: autopar's pipeline search of the GPT on a DGX
def test_cli_compare_yours(tmp_path, capsys):
    from autopar.app import cli
    from autopar.app._examples import named_model

    model = named_model("gpt-tiny", 8, layer_markers=True)
    args = (model.abstract_state, model.abstract_batch)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", 1)
    theirs = autopar.score(model.train_step, *args, shardings=fsdp(*args, mesh),
                           cluster=cluster)
    path = tmp_path / "yours.json"
    theirs.save(path)
    status = cli.main(["compare", "--model", "gpt-tiny", "--hosts", "1", "--configs", "dp8tp1",
                       "--yours", str(path)])
    out = capsys.readouterr().out
    assert status == 0
    header = next(line for line in out.splitlines() if line.startswith("plan "))
    assert header.split()[1] == "yours"
    assert "what autopar changes in yours:" in out
    assert len(re.findall(r"^  \d\. ", out.split("what autopar changes in yours:")[1],
                          flags=re.M)) >= 3
