"""The memory/time Pareto frontier of priced plans, in words and as a picture.

In: points (peak memory per device, predicted step time), each with a label and where it
came from (autopar's search or a Megatron configuration): the rows of an explored space
(`autopar.space`), or a plan's `frontier_points`. Out: the frontier (no point on it is
both slower and larger than another), the lines `explain()` prints around a plan ("with
a budget of X: Y"), and a picture of the whole space (time against memory, the hand plans
and autopar's marked, the frontier drawn as a staircase).

TensorOpt (Cai et al. 2021) searches this frontier; here it is read off the plans that
were priced, so it is the frontier of what was explored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from autopar.plan import FrontierPoint
from autopar.report._why import _bytes as _fmt_bytes
from autopar.report._why import _time as _fmt_time


def pareto_frontier(points: Iterable[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other point beats in both memory and time, by memory (so by time
    falling). Ties: of equal memory the fastest; of equal (memory, time) the chosen plan,
    else the first given."""
    ordered = sorted(enumerate(points),
                     key=lambda ip: (ip[1].memory, ip[1].step_time, not ip[1].chosen, ip[0]))
    frontier: list[FrontierPoint] = []
    for _, point in ordered:
        if not frontier or point.step_time < frontier[-1].step_time:
            frontier.append(point)
    return frontier


def on_frontier(point: FrontierPoint, frontier: Sequence[FrontierPoint]) -> bool:
    """Whether no frontier point is at most as large and strictly faster, or strictly
    smaller and at most as slow, than `point`."""
    return not any(
        (f.memory <= point.memory and f.step_time < point.step_time)
        or (f.memory < point.memory and f.step_time <= point.step_time)
        for f in frontier
    )


def frontier_lines(points: Sequence[FrontierPoint], around: int = 3) -> list[str]:
    """`explain()`'s section: the frontier points nearest the chosen plan (up to `around`
    either side), each as the least budget that buys it and its time against the chosen
    plan's."""
    if not points:
        return []
    chosen = next((p for p in points if p.chosen), None)
    index = next((i for i, p in enumerate(points) if p.chosen), None)
    if index is None and chosen is None:
        shown = list(points[: 2 * around + 1])
    else:
        at = index if index is not None else 0
        shown = list(points[max(0, at - around): at + around + 1])
    lines = ["memory/time frontier (each budget per device buys the fastest plan that "
             "fits it):"]
    reference = chosen.step_time if chosen is not None else None
    for p in shown:
        versus = ""
        if reference and not p.chosen:
            versus = f" ({p.step_time / reference:.2f}x this plan's time)"
        mark = "  <- this plan" if p.chosen else ""
        lines.append(f"  budget {_fmt_bytes(p.memory):>10}: {_fmt_time(p.step_time)}"
                     f"{versus}  {p.label}{mark}")
    leaner = points.index(shown[0])
    larger = len(points) - leaner - len(shown)
    if leaner or larger:
        lines.append(f"  ({leaner} leaner and slower point(s) and {larger} larger and faster "
                     "one(s) not shown)")
    return lines


def plot_space(points: Sequence[FrontierPoint], path: str | Path, *,
               budget: float | None = None, title: str = "") -> Path:
    """Draw every feasible point (time against memory per device; autopar's candidates,
    the Megatron configurations, the chosen plan marked) and the frontier. A ``.png``
    path needs matplotlib; a ``.svg`` path is written by hand when matplotlib is missing
    (`write_svg`). **Returns:** the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if path.suffix != ".svg":
            raise ValueError(
                f"drawing {path} needs matplotlib (pip install 'autopar[plot]'); or ask for "
                "a .svg path, which is written without it"
            ) from None
        return write_svg(points, path, budget=budget, title=title)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    largest = max((p.memory for p in points), default=1.0)
    gib, unit = next(((2.0**k, name) for k, name in ((30, "GiB"), (20, "MiB"), (10, "KiB"))
                      if largest >= 2.0**k), (1.0, "B"))
    for source, marker, color, name in (("megatron", "s", "0.55", "Megatron-LM configurations"),
                                        ("auto", "o", "tab:blue", "autopar's candidates")):
        chosen = [p for p in points if p.source == source]
        if chosen:
            ax.scatter([p.memory / gib for p in chosen], [p.step_time * 1e3 for p in chosen],
                       marker=marker, color=color, s=22, label=name, alpha=0.8)
    frontier = pareto_frontier(points)
    if frontier:
        xs, ys = _staircase(frontier)
        ax.plot([x / gib for x in xs], [y * 1e3 for y in ys], color="tab:green", lw=1.2,
                label="frontier")
    for p in points:
        if p.chosen:
            ax.scatter([p.memory / gib], [p.step_time * 1e3], marker="*", s=180,
                       color="tab:red", label="autopar's plan", zorder=5)
    if budget is not None and budget <= 2 * largest:  # else it squeezes the points
        ax.axvline(budget / gib, color="tab:red", ls="--", lw=0.8, label="memory budget")
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title or "explored plan space")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _staircase(frontier: Sequence[FrontierPoint]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, p in enumerate(frontier):
        if i:
            xs.append(p.memory)
            ys.append(frontier[i - 1].step_time)
        xs.append(p.memory)
        ys.append(p.step_time)
    return xs, ys


def write_svg(points: Sequence[FrontierPoint], path: str | Path, *,
              budget: float | None = None, title: str = "") -> Path:
    """The picture of `plot_space` as a hand-written SVG (no matplotlib)."""
    path = Path(path)
    width, height, margin = 640, 420, 60
    if not points:
        path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
                        f'height="{height}"><text x="20" y="40">no feasible plan</text></svg>')
        return path
    if budget and budget > 2 * max(p.memory for p in points):
        budget = None  # it would squeeze the points
    times = [p.step_time for p in points]
    x0, x1 = 0.0, max([p.memory for p in points] + ([budget] if budget else [])) * 1.05
    y0, y1 = 0.0, max(times) * 1.05

    def sx(m):
        return margin + (m - x0) / (x1 - x0 or 1) * (width - 2 * margin)

    def sy(t):
        return height - margin - (t - y0) / (y1 - y0 or 1) * (height - 2 * margin)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="{width / 2}" y="20" text-anchor="middle">'
             f'{_escape(title or "explored plan space")}</text>',
             f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" '
             f'y2="{height - margin}" stroke="black"/>',
             f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" '
             'stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">peak memory '
             f'per device (0 .. {_fmt_bytes(x1)})</text>',
             f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
             f'text-anchor="middle">predicted step time (0 .. {_fmt_time(y1)})</text>']
    if budget:
        parts.append(f'<line x1="{sx(budget):.1f}" y1="{margin}" x2="{sx(budget):.1f}" '
                     f'y2="{height - margin}" stroke="red" stroke-dasharray="4,3"/>')
    xs, ys = _staircase(pareto_frontier(points))
    parts.append('<polyline fill="none" stroke="green" points="' + " ".join(
        f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys)) + '"/>')
    for p in points:
        x, y = sx(p.memory), sy(p.step_time)
        if p.chosen:
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="7" fill="red"/>')
        elif p.source == "auto":
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="steelblue"/>')
        else:
            parts.append(f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" '
                         'fill="gray"/>')
    parts.append(f'<text x="{width - margin}" y="{margin}" text-anchor="end">'
                 'red: autopar\'s plan, blue: its candidates, gray: Megatron-LM, '
                 'green: frontier</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
