"""Chaos on the peer tier: a 2-host job (torch.distributed, gloo on loopback, a memory and a
peer tier) whose rank 1 aborts in the middle of pushing a replica (failpoint `replicate` at
a random chunk) or of an eviction (`evict`) while rank 0 is SIGKILLed at a random moment; then a fresh launch checks that
every step committed on each tier restores bit-identical from that tier alone on every rank,
and the next launch resumes from there. TIERCEL_CHAOS_PEER_KILLS sets the cycles."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time

from conftest import PYTHON, child_env, new_shm_root
from test_multirank import free_port, run_ranks

CYCLES = int(os.environ.get("TIERCEL_CHAOS_PEER_KILLS", "3"))

WORKER = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

mode, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
host = os.environ["TIERCEL_HOST"]

def state(rank, step):
    rng = np.random.default_rng(1000 * step + rank)
    return {"w": rng.standard_normal(60_000).astype(np.float32), "step": step, "rank": rank}

policy = {
    "tier": [
        {"name": "ram", "kind": "memory", "root": f"{base}/{host}", "keep": 2},
        {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2},
    ],
    "restore": {"order": ["ram", "peer"]},
    "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 1},
}
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank = dist.get_rank()
store = tiercel.Store(policy)
if mode == "save":
    newest = store.latest_step() or 0
    step = newest + 1
    print("ready", step, flush=True)
    while True:
        h = store.save(step, state(rank, step))
        h._core.wait(None)  # the peer tier fails once the other host is gone: a clear state, not a crash
        print("saved", step, h.states(), flush=True)
        step += 1
verified, committed = 0, store.steps()
for tier, steps in committed.items():
    for step in steps:
        got = store.reader(step, tiers=[tier]).get_all()
        want = state(rank, step)
        assert np.array_equal(got["w"], want["w"]) and got["step"] == step and got["rank"] == rank, (tier, step)
        verified += 1
dist.barrier()
store.close()
json.dump({"rank": rank, "committed": committed, "verified": verified}, open(f"{out}/check-{rank}.json", "w"))
"""


def test_peer_replication_killed_mid_push(tmp_path):
    shm = new_shm_root("chaos-peer")
    shm.mkdir()
    rnd = random.Random(13)
    fired = verified = 0
    try:
        for cycle in range(CYCLES):
            port = free_port()
            procs = []
            for rank in range(2):
                env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                       "TIERCEL_HOST": f"host{rank}", "OMP_NUM_THREADS": "1"}
                if rank == 1:  # mid-push, or mid-eviction (of its own steps or of the replicas it holds)
                    env["TIERCEL_FAILPOINT"] = f"{rnd.choice(['replicate', 'evict'])}:{rnd.randint(1, 12)}"
                log = open(tmp_path / f"save-{cycle}-{rank}.log", "w")
                procs.append((subprocess.Popen([PYTHON, "-c", WORKER, "save", str(shm), str(tmp_path)], stdout=log,
                                               stderr=subprocess.STDOUT, env=child_env(env)), log))
            try:
                p1 = procs[1][0]
                p1.wait(120)  # rank 1 aborts at its failpoint
                assert p1.returncode == -signal.SIGABRT, (p1.returncode, (tmp_path / f"save-{cycle}-1.log").read_text()[-3000:])
                fired += 1
                time.sleep(rnd.uniform(0, 0.3))
                procs[0][0].kill()  # and the rest of the job goes down with it
            finally:
                for p, log in procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait(30)
                    log.close()
            out = tmp_path / f"check-{cycle}"
            out.mkdir()
            run_ranks(WORKER, ["check", str(shm), str(out)], tmp_path, 2, lambda r: {"TIERCEL_HOST": f"host{r}"}, tag=f"check-{cycle}")
            reports = [json.loads((out / f"check-{r}.json").read_text()) for r in range(2)]
            assert all(r["committed"]["ram"] for r in reports), reports
            verified += sum(r["verified"] for r in reports)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print("\nCHAOS peer " + json.dumps({"kills": 2 * fired, "failpoints_fired": fired, "steps_verified": verified}))
