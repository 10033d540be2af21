"""A scanned layer stack in the pipeline search: which cuts a stage may take, and the pieces
of the stack the chosen stages hold.

The stack of `length` iterations is traced one layer per iteration (`inter.scan_layers`):
layer 0 before the stack, layers 1..`length` its iterations, layer `length` + 1 after it.
These functions are pure: the choices they read are `inter.PipelineChoice`s (or anything
with `stage_layers`, `logical_shapes` and `stage_remat`).
"""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger("autopar")

def even_shares(length: int, max_stages: int, share: int | None = None):
    """`allowed(start, end)` for the DP over a stack of `length` iterations traced one
    layer per iteration (layer 0 before the stack, layer `length` + 1 after it): a stage
    holds none of the stack, or `length` / d iterations for a d that divides `length`
    (only `share` iterations when given). (A leaf held in pieces is handed back as one
    array sharded over the stages, which needs pieces of one length; `stack_ranges` checks
    that the chosen ones are, and `one_layout` re-runs a DP that mixed shares.)"""
    shares = {0} | {length // d for d in range(1, max_stages + 1) if length % d == 0}
    if share is not None:
        shares = {0, share} & shares

    def allowed(start: int, end: int) -> bool:
        return max(0, min(end, length + 1) - max(start, 1)) in shares

    return allowed


def pieces(choice, length: int) -> list[tuple[int, tuple[int, ...]]]:
    """(iterations, logical mesh shape) of each piece of the stack a chosen stage holds
    (see `_pipeline._PipelineSearch.regroup`)."""
    found = []
    for (start, end), shape in zip(choice.stage_layers, choice.logical_shapes):
        a, b = max(start, 1) - 1, min(end, length + 1) - 1
        if b > a:
            found.append((b - a, tuple(shape)))
    return found


def piece_lengths(choice, length: int) -> set[int]:
    """The lengths of the pieces of the stack the chosen stages hold."""
    return {n for n, _ in pieces(choice, length)}


def holds_stack(length: int, shape: tuple[int, ...]):
    """`range_shapes` for the stage DP: a stage holding any of the stack's iterations
    (layers 1..`length`) takes the logical mesh `shape`; the others any shape."""

    def only(start: int, end: int):
        return [shape] if max(start, 1) < min(end, length + 1) else None

    return only


REMAT_ORDER = ("none", "selective", "full")


def piece_remat(choice, ranges, length: int) -> tuple[str, ...]:
    """Per piece of the stack (one sub-scan, one body): the most its iterations recompute
    in the stage DP's choice (it chose per iteration, and a sub-scan has one body; the
    regrouped plan is timed with it). Iteration i of the stack is the DP's layer i + 1."""
    per_layer = remat_by_layer(choice)
    return tuple(
        max((per_layer.get(i + 1, "none") for i in range(a, b)), key=REMAT_ORDER.index)
        for a, b in ranges
    )


def remat_by_layer(choice) -> dict[int, str]:
    """The stage DP's remat choice of every layer, by layer index."""
    per_layer: dict[int, str] = {}
    for (start, end), remats in zip(choice.stage_layers, choice.stage_remat):
        per_layer.update(zip(range(start, end), remats))
    return per_layer



def stack_ranges(choice, length: int) -> tuple[tuple[tuple[int, int], ...], list[int]]:
    """The iteration ranges of the stack each chosen stage holds (one sub-scan per stage
    that holds any), and the stage of each range; a ValueError naming the fix when the
    pieces differ in length or mesh shape (a stacked leaf held in pieces is handed back as
    one array sharded over the stages)."""
    ranges, stage_of_piece = [], []
    for s, (start, end) in enumerate(choice.stage_layers):
        a, b = max(start, 1) - 1, min(end, length + 1) - 1
        if b > a:
            ranges.append((a, b))
            stage_of_piece.append(s)
    lengths = {b - a for a, b in ranges}
    shapes = {choice.logical_shapes[s] for s in stage_of_piece}
    if len(lengths) > 1 or len(shapes) > 1:
        raise ValueError(
            f"the stage DP cut the scanned stack of {length} layers into pieces {ranges} on "
            f"stage meshes {sorted(shapes)}; a stacked leaf held in pieces is handed back as "
            "one array sharded over the stages, which needs pieces of one length on meshes "
            f"of one shape: pass num_stages= a divisor of {length} (and logical_shapes=[...] "
            "to fix the stage mesh shape)"
        )
    return tuple(ranges), stage_of_piece


def regrouped_layers(choice, ranges, length: int):
    """The chosen stages' layer ranges and remat per layer once the stack is traced with
    one sub-scan per range: a stage's layer at new index k holds range k - 1 of the stack
    (its sub-scan, recomputing as `piece_remat` says), or the embeddings / the head."""
    remat_of_piece = piece_remat(choice, ranges, length)

    def new_layer(old: int) -> int:
        if old == 0:
            return 0
        if old > length:
            return len(ranges) + 1
        return 1 + next(k for k, (a, b) in enumerate(ranges) if a <= old - 1 < b)

    stage_layers = [
        (new_layer(start), new_layer(end - 1) + 1) for start, end in choice.stage_layers
    ]
    old_remat = remat_by_layer(choice)
    stage_remat = [
        tuple(remat_of_piece[k - 1] if 1 <= k <= len(ranges)
              else old_remat.get(0 if k == 0 else length + 1, "none") for k in range(a, b))
        for a, b in stage_layers
    ]
    return stage_layers, stage_remat, remat_of_piece


def one_layout(choice, length: int, max_stages: int, num_micro: int, rerun, latency_of):
    """A stage DP choice whose pieces of the stack have one length on one logical mesh
    shape, for a `choice` that mixed lengths or shapes (the DP prices each stage on its
    own and cannot see that they must agree: llama-70B on 32 H100s was cut
    10/10/20/20/20, then into 4 x 20 on meshes (2, 4) and (4, 2)). The DP again,
    `rerun(allowed=..., range_shapes=...)` on the same layer cost table, with each mixed
    length as the only share, and where that still mixes shapes, with each of them as
    the only shape for the stages holding the stack; the fastest that finds a plan
    (`latency_of(choice)`: its predicted seconds per step). Not
    the best of every uniform cut, only of the lengths and shapes the unrestricted DP
    chose."""
    chosen_pieces = pieces(choice, length)
    if len(set(chosen_pieces)) <= 1:
        return choice
    found, tried, last_error = [], {}, None
    spent = dict(choice.timings)  # every run's search time, the first's included

    def attempt(share: int, shape=None):
        nonlocal last_error
        if (share, shape) not in tried:
            again = None
            try:
                again = rerun(allowed=even_shares(length, max_stages, share),
                              range_shapes=None if shape is None else holds_stack(length,
                                                                                  shape))
            except ValueError as err:
                last_error = err
            tried[share, shape] = again
            if again is not None:
                for name, value in again.timings.items():
                    spent[name] = spent.get(name, 0) + value
                if len(set(pieces(again, length))) <= 1:
                    latency = latency_of(again)
                    log.info("%d microbatch(es): the stack in pieces of %d iteration(s)%s:"
                             " %d stage(s), predicted %.4g s", num_micro, share,
                             "" if shape is None else f" on meshes {shape}",
                             len(again.stage_layers), latency)
                    found.append((latency, share, shape or (), again))
        return tried[share, shape]

    lengths = sorted({n for n, _ in chosen_pieces})
    for share in lengths:
        again = choice if len(lengths) == 1 else attempt(share)
        if again is None or len(set(pieces(again, length))) <= 1:
            continue
        for shape in sorted({s for _, s in pieces(again, length) + chosen_pieces}):
            attempt(share, shape)
    if not found:
        raise last_error or ValueError(
            f"no stage DP choice holds the scanned stack of {length} layers in pieces of "
            f"one length on meshes of one shape: pass num_stages= a divisor of {length} "
            "and logical_shapes=[...]"
        )
    best = min(found, key=lambda f: f[:3])[3]
    log.info("%d microbatch(es): the stage DP cut the stack into %s; kept the fastest "
             "uniform cut", num_micro, ", ".join(f"{n} on {s}" for n, s in chosen_pieces))
    # The re-runs' search time (ILPs, DP) is the kept choice's: the phases sum them all.
    return dataclasses.replace(best, timings=spent)
