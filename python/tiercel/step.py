"""One step, written put by put (`Writer`) and read item by item (`Reader`), and what a save
has done where (`SaveHandle`).

No bytes move in Python loops here: contiguous host arrays are copied by the core on its
copy threads with the GIL released; device and non-contiguous tensors are copied once by
their framework straight into the shared-memory segment (the leaf handler's `copy_into`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import _core
from ._tree import flatten, tree_items, unflatten
from .errors import InvalidArgumentError, NotFoundError, TierUnavailableError
from .leaves import PICKLE_MODE, PICKLE_TRUSTED, Leaf, check_unpickle, rebuilder
from .manifest import Item, Manifest

if TYPE_CHECKING:
    from .store import Store


class SaveHandle:
    """What a save has done where. `wait()` blocks until every tier is final."""

    def __init__(self, core: _core.SaveHandle, blocking_seconds: float):
        self._core = core
        self.step: int = core.step
        #: Seconds the save blocked the caller (the copy into the memory tier).
        self.blocking_seconds = blocking_seconds

    def states(self) -> dict[str, str]:
        """{tier: state}: pending, running, written (this rank; others still going),
        committed, not scheduled (`every`), "skipped: ...", "failed: ..."."""
        return dict(self._core.states())

    def done(self) -> bool:
        return self._core.done()

    def intervals(self) -> dict[str, tuple[int, str]]:
        """{tier: (effective interval in iterations, why)} for the tiers whose checkpoints do
        not fit the training job's idle time at their `every` (`[traffic] mode = "learned"`):
        saves in between are skipped there."""
        return {tier: (n, why) for tier, n, why in self._core.notes()}

    def wait(self, timeout: float | None = None, *, commit: bool = False) -> dict[str, str]:
        """Waits for the background tiers; raises TimeoutError, or the tier's error if one failed.

        A tier's state is final for this rank once it has written its part ("written": other
        ranks still going). `commit=True` waits, on every tier this rank wrote the step to,
        until the step is committed there (every rank's part and the commit record: the state
        becomes "committed"), or will never be (this rank's part was removed or saved again:
        "skipped: ..."), looking again every few milliseconds; `timeout` bounds it all."""
        if not self._core.wait(timeout, commit):
            raise TimeoutError(f"step {self.step}: background tiers not done after {timeout} s: {self.states()}")
        states = self.states()
        failed = {t: s for t, s in states.items() if s.startswith("failed")}
        if failed:
            # Raised as what the (first) failure was, with its fields: an integrity problem is
            # an IntegrityError, a full disk a TierUnavailableError, ...
            msg = f"step {self.step}: " + "; ".join(f"tier '{t}' {s}" for t, s in failed.items())
            first = next(iter(dict(self._core.errors()).values()), None)
            if first is None:
                raise TierUnavailableError(msg)
            raise type(first)(msg, **first.fields()) from first
        return states

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, {self.states()})"


@dataclass
class Prepared:
    """A put flattened by `Writer.prepare`, not yet written: its tree (JSON-ready) and its
    leaves, which reference the caller's arrays and tensors."""

    name: str
    tree: Any
    leaves: list[Leaf]
    #: Every rank of the replica group puts the same bytes (`Writer.put(replicated=True)`).
    replicated: bool = False

    def take_copies(self, keep: Callable[[Leaf], bool]) -> int:
        """Replaces every leaf's object for which `keep` says no by a copy of it (a tensor on
        its own device, an array, bytes), so that the caller may change the original before
        `write`. Returns the bytes copied."""
        copied = 0
        for leaf in self.leaves:
            if leaf.nbytes and not keep(leaf):
                copy = _copy_of(leaf.obj)
                if copy is not leaf.obj:  # immutable values (pickled bytes) stay as they are
                    leaf.obj = copy
                    copied += leaf.nbytes
        return copied


def _copy_of(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, memoryview) and isinstance(obj.obj, bytes):
        return obj  # a view of immutable bytes
    if isinstance(obj, (bytearray, memoryview)):
        return memoryview(bytes(obj))
    if hasattr(obj, "clone") and hasattr(obj, "data_ptr"):  # a torch.Tensor
        return obj.clone()
    return obj  # bytes, and objects their handler keeps as immutable values


