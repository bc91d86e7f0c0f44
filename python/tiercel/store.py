"""The Python face of a Store: framework objects in, buffers to the Rust core, objects out.

No bytes move in Python loops here: contiguous host arrays are copied by the core on its
copy threads with the GIL released; device and non-contiguous tensors are copied once by
their framework straight into the shared-memory segment.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from . import _core, _dtypes
from ._tree import Leaf, _torch, flatten, tree_items, unflatten
from .coordinator import Coordinator, default_coordinator


PolicyLike = str | os.PathLike | Mapping[str, Any]


def _policy_path(policy: PolicyLike | None) -> PolicyLike:
    if policy is not None:
        return policy
    return os.environ.get("TIERCEL_POLICY", "tiercel.toml")


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

    def wait(self, timeout: float | None = None) -> dict[str, str]:
        """Waits for the background tiers; raises TimeoutError, or the tier's error if one failed."""
        if not self._core.wait(timeout):
            raise TimeoutError(f"step {self.step}: background tiers not done after {timeout} s: {self.states()}")
        states = self.states()
        failed = {t: s for t, s in states.items() if s.startswith("failed")}
        if failed:
            # Raised as what the (first) failure was, with its fields: an integrity problem is
            # an IntegrityError, a full disk a TierUnavailableError, ...
            msg = f"step {self.step}: " + "; ".join(f"tier '{t}' {s}" for t, s in failed.items())
            first = next(iter(dict(self._core.errors()).values()), None)
            if first is None:
                raise _core.TierUnavailableError(msg)
            raise type(first)(msg, **first.fields()) from first
        return states

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, {self.states()})"


class Writer:
    """Writes one step, `put` by `put`; commits on a clean exit, discards on an exception."""

    def __init__(self, store: Store, step: int):
        self._store = store
        self._core = store._core.begin(step)
        self.step = step
        self.handle: SaveHandle | None = None
        self._t0 = time.perf_counter()

    def put(self, name: str, value: Any) -> None:
        """Copies `value` (a tree of arrays, tensors, bytes and scalars) into this step."""
        if not isinstance(name, str) or not name or "/" in name:
            raise _core.InvalidArgumentError(f"put name must be a non-empty string without '/', got {name!r}")
        try:
            tree, leaves = flatten(name, value)
        except TypeError as e:
            raise _core.InvalidArgumentError(f"step {self.step}: {e}") from None
        specs = [(l.name, l.kind, l.dtype, list(l.shape), l.nbytes, json.dumps(l.meta)) for l in leaves]
        part, places = self._core.add_part(name, json.dumps(tree), specs)
        direct: list[tuple[int, int]] = []  # (item index, source address): copied by the core
        framework_copied: list[int] = []
        keep_alive = []
        segment = None
        for leaf, (index, offset) in zip(leaves, places):
            if leaf.nbytes == 0:
                continue
            src = _host_address(leaf)
            if src is not None:
                direct.append((index, src[0]))
                keep_alive.append(src[1])
                continue
            if segment is None:
                segment = self._core.segment(part)
            _copy_into(segment, offset, leaf)
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

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _host_address(leaf: Leaf) -> tuple[int, Any] | None:
    """(address, owner) of a leaf's bytes when they are contiguous in host memory."""
    obj = leaf.obj
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.is_contiguous():
            return obj.data_ptr(), obj
        return None
    if isinstance(obj, np.ndarray):
        if obj.flags.c_contiguous:
            return obj.__array_interface__["data"][0], obj
        return None
    if isinstance(obj, bytes):
        arr = np.frombuffer(obj, dtype=np.uint8)
        return arr.__array_interface__["data"][0], (arr, obj)
    mv = memoryview(obj)
    if mv.c_contiguous:
        arr = np.frombuffer(mv, dtype=np.uint8)
        return arr.__array_interface__["data"][0], (arr, mv)
    return None


def _copy_into(segment: _core.Buffer, offset: int, leaf: Leaf) -> None:
    """One copy by the framework straight into shared memory: device tensors (a single
    device-to-host transfer) and non-contiguous arrays."""
    obj = leaf.obj
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        dst = torch.frombuffer(segment, dtype=torch.uint8, count=leaf.nbytes, offset=offset)
        dst = dst.view(obj.dtype).view(obj.shape)
        dst.copy_(obj)
        return
    dst = np.frombuffer(segment, dtype=obj.dtype, count=obj.size, offset=offset).reshape(obj.shape)
    np.copyto(dst, obj)


@dataclass
class RestoreInfo:
    """How the last restore went."""

    step: int
    seconds: float
    #: Number of items read from each tier ("ram", "disk", "ram+disk" when chunks were mixed).
    tiers: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def tier(self) -> str:
        """The tier most items came from."""
        return max(self.tiers, key=self.tiers.get) if self.tiers else "-"


