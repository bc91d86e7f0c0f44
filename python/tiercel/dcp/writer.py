"""tiercel as DCP's storage writer, and as the stager of `dcp.async_save`.

    dcp.save(state_dict, storage_writer=tiercel.dcp.Writer("tiercel.toml", step=step))
    dcp.async_save(state_dict, storage_writer=tiercel.dcp.Writer("tiercel.toml", step=step))

What DCP calls, and what happens:

- `write_data` (every rank): the plan's items go into the rank's step in shared memory in one
  put (tensors raw, DCP's byte items as they are); ranks other than the coordinator commit
  their part of the step right there, since DCP calls nothing else on them.
- `finish` (the coordinator, rank 0, once every rank's `write_data` succeeded): DCP's
  Metadata, with where each item lives, goes into rank 0's step, which then commits too. A
  step commits on a tier only when every rank's part is there, so it becomes visible only
  after `finish`; a save that fails or is killed before leaves the previous step.
- `stage` (`dcp.async_save`, before it returns): the state's tensors are copied once, straight
  into the step's shared memory, and DCP's background save writes from there without a
  second copy (`write_data` finds the staged bytes already in place).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..errors import InvalidArgumentError
from ..metrics import record
from ..step import SaveHandle
from ..step import Writer as StepWriter
from ..store import PolicyLike, Store
from . import _layout
from ._layout import PUT_DATA, PUT_METADATA, PUT_STAGED, Where
from ._stores import open_store


def parse_step(checkpoint_id: Any) -> int:
    """A step from DCP's `checkpoint_id` (an int, or a str of digits)."""
    if isinstance(checkpoint_id, bool):
        raise InvalidArgumentError(f"checkpoint_id must be a tiercel step (a non-negative int), got {checkpoint_id!r}")
    if isinstance(checkpoint_id, int) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return int(checkpoint_id)
    raise InvalidArgumentError(f"checkpoint_id must be a tiercel step (a non-negative int), got {checkpoint_id!r}")


def is_step(checkpoint_id: Any) -> bool:
    try:
        parse_step(checkpoint_id)
        return True
    except InvalidArgumentError:
        return False


