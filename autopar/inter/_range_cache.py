"""Figures shared by the layer ranges of equal content, and the layer ILPs a range needs.

In: a `LayerCostTable` (or a test's made-up table with the same methods) and a range of
its layers. Out: `range_key`, equal for contiguous ranges of the same layer structures
sharing the same state at the same places; `_range_cached`, a figure computed once per
such key (a remat fit, a lower bound, an order of shapes); and `_prefetch`, the range's
layer ILPs solved side by side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.inter._layer_table import LayerCostTable

# `range_key`'s hashes, and the entries `LayerCostTable.range_cache` holds before it is
# cleared (a fit holds a tuple of its layers' costs: a few hundred MB at most).
_HASH_MOD = (1 << 61) - 1
_HASH_BASES = (1_000_003, 998_244_353)
RANGE_CACHE_SIZE = 200_000


# `content` not given: `_range_cache_key` asks the table (see `range_content`).
_ASK = object()


def range_content(table: LayerCostTable, layer_range):
    """The range's `range_key` (None: nothing shared: a range that is not contiguous, or
    a table without `range_key`, e.g. a test's made-up numbers). A caller that reads
    several figures of one range passes it on as `content` instead of a key per figure."""
    range_key = getattr(table, "range_key", None)
    return None if range_key is None else range_key(layer_range)


def _range_cache_key(table: LayerCostTable, what: str, layer_range, args: tuple,
                     content=_ASK):
    """The `range_cache` key of `what` for these layers and `args`; None when nothing is
    shared (`range_content`, given or asked)."""
    if content is _ASK:
        content = range_content(table, layer_range)
    return None if content is None else (what, content, *args)


def _range_cached(table: LayerCostTable, what: str, layer_range, args: tuple, compute,
                  content=_ASK):
    """`compute()`, shared by the layer ranges of equal content (`_range_cache_key`)."""
    key = _range_cache_key(table, what, layer_range, args, content)
    if key is None:
        return compute()
    cache = table.range_cache
    if key not in cache:
        if len(cache) >= RANGE_CACHE_SIZE:
            cache.clear()
        cache[key] = compute()
    return cache[key]


def _all_solved(table: LayerCostTable, layer_range, shape, level: int,
                content=_ASK) -> bool:
    """Whether every layer's cost at `level` is known without a solve (a range once
    solved stays so: only that answer is shared)."""
    key = _range_cache_key(table, "solved", layer_range, (shape, level), content)
    if key is not None and key in table.range_cache:
        return True
    if not all(table.is_solved(k, shape, level) for k in layer_range):
        return False
    if key is not None:
        table.range_cache[key] = True
    return True


def _prefetch(table: LayerCostTable, layer_range, shape, level: int) -> None:
    """The range's layer ILPs at `level` solved side by side (`LayerCostTable.prefetch`)
    when some are not yet."""
    prefetch = getattr(table, "prefetch", None)  # a test's made-up table has none
    if prefetch is not None and not _all_solved(table, layer_range, shape, level):
        prefetch((k, shape, level) for k in layer_range)


def range_key(table, layer_range) -> tuple | None:
    """`LayerCostTable.range_key`: a key equal for contiguous layer ranges of equal
    content -- the same layer structures in the same order, sharing the same state at the
    same places -- whose costs, memory and remat choices are therefore equal (every
    per-layer figure is keyed by the layer's structure); None for a range that is not
    contiguous. O(shared state vars): the structures are compared by two polynomial hashes
    of the sequence (mod 2^61 - 1), not layer by layer."""
    if isinstance(layer_range, range):
        if layer_range.step != 1:
            return None
        start, end = layer_range.start, layer_range.stop
        known = table.__dict__.setdefault("_range_keys", {})  # (start, end) -> key
        if (start, end) not in known:
            known[(start, end)] = _range_key(table, start, end)
        return known[(start, end)]
    layer_range = list(layer_range)
    if not layer_range:
        return ()
    start, end = layer_range[0], layer_range[-1] + 1
    if layer_range != list(range(start, end)):
        return None
    return _range_key(table, start, end)


def _range_key(table, start: int, end: int) -> tuple:
    """`range_key` of layers [start, end)."""
    if end <= start:
        return ()
    if table._hashes is None:
        table._hashes = _prefix_hashes(table.fingerprints)
    length = end - start
    key = [length]
    for prefix, power in table._hashes:
        key.append((prefix[end] - prefix[start] * power[length]) % _HASH_MOD)
    for v, ks in table.shared_readers().items():
        inside = [k for k in ks if start <= k < end]
        if len(inside) > 1:
            key.append(tuple((k - start, table._slots[(v, k)]) for k in inside))
    return tuple(key)


def _prefix_hashes(fingerprints) -> list[tuple[list[int], list[int]]]:
    """Per hash base, the prefix hashes of the layers' structures (each fingerprint coded
    by its first appearance) and the powers of the base, both mod `_HASH_MOD`."""
    ids: dict[str, int] = {}
    codes = [ids.setdefault(f, len(ids)) + 1 for f in fingerprints]
    hashes = []
    for base in _HASH_BASES:
        prefix, power = [0], [1]
        for c in codes:
            prefix.append((prefix[-1] * base + c) % _HASH_MOD)
            power.append(power[-1] * base % _HASH_MOD)
        hashes.append((prefix, power))
    return hashes
