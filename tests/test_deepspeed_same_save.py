"""A DeepSpeed step saved again on some ranks only is never loaded as a mix of its saves
(real DeepSpeed on the CPU, two ranks on gloo, two simulated hosts).

Repro (issue 29): hosts A and B, each with its own RAM tier, and a shared disk. Both ranks
save steps 1 and 2; a relaunched job loads step 2, updates once and saves step 2's tag again
on rank 0 only (rank 1 died before its save), persisted there. Rank 0's RAM holds the new
save of step 2, rank 1's RAM the old one, and the disk neither whole. `load_checkpoint` used to pick step 2 because every rank had *some*
save of it committed (tiercel.deepspeed.resolve counted committed steps on any tier, with no
same-save check): rank 0 loaded the new save, rank 1 its old optimizer partition with rank
0's new model states, and training went on from a state no run ever had. Now the ranks agree
on the step through the one step-agreement routine (tiercel.newest, the same-save check):
both load step 1, and the run continues bit for bit like the uninterrupted reference.
"""

from __future__ import annotations

import pytest
from test_deepspeed import assert_continues_like, reference, run_job  # noqa: F401 - reference: the fixture

pytest.importorskip("deepspeed")  # the ranks run it; this process never imports it

SAVED = 2  # the step saved by both ranks, then again by rank 0 alone


def test_a_step_saved_again_on_one_rank_loads_one_save_on_every_rank(tmp_path, shm_root, reference):  # noqa: F811
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": f"{shm_root}/{{host}}", "keep": 3},
            {"name": "disk", "kind": "fs", "url": str(tmp_path / "disk"), "every": 1, "keep": 3},
        ],
        "restore": {"order": ["ram", "disk"]},
        "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
    }
    hosts = ["hostA", "hostB"]
    cfg = {"stage": 2, "steps": SAVED, "mode": "tiercel", "policy": policy, "save_dir": str(tmp_path / "ckpt")}
    saved = run_job(tmp_path, cfg, "saved", hosts=hosts)
    assert len(saved) == 2 and all(r["states"]["disk"] in ("committed", "written") for r in saved), saved
    # A relaunch loads step 2, updates once, and redoes step 2's save on rank 0 only (rank 1
    # died first): a fresh process, whose layout of the step is like rank 1's.
    redo = run_job(tmp_path, {**cfg, "resume": True, "resave_rank0": True}, "redo", hosts=hosts)
    assert [r["loaded"]["global_steps"] for r in redo] == [SAVED, SAVED], redo

    resumed = run_job(tmp_path, {**cfg, "steps": 4, "resume": True}, "resumed", hosts=hosts)
    assert len(resumed) == 2, resumed
    loaded = [r["loaded"]["global_steps"] for r in resumed]
    # Step 1 (step 2's saves differ between the ranks' tiers); never rank 0's new save of
    # step 2 (global step 3) with rank 1's old one.
    assert loaded == [SAVED - 1, SAVED - 1], resumed
    assert assert_continues_like(reference(2), tmp_path, "resumed", resumed) == SAVED - 1
