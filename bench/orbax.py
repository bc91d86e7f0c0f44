"""Orbax's CheckpointManager with its own StandardCheckpointHandler on local disk against the
same manager with tiercel's handler, on one sharded pytree, in one run.

A JAX job of 2 processes x 2 CPU devices (jax.distributed on 127.0.0.1) holds a pytree of
float32 matrices sharded over a 2x2 mesh (plus a replicated vector and a scalar). Measured,
per process, the job waiting for its slowest process (the maximum over processes is
reported); every timed save starts on all processes at once, as after a training step:
  - the physical limit: copying the process's shards into preallocated host buffers (memcpy);
  - CheckpointManager alone: `mngr.save` with a handler that saves nothing, the floor under
    any handler's `mngr.save`;
  - Orbax: `mngr.save(StandardSave)` blocking time (async checkpointing, the default), the
    time until the step is on disk (`wait_until_finished`), the full `mngr.restore`;
  - tiercel: the same manager calls with tiercel.orbax's handler: blocking time (the copy into
    the memory tier), time until the fs tier has the step, restore from the memory tier, and
    restore from the fs tier (a policy that reads the fs tier first).
The saves run twice: with the manager's defaults, and with the options that make its own
barriers cheaper (`MANAGER_OPTIONS`), the same for every handler.
Goals (issue 9): save blocking >= 10x shorter than Orbax's; restore from RAM >= 5x faster
than Orbax from local disk.

    python bench/orbax.py [--mib 1024] [--arrays 8] [--repeat 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# This file is bench/orbax.py: its directory must not shadow the `orbax` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import orbax.checkpoint as ocp  # noqa: E402

sys.path.append(str(HERE))
from _measure import write_results  # noqa: E402

NPROC, NDEV = 2, 2
#: Untimed saves first: with keep = 2, the third save is the first to reuse evicted memory
#: (steady state), as it would in a training run.
WARMUP = 3


# -- one process of the job ----------------------------------------------------------------------


class TimedStandardHandler(ocp.handlers.StandardCheckpointHandler):
    """Orbax's own handler, timing its blocking part (`async_save` up to its futures) as
    tiercel's handler does (`last_blocking_seconds`)."""

    last_blocking_seconds = 0.0

    async def async_save(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        futures = await super().async_save(*args, **kwargs)
        self.last_blocking_seconds = time.perf_counter() - t0
        return futures


class NullHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves nothing and returns no future: `mngr.save` with it is CheckpointManager's own
    blocking work, which no handler can avoid."""

    last_blocking_seconds = 0.0

    async def async_save(self, directory: Any, args: Any = None) -> None:
        return None

    def save(self, directory: Any, args: Any = None) -> None:
        pass

    def restore(self, directory: Any, args: Any = None) -> None:
        return None


@ocp.args.register_with_handler(NullHandler, for_save=True)
@dataclasses.dataclass
class NullSave(ocp.args.CheckpointArgs):
    item: Any = None


#: Manager options, each documented by Orbax, that shorten what `mngr.save` does itself:
#: with `active_processes` set, Orbax's barriers are the coordination service's (one round
#: trip) instead of a small all-gather compiled and run on every device (its default on
#: CPU-only JAX); `skip_sync_file_validations` drops the check that the step directory does
#: not exist yet. (`create_directories_asynchronously` is already Orbax's default.)
MANAGER_OPTIONS = ("active_processes = all processes (Orbax's barriers through the coordination service), "
                   "create = False, skip_sync_file_validations = True")


def worker(cfg: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", NDEV)
    jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", num_processes=NPROC, process_id=cfg["pid"])
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tiercel.orbax

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    rows = int(np.sqrt(cfg["per_array"] / 4 / 2)) // 2 * 2 or 2  # 2:1 matrices, even rows
    cols = max(2, cfg["per_array"] // 4 // rows // 2 * 2)
    rng = np.random.default_rng(0)

    def array(shape: tuple[int, ...], spec: P) -> jax.Array:
        host = rng.standard_normal(shape, dtype=np.float32)  # the same in every process
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda idx: host[idx])

    state = {
        "params": {f"layer{i}": array((rows, cols), P("x", "y")) for i in range(cfg["arrays"])},
        "bias": array((cols,), P()),
        "scale": array((), P()),
    }
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    local = [np.asarray(s.data) for x in jax.tree.leaves(state) for s in x.addressable_shards if s.replica_id == 0]
    nbytes = sum(a.nbytes for a in local)
    out: dict[str, Any] = {"pid": cfg["pid"], "local_bytes": nbytes,
                           "global_bytes": sum(x.nbytes for x in jax.tree.leaves(state))}
    repeat = cfg["repeat"]

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # The physical limit: one copy of this process's shards into touched host buffers.
    dst = [np.ones_like(a) for a in local]

    def memcpy() -> None:
        for d, a in zip(dst, local):
            np.copyto(d, a)

    out["memcpy"] = statistics.median(timed(memcpy) for _ in range(repeat))
    dst.clear()

    def progress(what: str) -> None:
        if cfg["pid"] == 0:
            print(f"  [{time.strftime('%H:%M:%S')}] {what}", flush=True)

    def check(restored: Any) -> None:
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            for sa, sb in zip(a.addressable_shards, b.addressable_shards):
                assert np.asarray(sa.data).tobytes() == np.asarray(sb.data).tobytes()

    barrier = itertools.count()

    def together() -> None:
        """All processes start the next timed call at once, as the collectives of a training
        step leave them: otherwise the first barrier of `mngr.save` would count how much
        later the other process finished the untimed wait before it."""
        multihost_utils.sync_global_devices(f"bench-orbax-{next(barrier)}")

    def run(name: str, mngr: ocp.CheckpointManager, save_args: Any, restore_args: Any, durable: Any, handler: Any) -> None:
        """Saves WARMUP + repeat steps, times the last `repeat`, restores the last step
        `repeat` times (unless `restore_args` is None)."""
        progress(f"{name}: {WARMUP} + {repeat} saves" + (f", {repeat} restores" if restore_args else ""))
        blocking, in_handler, until_durable, restores = [], [], [], []
        for step in range(WARMUP + repeat):
            together()
            t0 = time.perf_counter()
            mngr.save(step, args=ocp.args.Composite(state=save_args(state)))
            t1 = time.perf_counter()
            durable()
            if step >= WARMUP:
                blocking.append(t1 - t0)
                in_handler.append(handler.last_blocking_seconds)
                until_durable.append(time.perf_counter() - t0)
        out[name] = {"save_blocking": statistics.median(blocking), "handler_blocking": statistics.median(in_handler),
                     "until_durable": statistics.median(until_durable)}
        if restore_args is None:
            return
        last = mngr.latest_step()
        for _ in range(repeat):
            together()
            t0 = time.perf_counter()
            restored = mngr.restore(last, args=ocp.args.Composite(state=restore_args(abstract)))["state"]
            jax.block_until_ready(restored)
            restores.append(time.perf_counter() - t0)
        check(restored)
        out[name]["restore"] = statistics.median(restores)

    base = Path(cfg["dir"])

    def manager(name: str, handler: Any, save_args: Any, restore_args: Any, lean: bool) -> ocp.CheckpointManager:
        reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
        reg.add("state", save_args, handler)
        if restore_args is not None:
            reg.add("state", restore_args, handler)
        options = ocp.CheckpointManagerOptions(max_to_keep=2)
        if lean:  # MANAGER_OPTIONS; with active_processes Orbax leaves the root directory to the caller
            (base / name / "orbax").mkdir(parents=True, exist_ok=True)
            options = ocp.CheckpointManagerOptions(
                max_to_keep=2, create=False,
                multiprocessing_options=ocp.options.MultiprocessingOptions(active_processes=set(range(jax.process_count()))),
                file_options=ocp.options.FileOptions(skip_sync_file_validations=True))
        return ocp.CheckpointManager(base / name / "orbax", options=options, handler_registry=reg)

    def tiercel_handler(name: str, order: list[str]) -> tiercel.orbax.TiercelCheckpointHandler:
        # A memory tier + an fs tier on the same disk, no compression (Orbax writes raw too).
        tiers = [
            {"name": "ram", "kind": "memory", "root": f"{cfg['shm']}/{name}", "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(base / name / "disk"), "keep": 2, "compression": "none"},
        ]
        return tiercel.orbax.TiercelCheckpointHandler({"tier": tiers, "restore": {"order": order}})

    def tiercel_run(name: str, order: list[str], lean: bool, restore: bool) -> None:
        handler = tiercel_handler(name, order)
        mngr = manager(name, handler, tiercel.orbax.Save, tiercel.orbax.Restore, lean)

        def durable() -> None:
            mngr.wait_until_finished()  # Orbax's own finalize (its step directory)
            assert handler.last_save is not None
            handler.last_save.wait()  # the fs tier has this process's part (tiercel's background)

        run(name, mngr, tiercel.orbax.Save, tiercel.orbax.Restore if restore else None, durable, handler)
        if restore:
            assert handler.last_restore is not None
            out[name]["restored_from"] = handler.last_restore.tiers
        together()  # both processes done before the next round
        mngr.close()
        shutil.rmtree(f"{cfg['shm']}/{name}", ignore_errors=True)

    for suffix, lean in (("", False), ("_lean", True)):
        # CheckpointManager alone, then Orbax on local disk: its own handler, async
        # checkpointing (the default); the handler is the one the manager would pick,
        # registered explicitly so its blocking part is timed.
        null = NullHandler()
        mngr = manager("null" + suffix, null, NullSave, None, lean)
        run("null" + suffix, mngr, NullSave, None, mngr.wait_until_finished, null)
        mngr.close()
        orbax_handler = TimedStandardHandler()
        mngr = manager("orbax" + suffix, orbax_handler, ocp.args.StandardSave, ocp.args.StandardRestore, lean)
        run("orbax" + suffix, mngr, ocp.args.StandardSave, None if lean else ocp.args.StandardRestore,
            mngr.wait_until_finished, orbax_handler)
        mngr.close()
        shutil.rmtree(base / ("orbax" + suffix), ignore_errors=True)
        tiercel_run("tiercel_ram" + suffix, ["ram", "disk"], lean, restore=not lean)
    tiercel_run("tiercel_fs", ["disk", "ram"], lean=False, restore=True)
    (Path(cfg["out"]) / f"orbax-bench-{cfg['pid']}.json").write_text(json.dumps(out))
    jax.distributed.shutdown()


# -- the launcher -------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=1024, help="pytree size in MiB over the whole job (default 1024)")
    ap.add_argument("--arrays", type=int, default=8, help="number of sharded matrices")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions (median reported)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"), help="local disk directory for both")
    ap.add_argument("--out", default=str(HERE / "results" / "orbax.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    work = Path(tempfile.mkdtemp(prefix="tiercel-bench-orbax-", dir=args.dir))
    shm = tempfile.mkdtemp(prefix="tiercel-bench-orbax-", dir="/dev/shm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_array = int(args.mib * (1 << 20)) // args.arrays
    print(f"pytree: {args.arrays} float32 matrices of {per_array / (1 << 20):.1f} MiB on a 2x2 mesh over "
          f"{NPROC} processes; {args.repeat} repetitions, medians; max over processes", flush=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    procs = []
    try:
        for pid in range(NPROC):
            cfg = {"pid": pid, "port": port, "per_array": per_array, "arrays": args.arrays, "repeat": args.repeat,
                   "dir": str(work / "job"), "shm": f"{shm}/ram", "out": str(work)}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"a worker failed: exit codes {codes}", file=sys.stderr)
            return 1
        reports = [json.loads((work / f"orbax-bench-{pid}.json").read_text()) for pid in range(NPROC)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    nbytes = reports[0]["global_bytes"]
    worst = lambda *keys: max(_get(r, keys) for r in reports)  # noqa: E731
    results: dict[str, dict[str, Any]] = {}

    def record(name: str, seconds: float, note: str = "") -> None:
        results[name] = {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "note": note}
        print(f"  {name:<44} {seconds * 1e3:9.1f} ms  {nbytes / seconds / 1e9:6.2f} GB/s  {note}", flush=True)

    record("memcpy of each process's shards", worst("memcpy"), "the physical limit")
    record("CheckpointManager alone, blocking", worst("null", "save_blocking"), "mngr.save with a handler that saves nothing")
    record("Orbax save, blocking", worst("orbax", "save_blocking"), "async checkpointing")
    record("  of which Orbax's handler", worst("orbax", "handler_blocking"), "async_save until it returns its futures")
    record("Orbax save, until on disk", worst("orbax", "until_durable"), "wait_until_finished")
    record("Orbax restore from local disk", worst("orbax", "restore"), "warm page cache")
    record("tiercel save, blocking", worst("tiercel_ram", "save_blocking"), "host views of the shards; the copy is async")
    record("  of which tiercel's handler", worst("tiercel_ram", "handler_blocking"), "async_save until it returns its future")
    record("tiercel save, until on disk", worst("tiercel_ram", "until_durable"), "fs tier, no compression")
    record("tiercel restore from RAM", worst("tiercel_ram", "restore"), str(reports[0]["tiercel_ram"]["restored_from"]))
    record("tiercel restore from fs tier", worst("tiercel_fs", "restore"), str(reports[0]["tiercel_fs"]["restored_from"]) + ", warm page cache")
    record("lean manager: CheckpointManager alone, blocking", worst("null_lean", "save_blocking"), "active_processes, skip_sync_file_validations")
    record("lean manager: Orbax save, blocking", worst("orbax_lean", "save_blocking"), "")
    record("lean manager: tiercel save, blocking", worst("tiercel_ram_lean", "save_blocking"), "")
    memcpy_s = results["memcpy of each process's shards"]["seconds"]
    for r in results.values():
        r["vs_memcpy"] = r["seconds"] / memcpy_s
    s_ = lambda name: results[name]["seconds"]  # noqa: E731
    goals = {
        "save blocking: Orbax / tiercel (goal >= 10x)": s_("Orbax save, blocking") / s_("tiercel save, blocking"),
        "save blocking, lean manager: Orbax / tiercel": s_("lean manager: Orbax save, blocking") / s_("lean manager: tiercel save, blocking"),
        "save blocking: Orbax / CheckpointManager alone (the most any handler can reach)":
            s_("Orbax save, blocking") / s_("CheckpointManager alone, blocking"),
        "same, lean manager": s_("lean manager: Orbax save, blocking") / s_("lean manager: CheckpointManager alone, blocking"),
        "handler's blocking part: Orbax's / tiercel's": s_("  of which Orbax's handler") / s_("  of which tiercel's handler"),
        "restore: Orbax from disk / tiercel from RAM (goal >= 5x)": s_("Orbax restore from local disk") / s_("tiercel restore from RAM"),
        "restore: Orbax from disk / tiercel from fs tier": s_("Orbax restore from local disk") / s_("tiercel restore from fs tier"),
        "until on disk: Orbax / tiercel": s_("Orbax save, until on disk") / s_("tiercel save, until on disk"),
    }
    table = "\n".join(
        ["| operation | median ms | GB/s | vs memcpy | note |", "|---|---:|---:|---:|---|"]
        + [f"| {k} | {r['seconds'] * 1e3:.1f} | {r['gb_per_s']:.2f} | {r['vs_memcpy']:.2f}x | {r['note']} |" for k, r in results.items()]
        + ["", "| ratio | measured |", "|---|---:|"]
        + [f"| {k} | {v:.1f}x |" for k, v in goals.items()]
    )
    print("\n" + table)
    import jax

    write_results(args.out, {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                    "orbax": ocp.__version__},
        "state_bytes": nbytes,
        "processes": reports,
        "results": results,
        "ratios": goals,
        "lean_manager_options": MANAGER_OPTIONS,
        "table_markdown": table,
    })
    return 0


def _get(d: dict[str, Any], keys: tuple[str, ...]) -> float:
    for k in keys:
        d = d[k]
    return float(d)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
