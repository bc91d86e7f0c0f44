"""Restoring a saved pytree into any target: each process reads only the byte ranges its
target shards need (tiercel._sharding plans them), from the fastest tier that has them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from .. import _dtypes
from .._sharding import Box, CoverageError, box_of_index, box_shape, plan
from ..errors import InvalidArgumentError, NotFoundError
from ..step import Reader, RestoreInfo
from ..store import Store
from ._layout import SavedLeaf, nested, read_layout


class SavedStep:
    """One Orbax item of one committed step, over all the ranks that saved it. Opening it
    reads only manifests; readers of other ranks are opened on first use."""

    def __init__(self, store: Store, step: int, put: str, tiers: list[str] | None = None):
        self.step = step
        self.put = put
        self._store = store
        self._tiers = tiers
        first = store.reader(step, rank=0, tiers=tiers)
        self.world_size = first.manifest.world_size
        self._readers: dict[int, Reader] = {0: first}
        manifests = [first.manifest] + [self.reader(r).manifest for r in range(1, self.world_size)]
        try:
            self.leaves = read_layout(manifests, put)
        except (KeyError, ValueError) as e:
            raise NotFoundError(f"step {step}: {e}") from None

    def reader(self, rank: int) -> Reader:
        if rank not in self._readers:
            self._readers[rank] = self._store.reader(self.step, rank=rank, tiers=self._tiers)
        return self._readers[rank]

    def info(self, seconds: float) -> RestoreInfo:
        """Where this restore's bytes came from, over every rank's reader."""
        info = RestoreInfo(step=self.step, seconds=seconds)
        for r in self._readers.values():
            for tier, n in r.info.tiers.items():
                info.tiers[tier] = info.tiers.get(tier, 0) + n
            info.nbytes += r.info.nbytes
            info.warnings += r.info.warnings
        return info

    # -- values ---------------------------------------------------------------------------------

    def host_box(self, leaf: SavedLeaf, box: Box) -> np.ndarray:
        """The elements of `box` of an array leaf as a numpy array of the saved dtype: one
        read per contiguous range of every saved piece that overlaps it. A box that is one
        whole saved piece comes back without a copy (a view of shared memory from RAM)."""
        dtype = _dtypes.numpy_dtype(leaf.dtype)
        pieces = {(rank, it.index): it for rank, it in leaf.pieces}
        saved = [((rank, it.index), it.shard.offsets if it.shard else (0,) * len(it.shape), it.shape) for rank, it in leaf.pieces]
        max_waste = self.reader(0).manifest.chunk_size
        try:
            p = plan(saved, box, dtype.itemsize, max_waste)
        except CoverageError as e:
            raise NotFoundError(f"step {self.step} '{self.put}' leaf {leaf.key}: {e} (saved by {self.world_size} ranks)") from None
        shape = box_shape(box)
        if len(p.reads) == 1:
            (rank, index), r = p.reads[0]
            if r.shape == shape and r.nbytes == pieces[(rank, index)].nbytes:
                return np.frombuffer(self.reader(rank).read(index, r.start, r.nbytes), dtype=dtype).reshape(shape)
        out = np.empty(shape, dtype=dtype)
        for (rank, index), r in p.reads:
            buf = self.reader(rank).read(index, r.start, r.nbytes)
            out[r.dst] = np.ndarray(r.shape, dtype=dtype, buffer=buf, strides=r.strides)
        return out

    def value(self, leaf: SavedLeaf) -> Any:
        """A non-array leaf as saved: a Python value, or the value of an "object" item."""
        if leaf.type == "object":
            return self.reader(0).value(leaf.value)
        return leaf.value


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _check_shape(step: int, leaf: SavedLeaf, shape: Sequence[int]) -> None:
    if tuple(shape) != leaf.shape:
        raise InvalidArgumentError(f"step {step} leaf {leaf.key}: the target has shape {tuple(shape)}, the checkpoint {leaf.shape}")


def _cast(x: np.ndarray, dtype: Any) -> np.ndarray:
    return x if dtype is None or x.dtype == np.dtype(dtype) else x.astype(dtype)


def restore_leaf(saved: SavedStep, leaf: SavedLeaf, target: Any) -> Any:
    """One leaf into its target: a jax.ShapeDtypeStruct or jax.Array with a sharding gives a
    jax.Array of that sharding; a numpy array or an unsharded ShapeDtypeStruct a numpy array;
    anything else (or no target) the saved value (numpy for arrays)."""
    if leaf.type not in ("jax", "numpy"):
        return saved.value(leaf)
    sharding = getattr(target, "sharding", None)
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)) and isinstance(sharding, jax.sharding.Sharding):
        _check_shape(saved.step, leaf, target.shape)
        return _to_device(saved, leaf, target.shape, target.dtype, sharding)
    arr = saved.host_box(leaf, _full(leaf.shape))
    if isinstance(target, (np.ndarray, jax.ShapeDtypeStruct)):
        _check_shape(saved.step, leaf, target.shape)
        arr = _cast(arr, target.dtype)
    if leaf.scalar:
        return arr[()]
    return arr


def _to_device(saved: SavedStep, leaf: SavedLeaf, shape: Sequence[int], dtype: Any, sharding: Any) -> jax.Array:
    """Each addressable device's box read once (replicas share it), put on its device."""
    per_box: dict[Box, np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        box = box_of_index(index, shape)
        if box not in per_box:
            per_box[box] = _cast(saved.host_box(leaf, box), dtype)
        arrays.append(jax.device_put(per_box[box], device))
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def restore_tree(saved: SavedStep, target: Any, multi_process: bool, on_leaf: Callable[[int, int], Any] | None = None) -> Any:
    """The saved tree, into the structure and shardings of `target` (an abstract or concrete
    pytree), or, with no target, as nested dicts/lists of numpy arrays and values."""
    if target is None:
        if multi_process:
            raise InvalidArgumentError(
                f"step {saved.step}: Restore() without a target returns numpy global arrays, which only a single-process "
                "job can use; pass Restore(abstract_state) with the shardings to restore into, e.g. "
                "jax.tree.map(ocp.utils.to_shape_dtype_struct, state)"
            )
        values = []
        for i, leaf in enumerate(saved.leaves):
            values.append(restore_leaf(saved, leaf, None))
            if on_leaf:
                on_leaf(i + 1, len(saved.leaves))
        return nested(saved.leaves, values)
    by_key = {leaf.key: leaf for leaf in saved.leaves}
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    missing = [jax.tree_util.keystr(p) for p, _ in flat if jax.tree_util.keystr(p) not in by_key]
    if missing:
        raise NotFoundError(
            f"step {saved.step} '{saved.put}' has no leaf {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
            f"of the target (saved leaves: {', '.join(list(by_key)[:10])}{' ...' if len(by_key) > 10 else ''})"
        )
    values = []
    for i, (path, t) in enumerate(flat):
        values.append(restore_leaf(saved, by_key[jax.tree_util.keystr(path)], t))
        if on_leaf:
            on_leaf(i + 1, len(flat))
    return jax.tree_util.tree_unflatten(treedef, values)
