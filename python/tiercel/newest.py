"""Which step a restore without a step reads: the newest one that every rank can open at
this world size, all of one save of it, agreed by all ranks. `agree` is the one routine:
`Store.latest_step` and restores without a step use it, and so does every adapter
(tiercel.kit.agree: DeepSpeed's load_checkpoint, tiercel.dcp's Reader), with the adapter's
own test of a candidate step where it has one.

Collective when the job has several ranks: one reduction (`coordinator.agree`) of the steps
each rank has committed (in restore order, other jobs' steps left out) to the steps all of
them have, then one per candidate step, newest first (usually just the first), in which
every rank says which save of the step it would read, or that it cannot, reduced to one
verdict. One rank combines; every other rank sends its own value and receives that small
result, not every rank's (docs/scale.md). Every rank walks the same list in the same order
and decides on the same combined values, so all of them pick the same step, raise the same
error, or fall back together. A step whose ranks would read different saves of it (saved again, and
the new save not on every rank's tiers) is passed over (`one_save`), never mixed.

The world size is part of the rule. A plain restore reads each rank's own part, so a step
saved by another number of ranks cannot be continued from (a rank would get another rank's
part, or none): that is a `WorldSizeError` naming the steps and how to reshard, never "no
step yet" (a resumed job would start over). Readers that reshard (tiercel.dcp,
tiercel.orbax, `Store.restore(reshard=...)`) ask for `Need.reshard`: every saved rank's part,
whoever reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from . import coordinator as coordination
from .errors import InvalidArgumentError, TiercelError, WorldSizeError

if TYPE_CHECKING:
    from . import _core
    from .coordinator import Coordinator
    from .store import Store

T = TypeVar("T")

#: What a rank reports about a candidate step: the world size that saved it (None when no
#: commit record could be read) and the saves of it it would read (their generations), or
#: False when it cannot open a part it needs.
Report = tuple[int | None, list[str | None] | Literal[False]]


@dataclass(frozen=True)
class Need:
    """Which saved ranks' parts a process needs of a step: its own at this world size (the
    default), saved rank `rank`'s (`restore(rank=...)`), or, with `reshard`, its share of
    every saved rank's (process p of n checks saved ranks p, p + n, ...)."""

    rank: int | None = None
    reshard: bool = False


@dataclass
class Agreement:
    """What the ranks agreed on: the step (None when there is none), the save of it every
    rank reads (its generation: None for a step saved before generations were recorded, or
    no step), each newer step passed over and why, and the core's readers of the step that
    deciding opened, by saved rank: a restore reads through them, so it reads each commit
    record and manifest once."""

    step: int | None
    save: str | None = None
    skipped: list[str] = field(default_factory=list)
    readers: dict[int, _core.StepReader] = field(default_factory=dict)


def agree(store: Store, need: Need, *, below: int | None = None, only: Callable[[int], bool] | None = None,
          accept: Callable[[int], str | None] | None = None) -> Agreement:
    """The one step-agreement routine (`Store.latest_step`, restores without a step, and every
    adapter): the newest step (below `below`, if given; among those `only` admits) that every
    rank can read what `need` says, all of one save of it (the same-save rule, `one_save`).

    `accept(step)`, if given, is asked on every rank about each such step, newest first, in
    the same order: None takes the step, a reason passes it over (an adapter's own test, such
    as "holds a DeepSpeed checkpoint of this directory"). It may be collective, and must give
    every rank the same answer (decide on gathered values).

    Raises WorldSizeError when the newest such step of this job was saved by another number
    of ranks and `need` reads each rank's own part."""
    skipped: list[str] = []
    mine = [s for s in store._core.restorable_steps()
            if (below is None or s < below) and (only is None or only(s))]
    common, lacking = combined(store, mine, _steps_in_common)
    chosen = Agreement(None, None, skipped)
    for step in common:
        readers: dict[int, _core.StepReader] = {}
        verdict = combined(store, _report(store, step, need, skipped, readers), _verdict)
        if not need.reshard and need.rank is None and any(w != store.world_size for w in verdict.worlds):
            raise world_size_error(store, step, verdict.worlds[0], common)
        if verdict.bad:
            skipped.append(f"step {step} passed over: rank(s) {verdict.bad} cannot restore it")
            continue
        if verdict.mixed is not None:
            # Each rank's part is whole, but not of one save: the step was saved again and
            # some rank's new part is not on the tier it reads from (never mixed).
            skipped.append(
                f"step {step} passed over: the ranks hold different saves of it "
                f"({verdict.mixed}): a save of it again did not finish")
            continue
        why = accept(step) if accept is not None else None
        if why is not None:
            skipped.append(f"step {step} passed over: {why}")
            continue
        chosen.step, chosen.save, chosen.readers = step, verdict.save, readers
        break
    # Newer steps that some ranks have and others not: every rank says which and why.
    for step, missing in lacking:
        if chosen.step is None or step > chosen.step:
            skipped.append(
                f"step {step} passed over: rank(s) {missing} have it committed on none of the tiers "
                f"{store._core.restore_order} (lost with their host, or never saved there)")
    return chosen


def _steps_in_common(everyone: list[list[int]]) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """Combines every rank's committed steps (on one rank): the steps all ranks have, newest
    first, and each step that only some have with the ranks that lack it, newest first (the
    steps passed over that `agree` names: empty when the ranks have the same steps)."""
    have = [set(steps) for steps in everyone]
    common = set.intersection(*have)
    lacking = sorted(set().union(*have) - common, reverse=True)
    return sorted(common, reverse=True), [(s, [r for r, h in enumerate(have) if s not in h]) for s in lacking]


