"""Puts tiercel in place of a framework's stock checkpoint backend, in every process of a
peer-suite run (suites/run.py puts this directory first on PYTHONPATH, so Python imports it
at start-up, in the pytest process and in every rank it spawns).

Active only with TIERCEL_PEER_SUITE=tiercel; with `stock` the suite runs on the stock backend
(with the one bridge between the pinned test files and the installed DeepSpeed that both
backends get, `_bridge_deepspeed`). Each substitution is the one the framework offers its users, made when the
framework's module has been imported (before the test module takes names from it):

- DeepSpeed: `deepspeed.initialize` returns engines with tiercel attached
  (`tiercel.deepspeed.attach(engine, policy)`, its checkpoint engine).
- Orbax: `StandardCheckpointHandler` (and the handler that `args.StandardSave` /
  `StandardRestore` select) is a handler that forwards to `tiercel.orbax.TiercelCheckpointHandler`
  with `tiercel.orbax.Save(item)` / `Restore(item)`.
- DCP: `FileSystemWriter(path)` / `FileSystemReader(path)` (also what `dcp.save(...,
  checkpoint_id=path)` picks) are `tiercel.dcp.Writer` / `Reader`.

Each test's checkpoints live in a memory tier of their own under $TIERCEL_PEER_SUITE_ROOT
(in /dev/shm; the runner removes it): one root per test and checkpoint location, the same
for every rank of the test, so a save and the later load (another engine, handler, writer or
process) meet there, and tests never see each other's steps.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import os
import sys
from typing import Any, Callable

_PATCHES: dict[str, Callable[[Any], None]] = {}


def _key(*parts: object) -> str:
    """A memory root for this test and location (PYTEST_CURRENT_TEST reaches spawned ranks
    through the environment; its phase suffix is dropped)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    digest = hashlib.blake2b(repr((test, *parts)).encode(), digest_size=8).hexdigest()
    return os.path.join(os.environ["TIERCEL_PEER_SUITE_ROOT"], digest)


def policy_for(*parts: object) -> dict[str, Any]:
    """A memory tier that keeps every step of the test (the stock backends keep every file
    until the test deletes it); small thread counts for a shared machine."""
    return {
        "tier": [{"name": "ram", "kind": "memory", "root": _key(*parts), "keep": 1000}],
        "store": {"threads": 2, "io_threads": 2},
    }


# -- DeepSpeed -----------------------------------------------------------------------------------


