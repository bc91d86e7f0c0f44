"""`tiercel cp` and `tiercel rm`: copy a committed step between tiers, delete one."""

from __future__ import annotations

import json
import time
from typing import Any

from .. import _core
from .context import EXIT_OK, Ctx, UsageError
from .output import Progress, count, fmt_bytes, json_out


def cmd_cp(ctx: Ctx) -> int:
    a = ctx.args
    src, dst = ctx.reachable(a.source), ctx.reachable(a.dest)
    if src == dst:
        raise UsageError(f"--from and --to are the same tier ('{src}')")
    ctx.require_committed(a.step, [src])
    doc: dict[str, Any] = {"step": a.step, "from": src, "to": dst, "copied": False}
    if ctx.has(dst, a.step):
        if a.json:
            json_out(doc)
        else:
            print(f"step {a.step} is already committed on tier '{dst}'; nothing copied")
        return EXIT_OK
    record = json.loads(ctx.core.commit_record(src, a.step))
    ws = record["world_size"]
    per_rank = []
    for r in range(ws):
        m = ctx.manifest(src, a.step, r)
        per_rank.append(sum(i["nbytes"] for i in m["items"]))
    total = sum(per_rank)
    # The core reports each chunk copied and each rank done (a bar on a terminal only).
    prog = Progress(f"cp step {a.step} {src} -> {dst}", ws, total, unit="rank")
    t0 = time.monotonic()

    def progress(done: int, _total: int, nbytes: int) -> None:
        # Chunks finish on several threads: a smaller total may arrive after a larger one.
        prog.update(done=max(done, prog.done), nbytes=max(nbytes, prog.nbytes))

    ctx.core.copy_step(a.step, src, dst, progress)
    secs = time.monotonic() - t0
    prog.finish()
    doc.update(copied=True, world_size=ws, raw_bytes=total, seconds=round(secs, 3))
    if a.json:
        json_out(doc)
    else:
        print(f"copied step {a.step} ({count(ws, 'rank')}, {fmt_bytes(total)}) from tier '{src}' to tier '{dst}' "
              f"in {secs:.2f} s; committed")
    return EXIT_OK


def cmd_rm(ctx: Ctx) -> int:
    a = ctx.args
    tier = ctx.reachable(a.tier)
    steps = ctx.core.all_steps(tier)
    if a.step not in steps:
        raise _core.NotFoundError(f"tier '{tier}' has no step {a.step} (steps: {steps or 'none'})", tier=tier, step=a.step)
    ctx.core.delete_step(tier, a.step)
    if a.json:
        json_out({"tier": tier, "step": a.step, "removed": True})
    else:
        print(f"removed step {a.step} from tier '{tier}'")
    return EXIT_OK
