"""A layer plan's variable specs, kept only for the variables its layer graph touches.

In: a plan's `var_specs` (a spec per variable id of the whole step, None for most) and the
ids a layer graph uses. Out: `_CompactSpecs`, which reads as the tuple it replaces.
`LayerCostTable` keeps every layer plan this way.
"""

from __future__ import annotations

from collections.abc import Sequence


class _CompactSpecs(Sequence):
    """A plan's `var_specs` (a spec per variable id, None for most) stored as one tuple of
    the specs of the variables in `index` (var id -> position, shared by the plans of one
    layer graph); every other id reads None. Reads as the tuple it replaces."""

    __slots__ = ("_index", "_specs", "_length")

    def __init__(self, index: dict[int, int], specs: tuple, length: int):
        self._index, self._specs, self._length = index, specs, length

    @classmethod
    def of(cls, var_specs, index: dict[int, int]):
        """The compact form of `var_specs`; `var_specs` itself when a spec lies outside
        `index`."""
        specs = [None] * len(index)
        for v, spec in enumerate(var_specs):
            if spec is not None:
                at = index.get(v)
                if at is None:
                    return var_specs
                specs[at] = spec
        return cls(index, tuple(specs), len(var_specs))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, v):
        if isinstance(v, slice):
            return tuple(self[i] for i in range(*v.indices(self._length)))
        if v < 0:
            v += self._length
        if not 0 <= v < self._length:
            raise IndexError(f"variable {v} out of range ({self._length} variables)")
        at = self._index.get(v)
        return None if at is None else self._specs[at]

    def __iter__(self):
        get, specs = self._index.get, self._specs
        for v in range(self._length):
            at = get(v)
            yield None if at is None else specs[at]

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, list, _CompactSpecs)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"_CompactSpecs({tuple(self)!r})"