class Writer:
    """Writes one step, `put` by `put`; commits on a clean exit, discards on an exception."""

    def __init__(self, store: Store, step: int):
        self._store = store
        self._core = store._core.begin(step)
        self.step = step
        self.handle: SaveHandle | None = None
        self._t0 = time.perf_counter()

    def put(self, name: str, value: Any, *, replicated: bool = False) -> None:
        """Copies `value` (a tree of arrays, tensors, bytes and scalars) into this step.

        `replicated=True`: every rank of this store's replica group (`Store(replica_group=)`,
        default all ranks) puts the same bytes under `name` (data-parallel copies of the
        model, say). Persistent tiers then store one copy per group, and a restore from them
        reads it once and shares it over the network ([restore] replicated). A rank whose copy
        differs is reported when the step commits there (an IntegrityError naming it)."""
        self.write(self.prepare(name, value, replicated=replicated))

    def prepare(self, name: str, value: Any, *, replicated: bool = False, trust_pickles: bool = False) -> Prepared:
        """The first half of `put`: flattens `value` (small values are taken now: scalars into
        the tree, pickled objects as bytes); the arrays and tensors are referenced, not
        copied. `write` copies them later; until then they must not change.
        `trust_pickles`: the put is read back by `Reader(trust_pickles=True)`, so under
        `[store] pickle = "warn"` its values may be pickled (an adapter's own objects)."""
        if not isinstance(name, str) or not name or "/" in name:
            raise InvalidArgumentError(f"put name must be a non-empty string without '/', got {name!r}")
        token = PICKLE_MODE.set(self._store._core.pickle)  # what the pickle fallback may do
        trusted = PICKLE_TRUSTED.set(trust_pickles)
        try:
            tree, leaves = flatten(name, value)
        except TypeError as e:
            raise InvalidArgumentError(f"step {self.step}: {e}") from None
        except RecursionError:
            raise InvalidArgumentError(f"step {self.step}: '{name}' is nested too deeply to store") from None
        finally:
            PICKLE_MODE.reset(token)
            PICKLE_TRUSTED.reset(trusted)
        return Prepared(name, tree, leaves, replicated)

    def write(self, prepared: Prepared) -> None:
        """The second half of `put`: lays the put out and copies its leaves into the step
        (may run on another thread than `prepare`, one put at a time)."""
        leaves = prepared.leaves
        specs = [_spec(leaf) for leaf in leaves]
        primary = min(self._store.replica_group) if prepared.replicated else None
        part, places = self._core.add_part(prepared.name, json.dumps(prepared.tree), specs, primary)
        direct: list[tuple[int, int]] = []  # (item index, source address): copied by the core
        framework_copied: list[int] = []
        keep_alive = []
        segment = None
        for leaf, (index, offset) in zip(leaves, places):
            if leaf.nbytes == 0:
                continue
            assert leaf.handler is not None
            src = leaf.handler.host_address(leaf)
            if src is not None:
                direct.append((index, src[0]))
                keep_alive.append(src[1])
                continue
            if segment is None:
                segment = self._core.segment(part)
            leaf.handler.copy_into(leaf, segment, offset)
            framework_copied.append(index)
        if direct:
            self._core.copy_items(direct)
        if framework_copied:
            self._core.mark_written(framework_copied)
        del keep_alive

    def commit(self) -> SaveHandle:
        core_handle = self._core.commit()
        self.handle = SaveHandle(core_handle, time.perf_counter() - self._t0)
        return self.handle

    def abort(self) -> None:
        self._core.abort()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _spec(leaf: Leaf) -> tuple:
    """What the core lays out for a leaf: name, kind, dtype, shape, bytes, meta, and its
    shard (JSON) when it is one piece of a global array."""
    spec: tuple = (leaf.name, leaf.kind, leaf.dtype, list(leaf.shape), leaf.nbytes, json.dumps(leaf.meta))
    if leaf.shard is not None:
        spec += (json.dumps(leaf.shard.to_json()),)
    return spec


