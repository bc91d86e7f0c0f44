"""`TiercelCheckpointEngine`: DeepSpeed's checkpoint engine interface over a tiercel Store.

DeepSpeed drives a save as `create(info)`, `makedirs(...)`, `save(state_dict, path)` per
file, `commit(info)`, on every rank. Here `create` opens a writer for the tag's step, each
`save` is one put (named after the file), flattened then and there, and `commit` records
which files this rank wrote (the step's layout) and hands the puts to a snapshot thread that
copies the tensors into shared memory and commits (see snapshot.py: the optimizer's next
step waits for it); checksums, replication and persistence run in tiercel's background.

`load(path)` serves a file from the step the running `load_checkpoint` agreed on (see
tiercel.deepspeed.attach), reading another rank's put when that rank wrote the file.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from .. import kit
from ..errors import InvalidArgumentError, NotFoundError, TiercelError
from ..leaves import PickleWarning
from ..metrics import record
from ..step import Prepared, Reader, RestoreInfo, SaveHandle, Writer
from ..step_view import StepView
from ..store import Store
from .layout import LAYOUT_PUT, Layout, Save, norm_dir, step_for_tag
from .mirror import Mirror
from .resolve import Found, find_local
from .snapshot import Gate, keeps_reference

ENGINE_NAME = "TiercelCheckpointEngine"

#: How long a read of a step this process just saved waits for the other ranks' parts.
COMMIT_WAIT_S = 60.0

#: Steps whose layout this process remembers, to keep their files when a later save goes to
#: the same step (save_16bit_model, then save_checkpoint of that step).
_SESSION_STEPS = 2


@dataclass
class _OpenSave:
    """A save between `create` and `commit`."""

    step: int
    save: Save
    writer: Writer
    #: The step's earlier saves in this process, and this rank's files of them, read back
    #: before the writer replaced the step.
    before: Layout
    carried: dict[str, Any]
    #: Puts of `before` this rank could not read back (they leave the layout).
    lost: list[str]
    #: Which leaves the snapshot may copy later (the others are copied by `save`).
    keep: Callable[[Any], bool]
    #: Files this rank wrote: relative path -> put.
    files: dict[str, str] = field(default_factory=dict)
    #: The puts, flattened, for the snapshot to write.
    puts: list[Prepared] = field(default_factory=list)
    #: Bytes copied in the blocking part (tensors that the optimizer's step does not write).
    copied: int = 0


class Loading:
    """The checkpoint a `load_checkpoint` is reading: its step, layout and save, the step's
    view (readers per rank, opened once, all of the save the ranks agreed on), and files
    another rank sent (serialized) because this rank cannot read them."""

    def __init__(self, store: Store, found: Found):
        self.store = store
        self.found = found
        agreed = found.agreed
        self.view = (StepView(store, found.step, trust_pickles=True) if agreed is None
                     else StepView(store, found.step, save=agreed.save, trust_pickles=True))
        #: (rank, put) -> the file as torch.save wrote it, sent by its rank.
        self.fetched: dict[tuple[int, str], bytes] = {}

    def reader(self, rank: int) -> Reader:
        return self.view.reader(rank)

    def read(self, rank: int, put: str) -> Any:
        data = self.fetched.get((rank, put))
        if data is not None:
            import torch

            return torch.load(io.BytesIO(data), weights_only=False)
        return self.reader(rank).get(put)

    def info(self, seconds: float) -> RestoreInfo:
        """How the load went: items per tier over every rank's reader, and per rank whose
        files it sent ("rank 0")."""
        info = self.view.info(seconds)
        for rank, _ in self.fetched:
            info.tiers[f"rank {rank}"] = info.tiers.get(f"rank {rank}", 0) + 1
        return info


class TiercelCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine on a tiercel Store. Install it with
    `tiercel.deepspeed.attach(engine, policy)`, which also covers what DeepSpeed does around
    the engine (its glob of the tag folder, its file-exists check, `latest`)."""

    def __init__(self, store: Store, global_steps: Callable[[], int], updated_by_step: Callable[[], set[int]] = set):
        super().__init__(None)
        self.name = ENGINE_NAME
        self.store = store
        self._global_steps = global_steps
        self._updated_by_step = updated_by_step
        self._open: _OpenSave | None = None
        self._session: dict[int, Layout] = {}
        #: The optimizer's step waits here for the last save's snapshot (attach installs it);
        #: `gate.last_stall_seconds` / `gate.stall_seconds` say how long it waited.
        self.gate = Gate(lambda seconds: record(store, "deepspeed_stall", seconds))
        #: The handle of the last committed save, once its snapshot is done (`wait()` waits
        #: for the snapshot, then for the background tiers).
        self.last_handle: SaveHandle | None = None
        #: Bytes the last save copied while it blocked (tensors the optimizer does not write).
        self.last_copied_bytes = 0
        #: Set by load_checkpoint while DeepSpeed reads a checkpoint.
        self.loading: Loading | None = None
        #: How the last load_checkpoint went: step, seconds, items read per tier.
        self.last_load: RestoreInfo | None = None
        #: Writes DeepSpeed's own files under save_dir in the background (attach(mirror=True)).
        self.mirror: Mirror | None = None
        #: The `save_latest` the running save_checkpoint was called with, when attach hands
        #: `latest` to the mirror (DeepSpeed itself then runs with save_latest=False).
        self.latest_requested: bool | None = None

    # -- save -------------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        self._discard_open()
        self.finish_snapshot()  # one snapshot at a time; its step may be read back below
        step = step_for_tag(str(info.tag), self._global_steps())
        before = Layout.from_tree(self._session[step].to_tree(), "session") if step in self._session else Layout(step)
        carried, lost = self._read_back(before)
        latest = info.save_latest if self.latest_requested is None else self.latest_requested
        save = Save(norm_dir(info.save_dir), str(info.tag), bool(latest), int(self._global_steps()))
        keep = keeps_reference(self._updated_by_step())
        self._open = _OpenSave(step, save, self.store.writer(step), before, carried, lost, keep)

    def _read_back(self, before: Layout) -> tuple[dict[str, Any], list[str]]:
        """This rank's files of the step's earlier saves, read before the writer replaces the
        step (zero-copy views over shared memory where they are still there)."""
        mine = sorted(before.put_names(self.store.rank))
        if not mine:
            return {}, []
        carried: dict[str, Any] = {}
        try:
            reader = self._committed_reader(before.step)
            for put in mine:
                carried[put] = reader.get(put)
        except TiercelError as e:
            warnings.warn(f"step {before.step}: the files saved earlier to this step cannot be read back and are "
                          f"dropped from it: {e}", RuntimeWarning, stacklevel=3)
        return carried, [p for p in mine if p not in carried]

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # The tag folder lives in tiercel; the save directory itself is real (DeepSpeed's
        # rank 0 writes `latest` and zero_to_fp32.py into it, and save_16bit_model's file
        # goes through here with its own directory).
        o = self._open
        if o is not None and norm_dir(path) == norm_dir(os.path.join(o.save.dir, o.save.tag)):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        o = self._open
        if o is None:
            raise InvalidArgumentError(f"DeepSpeed saved {path} outside a checkpoint (no create() before it)")
        rel = os.path.relpath(norm_dir(path), o.save.dir)
        if rel.startswith(".."):
            raise InvalidArgumentError(f"DeepSpeed file {path} is outside the save directory {o.save.dir}")
        put = self._put_name(o, path, rel)
        try:
            prepared = _prepare(o.writer, put, state_dict)
            o.copied += prepared.take_copies(o.keep)
            o.puts.append(prepared)
        except BaseException as e:
            self._discard_open()
            if isinstance(e, TiercelError):
                raise type(e)(f"DeepSpeed file {path} (step {o.step}, tag '{o.save.tag}'): {e}") from None
            raise
        o.files[rel] = put

    def _put_name(self, o: _OpenSave, path: str, rel: str) -> str:
        """The file's name, unless this rank has another put of that name in the step. A file
        this rank wrote earlier at the same path keeps its put name: it is being rewritten."""
        me = self.store.rank
        prior = o.before.owner(path)
        if prior is not None and prior[0].dir == o.save.dir and prior[2] == me:
            return prior[3]
        taken = set(o.files.values()) | o.before.put_names(me) | {LAYOUT_PUT}
        put, n = os.path.basename(rel), 1
        while put in taken:
            n += 1
            put = f"{os.path.basename(rel)}#{n}"
        return put

    def commit(self, info: CheckpointCommitInfo) -> bool:
        o = self._open
        if o is None or o.save.tag != str(info.tag):
            raise InvalidArgumentError(f"DeepSpeed committed tag '{info.tag}', which no create() opened")
        self._open = None
        me = self.store.rank
        try:
            # This rank's layout: the step's earlier saves with the files of this rank they
            # keep, and this save's. No word with the other ranks: a load merges the layouts.
            layout = o.before
            for s in layout.saves:
                s.files = {rel: w for rel, w in s.files.items() if w[1] not in o.lost}
            o.save.files = {rel: [me, put] for rel, put in o.files.items()}
            layout.add(o.save)
            for s in layout.saves[:-1]:
                for _, put in s.files.values():  # an earlier save's file this save did not rewrite
                    o.puts.append(_prepare(o.writer, put, o.carried[put]))
            o.puts.append(_prepare(o.writer, LAYOUT_PUT, layout.to_tree()))
        except BaseException:
            o.writer.abort()
            raise
        self.last_copied_bytes = o.copied
        snapshot = self.gate.start(o.writer, o.puts)
        if self.mirror is not None:
            self.mirror.submit(snapshot, o.save, o.files)
        self._session[o.step] = layout
        for old in sorted(self._session)[:-_SESSION_STEPS]:
            del self._session[old]
        return True

    def _discard_open(self) -> None:
        """Drops a save that never committed (DeepSpeed raised between create and commit)."""
        o, self._open = self._open, None
        if o is not None:
            o.writer.abort()

    def _committed_reader(self, step: int) -> Reader:
        """A reader of a step this process saved, once the step is committed: the memory tier
        commits it in the background once every rank of this host has written its part (a
        few milliseconds after the save on the slowest of them), up to COMMIT_WAIT_S."""
        deadline = time.monotonic() + COMMIT_WAIT_S
        while True:
            try:
                return Reader(self.store, step, trust_pickles=True)
            except NotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def finish_snapshot(self) -> None:
        """Waits until the last save's tensors are in shared memory and its step committed
        there; raises if that failed."""
        s = self.gate.snapshot
        if s is None:
            return
        s.join()
        self.gate.snapshot = None
        if s.handle is not None:
            self.last_handle = s.handle
        s.raise_error()

    def settle(self) -> None:
        """Waits for this process's last save to be committed and final on every tier, so
        that a load that follows it in the same job sees it (and, writing the parameters,
        does not race its snapshot)."""
        self.finish_snapshot()
        if self.last_handle is not None:
            with contextlib.suppress(TiercelError):
                self.last_handle.wait()
                self._committed_reader(self.last_handle.step)
        if self.mirror is not None:
            self.mirror.wait()  # the load's placeholders never meet a tag folder being renamed

    def wait(self, timeout: float | None = None) -> dict[str, str]:
        """Waits until the last save is final on every tier (and, with the mirror, its
        DeepSpeed files are under save_dir); returns the tiers' states."""
        self.finish_snapshot()
        if self.last_handle is None:
            raise NotFoundError("no checkpoint was saved through this engine yet")
        states = self.last_handle.wait(timeout)
        if self.mirror is not None:
            self.mirror.wait(timeout)
        return states

    # -- load -------------------------------------------------------------------------------

    def load(self, path: str, map_location: Any = None) -> Any:
        loading = self.loading
        hit = loading.found.layout.owner(path) if loading is not None else None
        if loading is None or hit is None:
            # Outside load_checkpoint (or a file of another save): look the tag up as this
            # rank sees it.
            tag_dir = os.path.dirname(os.fspath(path))
            loading = Loading(self.store, find_local(self.store, os.path.basename(tag_dir), os.path.dirname(tag_dir)))
            hit = loading.found.layout.owner(path)
            if hit is None:
                raise NotFoundError(f"DeepSpeed file {path}: step {loading.found.step} has no such file "
                                    f"(it holds {loading.found.layout.describe()})")
        _, _, rank, put = hit
        return _to_location(loading.read(rank, put), map_location)

    def is_decoupled(self) -> bool:
        return False  # saves are asynchronous inside tiercel; DeepSpeed's commit order stays

    def preserves_storage_sharing(self) -> bool:
        # Tensors are stored by their own bytes (a view is not saved with its whole storage,
        # as torch.save would): DeepSpeed need not clone them first.
        return False

    def close(self) -> None:
        self._discard_open()
        try:
            self.finish_snapshot()
        finally:
            self.gate.close()
            if self.mirror is not None:
                self.mirror.close()  # its files are written from the store: before it closes
            kit.release(self.store)  # the last holder closes it (tiercel.kit.acquire)


def _prepare(writer: Writer, name: str, value: Any) -> Prepared:
    with warnings.catch_warnings():
        # DeepSpeed's states hold a few small objects (LossScaler, the config)
        # that only pickle keeps: expected, not worth a warning per save.
        warnings.simplefilter("ignore", PickleWarning)
        return writer.prepare(name, value, trust_pickles=True)  # its readers are Reader(trust_pickles=True)


def _to_location(value: Any, map_location: Any) -> Any:
    """Restored tensors are on the CPU. A device (or its name) as map_location moves them
    there; callables and mappings (DeepSpeed passes `lambda storage, loc: storage`) keep them
    on the CPU, where torch.load would put CPU-saved tensors too."""
    if map_location is None or callable(map_location) or isinstance(map_location, dict):
        return value
    import torch

    device = torch.device(map_location)
    if device.type == "cpu":
        return value

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, (dict, list)):
            out = copy.copy(v)  # keeps the class (OrderedDict, with its _metadata)
            for k in out.keys() if isinstance(out, dict) else range(len(out)):
                out[k] = move(out[k])
            return out
        if type(v) is tuple:
            return tuple(move(x) for x in v)
        return v

    return move(value)
