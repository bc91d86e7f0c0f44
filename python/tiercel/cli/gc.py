"""`tiercel gc [--dry-run]`: what the core's gc planner says may go from each tier (steps
beyond `keep`, uncommitted leftovers, temporary files and spare segments of dead writers,
abandoned uploads, objects of rank areas that nothing kept refers to), removed or, dry, listed. The rules live in the core (gc.rs); this
module only reports."""

from __future__ import annotations

import sys
from typing import Any

from .. import _core
from .context import EXIT_ERROR, EXIT_OK, PEER_SKIPPED, Ctx
from .output import Progress, count, fmt_bytes, json_out

#: gc removes a temporary file only when its writer is gone and it is at least this old.
DEFAULT_TMP_AGE = 600.0

#: The core's kinds of removal and how the summary counts them.
KINDS = {"step": "steps", "temp file": "temp_files", "upload": "uploads", "segment": "segments", "object": "objects"}


def _line(r: dict[str, Any], dry_run: bool) -> str:
    if r["what"] == "upload":  # the reason names the upload: "abandoned multipart upload of s3://..."
        return f"{'would abort' if dry_run else 'aborted'} the {r['reason']}"
    verb = "would remove" if dry_run else "removed"
    if r["what"] == "step":
        return f"{verb} step {r['step']} ({r['reason']})"
    size = f", {fmt_bytes(r['bytes'])}" if r["bytes"] is not None else ""
    return f"{verb} {r['what']} {r['path']} ({r['reason']}{size})"


def cmd_gc(ctx: Ctx) -> int:
    a = ctx.args
    verb = "would remove" if a.dry_run else "removed"
    doc: dict[str, Any] = {"dry_run": a.dry_run, "tiers": []}
    # Listing and deleting on an object store take a request per object: a bar per tier.
    prog = Progress("gc", len(ctx.tiers), unit="tier")
    for n, t in enumerate(ctx.tiers):
        entry: dict[str, Any] = {"name": t["name"], "error": None, "skipped": None, "removals": []}
        doc["tiers"].append(entry)
        if t["cluster"]:
            entry["skipped"] = PEER_SKIPPED + " (its holders apply `keep` themselves)"
        else:
            try:
                run = ctx.core.gc_plan if a.dry_run else ctx.core.gc
                entry["removals"] = run(t["name"], a.tmp_age)
            except _core.TiercelError as e:  # one tier out of reach: clean up the others
                entry["error"] = str(e)
        prog.update(done=n + 1)
    prog.finish()
    removals = [r for t in doc["tiers"] for r in t["removals"]]
    doc["counts"] = {key: sum(r["what"] == what for r in removals) for what, key in KINDS.items()}
    code = EXIT_ERROR if any(t["error"] for t in doc["tiers"]) else EXIT_OK
    if a.json:
        json_out(doc)
        return code
    for t in doc["tiers"]:
        if t["skipped"]:
            print(f"{t['name']}: {t['skipped']}")
        for r in t["removals"]:
            print(f"{t['name']}: {_line(r, a.dry_run)}")
    c = doc["counts"]
    if removals:
        extra = f", {count(c['segments'], 'spare segment')}" if c["segments"] else ""
        if c["objects"]:  # manifests and data objects of rank areas (format version 3)
            extra += f", {count(c['objects'], 'object')} of rank areas"
        if c["uploads"]:
            extra += f", {'would abort' if a.dry_run else 'aborted'} {count(c['uploads'], 'abandoned upload')}"
        print(f"gc: {verb} {count(c['steps'], 'step')} and {count(c['temp_files'], 'temporary file')}{extra}")
    else:
        print("gc: nothing to remove")
    for t in doc["tiers"]:
        if t["error"]:
            print(f"tiercel: error: tier '{t['name']}': {t['error']}", file=sys.stderr)
    return code
