"""`kind = "fsspec"`: any fsspec filesystem as a tier (`url = "<protocol>://..."`, the
`[tier.options]` handed to the filesystem), through the Python-tier path. fsspec is an
optional dependency: `pip install tiercel[fsspec]`.

Atomicity, which the core relies on (docs/tiers.md):

- `put` and streamed writes go to `<key>.tmp-<pid>-<n>` and are moved into place, so a
  reader sees the old object or the new one, never a part. On a local directory (`file://`)
  the file is fsynced and renamed, as the `fs` tier does.
- `put_if_absent` (the commit record): on a local directory a hard link, atomic on POSIX
  filesystems and NFS; elsewhere the filesystem's exclusive-create mode (`open(path, "xb")`,
  e.g. a conditional PUT), serialized within the process. A filesystem that has no such mode
  falls back to "create unless it exists", which is not atomic between processes: tiercel
  warns once, and two ranks committing the same step at the same moment could both believe
  they wrote its commit record (both write the same step's record).
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import warnings
from typing import Any

_seq = itertools.count()
#: Serializes exclusive creates in this process (memory:// lives in the process).
_create_lock = threading.Lock()
#: Marks a writer's temporary file, as the core's fs tier does (`tier::gc::TEMP_MARKER`).
TEMP_MARKER = ".tmp-"


def _tmp(path: str) -> str:
    return f"{path}{TEMP_MARKER}{os.getpid()}-{next(_seq)}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class FsspecTier:
    """A tier on the filesystem fsspec opens for `url`, with `options` as its settings."""

    def __init__(self, url: str, **options: Any) -> None:
        try:
            import fsspec
        except ImportError as e:
            raise ImportError("kind \"fsspec\" needs fsspec: pip install tiercel[fsspec]") from e
        self.location = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")
        from fsspec.implementations.local import LocalFileSystem
        # A local directory is written with os calls: fsync, rename and link make it as
        # durable and atomic as the core's fs tier.
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            os.makedirs(self.root, exist_ok=True)
        self._no_exclusive_warned = False

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    # --- local directory ---------------------------------------------------------------

    def _write_local_tmp(self, path: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = _tmp(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    # --- the blob protocol -------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self.local:
            tmp = self._write_local_tmp(path, data)
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
            return
        tmp = _tmp(path)
        self.fs.pipe_file(tmp, bytes(data))
        self.fs.mv(tmp, path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if self.local:
            tmp = self._write_local_tmp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            _fsync_dir(os.path.dirname(path))
            return True
        with _create_lock:
            try:
                with self.fs.open(path, "xb") as f:
                    f.write(data)
                return True
            except FileExistsError:
                return False
            except (ValueError, NotImplementedError, TypeError):
                pass  # no exclusive-create mode: see the module's docstring
            if not self._no_exclusive_warned:
                self._no_exclusive_warned = True
                warnings.warn(f"fsspec tier {self.location}: the filesystem has no exclusive create; commit records "
                              "are created unless present, which is not atomic between processes", stacklevel=2)
            if self.fs.exists(path):
                return False
            self.put(key, data)
            return True

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)
        if self.local:
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.pread(fd, length, offset)
            finally:
                os.close(fd)
        return bytes(self.fs.cat_file(path, start=offset, end=offset + length))

    def get(self, key: str) -> bytes:
        path = self._path(key)
        if self.local:
            with open(path, "rb") as f:
                return f.read()
        return bytes(self.fs.cat_file(path))

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return os.path.exists(path) if self.local else bool(self.fs.exists(path))

    def list(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        try:
            if self.local:
                return sorted(os.listdir(path))
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        path = self._path(key)
        if self.local:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if self.local:
            if os.path.isdir(path):
                shutil.rmtree(path)
            return
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def writer(self, key: str) -> _Writer:
        return _Writer(self, self._path(key))


class _Writer:
    """A streamed object: written to a temporary file, moved into place on `commit`."""

    def __init__(self, tier: FsspecTier, path: str) -> None:
        self.tier, self.path, self.tmp = tier, path, _tmp(path)
        if tier.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.f: Any = open(self.tmp, "xb", buffering=0)
        else:
            self.f = tier.fs.open(self.tmp, "wb")

    def write(self, data: bytes) -> None:
        self.f.write(data)

    def commit(self) -> None:
        if self.tier.local:
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
            _fsync_dir(os.path.dirname(self.path))
        else:
            self.f.close()
            self.tier.fs.mv(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            if self.tier.local:
                try:
                    os.unlink(self.tmp)
                except FileNotFoundError:
                    pass
            else:
                try:
                    self.tier.fs.rm_file(self.tmp)
                except FileNotFoundError:
                    pass
