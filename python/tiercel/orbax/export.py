"""Export a step saved through tiercel.orbax to a standard Orbax checkpoint directory, which
`ocp.StandardCheckpointer().restore(out_dir)` (or `ocp.PyTreeCheckpointer`) loads without
tiercel."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import orbax.checkpoint as ocp

from ..coordinator import LocalCoordinator
from ..errors import InvalidArgumentError, NotFoundError
from ..store import PolicyLike, Store
from ._layout import is_layout
from ._restore import SavedStep, restore_tree


def export(
    policy_or_store: PolicyLike | Store,
    step: int,
    out_dir: str | os.PathLike,
    *,
    item: str | None = None,
    tiers: list[str] | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> Path:
    """Writes `item` of `step` (default: the step's only tiercel.orbax item) as a standard
    Orbax checkpoint at `out_dir` (which must not exist yet): global numpy arrays, Python
    scalars and strings, in nested dicts and lists. One process reads every rank's shards,
    from the fastest tier that has them (or only `tiers`), and holds the whole item in memory
    while Orbax writes it. `progress(leaves_done, leaves)` is called after each leaf.
    Returns the directory."""
    out = Path(out_dir).absolute()
    if out.exists():
        raise InvalidArgumentError(f"{out} exists; export writes a new directory")
    if isinstance(policy_or_store, Store):
        store, own = policy_or_store, False
    else:
        store, own = Store(policy_or_store, coordinator=LocalCoordinator()), True
    try:
        if item is None:
            trees = store.reader(step, rank=0).manifest.trees
            items = [name for name, tree in trees.items() if is_layout(tree)]
            if len(items) != 1:
                what = f"several ({', '.join(items)}): pass item=" if items else "none"
                raise NotFoundError(f"step {step}: tiercel.orbax items saved: {what}")
            item = items[0]
        saved = SavedStep(store, step, item, tiers)
        empty = [leaf.key for leaf in saved.leaves if leaf.type in ("jax", "numpy") and 0 in leaf.shape]
        if empty:
            raise InvalidArgumentError(
                f"step {step} '{item}': Orbax's format cannot store arrays of zero size: {', '.join(empty)}; "
                "restore the step with tiercel instead (tiercel.orbax.Restore)"
            )
        tree = restore_tree(saved, None, multi_process=False, on_leaf=progress)
        # Orbax's PyTree handler writes the format StandardCheckpointer reads, and also takes
        # the strings and numpy scalars that StandardCheckpointer refuses to save.
        with ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save(out, tree)
        return out
    finally:
        if own:
            store.close()
