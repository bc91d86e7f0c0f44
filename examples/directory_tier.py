"""A tier written in Python: a directory, with nothing but `os` calls. A worked example of the
blob protocol of docs/tiers.md; tiercel adds checksums, compression, commits, retention, gc,
scheduling and fallback on top.

    [[tier]]
    name = "archive"
    kind = "python"
    factory = "directory_tier:DirectoryTier"   # this file on PYTHONPATH
    every = 10
    [tier.options]
    root = "/mnt/archive"

`tests/test_python_tier.py` runs `tiercel.testing.check_tier` against it.
"""

from __future__ import annotations

import itertools
import os
import shutil

_seq = itertools.count()


class DirectoryTier:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.location = f"file://{self.root}"  # where messages say the tier is
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _write_temp(self, path: str, data: bytes) -> str:
        """The bytes in a temporary file beside `path`, on disk (fsync) before they count."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{next(_seq)}"
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        """Replaces `key` atomically: a reader sees the old object or the new one."""
        path = self._path(key)
        os.replace(self._write_temp(path, data), path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomic create: a hard link fails if the name exists, even between hosts on NFS."""
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset`; fewer only where the object ends. A missing key
        raises FileNotFoundError, which is what `open` does."""
        with open(self._path(key), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except IsADirectoryError:
            pass  # a "directory" is removed through what is under it (or delete_prefix)
        except FileNotFoundError:
            pass

    # Optional: without it the core deletes what `list` shows, one name at a time.
    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)
