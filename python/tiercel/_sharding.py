"""Shard bookkeeping for restoring a sharded array into another sharding: which saved pieces
overlap a target box, and which byte ranges of each to read.

Pure arithmetic on boxes (no arrays, no I/O), so it can be tested on its own. Saved pieces are
C-order arrays: each holds the box of the global array that starts at its offsets and has its
shape. A target box (what one device of the new sharding holds) is filled from every saved
piece that overlaps it; the overlap is read in as few contiguous byte ranges as possible while
reading at most `max_waste` bytes that the target does not need per range (reading a little
more is cheaper than another request: tiers read whole chunks anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Generic, Hashable, Sequence, TypeVar

#: A box of a global array: (start, stop) per dimension, stop exclusive. () for a scalar.
Box = tuple[tuple[int, int], ...]


def box_of(offsets: Sequence[int], shape: Sequence[int]) -> Box:
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offsets, shape, strict=True))


def box_of_index(index: Sequence[slice], global_shape: Sequence[int]) -> Box:
    """The box of a JAX shard index (a tuple of slices with step 1, None for 'whole dim')."""
    if len(index) != len(global_shape):
        raise ValueError(f"index {index} has {len(index)} dims, the array {len(global_shape)}")
    box = []
    for s, n in zip(index, global_shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        box.append((start, max(start, stop)))
    return tuple(box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    return prod(box_shape(box))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of two boxes of the same array, or None when they share no element."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    if any(s >= e for s, e in out):
        return None
    return out


def subtract(box: Box, hole: Box) -> list[Box]:
    """`box` less `hole`: disjoint boxes that together hold the elements of `box` outside
    `hole` (at most two per dimension)."""
    common = intersect(box, hole)
    if common is None:
        return [box] if box_size(box) else []
    out: list[Box] = []
    rest = list(box)
    for d, ((a, b), (c0, c1)) in enumerate(zip(box, common)):
        for lo, hi in ((a, c0), (c1, b)):
            if lo < hi:
                out.append(tuple(rest[:d]) + ((lo, hi),) + tuple(rest[d + 1:]))
        rest[d] = (c0, c1)  # the next dimensions cut only the common slab
    return out


def uncovered(target: Box, boxes: Sequence[Box]) -> list[Box]:
    """The parts of `target` that none of `boxes` holds, as disjoint boxes."""
    left = [target] if box_size(target) else []
    for box in boxes:
        left = [part for b in left for part in subtract(b, box)]
    return left


@dataclass(frozen=True)
class Piece:
    """One contiguous byte range of a saved piece and where its elements go.

    Read `nbytes` bytes at byte offset `start` of the saved item; viewed with `shape` and
    `strides` (bytes) from the first byte, they are the elements that belong at `dst` (slices
    into the target box's buffer)."""

    start: int
    nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dst: tuple[slice, ...]


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-order array."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return tuple(strides)


def _span(local: Box, strides: Sequence[int]) -> int:
    """Elements from the first to the last element of a non-empty box, both included."""
    return sum((b - a - 1) * s for (a, b), s in zip(local, strides)) + 1


def plan_piece(
    saved_offsets: Sequence[int],
    saved_shape: Sequence[int],
    target: Box,
    itemsize: int,
    max_waste: int,
) -> list[Piece]:
    """The byte ranges to read from one saved piece for the target box (none if they do not
    overlap). `max_waste`: bytes not needed by the target that one range may include."""
    saved = box_of(saved_offsets, saved_shape)
    overlap = intersect(saved, target)
    if overlap is None:
        return []
    strides = _c_strides(saved_shape)
    local = tuple((a - o, b - o) for (a, b), o in zip(overlap, saved_offsets))
    shift = tuple(o - t for o, (t, _) in zip(saved_offsets, target))  # local -> target coords
    budget = max_waste // max(itemsize, 1)  # in elements
    out: list[Piece] = []
    _split(local, strides, itemsize, budget, shift, out)
    return out


def _split(local: Box, strides: tuple[int, ...], itemsize: int, budget: int, shift: tuple[int, ...], out: list[Piece]) -> None:
    size = box_size(local)
    waste = _span(local, strides) - size
    if waste <= budget:
        out.append(
            Piece(
                start=sum(a * s for (a, _), s in zip(local, strides)) * itemsize,
                nbytes=_span(local, strides) * itemsize,
                shape=box_shape(local),
                strides=tuple(s * itemsize for s in strides),
                dst=tuple(slice(a + d, b + d) for (a, b), d in zip(local, shift)),
            )
        )
        return
    # Too sparse for one range: cut along the outermost dimension that has more than one
    # slice, into blocks of as many slices as the budget allows (1 when even one slice is too
    # sparse, which then gets cut along its next dimension).
    d = next(i for i, (a, b) in enumerate(local) if b - a > 1)
    a_d, b_d = local[d]
    one = local[:d] + ((a_d, a_d + 1),) + local[d + 1 :]
    one_waste = _span(one, strides) - box_size(one)
    gap = strides[d] - box_size(one)  # elements skipped between two consecutive slices
    n = 1 if one_waste > budget or gap <= 0 else 1 + (budget - one_waste) // gap
    for k in range(a_d, b_d, n):
        _split(local[:d] + ((k, min(k + n, b_d)),) + local[d + 1 :], strides, itemsize, budget, shift, out)


#: How a caller names its saved pieces.
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Plan(Generic[K]):
    """Everything one target box needs: (key of the saved piece, range) in saved-piece order."""

    reads: list[tuple[K, Piece]]
    #: The saved pieces that overlap the target, keyed as given.
    sources: list[K]


class CoverageError(ValueError):
    """The saved pieces do not cover the target box exactly once."""


def plan(
    saved: Sequence[tuple[K, Sequence[int], Sequence[int]]],
    target: Box,
    itemsize: int,
    max_waste: int,
) -> Plan[K]:
    """The reads that fill `target` from `saved` pieces ((key, offsets, shape) each).

    Pieces with the same box are copies of each other (saved by several ranks): the first is
    read. Raises CoverageError when the pieces leave part of the target uncovered or two
    different pieces overlap (the checkpoint does not describe one array)."""
    seen: set[Box] = set()
    overlaps: list[tuple[K, Box]] = []
    reads: list[tuple[K, Piece]] = []
    for key, offsets, shape in saved:
        box = box_of(offsets, shape)
        if len(box) != len(target):
            raise CoverageError(f"saved piece {key!r} has {len(box)} dims, the target {len(target)}")
        if box in seen:
            continue
        seen.add(box)
        ov = intersect(box, target)
        if ov is None:
            continue
        for other_key, other in overlaps:
            if intersect(other, ov) is not None:
                raise CoverageError(f"saved pieces {other_key!r} and {key!r} overlap at {intersect(other, ov)}")
        overlaps.append((key, ov))
        reads += [(key, p) for p in plan_piece(offsets, shape, target, itemsize, max_waste)]
    covered = sum(box_size(b) for _, b in overlaps)
    if covered != box_size(target):
        raise CoverageError(
            f"the saved pieces cover {covered} of the {box_size(target)} elements of box {list(target)}"
        )
    return Plan(reads=reads, sources=[k for k, _ in overlaps])