class Reader:
    """One rank's view of a committed step; reads only the items asked for."""

    def __init__(self, store: Store, step: int, rank: int | None = None, tiers: list[str] | None = None):
        self._core = store._core.reader(step, rank, tiers)
        self.step = step
        self.manifest: dict = json.loads(self._core.manifest_json())
        self._trees = dict((name, tree) for name, tree in self.manifest["trees"])
        self.info = RestoreInfo(step=step, seconds=0.0)

    def names(self) -> list[str]:
        """The names that were put in this step."""
        return list(self._trees)

    def get(self, name: str) -> Any:
        """Rebuilds one put value (e.g. "optim") without reading the others."""
        if name not in self._trees:
            raise _core.NotFoundError(f"step {self.step}: nothing was put under '{name}' (have: {', '.join(self._trees)})")
        return self._read(self._trees[name])

    def get_all(self) -> dict[str, Any]:
        return {name: self._read(tree) for name, tree in self._trees.items()}

    def _read(self, tree: dict) -> Any:
        t0 = time.perf_counter()
        refs = tree_items(tree)
        # Item references in a tree index the put's own leaves; the manifest numbers items
        # across puts, in put order.
        base = self._item_base(tree)
        indices = [base + r for r in refs]
        buffers = self._core.read_items(indices)
        values: dict[int, Any] = {}
        for r, i, (buf, tier) in zip(refs, indices, buffers):
            item = self.manifest["items"][i]
            values[r] = _rebuild(item, buf)
            self.info.tiers[tier] = self.info.tiers.get(tier, 0) + 1
            self.info.nbytes += item["nbytes"]
        self.info.seconds += time.perf_counter() - t0
        self.info.warnings = self._core.warnings()
        return unflatten(tree, values)

    def _item_base(self, tree: dict) -> int:
        base = 0
        for name, t in self._trees.items():
            if t is tree:
                return base
            base += len(tree_items(t))
        raise AssertionError("tree not in manifest")


def _rebuild(item: dict, buf: _core.Buffer) -> Any:
    meta = item.get("meta") or {}
    if item["kind"] == "bytes":
        data = bytes(memoryview(buf)) if len(buf) else b""
        kind = meta.get("type")
        if kind == "pickle":
            return pickle.loads(data)
        if kind == "bytearray":
            return bytearray(data)
        return data
    shape = tuple(item["shape"])
    dtype = item["dtype"]
    if meta.get("framework") == "torch":
        try:
            import torch
        except ImportError:
            raise _core.InvalidArgumentError(f"item '{item['name']}' is a torch tensor; install torch to restore it") from None
        tdt = _dtypes.torch_dtype(dtype)
        if item["nbytes"] == 0:
            t = torch.empty(shape, dtype=tdt)
        else:
            t = torch.frombuffer(buf, dtype=torch.uint8).view(tdt).reshape(shape)
        if meta.get("requires_grad"):
            t.requires_grad_(True)
        return t
    ndt = _dtypes.numpy_dtype(dtype)
    if item["nbytes"] == 0:
        arr = np.empty(shape, dtype=ndt)
    else:
        arr = np.frombuffer(buf, dtype=ndt).reshape(shape)
    if meta.get("scalar"):
        return arr[()]
    return arr


