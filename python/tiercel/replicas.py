"""Replica groups: ranks that hold identical copies of replicated puts (data-parallel
replicas), and the restore in which they read such puts from a slow tier once between them
and pass the bytes to each other (`[restore] replicated`, docs/restore.md).

The bytes move in the core (tiercel-core's store/broadcast.rs over its relay); this module
only decides, with the other ranks, who takes part and in which mode.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .advertise import advertised_address
from .coordinator import agree_part, broadcast
from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .step import Reader
    from .store import Store

@dataclass
class Sharing:
    """What one Store keeps from one shared restore for the next (`Store._sharing`)."""

    #: Rank 0's relay secret and job name, agreed on at the first shared restore and kept:
    #: the relay is started once per store.
    relay: tuple[str, str] | None = None
    #: Bytes per second of one stream from the tier ("tier") and from another rank ("relay")
    #: in the last broadcast: what `auto_mode` decides on.
    rates: dict[str, float] = field(default_factory=dict)


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


def share_replicated(store: Store, reader: Reader | None) -> dict[str, Any] | None:
    """Before `reader` reads its puts: reads its replicated items with the rest of its replica
    group, if the policy says so and they come from a slow tier. Collective over all ranks
    (two collectives) unless `[restore] replicated = "all"`; a rank whose reader could not be
    opened passes None and only takes part in them. Returns the broadcast's
    statistics, or None when this rank reads on its own."""
    if not _shares(store):
        return None
    wants = reader is not None and _slow(store, reader) and any(
        it.replica_primary is not None for it in reader.manifest.items)
    step = reader.step if reader is not None else None
    group = store.replica_group[0]  # the group's name: its lowest rank
    plan = _meet(store, wants, step, f"group {group} step {step}", _group_plans, group)
    if reader is None or not wants or plan is None:
        return None
    members, first_auto = plan
    chosen = _chosen(store, first_auto)
    if len(members) < 2 or chosen == "all":
        return None
    stats: dict[str, Any] = reader._core.broadcast(members, chosen)
    _remember_rates(store, stats)
    return stats


def share_pieces(store: Store, step: int, wanted: dict[tuple[int, int], Reader]) -> dict[str, Any] | None:
    """Before a collective restore in which processes read the same saved pieces (a JAX job's
    data-parallel replicas each need the shards replica 0 saved): every piece that two or
    more processes read whole from a slow tier is read from it once between them and passed
    on over the relay. `wanted`: this process's whole-piece reads, (saved rank, item index) ->
    the reader of that rank. Collective over all processes (two collectives) unless
    `[restore] replicated = "all"`; returns the broadcast's statistics or None."""
    if not _shares(store):
        return None
    # Whether a reader's tier is slow, once per saved rank: many pieces share a reader.
    slow = {rank for rank, r in {key[0]: r for key, r in wanted.items()}.items() if _slow(store, r)}
    mine = sorted(key for key in wanted if key[0] in slow)
    plan = _meet(store, bool(mine), step, f"rank {store.rank}", _piece_plans, mine)
    if plan is None:
        return None
    first_auto, members, shared = plan
    chosen = _chosen(store, first_auto)
    if chosen == "all":
        return None
    items = [(wanted[key]._core, key[1], key[0], position, takers) for key, position, takers in shared]
    stats: dict[str, Any] = store._core.broadcast_items(items, members, chosen)
    _remember_rates(store, stats)
    return stats


# What a rank hands in to the meeting: (wants, host, relay address, step, its `auto`
# choice, *extra): its replica group's name for a replicated restore, its pieces for
# `share_pieces`.
Meeting = tuple[Any, ...]


def _group_plans(everyone: list[Meeting]) -> dict[str, tuple[list[tuple[int, str, str]], str]]:
    """Per replica group and step, the members that read together ((rank, host, relay
    address), by rank) and the first one's `auto` choice: each rank receives its group's,
    O(its group) bytes however many groups the job has."""
    plans: dict[str, tuple[list[tuple[int, str, str]], str]] = {}
    for r, (wants, host, addr, step, auto, group) in enumerate(everyone):
        if wants:
            plans.setdefault(f"group {group} step {step}", ([], auto))[0].append((r, host, addr))
    return plans


