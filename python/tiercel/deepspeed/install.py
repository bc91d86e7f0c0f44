"""`attach(engine, policy)`: puts a DeepSpeed engine's checkpoints into tiercel.

DeepSpeed has no plug-in point for a checkpoint engine, and does some of its checkpoint work
outside the engine; `attach` covers each piece on the engine instance:

- `engine.checkpoint_engine` becomes a TiercelCheckpointEngine, and
  `engine.save_non_zero_checkpoint` is recomputed for it as DeepSpeed computes it at start.
- `engine.load_checkpoint` first agrees, with every rank, on the step to load (the newest
  one every rank can restore from some tier, not what `latest` on a local disk says), fetches
  from their writers the files a rank cannot read itself, then runs DeepSpeed's own
  load_checkpoint with that step's tag. A checkpoint tiercel does not hold but DeepSpeed
  wrote on disk (before the job adopted tiercel) is loaded from disk, as DeepSpeed would.
  A directory of which neither holds a checkpoint (a new `save_dir`) loads nothing and
  returns (None, None), as DeepSpeed does without a `latest` file.
- `engine._get_all_ckpt_names` (DeepSpeed's glob over the tag folder, made before any file is
  loaded) answers from the step's layout while a load runs: the tag folder is not on disk.
- `engine.optimizer.step` first waits for the last save's snapshot: a save returns before
  the parameters and optimizer states are copied into shared memory, and the next update
  must not change them while they are (see snapshot.py).
- `engine._copy_recovery_script` (rank 0 copies zero_to_fp32.py into save_dir at every save)
  copies through a temporary name and a rename (exporter.copy_recovery_scripts): DeepSpeed's
  copy truncates the script first, and a rank killed right then left it empty.
- With `mirror=True` (or TIERCEL_DEEPSPEED_MIRROR=1), `engine.save_checkpoint` runs
  DeepSpeed's with save_latest=False, and the mirror writes DeepSpeed's own files and
  `latest` under save_dir in the background (see mirror.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import os
import secrets
import time
from typing import Any, Callable, Iterator

from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from .. import kit
from ..coordinator import agree, all_true, barrier, broadcast
from ..errors import InvalidArgumentError, TierUnavailableError
from ..store import PolicyLike, Store
from .engine import Loading, TiercelCheckpointEngine
from .exporter import copy_recovery_scripts
from .layout import norm_dir
from .mirror import Mirror, enabled
from .resolve import committed_steps, coordinator_of, may_hold_dir, not_found, resolve
from .snapshot import updated_by_step

log = logging.getLogger("tiercel.deepspeed")


def attach(engine: Any, policy: PolicyLike | None = None, *, mirror: bool | None = None, **store_kwargs: Any) -> Any:
    """Makes `engine.save_checkpoint` / `engine.load_checkpoint` go through tiercel; returns
    the engine. Call it on every rank, after `deepspeed.initialize`. `policy`: a TOML file or a
    dict (default $TIERCEL_POLICY, else ./tiercel.toml); `store_kwargs` go to tiercel.Store.
    `mirror`: also write DeepSpeed's own files (and `latest`) under save_dir, in the
    background, for tools that read them (default $TIERCEL_DEEPSPEED_MIRROR; mirror.py)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise InvalidArgumentError(f"attach() takes the engine deepspeed.initialize() returned, got {type(engine).__name__}")
    if isinstance(engine.checkpoint_engine, TiercelCheckpointEngine):
        raise InvalidArgumentError("this DeepSpeed engine already saves through tiercel (attach() was called before)")
    store = kit.acquire(policy, **store_kwargs)  # a bad policy raises here, before the engine is touched
    ce = TiercelCheckpointEngine(store, lambda: engine.global_steps, lambda: updated_by_step(engine))
    ce.gate.install(engine.optimizer)
    engine.checkpoint_engine = ce
    engine.save_non_zero_checkpoint = writes_model_states(engine, ce)
    engine.load_checkpoint = functools.update_wrapper(
        functools.partial(load_checkpoint, engine, engine.load_checkpoint), engine.load_checkpoint)
    engine._get_all_ckpt_names = functools.partial(_ckpt_names, engine, engine._get_all_ckpt_names)
    engine._copy_recovery_script = copy_recovery_scripts
    if enabled(mirror):
        # The save ids of this launch, the same on every rank: a staging folder of another
        # launch is a leftover.
        ce.mirror = Mirror(store, broadcast(coordinator_of(store), secrets.token_hex(4) if store.rank == 0 else None))
        engine.save_checkpoint = functools.update_wrapper(
            functools.partial(_save_checkpoint, ce, engine.save_checkpoint), engine.save_checkpoint)
    return engine