class Store:
    """One per training process (rank): saves steps into the tiers of a policy and restores
    them from the fastest tier that still has them.

    `policy` is a TOML file path or a dict of the same shape. rank/world_size default to
    torch.distributed's, else $RANK/$WORLD_SIZE, else a single process.
    """

    def __init__(
        self,
        policy: PolicyLike | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        coordinator: Coordinator | None = None,
    ):
        if coordinator is not None:
            rank, world_size = coordinator.rank, coordinator.world_size
        else:
            coordinator, rank, world_size = default_coordinator(rank, world_size)
        self.coordinator = coordinator
        policy = _policy_path(policy)
        if isinstance(policy, Mapping):
            self._core = _core.Store(rank, world_size, policy_json=json.dumps(policy))
        else:
            self._core = _core.Store(rank, world_size, path=str(Path(policy)))
        self.rank: int = rank
        self.world_size: int = world_size
        self.last_restore: RestoreInfo | None = None
        self._skipped: list[str] = []
        self._closed = False
        self._join_cluster()

    def _join_cluster(self) -> None:
        """Learns which ranks share this host (its memory tier commits a step once they all
        have it) and, with a peer tier, everyone's peer address. Collective when the job has
        several ranks: one all-gather through the coordinator.

        The host name is the failure domain: $TIERCEL_HOST, else the machine's name. The
        peer secret comes from the policy or $TIERCEL_PEER_SECRET, else rank 0 makes one and
        hands it out over the coordinator (the job's own channel)."""
        # A job of one process has no peers to replicate to: its peer tier stays idle (as it
        # does for the CLI, which opens the store as a single process).
        if self.world_size == 1:
            return
        has_peer = any(t["kind"] == "peer" for t in self._core.tiers())
        if self.coordinator is None:
            if has_peer:
                raise _core.InvalidArgumentError(
                    "a peer tier needs a coordinator to exchange addresses: initialize torch.distributed "
                    "(or jax.distributed) before opening the Store, or pass coordinator="
                )
            return  # without one, all ranks are taken to share one host
        host = os.environ.get("TIERCEL_HOST") or socket.gethostname()
        addr = secret = None
        if has_peer:
            ip, port = self._core.peer_address().rsplit(":", 1)
            if ip in ("0.0.0.0", "[::]"):
                ip = os.environ.get("TIERCEL_ADVERTISE") or socket.gethostbyname(socket.gethostname())
            addr = f"{ip}:{port}"
            if not self._core.peer_has_secret() and self.rank == 0:
                secret = secrets.token_hex(32)
        everyone = self.coordinator.all_gather((host, addr, secret))
        hosts = [e[0] for e in everyone]
        self._core.set_local_ranks([r for r, h in enumerate(hosts) if h == host])
        if has_peer:
            shared = everyone[0][2]
            self._core.connect_peers(hosts, [e[1] for e in everyone], shared.encode() if shared else None)

    @classmethod
    def open(cls, policy: PolicyLike | None = None, **kwargs: Any) -> Store:
        """Opens a store from a policy file ($TIERCEL_POLICY, else ./tiercel.toml) or dict."""
        return cls(policy, **kwargs)

    # -- saving -----------------------------------------------------------------------------

    def writer(self, step: int) -> Writer:
        """A writer for `step`: `with store.writer(step) as w: w.put("model", sd)`."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise _core.InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        return Writer(self, step)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Saves a dict state; each top-level key becomes one put ("model", "optim", ...).
        Returns once the state is in the memory tier; the rest happens in the background."""
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise _core.InvalidArgumentError(
                f"save() takes a dict with str keys (e.g. {{'model': ..., 'optim': ...}}), got {type(state).__name__}; "
                "use store.writer(step).put(name, value) for anything else"
            )
        w = self.writer(step)
        try:
            for name, value in state.items():
                w.put(name, value)
        except BaseException:
            w.abort()
            raise
        return w.commit()

    # -- restoring --------------------------------------------------------------------------

    def steps(self) -> dict[str, list[int]]:
        """Committed steps per tier: {"ram": [3, 4], "disk": [2, 4]}."""
        return dict(self._core.steps())

    def latest_step(self) -> int | None:
        """The newest step that every rank can restore from some tier (collective when the
        job has several ranks), or None.

        A step counts for a rank only if the rank can open it: a commit record and its own
        manifest readable on some tier in restore order. So when one rank's copy of the newest
        step is gone (its manifest lost or corrupt on every tier), all ranks fall back together
        to the newest step that each of them can still read."""
        self._skipped = []
        mine = self._core.restorable_steps()
        if self.world_size == 1:
            for step in reversed(mine):
                if self._can_open(step):
                    return step
            return None
        if self.coordinator is None:
            raise _core.InvalidArgumentError(
                "a job of several ranks needs a coordinator to agree on the step: initialize torch.distributed "
                "before opening the Store, pass coordinator=, or restore(step=N)"
            )
        everyone = self.coordinator.all_gather(mine)
        common = sorted(set(everyone[0]).intersection(*map(set, everyone[1:])), reverse=True)
        # Every rank walks the same list in the same order: one all-gather per candidate,
        # usually just the first.
        for step in common:
            oks = self.coordinator.all_gather(self._can_open(step))
            if all(oks):
                return step
            bad = [r for r, ok in enumerate(oks) if not ok]
            self._skipped.append(f"step {step}: rank(s) {bad} cannot restore it")
        return None

    def _can_open(self, step: int) -> bool:
        try:
            self._core.reader(step, None, None)
            return True
        except _core.TiercelError as e:
            self._skipped.append(f"step {step} skipped on rank {self.rank}: {e}")
            return False

    def reader(self, step: int | None = None, *, rank: int | None = None, tiers: list[str] | None = None) -> Reader:
        """A reader of `step` (default: the newest step restorable by every rank)."""
        if step is None:
            step = self._require_latest()
        return Reader(self, step, rank, tiers)

    def restore(self, step: int | None = None) -> dict[str, Any]:
        """Restores a step (default: the newest one every rank can restore) as the dict that
        was saved. Arrays from the memory tier are zero-copy views over shared memory;
        writing to them never changes the checkpoint."""
        skipped: list[str] = []
        if step is None:
            step = self._require_latest()
            skipped = list(self._skipped)
        t0 = time.perf_counter()
        r = Reader(self, step)
        state = r.get_all()
        r.info.seconds = time.perf_counter() - t0
        r.info.warnings = skipped + r.info.warnings
        self.last_restore = r.info
        return state

    def _require_latest(self) -> int:
        step = self.latest_step()
        if step is None:
            try:
                steps: Any = self.steps()
            except _core.TiercelError as e:
                steps = f"cannot list: {e}"
            why = "".join(f"; {s}" for s in self._skipped)
            raise _core.NotFoundError(
                f"rank {self.rank}: no step can be restored by every rank from tiers {self._core.restore_order} "
                f"(committed here: {steps}){why}"
            )
        return step

    # -- housekeeping ---------------------------------------------------------------------------

    def tiers(self) -> list[dict[str, Any]]:
        return self._core.tiers()

    def flush(self) -> None:
        """Waits until every background job (persist, evict) has finished."""
        self._core.flush()

    def close(self) -> None:
        """Finishes background work and releases this process's spare shared memory."""
        if not self._closed:
            self._closed = True
            self._core.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
