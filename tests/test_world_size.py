"""Resuming at another world size, as torchrun would relaunch a job (gloo on loopback).

Repro (issue 28 items 1 and 2): saved by 2 ranks, then
- restarted on 3: `latest_step()` was None and `tiercel.torch.load_state()` returned None
  ("nothing saved yet"), so the loop retrained from step 1;
- restarted on 1: `restore()` returned rank 0's part only (rank 1's state silently lost).
Now both raise WorldSizeError naming the steps, their world size and how to reshard;
`restore(rank=r)` / `reader(rank=r)` read saved rank r's part on purpose, and
`latest_step(reshard=True)` (what resharding readers use) still finds the step.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_policy, new_shm_root
from test_multirank import run_ranks

SAVED_WORLD = 2


def rank_state(rank: int, step: int) -> dict:
    rng = np.random.default_rng(10 * step + rank)
    return {"w": rng.standard_normal(20_000).astype(np.float32), "who": {"rank": rank, "step": step}}


def make_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Linear(16, 4)


WORKER = r"""
import json, os, sys, traceback
from datetime import timedelta
import numpy as np
import torch, torch.distributed as dist
import tiercel, tiercel.torch
from test_world_size import make_model, rank_state

plain, torched, phase, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
store, tstore = tiercel.Store(plain), tiercel.Store(torched)
report = {}

def outcome(fn):
    try:
        return ["ok", fn()]
    except tiercel.TiercelError as e:
        return [type(e).__name__, str(e)]

if phase == "save":
    model = make_model(rank)
    for step in (1, 2, 3):
        store.save(step, rank_state(rank, step)).wait(60)
        tiercel.torch.save_state(tstore, step, model=model, extra={"rank": rank, "step": step}).wait(60)
else:
    report["latest"] = outcome(store.latest_step)
    report["restore"] = outcome(lambda: store.restore()["who"])
    report["restore_step"] = outcome(lambda: store.restore(step=3)["who"])
    report["reader_step"] = outcome(lambda: store.reader(3).step)
    report["reshard_latest"] = outcome(lambda: store.latest_step(reshard=True))
    # Saved rank r's part, on purpose: every process reads rank (its rank % 2).
    r = rank % 2
    got = outcome(lambda: store.restore(rank=r))
    if got[0] == "ok":
        want = rank_state(r, 3)
        got = ["ok", [store.last_restore.step, got[1]["who"], bool(np.array_equal(got[1]["w"], want["w"]))]]
    report["restore_rank"] = got
    report["restore_step_rank"] = outcome(lambda: store.restore(step=2, rank=r)["who"])
    report["reader_rank"] = outcome(lambda: [store.reader(rank=r).step, store.reader(2, rank=r).get("who")])
    extra = {}
    report["load_state"] = outcome(lambda: tiercel.torch.load_state(tstore, model=make_model(99), extra=extra))
tstore.close()
store.close()
dist.destroy_process_group()
with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


@pytest.fixture
def roots(tmp_path):
    shm = [new_shm_root("ws"), new_shm_root("wt")]
    yield [make_policy(shm[0], tmp_path / "disk"), make_policy(shm[1], tmp_path / "tdisk")]
    import shutil

    for r in shm:
        shutil.rmtree(r, ignore_errors=True)


def run_phase(tmp_path, roots, phase: str, world: int) -> list[dict]:
    out = tmp_path / "reports"
    out.mkdir(exist_ok=True)
    run_ranks(WORKER, [json.dumps(roots[0]), json.dumps(roots[1]), phase, str(out)], tmp_path, world=world, tag=phase)
    return [json.loads((out / f"{phase}-{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [3, 1])
def test_resume_at_another_world_size_is_refused_loudly(tmp_path, roots, world):
    run_phase(tmp_path, roots, "save", SAVED_WORLD)
    reports = run_phase(tmp_path, roots, "resume", world)
    for rank, r in enumerate(reports):
        # Never "nothing saved": an error that names the step, both world sizes and the ways on.
        for key in ("latest", "restore", "restore_step", "reader_step", "load_state"):
            kind, msg = r[key]
            assert kind == "WorldSizeError", (rank, key, r[key])
            assert "step 3" in msg and f"saved by {SAVED_WORLD} rank(s)" in msg and f"this job has {world}" in msg, msg
            assert "rank=r" in msg and "tiercel.dcp" in msg, msg
        # A resharding reader still sees the step.
        assert r["reshard_latest"] == ["ok", 3], r
        # Saved rank r's part, asked for: the newest step's, or the step given.
        part = rank % SAVED_WORLD
        assert r["restore_rank"] == ["ok", [3, {"rank": part, "step": 3}, True]], r
        assert r["restore_step_rank"] == ["ok", {"rank": part, "step": 2}], r
        assert r["reader_rank"] == ["ok", [3, {"rank": part, "step": 2}]], r