def _save_checkpoint(ce: TiercelCheckpointEngine, original: Callable[..., Any], save_dir: str, tag: Any = None,
                     client_state: Any = None, save_latest: bool = True, **kwargs: Any) -> Any:
    """DeepSpeed's save_checkpoint without its own write of `latest` (which would name the tag
    before the mirror wrote its folder); the mirror writes `latest` once the folder is whole."""
    ce.latest_requested = save_latest
    try:
        return original(save_dir, tag, {} if client_state is None else client_state, False, **kwargs)
    finally:
        ce.latest_requested = None


def writes_model_states(engine: Any, ce: Any) -> bool:
    """DeepSpeedEngine._configure_checkpointing's rule, asked of the new checkpoint engine."""
    from deepspeed.utils import groups

    dp_rank = groups._get_sequence_data_parallel_rank()
    rank = engine.local_rank if engine.use_node_local_storage() else dp_rank
    return bool(ce.is_data_parallel_writer(rank)
                or (engine.zero_optimization_partition_weights() and engine.is_first_weights_partition_group()))


def load_checkpoint(engine: Any, original: Callable[..., Any], load_dir: str, tag: str | None = None,
                    *args: Any, **kwargs: Any) -> tuple[str | None, dict | None]:
    """DeepSpeed's load_checkpoint, from the newest step every rank can restore (or `tag`'s)."""
    ce = engine.checkpoint_engine
    if not isinstance(ce, TiercelCheckpointEngine):
        return original(load_dir, tag, *args, **kwargs)  # the job replaced tiercel's engine since
    bound = inspect.signature(original).bind(load_dir, tag, *args, **kwargs)
    bound.apply_defaults()
    if engine.load_universal_checkpoint():
        raise InvalidArgumentError("DeepSpeed reads universal checkpoints from disk itself: `tiercel export` the step, "
                                   "convert it with ds_to_universal.py, and load that without tiercel")
    if (engine.zero_optimization_partition_weights() and not bound.arguments["load_optimizer_states"]
            and not engine.has_moe_layers):
        raise InvalidArgumentError("ZeRO-3 with load_optimizer_states=False makes DeepSpeed rebuild fp32 weights from "
                                   "files on disk: load with the optimizer states, or `tiercel export` the step and "
                                   "load that without tiercel")
    store = ce.store
    t0 = time.perf_counter()
    ce.settle()
    found, notes = resolve(store, load_dir, tag)
    if found is None:
        on_disk = _on_disk(engine, load_dir, tag)
        if all_true(coordinator_of(store), on_disk is not None):
            # A checkpoint DeepSpeed wrote without tiercel (before the job adopted it): read
            # by DeepSpeed's own engine, as it would have been.
            log.warning("tiercel holds no checkpoint of %s: DeepSpeed loads '%s' from disk", load_dir, on_disk)
            engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
            try:
                return original(*bound.args, **bound.kwargs)
            finally:
                engine.checkpoint_engine = ce
        if tag is None and all_true(coordinator_of(store), not may_hold_dir(store, load_dir)):
            # As stock DeepSpeed does where `load_dir` has no `latest` file: a fresh start.
            # Only where no rank sees a step that holds (or might hold) a checkpoint of
            # `load_dir`: one that some rank cannot restore is an error, never "nothing saved".
            held = "; ".join(notes[-3:]) or f"committed: {committed_steps(store)}"
            log.warning("tiercel holds no checkpoint of %s (tiers %s; %s) and DeepSpeed finds none on disk there: "
                        "nothing loaded, a fresh start", norm_dir(load_dir), [t["name"] for t in store.tiers()], held)
            return None, None
        raise not_found(store, load_dir, tag, notes)
    loading = Loading(store, found)
    ce.loading = loading
    try:
        model_files = _model_files(engine, loading, load_dir, found.save.tag)
        _fetch_unreadable(loading, model_files)
        with _placeholders(store, model_files):
            bound.arguments["tag"] = found.save.tag
            return original(*bound.args, **bound.kwargs)
    finally:
        ce.loading = None
        ce.last_load = loading.info(time.perf_counter() - t0)


