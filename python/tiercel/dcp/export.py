"""A tiercel.dcp step as a plain DCP directory: what `FileSystemWriter` would have written,
loadable with `FileSystemReader` (and `dcp_to_torch_save`) without tiercel.

    tiercel.dcp.export("tiercel.toml", 40, "/ckpt/step-40")
    dcp.load(state_dict, storage_reader=FileSystemReader("/ckpt/step-40"))

One process does it all: each saving rank's items go into `__<rank>_0.distcp` (tensors as
`torch.save` writes them, byte items as DCP serialized them), then `.metadata`, written last,
with each item's file, offset and length. A directory without `.metadata` is an export that
did not finish.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.metadata import Metadata

from .. import _dtypes, exports
from ..errors import TiercelError
from ..exports import Progress
from ..manifest import Item
from ..step import Reader as StepReader
from ..store import PolicyLike, Store
from . import _layout
from ._layout import Where
from .reader import metadata_bytes, unpickle_metadata

METADATA_FILE = ".metadata"


def export(
    policy: PolicyLike | Store,
    step: int,
    out_dir: str | os.PathLike,
    *,
    progress: Progress | None = None,
) -> Path:
    """Writes tiercel step `step` (saved with tiercel.dcp.Writer) to `out_dir` (new or empty)
    as a DCP checkpoint directory; returns its path. `policy`: a Store, or a policy opened
    here as a single process. `progress(done_bytes, total_bytes)` is called after each item."""
    return exports.export(policy, step, out_dir, format="dcp", progress=progress)


def write(store: Store, step: int | str, out: Path, *, progress: Progress | None = None) -> Path:
    """The registry's exporter (tiercel.exports): `out` is new or empty."""
    step = int(step)
    out.mkdir(parents=True, exist_ok=True)

    rank0 = StepReader(store, step, rank=0)
    metadata = unpickle_metadata(metadata_bytes(rank0), step)
    plan = items_by_rank(store, step, metadata)
    total = sum(it.nbytes for items in plan.values() for _, _, it in items)
    done = 0
    storage: dict[Any, Any] = {}
    for rank, items in plan.items():
        name = f"__{rank}_0{dcp_fs.DEFAULT_SUFFIX}"
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            for index, reader, it in items:
                offset = f.tell()
                _write_item(f, reader, it)
                storage[index] = dcp_fs._StorageInfo(name, offset, f.tell() - offset)
                done += it.nbytes
                if progress is not None:
                    progress(done, total)
            _sync(f)
        tmp.rename(out / name)
    exported = dataclasses.replace(metadata, storage_data=storage, version=getattr(dcp_fs, "CURRENT_DCP_VERSION", None))
    tmp = out / f"{METADATA_FILE}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(exported, f)
        _sync(f)
    tmp.rename(out / METADATA_FILE)
    return out


def items_by_rank(store: Store, step: int, metadata: Metadata) -> dict[int, list[tuple[Any, StepReader, Item]]]:
    """Per saving rank, in rank order: (DCP index, that rank's reader, the stored item). An
    item kept on several hosts is exported once, from its first copy this process can read."""
    locate = _layout.Locator(store, step)
    plan: dict[int, list[tuple[Any, StepReader, Item]]] = {}
    for index, data in metadata.storage_data.items():
        copies = Where.copies(data, f"step {step} item {index.fqn}")
        for i, where in enumerate(copies):
            try:
                found = locate.find(where)
                break
            except TiercelError:
                if i == len(copies) - 1:
                    raise
        plan.setdefault(where.rank, []).append((index, *found))
    return dict(sorted(plan.items()))


def _write_item(f: BinaryIO, reader: StepReader, it: Item) -> None:
    """One item as FileSystemWriter stores it: a tensor through torch.save, bytes as they are."""
    raw = reader.read(it)
    if it.kind == "bytes":
        f.write(raw.tobytes())
        return
    dtype = _dtypes.torch_dtype(it.dtype)
    t = torch.from_numpy(raw.copy() if not raw.flags.writeable else raw).view(dtype).reshape(it.shape) if it.nbytes \
        else torch.empty(it.shape, dtype=dtype)
    torch.save(t, f)


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
