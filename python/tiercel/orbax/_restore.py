"""Restoring a saved pytree into any target: each process reads only the byte ranges its
target shards need (tiercel._sharding plans them), from the fastest tier that has them."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .. import _dtypes
from .._sharding import Box, CoverageError, box_of_index, box_shape, plan
from ..errors import InvalidArgumentError, NotFoundError, TiercelError
from ..manifest import Item
from ..step import Reader, RestoreInfo
from ..store import Store
from ._layout import SavedLeaf, merge_layout, nested, rank_records
from ._leaf import CORE_SHARDS, shard_of


def read_range(reader: Reader, item: Item, start: int, length: int, cache: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """Bytes [start, start + length) of one saved item: the one place restores read bytes.
    Until the core reads ranges, the whole item is read once (`cache`) and cut."""
    if CORE_SHARDS:
        return reader.read(item, start, length)
    key = (reader.rank, item.index)
    if key not in cache:
        t0 = time.perf_counter()
        ((buf, tier),) = reader._core.read_items([item.index])
        cache[key] = np.frombuffer(memoryview(buf), dtype=np.uint8) if item.nbytes else np.empty(0, dtype=np.uint8)
        reader._account(tier, item.nbytes, t0)
    return cache[key][start : start + length]


class SavedStep:
    """One Orbax item of one committed step, as the ranks that saved it laid it out. Opening
    it reads manifests only; a rank's bytes are read when a target box needs them.

    `collective`: every process of the job opens it at once (as Orbax restores). Process p
    reads the manifests of saved ranks p, p + P, ... (P processes) and the processes swap
    what those say through the coordinator: no process has to reach every rank's manifest
    (a replacement host may reach its own rank's only, through its peers), and each manifest
    is read once per job."""

    def __init__(self, store: Store, step: int, put: str, tiers: list[str] | None = None, collective: bool = False):
        self.step = step
        self.put = put
        self._store = store
        self._tiers = tiers
        self._readers: dict[int, Reader] = {}
        self._cache: dict[tuple[int, int], np.ndarray] = {}
        many = collective and store.world_size > 1 and store.coordinator is not None
        p, n = (store.rank, store.world_size) if many else (0, 1)
        try:
            mine: tuple[str, Any] = ("ok", self._share(p, n))
        except (TiercelError, ValueError) as e:
            mine = ("error", f"process {p}: {e}")
        results = store.coordinator.all_gather(mine) if many and store.coordinator is not None else [mine]
        errors = [str(r) for ok, r in results if ok == "error"]
        if errors:
            raise NotFoundError(f"step {step} '{put}': " + "; ".join(errors))
        shares: dict[int, list[dict[str, Any]]] = {}
        for _, (_, records) in results:
            shares.update(records)
        #: Ranks that saved the step (process 0 always has a rank to read, so it knows).
        self.world_size: int = results[0][1][0]
        self.leaves = merge_layout(shares)

    def _share(self, p: int, n: int) -> tuple[int | None, dict[int, list[dict[str, Any]]]]:
        """(ranks that saved the step, {rank: leaf records}) for saved ranks p, p + n, ..."""
        try:
            first = self.reader(p)
        except InvalidArgumentError:  # more processes now than ranks then: nothing to read here
            return None, {}
        world = first.manifest.world_size
        return world, {r: rank_records(self.reader(r).manifest, self.put) for r in range(p, world, n)}

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
        saved: list[tuple[tuple[int, int], tuple[int, ...], tuple[int, ...]]] = []
        for rank, it in leaf.pieces:
            shard = shard_of(it)
            saved.append(((rank, it.index), shard.offsets if shard else (0,) * len(it.shape), it.shape))
        # Ranges closer than a chunk are read as one: the tiers read whole chunks anyway.
        max_waste = self._store._core.chunk_size
        try:
            p = plan(saved, box, dtype.itemsize, max_waste)
        except CoverageError as e:
            raise NotFoundError(f"step {self.step} '{self.put}' leaf {leaf.key}: {e} (saved by {self.world_size} ranks)") from None
        shape = box_shape(box)
        if len(p.reads) == 1:
            (rank, index), r = p.reads[0]
            if r.shape == shape and r.nbytes == pieces[(rank, index)].nbytes:
                buf = read_range(self.reader(rank), pieces[(rank, index)], r.start, r.nbytes, self._cache)
                return np.frombuffer(buf, dtype=dtype).reshape(shape)
        out = np.empty(shape, dtype=dtype)
        for (rank, index), r in p.reads:
            buf = read_range(self.reader(rank), pieces[(rank, index)], r.start, r.nbytes, self._cache)
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


def read_structure(store: Store, step: int, put: str) -> list[SavedLeaf]:
    """The leaves of a saved item (keys, shapes, dtypes, Python values) from the manifest of
    this process's rank alone (rank 0's when the step has fewer ranks): no collective."""
    try:
        reader = store.reader(step, rank=store.rank)
    except InvalidArgumentError:
        reader = store.reader(step, rank=0)
    try:
        return merge_layout({reader.rank: rank_records(reader.manifest, put)})
    except ValueError as e:
        raise NotFoundError(f"step {step}: {e}") from None
