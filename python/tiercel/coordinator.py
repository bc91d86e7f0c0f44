"""Coordinators: how the ranks of a job agree, borrowed from the engine the job already runs.

tiercel never runs a membership service of its own. A restore asks every rank which steps it
can restore and takes the newest step all of them can; that takes one all-gather.
"""

from __future__ import annotations

import os
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


def default_coordinator(rank: int | None, world_size: int | None) -> tuple[Coordinator | None, int, int]:
    """The coordinator of the engine in use, and this process's rank and world size.

    Order: torch.distributed if initialized; else RANK/WORLD_SIZE from the environment (as
    torchrun sets them) with no coordinator (restores must then name their step); else a
    single process.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            c = TorchCoordinator()
            if rank is not None and rank != c.rank or world_size is not None and world_size != c.world_size:
                raise ValueError(
                    f"rank={rank}, world_size={world_size} disagree with torch.distributed "
                    f"(rank {c.rank} of {c.world_size})"
                )
            return c, c.rank, c.world_size
    except ImportError:
        pass
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return LocalCoordinator(), rank, world_size
    return None, rank, world_size
