"""Orbax's CheckpointManager with its own StandardCheckpointHandler on local disk against the
same manager with tiercel's handler, on one sharded pytree, in one run.

A JAX job of 2 processes x 2 CPU devices (jax.distributed on 127.0.0.1) holds a pytree of
float32 matrices sharded over a 2x2 mesh (plus a replicated vector and a scalar). Measured,
per process, the job waiting for its slowest process (the maximum over processes is
reported):
  - the physical limit: copying the process's shards into preallocated host buffers (memcpy);
  - Orbax: `mngr.save(StandardSave)` blocking time (async checkpointing, the default), the
    time until the step is on disk (`wait_until_finished`), the full `mngr.restore`;
  - tiercel: the same manager calls with tiercel.orbax's handler: blocking time (the copy into
    the memory tier), time until the fs tier has the step, restore from the memory tier, and
    restore from the fs tier (a policy that reads the fs tier first).
Goals (issue 9): save blocking >= 10x shorter than Orbax's; restore from RAM >= 5x faster
than Orbax from local disk.

    python bench/orbax.py [--mib 1024] [--arrays 8] [--repeat 3] [--dir /var/tmp]
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


def worker(cfg: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", NDEV)
    jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", num_processes=NPROC, process_id=cfg["pid"])
    import numpy as np
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

    def run(name: str, mngr: ocp.CheckpointManager, save_args: Any, restore_args: Any, durable: Any, handler: Any) -> None:
        """Saves WARMUP + repeat steps, times the last `repeat`, restores the last step."""
        progress(f"{name}: {WARMUP} + {repeat} saves, {repeat} restores")
        blocking, in_handler, until_durable, restores = [], [], [], []
        for step in range(WARMUP + repeat):
            t0 = time.perf_counter()
            mngr.save(step, args=ocp.args.Composite(state=save_args(state)))
            t1 = time.perf_counter()
            durable()
            if step >= WARMUP:
                blocking.append(t1 - t0)
                in_handler.append(handler.last_blocking_seconds)
                until_durable.append(time.perf_counter() - t0)
        last = mngr.latest_step()
        for _ in range(repeat):
            t0 = time.perf_counter()
            restored = mngr.restore(last, args=ocp.args.Composite(state=restore_args(abstract)))["state"]
            jax.block_until_ready(restored)
            restores.append(time.perf_counter() - t0)
        check(restored)
        out[name] = {"save_blocking": statistics.median(blocking), "handler_blocking": statistics.median(in_handler),
                     "until_durable": statistics.median(until_durable), "restore": statistics.median(restores)}

    base = Path(cfg["dir"])
    # Orbax on local disk: its own handler, async checkpointing (the default); the handler is
    # the one the manager would pick, registered explicitly so its blocking part is timed.
    orbax_handler = TimedStandardHandler()
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("state", ocp.args.StandardSave, orbax_handler)
    reg.add("state", ocp.args.StandardRestore, orbax_handler)
    mngr = ocp.CheckpointManager(base / "orbax", options=ocp.CheckpointManagerOptions(max_to_keep=2), handler_registry=reg)
    run("orbax", mngr, ocp.args.StandardSave, ocp.args.StandardRestore, mngr.wait_until_finished, orbax_handler)
    mngr.close()
    shutil.rmtree(base / "orbax", ignore_errors=True)

    # tiercel: memory tier + fs tier on the same disk, no compression (Orbax writes raw too).
    for name, order in (("tiercel_ram", ["ram", "disk"]), ("tiercel_fs", ["disk", "ram"])):
        tiers = [
            {"name": "ram", "kind": "memory", "root": f"{cfg['shm']}/{name}", "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(base / name / "disk"), "keep": 2, "compression": "none"},
        ]
        handler = tiercel.orbax.TiercelCheckpointHandler({"tier": tiers, "restore": {"order": order}})
        reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
        reg.add("state", tiercel.orbax.Save, handler)
        reg.add("state", tiercel.orbax.Restore, handler)
        mngr = ocp.CheckpointManager(base / name / "orbax", options=ocp.CheckpointManagerOptions(max_to_keep=2), handler_registry=reg)

        def durable(h: Any = handler, m: Any = mngr) -> None:
            m.wait_until_finished()  # Orbax's own finalize (its step directory)
            h.last_save.wait()  # the fs tier has this process's part (tiercel's background)

        run(name, mngr, tiercel.orbax.Save, tiercel.orbax.Restore, durable, handler)
        out[name]["restored_from"] = handler.last_restore.tiers
        handler.store.coordinator.all_gather(name)  # both processes done before the next round
        mngr.close()
        shutil.rmtree(f"{cfg['shm']}/{name}", ignore_errors=True)
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
    record("Orbax save, blocking", worst("orbax", "save_blocking"), "async checkpointing")
    record("  of which Orbax's handler", worst("orbax", "handler_blocking"), "the rest is CheckpointManager's own")
    record("Orbax save, until on disk", worst("orbax", "until_durable"), "wait_until_finished")
    record("Orbax restore from local disk", worst("orbax", "restore"), "warm page cache")
    record("tiercel save, blocking", worst("tiercel_ram", "save_blocking"), "host views of the shards; the copy is async")
    record("  of which tiercel's handler", worst("tiercel_ram", "handler_blocking"), "the rest is CheckpointManager's own")
    record("tiercel save, until on disk", worst("tiercel_ram", "until_durable"), "fs tier, no compression")
    record("tiercel restore from RAM", worst("tiercel_ram", "restore"), str(reports[0]["tiercel_ram"]["restored_from"]))
    record("tiercel restore from fs tier", worst("tiercel_fs", "restore"), str(reports[0]["tiercel_fs"]["restored_from"]) + ", warm page cache")
    memcpy_s = results["memcpy of each process's shards"]["seconds"]
    for r in results.values():
        r["vs_memcpy"] = r["seconds"] / memcpy_s
    goals = {
        "save blocking: Orbax / tiercel (goal >= 10x)": results["Orbax save, blocking"]["seconds"] / results["tiercel save, blocking"]["seconds"],
        "handler's blocking part: Orbax's / tiercel's": results["  of which Orbax's handler"]["seconds"] / results["  of which tiercel's handler"]["seconds"],
        "restore: Orbax from disk / tiercel from RAM (goal >= 5x)": results["Orbax restore from local disk"]["seconds"] / results["tiercel restore from RAM"]["seconds"],
        "restore: Orbax from disk / tiercel from fs tier": results["Orbax restore from local disk"]["seconds"] / results["tiercel restore from fs tier"]["seconds"],
        "until on disk: Orbax / tiercel": results["Orbax save, until on disk"]["seconds"] / results["tiercel save, until on disk"]["seconds"],
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
        "table_markdown": table,
    })
    return 0


def _get(d: dict[str, Any], keys: tuple[str, ...]) -> float:
    for k in keys:
        d = d[k]
    return float(d)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
