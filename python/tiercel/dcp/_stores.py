"""One tiercel Store per process and policy, shared by every Writer and Reader.

DCP makes a new storage writer or reader for each save and load (`Writer("tiercel.toml",
step=step)` in the training loop), but opening a Store is collective (one all-gather to learn
which ranks share a host and, with a peer tier, everyone's address) and starts background
threads. So a policy given as a path or a dict opens its Store once, on first use, and later
Writers and Readers of the same policy reuse it (tiercel.kit.acquire: the adapters' one way
to own a Store). A Store passed in is used as it is and never closed here.

Every rank must make its first Writer or Reader of a policy at the same point (DCP users do:
the writer is built right before `dcp.save` on every rank). Shared stores are closed at exit,
which waits for their background work (persists, replication); `close()` does it earlier.
"""

from __future__ import annotations

from .. import kit
from ..store import PolicyLike, Store


def open_store(policy: PolicyLike | Store | None) -> Store:
    """The Store for `policy` (a Store, a TOML path, a dict, or None for $TIERCEL_POLICY /
    ./tiercel.toml): opened on first use in this process, reused afterwards."""
    return kit.acquire(policy)


def close() -> None:
    """Closes every Store the adapters share in this process (waiting for their background
    work). The next Writer or Reader opens a new one."""
    kit.close_all()
