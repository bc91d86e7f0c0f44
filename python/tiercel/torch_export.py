"""A plain tiercel step (`Store.save`, `tiercel.torch.save_state`) as `torch.save` files, one
per saving rank, loadable with `torch.load` and without tiercel:

    tiercel.torch_export.export("tiercel.toml", 40, "/ckpt/step-40")    # or: tiercel export 40 DIR --format torch
    state = torch.load("/ckpt/step-40/rank-00000.pt", weights_only=True)  # {"model": ..., "optimizer": ..., ...}

Each file holds what that rank's `store.restore(step)` returns: a dict of the step's puts
("model", "optimizer", ...), each rebuilt as it was saved. Tensors are CPU tensors with their
own storage (a tensor saved from a GPU comes back on the CPU, as tiercel restores it); numpy
arrays and numpy scalars stay numpy; bytes, str, int, float, bool, None, lists, tuples and
dicts stay what they were. So `torch.load(path, weights_only=True)` loads a file whose state
is tensors and plain Python values (a model's and an optimizer's state dicts, `extra=` of
plain values); numpy values (the numpy generator in `save_state`'s "rng") need
`weights_only=False`, or torch's numpy allow-list (`torch.serialization.safe_globals`).

Files are written as `rank-%05d.pt` (the saving rank) to a temporary name and renamed, one
rank at a time; `MANIFEST.json`, written last, names the step, the world size and the files,
so a directory without it is an export that did not finish.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import exports
from .exports import Progress
from .step import Reader
from .step_view import StepView
from .store import PolicyLike, Store

#: Written last: what the directory holds.
MANIFEST = "MANIFEST.json"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def export(
    policy: PolicyLike | Store,
    step: int,
    out_dir: str | os.PathLike,
    *,
    progress: Progress | None = None,
) -> Path:
    """Writes step `step` to `out_dir` (created; it must not hold files yet) as one
    `torch.save` file per saving rank; returns the directory. `policy`: a Store, or a policy
    opened here as a single process. One process reads every rank's part, from the fastest
    tier that has it, one rank at a time (that rank's state is held in memory while it is
    written). Pickled values are read as the policy's `[store] pickle` allows.
    `progress(done_bytes, total_bytes)` is called after each put."""
    return exports.export(policy, step, out_dir, format="torch", progress=progress)


def write(store: Store, step: int | str, out: Path, *, progress: Progress | None = None) -> Path:
    """The registry's exporter (tiercel.exports): `out` is new or empty."""
    import torch

    readers = rank_readers(store, int(step))
    world = len(readers)
    total = sum(it.nbytes for r in readers for it in r.items())
    done = 0
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for reader in readers:
        state: dict[str, Any] = {}
        for put in reader.manifest.trees:
            state[put] = _own(reader.get(put), torch)
            done += sum(it.nbytes for it in reader.items(put))
            if progress is not None:
                progress(done, total)
        name = rank_file(reader.rank)
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(out / name)
        files.append(name)
        del state
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": "torch", "step": int(step), "world_size": world, "files": files}, indent=1) + "\n")
    tmp.rename(out / MANIFEST)
    return out


def rank_readers(store: Store, step: int) -> list[Reader]:
    """A reader of every rank that saved `step`, in rank order (rank 0's manifest says how many)."""
    view = StepView(store, step)  # every rank's part of one save of the step
    return [view.reader(r) for r in range(view.reader(0).manifest.world_size)]


def _own(value: Any, torch: Any) -> Any:
    """`value` with every tensor in storage of its own (a restored tensor may be a view of
    shared memory or of a bigger buffer: torch.save would write the whole buffer) and every
    numpy array owning its bytes."""
    import numpy as np

    if isinstance(value, torch.Tensor):
        t = value.detach().clone()
        return t.requires_grad_(True) if value.requires_grad else t
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        copied = value.copy()  # the same mapping type (OrderedDict, defaultdict's factory)
        for k, v in value.items():
            copied[k] = _own(v, torch)
        return copied
    if isinstance(value, list):
        return [_own(v, torch) for v in value]
    if isinstance(value, tuple):
        items = [_own(v, torch) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