def _piece_plans(everyone: list[Meeting]) -> dict[str, tuple[str, list[tuple[int, str, str]], list[Any]]]:
    """Per process that reads a piece another reads too: the first such process's `auto`
    choice, the processes it shares pieces with ((rank, host, relay address), by rank,
    itself among them) and its shared pieces ((saved rank, item), the piece's position among
    all shared pieces, its readers as indices into those processes)."""
    step = everyone[0][3] if everyone else None
    takers: dict[tuple[int, int], list[int]] = {}
    for p, (wants, _, _, at, _, keys) in enumerate(everyone):
        for key in keys if wants and at == step else ():
            takers.setdefault((key[0], key[1]), []).append(p)
    shared = sorted(key for key, ps in takers.items() if len(ps) > 1)
    ranks = sorted({p for key in shared for p in takers[key]})
    if not ranks:
        return {}
    first_auto = everyone[ranks[0]][4]
    mine: dict[int, list[tuple[tuple[int, int], int]]] = {}
    for position, key in enumerate(shared):
        for p in takers[key]:
            mine.setdefault(p, []).append((key, position))
    plans = {}
    for p, keys in mine.items():
        with_ = sorted({q for key, _ in keys for q in takers[key]})
        index = {q: i for i, q in enumerate(with_)}
        members = [(q, everyone[q][1], everyone[q][2]) for q in with_]
        plans[f"rank {p}"] = (first_auto, members, [(key, position, [index[q] for q in takers[key]]) for key, position in keys])
    return plans


def _shares(store: Store) -> bool:
    mode, _, _ = store._core.replicated_policy()
    return mode != "all" and store.world_size > 1 and store.coordinator is not None


def _slow(store: Store, reader: Reader) -> bool:
    """Whether `reader` reads from a tier that a broadcast is worth it for."""
    # Not for a tier in memory's layout (memory, peer): each rank reads its own host's memory.
    fast = {t["name"]: t["memory_layout"] for t in store.tiers()}
    return not fast.get(reader._core.tiers()[0], False)


def _meet(store: Store, wants: bool, step: int | None, part: str, combine: Callable[[list[Meeting]], Mapping[str, Any]],
          *extra: Any) -> Any:
    """The two collectives before a broadcast: rank 0's secret and job name for the relays
    (agreed on at the first restore and kept: the relay is started once per store), then
    one round in which every rank hands in (wants, host, relay address, step, its `auto`
    choice, *extra), one rank plans with `combine`, and this rank receives the plan named
    `part` (None: nothing to share); this rank's relay is started first if it `wants`."""
    mine = store._sharing.relay
    if mine is None and store.rank == 0:
        mine = (secrets.token_hex(32), store.run_id or secrets.token_hex(8))
    assert store.coordinator is not None
    secret, job = broadcast(store.coordinator, mine, 0)
    shared = store._sharing.relay = (secret, job)
    addr = None
    if wants:
        listen = os.environ.get("TIERCEL_RELAY_LISTEN", "0.0.0.0:0")
        bound = store._core.start_relay(listen, shared[1], store.host, shared[0].encode())
        addr = advertised_address(bound)
    return agree_part(store.coordinator, (wants, store.host, addr, step, auto_mode(store), *extra), part, combine)


def _chosen(store: Store, first_auto: str) -> str:
    """The mode: the policy's, or for `auto` what the first member measured (handed to all
    in the plan), so that every member picks alike."""
    mode, _, _ = store._core.replicated_policy()
    return str(first_auto) if mode == "auto" else mode


def auto_mode(store: Store) -> str:
    """`[restore] replicated = "auto"`: `striped` (the bucket serves one copy, spread over
    every host's link to it), unless this rank's last broadcast showed the network between
    ranks slower than the tier: then each rank reading on its own (`all`) is faster.

    A chunk received waited for its sender's read of it and then crossed the network, so its
    time is about a tier read plus a transfer: the relay's per-stream rate falls below half
    the tier's exactly when a transfer takes longer than a read."""
    rates = store._sharing.rates
    if rates.get("relay", float("inf")) < 0.5 * rates.get("tier", 0.0):
        return "all"
    return "striped"


def _remember_rates(store: Store, stats: dict[str, Any]) -> None:
    """Bytes per second of one stream from the tier and of one from another rank (each over
    the time spent in such transfers, summed over the threads)."""
    rates = {}
    if stats["bytes_read"] and stats["read_seconds"] > 0:
        rates["tier"] = stats["bytes_read"] / stats["read_seconds"]
    if stats["bytes_received"] and stats["receive_seconds"] > 0:
        rates["relay"] = stats["bytes_received"] / stats["receive_seconds"]
    store._sharing.rates = rates
