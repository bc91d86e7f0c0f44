"""TiercelCheckpointHandler: an Orbax AsyncCheckpointHandler that keeps the bytes of a pytree
in tiercel's tiers, and its Save / Restore CheckpointArgs.

Orbax keeps its step directories; for each step the item's directory holds only a small
marker (`tiercel.json`) that process 0 writes once the memory tier has the step. The arrays
themselves are in the tiers of the handler's policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from ..errors import InvalidArgumentError, NotFoundError, TiercelError, TierUnavailableError
from ..metrics import record
from ..step import RestoreInfo, SaveHandle
from ..store import PolicyLike, Store
from . import _steps
from ._contract import OrbaxValueError, default_target, metadata_tree, restore_target, with_formats
from ._layout import FORMAT, VERSION, is_empty_node, leaf_records
from ._restore import SavedStep, read_structure, restore_tree

#: The marker in each Orbax item directory of a step saved by this handler.
MARKER = "tiercel.json"
_TMP = ".orbax-checkpoint-tmp"
# Orbax step directory names: "12", "prefix_12", each with a temporary suffix while saving.
_STEP_NAME = re.compile(r"^(?:.*_)?(\d+)(?:\.orbax-checkpoint-tmp.*)?$")


def _item_of(directory: epath.Path) -> str:
    """The Orbax item name ("state") of an item directory, temporary or final."""
    return directory.name.split(_TMP, 1)[0]


def _step_of(directory: epath.Path) -> int:
    m = _STEP_NAME.match(directory.parent.name)
    if m is None:
        raise InvalidArgumentError(
            f"cannot tell the step from Orbax's directory {directory}: expected a step directory named like "
            "'12' or 'prefix_12'; pass the step explicitly: tiercel.orbax.Save(state, step=N) / Restore(..., step=N)"
        )
    return int(m.group(1))


def _read_marker(directory: epath.Path) -> dict[str, Any] | None:
    path = directory / MARKER
    try:
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"{path}: unreadable tiercel marker: {e}") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise InvalidArgumentError(f"{path} is not a tiercel.orbax marker")
    return marker


def wait_for_tier(handle: SaveHandle, tier: str, timeout: float) -> str:
    """Waits until this rank's part of the step is in `tier` ("committed", or "written" while
    other ranks of the host are still copying); raises if the tier failed or skipped it."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        state = handle.states().get(tier, "missing")
        if state in ("committed", "written"):
            return state
        if state.startswith(("failed", "skipped", "missing", "not scheduled")):
            raise TierUnavailableError(f"step {handle.step}: tier '{tier}' {state}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {handle.step}: tier '{tier}' still {state} after {timeout:.0f} s: {handle.states()}")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


async def _nothing() -> None:
    pass


def _settle_orbax_directories() -> None:
    """Waits until the directories Orbax started creating for this save exist, before a save
    that tiercel refuses raises. Orbax's async save starts creating the step's directories (its
    step metadata written through the manager's metadata executor) in threads of its own before
    it calls the handler, and only the save's commit futures wait for them: a refusal raised
    from `async_save` left them running. A `mngr.close()` right after (it shuts that executor
    down) then failed their metadata write, "cannot schedule new futures after shutdown", and
    the directory signal they never sent kept the item directories' thread waiting, for
    Orbax's 300 s, also at the process's exit. The wait is the one every save future makes
    (Orbax's awaitable-signals contract of this save)."""
    # The refusal is what the caller must see; a failure of Orbax's own work is logged by Orbax.
    with contextlib.suppress(Exception):
        ocp_future.CommitFutureAwaitingContractedSignals(_nothing(), name="tiercel_refused_save").result()


class TiercelCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves and restores a pytree of jax.Arrays (any sharding), numpy arrays, Python scalars
    and strings through a tiercel Store.

    `policy`: a tiercel policy (TOML path or dict; default $TIERCEL_POLICY or ./tiercel.toml),
    or pass an open `store=`. The Store is opened on first use, by every process (it joins
    the job through jax.distributed's client when that is initialized).

    `timeout`: seconds a save's future waits for the memory tier before it fails.
    """

    def __init__(self, policy: PolicyLike | None = None, *, store: Store | None = None, timeout: float = 600.0):
        self._policy = policy
        self._store = store
        self._key: _steps.Key | None = None if store is None else _steps.store_key(store)
        self._timeout = timeout
        #: tiercel's handle of the last save, once its background copy is done: `states()` per
        #: tier, `wait()` for all tiers (`blocking_seconds` is the background copy's time).
        self.last_save: SaveHandle | None = None
        #: Seconds the last `async_save` held its caller (Orbax's `mngr.save` adds its own).
        self.last_blocking_seconds = 0.0
        #: Where the last restore's bytes came from (tiers, bytes, seconds, warnings).
        self.last_restore: RestoreInfo | None = None

    @property
    def store(self) -> Store:
        """The Store of the handler's policy, shared by every handler of that policy in this
        process (tiercel.orbax._steps)."""
        if self._store is None:
            self._key, self._store = _steps.acquire(self._policy)
        return self._store

    # -- save -----------------------------------------------------------------------------------

    async def async_save(self, directory: epath.Path, args: Save | None = None) -> list[ocp_future.Future] | None:
        """Takes what the save needs from the pytree (host views or copies of this process's
        shards, see `leaf_records`: the only part that blocks) and returns a future that copies
        them into the memory tier as one put of the step's tiercel write and completes once
        every item of the Orbax step is in and the memory tier has the step
        (tiercel.orbax._steps); replication and persistence go on in tiercel's background
        after that."""
        return self._start_save(epath.Path(directory), args, alone=False)

    def save(self, directory: epath.Path, args: Save | None = None) -> None:
        """A save of this item alone (Orbax's Checkpointer calls it for a handler of its own)."""
        for f in self._start_save(epath.Path(directory), args, alone=True):
            f.result()

    def _start_save(self, directory: epath.Path, args: Save | None, alone: bool) -> list[ocp_future.Future]:
        try:
            return self._begin_save(directory, args, alone)
        except Exception:
            if not alone:
                _settle_orbax_directories()
            raise

    def _begin_save(self, directory: epath.Path, args: Save | None, alone: bool) -> list[ocp_future.Future]:
        t0 = time.perf_counter()
        if not isinstance(args, Save):
            raise InvalidArgumentError(f"TiercelCheckpointHandler saves tiercel.orbax.Save(state), got {type(args).__name__}")
        step = args.step if args.step is not None else _step_of(directory)
        put = _item_of(directory)
        # A step of this number that tiercel still holds (Orbax deleted it, or max_to_keep
        # dropped it, and training went back) is simply saved again: the core never commits
        # or reads the old save's ranks with the new one's (see docs/reliability.md).
        store = self.store
        assert self._key is not None
        try:
            value = leaf_records(args.item, store.rank, store.world_size, args.save_args, args.custom_metadata)
        except TypeError as e:
            raise OrbaxValueError(f"step {step} '{put}': {e}") from None
        write = _steps.begin(self._key, store, step, put)
        loop = None
        if not alone:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        if loop is not None:
            # Inside Orbax's gather of the items' saves: the other items join first.
            loop.call_soon(write.close_registration)
        else:
            write.close_registration()
        # Starting the future starts its thread: part of what the caller waits for.
        futures: list[ocp_future.Future] = [ocp_future.CommitFutureAwaitingContractedSignals(
            self._write(write, put, value, directory, store.rank == 0), name="tiercel_save")]
        self.last_blocking_seconds = time.perf_counter() - t0
        record(store, "orbax_blocking", self.last_blocking_seconds)  # store.metrics().timings
        return futures

    async def _write(self, write: _steps.StepWrite, put: str, value: dict[str, Any], directory: epath.Path,
                     primary: bool) -> None:
        """The background half of a save, on Orbax's commit thread (Orbax runs one save at a
        time and has created the directory): the copy into the memory tier, the commit once
        every item is in, then the marker."""
        write.put(put, value)
        del value  # the host views: the device buffers may be reused from here on
        handle = write.arrive(put, self._timeout)
        self.last_save = handle
        store = self.store
        memory = store.tiers()[0]["name"]
        wait_for_tier(handle, memory, self._timeout)
        if primary:
            marker = {
                "format": FORMAT,
                "version": VERSION,
                "step": write.step,
                "item": put,
                "world_size": store.world_size,
                "tiers": [t["name"] for t in store.tiers()],
            }
            (directory / MARKER).write_text(json.dumps(marker))

    # -- restore ----------------------------------------------------------------------------------

    def _locate(self, directory: epath.Path, step: int | None) -> tuple[int, str]:
        """(step, item) of an Orbax item directory: from its marker, else from its name."""
        directory = epath.Path(directory)
        marker = _read_marker(directory)
        if step is None:
            step = int(marker["step"]) if marker else _step_of(directory)
        return step, (marker["item"] if marker else _item_of(directory))

    def _open_step(self, directory: epath.Path, step: int | None) -> SavedStep:
        """Collective: every process of the job opens the step together."""
        step, put = self._locate(directory, step)
        try:
            return SavedStep(self.store, step, put, collective=True)
        except NotFoundError as e:
            raise NotFoundError(
                f"Orbax lists step {step} ({directory}) but tiercel cannot restore it: {e}. If a restart lost the RAM "
                "that held it, tiercel.orbax.sync(manager, handler) drops such steps from the manager"
            ) from None

    def restore(self, directory: epath.Path, args: Restore | None = None) -> Any:
        """The saved pytree in the structure and shardings of `args.item` (an abstract tree
        of jax.ShapeDtypeStruct, or concrete arrays; a ShapeDtypeStruct without a sharding
        takes the saved one, as in Orbax). Without one, as Orbax does: each
        jax.Array in the sharding it was saved with (an OrbaxValueError, "Topology mismatch
        detected", where this job's devices cannot hold it and no `fallback_sharding` is
        given), numpy arrays and values as saved, in nested dicts and lists."""
        args = args if args is not None else Restore()
        if not isinstance(args, Restore):
            raise InvalidArgumentError(f"TiercelCheckpointHandler restores tiercel.orbax.Restore(target), got {type(args).__name__}")
        t0 = time.perf_counter()
        saved = self._open_step(directory, args.step)
        multi = self.store.world_size > 1
        if args.item is None:
            tree = restore_tree(saved, None, multi_process=multi,
                                default=lambda leaf: default_target(saved, leaf, args.fallback_sharding))
        else:
            target = restore_target(saved, args.item, args.fallback_sharding)
            tree = restore_tree(saved, target, multi_process=multi, strict=args.strict, empty=is_empty_node)
            if args.support_layout:
                tree = with_formats(tree, args.item)
        self.last_restore = saved.info(time.perf_counter() - t0)
        return tree

    def metadata(self, directory: epath.Path) -> Any:
        """Orbax's metadata object (a TreeMetadata): the saved tree with an ArrayMetadata per
        array (shape, dtype, the saved ShardingMetadata), ScalarMetadata / StringMetadata per
        Python value, and `custom_metadata` as saved; reads one manifest."""
        step, put = self._locate(directory, None)
        leaves, custom = read_structure(self.store, step, put)
        return metadata_tree(leaves, custom, directory)

    def finalize(self, directory: epath.Path) -> None:
        """Nothing to do: tiercel committed the step before the futures completed, and Orbax
        renames its directory itself."""

    def close(self) -> None:
        """Lets go of the shared Store; the last handler of a policy to close closes it, which
        finishes tiercel's background work (persists, replication). A Store passed in is
        left open."""
        if self._store is not None and self._key is not None and self._key[0] != "store":
            _steps.release(self._key)
            self._store = None
            self._key = None

    # -- steps --------------------------------------------------------------------------------------

    def restorable(self, step: int, item: str) -> bool:
        """Whether the job can open every saved rank's part of `item` at `step` on some tier
        (collective: the same answer on every process)."""
        try:
            SavedStep(self.store, step, item, collective=True)
            return True
        except TiercelError:
            return False


@ocp.args.register_with_handler(TiercelCheckpointHandler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
    """Save `item` (a pytree) through tiercel, with the options of Orbax's StandardSave:
    `save_args`, a tree of `ocp.SaveArgs` (or None) like `item`, whose `dtype` casts a leaf
    before it is saved (`aggregate` is refused; the TensorStore chunking options have no
    meaning here and are ignored); `custom_metadata`, a JSON-like value that `metadata()`
    returns. `step` only when Orbax's directory names are not the standard ones
    (CheckpointManager's are)."""

    item: Any
    step: int | None = None
    save_args: Any = None
    custom_metadata: Any = None


@ocp.args.register_with_handler(TiercelCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
    """Restore into `item`: an abstract pytree (jax.ShapeDtypeStruct with shardings, e.g.
    `jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "shape") else x, state)`,
    which keeps strings and other values as they are) or concrete arrays; a leaf the target
    leaves out (None, optax.MaskedNode()) is not read. None: the saved tree in its saved
    shardings (see TiercelCheckpointHandler.restore).

    As Orbax's StandardRestore: `strict=False` lets an array target of another shape (same
    number of dimensions) take the saved array cut to its shape or padded with zeros;
    `support_layout=True` gives each array the layout (`jax.Array.format`) of its target;
    `fallback_sharding` is used, without a target, for arrays whose saved sharding this
    job's devices cannot hold."""

    item: Any = None
    step: int | None = None
    strict: bool = True
    support_layout: bool = False
    fallback_sharding: Any = None


def sync(manager: Any, handler: TiercelCheckpointHandler, item: str | None = None) -> list[int]:
    """Drops from an Orbax CheckpointManager the steps that tiercel can no longer restore
    (their bytes were only in RAM that a restart lost, or retention removed them), so that
    `all_steps()` and `latest_step()` name restorable steps. Collective: every process calls
    it, after creating the manager. Returns the dropped steps."""
    dropped = []
    for step in list(manager.all_steps()):
        names = [item] if item else _tiercel_items(manager, step)
        if not all([handler.restorable(step, name) for name in names]):
            manager.delete(step)
            dropped.append(step)
    return dropped


def _tiercel_items(manager: Any, step: int) -> list[str]:
    """The items of a step in the manager's directory that this adapter saved (a marker)."""
    step_dir = epath.Path(manager.directory) / str(step)
    if not step_dir.exists():  # a step_name_format of the user's own: ask the manager
        step_dir = epath.Path(manager._get_read_step_directory(step, manager.directory))
    return sorted(p.name for p in step_dir.iterdir() if (p / MARKER).exists())
