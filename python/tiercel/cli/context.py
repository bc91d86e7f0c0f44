"""What every `tiercel` command shares: exit codes, usage errors, and `Ctx`, the open store
with the look-ups the commands make (steps per tier, commit records, manifests)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .. import _core

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4

class UsageError(Exception):
    """A mistake on the command line (exit code 2). `tier=`, `step=`: what it names, for the
    --json error document."""

    def __init__(self, message: str, *, tier: str | None = None, step: int | None = None):
        super().__init__(message)
        self.tier, self.step = tier, step


class CommandError(Exception):
    """A command could not do its work for a reason outside tiercel's tiers (exit code 4)."""


#: Why the command leaves a peer tier alone: its replicas live in the memory of the job's
#: hosts and are reached through the job's running processes, which the command does not join.
PEER_SKIPPED = "not looked at: a peer tier's replicas are reached through the job's own processes"


@dataclass
class StepInfo:
    step: int
    #: "committed", "uncommitted" or "bad commit record".
    state: str
    record: dict | None = None
    error: str | None = None

    @property
    def committed(self) -> bool:
        return self.state != "uncommitted"


@dataclass
class RankSizes:
    ranks: int = 0
    stored: int = 0
    raw: int = 0
    errors: list[str] = field(default_factory=list)
    # Every object the step's manifests refer to, by its key from the tier's root, with its
    # length: objects shared between steps (format version 3) appear under one key.
    objects: dict[str, int] = field(default_factory=dict)


def object_key(step: int, obj: dict) -> str:
    """An object's key from the tier's root: its `key` (format version 3), else its name in
    the step's directory."""
    return obj.get("key") or f"step-{step:012d}/{obj['name']}"


def shared_bytes(step: int, m: dict) -> int:
    """The stored bytes of `m`'s chunks that lie in another step's data object of its own
    rank (shared with that step: format version 3)."""
    own = f"step-{step:012d}."
    foreign = {i for i, o in enumerate(m["objects"])
               if o.get("key") and not o["key"].rsplit("/", 1)[-1].startswith(own) and _in_area(o["key"], m["rank"])}
    return sum(c["stored_len"] for it in m["items"] for c in it["chunks"]
               if c["object"] in foreign and not (it.get("replica") or {}).get("shared"))


def other_ranks_bytes(m: dict) -> int:
    """The stored bytes of `m`'s chunks that another rank's objects hold (replicated items,
    and items found alike on the ranks when they saved: format.md, "Items matched by content")."""
    theirs = {i for i, o in enumerate(m["objects"]) if o.get("key") and not _in_area(o["key"], m["rank"])}
    return sum(c["stored_len"] for it in m["items"] for c in it["chunks"] if c["object"] in theirs)


def _in_area(key: str, rank: int) -> bool:
    """Whether an object key lies in rank `rank`'s area (keys outside every area: an older format's, the rank's)."""
    return "/rank-" not in key or f"/rank-{rank:05d}/" in key


class Ctx:
    """The open store and what the commands share."""

    def __init__(self, store: Any, args: argparse.Namespace):
        self.store = store
        self.core: Any = store._core if store is not None else None
        self.args = args
        self.tiers: list[dict] = store.tiers() if store is not None else []
        self.names = [t["name"] for t in self.tiers]

    def tier(self, name: str) -> dict:
        for t in self.tiers:
            if t["name"] == name:
                return t
        raise UsageError(f"no tier named '{name}' in {self.core.policy_source} (tiers: {', '.join(self.names)})", tier=name)

    def reachable(self, name: str) -> str:
        """A tier named on the command line that the command can work on: not a peer tier."""
        if self.tier(name)["cluster"]:
            raise UsageError(f"tier '{name}' is a peer tier: {PEER_SKIPPED}", tier=name)
        return name

    def selected_tiers(self, name: str | None) -> list[str]:
        """`--tier NAME`, or every tier the command can look at (no peer tier)."""
        if name:
            return [self.reachable(name)]
        return [t["name"] for t in self.tiers if not t["cluster"]]

    def scan(self, tier: str) -> list[StepInfo]:
        """Every step directory on a tier, oldest first, with its commit record if any."""
        out = []
        for s in self.core.all_steps(tier):
            try:
                out.append(StepInfo(s, "committed", json.loads(self.core.commit_record(tier, s))))
            except _core.NotFoundError:
                out.append(StepInfo(s, "uncommitted"))
            except _core.IntegrityError as e:
                out.append(StepInfo(s, "bad commit record", error=str(e)))
        return out

    def committed(self, tier: str) -> list[int]:
        return [i.step for i in self.scan(tier) if i.state == "committed"]

    def has(self, tier: str, step: int) -> bool:
        """Whether `step` is committed on `tier` with a readable commit record (one read, not
        a listing); `verify` and `ls` report unreadable records, and a tier that cannot be
        reached has nothing (`require_committed` says why)."""
        try:
            self.core.commit_record(tier, step)
            return True
        except _core.TiercelError:
            return False

    def manifest(self, tier: str, step: int, rank: int) -> dict:
        return json.loads(self.core.reader(step, rank, [tier]).manifest_json())

    def committed_sizes(self, tier: str, step: int, world_size: int) -> RankSizes:
        sizes = RankSizes()
        for r in range(world_size):
            try:
                m = self.manifest(tier, step, r)
            except _core.TiercelError as e:
                sizes.errors.append(f"rank {r}: {e}")
                continue
            sizes.ranks += 1
            sizes.stored += sum(o["len"] for o in m["objects"])
            sizes.objects.update((object_key(step, o), o["len"]) for o in m["objects"])
            sizes.raw += sum(i["nbytes"] for i in m["items"])
        return sizes

    def require_committed(self, step: int, tiers: list[str]) -> list[str]:
        """The tiers among `tiers` that have `step` committed, or NotFoundError."""
        have = [t for t in tiers if self.has(t, step)]
        if not have:
            raise _core.NotFoundError(f"step {step} is committed on no tier in {tiers} "
                                      f"(committed steps: {'; '.join(self._committed_or_why(t) for t in tiers)})",
                                      step=step, tier=tiers[0] if len(tiers) == 1 else None)
        return have

    def _committed_or_why(self, tier: str) -> str:
        try:
            return f"{tier}: {self.committed(tier) or 'none'}"
        except _core.TiercelError as e:
            return f"{tier}: cannot list ({e})"


def local_dir(tier: dict) -> str | None:
    """The directory a tier lives in (memory, fs); None for tiers that are not directories."""
    return tier["directory"] or None


def uncommitted_details(core: Any, tier: dict, step: int) -> dict:
    """What an uncommitted step holds: the ranks whose part is complete (their manifest is
    there) and the world size they name, from the core; on a memory or fs tier also the bytes
    in its directory (whose name the core gives)."""
    out: dict[str, Any] = {"stored_bytes": None, "ranks": None, "world_size": None}
    try:
        ranks = core.step_ranks(tier["name"], step)
        out["ranks"] = len(ranks)
        if ranks:
            out["world_size"] = json.loads(core.manifest_json(tier["name"], step, ranks[0]))["world_size"]
    except _core.TiercelError:
        pass
    d = local_dir(tier)
    if d is not None:
        try:
            with os.scandir(os.path.join(d, _core.step_dir_name(step))) as it:
                out["stored_bytes"] = sum(e.stat(follow_symlinks=False).st_size for e in it if e.is_file(follow_symlinks=False))
        except OSError:
            pass
    return out
