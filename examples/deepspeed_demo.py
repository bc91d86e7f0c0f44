#!/usr/bin/env python
"""tiercel + DeepSpeed: save_checkpoint every step, lose a rank, load_checkpoint, same curve.

    python examples/deepspeed_demo.py [--stage 2] [--world 2] [--steps 12] [--kill-step 7]

The script is its own launcher (as the deepspeed launcher would be). Its ranks run a small
MLP under DeepSpeed ZeRO (`--stage`, on the CPU unless DS_ACCELERATOR says otherwise,
gloo on 127.0.0.1) with AdamW and a WarmupLR schedule, on data seeded per step and rank.
The training loop makes DeepSpeed's own calls; one line makes them go through tiercel:

    tiercel.deepspeed.attach(engine, policy)

with the policy examples/tiercel_demo.toml (shared memory, keep 2; a directory every 5 steps).

  1. reference: --steps steps, nothing goes wrong.
  2. failure:   the same job; right after its save_checkpoint of --kill-step returns, the last
                rank dies of SIGKILL. The launcher stops the others and starts them all again;
                they call engine.load_checkpoint(save_dir), which loads the newest step every
                rank can restore, from shared memory, and train on.
  3. check:     every loss of the failed-and-resumed job equals the reference, bit for bit.

Exits 0 when the check passes, 1 when it fails, 2 on any other error. The first run on a
machine builds DeepSpeed's CPU communication op (a minute or two, cached afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch_demo import POLICY_TEMPLATE, describe_memory_tier, free_port, read_records, write_policy

HIDDEN, BATCH = 256, 32


def trainer(args: argparse.Namespace) -> None:
    import deepspeed
    import torch

    import tiercel.deepspeed

    rank = int(os.environ["RANK"])
    log = (Path(args.out) / f"rank{rank}.jsonl").open("a", buffering=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.GELU(), torch.nn.Linear(HIDDEN, 8))
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, not DeepSpeed's fused one
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
        "steps_per_print": 10**6,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    if args.tiercel:
        tiercel.deepspeed.attach(engine, args.policy)  # the one line tiercel adds

    save_dir = str(Path(args.out).parent / "ckpt")
    if args.resume:
        t0 = time.perf_counter()
        path, client_state = engine.load_checkpoint(save_dir)  # DeepSpeed's call, unchanged
        last = engine.checkpoint_engine.last_load
        log.write(json.dumps({"event": "loaded", "step": engine.global_steps, "tiers": last.tiers,
                              "seconds": time.perf_counter() - t0}) + "\n")
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    for step in range(engine.global_steps + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1009 * step + rank)
        x = torch.randn(BATCH, 64, generator=g).to(engine.device)
        loss = torch.nn.functional.cross_entropy(engine(x), (x.cpu() @ teacher).argmax(1).to(engine.device))
        engine.backward(loss)
        engine.step()
        t0 = time.perf_counter()
        if args.tiercel:
            engine.save_checkpoint(save_dir, tag=f"global_step{step}")  # DeepSpeed's call, unchanged
        log.write(json.dumps({"event": "step", "step": step, "loss": loss.item().hex(),
                              "save_s": time.perf_counter() - t0}) + "\n")
        if step == args.kill_step and rank == int(os.environ["WORLD_SIZE"]) - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash: no cleanup, no flush
    if args.tiercel:
        engine.checkpoint_engine.wait(60)  # the background tiers of the last save
    log.write(json.dumps({"event": "done"}) + "\n")


def launch(args: argparse.Namespace, out: Path, *, tiercel: bool, resume: bool = False, kill: bool = False) -> int | None:
    """Runs all ranks once; returns the signal that killed a rank, or None when all finish."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    cmd = [sys.executable, __file__, "--trainer", "--out", str(out), "--policy", str(args.policy), "--stage", str(args.stage),
           "--steps", str(args.steps), "--kill-step", str(args.kill_step if kill else 0)]
    cmd += ["--tiercel"] * tiercel + ["--resume"] * resume
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(args.world),
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1",
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}  # ninja, for the op build
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=(out / f"rank{r}.log").open("w"), stderr=subprocess.STDOUT) for r in range(args.world)]
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c is not None and c < 0 for c in codes):  # a rank died: stop the others
                return -next(c for c in codes if c is not None and c < 0)
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), 0)
                tail = (out / f"rank{bad}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{out.name}: rank {bad} failed (exit {codes[bad]}) or timed out:\n{tail}")
            if all(c == 0 for c in codes):
                return None
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def losses(out: Path) -> dict[int, str]:
    return {r["step"]: r["loss"] for r in read_records(out / "rank0.jsonl") if r["event"] == "step"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiercel", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer:
        trainer(args)
        return 0

    work = Path(tempfile.mkdtemp(prefix="tiercel-ds-demo-"))
    shm = Path(f"/dev/shm/tiercel-ds-demo-{os.getpid()}")
    args.policy = work / "tiercel.toml"
    write_policy(args.policy, shm, work / "disk")
    try:
        print(f"policy: {POLICY_TEMPLATE.name} (shared memory under {shm}); ZeRO-{args.stage}, {args.world} ranks")
        print(f"== 1. reference: {args.steps} steps, nothing goes wrong")
        launch(args, work / "reference", tiercel=False)
        print(f"== 2. the same job with tiercel; rank {args.world - 1} is SIGKILLed right after saving step {args.kill_step}")
        sig = launch(args, work / "attempt1", tiercel=True, kill=True)
        if sig != signal.SIGKILL:
            raise RuntimeError(f"expected a rank to die of SIGKILL, got {sig}")
        print("   the processes are gone; shared memory still holds:")
        for line in describe_memory_tier(shm, args.world):
            print(f"     {line}")
        print(f"   restarting all {args.world} ranks: engine.load_checkpoint(save_dir), then train on")
        launch(args, work / "attempt2", tiercel=True, resume=True)
        loaded = next(r for r in read_records(work / "attempt2" / "rank0.jsonl") if r["event"] == "loaded")
        print(f"   loaded step {loaded['step']} from {loaded['tiers']} in {loaded['seconds']:.2f} s")

        ref, first, second = losses(work / "reference"), losses(work / "attempt1"), losses(work / "attempt2")
        resumed = {s: v for s, v in first.items() if s <= loaded["step"]} | second
        print("\n== 3. check: the loss of every step, reference vs failed-and-resumed")
        for step in range(1, args.steps + 1):
            got = resumed.get(step)
            mark = "same" if got == ref.get(step) else "DIFFERENT"
            src = "attempt 2" if step in second else "attempt 1"
            print(f"   step {step:3d}  {float.fromhex(ref[step]):.9f}  {float.fromhex(got) if got else float('nan'):.9f}  "
                  f"({src}) {mark}")
        ok = sorted(resumed) == sorted(ref) and all(resumed[s] == ref[s] for s in ref)
        print("\nPASS: the same loss curve, bit for bit" if ok else "\nFAIL: the loss curves differ")
        return 0 if ok else 1
    except Exception as e:  # noqa: BLE001 - the demo's own failure, reported as exit status 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        else:
            print(f"kept {work} and {shm}")


if __name__ == "__main__":
    sys.exit(main())
