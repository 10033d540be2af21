"""Where the Megatron grid's time goes: a cProfile of a few configurations.

GPT `small-test` (batch 8) on 2 DGX A100 hosts: the grid at pp 2, one microbatch size,
no sequence parallelism, no recompute, no interleaving (4 configurations costed, after a
first grid call that traces the step), profiled and printed by cumulative time. It shows
how much of pricing a configuration is building its layers' ILPs
(`autopar.intra._problem.build_problem`), the part the autopar search builds again for
the same layers without the configuration's fixed specs (docs/space.md, "Time").

Usage (about a minute on a quiet 2-core machine):
``python benchmarks/investigations/grid_profile.py [--top 40]``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from autopar.app._examples import named_model
from autopar.cluster import Cluster
from autopar.manual import megatron_grid_search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    model = named_model("gpt-small-test", 8, layer_markers=True)
    cluster = Cluster.from_profile("dgx-a100-80g", 2)
    traces: dict = {}
    common = dict(cluster=cluster, num_heads=4, num_layers=4, sequence_parallel=(False,),
                  recompute=("none",), virtual_stages=(1,), traces=traces)
    step, state, batch = model.train_step, model.abstract_state, model.abstract_batch
    megatron_grid_search(step, state, batch, pp_values=(1,), microbatch_sizes=(), **common)
    profile = cProfile.Profile()
    profile.enable()
    _, results = megatron_grid_search(step, state, batch, pp_values=(2,),
                                      microbatch_sizes=(1,), **common)
    profile.disable()
    print(f"{sum(isinstance(t, float) for _, t in results)} configuration(s) costed")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
