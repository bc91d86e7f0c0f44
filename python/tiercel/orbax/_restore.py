"""Restoring a saved pytree into any target: each process reads only the byte ranges its
target shards need (tiercel._sharding plans them), from the fastest tier that has them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .. import _dtypes
from .._sharding import Box, CoverageError, Plan, box_of_index, box_shape, plan
from .._tree import tree_items, unflatten
from ..errors import InvalidArgumentError, NotFoundError, TiercelError
from ..manifest import Item
from ..newest import one_save
from ..replicas import share_pieces
from ..step import Reader, RestoreInfo
from ..step_view import StepView
from ..store import Store
from ._layout import SavedLeaf, merge_layout, nested, rank_records, read_put


@dataclass
class BoxPlan:
    """How to fill one box of an array leaf: its shape and dtype, and the ranges to read of
    the saved pieces (keyed (rank, item index))."""

    shape: tuple[int, ...]
    dtype: np.dtype
    plan: Plan[tuple[int, int]]
    items: dict[tuple[int, int], Item]
    #: A box of a target larger than the saved array (Restore(strict=False)): the shape of
    #: the target's box, zeros where the saved array has no elements, and where in it the
    #: planned box goes.
    into: tuple[tuple[int, ...], tuple[slice, ...]] | None = None


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
        #: Every saved rank's reader, opened once, all of one save of the step.
        self.view = StepView(store, step, tiers=tiers)
        #: Per leaf: ((rank, item index), offsets, shape) of every saved piece.
        self._boxes: dict[str, list[tuple[tuple[int, int], tuple[int, ...], tuple[int, ...]]]] = {}
        many = collective and store.world_size > 1 and store.coordinator is not None
        self._collective = many
        #: What the processes' shared read of their common pieces did (`share`), if they did.
        self.broadcast: dict[str, Any] | None = None
        p, n = (store.rank, store.world_size) if many else (0, 1)
        try:
            mine: tuple[str, Any] = ("ok", self._share(p, n))
        except (TiercelError, ValueError) as e:
            mine = ("error", f"process {p}: {e}")
        results = store.coordinator.all_gather(mine) if many and store.coordinator is not None else [mine]
        errors = [str(r) for ok, r in results if ok == "error"]
        if errors:
            raise NotFoundError(f"step {step} '{put}': " + "; ".join(errors))
        saves = [[save] for _, (world, _, save) in results if world is not None]
        if not one_save(saves):
            raise NotFoundError(
                f"step {step} '{put}': the processes read different saves of it "
                f"({', '.join(f'process {p}: {r[2]}' for p, (_, r) in enumerate(results))}): it was saved again and that "
                "save did not reach every tier; restore another step", step=step)
        shares: dict[int, list[dict[str, Any]]] = {}
        for _, (_, records, _) in results:
            shares.update(records)
        #: Ranks that saved the step (process 0 always has a rank to read, so it knows).
        self.world_size: int = results[0][1][0]
        self.leaves = merge_layout(shares)

    def _share(self, p: int, n: int) -> tuple[int | None, dict[int, list[dict[str, Any]]], str | None]:
        """(ranks that saved the step, {rank: leaf records}, the save read) for saved ranks
        p, p + n, ..."""
        try:
            first = self.reader(p)
        except InvalidArgumentError:  # more processes now than ranks then: nothing to read here
            return None, {}, None
        world = first.manifest.world_size
        return world, {r: rank_records(self.reader(r).manifest, self.put) for r in range(p, world, n)}, self.view.save

    def reader(self, rank: int) -> Reader:
        return self.view.reader(rank)

    def info(self, seconds: float) -> RestoreInfo:
        """Where this restore's bytes came from, over every rank's reader."""
        info = self.view.info(seconds)
        info.broadcast = self.broadcast
        return info

    def share(self, jobs: list[_Leaf]) -> None:
        """Collective, before any read: the pieces this process reads whole and others read too
        come from a slow tier once between them (`[restore] replicated`, replicas.share_pieces).
        Data-parallel replicas need the same shards, saved once (by replica 0)."""
        if not self._collective:
            return
        need: dict[tuple[int, int], int] = {}
        items: dict[tuple[int, int], Item] = {}
        for job in jobs:
            for bp, _ in job.boxes:
                for key, r in bp.plan.reads:
                    need[key] = need.get(key, 0) + r.nbytes
                    items[key] = bp.items[key]
        whole = {key: self.reader(key[0]) for key, n in need.items() if n >= items[key].nbytes > 0}
        self.broadcast = share_pieces(self._store, self.step, whole)

    # -- values ---------------------------------------------------------------------------------

    def plan_box(self, leaf: SavedLeaf, box: Box) -> BoxPlan:
        """Which byte ranges of which saved pieces fill `box` of an array leaf (no reads)."""
        dtype = _dtypes.numpy_dtype(leaf.dtype)
        items = {(rank, it.index): it for rank, it in leaf.pieces}
        if leaf.key not in self._boxes:
            self._boxes[leaf.key] = []
            for rank, it in leaf.pieces:
                shard = it.shard
                self._boxes[leaf.key].append(((rank, it.index), shard.offsets if shard else (0,) * len(it.shape), it.shape))
        saved = self._boxes[leaf.key]
        # Ranges closer than a chunk are read as one: the tiers read whole chunks anyway.
        max_waste = self._store._core.chunk_size
        try:
            p = plan(saved, box, dtype.itemsize, max_waste)
        except CoverageError as e:
            raise NotFoundError(f"step {self.step} '{self.put}' leaf {leaf.key}: {e} (saved by {self.world_size} ranks)") from None
        return BoxPlan(box_shape(box), dtype, p, items)

    def fill(self, bp: BoxPlan) -> np.ndarray:
        """The box's elements as a numpy array of the saved dtype. A box that is one whole
        saved piece comes back without a copy (from RAM: a view of shared memory)."""
        if bp.into is not None:
            shape, where = bp.into
            padded = np.zeros(shape, dtype=bp.dtype)
            padded[where] = self.fill(BoxPlan(bp.shape, bp.dtype, bp.plan, bp.items))
            return padded
        return self.view.read_box(bp.plan.reads, bp.items, bp.shape, bp.dtype)

    def value(self, leaf: SavedLeaf) -> Any:
        """A non-array leaf as saved: a Python value, or the value of an "object" item."""
        if leaf.type == "object" and leaf.tree is not None:  # kept in the tree, with its items read
            node, items = leaf.tree
            reader = self.reader(0)
            return unflatten(node, {i: reader.value(items[i]) for i in tree_items(node)})
        if leaf.type == "object":
            return self.reader(0).value(leaf.value)
        return leaf.value


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _sharding_of(target: Any) -> Any:
    """The sharding to restore into: a jax.ShapeDtypeStruct's or a jax.Array's, else None."""
    sharding = getattr(target, "sharding", None)
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)) and isinstance(sharding, jax.sharding.Sharding):
        return sharding
    return None


@dataclass
class _Leaf:
    """One target leaf on its way: the boxes it needs (each with the devices that hold it)."""

    saved: SavedLeaf
    target: Any
    boxes: list[tuple[BoxPlan, list[Any]]]


def _prepare(saved: SavedStep, leaf: SavedLeaf, target: Any, strict: bool = True) -> _Leaf:
    if leaf.type not in ("jax", "numpy"):
        return _Leaf(leaf, target, [])
    sharding = _sharding_of(target)
    shape = leaf.shape
    if isinstance(target, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) and tuple(target.shape) != leaf.shape:
        if strict or len(target.shape) != len(leaf.shape):
            raise InvalidArgumentError(
                f"step {saved.step} leaf {leaf.key}: the target has shape {tuple(target.shape)}, the checkpoint "
                f"{leaf.shape}" + ("; Restore(..., strict=False) truncates or pads with zeros" if strict and
                                   len(target.shape) == len(leaf.shape) else ""))
        shape = tuple(target.shape)  # strict=False: the saved array cut or padded with zeros
    if sharding is None:
        return _Leaf(leaf, target, [(_plan_clipped(saved, leaf, _full(shape)), [])])
    # Each addressable device's box, read once however many replicas hold it.
    devices: dict[Box, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        devices.setdefault(box_of_index(index, shape), []).append(device)
    return _Leaf(leaf, target, [(_plan_clipped(saved, leaf, box), devs) for box, devs in devices.items()])


def _plan_clipped(saved: SavedStep, leaf: SavedLeaf, box: Box) -> BoxPlan:
    """The plan of a box of the target; where the box reaches past the saved array (a larger
    target, strict=False), the part inside it, padded with zeros."""
    inner = tuple((lo, max(lo, min(hi, n))) for (lo, hi), n in zip(box, leaf.shape))
    if inner == box:
        return saved.plan_box(leaf, box)
    bp = saved.plan_box(leaf, inner)
    bp.into = (box_shape(box), tuple(slice(0, hi - lo) for lo, hi in inner))
    return bp


def _cast(x: np.ndarray, dtype: Any) -> np.ndarray:
    return x if dtype is None or x.dtype == np.dtype(dtype) else x.astype(dtype)


def _build(saved: SavedStep, job: _Leaf) -> Any:
    """The leaf's value: a jax.Array in the target's sharding, a numpy array (a numpy or
    unsharded target, or none), or the saved value of a non-array leaf."""
    leaf, target = job.saved, job.target
    if leaf.type not in ("jax", "numpy"):
        return saved.value(leaf)
    dtype = getattr(target, "dtype", None) if isinstance(target, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) else None
    if leaf.prng_impl is not None:
        dtype = None  # the key data keeps its dtype
    sharding = _sharding_of(target)
    value: Any
    if sharding is None:
        arr = _cast(saved.fill(job.boxes[0][0]), dtype)
        value = arr[()] if leaf.scalar else arr
    else:
        arrays = []
        for bp, devices in job.boxes:
            host = _cast(saved.fill(bp), dtype)
            arrays += [jax.device_put(host, d) for d in devices]
        value = jax.make_array_from_single_device_arrays(tuple(target.shape), sharding, arrays)
    # A typed PRNG key array was stored as its key data (tiercel.orbax._layout).
    return value if leaf.prng_impl is None else jax.random.wrap_key_data(value, impl=leaf.prng_impl)


def restore_tree(saved: SavedStep, target: Any, multi_process: bool, on_leaf: Callable[[int, int], Any] | None = None,
                 *, strict: bool = True, default: Callable[[SavedLeaf], Any] | None = None,
                 empty: Callable[[Any], bool] | None = None) -> Any:
    """The saved tree, into the structure and shardings of `target` (an abstract or concrete
    pytree), or, with no target, as nested dicts/lists of numpy arrays and values (each
    leaf's target `default(leaf)` when given). Plans every leaf first, reads ahead, then
    builds the values. `strict=False`: an array target of another shape gets the saved
    array cut to it or padded with zeros. `empty`: which subtrees of the target are empty
    (None, {}, optax.MaskedNode()): they come back as they are, nothing is read for them."""
    if target is None and default is not None:
        try:
            pairs = [(leaf, default(leaf)) for leaf in saved.leaves]
        except TiercelError:
            saved.share([])  # still take part, so that the other processes do not wait
            raise
    elif target is None:
        if multi_process:
            raise InvalidArgumentError(
                f"step {saved.step}: Restore() without a target returns numpy global arrays, which only a single-process "
                "job can use; pass Restore(abstract_state) with the shardings to restore into, e.g. "
                "jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, 'shape') else x, state)"
            )
        pairs = [(leaf, None) for leaf in saved.leaves]
    else:
        by_key = {leaf.key: leaf for leaf in saved.leaves}
        flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=empty)
        kept = [empty is not None and empty(t) for _, t in flat]
        keys = [jax.tree_util.keystr(p) for p, _ in flat]
        missing = [k for k, e in zip(keys, kept) if not e and k not in by_key]
        if missing:
            raise NotFoundError(
                f"step {saved.step} '{saved.put}' has no leaf {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                f"of the target (saved leaves: {', '.join(list(by_key)[:10])}{' ...' if len(by_key) > 10 else ''})"
            )
        pairs = [(by_key[k], t) for k, (_, t), e in zip(keys, flat, kept) if not e]
    try:
        jobs = [_prepare(saved, leaf, t, strict) for leaf, t in pairs]
    except TiercelError:
        saved.share([])  # still take part, so that the other processes do not wait
        raise
    saved.share(jobs)
    values = []
    for i, job in enumerate(jobs):
        values.append(_build(saved, job))
        if on_leaf:
            on_leaf(i + 1, len(jobs))
    if target is None:
        return nested(saved.leaves, values)
    built = iter(values)
    return jax.tree_util.tree_unflatten(treedef, [t if e else next(built) for (_, t), e in zip(flat, kept)])


def read_structure(store: Store, step: int, put: str) -> tuple[list[SavedLeaf], Any]:
    """The leaves of a saved item (keys, shapes, dtypes, Python values) and its custom
    metadata, from the manifest of this process's rank alone (rank 0's when the step has
    fewer ranks): no collective."""
    try:
        reader = store.reader(step, rank=store.rank)
    except InvalidArgumentError:
        reader = store.reader(step, rank=0)
    try:
        value = read_put(reader.manifest, put)
        return merge_layout({reader.rank: value["leaves"]}), value.get("custom_metadata")
    except ValueError as e:
        raise NotFoundError(f"step {step}: {e}") from None
