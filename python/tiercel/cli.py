"""The `tiercel` command: look at, check, copy and clean up the checkpoints of a policy.

    tiercel [--policy FILE] ls [--json]
    tiercel [--policy FILE] inspect STEP [--tier T] [--rank R] [--json]
    tiercel [--policy FILE] verify [STEP] [--tier T] [--json]
    tiercel [--policy FILE] cp STEP --from TIER --to TIER
    tiercel [--policy FILE] gc [--dry-run]
    tiercel [--policy FILE] rm STEP --tier T

The policy comes from --policy, else $TIERCEL_POLICY, else ./tiercel.toml. The store is
opened as rank 0 of a world of 1; every rank's manifest is still readable through it.
Bytes are moved and checked by the core; this module only lists, formats and reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, TextIO

from . import _core

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4

EPILOG = """\
policy:
  --policy FILE, else $TIERCEL_POLICY, else ./tiercel.toml

exit codes:
  0  success (verify: every checksum holds)
  1  corruption found (verify), or stored bytes fail their checksum
  2  usage or configuration error (bad arguments, unknown tier, bad policy file)
  3  step (or rank) not found
  4  any other error (a tier cannot be read or written, a capacity limit, ...)
"""

#: verify reads a rank's items in batches of at most this many raw bytes (bounds memory).
VERIFY_BATCH_BYTES = 64 << 20
#: gc removes a temporary file only when its writer is gone and it is at least this old.
DEFAULT_TMP_AGE = 600.0


class UsageError(Exception):
    """A mistake on the command line (exit code 2)."""


# -------------------------------------------------------------------------------------------
# Formatting
# -------------------------------------------------------------------------------------------


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024
        if x < 1024 or unit == "PiB":
            return f"{x:.1f} {unit}"
    raise AssertionError


def _n(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.2f}x" if stored else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int] = frozenset()) -> list[str]:
    """Rows as aligned text lines (header first); columns in `right` are right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in cells
    ]


class Progress:
    """done/total and bytes on one stderr line. On a terminal the line is redrawn in place;
    elsewhere nothing is drawn while it runs (or, with `lines`, one line per update) and the
    final message is written as one line."""

    WIDTH = 24

    def __init__(self, label: str, total: int, total_bytes: int | None = None, *, unit: str = "",
                 lines: bool = False, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.label, self.total, self.total_bytes, self.unit, self.lines = label, total, total_bytes, unit, lines
        self.done = 0
        self.nbytes = 0
        self._drawn = 0.0

    def _text(self) -> str:
        frac = self.nbytes / self.total_bytes if self.total_bytes else (self.done / self.total if self.total else 1.0)
        fill = min(self.WIDTH, int(frac * self.WIDTH))
        text = f"{self.label} [{'#' * fill}{'.' * (self.WIDTH - fill)}] {self.done}/{self.total}"
        if self.unit:
            text += f" {self.unit}"
        if self.total_bytes is not None:
            text += f"  {fmt_bytes(self.nbytes)} / {fmt_bytes(self.total_bytes)}"
        return text

    def update(self, done: int | None = None, nbytes: int | None = None) -> None:
        if done is not None:
            self.done = done
        if nbytes is not None:
            self.nbytes = nbytes
        if self.tty:
            now = time.monotonic()
            if now - self._drawn >= 0.1 or self.done == self.total:
                self._drawn = now
                self.stream.write("\r" + self._text() + "\x1b[K")
                self.stream.flush()
        elif self.lines:
            text = f"{self.label}: {self.done}/{self.total}"
            if self.unit:
                text += f" {self.unit}"
            if self.total_bytes is not None:
                text += f", {fmt_bytes(self.nbytes)} / {fmt_bytes(self.total_bytes)}"
            self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self, message: str | None = None) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()


