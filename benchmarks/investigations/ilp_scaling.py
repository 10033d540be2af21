"""How the sharding ILP scales: build and solve time and ILP size on random layered graphs.

Each graph imitates a traced model: nodes in layers, every node fed by one to three nodes of
the two layers before it. A node's strategies are distinct "specs" from a shared pool; the
resharding cost between two specs is zero for the same spec and otherwise the edge's tensor
size times a fixed spec-to-spec factor (so matrices have the structure real ones have, not
uniform noise). A fraction of nodes follow their first producer (elementwise ops).

    python benchmarks/investigations/ilp_scaling.py   # 200, 1000, 3000 nodes, both forms
    python benchmarks/investigations/ilp_scaling.py --sizes 500 --formulations marginal --memory
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from autopar.intra._ilp import ShardingProblem, least_memory, solve  # noqa: E402

# Strategy counts per node are drawn log-uniformly in this range (the brief's 5-40).
MIN_STRATEGIES, MAX_STRATEGIES = 5, 40
# Distinct specs a tensor can take on a 2-D mesh of 8 devices, generously counted.
SPEC_POOL_SIZE = 64
NODES_PER_LAYER = 6
# Where the --memory budget sits between the least feasible peak and the largest group total;
# low enough that it binds (the unconstrained optimum peaks ~10 % of the way up).
MEMORY_BUDGET_FRACTION = 0.05


def _layered_dag(num_nodes: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    edges = []
    for v in range(NODES_PER_LAYER, num_nodes):
        layer_start = (v // NODES_PER_LAYER - 2) * NODES_PER_LAYER
        window = np.arange(max(layer_start, 0), (v // NODES_PER_LAYER) * NODES_PER_LAYER)
        for u in rng.choice(window, size=min(len(window), rng.integers(1, 4)), replace=False):
            edges.append((int(u), v))
    return sorted(edges)


def random_problem(
    num_nodes: int, seed: int, follower_fraction: float = 0.3, memory: bool = False
) -> ShardingProblem:
    """A random layered sharding problem.

    **Arguments:**
    - `num_nodes`: node count.
    - `seed`: random seed.
    - `follower_fraction`: share of nodes that follow their first producer.
    - `memory`: add memory groups (two consecutive layers live together) and a budget
      `MEMORY_BUDGET_FRACTION` of the way from the least to the most memory a group can need.

    **Returns:** a `ShardingProblem`.
    """
    rng = np.random.default_rng(seed)
    log_sizes = rng.uniform(np.log(MIN_STRATEGIES), np.log(MAX_STRATEGIES + 1), num_nodes)
    sizes = np.exp(log_sizes).astype(int)
    specs = [rng.choice(SPEC_POOL_SIZE, size=s, replace=False) for s in sizes]
    spec_factor = rng.uniform(0.2, 1.0, (SPEC_POOL_SIZE, SPEC_POOL_SIZE))
    spec_factor = (spec_factor + spec_factor.T) / 2
    np.fill_diagonal(spec_factor, 0.0)
    shard_degree = rng.choice([1, 2, 4, 8], size=SPEC_POOL_SIZE)
    work = rng.lognormal(-6, 1.5, num_nodes)  # seconds on one device
    tensor_time = rng.lognormal(-7, 1.5, num_nodes)  # seconds to move a node's output once
    node_costs = [work[v] / shard_degree[specs[v]] * rng.uniform(1, 1.3, sizes[v])
                  for v in range(num_nodes)]
    edges = _layered_dag(num_nodes, rng)
    edge_costs = [tensor_time[u] * spec_factor[np.ix_(specs[u], specs[v])] for u, v in edges]
    followers = {}
    first_producer = {}
    for u, v in edges:
        first_producer.setdefault(v, u)
    for v, u in sorted(first_producer.items()):
        if rng.random() < follower_fraction:
            same = {int(spec): k for k, spec in enumerate(specs[v])}
            fallback = rng.integers(0, sizes[v], sizes[u])
            followers[v] = (u, np.array([same.get(int(s), f) for s, f in zip(specs[u], fallback)]))
    kwargs = {}
    if memory:
        node_memory = [tensor_time[v] * 1e11 / shard_degree[specs[v]] for v in range(num_nodes)]
        layers = range(0, num_nodes, NODES_PER_LAYER)
        groups = tuple(tuple(range(s, min(s + 2 * NODES_PER_LAYER, num_nodes))) for s in layers)
        unbounded = ShardingProblem(tuple(node_costs), tuple(edges), tuple(edge_costs),
                                    tuple(node_memory), groups, None, followers)
        least = least_memory(unbounded)
        most = max(sum(node_memory[v].max() for v in g) for g in groups)
        kwargs = dict(node_memory=tuple(node_memory), memory_groups=groups,
                      memory_budget=least + MEMORY_BUDGET_FRACTION * (most - least))
    return ShardingProblem(tuple(node_costs), tuple(edges), tuple(edge_costs),
                           followers=followers, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 3000])
    parser.add_argument("--formulations", nargs="+", default=["marginal", "product"])
    parser.add_argument("--solver", default="auto", choices=["auto", "highs", "cbc"])
    parser.add_argument("--followers", type=float, default=0.3, help="follower fraction")
    parser.add_argument("--memory", action="store_true", help="add memory groups and a budget")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{'nodes':>6} {'merged':>6} {'in ILP':>6} {'vars (Alpa)':>11} {'vars':>8} "
          f"{'rows':>8} {'form':>8} {'build s':>8} {'solve s':>8} {'status':>10} objective")
    for num_nodes in args.sizes:
        start = time.perf_counter()
        problem = random_problem(num_nodes, args.seed, args.followers, args.memory)
        generate = time.perf_counter() - start
        for formulation in args.formulations:
            solution = solve(problem, time_limit=args.time_limit, solver=args.solver,
                             formulation=formulation)
            s = solution.stats
            print(f"{s.num_nodes:>6} {s.num_nodes_after_merge:>6} {s.num_ilp_nodes:>6} "
                  f"{s.num_variables_before_merge:>11} {s.num_variables:>8} "
                  f"{s.num_constraints:>8} {formulation:>8} {s.build_time:>8.2f} "
                  f"{s.solve_time:>8.2f} {solution.status:>10} {solution.objective:.9g}",
                  flush=True)
        print(f"  (generating the problem took {generate:.2f} s, solver {s.solver})")


if __name__ == "__main__":
    main()
