"""Three ranks of a real torch.distributed job (gloo on 127.0.0.1) share one memory tier and
one fs tier: they save together, agree on the step to restore, and fall back together when
one rank's copy of the newest step is gone."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import torch

from conftest import PYTHON, child_env, make_policy, manifest_path

WORLD = 3
TIMEOUT = 240


def rank_state(rank: int, step: int) -> dict:
    """Different for every rank and step; the same in every process."""
    rng = np.random.default_rng(1000 * step + rank)
    return {
        "model": {
            "w": torch.from_numpy(rng.standard_normal((200, 300)).astype(np.float32)),
            "shard": rng.integers(0, 255, 100_000 + 1000 * rank, dtype=np.uint8),  # sizes differ by rank
        },
        "optim": {"step": step, "rank": rank, "m": rng.standard_normal(5000)},
    }


WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import tiercel
from conftest import assert_same, manifest_path
from test_multirank import rank_state

policy, out_dir = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
report = {"rank": rank}

store = tiercel.Store(policy)  # rank, world size and coordinator from torch.distributed
assert (store.rank, store.world_size) == (rank, world), (store.rank, store.world_size)
assert type(store.coordinator).__name__ == "TorchCoordinator"

report["states"] = {}
for step in range(1, 5):
    h = store.save(step, rank_state(rank, step))
    report["states"][step] = h.wait(60)
dist.barrier()

# Everyone agrees on the newest step and gets its own data back.
got = store.restore()
assert_same(got, rank_state(rank, 4))
report["first"] = {"step": store.last_restore.step, "tiers": store.last_restore.tiers, "steps": store.steps()}

# A rank can read another rank's items (DeepSpeed reads rank 0's model states everywhere).
other = (rank + 1) % world
assert_same(store.reader(4, rank=other).get("model"), rank_state(other, 4)["model"])
assert_same(store.reader(4, rank=other, tiers=["disk"]).get("optim"), rank_state(other, 4)["optim"])
dist.barrier()

# Rank 2 loses its ram copy of step 4 only: step 4 stays, rank 2 reads it from disk.
if rank == 2:
    manifest_path(policy["tier"][0]["root"], 4, rank).unlink()
dist.barrier()
got = store.restore()
assert_same(got, rank_state(rank, 4))
report["ram_lost"] = {"step": store.last_restore.step, "tiers": store.last_restore.tiers}
dist.barrier()

# Rank 1 loses its copy of step 4 everywhere (its manifests on ram and disk).
if rank == 1:
    for tier in policy["tier"]:
        manifest_path(tier.get("root") or tier.get("url"), 4, rank).unlink()
dist.barrier()

got = store.restore()
report["second"] = {"step": store.last_restore.step, "tiers": store.last_restore.tiers, "warnings": store.last_restore.warnings}
assert_same(got, rank_state(rank, store.last_restore.step))
dist.barrier()

store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], tmp_path, world: int = WORLD, env_of=None, tag: str = "rank",
              victim: int | None = None, killed: bool = False, prefix_of=None) -> None:
    """Starts `world` ranks of `script` as a launcher would (torch.distributed env vars,
    one free port); `env_of(rank)` adds per-rank variables, `prefix_of(rank)` a command to
    run the rank under (e.g. `ip netns exec <ns>`). Fails the test with every rank's log
    when one fails or the job outlasts TIMEOUT.

    `victim`: that rank is to SIGKILL itself; once it has, the others are killed too, as a
    launcher tears a job down when one rank dies. `killed`: every rank is meant to end by
    SIGKILL (a crash the test stages); a rank that exits otherwise fails the test."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
                         **(env_of(rank) if env_of else {})})
        out = open(tmp_path / f"{tag}-{rank}.out", "w")
        cmd = [*(prefix_of(rank) if prefix_of else []), PYTHON, "-c", script, *args]
        procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), out))
    deadline = time.monotonic() + TIMEOUT
    failed = []
    try:
        order = list(range(world)) if victim is None else [victim]
        for rank in order:
            p = procs[rank][0]
            try:
                p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} timed out after {TIMEOUT} s")
                break
            if rank == victim and p.returncode != -signal.SIGKILL:
                failed.append(f"rank {rank} was to kill itself but exited with {p.returncode}")
            elif rank != victim and p.returncode != (-signal.SIGKILL if killed else 0):
                failed.append(f"rank {rank} exited with {p.returncode}, not {-signal.SIGKILL if killed else 0}")
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
            out.close()
    if failed:
        logs = "\n".join(f"--- rank {r}\n{(tmp_path / f'{tag}-{r}.out').read_text()[-4000:]}" for r in range(world))
        pytest.fail("; ".join(failed) + "\n" + logs)


