"""Replica groups: ranks that hold identical copies of replicated puts (data-parallel
replicas), and the restore in which they read such puts from a slow tier once between them
and pass the bytes to each other (`[restore] replicated`, docs/restore.md).

The bytes move in the core (tiercel-core's store/broadcast.rs over its relay); this module
only decides, with the other ranks, who takes part and in which mode.
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING, Any, Sequence

from .advertise import advertised_address
from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .step import Reader
    from .store import Store

#: Tier kinds a broadcast is not worth it for: each rank reads its own host's memory.
FAST_KINDS = ("memory", "peer")


def replica_group_of(spec: Sequence[int] | Sequence[Sequence[int]] | None, rank: int, world_size: int) -> list[int]:
    """This rank's replica group, sorted: `spec` is None (all ranks), this rank's group (a
    list of ranks) or every group (a list of lists, one of which holds this rank)."""
    if spec is None:
        return list(range(world_size))
    groups: list[Any] = list(spec)
    if groups and all(isinstance(g, (list, tuple, range)) for g in groups):
        mine = [g for g in groups if rank in g]
        if len(mine) != 1:
            raise InvalidArgumentError(
                f"replica_group: rank {rank} must be in exactly one of the groups {groups}, is in {len(mine)}")
        groups = list(mine[0])
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in groups):
        raise InvalidArgumentError(f"replica_group must be a list of ranks or a list of such lists, got {spec!r}")
    bad = [r for r in groups if not 0 <= r < world_size]
    if bad or rank not in groups or len(set(groups)) != len(groups):
        raise InvalidArgumentError(
            f"replica_group {groups} of rank {rank}: it must hold this rank, each rank once, all in 0..{world_size - 1}")
    return sorted(groups)


def share_replicated(store: Store, reader: Reader) -> dict[str, Any] | None:
    """Before `reader` reads its puts: reads its replicated items with the rest of its replica
    group, if the policy says so and they come from a slow tier. Collective over all ranks
    (two all-gathers) unless `[restore] replicated = "all"`. Returns the broadcast's
    statistics, or None when this rank reads on its own."""
    mode, _, _ = store._core.replicated_policy()
    if mode == "all" or store.world_size == 1 or store.coordinator is None:
        return None
    kinds = {t["name"]: t["kind"] for t in store.tiers()}
    first = reader._core.tiers()[0]
    wants = kinds.get(first) not in FAST_KINDS and any(it.replica_primary is not None for it in reader.manifest.items)
    # Rank 0's secret and job name for this restore's relays (the job's own channel carries them).
    # Agreed on at the first restore and kept: the relay is started once per store.
    mine: tuple[str, str] | None = getattr(store, "_relay_shared", None)
    if mine is None and store.rank == 0:
        mine = (secrets.token_hex(32), store.run_id or secrets.token_hex(8))
    shared = store.coordinator.all_gather(mine)[0]
    setattr(store, "_relay_shared", shared)
    addr = None
    if wants:
        listen = os.environ.get("TIERCEL_RELAY_LISTEN", "0.0.0.0:0")
        bound = store._core.start_relay(listen, shared[1], store.host, shared[0].encode())
        addr = advertised_address(bound)
    everyone = store.coordinator.all_gather((wants, store.host, addr, reader.step))
    members = [(r, everyone[r][1], everyone[r][2]) for r in store.replica_group
               if everyone[r][0] and everyone[r][3] == reader.step]
    if not wants or len(members) < 2:
        return None
    chosen = "striped" if mode == "auto" else mode
    stats: dict[str, Any] = reader._core.broadcast(members, chosen)
    return stats
