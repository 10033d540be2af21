"""A forced `context_parallel` in the pipeline search: a (layer, submesh) whose attention
the algorithm cannot split has no plan there and the search goes on with the other
submeshes; when none is left, the error names the tensor that blocked it and the fix."""

from __future__ import annotations

import dataclasses

import pytest
from test_context_parallel import CFG, _cpu, _setup

import autopar
from autopar.intra._context import ContextParallelError

# 2 query heads of 1 key/value head, two marked layers: two pipeline stages of 4 devices
# cannot split the heads 4 ways (Ulysses).
SMALL = dataclasses.replace(CFG, num_heads=2, num_kv_heads=1, num_layers=2, seq_len=64,
                            hidden=32, layer_markers=True)


def test_a_blocked_submesh_leaves_the_others():
    step, state, batch = _setup(SMALL)
    plan = autopar.plan(step, state, batch, cluster=_cpu(), method="auto",
                        context_parallel="ulysses", num_stages=2)
    splits = [stage.sharding.context_parallel for stage in plan.stages]
    assert any(s.algorithm == "ulysses" and s.degree > 1 for s in splits)


def test_no_submesh_left_names_the_tensor():
    step, state, batch = _setup(dataclasses.replace(SMALL, seq_len=63))
    with pytest.raises(ContextParallelError,
                       match=r"context_parallel='allgather' cannot split attention tensor "
                             r".*sequence 63.*No pipeline plan without those meshes"):
        autopar.plan(step, state, batch, cluster=_cpu(), method="auto",
                     context_parallel="allgather", num_stages=2)
