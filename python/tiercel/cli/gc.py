"""`tiercel gc [--dry-run]`: apply `keep`, remove uncommitted leftovers and stale temporary
files, abort abandoned uploads."""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from typing import Any, Iterator

from .. import _core
from .context import EXIT_ERROR, EXIT_OK, PEER_SKIPPED, Ctx, local_dir
from .output import Progress, count, fmt_bytes, json_out

#: gc removes a temporary file only when its writer is gone and it is at least this old.
DEFAULT_TMP_AGE = 600.0



_TMP_PID = re.compile(r"\.tmp-(\d+)-\d+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return False
    return True


def _stale_tmp_files(tier: dict, skip_steps: set[int], min_age: float) -> Iterator[tuple[str, str, int]]:
    """(step dir, file name, size) of temporary files (".tmp-" in the name) directly inside
    the step directories of a directory tier whose writer process is gone and that were not
    touched for `min_age` seconds. Only regular files are considered; symlinks are never
    followed, so nothing outside the tier's directory is reached."""
    root = local_dir(tier)
    if root is None or not os.path.isdir(root):
        return
    now = time.time()
    with os.scandir(root) as it:
        dirs = sorted(e.name for e in it if re.fullmatch(r"step-\d{12}", e.name) and e.is_dir(follow_symlinks=False))
    for d in dirs:
        if int(d[5:]) in skip_steps:
            continue
        try:
            fd = os.open(os.path.join(root, d), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            for name in sorted(os.listdir(fd)):
                if ".tmp-" not in name:
                    continue
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < min_age:
                    continue
                pid = _TMP_PID.search(name)
                if pid and _pid_alive(int(pid.group(1))):
                    continue
                yield d, name, st.st_size
        finally:
            os.close(fd)


def _remove_tmp(root: str, d: str, name: str) -> bool:
    try:
        fd = os.open(os.path.join(root, d), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def cmd_gc(ctx: Ctx) -> int:
    a = ctx.args
    verb = "would remove" if a.dry_run else "removed"
    doc: dict[str, Any] = {"dry_run": a.dry_run, "tiers": []}
    # Listing and deleting on an object store take a request per object: a bar per tier.
    prog = Progress("gc", len(ctx.tiers), unit="tier")
    for n, t in enumerate(ctx.tiers):
        entry: dict[str, Any] = {"name": t["name"], "error": None, "skipped": None, "aborted_uploads": [], "steps": [],
                                 "temporary_files": []}
        doc["tiers"].append(entry)
        if t["kind"] == "peer":
            entry["skipped"] = PEER_SKIPPED + " (its holders apply `keep` themselves)"
        else:
            try:
                entry.update(_collect(ctx, t, a.dry_run, a.tmp_age))
            except _core.TiercelError as e:  # one tier out of reach: clean up the others
                entry["error"] = str(e)
        prog.update(done=n + 1)
    prog.finish()
    n_steps = sum(len(t["steps"]) for t in doc["tiers"])
    n_tmp = sum(len(t["temporary_files"]) for t in doc["tiers"])
    n_uploads = sum(len(t["aborted_uploads"]) for t in doc["tiers"])
    doc.update(steps=n_steps, temporary_files=n_tmp, aborted_uploads=n_uploads)
    code = EXIT_ERROR if any(t["error"] for t in doc["tiers"]) else EXIT_OK
    if a.json:
        json_out(doc)
        return code
    for t in doc["tiers"]:
        if t["skipped"]:
            print(f"{t['name']}: {t['skipped']}")
        for line in t["aborted_uploads"]:
            print(f"{t['name']}: {line}")
        for s in t["steps"]:
            print(f"{t['name']}: {verb} step {s['step']} ({s['reason']})")
        for f in t["temporary_files"]:
            print(f"{t['name']}: {verb} {f['path']} (stale temporary file, {fmt_bytes(f['bytes'])})")
    if n_steps or n_tmp or n_uploads:
        aborted = f", aborted {count(n_uploads, 'abandoned upload')}" if n_uploads else ""
        print(f"gc: {verb} {count(n_steps, 'step')} and {count(n_tmp, 'temporary file')}{aborted}")
    else:
        print("gc: nothing to remove")
    for t in doc["tiers"]:
        if t["error"]:
            print(f"tiercel: error: tier '{t['name']}': {t['error']}", file=sys.stderr)
    return code


def _collect(ctx: Ctx, t: dict, dry_run: bool, tmp_age: float) -> dict[str, Any]:
    """What gc removes (or, dry, would remove) on one tier."""
    name = t["name"]
    infos = ctx.scan(name)
    committed = [i.step for i in infos if i.committed]
    newest = committed[-1] if committed else None
    keep = t["keep"]
    beyond = set(committed[:-keep] if keep is not None and len(committed) > keep else [])
    leftovers = {i.step for i in infos if not i.committed and newest is not None and i.step < newest}
    uploads: list[str] = []
    if dry_run:
        removed = sorted(beyond | leftovers)
    else:
        # Abandoned multipart uploads (s3, gcs) first; retention would also do it, silently.
        uploads = list(ctx.core.sweep(name))
        removed = list(ctx.core.retain(name))
    steps = [{"step": s, "reason": f"committed; beyond keep {keep}" if s in committed else "uncommitted leftover"}
             for s in sorted(removed)]
    root = local_dir(t) or ""
    tmp = [{"path": f"{d}/{fname}", "bytes": size}
           for d, fname, size in list(_stale_tmp_files(t, set(removed), tmp_age))
           if dry_run or _remove_tmp(root, d, fname)]
    return {"aborted_uploads": uploads, "steps": steps, "temporary_files": tmp}