def _bridge_deepspeed(deepspeed: Any) -> None:
    """For both backends alike: the pinned test files compare the saved and the loaded
    engine's `sparse_tensor_module_names`, an attribute DeepSpeed 0.19.8 no longer has; an
    engine without one has no sparse-gradient modules, so the comparison is of two empty sets."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = frozenset()


def _patch_deepspeed(deepspeed: Any) -> None:
    _bridge_deepspeed(deepspeed)
    import tiercel.deepspeed

    stock, stock_init_distributed = deepspeed.initialize, deepspeed.init_distributed
    # DeepSpeed's test ranks are forked from a server that keeps the first test's environment
    # (PYTEST_CURRENT_TEST is stale there): the file store its launcher creates for each test's
    # process group tells the tests apart.
    job: dict[str, Any] = {}

    def init_distributed(*args: Any, **kwargs: Any) -> Any:
        job["init_method"] = kwargs.get("init_method")
        return stock_init_distributed(*args, **kwargs)

    def initialize(*args: Any, **kwargs: Any) -> Any:
        out = stock(*args, **kwargs)
        tiercel.deepspeed.attach(out[0], policy_for("deepspeed", job.get("init_method"), os.environ.get("MASTER_PORT")))
        return out

    deepspeed.initialize, deepspeed.init_distributed = initialize, init_distributed


# -- Orbax ------------------------------------------------------------------------------------------


def _patch_orbax(ocp: Any) -> None:
    import re

    from etils import epath
    from orbax.checkpoint import checkpoint_args
    from orbax.checkpoint._src.handlers import standard_checkpoint_handler as std

    import tiercel.orbax

    step_dir = re.compile(r"^(?:.*_)?(\d+)(?:\.orbax-checkpoint-tmp.*)?$")

    class TiercelStandardCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
        """StandardCheckpointHandler's calls, answered by TiercelCheckpointHandler: one per
        checkpoint location (a CheckpointManager's root, or the directory a handler is given
        alone, saved as step 0)."""

        def __init__(self, *_args: Any, **_kwargs: Any) -> None:
            self._by_root: dict[str, Any] = {}

        def _target(self, directory: Any) -> tuple[Any, int | None]:
            directory = epath.Path(directory)
            m = step_dir.match(directory.parent.name)
            root, step = (directory.parent.parent, None) if m else (directory, 0)
            key = str(root)
            if key not in self._by_root:
                self._by_root[key] = tiercel.orbax.TiercelCheckpointHandler(policy_for("orbax", key))
            return self._by_root[key], step

        @staticmethod
        def _save(args: Any, step: int | None) -> Any:
            return tiercel.orbax.Save(args.item, step=step, save_args=getattr(args, "save_args", None),
                                      custom_metadata=getattr(args, "custom_metadata", None))

        async def async_save(self, directory: Any, args: Any = None) -> Any:
            handler, step = self._target(directory)
            return await handler.async_save(directory, args=self._save(args, step))

        def save(self, directory: Any, args: Any = None) -> None:
            handler, step = self._target(directory)
            handler.save(directory, args=self._save(args, step))

        def restore(self, directory: Any, args: Any = None) -> Any:
            handler, step = self._target(directory)
            return handler.restore(directory, args=tiercel.orbax.Restore(
                getattr(args, "item", None), step=step, strict=getattr(args, "strict", True),
                support_layout=getattr(args, "support_layout", False),
                fallback_sharding=getattr(args, "fallback_sharding", None)))

        def metadata(self, directory: Any) -> Any:
            handler, _ = self._target(directory)
            return handler.metadata(directory)

        def finalize(self, directory: Any) -> None:
            handler, _ = self._target(directory)
            handler.finalize(directory)

        def close(self) -> None:
            for handler in self._by_root.values():
                handler.close()
            self._by_root.clear()

    TiercelStandardCheckpointHandler.__name__ = "StandardCheckpointHandler"
    std.StandardCheckpointHandler = TiercelStandardCheckpointHandler
    ocp.handlers.StandardCheckpointHandler = TiercelStandardCheckpointHandler
    if hasattr(ocp, "StandardCheckpointHandler"):
        ocp.StandardCheckpointHandler = TiercelStandardCheckpointHandler
    checkpoint_args.register_with_handler(TiercelStandardCheckpointHandler, for_save=True)(std.StandardSaveArgs)
    checkpoint_args.register_with_handler(TiercelStandardCheckpointHandler, for_restore=True)(std.StandardRestoreArgs)


# -- DCP --------------------------------------------------------------------------------------------


def _patch_dcp(dcp: Any) -> None:
    from torch.distributed.checkpoint import _storage_utils, filesystem

    import tiercel.dcp

    saves: dict[str, int] = {}  # per location: each writer saves the next step (ranks agree)

    def is_path(checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and not str(checkpoint_id).isdigit()

    class Writer(tiercel.dcp.Writer):
        def __init__(self, path: Any, *_args: Any, **_kwargs: Any) -> None:
            key = os.fspath(path)
            saves[key] = saves.get(key, 0) + 1
            super().__init__(policy_for("dcp", key), step=saves[key])

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(None if is_path(checkpoint_id) else checkpoint_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return is_path(checkpoint_id)

    class Reader(tiercel.dcp.Reader):
        def __init__(self, path: Any, *_args: Any, **_kwargs: Any) -> None:
            super().__init__(policy_for("dcp", os.fspath(path)))

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(None if is_path(checkpoint_id) else checkpoint_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return is_path(checkpoint_id)

    Writer.__name__, Reader.__name__ = "FileSystemWriter", "FileSystemReader"
    for module in (dcp, filesystem, _storage_utils):
        module.FileSystemWriter, module.FileSystemReader = Writer, Reader


# -- the import hook ----------------------------------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module has executed (before any importer sees it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, _PATCHES.pop(name)
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("TIERCEL_PEER_SUITE") == "tiercel":
    _PATCHES.update({
        "deepspeed": _patch_deepspeed,
        "orbax.checkpoint": _patch_orbax,
        "torch.distributed.checkpoint": _patch_dcp,
    })  # fmt: skip
    sys.meta_path.insert(0, _AfterImport())
elif os.environ.get("TIERCEL_PEER_SUITE") == "stock":
    _PATCHES["deepspeed"] = _bridge_deepspeed
    sys.meta_path.insert(0, _AfterImport())
