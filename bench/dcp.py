"""torch.distributed.checkpoint (DCP): tiercel's storage writer and reader against DCP's own
FileSystemWriter / FileSystemReader, on the same sharded state, in one run.

Two ranks (gloo on 127.0.0.1, CPU) hold a state of float32 DTensors sharded on dim 0, the
shape FSDP2 gives a model. Measured, every time as the slowest rank's:
  - the physical limit: each rank copies its shards into preallocated, touched buffers (memcpy);
  - DCP's FileSystemWriter to a disk directory and to /dev/shm: dcp.save (all of it blocks),
    and dcp.async_save with its default stager (the writer's own: a fresh CPU copy), where
    only the staging blocks and the write follows in a thread;
  - tiercel.dcp.Writer with a memory tier and an uncompressed fs tier: dcp.save and
    dcp.async_save (staging straight into shared memory: one copy), the time until the step
    is also on disk;
  - loads into preallocated DTensors: FileSystemReader from disk (cold page cache where it
    can be dropped, else warm) and from /dev/shm, tiercel.dcp.Reader from RAM; where the
    launcher can mount a tmpfs with huge pages (root), both again from there.
Targets (issue #10): tiercel's async_save blocking <= 1/5 of DCP's async_save with its
default stager; load from RAM >= 5x faster than FileSystemReader from /dev/shm.

    python bench/dcp.py [--gib 1] [--tensors 16] [--repeat 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tiercel.dcp

from _measure import drop_page_cache, huge_tmpfs, write_results

HERE = Path(__file__).resolve().parent
WORLD = 2


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size over all ranks in GiB (default 1)")
    ap.add_argument("--tensors", type=int, default=16, help="number of sharded tensors")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"), help="disk directory for DCP and the fs tier")
    ap.add_argument("--out", default=str(HERE / "results" / "dcp.json"))
    ap.add_argument("--base", help=argparse.SUPPRESS)  # set by the launcher for its ranks
    return ap


def main() -> int:
    """Starts the ranks; rank 0 prints the table and writes the results."""
    args = args_parser().parse_args()
    if "RANK" in os.environ:
        return rank_main(args)
    disk = Path(tempfile.mkdtemp(prefix="tiercel-bench-dcp-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-dcp-", dir="/dev/shm"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # One tmpfs for both ranks (one host): a DCP copy, tiercel's two kept steps and the
    # segment pre-faulted for the next save.
    with huge_tmpfs(5 * int(args.gib * (1 << 30))) as huge:
        return launch(disk, shm, huge, port)


def launch(disk: Path, shm: Path, huge: Path | None, port: int) -> int:
    procs = []
    try:
        for rank in range(WORLD):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"}
            base = json.dumps([str(disk), str(shm), str(huge) if huge else ""])
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--base", base], env=env))
        return max(abs(p.wait()) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def make_state(mesh: Any, nbytes: int, tensors: int, rank: int) -> dict[str, Any]:
    cols = 1024
    rows = max(WORLD, nbytes // 4 // cols // tensors // WORLD * WORLD)
    gen = torch.Generator().manual_seed(rank)
    local = rows // WORLD
    return {"model": {f"layer{i}.weight": DTensor.from_local(torch.randn(local, cols, generator=gen), mesh, [Shard(0)],
                                                             run_check=False, shape=torch.Size((rows, cols)),
                                                             stride=(cols, 1))
                      for i in range(tensors)}}


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                            shape=v.shape, stride=v.stride())
                      for k, v in state["model"].items()}}


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    disk_s, shm_s, huge_s = json.loads(args.base)
    disk, shm, huge = Path(disk_s), Path(shm_s), Path(huge_s) if huge_s else None
    state = make_state(mesh, int(args.gib * (1 << 30)), args.tensors, rank)
    local = [v.to_local() for v in state["model"].values()]
    nbytes = sum(t.numel() * t.element_size() for t in local) * WORLD
    results: dict[str, dict] = {}

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    def record(name: str, samples: list[float], note: str = "") -> None:
        med = statistics.median(samples)
        results[name] = {"seconds": med, "gb_per_s": nbytes / med / 1e9, "samples": samples, "note": note}
        say(f"  {name:<44} {med * 1e3:9.1f} ms  {nbytes / med / 1e9:6.2f} GB/s  {note}")

    def measure(fn: Callable[[int], float]) -> list[float]:
        """Runs fn(i) for a warm-up (i = -1) and `repeat` repetitions; fn returns its
        seconds. Each sample is the slowest rank's."""
        out = []
        for i in range(-1, args.repeat):
            dist.barrier()
            dt = slowest(fn(i))
            if i >= 0:
                out.append(dt)
        return out

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def remove(path: Path) -> None:
        dist.barrier()  # every rank's files are written
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    say(f"state: {args.tensors} float32 DTensors sharded over {WORLD} ranks, {nbytes / (1 << 30):.2f} GiB; "
        f"{args.repeat} repetitions, medians, slowest rank")
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(shm / "tiercel"), "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(disk / "tiercel"), "keep": 1, "compression": "none"},
        ],
        "restore": {"order": ["ram", "disk"]},
    }
    try:
        say("physical limit")
        dst = [torch.ones_like(t) for t in local]

        def memcpy(i: int) -> float:
            return timed(lambda: [np.copyto(d.numpy(), t.numpy()) for d, t in zip(dst, local)])

        record("memcpy (each rank its shards, preallocated)", measure(memcpy))

        say("DCP FileSystemWriter")
        dirs: dict[str, Path] = {"disk": disk, "/dev/shm": shm}
        counter = iter(range(1 << 30))
        kept: dict[str, Path] = {}  # the last sync save to each place, for the loads
        for where, parent in dirs.items():
            def save(i: int, parent: Path = parent, where: str = where) -> float:
                path = parent / f"dcp-{next(counter)}"
                dt = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path)))
                if where in kept:
                    remove(kept[where])
                kept[where] = path
                return dt

            record(f"DCP save to {where}", measure(save))
            blocking: list[float] = []

            def async_save(i: int, parent: Path = parent) -> float:
                path = parent / f"dcp-{next(counter)}"
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path))
                blocked = time.perf_counter() - t0
                fut.result()
                total = time.perf_counter() - t0
                b = slowest(blocked)
                if i >= 0:
                    blocking.append(b)
                remove(path)
                return total

            total = measure(async_save)
            record(f"DCP async_save to {where}, blocking", blocking, "default stager: a fresh CPU copy")
            record(f"DCP async_save to {where}, until written", total)

        say("tiercel.dcp.Writer (memory tier + fs tier)")
        steps = iter(range(1, 1 << 30))
        durable: list[float] = []

        def tiercel_save(i: int) -> float:
            w = tiercel.dcp.Writer(policy, step=next(steps))
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=w)
            blocked = time.perf_counter() - t0
            assert w.handle is not None
            w.handle.wait()
            d = slowest(time.perf_counter() - t0)
            if i >= 0:
                durable.append(d)
            return blocked

        record("tiercel save, blocking", measure(tiercel_save), "in shared memory, committed in the background")
        record("tiercel save, until on disk", durable, "fs tier, uncompressed, fsync")
        t_blocking: list[float] = []

        def tiercel_async(i: int) -> float:
            w = tiercel.dcp.Writer(policy, step=next(steps))
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=w)
            blocked = time.perf_counter() - t0
            fut.result()
            assert w.handle is not None
            w.handle.wait()
            b = slowest(blocked)
            if i >= 0:
                t_blocking.append(b)
            return time.perf_counter() - t0

        until = measure(tiercel_async)
        record("tiercel async_save, blocking", t_blocking, "staged once, straight into shared memory")
        record("tiercel async_save, until on disk", until)

        say("loads into preallocated DTensors")
        target = zeros_like(state)
        cold = drop_page_cache()

        def fs_load(i: int, where: str) -> float:
            if where == "disk" and cold:
                drop_page_cache()
                dist.barrier()
            return timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(kept[where])))

        record("DCP load from disk" + (", cold" if cold else ", warm"), measure(lambda i: fs_load(i, "disk")))
        record("DCP load from /dev/shm", measure(lambda i: fs_load(i, "/dev/shm")))
        record("DCP load, a reader that copies nothing", measure(lambda i: timed(
            lambda: dcp.load(target, storage_reader=NothingReader(kept["/dev/shm"])))), "DCP's own cost: any reader's floor")
        newest = next(steps) - 1
        record("tiercel load from RAM",
               measure(lambda i: timed(lambda: dcp.load(target, storage_reader=tiercel.dcp.Reader(policy, step=newest)))))
        for a, b in zip(target["model"].values(), state["model"].values()):
            assert torch.equal(a.to_local(), b.to_local()), "tiercel load returned other values"
        if huge is not None:
            huge_loads(state, target, huge, measure, timed, record)
        else:
            say("(no huge-page tmpfs: mounting one needs root; its rows are left out)")

        if rank == 0:
            report(results, args, nbytes)
    finally:
        tiercel.dcp.close()
        dist.barrier()
        dist.destroy_process_group()
    return 0