@dataclass(frozen=True)
class Verdict:
    """Every rank's `Report` on a candidate step, combined on one rank: the world sizes that
    saved it (sorted), the ranks that cannot open what they need, the ranks' saves when they
    are not all one (what the message names; else None), and that one save."""

    worlds: list[int]
    bad: list[int]
    mixed: str | None
    save: str | None


def _verdict(reports: list[Report]) -> Verdict:
    saves = [o for _, o in reports if o is not False]
    mixed = None if one_save(saves) else ", ".join(f"rank {r}: {o}" for r, (_, o) in enumerate(reports))
    return Verdict(
        worlds=sorted({w for w, _ in reports if w is not None}),
        bad=[r for r, (_, o) in enumerate(reports) if o is False],
        mixed=mixed,
        save=next((g for o in saves for g in o), None),
    )


def one_save(saves: Sequence[Sequence[str | None]]) -> bool:
    """The same-save rule: the saves (generations) that the ranks would read of one step, one
    list per rank, name at most one save between them. A step saved again whose new save is
    not whole where some rank reads is never mixed with its earlier save."""
    return len({g for per_rank in saves for g in per_rank}) <= 1


def saved_world_size(store: Store, step: int) -> int | None:
    """How many ranks saved `step`, from its commit record on the first tier in restore
    order that has one; None when none can be read."""
    for tier in store._core.restore_order:
        try:
            return int(json.loads(store._core.commit_record(tier, step))["world_size"])
        except TiercelError:
            continue
    return None


def check_world_size(store: Store, step: int) -> None:
    """Raises WorldSizeError when `step` was saved by another number of ranks than this
    job has (a restore of this rank's own part, which would be another rank's or none)."""
    world = saved_world_size(store, step)
    if world is not None and world != store.world_size:
        raise world_size_error(store, step, world, [step])


def world_size_error(store: Store, step: int, world: int, steps: list[int]) -> WorldSizeError:
    """The error for a restore of this rank's own part of a step saved by `world` ranks:
    the steps and their world sizes, and the ways on."""
    seen = ", ".join(f"{s} by {saved_world_size(store, s) or '?'} rank(s)" for s in sorted(steps, reverse=True)[:8])
    ranks = f"0..{world - 1}" if world > 1 else "0"
    return WorldSizeError(
        f"rank {store.rank}: step {step}, the newest step of this job, was saved by {world} rank(s) and this job has "
        f"{store.world_size} (committed steps: {seen}). A plain restore reads each rank's own part, so it does not "
        f"continue at another world size: restart with {world} rank(s); or reshard: tiercel.dcp (DCP) and "
        f"tiercel.orbax (Orbax) restore at any world size, and so does restore(reshard=...) for arrays saved as "
        f"tiercel.Sharded pieces; or read a saved rank's part on purpose with "
        f"restore(step={step}, rank=r) or reader({step}, rank=r) for r in {ranks}. To start afresh instead, give this "
        f"job another run id (`[store] run`, $TIERCEL_RUN_ID) or other tiers",
        step=step, rank=store.rank,
    )


def _report(store: Store, step: int, need: Need, skipped: list[str], opened: dict[int, _core.StepReader]) -> Report:
    """This rank's `Report` on `step`; the readers it opened go into `opened` (by saved
    rank), for the restore to read through rather than open the step again. The saved world
    size comes from the first reader's commit record (a resharding process p checks saved
    ranks p, p + n, ...: p first), so nothing is read twice."""
    plain = not need.reshard and need.rank is None  # this rank's own part, at this world size
    first = store.rank if need.rank is None else need.rank
    try:
        reader = store._core.reader(step, first, None)
    except TiercelError as e:
        world = saved_world_size(store, step)
        if world is not None and ((plain and world != store.world_size) or (need.reshard and first >= world)):
            # A plain restore: every rank raises WorldSizeError on the gathered world sizes.
            # Resharding: fewer saved ranks than processes, none of them this one's to check.
            return world, []
        skipped.append(f"step {step} skipped on rank {store.rank}: {e}")
        return world, False
    world = reader.world_size
    if plain and world != store.world_size:
        return world, []
    opened[first] = reader
    saves: list[str | None] = [reader.generation]
    for r in range(first + store.world_size, world, store.world_size) if need.reshard else ():
        try:
            opened[r] = reader = store._core.reader(step, r, None)
        except TiercelError as e:
            skipped.append(f"step {step} skipped on rank {store.rank}: {e}")
            return world, False
        saves.append(reader.generation)
    return world, sorted(set(saves), key=str)


def gather(store: Store, value: Any) -> list[Any]:
    """Every rank's `value`, by rank (one all-gather; none for a job of one process). Where
    only a result of them all is needed, `combined` costs the ranks less."""
    if store.world_size == 1:
        return [value]
    return _coordinator(store).all_gather(value)


def combined(store: Store, value: Any, combine: Callable[[list[Any]], T]) -> T:
    """`combine(every rank's value, by rank)`, computed on one rank and handed to all
    (`coordinator.agree`: O(1) bytes to each other rank when the result is small; no
    exchange for a job of one process). `combine` must be the same on every rank."""
    if store.world_size == 1:
        return combine([value])
    result: T = coordination.agree(_coordinator(store), value, combine)
    return result


def _coordinator(store: Store) -> Coordinator:
    if store.coordinator is None:
        raise InvalidArgumentError(
            "a job of several ranks needs a coordinator to agree on the step: initialize torch.distributed "
            "before opening the Store, pass coordinator=, or restore(step=N)"
        )
    return store.coordinator
