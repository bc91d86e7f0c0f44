"""The adapter kit: what every framework adapter (DeepSpeed, Orbax, torch DCP) and every
exporter shares after the save, so that each adapter's own files keep only what is specific
to its framework.

- Owning a Store: `borrow` (a Store passed in, or one opened for the length of a call, as
  the CLI and the exporters do), and `acquire` / `release` / `close_all` (the one Store per
  policy and process that an adapter's objects share: opening a Store is collective).
- Agreeing on a step: `agree` (tiercel.newest's one routine, with the same-save check), as
  `Store.latest_step` does, with an adapter's own test of a candidate step (`accept`).
- Reading a step: `StepView` (step_view.py): the per-rank Readers of one step, opened once,
  all of one save; one merged `RestoreInfo`; a put's items by key through tiercel._tree.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .environment import launcher_job
from .newest import Agreement, Need, agree
from .step_view import StepView
from .store import PolicyLike, Store, _policy_path

__all__ = ["Agreement", "Need", "StepView", "acquire", "agree", "borrow", "close_all", "release", "shared_key"]


@contextmanager
def borrow(store: Store | PolicyLike) -> Iterator[Store]:
    """Yields `store` itself when it is an open Store (never closed here: its owner closes it),
    or a Store opened from the policy `store` names as a single process (rank 0 of 1, as the
    CLI and the exporters open one), closed on the way out."""
    if isinstance(store, Store):
        yield store
        return
    with Store(store, rank=0, world_size=1) as opened:
        yield opened


# -- the Stores adapters share ---------------------------------------------------------------

_lock = threading.Lock()
#: The shared Stores by key (policy, job, options), each with how many holders it has.
_shared: dict[tuple[Any, ...], list[Any]] = {}


def _job() -> tuple[int, int]:
    """This process's (rank, world size) as a new Store would see it: torch.distributed's
    when the job initialized it, else the launcher's (tiercel.environment). A job that
    re-creates its group with another size must not get a Store of the old one."""
    dist = sys.modules.get("torch.distributed")  # imported by the job if it uses it
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return launcher_job()


def _key(policy: PolicyLike, job: tuple[int, int], options: Mapping[str, Any]) -> tuple[Any, ...]:
    if isinstance(policy, Mapping):
        where: tuple[str, str] = ("dict", json.dumps(policy, sort_keys=True, default=str))
    else:
        where = ("path", os.path.realpath(os.fspath(policy)))
    # Options by value where they are plain, by identity otherwise (a coordinator object).
    opts = json.dumps({k: options[k] for k in sorted(options)}, default=lambda v: f"<{type(v).__name__} {id(v)}>")
    return (*where, *job, opts)


def acquire(policy: Store | PolicyLike | None, *, job: tuple[int, int] | None = None, **options: Any) -> Store:
    """The Store an adapter's object uses. An open Store passed in is used as it is (its
    owner closes it; `release` leaves it open). A policy (a TOML path, a dict, or None for
    $TIERCEL_POLICY / ./tiercel.toml) gets the one Store of this process for that policy,
    job and `options` (tiercel.Store's keywords), opened on first use and shared by every
    later `acquire` until closed: opening a Store is collective (the ranks learn each other's
    hosts), so every rank must make its first acquire of a policy at the same point.

    `job`: this process's (rank, world size) as the framework knows it (default:
    torch.distributed's, else the launcher's: tiercel.environment): another job in the same process gets
    its own Store. Each acquire of a policy is matched by at most one `release`."""
    if isinstance(policy, Store):
        return policy
    resolved = _policy_path(policy)
    key = _key(resolved, job or _job(), options)
    with _lock:
        entry = _shared.get(key)
        if entry is None or entry[0].closed:
            entry = _shared[key] = [Store(resolved, **options), 0]
        entry[1] += 1
        return entry[0]


def shared_key(store: Store) -> tuple[Any, ...] | None:
    """The key `acquire` shares `store` under (its policy, job and options): the same for
    the Store opened again after the last one closed, so an adapter may keep what it knows
    of a policy's steps across them. None for a Store that `acquire` did not open."""
    with _lock:
        return next((k for k, e in _shared.items() if e[0] is store), None)


def release(store: Store, timeout: float | None = None, *, before_close: Callable[[], None] | None = None) -> bool:
    """Lets go of a Store from `acquire`: the last holder of a shared Store closes it
    (waiting up to `timeout` for its background work: persists, replication), after
    `before_close()` (an adapter abandons what it left open in it). A Store that `acquire`
    did not open is left open. Returns whether this call closed it."""
    with _lock:
        key = next((k for k, e in _shared.items() if e[0] is store), None)
        if key is None:
            return False
        entry = _shared[key]
        entry[1] -= 1
        if entry[1] > 0:
            return False
        del _shared[key]
    if before_close is not None:
        before_close()
    store.close(timeout)
    return True


def close_all() -> None:
    """Closes every shared Store (waiting for their background work); the next `acquire`
    opens a new one. Run at exit."""
    with _lock:
        stores = [e[0] for e in _shared.values()]
        _shared.clear()
    for s in stores:
        s.close()


atexit.register(close_all)
