"""The peer tier across real processes: ranks of a torch.distributed job (gloo on 127.0.0.1)
on simulated hosts, each host with its own shared-memory root and the ranks' peer servers on
loopback. A host whose RAM is wiped restores from its peers; a lost group falls back, all
ranks together, to the same persistent step."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import new_shm_root
from test_multirank import run_ranks

WORKER = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch
import torch.distributed as dist
import tiercel

base, mode, out_dir, last, sparse = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "sparse"
host = os.environ["TIERCEL_HOST"]

def state(rank, step):
    rng = np.random.default_rng(7919 * step + rank)
    return {"model": {"w": torch.from_numpy(rng.standard_normal((256, 256)).astype(np.float32)),
                      "b": rng.integers(0, 255, 70_000 + 1000 * rank, dtype=np.uint8)},
            "meta": {"step": step, "rank": rank}}

policy = {
    "tier": [
        {"name": "ram", "kind": "memory", "root": f"{base}/shm/{host}", "keep": 2},
        {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2},
        {"name": "disk", "kind": "fs", "url": f"{base}/disk", "every": 2},
    ],
    "restore": {"order": ["ram", "peer", "disk"]},
    "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
}
if sparse:  # RAM keeps one step, the peer tier gets every 2nd; no durable tier
    policy["tier"] = [dict(policy["tier"][0], keep=1), dict(policy["tier"][1], every=2)]
    policy["restore"]["order"] = ["ram", "peer"]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
report = {"rank": rank, "host": host}
if mode == "save":
    report["states"] = {}
    for step in range(1, last + 1):
        report["states"][step] = store.save(step, state(rank, step)).wait(60)
else:
    got = store.restore()
    info = store.last_restore
    want = state(rank, info.step)
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert np.array_equal(got["model"]["b"], want["model"]["b"])
    assert got["meta"] == want["meta"]
    report.update(step=info.step, tiers=info.tiers, warnings=info.warnings)
dist.barrier()
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def run_job(tmp_path, base, hosts: list[str], mode: str, last: int, sparse: bool = False) -> list[dict]:
    """Runs one rank per entry of `hosts` (the rank's host name); returns their reports.
    `sparse`: the policy whose memory tier keeps one step and whose peer tier gets every 2nd."""
    env_of = lambda rank: {"TIERCEL_HOST": hosts[rank], "OMP_NUM_THREADS": "1"}  # noqa: E731
    run_ranks(WORKER, [str(base), mode, str(tmp_path), str(last), "sparse" if sparse else "all"], tmp_path, len(hosts), env_of,
              tag=mode)
    return [json.loads((tmp_path / f"{mode}-{r}.json").read_text()) for r in range(len(hosts))]


@pytest.fixture
def base(tmp_path):
    b = tmp_path / "run"
    (b / "disk").mkdir(parents=True)
    shm = b / "shm"
    shm.parent.mkdir(exist_ok=True)
    # Memory roots must be on tmpfs: link <base>/shm to a fresh /dev/shm directory (unique:
    # other test sessions on the machine use the same tmp_path names).
    target = new_shm_root("peer")
    target.mkdir()
    shm.symlink_to(target)
    yield b
    shutil.rmtree(target, ignore_errors=True)


def test_a_wiped_host_restores_from_its_peers(tmp_path, base):
    hosts = ["hostA", "hostA", "hostB", "hostB"]
    saved = run_job(tmp_path, base, hosts, "save", last=3)
    for r in saved:
        # Every step went to the peer tier (committed = every peer host acknowledged).
        assert all(s["peer"] == "committed" for s in r["states"].values()), r
    # Host B loses everything in RAM (a replacement machine): its own steps and the
    # replicas it held for host A.
    shutil.rmtree(base / "shm" / "hostB")
    restored = run_job(tmp_path, base, hosts, "restore", last=3)
    for r in restored:
        assert r["step"] == 3, r
        expected = "peer" if r["host"] == "hostB" else "ram"
        assert set(r["tiers"]) == {expected}, r


def test_memory_keeps_its_copy_of_the_newest_replicated_step_beyond_its_keep(tmp_path, base):
    # RAM keeps 1 step, the peer tier replicates every 2nd: after step 3, RAM holds step 3 and
    # also step 2, the own copy of the newest replicated step (else a host loss would find the
    # lost host's replicas of step 2 and no surviving copy of the other ranks' parts).
    hosts = ["hostA", "hostA", "hostB", "hostB"]
    saved = run_job(tmp_path, base, hosts, "save", last=3, sparse=True)
    for r in saved:
        assert r["states"]["2"]["peer"] == "committed" and r["states"]["3"]["peer"] == "not scheduled", r
    for h in ("hostA", "hostB"):
        steps = sorted(int(d.name.split("-")[1]) for d in (base / "shm" / h).glob("step-*"))
        assert steps == [2, 3], (h, steps)
    shutil.rmtree(base / "shm" / "hostB")
    restored = run_job(tmp_path, base, hosts, "restore", last=3, sparse=True)
    for r in restored:
        assert r["step"] == 2, r
        assert set(r["tiers"]) == ({"peer"} if r["host"] == "hostB" else {"ram"}), r


def test_a_lost_group_falls_back_to_the_same_persistent_step(tmp_path, base):
    # Four hosts, m = 2: groups {0, 1} and {2, 3} replicate to each other.
    hosts = ["h0", "h1", "h2", "h3"]
    run_job(tmp_path, base, hosts, "save", last=5)
    for h in ("h0", "h1"):
        shutil.rmtree(base / "shm" / h)
    restored = run_job(tmp_path, base, hosts, "restore", last=5)
    # Hosts 0 and 1 lost every copy of step 5 (theirs and their group's replicas): every rank
    # falls back to step 4, the newest on disk (every = 2), which hosts 2, 3 still have in RAM.
    assert {r["step"] for r in restored} == {4}, restored
    for r in restored:
        assert set(r["tiers"]) == ({"disk"} if r["host"] in ("h0", "h1") else {"ram"}), r


def test_too_few_hosts_run_degraded(tmp_path, base):
    # torchrun with 2 ranks on one machine: one host, fewer than replicas = 2. Saves go on
    # without peer copies, the handles say why, each process warns once; restores use ram.
    saved = run_job(tmp_path, base, ["solo", "solo"], "save", last=3)
    for r in saved:
        assert all(s["peer"] == "skipped: not enough hosts (1 < 2)" for s in r["states"].values()), r
        assert all(s["ram"] in ("committed", "written") for s in r["states"].values()), r
    for rank in range(2):
        log = (tmp_path / f"save-{rank}.out").read_text()
        assert log.count("not enough hosts (1 < 2)") == 1, log
    restored = run_job(tmp_path, base, ["solo", "solo"], "restore", last=3)
    assert [(r["step"], set(r["tiers"])) for r in restored] == [(3, {"ram"}), (3, {"ram"})], restored


def test_a_single_process_runs_degraded(make_store, policy):
    peer = {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2}
    store = make_store({**policy, "tier": [policy["tier"][0], peer, policy["tier"][1]]})
    states = store.save(2, {"x": list(range(10))}).wait(60)
    assert states == {"ram": "committed", "peer": "skipped: not enough hosts (1 < 2)", "disk": "committed"}
    assert store.steps() == {"ram": [2], "peer": [], "disk": [2]} and store.steps().errors == {}
    assert store.restore() == {"x": list(range(10))} and store.last_restore.warnings == []
