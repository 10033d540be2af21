"""Resharding: the collectives (and their time) that turn one spec of a tensor into another.

The model follows what XLA's SPMD partitioner emits (`PartitionedHlo::ReshardNoCache` in
xla/service/spmd/spmd_partitioner.cc): every rule below was read off compiled HLO, and
`tests/test_intra_correctness.py::test_reshard_matches_xla` compiles every pair of specs of
a matrix on meshes (2, 4) and (4, 2) to keep it so. XLA reasons about tile counts and
device order, not about axis names, so the model does too. Every mesh axis is cut into
prime *digits* (an axis of size 4 is two digits of size 2, major then minor); a *layout*
lists, per tensor dimension, the digits that split it, major to minor, and a device's tile
along a dimension is its coordinates on those digits read as one number.

From `src` to `dst` each dimension's tile count grows or shrinks by some factor, and XLA:
1. slices growing dimensions locally (free), taking replicated digits;
2. moves tiles that one dimension loses and another gains with an all-to-all (the moved
   digits, the minor ones, become the minor digits of the receiver); when the dimensions
   merely permute their tile counts, each moves whole into the one that needs its count;
3. all-gathers what shrinking dimensions still lose (their minor digits, one all-gather per
   dimension, the last dimension first): before the all-to-alls when `dst` has fewer
   tiles, after them otherwise;
4. if the digits do not end where `dst` has them, or some were taken from the middle of a
   dimension, puts every tile on its device with one collective-permute, where the tensor
   is smallest along the way;
5. and where it has no such route ("involuntary full rematerialization" in its log), it
   all-gathers every dimension and slices locally. That happens when a tile count changes
   by no whole factor, when there are slices and gathers but no trade, when one dimension
   would trade with two, when a trade has partly replicated layouts on both sides, or when
   a dimension both gives tiles to an unsplit one and is gathered.
Examples on a (4, 2) mesh: ``P('x') -> P('y')`` (4 tiles to 2) is a collective-permute of
the local quarter and an all-gather of pairs, not an all-gather of the whole tensor;
``P('y') -> P('x')`` (2 to 4) is a local slice and a collective-permute.
"""

from __future__ import annotations

import math

import numpy as np

from autopar._memo import declare, memo
from autopar.cluster import LogicalMesh, Spec
from autopar.cost import collectives_seconds
from autopar.graph import dtype_itemsize
from autopar.intra._strategies import Collective

Digit = tuple[str, int, int]  # (mesh axis, position in the axis with 0 the major, size)
Layout = list[list[Digit]]  # per tensor dimension, its digits major to minor
Move = tuple[int, int, int]  # an all-to-all: (from dimension, to dimension, factor)


@memo("intra.axis_digits", "(axis, size)", maxsize=1024)
def _axis_digits(axis: str, size: int) -> tuple[Digit, ...]:
    """The prime factors of an axis, as digits major to minor."""
    factors = []
    rest, prime = size, 2
    while rest > 1:
        while rest % prime == 0:
            factors.append(prime)
            rest //= prime
        prime += 1
    return tuple((axis, i, f) for i, f in enumerate(factors))


def _layout(spec: Spec, mesh: LogicalMesh) -> Layout:
    sizes = mesh.sizes()
    return [[d for axis in axes for d in _axis_digits(axis, sizes[axis])] for axes in spec]


def _tiles(digits) -> int:
    return math.prod(size for _, _, size in digits)


def _axes(digits, mesh: LogicalMesh) -> tuple[str, ...]:
    """The mesh axes that some of `digits` belong to, in mesh order."""
    names = {axis for axis, _, _ in digits}
    return tuple(a for a in mesh.axis_names if a in names)


def _take(candidates, factor: int) -> list[Digit] | None:
    """Digits from `candidates`, in order, whose sizes multiply to `factor` (None if none)."""
    taken = []
    for digit in candidates:
        if factor == 1:
            break
        if digit not in taken and factor % digit[2] == 0:
            taken.append(digit)
            factor //= digit[2]
    return taken if factor == 1 else None


