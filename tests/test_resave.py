"""Saving a step number again (a job that went back, Orbax's max_to_keep, a relaunch that
redoes a step) from several ranks: a restore returns the whole new save, the whole old one,
or an older step, bit-identical, and never old ranks with new ones.

Repro (before saves carried a generation): two ranks (gloo) save step 5 (version A), then
rank 0 alone saves step 5 again (version B) while rank 1 has not begun: rank 0's flush found
rank 1's old manifest next to its new one and committed the step; `restore()` then gave rank
0 version B and rank 1 version A. The same when rank 1 is killed before its re-save: the
relaunched job restored that mix of step 5 on both tiers."""

from __future__ import annotations

import json

import numpy as np

from conftest import make_policy
from test_multirank import run_ranks

WORLD = 2


def rank_state(rank: int, step: int, version: str) -> dict:
    """Different for every rank, step and version; the same in every process."""
    rng = np.random.default_rng([step, rank, ord(version)])
    return {"model": {"w": rng.standard_normal((64, 100)).astype(np.float32)}, "meta": {"step": step, "version": version}}


WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import tiercel
from conftest import assert_same
from test_resave import rank_state

policy, out_dir, phase = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
report = {"rank": rank}

def restored():
    got = store.restore()
    step, version = store.last_restore.step, got["meta"]["version"]
    assert_same(got, rank_state(rank, step, version))  # whole and bit-identical, or this fails
    return {"step": step, "version": version, "warnings": store.last_restore.warnings}

if phase == "first":
    for step in (4, 5):
        store.save(step, rank_state(rank, step, "A")).wait(60)
    store.flush()
    dist.barrier()
    # Rank 0 saves step 5 again and finishes before rank 1 begins (not `wait()`: that waits
    # for rank 1's part of the memory commit).
    if rank == 0:
        store.save(5, rank_state(rank, 5, "B"))
        store.flush()
    dist.barrier()
    report["midway"] = restored()
    dist.barrier()
    if rank == 1:
        store.save(5, rank_state(rank, 5, "B")).wait(60)
        store.flush()
    dist.barrier()
    report["after"] = restored()
    dist.barrier()
    # Saved again once more, now rank 1 dies before its part (the launcher kills rank 0).
    if rank == 0:
        store.save(5, rank_state(rank, 5, "C"))
        store.flush()
    dist.barrier()
    with open(os.path.join(out_dir, f"{phase}-{rank}.json"), "w") as f:
        json.dump(report, f)
    if rank == 1:
        os.kill(os.getpid(), 9)
    dist.barrier()  # rank 0 waits here until the launcher kills it
else:
    report["relaunch"] = restored()
    with open(os.path.join(out_dir, f"{phase}-{rank}.json"), "w") as f:
        json.dump(report, f)
    store.close()
    dist.destroy_process_group()
"""


def test_resaved_step_is_never_a_mix_of_ranks(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, every=1, ram={"keep": 3}, disk_opts={"keep": 3})
    out = tmp_path / "reports"
    out.mkdir()
    run_ranks(WORKER, [json.dumps(policy), str(out), "first"], tmp_path, world=WORLD, victim=1, tag="first")
    run_ranks(WORKER, [json.dumps(policy), str(out), "relaunch"], tmp_path, world=WORLD, tag="relaunch")
    first = [json.loads((out / f"first-{r}.json").read_text()) for r in range(WORLD)]
    relaunch = [json.loads((out / f"relaunch-{r}.json").read_text()) for r in range(WORLD)]

    def agreed(phase: str, reports: list[dict]) -> tuple[int, str]:
        got = {(r[phase]["step"], r[phase]["version"]) for r in reports}
        assert len(got) == 1, f"{phase}: the ranks restored different saves {got}: {reports}"
        return got.pop()

    # Midway, rank 0's new part is everywhere its old one was: step 5 is on no tier whole
    # (uncommitted on both), so both ranks restore step 4.
    assert agreed("midway", first) == (4, "A"), first
    # Both ranks saved it again: the new step 5.
    assert agreed("after", first) == (5, "B"), first
    # Rank 0 saved it a third time, rank 1 died first: neither B (rank 0's is gone) nor C
    # (rank 1's never came) is whole; the relaunch goes back to step 4.
    assert agreed("relaunch", relaunch) == (4, "A"), relaunch


RACE_WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import tiercel
from conftest import assert_same
from test_resave import rank_state

policy, out_dir = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
assert store._core.has_counter()

def on_disk():
    try:
        commit = json.loads(store._core.commit_record("disk", 5)).get("generation")
    except tiercel.NotFoundError:
        commit = None
    return {"commit": commit, "manifests": [json.loads(store._core.manifest_json("disk", 5, r)).get("generation") for r in range(2)]}

store.save(4, rank_state(rank, 4, "A")).wait(60)
store.flush()
dist.barrier()
# Rank 0 saves step 5 (A), then again (B), both persisted, while rank 1 has not begun.
if rank == 0:
    store.save(5, rank_state(rank, 5, "A"))
    store.flush()
    store.save(5, rank_state(rank, 5, "B"))
    store.flush()
dist.barrier()
# Only now rank 1 writes its part of the first save (A): it counts in under A's key.
if rank == 1:
    store.save(5, rank_state(rank, 5, "A"))
    store.flush()
dist.barrier()
report = {"raced": on_disk()}
dist.barrier()
if rank == 1:
    store.save(5, rank_state(rank, 5, "B")).wait(60)
    store.flush()
dist.barrier()
report["after"] = on_disk()
got = store.restore()
assert_same(got, rank_state(rank, store.last_restore.step, got["meta"]["version"]))
report["restored"] = [store.last_restore.step, got["meta"]["version"]]
with open(os.path.join(out_dir, f"race-{rank}.json"), "w") as f:
    json.dump(report, f)
store.close()
dist.destroy_process_group()
"""


def test_two_saves_of_a_step_racing_never_commit_mixed(tmp_path, shm_root, disk_root):
    """The counted commit (docs/scale.md, "Commit") with two saves of step 5 in flight: rank 0
    writes save A and then save B of it before rank 1 writes its part of A. Rank 1's count
    completes A's count, but rank 0 retracted its own from A's (its part is B's now), so A
    never commits: the fs tier holds no commit of A next to rank 0's manifest of B. Once rank 1
    writes B too, B commits and restores whole on both ranks.

    Repro (the counter without the retraction): rank 1's add brought A's count to 2 and it
    committed A over rank 0's manifest of B."""
    policy = make_policy(shm_root, disk_root, every=1, ram={"keep": 3}, disk_opts={"keep": 3})
    out = tmp_path / "reports"
    out.mkdir()
    run_ranks(RACE_WORKER, [json.dumps(policy), str(out)], tmp_path, world=WORLD, tag="race")
    reports = [json.loads((out / f"race-{r}.json").read_text()) for r in range(WORLD)]
    raced, after = reports[0]["raced"], reports[0]["after"]
    a, b = raced["manifests"][1], raced["manifests"][0]
    assert a != b and raced["commit"] is None, f"committed {raced['commit']} over manifests {raced['manifests']}: {reports}"
    assert after["commit"] == b and after["manifests"] == [b, b], reports
    assert [r["restored"] for r in reports] == [[5, "B"]] * WORLD, reports
