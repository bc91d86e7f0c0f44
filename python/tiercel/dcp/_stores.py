"""One tiercel Store per process and policy, shared by every Writer and Reader.

DCP makes a new storage writer or reader for each save and load (`Writer("tiercel.toml",
step=step)` in the training loop), but opening a Store is collective (one all-gather to learn
which ranks share a host and, with a peer tier, everyone's address) and starts background
threads. So a policy given as a path or a dict opens its Store once, on first use, and later
Writers and Readers of the same policy reuse it. A Store passed in is used as it is and never
closed here.

Every rank must make its first Writer or Reader of a policy at the same point (DCP users do:
the writer is built right before `dcp.save` on every rank). Cached stores are closed at exit,
which waits for their background work (persists, replication); `close()` does it earlier.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from ..store import PolicyLike, Store, _policy_path

_lock = threading.Lock()
_stores: dict[tuple[Any, ...], Store] = {}


def _policy_key(policy: PolicyLike) -> tuple[str, str]:
    if isinstance(policy, Mapping):
        return ("dict", json.dumps(policy, sort_keys=True, default=str))
    return ("path", os.path.realpath(os.fspath(policy)))


def _job() -> tuple[int, int]:
    """This process's (rank, world size) as a new Store would see it: a job that re-creates
    its process group with another size must not get a Store of the old one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def open_store(policy: PolicyLike | Store | None) -> Store:
    """The Store for `policy` (a Store, a TOML path, a dict, or None for $TIERCEL_POLICY /
    ./tiercel.toml): opened on first use in this process, reused afterwards."""
    if isinstance(policy, Store):
        return policy
    resolved = _policy_path(policy)
    key = (*_policy_key(resolved), *_job())
    with _lock:
        store = _stores.get(key)
        if store is None or store._closed:
            store = Store(resolved)
            _stores[key] = store
        return store


def close() -> None:
    """Closes every Store this module opened (waiting for their background work). The next
    Writer or Reader opens a new one."""
    with _lock:
        stores = list(_stores.values())
        _stores.clear()
    for s in stores:
        s.close()


atexit.register(close)
