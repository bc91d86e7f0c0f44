"""Read-your-writes for "the newest step": right after `save(k)` in the same process,
`latest_step()`, `restore()` and `reader()` without a step see step k, not the step before
(the memory tier's commit of k runs in the background; a read of "the newest step" waits
for this process's own saves to reach it). Repro (issue 28 item 6): save k then restore()
for k = 1..6 returned step k-1's values for some k."""

from __future__ import annotations

import json

import numpy as np

from conftest import make_policy
from test_multirank import run_ranks


def state_of(step: int, rank: int = 0) -> dict:
    # A few MB, so that the background checksum pass of the memory commit takes a while.
    rng = np.random.default_rng(100 * step + rank)
    return {"w": rng.standard_normal(600_000).astype(np.float32), "meta": {"step": step, "rank": rank}}


def test_restore_right_after_save_sees_that_step(make_store, shm_root, disk_root):
    store = make_store(make_policy(shm_root, disk_root))
    for k in range(1, 7):
        store.save(k, state_of(k))
        got = store.restore()
        assert store.last_restore.step == k, (k, store.last_restore)
        assert got["meta"] == {"step": k, "rank": 0}
        np.testing.assert_array_equal(got["w"], state_of(k)["w"])
    for k in range(7, 13, 2):
        store.save(k, state_of(k))
        assert store.latest_step() == k
        store.save(k + 1, state_of(k + 1))
        assert store.reader().step == k + 1


WORKER = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from test_newest_after_save import state_of

policy, out_dir = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
seen = []
for k in range(1, 7):
    store.save(k, state_of(k, rank))
    got = store.restore()
    ok = got["meta"] == {"step": k, "rank": rank} and np.array_equal(got["w"], state_of(k, rank)["w"])
    seen.append([store.last_restore.step, ok])
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(seen, f)
"""


def test_two_ranks_restore_right_after_save(tmp_path, shm_root, disk_root):
    """Two ranks on one host: the memory tier commits a step once both have written it, by
    whichever finishes last; both still agree on the step just saved."""
    out = tmp_path / "reports"
    out.mkdir()
    run_ranks(WORKER, [json.dumps(make_policy(shm_root, disk_root)), str(out)], tmp_path, world=2)
    for r in range(2):
        seen = json.loads((out / f"rank-{r}.json").read_text())
        assert seen == [[k, True] for k in range(1, 7)], (r, seen)