def reshard_collectives(
    shape: tuple[int, ...], dtype: str, src: Spec, dst: Spec, mesh: LogicalMesh
) -> tuple[Collective, ...]:
    """The collectives XLA issues to go from `src` to `dst` (empty when free).

    **Arguments:**
    - `shape`, `dtype`: the global tensor.
    - `src`, `dst`: its spec before and after (see `autopar.cluster.Spec`).
    - `mesh`: the logical mesh both specs refer to.

    **Returns:** `Collective`s in the order XLA runs them, with bytes as
    `autopar.cost.collective_time` takes them (the route is in the module docstring).
    """
    if src == dst:
        return ()
    # Dimensions split on neither side stay one tile throughout and take no part in the
    # route: it is the route of the other dimensions (checked on every spec pair of up
    # to 4 dimensions on 15 meshes), shared by more spec pairs (issue 18).
    kept = [d for d, (a, b) in enumerate(zip(src, dst)) if a or b]
    whole = dtype_itemsize(dtype)
    if len(kept) < len(shape):
        whole *= math.prod(n for d, n in enumerate(shape) if not (src[d] or dst[d]))
        shape = [shape[d] for d in kept]
        src, dst = tuple(src[d] for d in kept), tuple(dst[d] for d in kept)

    def per_device(tiles: tuple[int, ...]) -> float:
        return float(whole * math.prod(math.ceil(n / t) for n, t in zip(shape, tiles)))

    return tuple(
        Collective(kind, axes, per_device(tiles) if tiles is not None
                   else min(per_device(t) for t in states))
        for kind, axes, tiles, states in _route(len(shape), src, dst, mesh)
    )


@memo("intra.reshard_routes", "(ndim, src, dst, mesh)", maxsize=1 << 16)
def _route(ndim: int, src: Spec, dst: Spec, mesh: LogicalMesh):
    """The collectives from `src` to `dst` for any tensor of `ndim` dimensions: the route
    depends on the layouts alone, the bytes on the shape (issue 18: the same spec pairs
    recur for tensors of many shapes). **Returns:** (kind, axes, tiles per dimension when
    it runs, None) per collective, or (kind, axes, None, tiles of every state visited) for
    the collective-permute, which runs where the tensor is smallest."""
    return _Route(ndim, _layout(src, mesh), _layout(dst, mesh), mesh).run()


