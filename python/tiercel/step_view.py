"""`StepView`: one committed step as an adapter's restore or export reads it (part of the
adapter kit, tiercel.kit).

A restore of DeepSpeed, Orbax or DCP reads other ranks' parts as well as its own (the model
states rank 0 wrote; the pieces of a resharded array; DCP's metadata). The view opens each
rank's `Reader` once, on first use, and keeps every one of them on one save of the step:
the save the ranks agreed on (`tiercel.kit.agree`), else the one the first reader opened
reads. A tier that holds another save of a rank's part (a save of the step again that did
not reach every tier) is passed over for that rank; a rank with no tier holding the agreed
save is a NotFoundError, never a mix of two saves.

For exporters, which read every rank of a step in one process:

    with tiercel.kit.borrow(store_or_policy) as store:
        view = StepView(store, step, trust_pickles=True)
        for rank in range(view.world_size):
            value = view.reader(rank).get(put)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _tree
from ._sharding import Piece
from .errors import IntegrityError, NotFoundError, TiercelError
from .manifest import Item, Manifest
from .step import Reader, RestoreInfo

if TYPE_CHECKING:
    from .store import Store

#: `save` not given: the first reader the view opens decides it.
_FIRST = object()


class StepView:
    """The per-rank Readers of one step, all of one save. `save`: the generation the ranks
    agreed on (`Agreement.save`); `tiers`: read only these (default: every tier, in restore
    order); `trust_pickles`: as `Reader` (an adapter whose framework unpickles its own
    files)."""

    def __init__(self, store: Store, step: int, *, save: Any = _FIRST, tiers: list[str] | None = None,
                 trust_pickles: bool = False):
        self.store = store
        self.step = step
        self._save = save
        self._tiers = tiers
        self._trust = trust_pickles
        self._readers: dict[int, Reader] = {}

    @property
    def save(self) -> str | None:
        """The save (generation) every reader of this view reads; None before the first
        reader when the view was not given one, or for a step saved before generations."""
        return None if self._save is _FIRST else self._save

    def reader(self, rank: int) -> Reader:
        """Saved rank `rank`'s reader of the step, opened on first use (any world size)."""
        if rank not in self._readers:
            self._readers[rank] = self._open(rank)
        return self._readers[rank]

    def readers(self) -> list[Reader]:
        """The readers opened so far, by rank."""
        return [self._readers[r] for r in sorted(self._readers)]

    @property
    def world_size(self) -> int:
        """How many ranks saved the step (from a manifest this process can read)."""
        for r in self._readers.values():
            return r.manifest.world_size
        try:
            return self.reader(self.store.rank).manifest.world_size
        except TiercelError:
            return self.reader(0).manifest.world_size

    def _open(self, rank: int) -> Reader:
        reader = Reader(self.store, self.step, rank, self._tiers, trust_pickles=self._trust)
        if self._save is _FIRST:
            self._save = reader.save
        if reader.save == self._save:
            return reader
        # The first tier with this rank's part holds another save of it: read the agreed
        # save from the tiers that hold it, if any does.
        holding = []
        for tier in self._tiers or self.store._core.restore_order:
            try:
                if Reader(self.store, self.step, rank, [tier]).save == self._save:
                    holding.append(tier)
            except TiercelError:
                continue
        if not holding:
            raise NotFoundError(
                f"step {self.step} rank {rank}: no tier this process reads ({self._tiers or self.store._core.restore_order}) "
                f"holds the save of the step the ranks read ({self._save}); the first holds another ({reader.save}): the "
                "step was saved again and that save did not reach every tier. Restore another step, or let the save "
                "finish (flush) on every rank", step=self.step, rank=rank)
        return Reader(self.store, self.step, rank, holding, trust_pickles=self._trust)

    def items_by_key(self, rank: int, put: str) -> dict[str, Item]:
        """Rank `rank`'s items of put `put`, by key, where the put was a dict of items."""
        return items_by_key(self.reader(rank).manifest, put)

    def read_box(self, reads: Sequence[tuple[tuple[int, int], Piece]], items: Mapping[tuple[int, int], Item],
                 shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A box of a sharded array, from the byte ranges of saved pieces that fill it
        (`tiercel._sharding.plan`'s reads, keyed (saved rank, item index); `items` the
        pieces' items by the same key), as a numpy array of `dtype` and `shape`. Each range
        comes from the nearest tier holding that rank's part. A box that is one whole saved
        piece comes back without a copy (from RAM: a view of shared memory)."""
        if len(reads) == 1:
            key, r = reads[0]
            if r.shape == shape and r.nbytes == items[key].nbytes:
                return np.frombuffer(self.reader(key[0]).read(items[key], r.start, r.nbytes), dtype=dtype).reshape(shape)
        out = np.empty(shape, dtype=dtype)
        for (rank, index), r in reads:
            buf = self.reader(rank).read(items[(rank, index)], r.start, r.nbytes)
            out[r.dst] = np.ndarray(r.shape, dtype=dtype, buffer=buf, strides=r.strides)
        return out

    def info(self, seconds: float = 0.0) -> RestoreInfo:
        """How the reads through this view went, over every rank's reader: items per tier,
        bytes, warnings (each once)."""
        info = RestoreInfo(step=self.step, seconds=seconds)
        for r in self.readers():
            for tier, n in r.info.tiers.items():
                info.tiers[tier] = info.tiers.get(tier, 0) + n
            info.nbytes += r.info.nbytes
            info.warnings += [w for w in r.info.warnings if w not in info.warnings]
        return info


def items_by_key(manifest: Manifest, put: str) -> dict[str, Item]:
    """The items of a put whose value was a dict of items (DCP's puts), by key (as str)."""
    where = f"step {manifest.step} rank {manifest.rank}"
    if put not in manifest.trees:
        raise NotFoundError(f"{where}: nothing was put under '{put}' (have: {', '.join(manifest.puts())})",
                            step=manifest.step, rank=manifest.rank)
    entries = _tree.dict_entries(manifest.trees[put])
    if entries is None:
        raise IntegrityError(f"{where}: put '{put}' is not a dict of items", step=manifest.step, rank=manifest.rank)
    items = manifest.items_of(put)
    # A tree's item references number the put's own items.
    return {str(key): items[i] for key, node in entries if (i := _tree.item_ref(node)) is not None}
