"""Pictures of a plan: which devices hold which part of every weight.

`plot_layout(plan, path)` draws, for each layer, every weight with two or more dims as a
rectangle cut into its shards. Each colour is one shard; the numbers in a shard are the
devices that hold a copy of it. A first panel draws the mesh itself (device ids laid out
along the named mesh axes), so "P(None, 'y')" reads as "columns split across the y axis".

Matplotlib is an optional dependency (``pip install autopar[plot]``). Figures are made
with `matplotlib.figure.Figure`, never `pyplot`, so drawing changes no global state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from autopar.cluster import LogicalMesh, Spec, spec_axes, spec_str
from autopar.report._explain import _group, _short

# Rows and columns sampled per weight: enough to show every shard boundary of meshes up to
# 64 devices, few enough to draw instantly for a 51,200 x 12,288 embedding.
MAX_CELLS = 256
# The drawn rectangle's height/width follows the weight's, clamped to this range so that a
# 51,200 x 64 embedding stays visible.
MAX_ASPECT = 3.0
# More devices than this in one label are shortened to "first, second, ... (count)".
MAX_LABEL_DEVICES = 4
PANEL_INCHES = 2.3
MISSING_MATPLOTLIB = (
    "autopar's pictures need matplotlib, which is not installed. Install the plot extra: "
    "pip install autopar[plot]   (or: pip install matplotlib)"
)
_LAYER_NUMBER = re.compile(r"\d+$")


def new_figure(**kwargs):
    """A `matplotlib.figure.Figure`; ImportError naming ``autopar[plot]`` without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(MISSING_MATPLOTLIB) from err
    return Figure(**kwargs)


# ---- who holds what ----------------------------------------------------------------------


def shard_counts(spec: Spec, mesh: LogicalMesh) -> tuple[int, ...]:
    """How many pieces each tensor dim is cut into."""
    return tuple(mesh.axis_size(axes) if axes else 1 for axes in spec)


def shard_holders(spec: Spec, mesh: LogicalMesh) -> dict[tuple[int, ...], tuple[int, ...]]:
    """For every shard (its index along each dim), the device ids that hold it.

    Device d at mesh coordinates c holds, along dim k, piece number ``c[spec[k]]`` (the
    coordinates of the axes in ``spec[k]``, major to minor); devices that differ only along
    axes the spec does not use hold the same shard.

    **Example:** on mesh ``{'x': 2, 'y': 2}`` (devices 0 1 / 2 3), ``P(None, 'y')`` gives
    ``{(0, 0): (0, 2), (0, 1): (1, 3)}``.
    """
    unknown = set(spec_axes(spec)) - set(mesh.axis_names)
    if unknown:
        raise ValueError(
            f"spec {spec_str(spec)} uses mesh axes {sorted(unknown)} that mesh "
            f"{mesh.sizes()} does not have"
        )
    ids = np.asarray(mesh.device_ids).reshape(mesh.shape)
    holders: dict[tuple[int, ...], list[int]] = {}
    for coords in np.ndindex(*mesh.shape):
        at = dict(zip(mesh.axis_names, coords))
        index = tuple(_piece(axes, at, mesh) for axes in spec)
        holders.setdefault(index, []).append(int(ids[coords]))
    return {k: tuple(sorted(v)) for k, v in sorted(holders.items())}


def _piece(axes: tuple[str, ...], coords: dict[str, int], mesh: LogicalMesh) -> int:
    piece = 0
    for axis in axes:  # major to minor
        piece = piece * mesh.axis_size(axis) + coords[axis]
    return piece


def sampled_elements(
    shape: Sequence[int], max_cells: int = MAX_CELLS
) -> tuple[np.ndarray, np.ndarray]:
    """Evenly sampled rows and columns of a tensor viewed as a matrix.

    The tensor is viewed as ``[prod(shape[:-1]), shape[-1]]`` (leading dims flattened in
    row-major order); at most `max_cells` rows and columns are kept.

    **Returns:** ``(row_coords, cols)``: each sampled row as its coordinates along the
    leading dims (``[rows, ndim - 1]``), and the sampled column indices (``[cols]``).
    """
    assert len(shape) >= 2, f"a matrix view needs 2+ dims, got shape {tuple(shape)}"
    leading = tuple(int(s) for s in shape[:-1])
    rows = _sample(math.prod(leading), max_cells)
    cols = _sample(int(shape[-1]), max_cells)
    return np.stack(np.unravel_index(rows, leading), axis=1), cols