def _json_out(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


# -------------------------------------------------------------------------------------------
# Reading a store
# -------------------------------------------------------------------------------------------


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


class Ctx:
    """The open store and what the commands share."""

    def __init__(self, store: Any, args: argparse.Namespace):
        self.store = store
        self.core = store._core if store is not None else None
        self.args = args
        self.tiers: list[dict] = store.tiers() if store is not None else []
        self.names = [t["name"] for t in self.tiers]

    def tier(self, name: str) -> dict:
        for t in self.tiers:
            if t["name"] == name:
                return t
        raise UsageError(f"no tier named '{name}' in {self.core.policy_source} (tiers: {', '.join(self.names)})")

    def selected_tiers(self, name: str | None) -> list[str]:
        return [self.tier(name)["name"]] if name else list(self.names)

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
        a listing); `verify` and `ls` report unreadable records."""
        try:
            self.core.commit_record(tier, step)
            return True
        except (_core.NotFoundError, _core.IntegrityError):
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
            sizes.raw += sum(i["nbytes"] for i in m["items"])
        return sizes

    def require_committed(self, step: int, tiers: list[str]) -> list[str]:
        """The tiers among `tiers` that have `step` committed, or NotFoundError."""
        have = [t for t in tiers if self.has(t, step)]
        if not have:
            listing = "; ".join(f"{t}: {self.committed(t) or 'none'}" for t in tiers)
            raise _core.NotFoundError(f"step {step} is committed on no tier in {tiers} (committed steps: {listing})")
        return have


def _local_dir(tier: dict) -> str | None:
    """The directory a memory or fs tier lives in; None for kinds that are not directories."""
    if tier["kind"] in ("memory", "fs") and tier["location"]:
        return tier["location"]
    return None


def _uncommitted_details(tier: dict, step: int) -> dict:
    """What is in an uncommitted step's directory: bytes on disk and the ranks whose manifest
    is there (these tiers are plain directories; the layout is in format.rs)."""
    d = _local_dir(tier)
    out: dict[str, Any] = {"stored_bytes": None, "ranks": None, "world_size": None}
    if d is None:
        return out
    path = os.path.join(d, f"step-{step:012d}")
    total, ranks, world = 0, 0, None
    try:
        with os.scandir(path) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False):
                    continue
                total += e.stat(follow_symlinks=False).st_size
                if re.fullmatch(r"rank-\d{5}\.manifest\.json", e.name):
                    ranks += 1
                    try:
                        with open(e.path, "rb") as f:
                            world = json.load(f).get("world_size", world)
                    except (OSError, ValueError):
                        pass
    except OSError:
        return out
    out.update(stored_bytes=total, ranks=ranks, world_size=world)
    return out


# -------------------------------------------------------------------------------------------
# ls
# -------------------------------------------------------------------------------------------


def _tier_summary(t: dict) -> str:
    bits = [t["kind"], t["location"]]
    if t["every"] != 1:
        bits.append(f"every {t['every']}")
    bits.append(f"keep {t['keep']}" if t["keep"] is not None else "keep all")
    if t["compression"] != "none":
        bits.append(t["compression"])
    return ", ".join(bits)


def cmd_ls(ctx: Ctx) -> int:
    doc: dict[str, Any] = {"policy": ctx.core.policy_source, "tiers": []}
    for t in ctx.tiers:
        steps = []
        for info in ctx.scan(t["name"]):
            entry: dict[str, Any] = {"step": info.step, "state": info.state}
            if info.state == "committed":
                ws = info.record["world_size"]
                sizes = ctx.committed_sizes(t["name"], info.step, ws)
                entry.update(world_size=ws, ranks=sizes.ranks, stored_bytes=sizes.stored, raw_bytes=sizes.raw,
                             time=info.record["time"], error="; ".join(sizes.errors) or None)
            elif info.state == "uncommitted":
                entry.update(_uncommitted_details(t, info.step), raw_bytes=None, time=None, error=None)
            else:
                entry.update(world_size=None, ranks=None, stored_bytes=None, raw_bytes=None, time=None, error=info.error)
            steps.append(entry)
        doc["tiers"].append({k: t[k] for k in ("name", "kind", "location", "every", "keep", "compression")} | {"steps": steps})
    if ctx.args.json:
        _json_out(doc)
        return EXIT_OK

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
        if a == b:
            print("  (no steps)")
            continue
        print("  " + lines[0])
        for line in lines[1 + a:1 + b]:
            print("  " + line)
    for n in notes:
        print(f"warning: {n}", file=sys.stderr)
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# inspect
# -------------------------------------------------------------------------------------------


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
    if a.tier:
        ctx.tier(a.tier)
        tier = ctx.require_committed(step, [a.tier])[0]
    else:
        order = list(ctx.core.restore_order) + [n for n in ctx.names if n not in ctx.core.restore_order]
        tier = ctx.require_committed(step, order)[0]
    on = [t for t in ctx.names if ctx.has(t, step)]
    record = json.loads(ctx.core.commit_record(tier, step))
    ws = record["world_size"]
    if a.rank is not None:
        if not 0 <= a.rank < ws:
            raise _core.NotFoundError(f"tier '{tier}': step {step} was saved by {ws} ranks; there is no rank {a.rank}")
        ranks = [a.rank]
    else:
        ranks = list(range(ws))
    doc: dict[str, Any] = {"step": step, "tier": tier, "on_tiers": on, "world_size": ws, "time": record["time"], "ranks": []}
    for r in ranks:
        m = ctx.manifest(tier, step, r)
        items = [_item_facts(i) for i in m["items"]]
        raw = sum(i["nbytes"] for i in items)
        stored = sum(i["stored_bytes"] for i in items)
        doc["ranks"].append({
            "rank": r,
            "format": m["format"],
            "version": m["version"],
            "chunk_size": m["chunk_size"],
            "puts": [name for name, _ in m["trees"]],
            "objects": m["objects"],
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": round(raw / stored, 4) if stored else None,
            "items": items,
        })
    if a.json:
        _json_out(doc)
        return EXIT_OK

    print(f"step {step} on tier '{tier}', world size {ws}, committed {fmt_time(record['time'])}")
    print(f"committed on: {', '.join(on)}")
    for rk in doc["ranks"]:
        print()
        print(f"rank {rk['rank']}: {_n(len(rk['items']), 'item')} in {_n(len(rk['puts']), 'put')} ({', '.join(rk['puts'])}); "
              f"{_n(len(rk['objects']), 'object')}; chunk size {fmt_bytes(rk['chunk_size'])}; "
              f"raw {fmt_bytes(rk['raw_bytes'])}, stored {fmt_bytes(rk['stored_bytes'])} "
              f"({fmt_ratio(rk['raw_bytes'], rk['stored_bytes'])})")
        rows = [[i["name"], i["kind"], i["dtype"], "[" + ", ".join(map(str, i["shape"])) + "]", fmt_bytes(i["nbytes"]),
                 str(i["chunks"]), _codec_mix(i["codecs"]), fmt_bytes(i["stored_bytes"]),
                 fmt_ratio(i["nbytes"], i["stored_bytes"])] for i in rk["items"]]
        for line in table(["ITEM", "KIND", "DTYPE", "SHAPE", "BYTES", "CHUNKS", "CODECS", "STORED", "RATIO"], rows,
                          right={4, 5, 7, 8}):
            print("  " + line)
    if len(doc["ranks"]) > 1:
        raw = sum(r["raw_bytes"] for r in doc["ranks"])
        stored = sum(r["stored_bytes"] for r in doc["ranks"])
        print()
        print(f"all {len(doc['ranks'])} ranks: {_n(sum(len(r['items']) for r in doc['ranks']), 'item')}; "
              f"raw {fmt_bytes(raw)}, stored {fmt_bytes(stored)} ({fmt_ratio(raw, stored)})")
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# verify
# -------------------------------------------------------------------------------------------


@dataclass
class Problem:
    tier: str
    step: int
    rank: int | None
    item: str | None
    #: "corrupt" (checksum, decode, missing data: exit 1) or "error" (could not check: exit 4).
    kind: str
    message: str

    def where(self) -> str:
        w = f"tier '{self.tier}' step {self.step}"
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
    checked = {"tier": tier, "step": step, "ranks": 0, "items": 0, "bytes": 0, "ok": True, "vanished": False}
    if info.state != "committed":
        Progress("", 0).finish(f"verify: tier '{tier}' step {step}: {info.state}")
        return [Problem(tier, step, None, None, "corrupt", info.error or info.state)], checked | {"ok": False}
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
    prog = Progress(f"verify {tier} step {step}", ws, total, unit="ranks")
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
    prog.finish(f"verify: tier '{tier}' step {step}: {checked['ranks']}/{ws} ranks, {checked['items']} items, "
                f"{fmt_bytes(done_bytes)}: {status}")
    return problems, checked


def cmd_verify(ctx: Ctx) -> int:
    a = ctx.args
    tiers = ctx.selected_tiers(a.tier)
    targets: list[tuple[str, StepInfo]] = []
    for t in tiers:
        for info in ctx.scan(t):
            if info.state == "uncommitted":
                continue
            if a.step is None or info.step == a.step:
                targets.append((t, info))
    if a.step is not None and not targets:
        ctx.require_committed(a.step, tiers)  # raises NotFoundError naming what there is
    problems: list[Problem] = []
    checked: list[dict] = []
    for t, info in targets:
        p, c = _verify_step(ctx, t, info)
        problems += p
        checked.append(c)
        for pr in p:
            if not a.json:
                print(f"{pr.kind.upper()}: {pr.where()}: {pr.detail()}", flush=True)
    corrupt = any(p.kind == "corrupt" for p in problems)
    code = EXIT_CORRUPT if corrupt else EXIT_ERROR if problems else EXIT_OK
    if a.json:
        _json_out({"ok": not problems, "exit_code": code, "checked": checked, "problems": [p.as_json() for p in problems]})
        return code
    steps = [c for c in checked if not c["vanished"]]
    if not steps:
        print(f"nothing to verify: no committed steps on {', '.join(tiers)}")
        return code
    summary = (f"verified {_n(len(steps), 'step copy', 'step copies')} on {', '.join(sorted({c['tier'] for c in steps}, key=tiers.index))}: "
               f"{_n(sum(c['ranks'] for c in steps), 'rank')}, {_n(sum(c['items'] for c in steps), 'item')}, "
               f"{fmt_bytes(sum(c['bytes'] for c in steps))}")
    if not problems:
        print(f"{summary}: all checksums hold")
    else:
        n_c = sum(p.kind == "corrupt" for p in problems)
        n_e = len(problems) - n_c
        what = ", ".join(x for x in (f"{n_c} corrupt" if n_c else "", f"{n_e} unreadable" if n_e else "") if x)
        print(f"{summary}: {what}")
    return code


# -------------------------------------------------------------------------------------------
# cp, rm
# -------------------------------------------------------------------------------------------


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


# -------------------------------------------------------------------------------------------
# gc
# -------------------------------------------------------------------------------------------

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
    root = _local_dir(tier)
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
    n_steps = n_tmp = n_uploads = 0
    for t in ctx.tiers:
        name = t["name"]
        infos = ctx.scan(name)
        committed = [i.step for i in infos if i.committed]
        newest = committed[-1] if committed else None
        keep = t["keep"]
        beyond = set(committed[:-keep] if keep is not None and len(committed) > keep else [])
        leftovers = {i.step for i in infos if not i.committed and newest is not None and i.step < newest}
        if a.dry_run:
            removed = sorted(beyond | leftovers)
        else:
            # Abandoned multipart uploads (s3, gcs) first; retention would also do it, silently.
            for line in ctx.core.sweep(name):
                print(f"{name}: {line}")
                n_uploads += 1
            removed = list(ctx.core.retain(name))
        for s in sorted(removed):
            why = f"committed; beyond keep {keep}" if s in committed else "uncommitted leftover"
            print(f"{name}: {verb} step {s} ({why})")
        n_steps += len(removed)
        root = _local_dir(t)
        for d, fname, size in list(_stale_tmp_files(t, set(removed), a.tmp_age)):
            if a.dry_run or _remove_tmp(root, d, fname):
                n_tmp += 1
                print(f"{name}: {verb} {d}/{fname} (stale temporary file, {fmt_bytes(size)})")
    if n_steps or n_tmp or n_uploads:
        uploads = f", aborted {_n(n_uploads, 'abandoned upload')}" if n_uploads else ""
        print(f"gc: {verb} {_n(n_steps, 'step')} and {_n(n_tmp, 'temporary file')}{uploads}")
    else:
        print("gc: nothing to remove")
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------


def _step(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="tiercel",
        description="Look at, check, copy and clean up the checkpoints of a tiercel policy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--policy", metavar="FILE", help="policy file (default: $TIERCEL_POLICY, else ./tiercel.toml)")
    p.add_argument("--version", action="version", version=f"tiercel {__version__} (format {_core.FORMAT_VERSION})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("ls", help="steps per tier: state, ranks, size, commit time",
                       description="Lists every step on every tier: committed steps and uncommitted leftovers, "
                                   "with their size (stored bytes of all ranks), raw size, world size and commit time.")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", help="the manifests of a step: items, dtypes, shapes, chunks, compression",
                       description="Shows the manifest of each rank of a step on one tier (default: the first tier "
                                   "in restore order that has it).")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("--tier", metavar="T", help="the tier to read the manifests from")
    s.add_argument("--rank", type=int, metavar="R", help="only this rank")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="re-read every chunk and check every checksum",
                       description="Reads every chunk of every rank of committed steps from each tier on its own "
                                   "and checks every checksum. Exit code 0: all good; 1: corruption found; "
                                   "3: the step is not committed on the tiers asked; 4: a tier could not be read.")
    s.add_argument("step", type=_step, nargs="?", metavar="STEP", help="default: every committed step")
    s.add_argument("--tier", metavar="T", help="default: every tier")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("cp", help="copy a committed step (every rank) between tiers",
                       description="Copies a committed step, every rank, from one tier to another and commits it there.")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("--from", dest="source", required=True, metavar="TIER")
    s.add_argument("--to", dest="dest", required=True, metavar="TIER")
    s.set_defaults(func=cmd_cp)

    s = sub.add_parser("gc", help="apply `keep`, remove uncommitted leftovers and stale temporary files",
                       description="On each tier: aborts multipart uploads that killed writers left (s3, gcs), "
                                   "removes committed steps beyond `keep` and uncommitted steps older "
                                   "than the newest committed one, then temporary files (\".tmp-\" in the name) in "
                                   "step directories whose writer is gone.")
    s.add_argument("--dry-run", action="store_true", help="only print what would be removed (uploads are not checked)")
    s.add_argument("--tmp-age", type=float, default=DEFAULT_TMP_AGE, metavar="SECONDS",
                   help=f"leave temporary files younger than this (default: {DEFAULT_TMP_AGE:.0f})")
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("rm", help="delete a step from a tier", description="Deletes a step from one tier (no question asked).")
    s.add_argument("step", type=_step, metavar="STEP")
    s.add_argument("--tier", required=True, metavar="T")
    s.set_defaults(func=cmd_rm)

    s = sub.add_parser("placement", help="GEMINI replica placement and the chance of surviving k host failures",
                       description="Prints the groups (and ring) that GEMINI's placement forms for N hosts with m "
                                   "copies each, and the exact probability that no host loses every copy of its "
                                   "shards when k hosts fail at once, for group, ring and mixed placement, beside "
                                   "GEMINI's closed form. Needs no policy.")
    s.add_argument("--hosts", type=int, required=True, metavar="N")
    s.add_argument("--replicas", type=int, required=True, metavar="M")
    s.add_argument("--failures", type=int, metavar="K")
    s.set_defaults(func=cmd_placement, needs_store=False)
    return p


def cmd_placement(ctx: Ctx) -> int:
    from .placement import report

    print(report(ctx.args.hosts, ctx.args.replicas, ctx.args.failures))
    return EXIT_OK


def _open_store(policy: str | None) -> Any:
    from .store import Store

    origin = "--policy"
    if policy is None:
        env = os.environ.get("TIERCEL_POLICY")
        policy, origin = (env, "$TIERCEL_POLICY") if env else ("tiercel.toml", "default")
    if not os.path.isfile(policy):
        hint = "" if origin != "default" else "; give --policy FILE or set $TIERCEL_POLICY"
        raise UsageError(f"policy file {policy} (from {origin}) does not exist{hint}")
    return Store(policy, rank=0, world_size=1)


def _fail(message: str, code: int) -> int:
    print(f"tiercel: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    store = None
    try:
        if getattr(args, "needs_store", True):
            store = _open_store(args.policy)
        return args.func(Ctx(store, args))
    except UsageError as e:
        return _fail(str(e), EXIT_USAGE)
    except _core.ConfigError as e:
        return _fail(str(e), EXIT_USAGE)
    except _core.NotFoundError as e:
        return _fail(str(e), EXIT_NOT_FOUND)
    except _core.IntegrityError as e:
        return _fail(str(e), EXIT_CORRUPT)
    except _core.TiercelError as e:
        return _fail(str(e), EXIT_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # `tiercel ls | head`: the reader went away; stay quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    finally:
        if store is not None:
            try:
                store.close()
            except Exception:
                pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
