"""The shard arithmetic behind resharding restores (tiercel._sharding): for any saved grid of
pieces and any target box, the planned byte ranges rebuild exactly the target's elements,
read every needed byte once, and stay within the waste budget."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tiercel._sharding import CoverageError, Piece, box_of, box_of_index, box_size, intersect, plan, plan_piece


def grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, shape) of the pieces of an even-ish split of `shape` into `parts` per dim."""
    cuts = [np.linspace(0, n, p + 1).astype(int) for n, p in zip(shape, parts)]
    out = []
    for idx in itertools.product(*[range(p) for p in parts]):
        offs = tuple(int(c[i]) for c, i in zip(cuts, idx))
        ends = tuple(int(c[i + 1]) for c, i in zip(cuts, idx))
        out.append((offs, tuple(e - o for o, e in zip(offs, ends))))
    return out


def assemble(global_arr: np.ndarray, saved, target, max_waste: int) -> tuple[np.ndarray, int]:
    """Fills the target box from saved pieces of `global_arr` through the plan; returns the
    result and the bytes read."""
    pieces = {}
    for offs, shp in saved:
        sl = tuple(slice(o, o + n) for o, n in zip(offs, shp))
        pieces[offs] = np.ascontiguousarray(global_arr[sl]).tobytes()
    p = plan([(offs, offs, shp) for offs, shp in saved], target, global_arr.itemsize, max_waste)
    out = np.full(tuple(b - a for a, b in target), -1, dtype=global_arr.dtype)
    nread = 0
    for key, r in p.reads:
        data = pieces[key][r.start : r.start + r.nbytes]
        assert len(data) == r.nbytes
        nread += r.nbytes
        src = np.ndarray(r.shape, dtype=global_arr.dtype, buffer=data, strides=r.strides)
        out[r.dst] = src
    return out, nread


@pytest.mark.parametrize(
    "shape,saved_parts,target_parts",
    [
        ((8, 12), (2, 2), (2, 2)),  # same sharding
        ((8, 12), (4, 1), (1, 4)),  # rows -> columns
        ((8, 12), (2, 2), (1, 1)),  # sharded -> whole
        ((8, 12), (1, 1), (3, 2)),  # whole -> uneven
        ((6, 10, 7), (2, 1, 3), (3, 2, 1)),
        ((17,), (4,), (3,)),
        ((5, 1, 9), (1, 1, 2), (5, 1, 1)),
    ],
)
@pytest.mark.parametrize("max_waste", [0, 16, 1 << 20])
def test_any_grid_to_any_grid(shape, saved_parts, target_parts, max_waste):
    g = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    saved = grid(shape, saved_parts)
    for offs, shp in grid(shape, target_parts):
        target = box_of(offs, shp)
        got, nread = assemble(g, saved, target, max_waste)
        want = g[tuple(slice(a, b) for a, b in target)]
        assert np.array_equal(got, want), (target, got, want)
        needed = box_size(target) * g.itemsize
        assert nread >= needed
        if max_waste == 0:
            assert nread == needed  # exactly what the target needs, nothing more


def test_ranges_stay_within_the_waste_budget():
    # A column half of row-major pieces: every row of the piece is half needed.
    saved = [((0, 0), (100, 64))]
    target = box_of((0, 32), (100, 32))
    item = 4
    # No waste allowed: one range per row.
    assert len(plan_piece((0, 0), (100, 64), target, item, 0)) == 100
    # The whole piece in one range when the budget covers all the gaps.
    one = plan_piece((0, 0), (100, 64), target, item, 1 << 20)
    assert len(one) == 1 and one[0].start == 32 * item and one[0].nbytes == (99 * 64 + 32) * item
    # In between: blocks of rows, each reading at most the budget in gaps.
    budget = 10 * 32 * item  # ten row-gaps
    rs = plan_piece((0, 0), (100, 64), target, item, budget)
    assert len(rs) == 10
    for r in rs:
        assert r.nbytes - np.prod(r.shape) * item <= budget
    got, _ = assemble(np.arange(6400, dtype=np.int32).reshape(100, 64), saved, target, budget)
    assert np.array_equal(got, np.arange(6400, dtype=np.int32).reshape(100, 64)[:, 32:])


def test_contiguous_overlap_is_one_range():
    # Rows of a row-sharded piece are contiguous whatever the budget.
    rs = plan_piece((0, 0), (8, 16), box_of((2, 0), (3, 16)), 8, 0)
    assert rs == [Piece(start=2 * 16 * 8, nbytes=3 * 16 * 8, shape=(3, 16), strides=(128, 8), dst=(slice(0, 3), slice(0, 16)))]


def test_scalars_and_empty_boxes():
    assert plan([("s", (), ())], (), 4, 0).reads == [("s", Piece(0, 4, (), (), ()))]
    empty = plan([("a", (0,), (0,))], box_of((0,), (0,)), 4, 0)
    assert empty.reads == [] and empty.sources == []


def test_copies_of_one_box_are_read_once():
    p = plan([("r0", (0,), (10,)), ("r1", (0,), (10,))], box_of((0,), (10,)), 4, 0)
    assert p.sources == ["r0"]


def test_missing_or_overlapping_pieces_are_errors():
    with pytest.raises(CoverageError, match="cover 5 of the 10"):
        plan([("a", (0,), (5,))], box_of((0,), (10,)), 4, 0)
    with pytest.raises(CoverageError, match="overlap"):
        plan([("a", (0,), (6,)), ("b", (4,), (6,))], box_of((0,), (10,)), 4, 0)
    with pytest.raises(CoverageError, match="dims"):
        plan([("a", (0, 0), (5, 5))], box_of((0,), (10,)), 4, 0)


def test_box_of_index_reads_jax_style_slices():
    assert box_of_index((slice(None), slice(4, 8)), (6, 8)) == ((0, 6), (4, 8))
    assert box_of_index((), ()) == ()
    assert intersect(((0, 4),), ((4, 8),)) is None
    with pytest.raises(ValueError, match="strided"):
        box_of_index((slice(0, 4, 2),), (4,))
