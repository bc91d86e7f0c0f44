"""A peer tier tried on one machine: docs/troubleshooting.md's recipe (each rank its own
TIERCEL_HOST and memory root) runs as written under torchrun with 2 ranks, and a rank that
closes first keeps its peer server up until a slower rank's replica of the same step has
arrived (close() on a peer tier waits for replication to it, bounded)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from conftest import PYTHON, TESTS_DIR, child_env, new_shm_root
from test_multirank import run_ranks

RECIPE_MARK = "<!-- not-run: two ranks under torchrun; tests/test_peer_one_machine.py runs it as written -->"


def recipe() -> str:
    text = (TESTS_DIR.parent / "docs" / "troubleshooting.md").read_text()
    after = text[text.index(RECIPE_MARK) + len(RECIPE_MARK):]
    m = re.match(r"\s*```python\n(.*?)```", after, re.S)
    assert m, "the recipe's python block follows its marker"
    return m.group(1)


def test_the_one_machine_recipe_runs_as_written(tmp_path):
    root = new_shm_root("recipe")
    script = tmp_path / "try_peer.py"
    # The docs' example path, mapped to a directory of this test (as tests/test_docs.py does).
    script.write_text(recipe().replace("/dev/shm/tiercel", str(root)))
    try:
        logs = tmp_path / "logs"
        p = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "--log-dir", str(logs), "--redirects", "3", str(script)],
                           capture_output=True, text=True, timeout=240, env=child_env({"OMP_NUM_THREADS": "1"}),
                           cwd=str(tmp_path))
        # Each rank's output in its own file (one pipe would interleave them).
        out = {int(f.parent.name): f.read_text() for f in logs.glob("**/attempt_0/*/stdout.log")}
        err = "".join(f.read_text() for f in logs.glob("**/attempt_0/*/stderr.log"))
        assert p.returncode == 0, p.stdout + p.stderr + err
        for rank in (0, 1):
            assert out[rank].splitlines() == [f"{rank} {{'ram': 'committed', 'peer': 'committed'}}"] * 3, (out, err)
        # Each host keeps the other's replicas, in its own root.
        for host, other in (("host0", 1), ("host1", 0)):
            assert (root / "try-peer" / host / "peers" / "step-000000000003" / f"rank-{other:05d}.manifest.json").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


CLOSE_FIRST = r"""
import json, os, sys, time
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

base, out_dir = sys.argv[1], sys.argv[2]
host = os.environ["TIERCEL_HOST"]
policy = {"tier": [{"name": "ram", "kind": "memory", "root": f"{base}/{host}"},
                   {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2}]}
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
report = {"1": store.save(1, {"w": np.full(1000, rank)}).wait(60)}
dist.barrier()
if rank == 1:
    # Done first: closes while rank 0 has yet to replicate step 2 to this host.
    report["2"] = store.save(2, {"w": np.full(1000, 20 + rank)}).wait(60)
    t0 = time.monotonic()
    store.close()
    report["close_seconds"] = time.monotonic() - t0
else:
    time.sleep(1.0)
    try:
        report["2"] = store.save(2, {"w": np.full(1000, 20 + rank)}).wait(60)
    except tiercel.TiercelError as e:
        report["2"] = f"{type(e).__name__}: {e}"
    store.close()
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_a_rank_that_closes_first_still_takes_the_replica_a_slower_rank_sends(tmp_path):
    root = new_shm_root("closefirst")
    out = tmp_path / "out"
    out.mkdir()
    try:
        run_ranks(CLOSE_FIRST, [str(root), str(out)], tmp_path, world=2, tag="close-first",
                  env_of=lambda r: {"TIERCEL_HOST": f"host{r}", "OMP_NUM_THREADS": "1"})
        r0, r1 = (json.loads((out / f"rank-{r}.json").read_text()) for r in range(2))
        both = {"ram": "committed", "peer": "committed"}
        assert r0["1"] == both and r1["1"] == both and r1["2"] == both, (r0, r1)
        assert r0["2"] == both, (r0, (tmp_path / "close-first-0.out").read_text())
        # Rank 1's close waited for rank 0's replica (about the second rank 0 slept).
        assert 0.5 < r1["close_seconds"] < 20, r1
        assert (root / "host1" / "peers" / "step-000000000002" / "rank-00000.manifest.json").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
