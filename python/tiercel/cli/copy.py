"""`tiercel cp` and `tiercel rm`: copy a committed step between tiers, delete one."""

from __future__ import annotations

import json
import time

from .. import _core
from .context import EXIT_OK, Ctx, UsageError
from .output import Progress, fmt_bytes


def cmd_cp(ctx: Ctx) -> int:
    a = ctx.args
    src, dst = ctx.tier(a.source)["name"], ctx.tier(a.dest)["name"]
    if src == dst:
        raise UsageError(f"--from and --to are the same tier ('{src}')")
    ctx.require_committed(a.step, [src])
    if ctx.has(dst, a.step):
        print(f"step {a.step} is already committed on tier '{dst}'; nothing copied")
        return EXIT_OK
    record = json.loads(ctx.core.commit_record(src, a.step))
    ws = record["world_size"]
    per_rank = []
    for r in range(ws):
        m = ctx.manifest(src, a.step, r)
        per_rank.append(sum(i["nbytes"] for i in m["items"]))
    prog = Progress(f"cp step {a.step} {src} -> {dst}", ws, sum(per_rank), unit="ranks", lines=True)
    t0 = time.monotonic()

    def progress(done: int, total: int) -> None:
        prog.update(done=done, nbytes=sum(per_rank[:done]))

    ctx.core.copy_step(a.step, src, dst, progress)
    secs = time.monotonic() - t0
    prog.finish()
    print(f"copied step {a.step} ({ws} ranks, {fmt_bytes(sum(per_rank))}) from tier '{src}' to tier '{dst}' "
          f"in {secs:.2f} s; committed")
    return EXIT_OK


def cmd_rm(ctx: Ctx) -> int:
    a = ctx.args
    tier = ctx.tier(a.tier)["name"]
    if a.step not in ctx.core.all_steps(tier):
        raise _core.NotFoundError(f"tier '{tier}' has no step {a.step} (steps: {ctx.core.all_steps(tier) or 'none'})")
    ctx.core.delete_step(tier, a.step)
    print(f"removed step {a.step} from tier '{tier}'")
    return EXIT_OK