class Writer(StorageWriter, AsyncStager):
    """Saves one DCP checkpoint as tiercel step `step`.

    `policy`: a tiercel.Store, or a policy (TOML path or dict; default $TIERCEL_POLICY, else
    ./tiercel.toml) whose Store is opened once per process and reused (tiercel.dcp._stores).
    `step` may instead come as DCP's `checkpoint_id` (`dcp.save(..., checkpoint_id=step)`),
    except for `dcp.async_save`, which stages before it hands over the id.

    After the save, `handle` is this rank's SaveHandle: `handle.wait()` waits for the
    background tiers (peers, disk, object store).
    """

    # Staging is done when `stage` returns: nothing for DCP to synchronize later.
    _synchronize_after_execute: bool = False

    def __init__(self, policy: PolicyLike | Store | None = None, step: int | None = None) -> None:
        super().__init__()
        self.store = open_store(policy)
        self.step: int | None = None if step is None else parse_step(step)
        self.handle: SaveHandle | None = None
        self._save_id = str(uuid.uuid4())
        self._is_coordinator = False
        self._writer: StepWriter | None = None
        # Staged views by data pointer: a tensor DCP resolves to one of these is already stored.
        self._staged: dict[int, tuple[str, torch.Tensor]] = {}

    # -- StorageWriter -----------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        self._save_id = str(uuid.uuid4())
        if checkpoint_id is None:
            return
        step = parse_step(checkpoint_id)
        if self._writer is not None and self._writer.step != step:
            raise InvalidArgumentError(
                f"async_save staged step {self._writer.step} but was given checkpoint_id={checkpoint_id!r}; "
                "give the step to tiercel.dcp.Writer(policy, step=N) and leave checkpoint_id out"
            )
        self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "tiercel.dcp.Writer needs dcp.save's collectives (use_collectives=True): a step commits "
                "once rank 0 has stored the global metadata"
            )
        rank = kwargs.get("rank")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.store.world_size:
            raise InvalidArgumentError(
                f"the job has {dist.get_world_size()} ranks but this tiercel Store was opened for {self.store.world_size}: "
                "make the first tiercel.dcp.Writer after init_process_group"
            )
        if rank is not None and rank != self.store.rank:
            raise InvalidArgumentError(
                f"DCP runs this process as rank {rank} but its tiercel Store is rank {self.store.rank} of "
                f"{self.store.world_size}: save over the default process group (no process_group=, no no_dist=) "
                "so that every rank of the job writes its part of the step"
            )
        if is_coordinator and self.store.rank != 0:
            raise InvalidArgumentError(
                f"DCP's coordinator is rank {self.store.rank}; tiercel.dcp stores the checkpoint metadata with "
                "rank 0, so save with coordinator rank 0 (the default)"
            )
        if self.step is None:
            raise InvalidArgumentError(
                "no step to save: make the writer with tiercel.dcp.Writer(policy, step=N) or pass "
                "dcp.save(..., checkpoint_id=N)"
            )
        self._is_coordinator = is_coordinator
        self.handle = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Every item this rank holds, before DCP's planner drops the ones another rank also
        # holds (the same list object: pickled once on the way to the coordinator).
        return dataclasses.replace(plan, storage_data=plan.items)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Gives back each host one copy of every item its ranks hold (DCP keeps one copy
        in the whole job): restores then read such items from their own host."""
        hosts = self.store.hosts  # known on rank 0, DCP's coordinator here (checked above)
        if hosts is None or len(plans) != len(hosts) or not all(p.usable for p in plans):
            return [dataclasses.replace(p, storage_data=None) for p in plans]
        held: dict[str, set[Any]] = {h: set() for h in hosts}
        for host, p in zip(hosts, plans):
            held[host].update(it.index for it in p.items)
        out = []
        for host, p in zip(hosts, plans):
            extra = [it for it in (p.storage_data or []) if it.index not in held[host]]
            held[host].update(it.index for it in extra)
            out.append(dataclasses.replace(p, items=[*p.items, *extra], storage_data=None))
        return out

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    @property
    def checkpoint_id(self) -> str:
        return f"tiercel:{self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_step(checkpoint_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        writer = self._step_writer()
        rank = self.store.rank
        fresh: dict[str, Any] = {}
        keep_alive: list[io.BytesIO] = []
        results = []
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    keep_alive.append(data)
                    buf = data.getbuffer()
                    key, put, size = _layout.item_key(item.index.fqn, item.index.offset), PUT_DATA, buf.nbytes
                    fresh[key] = buf
                else:
                    assert isinstance(data, torch.Tensor)
                    size = data.numel() * data.element_size()
                    staged = self._staged_key(data)
                    if staged is not None:
                        key, put = staged, PUT_STAGED
                    else:
                        key, put = _layout.item_key(item.index.fqn, item.index.offset), PUT_DATA
                        fresh[key] = data.detach()
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=Where(rank, self.store.host, put, key).to_storage_data()))
            if fresh:
                writer.put(PUT_DATA, fresh)
            del fresh, keep_alive
            if not self._is_coordinator:
                self._commit()
        except BaseException:
            self._discard()
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            copies: dict[Any, list[dict[str, Any]]] = {}
            for rank_results in results:
                for r in rank_results:
                    copies.setdefault(r.index, []).append(r.storage_data)
            metadata.storage_data = copies
            metadata.storage_meta = self.storage_meta()
            self._step_writer().put(PUT_METADATA, pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
            self._commit()
        except BaseException:
            self._discard()
            raise

    # -- AsyncStager ---------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copies the state into this step's shared memory, once, and returns the same
        structure over that memory (DTensors keep their mesh and placements). Training may
        change the original state as soon as this returns."""
        if self.step is None:
            raise InvalidArgumentError(
                "dcp.async_save stages before it hands over checkpoint_id: give the step to "
                "tiercel.dcp.Writer(policy, step=N)"
            )
        t0 = time.perf_counter()
        self._discard()
        self._writer = self.store.writer(self.step)
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _collect(state_dict, "", tensors)
        views = _layout.stage(self._writer, PUT_STAGED, tensors)
        self._staged = {v.data_ptr(): (k, v) for k, v in views.items() if v.numel()}
        record(self.store, "dcp_staging", time.perf_counter() - t0)  # store.metrics().timings
        return _rebuild(skeleton, views)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once the copy is done."""

    def close(self) -> None:
        """Nothing to release: the Store is shared (tiercel.dcp.close() closes it)."""

    def __getstate__(self) -> Any:
        raise InvalidArgumentError(
            "tiercel.dcp.Writer cannot move to another process (it writes through this process's Store and "
            "shared memory): use dcp.async_save's default thread executor, not AsyncCheckpointerType.PROCESS"
        )

    # -- internals -----------------------------------------------------------------------------

    def _step_writer(self) -> StepWriter:
        if self._writer is None:
            assert self.step is not None
            self._writer = self.store.writer(self.step)
        return self._writer

    def _staged_key(self, t: torch.Tensor) -> str | None:
        if not self._staged or t.numel() == 0:
            return None
        hit = self._staged.get(t.data_ptr())
        if hit is None:
            return None
        key, view = hit
        same = t.device == view.device and t.dtype == view.dtype and t.shape == view.shape and t.stride() == view.stride()
        return key if same else None

    def _commit(self) -> None:
        assert self._writer is not None
        self.handle = self._writer.commit()
        self._writer = None
        self._staged = {}
        # One step per writer: a second save must name its own step.
        self.step = None

    def _discard(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        self._writer = None
        self._staged = {}


# -- staging: the state's structure, with tensors taken out and put back as views ----------


class _Slot:
    """Where a staged tensor goes back: its key, and how to wrap the view (a DTensor's mesh,
    placements, global shape and stride)."""

    def __init__(self, key: str, like: torch.Tensor):
        self.key = key
        self.dtensor = like if isinstance(like, DTensor) else None


def _collect(obj: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    """The state with every tensor replaced by a _Slot (its data put in `out`), and every
    other leaf deep-copied: the background save must see the values of now."""
    if isinstance(obj, DTensor):
        key = _unique(path, out)
        out[key] = obj.to_local().detach()
        return _Slot(key, obj)
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise InvalidArgumentError(
                f"'{path}': {type(obj).__name__} cannot be staged into shared memory; save it with dcp.save, "
                "or pass dcp.async_save a stager of its own (async_stager=DefaultStager())"
            )
        key = _unique(path, out)
        out[key] = obj.detach()
        return _Slot(key, obj)
    if isinstance(obj, dict):
        return type(obj)((k, _collect(v, f"{path}.{k}" if path else str(k), out)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_collect(v, f"{path}.{i}" if path else str(i), out) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _unique(path: str, taken: dict[str, Any]) -> str:
    key, n = path or "_", 1
    while key in taken:  # keys 1 and "1" of one dict
        n += 1
        key = f"{path}#{n}"
    return key


def _rebuild(obj: Any, views: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        view = views[obj.key]
        d = obj.dtensor
        if d is None:
            return view
        # DTensor's own constructor, as torch's stagers use it: DTensor.from_local would move
        # the view back to the mesh's device (a GPU), undoing the staging.
        return DTensor(view, d._spec, requires_grad=False)
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, views)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_rebuild(v, views) for v in obj)
    return obj
