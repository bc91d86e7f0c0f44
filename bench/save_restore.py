"""Save and restore of a 1 GiB state: tiercel against the physical limit and torch.save.

Measured side by side in one run:
  - the physical limit: a numpy copy of the state into a preallocated buffer (memcpy);
  - tiercel: the blocking part of save() (copy into the memory tier), the background
    persist to an fs tier, restore() from the memory tier and from the fs tier;
  - what a user would otherwise do: torch.save / torch.load to the same directory and to
    /dev/shm.
Targets (issue #2): save blocking <= 1.5x memcpy, restore from RAM <= 1.5x memcpy.

    python bench/save_restore.py [--gib 1] [--repeat 5] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tiercel

from _measure import drop_page_cache, median_time, write_results

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    ap.add_argument("--tensors", type=int, default=16, help="number of tensors the state is split into")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"), help="disk directory for the fs tier and torch.save")
    ap.add_argument("--out", default=str(HERE / "results" / "save_restore.json"))
    args = ap.parse_args()

    nbytes = int(args.gib * (1 << 30)) // args.tensors // 4 * 4 * args.tensors
    per = nbytes // args.tensors // 4
    print(f"state: {args.tensors} float32 tensors, {nbytes / (1 << 30):.2f} GiB; {args.repeat} repetitions, medians", flush=True)
    gen = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(args.tensors)}}
    flat = [t.numpy() for t in state["model"].values()]

    disk = Path(tempfile.mkdtemp(prefix="tiercel-bench-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-", dir="/dev/shm"))
    results: dict[str, dict] = {}

    def record(name: str, seconds: float, samples: list[float] | None = None, note: str = "") -> None:
        results[name] = {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "samples": samples or [seconds], "note": note}
        print(f"  {name:<38} {seconds * 1e3:9.1f} ms  {nbytes / seconds / 1e9:6.2f} GB/s  {note}", flush=True)

    try:
        # -- the physical limit ------------------------------------------------------------
        print("physical limit", flush=True)
        dst = [np.empty_like(a) for a in flat]
        for d in dst:
            d.fill(1)  # touch the pages: the limit is the copy, not page faults

        def memcpy():
            for d, a in zip(dst, flat):
                np.copyto(d, a)

        record("memcpy (numpy copy, preallocated)", *median_time(memcpy, args.repeat))
        dst.clear()

        # -- tiercel ---------------------------------------------------------------------------
        print("tiercel", flush=True)
        policy = {
            "tier": [
                {"name": "ram", "kind": "memory", "root": str(shm / "ram"), "keep": 2},
                {"name": "disk", "kind": "fs", "url": str(disk / "tiercel"), "keep": 1, "compression": "none"},
            ],
            "restore": {"order": ["ram", "disk"]},
        }
        store = tiercel.Store(policy, rank=0, world_size=1)
        h = store.save(0, state)
        first = h.blocking_seconds
        h.wait()
        record("tiercel save, first (fresh shm pages)", first, note="pages allocated on the critical path")
        blocking, persists = [], []
        for step in range(1, args.repeat + 2):
            h = store.save(step, state)
            t0 = time.perf_counter()
            h.wait()
            blocking.append(h.blocking_seconds)
            persists.append(h.blocking_seconds + time.perf_counter() - t0)
        blocking, persists = blocking[1:], persists[1:]  # steady state: recycled segments
        record("tiercel save, blocking", statistics.median(blocking), blocking, "steady state, recycled segments")
        record("tiercel save, until on disk (fs tier)", statistics.median(persists), persists, "background: checksum + write + fsync")
        last = args.repeat + 1

        def restore_ram():
            s = store.restore(last)
            assert store.last_restore.tiers == {"ram": args.tensors}, store.last_restore
            return s

        record("tiercel restore from RAM", *median_time(restore_ram, args.repeat), note="zero-copy views, checksums verified")

        def restore_disk():
            return store.reader(last, tiers=["disk"]).get_all()

        cold = drop_page_cache()
        if cold:
            t0 = time.perf_counter()
            restore_disk()
            record("tiercel restore from disk, cold", time.perf_counter() - t0, note="page cache dropped")
        record("tiercel restore from disk, warm", *median_time(restore_disk, args.repeat), note="file in page cache")
        restored = store.restore(last)
        for k, t in state["model"].items():
            assert torch.equal(restored["model"][k], t), k
        del restored
        store.close()

        # -- torch.save / torch.load -------------------------------------------------------------
        print("torch.save / torch.load", flush=True)
        for where, base in (("disk", disk), ("/dev/shm", shm)):
            path = base / "torch_ckpt.pt"

            def tsave():
                torch.save(state, path)

            def tsave_fsync():
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())

            record(f"torch.save to {where}", *median_time(tsave, args.repeat), note="no fsync")
            if where == "disk":
                record("torch.save to disk + fsync", *median_time(tsave_fsync, args.repeat), note="as durable as the fs tier")
            record(f"torch.load from {where}", *median_time(lambda: torch.load(path), args.repeat), note="warm page cache")
            path.unlink()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    memcpy_s = results["memcpy (numpy copy, preallocated)"]["seconds"]
    checks = {
        "save blocking <= 1.5x memcpy": results["tiercel save, blocking"]["seconds"] / memcpy_s,
        "restore from RAM <= 1.5x memcpy": results["tiercel restore from RAM"]["seconds"] / memcpy_s,
    }
    print("\nratios", flush=True)
    rows = []
    for name, r in results.items():
        r["vs_memcpy"] = r["seconds"] / memcpy_s
        rows.append(f"| {name} | {r['seconds'] * 1e3:.1f} | {r['gb_per_s']:.2f} | {r['vs_memcpy']:.2f}x | {r['note']} |")
    comparisons = {
        "tiercel save blocking vs torch.save to /dev/shm": results["torch.save to /dev/shm"]["seconds"] / results["tiercel save, blocking"]["seconds"],
        "tiercel save blocking vs torch.save to disk": results["torch.save to disk"]["seconds"] / results["tiercel save, blocking"]["seconds"],
        "tiercel restore from RAM vs torch.load from /dev/shm": results["torch.load from /dev/shm"]["seconds"] / results["tiercel restore from RAM"]["seconds"],
        "tiercel restore from disk (warm) vs torch.load from disk": results["torch.load from disk"]["seconds"] / results["tiercel restore from disk, warm"]["seconds"],
    }
    table = "\n".join(
        ["| operation | median ms | GB/s | vs memcpy | note |", "|---|---:|---:|---:|---|", *rows]
        + ["", "| tiercel is faster by | factor |", "|---|---:|"]
        + [f"| {k} | {v:.1f}x |" for k, v in comparisons.items()]
        + ["", "| target | measured | met |", "|---|---:|---|"]
        + [f"| {k} | {v:.2f}x | {'yes' if v <= 1.5 else 'NO'} |" for k, v in checks.items()]
    )
    print(table)
    out = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "state_bytes": nbytes,
        "cold_disk_read": "measured" if cold else "not measured (page cache could not be dropped)",
        "results": results,
        "comparisons": comparisons,
        "targets": checks,
        "table_markdown": table,
    }
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