class NothingReader(dcp.FileSystemReader):
    """DCP's FileSystemReader that reads the metadata and plans as usual but reads no data:
    what dcp.load costs before any byte moves (planning, its collectives, the metadata). Any
    reader's load takes at least this plus a memcpy of the bytes into the targets."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_result(None)
        return fut


def huge_loads(state: dict[str, Any], target: dict[str, Any], huge: Path, measure: Callable, timed: Callable,
               record: Callable) -> None:
    """The loads again from a tmpfs with huge pages: DCP's files there, and tiercel's memory
    tier rooted there (which then copies out of mapped memory, see docs/config.md)."""
    path = huge / "dcp"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    record("DCP load from huge-page tmpfs",
           measure(lambda i: timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(path)))))
    policy = {"tier": [{"name": "ram", "kind": "memory", "root": str(huge / "tiercel"), "keep": 2}]}
    w = tiercel.dcp.Writer(policy, step=1)
    dcp.save(state, storage_writer=w)
    assert w.handle is not None
    w.handle.wait()
    record("tiercel load from RAM, huge pages",
           measure(lambda i: timed(lambda: dcp.load(target, storage_reader=tiercel.dcp.Reader(policy, step=1)))))
    for a, b in zip(target["model"].values(), state["model"].values()):
        assert torch.equal(a.to_local(), b.to_local()), "tiercel load from huge pages returned other values"


def report(results: dict[str, dict], args: argparse.Namespace, nbytes: int) -> None:
    def s(name: str) -> float:
        return results[name]["seconds"]

    ratios = {
        "tiercel async_save blocking vs DCP async_save to /dev/shm (blocking)": s("DCP async_save to /dev/shm, blocking") / s("tiercel async_save, blocking"),
        "tiercel async_save blocking vs DCP async_save to disk (blocking)": s("DCP async_save to disk, blocking") / s("tiercel async_save, blocking"),
        "tiercel save blocking vs DCP save to disk": s("DCP save to disk") / s("tiercel save, blocking"),
        "tiercel load from RAM vs DCP load from /dev/shm": s("DCP load from /dev/shm") / s("tiercel load from RAM"),
    }
    # No reader can load faster than DCP's own cost plus one copy of the bytes into the targets.
    ratios["the most any reader could reach vs DCP load from /dev/shm (DCP's own cost + memcpy)"] = (
        s("DCP load from /dev/shm") / (s("DCP load, a reader that copies nothing") + s("memcpy (each rank its shards, preallocated)")))
    if "tiercel load from RAM, huge pages" in results:
        ratios["tiercel load from RAM (huge pages) vs DCP load from /dev/shm"] = (
            s("DCP load from /dev/shm") / s("tiercel load from RAM, huge pages"))
        ratios["tiercel load from RAM (huge pages) vs DCP load from the huge-page tmpfs"] = (
            s("DCP load from huge-page tmpfs") / s("tiercel load from RAM, huge pages"))
    print("\n| tiercel is faster by | factor |\n|---|---:|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.1f}x |")
    targets = {
        "async_save blocking <= 1/5 of DCP's (default stager, /dev/shm)": ratios["tiercel async_save blocking vs DCP async_save to /dev/shm (blocking)"] >= 5,
        "load from RAM >= 5x faster than FileSystemReader from /dev/shm": ratios["tiercel load from RAM vs DCP load from /dev/shm"] >= 5,
    }
    for k, ok in targets.items():
        print(f"target: {k}: {'met' if ok else 'NOT met'}")
    write_results(args.out, {
        "bench": "dcp", "gib": nbytes / (1 << 30), "tensors": args.tensors, "repeat": args.repeat, "ranks": WORLD,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": results, "ratios": ratios, "targets": targets,
    })


if __name__ == "__main__":
    sys.exit(main())
