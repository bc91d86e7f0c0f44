"""Export a step saved through tiercel.orbax to a standard Orbax checkpoint directory, which
`ocp.StandardCheckpointer().restore(out_dir)` (or `ocp.PyTreeCheckpointer`) loads without
tiercel."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from .. import exports
from .._dtypes import ITEMSIZE
from ..errors import InvalidArgumentError, NotFoundError
from ..exports import Progress
from ..store import PolicyLike, Store
from ._layout import SavedLeaf
from ._restore import SavedStep, restore_tree


def export(
    policy_or_store: PolicyLike | Store,
    step: int,
    out_dir: str | os.PathLike,
    *,
    item: str | None = None,
    tiers: list[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Writes `item` of `step` (default: the step's only tiercel.orbax item) as a standard
    Orbax checkpoint at `out_dir` (new or empty): global numpy arrays, Python scalars and
    strings, in nested dicts and lists. One process reads every rank's shards, from the
    fastest tier that has them (or only `tiers`), and holds the whole item in memory while
    Orbax writes it. `progress(done_bytes, total_bytes)` is called after each leaf.
    Returns the directory."""
    return exports.export(policy_or_store, step, out_dir, format="orbax", item=item, tiers=tiers, progress=progress)


def write(store: Store, step: int | str, out: Path, *, progress: Progress | None = None, item: str | None = None,
          tiers: list[str] | None = None) -> Path:
    """The registry's exporter (tiercel.exports): `out` is new or empty."""
    step = int(step)
    saved = SavedStep(store, step, item or only_item(store, step), tiers)
    empty = [leaf.key for leaf in saved.leaves if leaf.type in ("jax", "numpy") and 0 in leaf.shape]
    if empty:
        raise InvalidArgumentError(
            f"step {step} '{saved.put}': Orbax's format cannot store arrays of zero size: {', '.join(empty)}; "
            "restore the step with tiercel instead (tiercel.orbax.Restore)"
        )
    tree = restore_tree(saved, None, multi_process=False, on_leaf=leaf_bytes(saved.leaves, progress))
    if out.exists():
        out.rmdir()  # empty (the registry checked): Orbax writes a directory of its own
    # Orbax's PyTree handler writes the format StandardCheckpointer reads, and also takes
    # the strings and numpy scalars that StandardCheckpointer refuses to save.
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(out, tree)
    return out


def only_item(store: Store, step: int) -> str:
    """The step's one tiercel.orbax item; an error names them when there are several or none."""
    items = exports.orbax_items(store.reader(step, rank=0).manifest)
    if len(items) != 1:
        what = f"several ({', '.join(items)}): pass item=" if items else "none"
        raise NotFoundError(f"step {step}: tiercel.orbax items saved: {what}")
    return items[0]


def nbytes(leaf: SavedLeaf) -> int:
    """The bytes of an array leaf's global value (0 for other leaves)."""
    if leaf.type not in ("jax", "numpy"):
        return 0
    return int(np.prod(leaf.shape, dtype=np.int64)) * ITEMSIZE[leaf.dtype]


def leaf_bytes(leaves: list[SavedLeaf], progress: Progress | None) -> Callable[[int, int], None] | None:
    """restore_tree's per-leaf callback (leaves done, leaves) as progress(bytes done, bytes)."""
    if progress is None:
        return None
    sizes = [nbytes(leaf) for leaf in leaves]
    total = sum(sizes)
    done = [0]

    def on_leaf(i: int, _n: int) -> None:
        done[0] += sizes[i - 1]
        progress(done[0], total)

    return on_leaf
