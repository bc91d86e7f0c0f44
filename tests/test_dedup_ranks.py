"""Ranks that hold the same bytes (issue 31, "across ranks"): two ranks of a data-parallel job
save the same parameters without declaring them replicated, each with a small state of its
own. A tier that dedups stores the parameters once a step (one rank's copy, the other's
manifest refers to it), and once over steps that do not change them; each rank restores
every step bit-identical from that tier alone; a damaged chunk of the one copy fails every
step that uses it, on both ranks, and their restores take it from another tier.

Real ranks: processes forked from one parent (tests/fork_ranks.py), one real TCPStore (the
job's coordinator and its counter), a memory tier on one host and two fs tiers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, child_env, du
from fork_ranks import FORK_RANKS
from test_object_store import shm  # noqa: F401 (fixture)

td = pytest.importorskip("torch.distributed")

MODEL = 1 << 20  # bytes of parameters each rank holds, the same on both

WORKER = r"""
import datetime, glob, json, os, sys, traceback
import numpy as np
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, policy, root = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]


def state(step, rank):
    # Steps 2 and 3 hold the same parameters (nothing trained in between).
    w = np.random.default_rng(min(step, 2)).standard_normal(MODEL // 4).astype(np.float32)
    return {"model": {"w": w}, "mine": {"rank": np.full(64, rank * 100 + step, np.int32)}}


def same(got, want):
    return all(got[k][n].tobytes() == want[k][n].tobytes() for k in want for n in want[k])


def manifests(step):
    found = [json.load(open(p)) for p in glob.glob(f"{root}/disk/ranks/*/rank-*/step-{step:012d}.manifest.json")]
    return sorted(found, key=lambda m: m["rank"])


def rank_main(rank):
    kv = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
    c = tc.KVStoreCoordinator(kv, rank, world, prefix="dedup-ranks")
    with tiercel.Store(policy, coordinator=c) as store:
        for step in (1, 2, 3):
            store.save(step, state(step, rank)).wait(timeout=60)
            store.flush()
            tc.barrier(c)  # both ranks' persists of the step are over
        for step in (1, 2, 3):
            assert same(store.reader(step, tiers=["disk"]).get_all(), state(step, rank)), (rank, step)
        tc.barrier(c)
        if rank == 0:
            # What the parent checks: which rank stores the parameters of each step.
            out = {step: [[it.get("replica") for it in m["items"] if it["name"] == "model/w"][0] for m in manifests(step)]
                   for step in (1, 2, 3)}
            json.dump(out, open(f"{root}/replicas.json", "w"))
            # Damage the one stored copy of step 3's parameters (step 2's object, reused).
            m = next(m for m in manifests(3) if not [it for it in m["items"] if it["name"] == "model/w"][0].get("replica"))
            it = next(it for it in m["items"] if it["name"] == "model/w")
            ch = it["chunks"][0]
            path = glob.glob(f"{root}/disk/" + m["objects"][ch["object"]]["key"])[0]
            with open(path, "r+b") as f:
                f.seek(ch["stored_offset"] + 10)
                b = f.read(1)
                f.seek(ch["stored_offset"] + 10)
                f.write(bytes([b[0] ^ 0xFF]))
        tc.barrier(c)
        for step in (2, 3):
            try:
                store.reader(step, tiers=["disk"]).get_all()
                raise AssertionError(f"rank {rank} read step {step} from the damaged copy")
            except tiercel.IntegrityError as e:
                assert "model/w" in str(e), e
            assert same(store.reader(step, tiers=["disk", "disk2"]).get_all(), state(step, rank)), (rank, step)
        assert same(store.reader(1, tiers=["disk"]).get_all(), state(1, rank))
        tc.barrier(c)
""".replace("MODEL", str(MODEL)) + FORK_RANKS


@pytest.mark.parametrize("compression", ["none", "zstd:3"])
def test_two_ranks_with_the_same_parameters_store_them_once(shm, tmp_path, compression):  # noqa: F811
    ram = shm()
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(ram), "keep": 3},
            {"name": "disk", "kind": "fs", "url": str(tmp_path / "disk"), "compression": compression},
            {"name": "disk2", "kind": "fs", "url": str(tmp_path / "disk2"), "compression": "none", "dedup": False},
        ],
        "store": {"threads": 1, "io_threads": 1},
    }
    master = td.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    proc = subprocess.run([PYTHON, "-c", WORKER, str(master.port), "2", json.dumps(policy), str(tmp_path)],
                          env=child_env({"OMP_NUM_THREADS": "1", "TIERCEL_HOST": "one-host"}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    replicas = json.loads((tmp_path / "replicas.json").read_text())
    for step, (r0, r1) in replicas.items():
        # One rank stores the parameters; the other's manifest refers to its copy.
        assert [r0, r1].count(None) == 1, (step, r0, r1)
        follower = r0 or r1
        assert follower["matched"] and follower["shared"] and follower["primary"] == [r0, r1].index(None), (step, follower)
    assert replicas["2"] == replicas["3"], "the same primary while the parameters stay the same"
    # Two distinct parameter sets (steps 1 and 2 = 3), each stored once; disk2 (no dedup)
    # holds both ranks' copies of all three steps.
    stored = du(tmp_path / "disk")
    least = 2 * MODEL if compression == "none" else 1.6 * MODEL  # random weights compress little
    assert least <= stored <= 2 * MODEL + (256 << 10), f"disk holds {stored} bytes for 2 parameter sets of {MODEL}"
    assert du(tmp_path / "disk2") >= 6 * MODEL
    assert not list(Path(tmp_path / "disk").rglob("*.tmp*")), "temporary files left behind"
    # `tiercel inspect` tells the bytes a rank's step refers to in another rank's objects.
    toml = tmp_path / "policy.toml"
    toml.write_text(f'[[tier]]\nname = "ram"\nkind = "memory"\nroot = "{ram}"\n\n'
                    f'[[tier]]\nname = "disk"\nkind = "fs"\nurl = "{tmp_path / "disk"}"\n')
    out = subprocess.run([PYTHON, "-m", "tiercel", "--policy", str(toml), "inspect", "3", "--tier", "disk", "--json"],
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = sorted(r["other_ranks_bytes"] for r in json.loads(out.stdout)["ranks"])
    assert theirs[0] == 0 and theirs[1] >= MODEL * (0.8 if compression != "none" else 1), theirs


KILL_WORKER = r"""
import datetime, glob, json, os, sys, time, traceback
import numpy as np
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, policy, phase = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]


