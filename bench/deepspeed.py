"""engine.save_checkpoint / engine.load_checkpoint of a DeepSpeed job through tiercel, against
DeepSpeed's own checkpoint engines, ZeRO-1 and ZeRO-3, two ranks on the CPU (gloo).

Measured side by side in one run, in the same two processes, on the same model and state:
  - the physical limit: each rank copies the bytes it saves into preallocated buffers
    (numpy copy, as in bench/save_restore.py);
  - tiercel: how long save_checkpoint blocks (DeepSpeed's own work and tiercel's flattening:
    the tensors are copied into shared memory by a background snapshot), how long the next
    optimizer step then waits for that snapshot (the stall: the update must not change the
    tensors before they are copied), until its background tiers are done, and load_checkpoint
    from RAM;
  - DeepSpeed's TorchCheckpointEngine to /dev/shm and to disk (torch.save, no fsync), and its
    FastCheckpointEngine with the python writer when it runs here.
Targets (issue 8): tiercel's blocking time <= 1/10 of TorchCheckpointEngine to /dev/shm and
<= 1.5x the memcpy of the same bytes.

    python bench/deepspeed.py [--mib 1024] [--repeat 3] [--warmup 3] [--stages 1 3] [--dir /var/tmp]
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

from _measure import write_results

HERE = Path(__file__).resolve().parent
# This file is named deepspeed.py: its own directory must not shadow the deepspeed package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
WORLD = 2
WIDTH = 1024  # Linear(WIDTH, WIDTH) layers
#: Bytes a parameter costs in a checkpoint: fp32 weights in the model states, and the fp32
#: master copy, exp_avg and exp_avg_sq (AdamW) in the ZeRO optimizer states.
BYTES_PER_PARAM = 16
NOTHING = "none: DeepSpeed's own work (an engine that writes nothing)"
ENGINES = (NOTHING, "torch, /dev/shm", "torch, disk", "fast (python writer), disk", "tiercel")


# -- one rank ----------------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    import tiercel.deepspeed
    from tiercel.deepspeed.install import writes_model_states

    rank = int(os.environ["RANK"])
    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": cfg["stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        # DeepSpeed builds its FastCheckpointEngine from this (every data-parallel rank writes
        # a slice of each file); the other engines are swapped in.
        "checkpoint": {"writer": {"type": "python", "decoupled": False, "data_parallel": "replica"}},
    }

    def initialize() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(cfg["layers"])])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return deepspeed.initialize(model=model, optimizer=opt, config=ds_config)[0]

    try:
        engine = initialize()
        fast = engine.checkpoint_engine if type(engine.checkpoint_engine).__name__ == "FastCheckpointEngine" else None
    except Exception as e:  # noqa: BLE001 - measured only where it runs
        print(f"rank {rank}: FastCheckpointEngine does not start here ({e}); measuring without it", flush=True)
        del ds_config["checkpoint"]
        engine = initialize()
        fast = None
    fast_writes = engine.save_non_zero_checkpoint
    x = torch.randn(2, WIDTH)

    def train_step() -> float:
        """One forward, backward and optimizer step; returns its seconds."""
        t0 = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        return time.perf_counter() - t0

    train_step()  # the optimizer state exists from here on

    class Recorder(CheckpointEngine):
        """Keeps the tensors DeepSpeed hands over: the bytes this rank saves."""

        def __init__(self) -> None:
            super().__init__()
            self.tensors: list[Any] = []
            self.recording = True

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            stack = [state_dict] if self.recording else []
            while stack:
                v = stack.pop()
                if isinstance(v, torch.Tensor):
                    self.tensors.append(v.detach())
                elif isinstance(v, dict):
                    stack += v.values()
                elif isinstance(v, (list, tuple)):
                    stack += v

        def load(self, path: str, map_location: Any = None) -> Any:
            raise NotImplementedError

        def commit(self, info: Any) -> bool:
            return True

    base = Path(cfg["dir"])
    dirs = {"torch, /dev/shm": Path(cfg["shm"]) / "torch", "torch, disk": base / "torch", "fast (python writer), disk": base / "fast",
            "tiercel": base / "tiercel-save-dir"}
    torch_engine = TorchCheckpointEngine(engine._config)
    torch_writes = writes_model_states(engine, torch_engine)
    tiercel.deepspeed.attach(engine, cfg["policy"])
    engines: dict[str, tuple[Any, bool]] = {
        "torch, /dev/shm": (torch_engine, torch_writes),
        "torch, disk": (torch_engine, torch_writes),
        "tiercel": (engine.checkpoint_engine, engine.save_non_zero_checkpoint),
    }
    if fast is not None:
        engines["fast (python writer), disk"] = (fast, fast_writes)

    def use(name: str) -> None:
        engine.checkpoint_engine, engine.save_non_zero_checkpoint = engines[name]

    # The bytes this rank saves, and the limit: copying them once.
    recorder = Recorder()
    engines["recorder"] = (recorder, torch_writes)
    use("recorder")
    engine.save_checkpoint(str(base / "recorder"), tag="global_step0")
    arrays = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in recorder.tensors if t.numel()]
    nbytes = sum(a.nbytes for a in arrays)
    dst = [np.ones_like(a) for a in arrays]  # touched: the limit is the copy, not page faults
    memcpy = []
    for _ in range(cfg["repeat"]):
        dist.barrier()
        t0 = time.perf_counter()
        for d, a in zip(dst, arrays):
            np.copyto(d, a)
        memcpy.append(time.perf_counter() - t0)
    del dst, arrays
    recorder.tensors.clear()
    recorder.recording = False
    engines[NOTHING] = engines.pop("recorder")
    dirs[NOTHING] = base / "recorder"

    report: dict[str, Any] = {"rank": rank, "bytes": nbytes, "memcpy": memcpy, "save": {}, "load": {}, "background": [],
                              "next_step": {}, "stall": []}
    # Warm-up rounds first: until the memory tier evicts (keep = 2) and recycles its segments,
    # each save pays for fresh shared-memory pages, as each torch.save does for its files.
    for rep in range(1, cfg["warmup"] + cfg["repeat"] + 1):
        for name in engines:
            use(name)
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(str(dirs[name]), tag=f"global_step{rep}")
            seconds = time.perf_counter() - t0
            # Training goes on at once: tiercel's snapshot runs during forward and backward,
            # and the optimizer's step waits for whatever of it is left.
            step_seconds = train_step()
            if name == "tiercel":
                stall = engine.checkpoint_engine.gate.last_stall_seconds
                engine.checkpoint_engine.wait()
                if rep > cfg["warmup"]:
                    report["background"].append(time.perf_counter() - t0)
                    report["stall"].append(stall)
            if rep > cfg["warmup"]:
                report["save"].setdefault(name, []).append(seconds)
                report["next_step"].setdefault(name, []).append(step_seconds)
            elif name == "tiercel":
                report.setdefault("tiercel_warmup", []).append(seconds)
            dist.barrier()
            if rank == 0 and name in dirs and name != "tiercel":  # one checkpoint on disk per engine at a time
                shutil.rmtree(dirs[name] / f"global_step{rep - 1}", ignore_errors=True)
        print(f"rank {rank}: round {rep} saved", flush=True)
    for name in engines:
        if name == NOTHING:
            continue
        if name.startswith("fast"):
            # Its load is torch.load(path) with torch's default weights_only=True since torch
            # 2.6, which refuses DeepSpeed's LossScaler: DeepSpeed's own engine reads the files.
            engines[name] = (torch_engine, engines[name][1])
        use(name)
        dist.barrier()
        t0 = time.perf_counter()
        path, _ = engine.load_checkpoint(str(dirs[name]))
        report["load"][name] = time.perf_counter() - t0
        assert path is not None, name
    report["tiercel_load_tiers"] = engines["tiercel"][0].last_load.tiers
    with open(Path(cfg["out"]) / f"rank-{rank}.json", "w") as f:
        json.dump(report, f)
    engines["tiercel"][0].close()


# -- the driver ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stage(stage: int, args: argparse.Namespace, layers: int) -> list[dict]:
    disk = Path(tempfile.mkdtemp(prefix="tiercel-bench-ds-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-ds-", dir="/dev/shm"))
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(shm / "tiercel"), "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(disk / "tiercel"), "keep": 1, "compression": "none"},
        ],
        "restore": {"order": ["ram", "disk"]},
    }
    cfg = {"stage": stage, "layers": layers, "repeat": args.repeat, "warmup": args.warmup, "dir": str(disk), "shm": str(shm),
           "out": str(disk), "policy": policy}
    port = str(free_port())
    procs = []
    try:
        for rank in range(WORLD):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port, "CROSS_RANK": "0", "CROSS_SIZE": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
                   "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env))
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"ZeRO-{stage}: a rank exited with {p.returncode}")
        return [json.loads((disk / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def summarize(stage: int, ranks: list[dict]) -> dict:
    """The job's times: per round the slowest rank (save_checkpoint ends in a barrier, so the
    job waits for it), median over rounds."""
    def job(samples: list[list[float]]) -> float:
        return statistics.median(max(round_) for round_ in zip(*samples))

    out: dict[str, Any] = {"bytes": sum(r["bytes"] for r in ranks), "memcpy_s": job([r["memcpy"] for r in ranks])}
    out["save_s"] = {name: job([r["save"][name] for r in ranks]) for name in ENGINES if name in ranks[0]["save"]}
    out["load_s"] = {name: max(r["load"][name] for r in ranks) for name in out["save_s"] if name != NOTHING}
    out["tiercel_background_s"] = job([r["background"] for r in ranks])
    out["tiercel_stall_s"] = job([r["stall"] for r in ranks])
    out["next_step_s"] = {name: job([r["next_step"][name] for r in ranks]) for name in out["save_s"]}
    out["tiercel_first_save_s"] = max(r["tiercel_warmup"][0] for r in ranks)
    out["tiercel_load_tiers"] = [r["tiercel_load_tiers"] for r in ranks]
    out["ranks"] = ranks  # every sample of every rank
    t = out["save_s"]["tiercel"]
    out["ratios"] = {
        "torch /dev/shm blocking / tiercel blocking": out["save_s"]["torch, /dev/shm"] / t,
        "tiercel blocking / memcpy": t / out["memcpy_s"],
    }
    return out


def table(results: dict) -> str:
    rows = ["| ZeRO | engine | save blocks (ms) | vs memcpy | next train step (ms) | load (ms) |",
            "|---|---|---:|---:|---:|---:|"]
    for stage, r in results.items():
        rows.append(f"| {stage} | memcpy of the same bytes ({r['bytes'] / 2**20:.0f} MiB) | {r['memcpy_s'] * 1e3:.0f} | 1.00x | | |")
        for name, s in r["save_s"].items():
            load = f"{r['load_s'][name] * 1e3:.0f}" if name in r["load_s"] else ""
            rows.append(f"| {stage} | {name} | {s * 1e3:.0f} | {s / r['memcpy_s']:.2f}x | {r['next_step_s'][name] * 1e3:.0f} | {load} |")
        stall = r["tiercel_stall_s"]
        rows.append(f"| {stage} | tiercel, stall: the next optimizer step waits for the snapshot | {stall * 1e3:.0f} | "
                    f"{stall / r['memcpy_s']:.2f}x | | |")
        rows.append(f"| {stage} | tiercel, until ram + disk tiers done (background) | {r['tiercel_background_s'] * 1e3:.0f} | | | |")
        rows.append(f"| {stage} | tiercel, first save (fresh shared-memory pages) | {r['tiercel_first_save_s'] * 1e3:.0f} | | | |")
    rows += ["", "| ZeRO | target | measured | met |", "|---|---|---:|---|"]
    for stage, r in results.items():
        a = r["ratios"]["torch /dev/shm blocking / tiercel blocking"]
        b = r["ratios"]["tiercel blocking / memcpy"]
        rows.append(f"| {stage} | tiercel blocking <= 1/10 of torch to /dev/shm | 1/{a:.1f} | {'yes' if a >= 10 else 'NO'} |")
        rows.append(f"| {stage} | tiercel blocking <= 1.5x memcpy | {b:.2f}x | {'yes' if b <= 1.5 else 'NO'} |")
        c = (r["save_s"]["tiercel"] + r["tiercel_stall_s"]) / r["memcpy_s"]
        rows.append(f"| {stage} | (not a target) tiercel blocking + stall, vs memcpy | {c:.2f}x | |")
    return "\n".join(rows)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=1024, help="checkpoint size of the job in MiB, both ranks (default 1024)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="rounds before them (default 3: the memory tier recycles segments)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3], help="ZeRO stages (default 1 3)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"), help="disk directory for the checkpoints")
    ap.add_argument("--out", default=str(HERE / "results" / "deepspeed.json"))
    args = ap.parse_args()
    layers = max(1, round(args.mib * 2**20 / BYTES_PER_PARAM / (WIDTH * WIDTH + WIDTH)))
    print(f"model: {layers} x Linear({WIDTH}, {WIDTH}), ~{layers * (WIDTH + 1) * WIDTH * BYTES_PER_PARAM / 2**20:.0f} MiB "
          f"of checkpoint; {WORLD} ranks; {args.repeat} rounds, medians", flush=True)
    results = {}
    for stage in args.stages:
        print(f"ZeRO-{stage}", flush=True)
        results[stage] = summarize(stage, run_stage(stage, args, layers))
    text = table(results)
    print("\n" + text)
    import torch

    write_results(args.out, {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": results,
        "table_markdown": text,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
