"""Who is where in a job, learned once when a Store opens (`Store._join_cluster`): the ranks
of this process's host (its memory tier commits a step once they all have it), this launch's
token, the peer tier's job and secret, and the members of the hosts the peer tier's placement
pairs with this host (those holding its replicas and those whose replicas it holds).

One round through the coordinator (`coordinator.agree_part`): one rank combines every rank's
(host, peer address, secret, job, launch, and rank 0's answer to the checks at open) and each rank receives its own host's part, whose
size grows with the ranks of its host and of its m-1 (group) or 2(m-1) (ring) placement
neighbours, not with N. Rank 0 also receives every rank's host (`Store.hosts`: DCP's save
planning on rank 0 places items per host). Costs as formulas: docs/scale.md, "Coordination".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from . import errors
from .coordinator import Coordinator, agree_part

#: (host index, host name, [(rank, peer address)]): one host as the peer tier is told it.
HostMembers = tuple[int, str, list[tuple[int, str]]]

#: Why rank 0 refused to open the store (`Store.check_open` raised): the error's class name
#: in tiercel.errors, its message and its fields; plain values, whatever the coordinator's
#: transport.
Refusal = tuple[str, str, dict[str, Any]]

#: What a rank hands in: (host, peer address, secret, job, launch, refusal); rank 0's secret,
#: job, launch and refusal are the job's (None on the other ranks).
Entry = tuple[str, Optional[str], Optional[str], Optional[str], Optional[str], Optional[Refusal]]


class HostPart(NamedTuple):
    """What one host's ranks learn when the store opens (a tuple: it pickles without its
    field names)."""

    launch: str
    #: The peer tier's job id and secret (rank 0's; None without a peer tier or secret).
    job: str | None
    secret: str | None
    #: Hosts in the job, this host's index (hosts are numbered in the order of their first
    #: rank, as the placement numbers them) and its ranks, ascending.
    hosts: int
    host_index: int
    local: list[int]
    #: This host and its placement neighbours (the peer tier's `peer_neighbours`).
    members: list[HostMembers]
    #: Why the placement could not be made (the combining rank's error), if it could not.
    error: str | None = None
    #: Every rank's host, by rank: on rank 0 only.
    every_host: list[str] | None = None
    #: Why the store may not open (rank 0's check of what the tiers hold): every rank raises it.
    refused: Refusal | None = None


#: The part rank 0 asks for: its host's, and every rank's host.
RANK0 = "rank 0"


def part_name(rank: int, host: str) -> str:
    return RANK0 if rank == 0 else f"host {host}"


def host_parts(everyone: list[Entry], neighbours: Callable[[int], list[list[int]] | None] | None) -> dict[str, HostPart]:
    """The combine of the round: one part per host, and rank 0's. `neighbours(hosts)`: the
    hosts each host must know (None: the peer tier runs degraded; the function None: no
    peer tier)."""
    names: list[str] = []
    ranks_on: dict[str, list[int]] = {}
    for rank, (host, *_rest) in enumerate(everyone):
        if host not in ranks_on:
            names.append(host)
            ranks_on[host] = []
        ranks_on[host].append(rank)
    _, _, secret, job, launch, refused = everyone[0]
    assert launch is not None  # rank 0 always makes one
    error = None
    around: list[list[int]] | None = None
    if neighbours is not None:
        try:
            around = neighbours(len(names))
        except Exception as e:  # noqa: BLE001 -- every rank raises it, as its own connect would
            more = ", ..." if len(names) > 16 else ""
            error = f"{e} (hosts: {', '.join(names[:16])}{more})"

    def members(i: int) -> HostMembers:
        # (An address is None only without a peer tier, where nobody connects to it.)
        return (i, names[i], [(r, everyone[r][1] or "") for r in ranks_on[names[i]]])

    parts: dict[str, HostPart] = {}
    for i, host in enumerate(names):
        known = sorted({i, *(around[i] if around is not None else [])})
        parts[f"host {host}"] = HostPart(launch, job, secret, len(names), i, ranks_on[host],
                                         [members(k) for k in known], error, refused=refused)
    first = parts[f"host {everyone[0][0]}"]
    parts[RANK0] = first._replace(every_host=[e[0] for e in everyone])
    return parts


def refusal(e: Exception) -> Refusal:
    """What rank 0 hands the other ranks of an error that refuses the open."""
    if isinstance(e, errors.TiercelError):
        return (type(e).__name__, e.message, e.fields())
    return ("TiercelError", f"rank 0 could not check the tiers at open: {type(e).__name__}: {e}", {})


def refused_error(r: Refusal) -> errors.TiercelError:
    """The error of `refusal`, as rank 0 raised it."""
    name, message, fields = r
    cls = getattr(errors, name, errors.TiercelError)
    if not (isinstance(cls, type) and issubclass(cls, errors.TiercelError)):
        cls = errors.TiercelError
    return cls(message, **fields)


def learn(coordinator: Coordinator, rank: int, entry: Entry,
          neighbours: Callable[[int], list[list[int]] | None] | None) -> HostPart:
    """This rank's host's part. Collective: every rank calls it once as its store opens."""
    part: Any = agree_part(coordinator, entry, part_name(rank, entry[0]), lambda e: host_parts(e, neighbours))
    assert isinstance(part, HostPart), part
    return part