def state(step):
    return {"model": {"w": np.random.default_rng(step).standard_normal(MODEL // 4).astype(np.float32)}}


def rank_main(rank):
    if phase == "kill" and rank == 0:
        os.environ["TIERCEL_FAILPOINT"] = "persist:2"  # step 2: its data is written, its manifest is not
    kv = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
    c = tc.KVStoreCoordinator(kv, rank, world, prefix="dedup-kill-" + phase)
    with tiercel.Store(policy, coordinator=c) as store:
        if phase == "kill":
            for step in (1, 2):
                time.sleep(0.5 * rank)  # rank 0 meets the other first: the primary
                store.save(step, state(step)).wait(timeout=60)
                store.flush()
            return
        assert store.steps()["disk"] == [1], store.steps()
        got = store.restore()
        assert store.last_restore.step == 1 and got["model"]["w"].tobytes() == state(1)["model"]["w"].tobytes()
        store.save(2, state(2)).wait(timeout=60)
        store.flush()
        tc.barrier(c)
        assert store.reader(2, tiers=["disk"]).get_all()["model"]["w"].tobytes() == state(2)["model"]["w"].tobytes()
        tc.barrier(c)
""".replace("MODEL", str(MODEL)) + FORK_RANKS


def test_the_primary_killed_before_its_manifest_leaves_the_step_uncommitted(shm, tmp_path):  # noqa: F811
    """Rank 0 stores the parameters both ranks hold and is killed before its manifest of step 2
    (failpoint `persist`), after rank 1 wrote its manifest referring to rank 0's copy: step 2
    never commits, and the job relaunched on wiped hosts restores step 1 from the disk and
    saves step 2 again."""
    policy = {
        "tier": [{"name": "ram", "kind": "memory", "root": "", "keep": 2},
                 {"name": "disk", "kind": "fs", "url": str(tmp_path / "disk"), "compression": "none"}],
        "store": {"threads": 1, "io_threads": 1},
    }
    for phase in ("kill", "relaunch"):
        policy["tier"][0]["root"] = str(shm())  # a host wiped between the launches
        master = td.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
        proc = subprocess.run([PYTHON, "-c", KILL_WORKER, str(master.port), "2", json.dumps(policy), phase],
                              env=child_env({"OMP_NUM_THREADS": "1", "TIERCEL_HOST": "one-host"}),
                              capture_output=True, text=True, timeout=300)
        if phase == "kill":
            assert "failpoint 'persist' reached" in proc.stderr and "ranks [0] failed" in proc.stderr, proc.stderr[-6000:]
            follower = json.loads(next((tmp_path / "disk").glob("ranks/*/rank-00001/step-000000000002.manifest.json")).read_text())
            assert follower["items"][0]["replica"] == {"primary": 0, "shared": True, "matched": True}, follower["items"][0]
            assert not (tmp_path / "disk" / "step-000000000002" / "COMMIT").exists()
        else:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
