"""What is at risk, live (issue 32, 3): per tier, the newest committed step, seconds since it
was saved, and the bytes handed to the tier that it does not have yet, in `store.metrics()`,
the Prometheus text and `tiercel stats`.

A real slow tier: an fs tier at 128 KB/s, so that a 256 KiB persist takes ~2 s while the
memory tier has the step in milliseconds: the disk tier visibly falls behind, then catches up.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tiercel import cli, metrics

from conftest import make_policy

STEP_BYTES = 256 << 10


def state(step: int) -> dict:
    return {"w": np.full(STEP_BYTES // 4, step, dtype=np.float32)}


@pytest.fixture
def slow(shm_root, disk_root, make_store):
    """ram, then disk with every = 1 at 128 KB/s: a 256 KiB persist takes ~2 s."""
    return make_store(make_policy(shm_root, disk_root, every=1, compression="none", disk_opts={"bandwidth": "128KB/s"}))


def test_the_recovery_point_moves_as_saves_persist_and_fall_behind(slow, capsys):
    before = slow.metrics()["disk"]
    assert (before["committed_step"], before["committed_age_seconds"], before["unwritten_bytes"]) == (None, None, 0)

    slow.save(1, state(1)).wait(60)
    first = slow.metrics()
    assert [(first[t]["committed_step"], first[t]["unwritten_bytes"]) for t in ("ram", "disk")] == [(1, 0), (1, 0)], first
    time.sleep(0.3)
    # Nothing newer saved: the recovery point ages between scrapes.
    later = slow.metrics()["disk"]
    assert later["committed_age_seconds"] >= first["disk"]["committed_age_seconds"] + 0.3, (first, later)

    # Step 2 is in memory at once; the disk tier takes ~2 s to get it.
    h = slow.save(2, state(2))
    deadline = time.monotonic() + 60
    while h.states()["ram"] != "committed":
        assert time.monotonic() < deadline, h.states()
        time.sleep(0.01)
    behind = slow.metrics()
    ram, disk = behind["ram"], behind["disk"]
    assert h.states()["disk"] in ("queued", "running"), h.states()  # still on its way: the scrape was in time
    assert (ram["committed_step"], ram["unwritten_bytes"]) == (2, 0), ram
    assert (disk["committed_step"], disk["unwritten_bytes"]) == (1, STEP_BYTES), disk
    # The disk tier's recovery point is step 1's save, older than step 2's.
    assert disk["committed_age_seconds"] > ram["committed_age_seconds"] + 0.3, behind
    parsed = metrics.parse_prometheus(metrics.prometheus_text(slow))[("disk", 0)]
    assert (parsed["committed_step"], parsed["unwritten_bytes"]) == (1.0, float(STEP_BYTES)), parsed
    assert parsed["committed_age_seconds"] >= disk["committed_age_seconds"], parsed
    text = metrics.prometheus_text(slow)
    for name in ("tiercel_committed_step", "tiercel_committed_age_seconds", "tiercel_unwritten_bytes"):
        assert f"# TYPE {name} gauge" in text, text

    server = metrics.serve(slow)
    try:
        assert cli.main(["stats", "--url", f"127.0.0.1:{server.port}"]) == 0
    finally:
        server.close()
    out = capsys.readouterr().out.splitlines()
    header, disk_row = out[0], next(line for line in out[1:] if line.split()[0] == "disk")

    def cell(column: str) -> str:  # the columns are right-aligned: a cell ends where its header does
        return disk_row[:header.index(column) + len(column)].rsplit("  ", 1)[-1].strip()

    assert (cell("COMMITTED"), cell("UNWRITTEN")) == ("1", "256.0 KiB"), out
    assert float(cell("AGE S")) >= 0.3, out

    slow.flush()
    assert h.wait(60)["disk"] == "committed"
    done = slow.metrics()
    assert [(done[t]["committed_step"], done[t]["unwritten_bytes"]) for t in ("ram", "disk")] == [(2, 0), (2, 0)], done
    # Both tiers now hold step 2: the same recovery point.
    assert abs(done["disk"]["committed_age_seconds"] - done["ram"]["committed_age_seconds"]) < 0.05, done


TWO_RANKS = r"""
import json, os, sys, time
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

policy, out_dir = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
if rank == 1:
    time.sleep(0.5)  # rank 0 writes first: rank 1, the last, makes the commits
states = store.save(1, {"w": np.full(1000, rank, dtype=np.float32)}).wait(60, commit=True)
m = store.metrics()
report = {"states": states, **{t: (m[t]["committed_step"], m[t]["unwritten_bytes"]) for t in ("ram", "disk")}}
dist.barrier()
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_a_rank_that_did_not_commit_learns_the_commit(tmp_path, shm_root, disk_root):
    """The last rank to write a step commits it; the other learns it when its wait for the
    commit sees it, and counts it as its tiers' committed step too."""
    from test_multirank import run_ranks

    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    run_ranks(TWO_RANKS, [json.dumps(make_policy(shm_root, disk_root, every=1)), str(out_dir)], tmp_path, world=2)
    for rank in (0, 1):
        r = json.loads((out_dir / f"rank-{rank}.json").read_text())
        assert r["states"] == {"ram": "committed", "disk": "committed"}, r
        assert (r["ram"], r["disk"]) == ([1, 0], [1, 0]), (rank, r)
