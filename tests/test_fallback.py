"""A restore without a step falls back past a step whose data is damaged on every tier.

Repro (issue 28 item 5): with the newest step's data chunks failing their checksum on every
tier, `restore()` raised although the step before verified. Now a restore without an
explicit step takes the newest step that reads and verifies for every rank (all ranks fall
back together), and says which steps it skipped and why (`last_restore.warnings`, a log
line); `restore(step=N)` still raises IntegrityError.
"""

from __future__ import annotations

import gc
import json
import logging

import numpy as np
import pytest

import tiercel

from conftest import assert_same, chunk_location, flip_byte, make_policy, manifest_path
from test_multirank import run_ranks


def state(step: int, rank: int = 0) -> dict:
    rng = np.random.default_rng(10 * step + rank)
    # 200 KB: chunks 0..3 of 64 KiB
    return {"model": {"w": rng.standard_normal(50_000).astype(np.float32)}, "meta": {"step": step, "rank": rank}}


def damage(policy: dict, step: int, rank: int = 0, tiers: tuple[str, ...] = ("ram", "disk")) -> None:
    """Flips a byte inside chunk 1 of 'model/w' of `rank`'s part of `step` on those of
    `tiers` that hold it (retention may have removed it from RAM)."""
    for t in policy["tier"]:
        if t["name"] in tiers and manifest_path(t.get("root") or t["url"], step, rank).exists():
            path, off, length = chunk_location(t.get("root") or t["url"], step, "model/w", chunk=1, rank=rank)
            flip_byte(path, off + length // 2)


@pytest.fixture
def policy(shm_root, disk_root):
    return make_policy(shm_root, disk_root, every=1)  # every step on both tiers


def saved(policy: dict, steps: range) -> None:
    """Saves steps in a store that is gone before the test touches the files."""
    s = tiercel.Store(policy, rank=0, world_size=1)
    for step in steps:
        s.save(step, state(step)).wait(60)
    s.close()
    del s
    gc.collect()


def test_damaged_in_ram_only_is_read_from_disk(policy, make_store):
    """The zero-copy path verifies what it maps: a flipped byte in RAM is caught there, and
    that chunk comes from disk (the step itself is fine)."""
    saved(policy, range(1, 4))
    damage(policy, 3, tiers=("ram",))
    store = make_store()
    assert_same(store.restore(), state(3))
    assert store.last_restore.step == 3 and "ram+disk" in store.last_restore.tiers, store.last_restore


def test_newest_damaged_everywhere_falls_back(policy, make_store, caplog):
    saved(policy, range(1, 4))
    damage(policy, 3)
    store = make_store()
    with caplog.at_level(logging.WARNING, logger="tiercel"):
        got = store.restore()
    assert_same(got, state(2))
    info = store.last_restore
    assert info.step == 2, info
    skipped = [w for w in info.warnings if w.startswith("step 3 skipped")]
    assert len(skipped) == 1, info.warnings
    for part in ("rank 0", "'model/w'", "chunk 1", "no tier has a valid copy"):
        assert part in skipped[0], skipped[0]
    assert any("step 3 skipped" in r.getMessage() and "older step" in r.getMessage() for r in caplog.records), caplog.text
    # The step asked for by number: its error, not another step.
    with pytest.raises(tiercel.IntegrityError) as ei:
        store.restore(step=3)
    assert ei.value.step == 3 and "chunk 1" in str(ei.value)
    # Two damaged steps: two skipped, both named.
    damage(policy, 2)
    assert_same(store.restore(), state(1))
    assert [w[:14] for w in store.last_restore.warnings if "skipped" in w] == ["step 3 skipped", "step 2 skipped"]
    # Every step damaged: an IntegrityError that names each, not "nothing saved".
    damage(policy, 1)
    with pytest.raises(tiercel.IntegrityError) as ei:
        store.restore()
    for step in (1, 2, 3):
        assert f"step {step} skipped" in str(ei.value), str(ei.value)


WORKER = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from conftest import assert_same
from test_fallback import damage, state

policy, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
for step in (1, 2, 3):
    store.save(step, state(step, rank)).wait(60)
dist.barrier()
if rank == 1:  # only rank 1's part of step 3, on every tier
    damage(policy, 3, rank=1)
dist.barrier()
got = store.restore()
assert_same(got, state(store.last_restore.step, rank))
report = {"step": store.last_restore.step, "warnings": store.last_restore.warnings}
try:
    store.restore(step=3)
    report["explicit"] = "ok"
except tiercel.TiercelError as e:
    report["explicit"] = type(e).__name__
store.close()
dist.destroy_process_group()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_two_ranks_fall_back_together(tmp_path, policy):
    """Rank 1's part of the newest step is damaged on every tier, rank 0's is fine: both
    ranks restore the step before, and both say why."""
    out = tmp_path / "reports"
    out.mkdir()
    run_ranks(WORKER, [json.dumps(policy), str(out)], tmp_path, world=2)
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in reports] == [2, 2], reports
    for r in reports:
        assert any(w.startswith("step 3 skipped") and "rank 1" in w and "chunk 1" in w for w in r["warnings"]), r
    assert [r["explicit"] for r in reports] == ["ok", "IntegrityError"], reports