def _on_disk(engine: Any, load_dir: str, tag: str | None) -> str | None:
    """The tag DeepSpeed itself would load from `load_dir` on disk (its `latest`, or `tag`)
    when that tag folder holds model states, else None."""
    if tag is None:
        try:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        except OSError:
            return None
    return tag if engine._get_all_ckpt_names(load_dir, tag) else None


def _ckpt_names(engine: Any, original: Callable[[str, str], list[str]], checkpoints_path: str, tag: str) -> list[str]:
    """DeepSpeed's glob of the model-states files in a tag folder, answered from the step."""
    loading = getattr(engine.checkpoint_engine, "loading", None)
    if loading is None:
        return original(checkpoints_path, tag)
    return _model_files(engine, loading, checkpoints_path, tag)


def _model_files(engine: Any, loading: Loading, checkpoints_path: str, tag: str) -> list[str]:
    # DeepSpeed's own pattern (mp_rank_*_model_states.pt, or this rank's zero_pp_rank_N_...).
    pattern = engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*",
                                    pp_placeholder="0" if engine.load_universal_checkpoint() else None)
    return loading.found.layout.glob(pattern)


PLACEHOLDER = (b"tiercel placeholder: DeepSpeed checks that this file exists before it loads it through its "
               b"checkpoint engine; the checkpoint itself is in tiercel (`tiercel export STEP DIR --format deepspeed` "
               b"writes it out). Removed when the load ends.\n")


@contextlib.contextmanager
def _placeholders(store: Store, paths: list[str]) -> Iterator[None]:
    """DeepSpeed asserts that the model-states file exists on disk before it asks the engine
    to load it; the tag folder is not on disk (and a host that lost its disk has no save
    directory at all). Placeholders stand in for the load, created only where nothing is,
    removed (with the folders made for them) once every rank is done."""
    files: list[str] = []
    dirs: list[str] = []
    try:
        for path in paths:
            missing = []
            d = os.path.dirname(path)
            while d and not os.path.isdir(d):
                missing.append(d)
                d = os.path.dirname(d)
            for d in reversed(missing):
                try:
                    os.mkdir(d)
                    dirs.append(d)
                except FileExistsError:
                    pass  # another rank of this host made it
            try:
                with open(path, "xb") as f:
                    f.write(PLACEHOLDER)
                files.append(path)
            except FileExistsError:
                pass  # a real file, or another rank's placeholder
        yield
        barrier(coordinator_of(store))  # no placeholder goes while another rank of this host may check it
        _remove(files, [])
        barrier(coordinator_of(store))  # ... nor a folder that another rank's placeholder is still in
    finally:
        _remove(files, dirs)


def _union(missing: list[list[tuple[int, str]]]) -> list[tuple[int, str]]:
    """Every rank's (owner, put) that it cannot read, once each, sorted: what is sent."""
    return sorted({m for ms in missing for m in ms})


def _remove(files: list[str], dirs: list[str]) -> None:
    for path in files:
        with contextlib.suppress(OSError):
            os.unlink(path)
    files.clear()
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            os.rmdir(d)  # only if empty


def _fetch_unreadable(loading: Loading, wanted: list[str]) -> None:
    """Every rank loads the model states that data-parallel rank 0 wrote. A rank that cannot
    read another rank's file from any tier (its host lost the RAM copies it could reach) gets
    it from that rank, which reads it from its own tiers and broadcasts it. Collective."""
    store = loading.store
    missing = []
    for path in wanted:
        hit = loading.found.layout.owner(path)
        if hit is None or hit[2] == store.rank:
            continue
        try:
            loading.reader(hit[2])
        except Exception as e:  # noqa: BLE001 - any failure to open the writer's manifest
            log.info("rank %d cannot read %s from rank %d's copies (%s): rank %d sends it", store.rank, path, hit[2], e, hit[2])
            missing.append((hit[2], hit[3]))
    plan: list[tuple[int, str]] = agree(coordinator_of(store), missing, _union)
    if not plan:
        return
    import torch
    import torch.distributed as dist

    for owner, put in plan:
        box: list[Any] = [None]
        if store.rank == owner:
            try:
                buf = io.BytesIO()
                torch.save(loading.read(owner, put), buf)
                box[0] = buf.getvalue()
            except Exception as e:  # noqa: BLE001 - sent to the ranks that wait for it
                box[0] = f"rank {owner} cannot read its '{put}' of step {loading.found.step}: {e}"
        dist.broadcast_object_list(box, src=owner)
        if isinstance(box[0], str):
            raise TierUnavailableError(box[0])
        if (owner, put) in missing:
            loading.fetched[(owner, put)] = box[0]
