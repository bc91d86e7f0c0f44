"""`tiercel ls`: every step on every tier, committed or not, with sizes and commit times."""

from __future__ import annotations

import sys
from typing import Any

from .. import _core
from .context import EXIT_ERROR, EXIT_OK, PEER_SKIPPED, Ctx, StepInfo, uncommitted_details
from .output import Progress, fmt_bytes, fmt_time, json_out, table


def _tier_summary(t: dict) -> str:
    bits = [t["kind"]] + ([t["location"]] if t["location"] else [])
    if t["every"] != 1:
        bits.append(f"every {t['every']}")
    bits.append(f"keep {t['keep']}" if t["keep"] is not None else "keep all")
    if t["compression"] != "none":
        bits.append(t["compression"])
    return ", ".join(bits)


def _scan(ctx: Ctx, t: dict) -> tuple[list[StepInfo], str | None, str | None]:
    """(steps, why the tier could not be listed, why it was not looked at): one tier that
    cannot be reached does not hide the others."""
    if t["cluster"]:
        return [], None, PEER_SKIPPED
    try:
        return ctx.scan(t["name"]), None, None
    except _core.TiercelError as e:
        return [], str(e), None


def cmd_ls(ctx: Ctx) -> int:
    doc: dict[str, Any] = {"policy": ctx.core.policy_source, "tiers": []}
    scans = [(t, *_scan(ctx, t)) for t in ctx.tiers]
    # Sizes take one manifest read per rank and step: many requests on an object store.
    prog = Progress("ls: reading manifests", sum(i.state == "committed" for _, infos, _, _ in scans for i in infos), unit="step")
    for t, infos, error, skipped in scans:
        steps = []
        # The objects the committed steps refer to, each once: what the tier really holds
        # for them (steps share objects in format version 3).
        held: dict[str, int] = {}
        for info in infos:
            entry: dict[str, Any] = {"step": info.step, "state": info.state}
            if info.state == "committed":
                assert info.record is not None
                ws = info.record["world_size"]
                sizes = ctx.committed_sizes(t["name"], info.step, ws)
                held.update(sizes.objects)
                prog.update(done=prog.done + 1)
                entry.update(world_size=ws, ranks=sizes.ranks, stored_bytes=sizes.stored, raw_bytes=sizes.raw,
                             time=info.record["time"], error="; ".join(sizes.errors) or None)
            elif info.state == "uncommitted":
                entry.update(uncommitted_details(ctx.core, t, info.step), raw_bytes=None, time=None, error=None)
            else:
                entry.update(world_size=None, ranks=None, stored_bytes=None, raw_bytes=None, time=None, error=info.error)
            steps.append(entry)
        doc["tiers"].append({k: t[k] for k in ("name", "kind", "location", "every", "keep", "compression")}
                            | {"error": error, "skipped": skipped, "steps": steps,
                               "held_bytes": sum(held.values()) if steps else None})
    prog.finish()
    code = EXIT_ERROR if any(t["error"] for t in doc["tiers"]) else EXIT_OK
    if ctx.args.json:
        json_out(doc)
        return code

    headers = ["STEP", "STATE", "RANKS", "SIZE", "RAW", "COMMITTED"]
    rows: list[list[str]] = []
    sections: list[tuple[dict, int, int]] = []  # (tier, first row, end row)
    notes: list[str] = []
    for t in doc["tiers"]:
        start = len(rows)
        for s in t["steps"]:
            if s["state"] == "committed":
                ranks = str(s["world_size"]) if s["ranks"] == s["world_size"] else f"{s['ranks']}/{s['world_size']}"
            elif s["ranks"] is not None and s["world_size"] is not None:
                ranks = f"{s['ranks']}/{s['world_size']}"
            else:
                ranks = "?" if s["ranks"] is None else str(s["ranks"])
            rows.append([str(s["step"]), s["state"], ranks, fmt_bytes(s["stored_bytes"]), fmt_bytes(s["raw_bytes"]),
                         fmt_time(s["time"])])
            if s["error"]:
                notes.append(f"tier '{t['name']}' step {s['step']}: {s['error']}")
        sections.append((t, start, len(rows)))
    lines = table(headers, rows, right={0, 2, 3, 4})
    print(f"policy: {doc['policy']}")
    for t, a, b in sections:
        print()
        print(f"{t['name']} ({_tier_summary(t)})")
        if t["error"] or t["skipped"]:
            print(f"  ({t['skipped'] or 'cannot list: ' + t['error']})")
            continue
        if a == b:
            print("  (no steps)")
            continue
        print("  " + lines[0])
        for line in lines[1 + a:1 + b]:
            print("  " + line)
        if t["held_bytes"] is not None:
            summed = sum(s["stored_bytes"] or 0 for s in t["steps"] if s["state"] == "committed")
            print(f"  holds {fmt_bytes(t['held_bytes'])} for its committed steps"
                  + (f" (their sizes add up to {fmt_bytes(summed)}: steps share chunks)" if summed > t["held_bytes"] else ""))
    for n in notes:
        print(f"warning: {n}", file=sys.stderr)
    for t in doc["tiers"]:
        if t["error"]:
            print(f"tiercel: error: tier '{t['name']}' cannot be listed: {t['error']}", file=sys.stderr)
    return code
