"""Coordinators: how the ranks of a job agree, borrowed from the engine the job already runs.

tiercel never runs a membership service of its own. A restore asks every rank which steps it
can restore and takes the newest step all of them can; that takes one all-gather.
"""

from __future__ import annotations

import base64
import os
import pickle
import sys
from typing import Any, Protocol


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, indexed by rank. Collective: every rank must call it."""
        ...


class LocalCoordinator:
    """A job of one process."""

    rank = 0
    world_size = 1

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


class TorchCoordinator:
    """torch.distributed's default process group (gloo or NCCL)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value)
        return out

    def all_gather_flags(self, flag: bool) -> list[bool]:
        """Every rank's `flag`: on a gloo group one all-gather of one byte per rank, where
        all_gather_object pickles and makes two (the sizes, then the bytes). Other backends
        (NCCL takes device tensors only) go through all_gather."""
        if "gloo" not in str(self._dist.get_backend()):
            return [bool(v) for v in self.all_gather(flag)]
        import torch

        mine = torch.tensor([int(flag)], dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._dist.all_gather(out, mine)
        return [bool(t.item()) for t in out]


def all_gather_flags(coordinator: Coordinator, flag: bool) -> list[bool]:
    """Every rank's `flag`, by the cheapest way the coordinator has. Collective."""
    fast = getattr(coordinator, "all_gather_flags", None)
    return fast(flag) if fast is not None else [bool(v) for v in coordinator.all_gather(flag)]


# Rounds of all-gathers over a key-value store, counted per process rather than per
# coordinator: a job that opens a second Store (after a restart of its loop, say) must not
# collide with the keys of the first. Every rank opens its stores in the same order, so the
# counts agree.
_rounds: dict[str, int] = {}


def _next_round(prefix: str) -> str:
    _rounds[prefix] = _rounds.get(prefix, 0) + 1
    return f"{prefix}/{_rounds[prefix]}"


class KVStoreCoordinator:
    """Any torch.distributed Store (TCPStore, FileStore): set/get by key, usable without a
    process group, as tools and tests do. `get` blocks until the key exists.

    Nothing exchanged stays in the store: the last rank to read a round deletes its keys, so
    the peer secret handed out in one (when the policy sets none) is not left where anyone
    who reaches the TCPStore could read it."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "tiercel"):
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self._prefix = prefix

    def all_gather(self, value: Any) -> list[Any]:
        key = _next_round(self._prefix)
        self._store.set(f"{key}/{self.rank}", pickle.dumps(value))
        out = [pickle.loads(self._store.get(f"{key}/{r}")) for r in range(self.world_size)]
        # A counter, not a second all-gather: only the last reader knows every rank has read.
        if self._store.add(f"{key}/read", 1) == self.world_size:
            for k in [f"{key}/{r}" for r in range(self.world_size)] + [f"{key}/read"]:
                self._store.delete_key(k)
        return out


class JaxCoordinator:
    """JAX's distributed client (after `jax.distributed.initialize`): its key-value store."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        import jax
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized; call jax.distributed.initialize first")
        self._client = client
        self.rank = jax.process_index()
        self.world_size = jax.process_count()
        self._timeout_ms = int(timeout_s * 1000)

    def all_gather(self, value: Any) -> list[Any]:
        key = _next_round("tiercel-jax")
        self._client.key_value_set(f"{key}/{self.rank}", base64.b64encode(pickle.dumps(value)).decode())
        out = [
            pickle.loads(base64.b64decode(self._client.blocking_key_value_get(f"{key}/{r}", self._timeout_ms)))
            for r in range(self.world_size)
        ]
        # As KVStoreCoordinator: nothing exchanged (the peer secret) stays in the store. The
        # client has no counter: a barrier, then each rank deletes its own key.
        self._client.wait_at_barrier(f"{key}/read", self._timeout_ms)
        self._client.key_value_delete(f"{key}/{self.rank}")
        return out


def _jax_initialized() -> bool:
    jax_dist = sys.modules.get("jax._src.distributed")
    return jax_dist is not None and getattr(jax_dist.global_state, "client", None) is not None


def default_coordinator(rank: int | None, world_size: int | None) -> tuple[Coordinator | None, int, int]:
    """The coordinator of the engine in use, and this process's rank and world size.

    Order: torch.distributed if initialized; JAX's distributed client if initialized; else
    RANK/WORLD_SIZE from the environment (as
    torchrun sets them) with no coordinator (restores must then name their step); else a
    single process.
    """
    torch_dist = sys.modules.get("torch.distributed")  # only if the job already uses torch
    if torch_dist is not None:
        dist = torch_dist
        if dist.is_available() and dist.is_initialized():
            c = TorchCoordinator()
            if rank is not None and rank != c.rank or world_size is not None and world_size != c.world_size:
                raise ValueError(
                    f"rank={rank}, world_size={world_size} disagree with torch.distributed "
                    f"(rank {c.rank} of {c.world_size})"
                )
            return c, c.rank, c.world_size
    if _jax_initialized():
        j = JaxCoordinator()
        return j, j.rank, j.world_size
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return LocalCoordinator(), rank, world_size
    return None, rank, world_size
