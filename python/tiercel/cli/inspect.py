"""`tiercel inspect STEP`: the manifests of a step (items, dtypes, shapes, chunks, codecs)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from .. import _core
from .context import EXIT_OK, Ctx, other_ranks_bytes, shared_bytes
from .output import count, fmt_bytes, fmt_ratio, fmt_time, json_out, table


def _item_facts(item: dict) -> dict:
    codecs = Counter(c["codec"] for c in item["chunks"])
    stored = sum(c["stored_len"] for c in item["chunks"])
    return {
        "name": item["name"],
        "kind": item["kind"],
        "dtype": item["dtype"],
        "shape": item["shape"],
        "nbytes": item["nbytes"],
        "chunks": len(item["chunks"]),
        "codecs": dict(codecs),
        "stored_bytes": stored,
        "ratio": round(item["nbytes"] / stored, 4) if stored else None,
    }


def _codec_mix(codecs: dict[str, int]) -> str:
    if not codecs:
        return "-"
    if len(codecs) == 1:
        return next(iter(codecs))
    return ", ".join(f"{n} {c}" for c, n in sorted(codecs.items(), key=lambda kv: -kv[1]))


def cmd_inspect(ctx: Ctx) -> int:
    a = ctx.args
    step = a.step
    tiers = ctx.selected_tiers(a.tier)
    order = [n for n in ctx.core.restore_order if n in tiers] + [n for n in tiers if n not in ctx.core.restore_order]
    tier = ctx.require_committed(step, order)[0]
    on = [t for t in ctx.selected_tiers(None) if ctx.has(t, step)]
    record = json.loads(ctx.core.commit_record(tier, step))
    ws = record["world_size"]
    if a.rank is not None:
        if not 0 <= a.rank < ws:
            raise _core.NotFoundError(f"tier '{tier}': step {step} was saved by {count(ws, 'rank')}; there is no rank {a.rank}",
                                      tier=tier, step=step, rank=a.rank)
        ranks = [a.rank]
    else:
        ranks = list(range(ws))
    doc: dict[str, Any] = {"step": step, "tier": tier, "on_tiers": on, "world_size": ws, "time": record["time"], "ranks": []}
    for r in ranks:
        m = ctx.manifest(tier, step, r)
        items = [_item_facts(i) for i in m["items"]]
        raw = sum(i["nbytes"] for i in items)
        stored = sum(i["stored_bytes"] for i in items)
        shared = shared_bytes(step, m)
        theirs = other_ranks_bytes(m)
        doc["ranks"].append({
            "rank": r,
            "format": m["format"],
            "version": m["version"],
            "chunk_size": m["chunk_size"],
            "puts": [name for name, _ in m["trees"]],
            "objects": m["objects"],
            "raw_bytes": raw,
            "stored_bytes": stored,
            # Of those, the bytes stored by an earlier step (chunks this step shares with it).
            "shared_bytes": shared,
            # And the bytes other ranks store (the same bytes as theirs: stored once).
            "other_ranks_bytes": theirs,
            "ratio": round(raw / stored, 4) if stored else None,
            "items": items,
        })
    if a.json:
        json_out(doc)
        return EXIT_OK

    print(f"step {step} on tier '{tier}', world size {ws}, committed {fmt_time(record['time'])}")
    print(f"committed on: {', '.join(on)}")
    for rk in doc["ranks"]:
        print()
        print(f"rank {rk['rank']}: {count(len(rk['items']), 'item')} in {count(len(rk['puts']), 'put')} ({', '.join(rk['puts'])}); "
              f"{count(len(rk['objects']), 'object')}; chunk size {fmt_bytes(rk['chunk_size'])}; "
              f"raw {fmt_bytes(rk['raw_bytes'])}, stored {fmt_bytes(rk['stored_bytes'])} "
              f"({fmt_ratio(rk['raw_bytes'], rk['stored_bytes'])}), {fmt_bytes(rk['shared_bytes'])} of it shared with other steps"
              + (f", {fmt_bytes(rk['other_ranks_bytes'])} stored by other ranks" if rk["other_ranks_bytes"] else ""))
        rows = [[i["name"], i["kind"], i["dtype"], "[" + ", ".join(map(str, i["shape"])) + "]", fmt_bytes(i["nbytes"]),
                 str(i["chunks"]), _codec_mix(i["codecs"]), fmt_bytes(i["stored_bytes"]),
                 fmt_ratio(i["nbytes"], i["stored_bytes"])] for i in rk["items"]]
        for line in table(["ITEM", "KIND", "DTYPE", "SHAPE", "BYTES", "CHUNKS", "CODECS", "STORED", "RATIO"], rows,
                          right={4, 5, 7, 8}):
            print("  " + line)
    if len(doc["ranks"]) > 1:
        raw = sum(r["raw_bytes"] for r in doc["ranks"])
        # Bytes one rank stores for others count once.
        stored = sum(r["stored_bytes"] - r["other_ranks_bytes"] for r in doc["ranks"])
        shared = sum(r["shared_bytes"] for r in doc["ranks"])
        print()
        print(f"all {len(doc['ranks'])} ranks: {count(sum(len(r['items']) for r in doc['ranks']), 'item')}; "
              f"raw {fmt_bytes(raw)}, stored {fmt_bytes(stored)} ({fmt_ratio(raw, stored)}), "
              f"{fmt_bytes(shared)} of it shared with other steps")
    return EXIT_OK
