"""How a DCP checkpoint lies in a tiercel step, and the one place that reads or lays out
items for tiercel.dcp.

Every rank's step holds one put of the items its DCP plan wrote ("dcp": tensors raw, byte
items as DCP serialized them), the tensors `dcp.async_save` staged ("dcp-staged", if any),
and rank 0 also holds DCP's pickled `Metadata` ("dcp-metadata"). Each put is a dict whose
keys name the items; DCP's `Metadata.storage_data` maps every `MetadataIndex` to its copies,
each {"rank", "host", "put", "key"}: whose step, which put, which key.

DCP's planner writes an item that several ranks hold (a replicated tensor, the optimizer's
param groups) on one rank only. tiercel.dcp keeps one copy on every host instead, so that a
host restores it from its own RAM, and a host whose RAM is lost still finds its own copy in
its peers' (a copy on another host may be out of reach: another host's RAM is not visible).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _dtypes
from ..errors import IntegrityError, NotFoundError
from ..kit import Agreement, StepView
from ..manifest import Item, Manifest
from ..step import Reader as StepReader
from ..step import Writer as StepWriter
from ..step_view import items_by_key
from ..store import Store

PUT_DATA = "dcp"
PUT_STAGED = "dcp-staged"
PUT_METADATA = "dcp-metadata"


@dataclass(frozen=True)
class Where:
    """Where one copy of a DCP storage item lives: `rank`'s step (a rank of the saving job,
    on `host`), put `put`, under `key`."""

    rank: int
    host: str
    put: str
    key: str

    def to_storage_data(self) -> dict[str, Any]:
        # A plain dict, not this class: DCP pickles storage_data into its Metadata, and a
        # pickle of a tiercel class would tie every checkpoint to this module's path.
        return {"rank": self.rank, "host": self.host, "put": self.put, "key": self.key}

    @classmethod
    def copies(cls, data: Any, what: str) -> list[Where]:
        """Every copy of an item that Metadata.storage_data names (a list of dicts)."""
        if isinstance(data, list) and data and all(isinstance(d, dict) and {"rank", "put", "key"} <= d.keys() for d in data):
            return [cls(int(d["rank"]), str(d.get("host", "")), str(d["put"]), str(d["key"])) for d in data]
        raise IntegrityError(f"{what}: its DCP storage data {data!r} is not tiercel's; was the step written by tiercel.dcp?")


def nearest_first(copies: list[Where], rank: int, host: str) -> list[Where]:
    """Copies in the order to try them: this rank's own, then its host's, then the others."""
    return sorted(copies, key=lambda w: (w.rank != rank, w.host != host, w.rank))


def item_key(fqn: str, offset: Any) -> str:
    """The key of a DCP write item: its FQN, plus the chunk's offsets when it has any
    (a rank may hold several chunks of one tensor)."""
    if offset is None:
        return fqn
    return f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def put_items(manifest: Manifest, put: str) -> dict[str, Item]:
    """The items of one put whose value was a dict of str keys, by key."""
    try:
        return items_by_key(manifest, put)
    except NotFoundError as e:
        raise NotFoundError(f"{e}; was it saved with tiercel.dcp?", step=manifest.step, rank=manifest.rank) from None


class Locator:
    """Finds DCP's items in one step: the step's view (a reader per saving rank, opened
    once, all of one save) and each put's items by key."""

    def __init__(self, store: Store, step: int, agreed: Agreement | None = None):
        self.step = step
        # All of the save the ranks agreed on; a step given by number: the save read first.
        self.view = StepView(store, step) if agreed is None else StepView(store, step, save=agreed.save)
        self._puts: dict[tuple[int, str], dict[str, Item]] = {}

    def reader(self, rank: int) -> StepReader:
        return self.view.reader(rank)

    def find(self, where: Where) -> tuple[StepReader, Item]:
        reader = self.reader(where.rank)
        at = (where.rank, where.put)
        if at not in self._puts:
            self._puts[at] = put_items(reader.manifest, where.put)
        it = self._puts[at].get(where.key)
        if it is None:
            raise IntegrityError(f"step {self.step} rank {where.rank}: put '{where.put}' has no item '{where.key}', "
                                 "which the DCP metadata points to")
        return reader, it


# -- writing -------------------------------------------------------------------------------


def stage(writer: StepWriter, put: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies tensors into the step's shared memory (one copy: the core's parallel memcpy
    for host tensors, one device-to-host transfer for the others) and returns, per key, a
    tensor over that memory: the staged state DCP then writes from, without copying again."""
    writer.put(put, tensors)
    layout = put_items(Manifest.from_json(writer._core.manifest_json()), put)
    segments: dict[int, Any] = {}
    views: dict[str, torch.Tensor] = {}
    for key, it in layout.items():
        dtype = _dtypes.torch_dtype(it.dtype)
        if it.nbytes == 0:
            views[key] = torch.empty(it.shape, dtype=dtype)
            continue
        # An item lies raw and contiguous in its part's segment, from its first chunk on.
        part, offset = it.chunks[0].object, it.chunks[0].stored_offset
        if part not in segments:
            segments[part] = writer._core.segment(part)
        raw = torch.frombuffer(segments[part], dtype=torch.uint8, count=it.nbytes, offset=offset)
        views[key] = raw.view(dtype).view(it.shape)
    return views


# -- reading -------------------------------------------------------------------------------


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def box_span(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int]:
    """(first element, element count) of the smallest contiguous run of a C-ordered array of
    `shape` that holds the box at `offsets` of size `lengths`: along the first dimension
    (how FSDP and DCP shard) that is exactly the box."""
    strides = contiguous_strides(shape)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return first, last - first + 1


def read_box(reader: StepReader, it: Item, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The box of a stored tensor at `offsets` of size `lengths`, reading only the chunks
    that hold it (verified); a strided view when the box is not one contiguous run."""
    dtype = _dtypes.torch_dtype(it.dtype)
    if any(n == 0 for n in lengths):
        return torch.empty(lengths, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    first, count = box_span(it.shape, offsets, lengths)
    raw = reader.read(it, first * itemsize, count * itemsize)
    return _flat(raw, dtype).as_strided(lengths, contiguous_strides(it.shape))


def as_tensor(raw: np.ndarray, it: Item) -> torch.Tensor:
    """A whole stored tensor over its bytes (no copy)."""
    dtype = _dtypes.torch_dtype(it.dtype)
    if it.nbytes == 0:
        return torch.empty(it.shape, dtype=dtype)
    return _flat(raw, dtype).view(it.shape)


def _flat(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # torch wants writable memory; zero-copy views over shared memory are (copy-on-write).
    return torch.from_numpy(raw if raw.flags.writeable else raw.copy()).view(dtype)
