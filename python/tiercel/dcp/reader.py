"""tiercel as DCP's storage reader.

    dcp.load(state_dict, storage_reader=tiercel.dcp.Reader("tiercel.toml"))            # newest step
    dcp.load(state_dict, storage_reader=tiercel.dcp.Reader("tiercel.toml", step=40))

DCP's planner decides which boxes of which saved tensors each rank needs (resharding when
the job's layout changed); this reader fetches each box from the fastest tier that has it
(own RAM, a peer's RAM, then disk or object store, falling back chunk by chunk), reading only
the bytes that hold it, and copies it into the rank's tensors.

Loading is collective over the job's default process group, as `dcp.load` is: the ranks agree
on the step (the newest one every rank can restore, unless `step` is given), and DCP's
Metadata, which rank 0 of the saving job stored, is handed from a rank that can read it to
those that cannot (a host whose RAM was wiped cannot see the other host's copy).
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections import Counter
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _dtypes, kit
from ..coordinator import agree_min, all_true, broadcast
from ..errors import IntegrityError, InvalidArgumentError, NotFoundError, TiercelError
from ..manifest import Item
from ..step import Reader as StepReader
from ..store import PolicyLike, Store
from . import _layout
from ._layout import PUT_METADATA, Where
from ._stores import open_store
from .writer import is_step, parse_step

#: The most bytes of whole items read in one call (all of them are held until copied into
#: the state): zero-copy views from RAM cost nothing, bytes from disk or S3 do.
BATCH_BYTES = 256 << 20


class Reader(StorageReader):
    """Loads a DCP checkpoint from tiercel step `step` (default: the newest step that every
    rank can restore). `policy` as for tiercel.dcp.Writer.

    After a load, `step` is the step loaded, and `tiers` counts the reads served by each tier
    ({"ram": ..., "peer": ...}; "ram+disk" when one read's chunks came from several)."""

    def __init__(self, policy: PolicyLike | Store | None = None, step: int | None = None) -> None:
        super().__init__()
        self.store = open_store(policy)
        self._wanted = None if step is None else parse_step(step)
        self.step: int | None = self._wanted
        self._load_id = str(uuid.uuid4())
        self._storage: dict[Any, Any] = {}
        self._locate: _layout.Locator | None = None

    # -- StorageReader -----------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._wanted = parse_step(checkpoint_id)
        self.step = self._wanted
        self._load_id = str(uuid.uuid4())
        self._storage = {}
        self._locate = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP asks for a rank's own metadata only after the global one failed on every rank.
            raise NotFoundError("tiercel.dcp steps have no per-rank metadata, only the global one")
        agreed = None if self._wanted is not None else self._newest()
        step = self._wanted if agreed is None else agreed.step
        assert step is not None
        self.step = step
        self._locate = _layout.Locator(self.store, step, agreed)
        metadata = self._shared_metadata(step)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self._load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not metadata.storage_data:
            raise IntegrityError(f"step {self.step}: DCP metadata without storage data")
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @property
    def tiers(self) -> Counter[str]:
        return Counter(self._locate.view.info().tiers if self._locate else {})

    @property
    def checkpoint_id(self) -> str:
        return f"tiercel:{self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_step(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each request from its nearest copy. Requests for whole stored items (the
        usual case when the job's layout did not change) are read together, up to
        BATCH_BYTES at a time, in one call per saving rank; a box inside an item reads only
        the chunks that hold it. A copy that cannot be read gives way to the next one."""
        batch: list[tuple[ReadItem, list[Where], StepReader, Item]] = []
        size = 0
        for req in plan.items:
            what = f"step {self.step} item {req.storage_index.fqn}"
            copies = _layout.nearest_first(Where.copies(self._storage.get(req.storage_index), what),
                                           self.store.rank, self.store.host)
            whole = self._whole_item(req, copies[0])
            if whole is None:
                self._read_one(req, copies, planner)
                continue
            batch.append((req, copies, *whole))
            size += whole[1].nbytes
            if size >= BATCH_BYTES:
                self._read_batch(batch, planner)
                batch, size = [], 0
        self._read_batch(batch, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- internals -----------------------------------------------------------------------------

    def _newest(self) -> kit.Agreement:
        """The newest step every rank can reshard from, all of one save (collective)."""
        agreed = kit.agree(self.store, kit.Need(reshard=True))
        if agreed.step is None:
            why = "".join(f"; {s}" for s in agreed.skipped)
            raise NotFoundError(f"rank {self.store.rank}: no step can be restored by every rank from tiers "
                                f"{self.store._core.restore_order} (committed: {self.store.steps()}){why}")
        return agreed

    def _shared_metadata(self, step: int) -> Metadata:
        """DCP's Metadata of `step`, read by this rank if it can, else handed over by the
        lowest rank that could. Every rank takes part in the same collectives whatever it
        found, so a failure raises on all ranks instead of hanging some: whether all read it
        (`all_true`), and only when some could not, the lowest rank that did (`agree_min`)
        and a broadcast from it: O(1) bytes per rank besides the metadata."""
        data: bytes | None = None
        error = ""
        try:
            data = metadata_bytes(self._locator().reader(0))
        except TiercelError as e:
            error = str(e)
        coord = self.store.coordinator
        if self.store.world_size > 1 and coord is not None:
            world = self.store.world_size
            if not all_true(coord, data is not None):
                giver = agree_min(coord, self.store.rank if data is not None else world)
                if giver < world:
                    data = broadcast(coord, data if self.store.rank == giver else None, giver)
        if data is None:
            raise NotFoundError(f"step {step}: no rank can read the DCP metadata: {error}")
        return unpickle_metadata(data, step)

    def _locator(self) -> _layout.Locator:
        if self._locate is None:
            raise InvalidArgumentError("DCP asked for data before reading the metadata (read_metadata)")
        return self._locate

    def _whole_item(self, req: ReadItem, where: Where) -> tuple[StepReader, Item] | None:
        """The reader and item of `where` when `req` asks for all of it."""
        try:
            reader, it = self._locator().find(where)
        except TiercelError:
            return None  # _read_one tries the other copies and says what went wrong
        if req.type == LoadItemType.BYTE_IO or (not any(req.storage_offsets) and tuple(req.lengths) == it.shape):
            return reader, it
        return None

    def _read_batch(self, batch: list[tuple[ReadItem, list[Where], StepReader, Item]], planner: LoadPlanner) -> None:
        groups: dict[int, list[tuple[ReadItem, list[Where], StepReader, Item]]] = {}
        for entry in batch:
            if not self._read_into_target(*entry, planner):
                groups.setdefault(id(entry[2]), []).append(entry)
        for group in groups.values():
            try:
                raws = group[0][2].read_many([it for *_, it in group])
            except TiercelError:
                for req, copies, _, _ in group:
                    self._read_one(req, copies, planner)
                continue
            for (req, _, _, it), raw in zip(group, raws):
                self._deliver(req, io.BytesIO(raw.tobytes()) if req.type == LoadItemType.BYTE_IO else _layout.as_tensor(raw, it),
                              planner)

    def _read_into_target(self, req: ReadItem, copies: list[Where], reader: StepReader, it: Item, planner: LoadPlanner) -> bool:
        """Reads a whole stored tensor straight into DCP's target when the target is CPU memory
        of the same dtype and shape, in one piece: one copy, verified chunk by chunk in
        parallel (dcp.load's floor), instead of a view of the stored bytes and a copy_()."""
        if req.type == LoadItemType.BYTE_IO:
            return False
        target = planner.resolve_tensor(req).detach()
        if (target.device.type != "cpu" or not target.is_contiguous() or tuple(target.shape) != tuple(it.shape)
                or target.dtype != _dtypes.torch_dtype(it.dtype)):
            return False
        try:
            reader.read_into(it, target)
        except TiercelError:
            self._read_one(req, copies, planner)  # the next copy, or an error naming every copy
            return True
        planner.commit_tensor(req, target)
        return True

    def _read_one(self, req: ReadItem, copies: list[Where], planner: LoadPlanner) -> None:
        """Reads a request from the first copy that can be read (the nearest first)."""
        errors = []
        for where in copies:
            try:
                reader, it = self._locator().find(where)
                value = self._fetch(req, where, reader, it)
                break
            except TiercelError as e:
                errors.append(e)
        else:
            first = errors[0]
            more = "".join(f"; copy {i + 2}: {e}" for i, e in enumerate(errors[1:]))
            raise type(first)(f"{first}{more}")
        self._deliver(req, value, planner)

    def _deliver(self, req: ReadItem, value: io.BytesIO | torch.Tensor, planner: LoadPlanner) -> None:
        if isinstance(value, io.BytesIO):
            planner.load_bytes(req, value)
            return
        target = planner.resolve_tensor(req).detach()
        if target.shape != value.shape:
            raise InvalidArgumentError(f"step {self.step} item '{req.storage_index.fqn}': DCP's target has shape "
                                       f"{tuple(target.shape)}, the stored box {tuple(value.shape)}")
        target.copy_(value)
        planner.commit_tensor(req, target)

    def _fetch(self, req: ReadItem, where: Where, reader: StepReader, it: Item) -> io.BytesIO | torch.Tensor:
        if req.type == LoadItemType.BYTE_IO:
            return io.BytesIO(reader.read(it).tobytes())
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if len(offsets) != len(it.shape) or any(o + n > s for o, n, s in zip(offsets, lengths, it.shape)):
            raise InvalidArgumentError(f"step {self.step} rank {where.rank} item '{it.name}' of shape {it.shape}: "
                                       f"DCP asks for the box at {offsets} of size {lengths}, which is outside it")
        return _layout.read_box(reader, it, offsets, lengths)


def metadata_bytes(rank0: StepReader) -> bytes:
    """The pickled DCP Metadata in rank 0's part of a step (what Writer.finish stored)."""
    if PUT_METADATA not in rank0.names():
        raise NotFoundError(f"step {rank0.step}: rank 0 has no '{PUT_METADATA}' (it has: {', '.join(rank0.names())}); "
                            "was the step saved with tiercel.dcp.Writer?")
    data = rank0.get(PUT_METADATA)
    if not isinstance(data, bytes):
        raise IntegrityError(f"step {rank0.step}: '{PUT_METADATA}' holds {type(data).__name__}, not DCP metadata")
    return data


def unpickle_metadata(data: bytes, step: int) -> Metadata:
    metadata = pickle.loads(data)
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"step {step}: '{PUT_METADATA}' holds a {type(metadata).__name__}, not DCP metadata")
    return metadata

