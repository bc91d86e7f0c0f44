"""Resharding restores of the plain Store: `Store.restore(..., reshard=...)`.

A job that saved its arrays as pieces of global arrays (`tiercel.Sharded(value, global_shape,
offsets)`, or a leaf handler that sets the item's `Shard`) restores at another world size:
each rank says which box of each sharded item it wants now, and gets that box put together
from the pieces of every saved rank that overlap it. Only the byte ranges that hold the box
are read (tiercel._sharding plans them), every chunk verified, each from the nearest tier
that holds the saved rank's part: this host's RAM, a peer's RAM (a surviving host's own
copy or the replica it holds), then the durable tiers. The saved ranks' readers are the
step's `StepView`, all of one save of it.

What a rank wants (`reshard=`, a `Want`):

- `True`: every sharded item whole (its global array);
- `{item name: index}`: those items' boxes, every other sharded item whole. An index is
  what numpy takes for the global array: a slice of the first dimension (`np.s_[a:b]`, rows
  a:b) or a tuple of slices (step 1); dimensions left out are whole;
- a callable `(item name, global shape) -> index or None` (None: whole), asked for each
  sharded item.

Item names are the manifest's: the put, then the keys down its tree (`"w"` for
`save(step, {"w": ...})`, `"model/layer.weight"` for a dict under "model").

Values without shard information, and the state's structure (its puts and keys), come from
saved rank 0's part: data-parallel copies of a value are the same on every rank.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable, Mapping
from math import prod
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from . import _dtypes
from ._sharding import Box, CoverageError, box_of, box_shape, plan, uncovered
from ._text import count
from ._tree import tree_items, unflatten
from .errors import IntegrityError, InvalidArgumentError, NotFoundError
from .leaves import rebuilder
from .manifest import Item, Shard
from .step import RestoreInfo
from .step_view import StepView

if TYPE_CHECKING:
    from .store import Store

#: A box of a global array as numpy indexes it: a slice (first dimension) or slices.
Index = Union[slice, tuple[slice, ...]]
#: What `restore(reshard=...)` takes (see the module's doc).
Want = Union[bool, Mapping[str, Index], Callable[[str, tuple[int, ...]], Union[Index, None]]]

#: Pieces of one item: (saved rank, its item).
Pieces = list[tuple[int, Item]]


def check_want(want: Any) -> None:
    """Refuses a `reshard=` of the wrong kind before any rank starts the restore."""
    if want is True or callable(want):
        return
    if isinstance(want, Mapping) and all(isinstance(k, str) for k in want):
        return
    raise InvalidArgumentError(
        f"reshard= takes True (every sharded item whole), a dict {{item name: index}} (e.g. {{'w': np.s_[a:b]}}: "
        f"rows a:b of item 'w') or a callable (item name, global shape) -> index; got {want!r}")


def read(store: Store, step: int, want: Want, **view: Any) -> tuple[dict[str, Any], RestoreInfo]:
    """Step `step` as saved (rank 0's structure and unsharded values), each sharded item as
    the box of its global array that `want` asks for. `view`: the `StepView`'s `save` (the
    generation the ranks agreed on)."""
    t0 = time.perf_counter()
    steps = StepView(store, step, **view)
    base = steps.reader(0)
    world = base.manifest.world_size
    sharded = {it.name: it for it in base.manifest.items if it.shard is not None}
    boxes = _boxes(want, {name: it.shard.global_shape for name, it in sharded.items() if it.shard}, step)
    pieces = _pieces(steps, world, sharded)
    state: dict[str, Any] = {}
    for put, tree in base.manifest.trees.items():
        values: dict[int, Any] = {}
        for ref, it in zip(tree_items(tree), base.manifest.items_of(put)):
            if it.name in sharded:
                values[ref] = _assemble(steps, step, it, pieces[it.name], boxes[it.name], world)
            else:
                values[ref] = base.value(it)
        state[put] = unflatten(tree, values, f"step {step} rank 0 put '{put}'", step=step, rank=0)
    return state, steps.info(time.perf_counter() - t0)


def _boxes(want: Want, shapes: dict[str, tuple[int, ...]], step: int) -> dict[str, Box]:
    """The box this rank wants of each sharded item (by name)."""
    if isinstance(want, Mapping):
        unknown = [name for name in want if name not in shapes]
        if unknown:
            have = ", ".join(f"'{n}' {g}" for n, g in list(shapes.items())[:10]) or "none"
            raise InvalidArgumentError(
                f"step {step}: reshard= names {', '.join(repr(n) for n in unknown)}, which the step holds no sharded item "
                f"of (its sharded items, with their global shapes: {have}{' ...' if len(shapes) > 10 else ''}); an "
                "item's name is the put, then the keys down its tree ('model/w'), and it is sharded when saved as "
                "tiercel.Sharded")
        return {name: _box(name, want.get(name), g, step) for name, g in shapes.items()}
    if want is True:
        return {name: _box(name, None, g, step) for name, g in shapes.items()}
    assert callable(want)
    return {name: _box(name, want(name, g), g, step) for name, g in shapes.items()}


def _box(name: str, index: Any, global_shape: tuple[int, ...], step: int) -> Box:
    """The box an index of the global array means (None: all of it)."""
    where = f"step {step} item '{name}' (global shape {global_shape})"
    if index is None:
        index = ()
    if isinstance(index, slice):
        index = (index,)
    if not isinstance(index, tuple) or not all(isinstance(s, slice) for s in index) or len(index) > len(global_shape):
        raise InvalidArgumentError(
            f"{where}: reshard= wants a box of the global array as numpy indexes it: a slice of the first dimension "
            f"(np.s_[a:b]) or a tuple of at most {len(global_shape)} slices, got {index!r}")
    box = []
    for d, n in enumerate(global_shape):
        s = index[d] if d < len(index) else slice(None)
        try:
            start = 0 if s.start is None else operator.index(s.start)
            stop = n if s.stop is None else operator.index(s.stop)
        except TypeError:
            raise InvalidArgumentError(f"{where}: dimension {d}: {s} does not have int bounds") from None
        if s.step not in (None, 1) or not 0 <= start <= stop <= n:
            raise InvalidArgumentError(
                f"{where}: dimension {d}: {start}:{stop}{'' if s.step in (None, 1) else f':{s.step}'} is not a box of "
                f"it: give a:b with 0 <= a <= b <= {n} and no step")
        box.append((start, stop))
    return tuple(box)


def _pieces(steps: StepView, world: int, sharded: dict[str, Item]) -> dict[str, Pieces]:
    """Every saved rank's piece of each sharded item (by name): each rank's manifest, read
    once. A piece of another global shape or dtype than rank 0's is an IntegrityError."""
    out: dict[str, Pieces] = {name: [] for name in sharded}
    for rank in range(world):
        for it in steps.reader(rank).manifest.items:
            first = sharded.get(it.name)
            if first is None or it.shard is None:
                continue
            assert first.shard is not None
            if it.shard.global_shape != first.shard.global_shape or it.dtype != first.dtype:
                raise IntegrityError(
                    f"step {steps.step} item '{it.name}': rank {rank} saved a piece of a {it.dtype} array of global "
                    f"shape {it.shard.global_shape}, rank 0 of a {first.dtype} one of {first.shard.global_shape}: the "
                    "ranks saved different arrays under one name", step=steps.step, rank=rank, item=it.name)
            out[it.name].append((rank, it))
    return out