class _Route:
    """One resharding, simulated digit by digit (see the module docstring); it tracks tile
    counts per dimension, not bytes."""

    def __init__(self, ndim: int, current: Layout, target: Layout, mesh):
        self.shape, self.mesh = range(ndim), mesh  # only its length is read
        self.source = [list(dim) for dim in current]
        self.current, self.target = current, target
        self.out: list[tuple] = []
        self.reordered: list[Digit] = []  # digits of dimensions cut in the middle
        self.states = [self.per_device()]  # the smallest of these is the permute's size
        self.grow, self.shrink = [], []
        for have, want in zip(current, target):
            common = math.gcd(_tiles(have), _tiles(want))
            self.grow.append(_tiles(want) // common)
            self.shrink.append(_tiles(have) // common)

    def per_device(self) -> tuple[int, ...]:
        """The tile count of each dimension now (a device holds ceil(n / tiles) of each)."""
        return tuple(_tiles(d) for d in self.current)

    def add(self, kind: str, digits) -> None:
        self.out.append((kind, _axes(digits, self.mesh), self.per_device(), None))
        self.states.append(self.per_device())

    def run(self) -> tuple[tuple, ...]:
        if self.current == self.target:
            return ()
        uneven = any(g > 1 and s > 1 for g, s in zip(self.grow, self.shrink))
        moves = [] if uneven else self.pair_moves()
        if uneven or self.no_direct_route(moves):
            return self.full_rematerialization()
        if math.prod(map(_tiles, self.target)) < math.prod(map(_tiles, self.current)):
            ok = self.gather() and self.move(moves) and self.slice(moves, after_moves=True)
        else:
            ok = (
                self.slice(moves, after_moves=False)
                and self.move(moves)
                and self.slice(moves, after_moves=True)
                and self.gather()
            )
        if not ok:
            return self.full_rematerialization()
        misplaced = self.reordered + [
            d
            for have, want in zip(self.current, self.target)
            for d in have + want
            if d not in have or d not in want or have.index(d) != want.index(d)
        ]
        if misplaced:
            self.out.append(("send_recv", _axes(misplaced, self.mesh), None, tuple(self.states)))
        return tuple(self.out)

    def no_direct_route(self, moves: list[Move]) -> bool:
        """Whether XLA falls back to a full rematerialization (module docstring, step 5)."""
        if not moves:
            return max(self.grow) > 1 and max(self.shrink) > 1
        givers, receivers = [s for s, _, _ in moves], [g for _, g, _ in moves]
        if len(set(givers)) < len(givers) or len(set(receivers)) < len(receivers):
            return True
        num_src = math.prod(map(_tiles, self.current))
        num_dst = math.prod(map(_tiles, self.target))
        if num_src != num_dst and math.prod(self.mesh.shape) not in (num_src, num_dst):
            return True
        return any(self.shrink[s] > 1 and not self.current[g] for s, g, _ in moves)

    def pair_moves(self) -> list[Move]:
        """The all-to-alls; `grow` and `shrink` keep what slices and gathers must still do."""
        whole = self.whole_moves()
        if whole is not None:
            self.grow = [1] * len(self.shape)
            self.shrink = [1] * len(self.shape)
            return whole
        moves = []
        ndim = len(self.shape)
        pairs = [(s, g) for s in range(ndim) for g in range(ndim) if s != g]
        # Exact trades first (one dimension loses what another gains); among equals XLA
        # takes the later dimensions.
        pairs.sort(key=lambda p: (self.shrink[p[0]] != self.grow[p[1]], -p[1], -p[0]))
        for s, g in pairs:
            factor = math.gcd(self.shrink[s], self.grow[g])
            if factor > 1:
                moves.append((s, g, factor))
                self.shrink[s] //= factor
                self.grow[g] //= factor
        return moves

    def whole_moves(self) -> list[Move] | None:
        """When the dimensions merely permute their tile counts, each moves whole into the
        one that needs its count, in an order where the receiver is already empty; None if
        the counts are not a permutation or no such order exists (a swap)."""
        counts = [(_tiles(c), _tiles(t)) for c, t in zip(self.current, self.target)]
        differ = [d for d, (c, t) in enumerate(counts) if c != t]
        if sorted(counts[d][0] for d in differ) != sorted(counts[d][1] for d in differ):
            return None
        pairs, free_targets = {}, list(differ)
        for s in differ:
            g = next(g for g in free_targets if counts[g][1] == counts[s][0])
            free_targets.remove(g)
            if counts[s][0] > 1:
                pairs[s] = g
        ordered, occupied = [], {d for d in differ if counts[d][0] > 1}
        while pairs:
            ready = [s for s, g in pairs.items() if g not in occupied]
            if not ready:
                return None
            s = ready[0]
            ordered.append((s, pairs.pop(s), counts[s][0]))
            occupied.discard(s)
        return ordered

    def slice(self, moves: list[Move], after_moves: bool) -> bool:
        """Local slices of growing dimensions, from replicated digits (those `dst` wants
        next first). A dimension that gives tiles away is sliced after its all-to-all."""
        givers = {s for s, _, _ in moves}
        all_digits = [
            d for a, n in zip(self.mesh.axis_names, self.mesh.shape) for d in _axis_digits(a, n)
        ]
        for g, factor in enumerate(self.grow):
            if factor == 1 or (g in givers) != after_moves:
                continue
            used = {d for dim in self.current for d in dim}
            preferred = self.target[g][len(self.current[g]) :] + all_digits
            sliced = _take([d for d in preferred if d not in used], factor)
            if sliced is None:
                return False
            self.current[g] += sliced
            self.grow[g] = 1
            self.states.append(self.per_device())
        return True

    def pop_minor(self, dim: int, factor: int) -> list[Digit] | None:
        """Take digits making up `factor` off the minor end of `dim`. XLA gathers and
        exchanges contiguous runs of tiles, so digits taken from the middle need a
        collective-permute."""
        digits = self.current[dim]
        taken = _take(digits[::-1], factor)
        if taken is None:
            return None
        taken = [d for d in digits if d in taken]
        if digits[len(digits) - len(taken) :] != taken:
            self.reordered += digits
        self.current[dim] = [d for d in digits if d not in taken]
        return taken

    def move(self, moves: list[Move]) -> bool:
        for s, g, factor in moves:
            moved = self.pop_minor(s, factor)
            if moved is None:
                return False
            self.current[g] += moved
            self.add("all_to_all", moved)
        return True

    def gather(self) -> bool:
        """All-gathers of what shrinking dimensions still lose, the last dimension first."""
        for s in reversed(range(len(self.shape))):
            if self.shrink[s] == 1:
                continue
            gathered = self.pop_minor(s, self.shrink[s])
            if gathered is None:
                return False
            self.shrink[s] = 1
            self.add("all_gather", gathered)
        return True

    def full_rematerialization(self) -> tuple[Collective, ...]:
        """All-gather every split dimension (the last first), then slice locally."""
        self.out, self.current = [], [list(dim) for dim in self.source]
        for s in reversed(range(len(self.shape))):
            if self.current[s]:
                gathered, self.current[s] = self.current[s], []
                self.add("all_gather", gathered)
        return tuple(self.out)


# Resharding times shared by every problem of a process (issue 18: 1.78 million calls, most
# repeats across layers, memory levels and microbatch counts). Keyed by the mesh up to a
# shift by whole hosts (the cost model sees only which devices share a host, and a
# cluster's hosts are alike) and by the cluster; bounded, cleared when full.
_SHARED: dict[tuple, dict] = declare(
    {}, "intra.reshard_times", "(mesh up to a shift by hosts, cluster) -> {reshard: seconds}")
_SHARED_LIMIT = 2_000_000  # entries, some 200 bytes each


def shared_reshard_cache(mesh: LogicalMesh, cluster) -> dict:
    """The process-wide memo of `reshard_time` for `mesh` on `cluster` (pass it as
    `cache`): meshes that differ only by a shift of whole hosts share one."""
    per_host = cluster.devices_per_host
    base = (min(mesh.device_ids) // per_host) * per_host if mesh.device_ids else 0
    key = (mesh.shape, mesh.axis_names, tuple(d - base for d in mesh.device_ids), cluster)
    cache = _SHARED.get(key)
    if cache is None:
        if sum(len(c) for c in _SHARED.values()) > _SHARED_LIMIT:
            _SHARED.clear()
        cache = _SHARED[key] = {}
    return cache


def reshard_time(
    shape: tuple[int, ...],
    dtype: str,
    src: Spec,
    dst: Spec,
    mesh: LogicalMesh,
    cluster,
    cache: dict | None = None,
) -> float:
    """Seconds to reshard a tensor from `src` to `dst` on `mesh`: its
    `reshard_collectives` priced by `autopar.cost.collectives_seconds`.

    `cache`, if given, memoises results for one (mesh, cluster) pair.
    """
    if src == dst:
        return 0.0
    key = (tuple(shape), dtype, src, dst)
    if cache is not None:
        if key in cache:
            return cache[key]
        reduced = _reduced_key(shape, dtype, src, dst)
        if reduced is not None and reduced in cache:
            seconds = cache[key] = cache[reduced]
            return seconds
    collectives = reshard_collectives(shape, dtype, src, dst, mesh)
    seconds = collectives_seconds(((c.kind, c.nbytes, c.axes) for c in collectives),
                                  cluster, mesh, cache)
    if cache is not None:
        cache[key] = seconds
        if reduced is not None:
            cache[reduced] = seconds
    return seconds


def _reduced_key(shape, dtype: str, src: Spec, dst: Spec) -> tuple | None:
    """What `reshard_collectives` reads of a resharding that leaves some dimension whole
    on both sides: the product of those dimensions' sizes, the dtype, and the other
    dimensions' sizes and specs (None when every dimension is split on some side). Tensors
    that agree on it get the same collectives of the same bytes, so one memo entry serves
    them all: the same layer's activations at other microbatch sizes when their batch
    dimension stays whole (issue 45: 40 % of the resharding computations of the demo's and
    of llama-8B@64's planning)."""
    kept = [d for d, (a, b) in enumerate(zip(src, dst)) if a or b]
    if len(kept) == len(shape):
        return None
    whole = math.prod(n for d, n in enumerate(shape) if not (src[d] or dst[d]))
    return ("reduced", whole, dtype, tuple(shape[d] for d in kept),
            tuple(src[d] for d in kept), tuple(dst[d] for d in kept))


def reshard_matrix(shape, dtype: str, srcs, dsts, mesh: LogicalMesh, cluster, cache: dict,
                   pair_key=None) -> np.ndarray:
    """`reshard_time` of every pair of `srcs` (rows) and `dsts` (columns), the same
    numbers to the last bit, for an ILP edge's matrix (issue 45: a problem build priced
    some 4,000 pairs one `reshard_time` call each, a third of the build).

    A pair's route (`_route`'s collectives, with each one's tile counts per dimension)
    depends on the specs and the mesh alone: the routes of all pairs are tabled once
    (`_RouteTable`) and memoised in `cache` (`shared_reshard_cache`'s, for this mesh and
    cluster) under ``("routes", pair_key)`` when `pair_key` names the two spec lists. The
    shape only sets each collective's bytes (`reshard_collectives`' integer products, here
    over all pairs at once); each distinct (kind, axes, bytes) is priced by
    `autopar.cost.collectives_seconds` with `cache` as its memo, and a pair's seconds are
    its collectives' summed in their order, as `reshard_time` sums them.
    """
    table = cache.get(("routes", pair_key)) if pair_key is not None else None
    if table is None:
        table = _RouteTable(srcs, dsts, len(shape), mesh, cache)
        if pair_key is not None:
            cache["routes", pair_key] = table
    return table.seconds(shape, dtype, cluster, mesh, cache).reshape(len(srcs), len(dsts))


class _RouteTable:
    """The routes of every (src, dst) pair of two spec lists, as arrays. Per collective
    slot (a route's first, second, ... collective but its collective-permute), its kind
    and axes (`kinds`: 1 + an index into `names`, 0 where the pair's route is shorter) and
    the tile counts of every dimension when it runs (`tiles`: slot x pair x dimension);
    then the collective-permute that ends some routes (`permuted`: those pairs;
    `permute`: its code) and the tile counts of every state it may run at (`states`:
    permuted pair x state x dimension): it runs where the tensor is smallest."""

    def __init__(self, srcs, dsts, ndim: int, mesh: LogicalMesh, cache: dict):
        ids = cache.setdefault("spec ids", {})
        rows = [ids.setdefault(a, len(ids)) for a in srcs]
        cols = [ids.setdefault(b, len(ids)) for b in dsts]
        known = cache.get  # (a memo hit without the call: half a million pairs a search)
        routes = [known(("pair route", i, j)) or _pair_route(i, a, j, b, ndim, mesh, cache)
                  for i, a in zip(rows, srcs) for j, b in zip(cols, dsts)]
        slots = max((len(r[0]) for r in routes), default=0)
        depth = max((len(r[1][1]) for r in routes if r[1] is not None), default=1)
        self.names: list[tuple[str, tuple[str, ...]]] = []
        codes: dict[tuple, int] = {}

        def code_of(name) -> int:
            code = codes.get(name)
            if code is None:
                code = codes[name] = len(self.names) + 1
                self.names.append(name)
            return code

        one = (1,) * ndim
        kinds = [[0] * len(routes) for _ in range(slots)]
        tiles = [[one] * len(routes) for _ in range(slots)]
        permuted, permute, states = [], [], []
        for p, (steps, last) in enumerate(routes):
            for j, (name, at) in enumerate(steps):
                kinds[j][p] = code_of(name)
                tiles[j][p] = at
            if last is not None:
                name, visited = last
                permuted.append(p)
                permute.append(code_of(name))
                # (padded with its first state, which leaves the smallest the same)
                states.append(visited + (visited[0],) * (depth - len(visited)))
        # (tile counts and codes are small: int32 keeps a search's tables some 50 MB)
        self.size = len(routes)
        self.kinds = np.array(kinds, dtype=np.int32).reshape(slots, len(routes))
        self.tiles = np.array(tiles, dtype=np.int32).reshape(slots, len(routes), ndim)
        self.permuted = np.array(permuted, dtype=np.intp)  # the pairs with a permute
        self.permute = np.array(permute, dtype=np.int32)
        self.states = np.array(states, dtype=np.int32).reshape(len(permuted), depth, ndim)

    def seconds(self, shape, dtype: str, cluster, mesh, cache) -> np.ndarray:
        total = np.zeros(self.size)
        if not self.names:
            return total
        sizes = np.array(shape, dtype=np.int64)
        itemsize = dtype_itemsize(dtype)
        # bytes per device: itemsize x the product of ceil(n / tiles), in int64
        per_device = (-(-sizes // self.tiles)).prod(axis=-1) * itemsize
        for kinds, nbytes in zip(self.kinds, per_device):
            total = total + self._priced(kinds.astype(np.int64), nbytes, cluster, mesh, cache)
        if len(self.permuted):
            nbytes = (-(-sizes // self.states)).prod(axis=-1).min(axis=-1) * itemsize
            last = np.zeros(self.size)
            last[self.permuted] = self._priced(self.permute.astype(np.int64), nbytes,
                                               cluster, mesh, cache)
            total = total + last
        return total

    def _priced(self, kinds, nbytes, cluster, mesh, cache) -> np.ndarray:
        """Seconds of one collective per pair (0 where `kinds` is 0), each distinct one
        priced once by `collectives_seconds`."""
        codes = len(self.names) + 1
        found, where = np.unique(nbytes * codes + kinds, return_inverse=True)
        priced = np.array([
            0.0 if key % codes == 0 else collectives_seconds(
                [(self.names[key % codes - 1][0], float(key // codes),
                  self.names[key % codes - 1][1])], cluster, mesh, cache)
            for key in found.tolist()
        ])
        return priced[where.reshape(-1)]


def _pair_route(i: int, src: Spec, j: int, dst: Spec, ndim: int, mesh: LogicalMesh,
                cache: dict) -> tuple:
    """`reshard_collectives`' route of one spec pair (`i`, `j`: their ids in `cache`)
    before it reads the shape, memoised in `cache`: ((kind, axes), the tile counts of
    every dimension when it runs (1 for those split on neither side)) per collective but
    the collective-permute, and ((kind, axes), the tile counts at each state it may run
    at) of that permute, or None."""
    key = ("pair route", i, j)
    found = cache.get(key)
    if found is not None:
        return found
    steps, last = [], None
    if src != dst:
        kept = [d for d, (a, b) in enumerate(zip(src, dst)) if a or b]

        def full(tiles) -> tuple[int, ...]:
            out = [1] * ndim
            for d, t in zip(kept, tiles):
                out[d] = t
            return tuple(out)

        route = _route(len(kept), tuple(src[d] for d in kept), tuple(dst[d] for d in kept),
                       mesh)
        for n, (kind, axes, tiles, states) in enumerate(route):
            if tiles is None:  # the collective-permute, always the route's last
                assert n == len(route) - 1, route
                last = ((kind, axes), tuple(map(full, states)))
            else:
                steps.append(((kind, axes), full(tiles)))
    found = cache[key] = (tuple(steps), last)
    return found