def test_three_ranks_save_agree_and_fall_back(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, ram={"keep": 3})
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    run_ranks(WORKER, [json.dumps(policy), str(out_dir)], tmp_path)
    reports = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(WORLD)]

    for r in reports:
        # Every rank's saves ended well; ram commits once all ranks are in, so a rank sees
        # "written" (its part done, others pending) or "committed".
        for step, states in r["states"].items():
            assert states["ram"] in ("committed", "written"), (r["rank"], step, states)
            want_disk = ("committed", "written") if int(step) % 2 == 0 else ("not scheduled",)
            assert states["disk"] in want_disk, (r["rank"], step, states)
        assert r["first"]["step"] == 4, r
        assert set(r["first"]["tiers"]) == {"ram"}, r
        assert r["first"]["steps"] == {"ram": [2, 3, 4], "disk": [2, 4]}, r
    # At least the last rank to finish each step committed it.
    for step in ("1", "2", "3", "4"):
        assert any(r["states"][step]["ram"] == "committed" for r in reports), step

    # Rank 2's ram copy of step 4 gone: still step 4 for all, rank 2's from disk.
    assert [r["ram_lost"]["step"] for r in reports] == [4, 4, 4], reports
    assert [set(r["ram_lost"]["tiers"]) for r in reports] == [{"ram"}, {"ram"}, {"disk"}], reports

    # After rank 1 lost step 4, every rank restored step 3, the newest all of them have.
    assert [r["second"]["step"] for r in reports] == [3, 3, 3], reports
    assert all(set(r["second"]["tiers"]) == {"ram"} for r in reports), reports
    assert any("step 4" in w for w in reports[0]["second"]["warnings"]), reports[0]
    # The files are as the test left them: rank 1's manifests of step 4 are gone, others' not.
    assert not manifest_path(shm_root, 4, 1).exists() and manifest_path(shm_root, 4, 0).exists()


HOST_COMMIT_WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
import tiercel
from test_multirank import rank_state

policy, out_dir = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
report = {}
if rank == 0:
    h = store.save(1, rank_state(rank, 1))
    try:
        report["early"] = h.wait(0.3)
    except TimeoutError as e:
        report["early"] = f"TimeoutError: {e}"
    dist.barrier()  # rank 1 saves only now
    report["final"] = h.wait(60)
else:
    dist.barrier()
    time.sleep(0.5)
    store.save(1, rank_state(rank, 1)).wait(60)
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_wait_returns_once_the_host_has_committed(tmp_path, shm_root):
    """Two ranks on one host share its memory tier, which commits a step once both have
    written it. Repro: rank 0 saved step 1 and `handle.wait()` returned at once with
    `ram: written`, although rank 1 had not saved yet (and `wait(0.3)` raised nothing).
    Now `wait` returns once the host's commit is there, and `wait(timeout)` raises
    TimeoutError meanwhile, as docs/config.md says."""
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    run_ranks(HOST_COMMIT_WORKER, [json.dumps(make_policy(shm_root, None)), str(out_dir)], tmp_path, world=2)
    r = json.loads((out_dir / "rank-0.json").read_text())
    assert r["early"].startswith("TimeoutError") and "'ram': 'written'" in r["early"], r
    assert r["final"] == {"ram": "committed"}, r