def _assemble(steps: StepView, step: int, first: Item, pieces: Pieces, box: Box, world: int) -> Any:
    """The box of a sharded item's global array, from the saved pieces that overlap it
    (`StepView.read_box`), rebuilt by the item's leaf handler (a numpy array or a torch
    tensor). A box that is one whole saved piece comes back without a copy (from RAM: a view
    of shared memory)."""
    assert first.shard is not None
    itemsize = _dtypes.ITEMSIZE[first.dtype]
    saved = [((rank, it.index), it.shard.offsets if it.shard else (), it.shape) for rank, it in pieces]
    try:
        # Ranges closer than a chunk are read as one: the tiers read whole chunks anyway.
        reads = plan(saved, box, itemsize, steps.store._core.chunk_size).reads
    except CoverageError as e:
        raise _coverage_error(step, first, saved, box, world, e) from None
    shape = box_shape(box)
    # Elements as opaque units of the item's size: any dtype, with or without ml_dtypes.
    out = steps.read_box(reads, {(rank, it.index): it for rank, it in pieces}, shape, np.dtype(f"V{itemsize}"))
    target = dataclasses.replace(first, shape=shape, nbytes=prod(shape) * itemsize, chunks=(),
                                 shard=Shard(first.shard.global_shape, tuple(a for a, _ in box)))
    return rebuilder(target).rebuild(target, out.reshape(-1).view(np.uint8))


def _coverage_error(step: int, first: Item, saved: list[Any], box: Box, world: int, e: CoverageError) -> Exception:
    """What is missing from a wanted box (a region no saved rank's piece holds), or which
    saved pieces overlap: naming the item, the step and every saved rank's piece."""
    assert first.shard is not None
    held = "; ".join(f"rank {rank}: {list(box_of(o, s))}" for (rank, _), o, s in saved) or "none"
    holes = uncovered(box, [box_of(o, s) for _, o, s in saved])
    if not holes:  # the pieces overlap: the checkpoint does not describe one array
        return IntegrityError(f"step {step} item '{first.name}': {e} (the pieces of the {count(world, 'saved rank')}: {held})",
                              step=step, item=first.name)
    shown = ", ".join(str(list(h)) for h in holes[:4]) + (" ..." if len(holes) > 4 else "")
    return NotFoundError(
        f"step {step} item '{first.name}' (global shape {first.shard.global_shape}): no saved rank holds the region(s) "
        f"{shown} of the box {list(box)} this rank wants (the pieces of the {count(world, 'saved rank')}: {held}). Want a box inside "
        "what was saved (reshard=), or restore a step whose ranks saved all of it", step=step, item=first.name)
