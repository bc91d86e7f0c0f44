#!/usr/bin/env python
"""tiercel + PyTorch DDP: checkpoint every step, lose a process, resume from RAM.

    python examples/torch_demo.py          # or: make demo

This script is its own launcher (as torchrun would be): it starts 4 trainer processes on
this host (torch.distributed, gloo on 127.0.0.1), each training the same small MLP with DDP
and Adam on synthetic data that is seeded per step and rank, so the loss curve is exactly
reproducible. Every rank saves a checkpoint every step into a tiercel Store (policy:
examples/tiercel_demo.toml: shared memory, keep 2; a directory every 5 steps, zstd).

  1. reference: 30 steps, nothing goes wrong.
  2. failure:   the same job; right after its save of step 17 returns, rank 2 dies of SIGKILL.
                The launcher notices, stops the other ranks and starts all 4 again; they
                `store.restore()` (the newest step every rank can restore, agreed through
                torch.distributed) from shared memory, which outlived the processes, load the
                model, optimizer and RNG state, and train on to step 30.
  3. check:     the loss of every step of the failed-and-resumed job equals the reference
                (within --tolerance, 1e-6; on CPU it is bit-exact, final weights included).

Exits 0 when the check passes, 1 when it fails, 2 on any other error (or after --timeout s).
Options: --steps, --kill-step, --kill-rank, --world, --timeout, --tolerance; --keep keeps the files.

The time limit scales with the work (three launches of --world ranks, each importing torch,
and every rank-step of the three runs); while the ranks are busy, a line every
--progress-every seconds says where they are. On a slow or busy machine raise it:
`make demo DEMO_ARGS="--timeout 1800"` (or `python examples/torch_demo.py --timeout 1800`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICY_TEMPLATE = HERE / "tiercel_demo.toml"

# The model and the data: ~1.6 M parameters (6.3 MB), with Adam ~19 MB of state per rank.
IN, HIDDEN, CLASSES, BATCH = 256, 1024, 16, 64
LR = 1e-3

# The default time limit (--timeout): per launch, time for its ranks to import torch and join
# the gloo group (they contend for the cores: on 2 busy cores 4 ranks take ~a minute), then
# per rank-step, a forward/backward, an all-reduce and a save of ~19 MB. Generous: a limit is
# only there to stop a demo that hangs, and a newcomer's busy laptop must not hit it.
LAUNCH_S, RANK_START_S, RANK_STEP_S = 30.0, 15.0, 1.0


def default_timeout(world: int, steps: int, kill_step: int) -> float:
    launches = 3  # the reference, the attempt that loses a rank, the resumed attempt
    rank_steps = world * (steps + kill_step + (steps - kill_step + 1))
    return launches * (LAUNCH_S + RANK_START_S * world) + RANK_STEP_S * rank_steps


# =============================================================================================
# The trainer: one process per rank, started by the launcher below with RANK, WORLD_SIZE,
# MASTER_ADDR and MASTER_PORT in its environment, as torchrun would start it.
# =============================================================================================


def trainer(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tiercel

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    log = (out / f"rank{rank}.jsonl").open("a", buffering=1)  # one JSON record per line

    def record(**kv) -> None:
        log.write(json.dumps(kv) + "\n")
        log.flush()

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    # After init_process_group, the Store takes rank, world size and its coordinator (for
    # agreeing on the step to restore) from torch.distributed.
    store = tiercel.Store(args.policy)

    torch.manual_seed(1000 + rank)  # the dropout masks differ per rank; the RNG is checkpointed
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, IN), nn.GELU(),
        nn.Linear(IN, CLASSES),
    )  # fmt: skip
    ddp = DDP(model)  # broadcasts rank 0's initial weights
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)

    # A fixed random "teacher" labels the data, so the loss has something to go down to.
    teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(7))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(BATCH, IN, generator=g)
        return x, (x @ teacher).argmax(dim=1)

    def weights_digest() -> str:
        d = hashlib.blake2b(digest_size=16)
        for t in ddp.module.state_dict().values():
            d.update(t.detach().contiguous().numpy().data)
        return d.hexdigest()

    start = 1
    if args.resume:
        # DDP all-reduces the first iteration's gradients as one bucket and rebuilds its buckets
        # for the second; so the first step after a restart would add the same gradients in
        # another order than the uninterrupted job did at that step (gloo sums by position), and
        # the losses would drift by ~1e-7. One throwaway forward/backward settles the buckets;
        # the restore below then overwrites everything it touched (weights, optimizer, RNG).
        F.cross_entropy(ddp(batch(0)[0]), batch(0)[1]).backward()
        opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        state = store.restore()  # collective: the newest step every rank can restore
        t_restore = time.perf_counter() - t0
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        start = state["step"] + 1
        info = store.last_restore
        record(
            event="restored", step=info.step, tier=info.tier, tiers=info.tiers, nbytes=info.nbytes,
            read_s=info.seconds, restore_s=t_restore, total_s=time.perf_counter() - t0,
            warnings=info.warnings,
        )
        del state  # the optimizer holds what it needs

    handle = None
    for step in range(start, args.steps + 1):
        x, y = batch(step)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world

        state = {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": step}
        handle = store.save(step, state)  # returns once the state is in shared memory
        record(
            event="step", step=step, loss=mean_loss.item(), local_loss=loss.item(),
            blocking_s=handle.blocking_seconds, nbytes=_tensor_bytes(state, torch),
            weights=weights_digest() if rank == 0 else None,
        )
        if args.kill_step == step and args.kill_rank == rank:
            record(event="sigkill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash: no cleanup, no atexit, no flush

    # The end: wait for the background tiers of the last save on every rank, then list what
    # every tier holds.
    if handle is not None:
        handle.wait(timeout=60)
    dist.barrier()
    record(event="done", steps=store.steps(), weights=weights_digest())
    dist.barrier()
    store.close()
    dist.destroy_process_group()
    return 0


def _tensor_bytes(tree, torch) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v, torch) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v, torch) for v in tree)
    return 0


# =============================================================================================
# The launcher: starts the ranks, watches them, stops them all when one dies, and checks.
# =============================================================================================


class DemoError(Exception):
    """Something other than the check went wrong."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_policy(path: Path, ram_root: Path, disk_dir: Path) -> None:
    """examples/tiercel_demo.toml with this job's own shared-memory root and directory."""
    text = POLICY_TEMPLATE.read_text()
    text, n_root = re.subn(r'(?m)^(root\s*=\s*)"[^"]*"', lambda m: m.group(1) + json.dumps(str(ram_root)), text)
    text, n_url = re.subn(r'(?m)^(url\s*=\s*)"[^"]*"', lambda m: m.group(1) + json.dumps(str(disk_dir)), text)
    if (n_root, n_url) != (1, 1):
        raise DemoError(f"{POLICY_TEMPLATE}: expected one `root = ...` and one `url = ...` line")
    path.write_text(text)


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by a kill
    return out


