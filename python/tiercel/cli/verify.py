"""`tiercel verify [STEP]`: re-read every chunk of committed steps, tier by tier, and check
every checksum."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from .. import _core
from .context import EXIT_CORRUPT, EXIT_ERROR, EXIT_OK, Ctx, StepInfo
from .output import Progress, count, fmt_bytes, json_out

#: verify reads a rank's items in batches of at most this many raw bytes (bounds memory).
VERIFY_BATCH_BYTES = 64 << 20



@dataclass
class Problem:
    tier: str
    #: None when the tier itself could not be listed.
    step: int | None
    rank: int | None
    item: str | None
    #: "corrupt" (checksum, decode, missing data: exit 1) or "error" (could not check: exit 4).
    kind: str
    message: str

    def where(self) -> str:
        w = f"tier '{self.tier}'" + (f" step {self.step}" if self.step is not None else "")
        if self.rank is not None:
            w += f" rank {self.rank}"
        if self.item is not None:
            w += f" item '{self.item}'"
        return w

    def detail(self) -> str:
        """The core's message without the context this line already names."""
        m = self.message
        cut = m.rfind("no tier has a valid copy: ")
        if cut >= 0:
            m = m[cut + len("no tier has a valid copy: "):]
        return re.sub(r"^tier '[^']*', step \d+, rank \d+, item '.*?', (?=chunk \d+)", "", m)

    def as_json(self) -> dict:
        return {"tier": self.tier, "step": self.step, "rank": self.rank, "item": self.item, "kind": self.kind,
                "message": self.message}


def _problem_kind(e: Exception) -> str:
    return "corrupt" if isinstance(e, (_core.IntegrityError, _core.NotFoundError)) else "error"


def _batches(items: list[dict], limit: int) -> Iterator[list[int]]:
    batch: list[int] = []
    size = 0
    for i, it in enumerate(items):
        if batch and size + it["nbytes"] > limit:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += it["nbytes"]
    if batch:
        yield batch


def _verify_step(ctx: Ctx, tier: str, info: StepInfo) -> tuple[list[Problem], dict]:
    """Reads every chunk of every rank of one committed step on one tier, restricted to that
    tier, and returns the problems found and what was checked."""
    step = info.step
    checked: dict[str, Any] = {"tier": tier, "step": step, "ranks": 0, "items": 0, "bytes": 0, "ok": True, "vanished": False}
    if info.state != "committed":
        Progress("", 0).finish(f"verify: tier '{tier}' step {step}: {info.state}")
        return [Problem(tier, step, None, None, "corrupt", info.error or info.state)], checked | {"ok": False}
    assert info.record is not None
    ws = info.record["world_size"]
    problems: list[Problem] = []
    readers = []
    for r in range(ws):
        try:
            rd = ctx.core.reader(step, r, [tier])
            readers.append((r, rd, json.loads(rd.manifest_json())))
        except _core.TiercelError as e:
            problems.append(Problem(tier, step, r, None, _problem_kind(e), str(e)))
    total = sum(it["nbytes"] for _, _, m in readers for it in m["items"])
    prog = Progress(f"verify {tier} step {step}", ws, total, unit="rank")
    done_bytes = 0
    for n, (r, rd, m) in enumerate(readers, 1):
        items = m["items"]
        for batch in _batches(items, VERIFY_BATCH_BYTES):
            try:
                rd.read_items(batch)
            except _core.TiercelError:
                # The error names only the first bad item; check the batch one by one.
                for i in batch:
                    try:
                        rd.read_items([i])
                    except _core.TiercelError as e:
                        problems.append(Problem(tier, step, r, items[i]["name"], _problem_kind(e), str(e)))
            done_bytes += sum(items[i]["nbytes"] for i in batch)
            prog.update(nbytes=done_bytes)
        checked["ranks"] += 1
        checked["items"] += len(items)
        prog.update(done=n)
    checked["bytes"] = done_bytes
    del readers
    if problems:
        # A trainer's retention may have removed the step while it was read: not corruption.
        try:
            ctx.core.commit_record(tier, step)
        except _core.NotFoundError:
            checked["vanished"] = True
            prog.finish(f"verify: tier '{tier}' step {step}: removed while it was verified (skipped)")
            return [], checked
        except _core.TiercelError:
            pass
    checked["ok"] = not problems
    status = "ok" if not problems else f"{len(problems)} bad"
    prog.finish(f"verify: tier '{tier}' step {step}: {checked['ranks']}/{count(ws, 'rank')}, {count(checked['items'], 'item')}, "
                f"{fmt_bytes(done_bytes)}: {status}")
    return problems, checked


def cmd_verify(ctx: Ctx) -> int:
    a = ctx.args
    tiers = ctx.selected_tiers(a.tier)
    targets: list[tuple[str, StepInfo]] = []
    problems: list[Problem] = []
    for t in tiers:
        try:
            infos = ctx.scan(t)
        except _core.TiercelError as e:  # one tier out of reach: check the others
            problems.append(Problem(t, None, None, None, "error", f"cannot list the tier: {e}"))
            continue
        for info in infos:
            if info.state == "uncommitted":
                continue
            if a.step is None or info.step == a.step:
                targets.append((t, info))
    if a.step is not None and not targets and not problems:
        ctx.require_committed(a.step, tiers)  # raises NotFoundError naming what there is
    checked: list[dict] = []

    def report(found: list[Problem]) -> None:
        if not a.json:
            for pr in found:
                print(f"{pr.kind.upper()}: {pr.where()}: {pr.detail()}", flush=True)

    report(problems)
    for t, info in targets:
        p, c = _verify_step(ctx, t, info)
        problems += p
        checked.append(c)
        report(p)
    corrupt = any(p.kind == "corrupt" for p in problems)
    code = EXIT_CORRUPT if corrupt else EXIT_ERROR if problems else EXIT_OK
    if a.json:
        json_out({"ok": not problems, "exit_code": code, "checked": checked, "problems": [p.as_json() for p in problems]})
        return code
    steps = [c for c in checked if not c["vanished"]]
    if not steps:
        unlisted = f"; {count(len(problems), 'tier')} could not be listed" if problems else ""
        print(f"nothing to verify: no committed steps on {', '.join(tiers)}{unlisted}")
        return code
    summary = (f"verified {count(len(steps), 'step copy', 'step copies')} on {', '.join(sorted({c['tier'] for c in steps}, key=tiers.index))}: "
               f"{count(sum(c['ranks'] for c in steps), 'rank')}, {count(sum(c['items'] for c in steps), 'item')}, "
               f"{fmt_bytes(sum(c['bytes'] for c in steps))}")
    if not problems:
        print(f"{summary}: all checksums hold")
    else:
        n_c = sum(p.kind == "corrupt" for p in problems)
        n_e = len(problems) - n_c
        what = ", ".join(x for x in (f"{n_c} corrupt" if n_c else "", f"{n_e} unreadable" if n_e else "") if x)
        print(f"{summary}: {what}")
    return code
