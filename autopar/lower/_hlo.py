"""Count the collectives in compiled HLO, to check plans against what XLA does."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "send_recv",
}
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
# `%name = f32[8,16]{1,0} all-reduce(...)` or a tuple result `(f32[..], f32[..]) all-reduce(`
_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES.get(dtype, 4)
    return total


def count_collectives(hlo_text: str) -> dict[str, tuple[int, float]]:
    """Collective kind -> (count, bytes) in an optimized HLO module's text.

    Bytes are per device, measured the way `autopar.cost.collective_time` takes them: the
    result buffer for all-reduce, all-gather (the gathered size), all-to-all and
    collective-permute; for reduce-scatter the operand size (result × group size).
    """
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        kind = _KINDS[m.group("op")]
        nbytes = _shape_bytes(m.group("shape"))
        if kind == "reduce_scatter":
            groups = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
            size = len(groups.group(1).split(",")) if groups else 1
            if not groups:
                iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
                size = int(iota.group(2)) if iota else 1
            nbytes *= size
        counts[kind] += 1
        sizes[kind] += nbytes
    return {k: (counts[k], float(sizes[k])) for k in counts}