def _sample(n: int, max_cells: int) -> np.ndarray:
    if n <= max_cells:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_cells).round().astype(np.int64))


def owner_grid(
    shape: Sequence[int], spec: Spec, mesh: LogicalMesh, max_cells: int = MAX_CELLS
) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """A matrix view of a tensor where each cell holds the number of its shard.

    **Returns:** ``(grid, holders)``: ``grid[r, c]`` indexes `holders`, the device-id tuples
    of the shards in `shard_holders` order. See `sampled_elements` for the matrix view;
    pieces are JAX's: element i of a dim cut in n is in piece ``i // ceil(size / n)``.
    """
    counts = shard_counts(spec, mesh)
    holders = shard_holders(spec, mesh)
    assert len(holders) == math.prod(counts), f"{len(holders)} shards for counts {counts}"
    row_coords, cols = sampled_elements(shape, max_cells)
    chunks = [-(-int(size) // count) for size, count in zip(shape, counts)]  # ceil division
    row_pieces = row_coords // np.asarray(chunks[:-1])
    col_pieces = cols // chunks[-1]
    # Shards are numbered in row-major order of their piece indices, as shard_holders sorts.
    row_number = np.ravel_multi_index(tuple(row_pieces.T), counts[:-1]) * counts[-1]
    grid = row_number[:, None] + col_pieces[None, :]
    return grid, list(holders.values())


def device_label(devices: Sequence[int]) -> str:
    """``(0, 1, 2, 3)`` -> ``"0-3"``; ``(0, 2, 4, 6)`` -> ``"0,2,4,6"``; long lists shortened."""
    devices = list(devices)
    if len(devices) > 2 and devices == list(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}-{devices[-1]}"
    if len(devices) > MAX_LABEL_DEVICES:
        return f"{devices[0]},{devices[1]},…({len(devices)})"
    return ",".join(map(str, devices))


# ---- which weights, grouped how ----------------------------------------------------------


def layer_rows(plan) -> list[tuple[str, list]]:
    """The plan's 2+-dim parameters grouped by layer, identical neighbour layers merged.

    Layers are found as `Plan.explain` finds them (``layers/3/...``). A run of layers
    whose parameters have the same names, shapes and specs becomes one row titled
    ``layers 0-3``.

    **Returns:** ``[(title, [InputInfo, ...]), ...]`` in the plan's input order.
    """
    groups: dict[str, list] = {}
    for info in plan.inputs:
        if info.role == "param" and len(info.shape) >= 2:
            groups.setdefault(_group(info.path), []).append(info)
    rows: list[tuple[list[str], tuple, list]] = []
    for name, infos in groups.items():
        signature = tuple((_short(i.path), i.shape, i.spec) for i in infos)
        if name != "other" and rows and rows[-1][0][0] != "other" and rows[-1][1] == signature:
            rows[-1][0].append(name)
            continue
        rows.append(([name], signature, infos))
    return [(_row_title(names), infos) for names, _, infos in rows]


def _row_title(names: list[str]) -> str:
    if names == ["other"]:
        return "outside layers"
    if len(names) == 1:
        return names[0]
    first = _LAYER_NUMBER.search(names[0]).group()
    last = _LAYER_NUMBER.search(names[-1]).group()
    return f"layers {first}-{last}"


def _mesh_of(plan, info) -> LogicalMesh:
    """The mesh an input lives on: that of the stage holding it (`InputInfo.stage`)."""
    return plan.stages[getattr(info, "stage", 0)].mesh


# ---- drawing -----------------------------------------------------------------------------


def _colors(count: int):
    from matplotlib import colormaps

    cmap = colormaps["tab10" if count <= 10 else "tab20" if count <= 20 else "turbo"]
    if count > 20:
        return [cmap(i / max(count - 1, 1)) for i in range(count)]
    return [cmap(i) for i in range(count)]


def _draw_weight(ax, info, mesh: LogicalMesh) -> None:
    from matplotlib.colors import ListedColormap

    grid, holders = owner_grid(info.shape, info.spec, mesh)
    rows, cols = grid.shape
    height = min(max(math.prod(info.shape[:-1]) / info.shape[-1], 1 / MAX_ASPECT), MAX_ASPECT)
    if len(holders) == 1:
        cmap = ListedColormap(["#BBBBBB"])
    else:
        cmap = ListedColormap(_colors(len(holders)))
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(holders) - 0.5, interpolation="nearest",
              extent=(0, 1, height, 0), aspect="equal")
    _label_shards(ax, grid, holders, height)
    ax.set_xticks([])
    ax.set_yticks([])
    leading = " x ".join(map(str, info.shape[:-1]))
    ax.set_ylabel(leading, fontsize=7)
    ax.set_xlabel(str(info.shape[-1]), fontsize=7)
    name = _short(info.path).removeprefix("params/")
    ax.set_title(f"{name}\n{spec_str(info.spec)}", fontsize=8)


def _label_shards(ax, grid: np.ndarray, holders, height: float) -> None:
    """Write the holders' device ids at the centre of every shard that is one rectangle."""
    rows, cols = grid.shape
    if len(holders) == 1:
        ax.text(0.5, height / 2, f"replicated\non {device_label(holders[0])}",
                ha="center", va="center", fontsize=7)
        return
    fontsize = 7 if len(holders) <= 8 else 5
    for n, devices in enumerate(holders):
        r, c = np.nonzero(grid == n)
        if len(r) == 0:
            continue
        box = (r.max() - r.min() + 1) * (c.max() - c.min() + 1)
        if box != len(r):  # interleaved pieces: no single centre to label
            continue
        x = (c.min() + c.max() + 1) / 2 / cols
        y = (r.min() + r.max() + 1) / 2 / rows * height
        ax.text(x, y, device_label(devices), ha="center", va="center", fontsize=fontsize,
                color="white", fontweight="bold")


def _draw_mesh(ax, mesh: LogicalMesh) -> None:
    """The mesh as a grid of device ids: rows along the first axis, columns the second."""
    from matplotlib.colors import ListedColormap

    shape = mesh.shape if len(mesh.shape) >= 2 else (1, mesh.shape[0])
    rows, cols = shape[0], math.prod(shape[1:])
    ids = np.asarray(mesh.device_ids).reshape(rows, cols)
    ax.imshow(np.zeros((rows, cols)), cmap=ListedColormap(["#E4E4E4"]), extent=(0, cols, rows, 0))
    for r in range(rows):
        for c in range(cols):
            ax.text(c + 0.5, r + 0.5, str(ids[r, c]), ha="center", va="center", fontsize=8)
    ax.set_xticks(np.arange(cols + 1), minor=True)
    ax.set_yticks(np.arange(rows + 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    names = mesh.axis_names
    if len(mesh.shape) >= 2:
        ax.set_ylabel(f"axis {names[0]!r} ({mesh.shape[0]}) →", fontsize=7)
        ax.set_xlabel(f"axis {' x '.join(map(repr, names[1:]))} ({cols}) →", fontsize=7)
    else:
        ax.set_xlabel(f"axis {names[0]!r} ({mesh.shape[0]}) →", fontsize=7)
    ax.set_title("mesh (device ids)", fontsize=8)


def plot_layout(plan, path: str | Path) -> Path:
    """Draw how every 2+-dim parameter of `plan` is split across the devices.

    One row per layer (identical neighbouring layers share a row), one panel per weight:
    the weight as a rectangle (rows: its leading dims, columns: its last dim) cut into
    shards, one colour per shard, labelled with the devices that hold it. The first panel
    of each row draws the mesh.

    **Arguments:**
    - `plan`: an `autopar.Plan`.
    - `path`: the image file; ``.png``, ``.svg`` or ``.pdf`` by its suffix.

    **Returns:** the path written. Raises ImportError without matplotlib
    (``pip install autopar[plot]``), ValueError if the plan has no 2+-dim parameters.
    """
    rows = layer_rows(plan)
    if not rows:
        raise ValueError(
            "the plan has no parameters with two or more dims to draw; plot_layout shows "
            "weight matrices (parameters are the inputs whose role is 'param')"
        )
    num_cols = 1 + max(len(infos) for _, infos in rows)
    fig = new_figure(figsize=(PANEL_INCHES * num_cols, PANEL_INCHES * len(rows) + 0.6))
    for r, (title, infos) in enumerate(rows):
        mesh = _mesh_of(plan, infos[0])
        mesh_ax = fig.add_subplot(len(rows), num_cols, r * num_cols + 1)
        _draw_mesh(mesh_ax, mesh)
        mesh_ax.text(-0.35, 0.5, title, transform=mesh_ax.transAxes, rotation=90,
                     ha="center", va="center", fontsize=10, fontweight="bold")
        for c, info in enumerate(infos):
            ax = fig.add_subplot(len(rows), num_cols, r * num_cols + c + 2)
            _draw_weight(ax, info, _mesh_of(plan, info))
    fig.suptitle(
        f"autopar plan ({plan.method}): each colour is one shard, the numbers are the "
        "devices holding it",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