@dataclass
class RestoreInfo:
    """How the last restore went."""

    step: int
    seconds: float
    #: Number of items read from each tier ("ram", "disk", "ram+disk" when chunks were mixed).
    tiers: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    warnings: list[str] = field(default_factory=list)
    #: When replicated puts were read together with the replica group: the mode, bytes read
    #: from the tier, received from and sent to other ranks, fallbacks ([restore] replicated).
    broadcast: dict[str, Any] | None = None

    @property
    def tier(self) -> str:
        """The tier most items came from."""
        return max(self.tiers, key=lambda t: self.tiers[t]) if self.tiers else "-"


class Reader:
    """One rank's view of a committed step; reads only the items (or byte ranges) asked for."""

    def __init__(self, store: Store, step: int, rank: int | None = None, tiers: list[str] | None = None,
                 job: str | None = None, *, trust_pickles: bool = False, opened: _core.StepReader | None = None):
        # `opened`: the core's reader of this step and rank with these tiers and job, opened
        # already (choosing the step opens it): its commit records and manifests are not read again.
        self._core = store._core.reader(step, rank, tiers, job) if opened is None else opened
        self.step = step
        self.rank: int = self._core.rank
        #: The manifest of the first tier in restore order that has the step.
        self.manifest = Manifest.from_json(self._core.manifest_json())
        self.info = RestoreInfo(step=step, seconds=0.0)
        # An adapter whose framework itself unpickles these values (DeepSpeed's torch.load of
        # its own files) reads them with the same trust; `[store] pickle` rules everything else.
        self._pickle = "allow" if trust_pickles else store._core.pickle

    @property
    def save(self) -> str | None:
        """Which save of the step this reader reads (its generation: a step saved again is
        another save), None for a step saved before generations were recorded. Readers of
        several ranks read one save when their `save` is equal (tiercel.kit.StepView)."""
        return self._core.generation

    def names(self) -> list[str]:
        """The names that were put in this step."""
        return self.manifest.puts()

    def items(self, put: str | None = None) -> list[Item]:
        """The items of one put (default: of every put)."""
        return list(self.manifest.items) if put is None else self.manifest.items_of(self._put(put))

    def get(self, name: str) -> Any:
        """Rebuilds one put value (e.g. "optim") without reading the others."""
        return self._read(self._put(name))

    def get_all(self) -> dict[str, Any]:
        return {name: self._read(name) for name in self.manifest.trees}

    def read(self, item: Item | int | str, start: int = 0, length: int | None = None) -> np.ndarray:
        """The raw bytes [start, start + length) of one item as a uint8 array (default: to the
        end). Only the chunks that overlap the range are read, each verified before use, from
        the first tier in restore order that has a valid copy."""
        it = self._item(item)
        if length is None:
            length = it.nbytes - start
        if start < 0 or length < 0 or start + length > it.nbytes:
            raise InvalidArgumentError(f"step {self.step} item '{it.name}': bytes {start}..{start + length} "
                                       f"are outside its {it.nbytes} bytes")
        t0 = time.perf_counter()
        buf, tier = self._core.read_range(it.index, start, length)
        self._account(tier, length, t0)
        return np.frombuffer(memoryview(buf), dtype=np.uint8) if length else np.empty(0, dtype=np.uint8)

    def read_many(self, items: list[Item]) -> list[np.ndarray]:
        """Every byte of several items, as uint8 arrays, in one call: the core maps each
        shared-memory object once for all of them and reads chunks in parallel (one `read`
        per item maps its object again each time)."""
        t0 = time.perf_counter()
        out = []
        for it, (buf, tier) in zip(items, self._core.read_items([it.index for it in items])):
            self._account(tier, it.nbytes, t0)
            t0 = time.perf_counter()
            out.append(np.frombuffer(memoryview(buf), dtype=np.uint8) if it.nbytes else np.empty(0, dtype=np.uint8))
        return out

    def read_into(self, item: Item | int | str, out: Any, start: int = 0) -> None:
        """Reads bytes [start, start + nbytes of `out`) of one item into `out`, the caller's
        memory: a writable C-contiguous numpy array, CPU torch tensor or other buffer, of any
        dtype (its bytes are filled). One copy, made with the checksum of every chunk on the
        core's copy threads in parallel, from the first tier in restore order that has a valid
        copy (a shared-memory file is read without being mapped). If it raises, `out` may hold
        part of the bytes."""
        it = self._item(item)
        dst = writable_bytes(out, f"step {self.step} item '{it.name}'")
        if start < 0:  # the core checks the end (one rule for read_range and read_into)
            raise InvalidArgumentError(f"step {self.step} item '{it.name}': bytes start at {start}, before the item")
        t0 = time.perf_counter()
        tier = self._core.read_into(it.index, start, dst)
        self._account(tier, dst.nbytes, t0)

    def value(self, item: Item | int | str) -> Any:
        """One item rebuilt by the leaf handler that wrote it (an array, a tensor, bytes)."""
        it = self._item(item)
        check_unpickle(it, self._pickle, self.step, self.rank)
        t0 = time.perf_counter()
        ((buf, tier),) = self._core.read_items([it.index])
        self._account(tier, it.nbytes, t0)
        return rebuilder(it).rebuild(it, buf)

    def _item(self, item: Item | int | str) -> Item:
        if isinstance(item, Item):
            return item
        if isinstance(item, int) and 0 <= item < len(self.manifest.items):
            return self.manifest.items[item]
        if isinstance(item, str):
            try:
                return self.manifest.item(item)
            except KeyError:
                pass
        raise NotFoundError(f"step {self.step} rank {self.rank}: no item {item!r}")

    def _put(self, name: str) -> str:
        if name not in self.manifest.trees:
            raise NotFoundError(f"step {self.step}: nothing was put under '{name}' (have: {', '.join(self.manifest.trees)})")
        return name

    def _account(self, tier: str, nbytes: int, t0: float) -> None:
        self.info.tiers[tier] = self.info.tiers.get(tier, 0) + 1
        self.info.nbytes += nbytes
        self.info.seconds += time.perf_counter() - t0
        self.info.warnings = self._core.warnings()

    def _read(self, put: str) -> Any:
        t0 = time.perf_counter()
        tree = self.manifest.trees[put]
        items = self.manifest.items_of(put)
        for it in items:  # before reading anything
            check_unpickle(it, self._pickle, self.step, self.rank)
        buffers = self._core.read_items([it.index for it in items])
        values: dict[int, Any] = {}
        # Item references in a tree index the put's own items, in order.
        for ref, it, (buf, tier) in zip(tree_items(tree), items, buffers):
            values[ref] = rebuilder(it).rebuild(it, buf)
            self.info.tiers[tier] = self.info.tiers.get(tier, 0) + 1
            self.info.nbytes += it.nbytes
        self.info.seconds += time.perf_counter() - t0
        self.info.warnings = self._core.warnings()
        return unflatten(tree, values, f"step {self.step} rank {self.rank} put '{put}'", step=self.step, rank=self.rank)


def writable_bytes(out: Any, what: str) -> memoryview:
    """`out` (a numpy array, a CPU torch tensor, any buffer) as a writable memoryview of its
    bytes, sharing its memory; a clear error for memory that cannot be written in place."""
    if hasattr(out, "data_ptr") and hasattr(out, "is_contiguous"):  # a torch tensor
        if out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidArgumentError(f"{what}: read_into needs a contiguous CPU tensor, got one on "
                                       f"{out.device} (contiguous: {out.is_contiguous()}); read it and copy_() instead")
        import torch

        out = out.detach().reshape(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, dtype=np.uint8)
    try:
        mv = memoryview(out)
    except TypeError as e:
        raise InvalidArgumentError(f"{what}: read_into needs an array, tensor or buffer, got {type(out).__name__}") from e
    if mv.readonly or not mv.c_contiguous:
        raise InvalidArgumentError(f"{what}: read_into needs writable, C-contiguous memory "
                                   f"(read-only: {mv.readonly}, contiguous: {mv.c_contiguous})")
    return mv if mv.format == "B" else np.frombuffer(mv, dtype=np.uint8).data