class Job:
    """One launch of all ranks (what torchrun does for one attempt)."""

    def __init__(self, label: str, out: Path, policy: Path, args: argparse.Namespace, *, resume: bool, kill: bool):
        self.label, self.out, self.timeout = label, out, args.timeout
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.world),
            OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        if os.path.isdir("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trainer", "--out", str(out), "--policy", str(policy),
               "--steps", str(args.steps)]  # fmt: skip
        if resume:
            cmd.append("--resume")
        # The trainers die only when told to (0: never).
        cmd += ["--kill-step", str(args.kill_step if kill else 0), "--kill-rank", str(args.kill_rank)]
        self.procs: list[subprocess.Popen] = []
        for rank in range(args.world):
            with (out / f"rank{rank}.log").open("w") as logf:
                self.procs.append(
                    subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                     stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                )  # fmt: skip
        print(f"[{label}] started {args.world} ranks (pids {', '.join(str(p.pid) for p in self.procs)}), "
              f"MASTER_PORT={port}", flush=True)  # fmt: skip
        self._seen = 0
        self.t0 = self._said = time.monotonic()

    def records(self, rank: int) -> list[dict]:
        return read_records(self.out / f"rank{rank}.jsonl")

    def progress(self, every: int, steps: int, deadline: float, heartbeat: float) -> None:
        """Prints rank 0's new records, and a line when nothing was printed for `heartbeat` s
        (so that a slow start, ranks importing torch, does not look like a hang)."""
        recs = self.records(0)
        now = time.monotonic()
        if len(recs) > self._seen:
            self._said = now
        elif now - self._said >= heartbeat:
            self._said = now
            done = [r["step"] for r in recs if r["event"] == "step"]
            where = f"rank 0 finished step {done[-1]} of {steps}" if done else "ranks starting (importing torch, joining gloo)"
            print(f"[{self.label}] still running, {now - self.t0:.0f} s: {where}; "
                  f"{max(0.0, deadline - now):.0f} s left of the time limit (--timeout)", flush=True)  # fmt: skip
        for r in recs[self._seen :]:
            if r["event"] == "restored":
                print(f"[{self.label}] restored step {r['step']} from '{r['tier']}' in {r['total_s']:.3f} s", flush=True)
            elif r["event"] == "step" and (r["step"] % every == 0 or r["step"] in (1, steps)):
                print(f"[{self.label}] step {r['step']:3d}/{steps}  loss {r['loss']:.6f}  "
                      f"save blocked {r['blocking_s'] * 1e3:6.2f} ms", flush=True)  # fmt: skip
        self._seen = len(recs)

    def wait(self, deadline: float, every: int, steps: int, heartbeat: float) -> tuple[int, int] | None:
        """Waits until all ranks exit (None) or one fails: then stops the others, as torchrun
        does, and returns (rank, returncode) of the first to fail."""
        failed = None
        while True:
            self.progress(every, steps, deadline, heartbeat)
            codes = [p.poll() for p in self.procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # A rank killed by a signal is the cause; its peers' errors (a closed gloo
                # connection) are the consequence, even when seen in the same poll.
                failed = next((b for b in bad if b[1] < 0), bad[0])
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                self.stop()
                logs = "\n".join(self.log_tail(r, 5) for r in range(len(self.procs)))
                raise DemoError(f"[{self.label}] timed out: the whole demo may take {self.timeout:.0f} s (--timeout). "
                                f"On a slow or busy machine give it more: make demo DEMO_ARGS=\"--timeout "
                                f"{2 * self.timeout:.0f}\" (or examples/torch_demo.py --timeout {2 * self.timeout:.0f}). "
                                f"The last lines of the rank logs (--keep keeps them all):\n{logs}")  # fmt: skip
            time.sleep(0.05)
        self.progress(every, steps, deadline, heartbeat)
        self.seconds = time.monotonic() - self.t0
        if failed is None:
            print(f"[{self.label}] all ranks finished ({self.seconds:.1f} s)", flush=True)
        if failed is not None:
            rank, code = failed
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
            print(f"[{self.label}] rank {rank} died ({how}); stopping ranks {alive} as torchrun would", flush=True)
            self.stop()
        return failed

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        t = time.monotonic() + 3
        for p in self.procs:
            try:
                p.wait(max(0.0, t - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log_tail(self, rank: int, n: int = 25) -> str:
        lines = (self.out / f"rank{rank}.log").read_text(errors="replace").splitlines() or ["(no output)"]
        return "\n".join(f"    rank {rank}| {l}" for l in lines[-n:])


def describe_memory_tier(root: Path, world: int) -> list[str]:
    """What a memory tier's directory holds, step by step (docs/format.md: a step is
    committed once its commit record exists; each rank writes its manifest last)."""
    out = []
    for d in sorted(root.glob("step-*")):
        names = [p.name for p in d.iterdir()]
        ranks = sorted(int(m) for n in names for m in re.findall(r"^rank-(\d+)\.manifest", n))
        step = int(d.name.split("-")[-1]) if d.name.split("-")[-1].isdigit() else d.name
        if "COMMIT" in names:
            out.append(f"step {step}: committed")
        else:
            missing = sorted(set(range(world)) - set(ranks))
            out.append(f"step {step}: not committed (no manifest yet from rank(s) {missing})")
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def run_demo(args: argparse.Namespace, work: Path, shm: Path) -> bool:
    t_start = time.monotonic()
    deadline = t_start + args.timeout
    jobs: list[Job] = []

    def run(label, name, *, resume=False, kill=False, every=5):
        policy = work / f"{name}.toml"
        job = Job(label, work / label.replace(" ", "-"), policy, args, resume=resume, kill=kill)
        jobs.append(job)
        try:
            return job, job.wait(deadline, every, args.steps, args.progress_every)
        except BaseException:
            job.stop()
            raise

    def require_clean(job: Job, failed) -> None:
        if failed is not None:
            rank = failed[0]
            raise DemoError(f"[{job.label}] rank {rank} failed unexpectedly:\n{job.log_tail(rank)}")

    try:
        for name in ("reference", "run"):
            write_policy(work / f"{name}.toml", shm / name, work / f"{name}-disk")
        print(f"policy: {POLICY_TEMPLATE.relative_to(HERE.parent)} (shared memory under {shm}, directories under {work})")
        print(f"time limit: {args.timeout:.0f} s for the whole demo (--timeout; make demo DEMO_ARGS=\"--timeout N\")")

        # 1. Reference: nothing goes wrong.
        print(f"\n== 1. reference run: {args.world} ranks, {args.steps} steps, no failure")
        ref, failed = run("reference", "reference")
        require_clean(ref, failed)

        # 2. The same job, with rank 2 killed right after its save of step 17.
        print(f"\n== 2. the same job; rank {args.kill_rank} is SIGKILLed right after its save of step {args.kill_step}")
        crashed, failed = run("attempt 1", "run", kill=True, every=1)
        if failed != (args.kill_rank, -signal.SIGKILL):
            tail = crashed.log_tail(failed[0]) if failed else ""
            raise DemoError(f"expected rank {args.kill_rank} to die of SIGKILL, got {failed}\n{tail}")
        print(f"[attempt 1] the processes are gone; shared memory ({shm / 'run'}) still holds:")
        for line in describe_memory_tier(shm / "run", args.world):
            print(f"              {line}")
        print(f"[attempt 2] restarting all {args.world} ranks; they restore and train on")
        resumed, failed = run("attempt 2", "run", resume=True, every=1)
        require_clean(resumed, failed)
    finally:
        for job in jobs:
            job.stop()
    elapsed = time.monotonic() - t_start

    # 3. The check.
    ref_loss = {r["step"]: r["loss"] for r in ref.records(0) if r["event"] == "step"}
    tries = {job.label: {r["step"]: r["loss"] for r in job.records(0) if r["event"] == "step"} for job in (crashed, resumed)}
    restored = [next((r for r in resumed.records(rank) if r["event"] == "restored"), None) for rank in range(args.world)]
    if any(r is None for r in restored):
        raise DemoError("a resumed rank recorded no restore")
    rstep = restored[0]["step"]
    combined = {s: l for s, l in tries["attempt 1"].items() if s <= rstep} | tries["attempt 2"]
    problems = []
    if sorted(ref_loss) != list(range(1, args.steps + 1)):
        problems.append(f"the reference logged steps {sorted(ref_loss)}")
    if sorted(combined) != list(range(1, args.steps + 1)):
        problems.append(f"the failed-and-resumed job logged steps {sorted(combined)}")
    diffs = {}
    for label, losses in tries.items():  # every step either attempt computed, replays included
        for s, l in losses.items():
            diffs[(label, s)] = abs(l - ref_loss.get(s, math.nan))
    max_diff = max(diffs.values(), default=math.nan)
    exact = all(d == 0 for d in diffs.values())
    if not max_diff <= args.tolerance:
        bad = sorted(k for k, d in diffs.items() if not d <= args.tolerance)
        problems.append(f"loss differs from the reference (max |diff| {max_diff:.3g}) at {bad[:6]}")
    if {r["step"] for r in restored} != {rstep}:
        problems.append(f"ranks restored different steps: {[r['step'] for r in restored]}")
    tiers = [r["tier"] for r in restored]
    if any(t != "ram" for t in tiers):
        problems.append(f"restore came from tiers {tiers}, not all from 'ram'")
    if not args.kill_step - 1 <= rstep <= args.kill_step:
        problems.append(f"restored step {rstep}, expected {args.kill_step} (or {args.kill_step - 1})")
    done = {label: [r for r in job.records(0) if r["event"] == "done"] for label, job in (("reference", ref), ("resumed", resumed))}
    sha = {label: d[-1]["weights"] if d else None for label, d in done.items()}
    same_weights = sha["reference"] is not None and sha["reference"] == sha["resumed"]
    if not same_weights and (exact or args.tolerance == 0):
        problems.append(f"final weights differ: {sha}")

    # The losses around the kill, side by side.
    print(f"\n== 3. check: loss per step, reference vs. failed-and-resumed (all {args.steps} steps compared)")
    print(f"   {'step':>4}  {'reference':>12}  {'attempt 1':>12}  {'attempt 2':>12}  {'|diff|':>8}")
    lo, hi = max(1, rstep - 3), min(args.steps, args.kill_step + 4)
    for s in range(lo, hi + 1):
        a1, a2 = tries["attempt 1"].get(s), tries["attempt 2"].get(s)
        d = max((diffs.get((k, s), 0.0) for k in tries), default=0.0)
        note = ""
        if s == args.kill_step:
            note = f"  <- rank {args.kill_rank} SIGKILLed after this save"
        if s == rstep:
            note += f"  <- restored step ({restored[0]['tier']})"
        fmt = lambda v: f"{v:12.6f}" if v is not None else f"{'-':>12}"  # noqa: E731
        print(f"   {s:>4}  {ref_loss.get(s, math.nan):12.6f}  {fmt(a1)}  {fmt(a2)}  {d:8.1e}{note}")
    print(f"   final weights (blake2b): reference {str(sha['reference'])[:16]}, resumed {str(sha['resumed'])[:16]}"
          f" ({'identical' if same_weights else 'different'})")  # fmt: skip
    if not same_weights:  # where the runs parted: the first step whose updated weights differ
        ref_w = {r["step"]: r["weights"] for r in ref.records(0) if r["event"] == "step"}
        parted = [(job.label, r["step"]) for job in (crashed, resumed) for r in job.records(0)
                  if r["event"] == "step" and r["weights"] != ref_w.get(r["step"])]  # fmt: skip
        print(f"   weights first differ after: {parted[:1] or 'no step (only at the end)'}")
    if rstep < args.kill_step:
        print(f"   step {args.kill_step} was not committed by every rank when the job died, so the ranks agreed on "
              f"step {rstep},\n   the newest step all of them could restore, and computed step {args.kill_step} again.")

    # 4. The table.
    def blocking(jobs_):
        return [r["blocking_s"] * 1e3 for j in jobs_ for rank in range(args.world) for r in j.records(rank) if r["event"] == "step"]

    def steps_str(d):
        return "; ".join(f"{t} {','.join(map(str, v)) or '-'}" for t, v in d[-1]["steps"].items()) if d else "-"

    ref_ms, run_ms = blocking([ref]), blocking([crashed, resumed])
    nbytes = next(r["nbytes"] for r in ref.records(0) if r["event"] == "step")
    disk_steps = len(done["resumed"][-1]["steps"].get("disk", [])) if done["resumed"] else 0
    disk_bytes = dir_bytes(work / "run-disk")
    restore_total = max(r["total_s"] for r in restored)
    restore_read = max(r["read_s"] for r in restored)
    ok = not problems
    rows = [
        ("save blocking, median (ms)", f"{statistics.median(ref_ms):.2f}", f"{statistics.median(run_ms):.2f}"),
        ("save blocking, p90 (ms)", f"{percentile(ref_ms, 0.9):.2f}", f"{percentile(run_ms, 0.9):.2f}"),
        ("restore time (s)", "-", f"{restore_total:.3f} (read {restore_read:.3f}, slowest rank)"),
        ("restored step / tier", "-", f"{rstep} / {','.join(sorted(set(tiers)))}"),
        ("checkpoint bytes per rank", human(nbytes), human(nbytes)),
        ("disk bytes per rank-step (zstd:3)", "-",
         human(disk_bytes / max(1, disk_steps * args.world)) + f" ({disk_bytes / max(1, disk_steps * args.world * nbytes):.0%})"),
        ("steps committed at the end", steps_str(done["reference"]), steps_str(done["resumed"])),
        ("check (loss every step)", "", ("PASS" if ok else "FAIL") + (
            " (bit-exact, same final weights)" if exact and same_weights else f" (max |diff| {max_diff:.1e})")),
    ]  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "reference", "")])
    print(f"\n== 4. summary ({args.world} ranks, {args.steps} steps, {elapsed:.0f} s)")
    print(f"   {'':<{w0}}  {'reference':<{w1}}  failed at step {args.kill_step}, resumed")
    for name, a, b in rows:
        print(f"   {name:<{w0}}  {a:<{w1}}  {b}")
    for p in problems:
        print(f"   FAIL: {p}")
    warnings = [w for r in restored for w in r.get("warnings", [])]
    for w in warnings[:5]:
        print(f"   restore warning: {w}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-step", type=int, default=17)
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds for the whole demo (default: scales with --world and --steps; 514 s for the defaults)")
    ap.add_argument("--progress-every", type=float, default=15, help="a line when the ranks were quiet this many seconds")
    ap.add_argument("--tolerance", type=float, default=1e-6, help="largest |loss diff| that passes")
    ap.add_argument("--keep", action="store_true", help="keep the shared memory and directories")
    # Internal: the trainer processes.
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer:
        return trainer(args)
    if not (0 <= args.kill_rank < args.world and 2 <= args.kill_step < args.steps):
        ap.error("need 0 <= --kill-rank < --world and 2 <= --kill-step < --steps")
    if args.timeout is None:
        args.timeout = default_timeout(args.world, args.steps, args.kill_step)

    work = Path(tempfile.mkdtemp(prefix="tiercel-demo-"))
    shm_base = Path("/dev/shm") if os.path.isdir("/dev/shm") else work
    shm = shm_base / f"tiercel-demo-{os.getpid()}"
    # SIGTERM (a CI timeout) should clean up too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
    try:
        ok = run_demo(args, work, shm)
        print("\nPASS: the job that lost a rank resumed from RAM and matched the reference step for step"
              if ok else "\nFAIL")  # fmt: skip
        return 0 if ok else 1
    except DemoError as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"kept: {work} {shm}")
        else:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
