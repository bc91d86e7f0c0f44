"""The peer tier sends a holder only the chunks it lacks (docs/tiers.md, "What a push sends"):
two ranks on two hosts, rank 0's replicas going to host 1 through a counting TCP proxy spliced
into the members round (as tests/test_traffic.py does). A state of a large unchanged item and a
small changing one: step 2 puts at most the changed chunk and the manifests on the wire; a
chunk damaged in the holder's copy is sent again; a holder that lost its copies gets the whole
step; every step reads back bit-identical from the peer tier alone."""

from __future__ import annotations

import json

from test_multirank import run_ranks

WORKER = r"""
import glob, json, os, shutil, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from tiercel.coordinator import TorchCoordinator

shm, out_dir = sys.argv[1], sys.argv[2]
host = os.environ["TIERCEL_HOST"]

from peer_proxy import Splicing
Splicing.install()

CHUNK = 256 << 10
policy = {
    "tier": [
        {"name": "ram", "kind": "memory", "root": f"{shm}/{host}", "keep": 5},
        {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 5},
    ],
    "store": {"chunk_size": CHUNK, "threads": 1, "io_threads": 2},
}
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy, coordinator=TorchCoordinator())
base = np.random.default_rng(rank).integers(0, 255, 8 << 20, dtype=np.uint8)

def state(step):
    return {"base": base, "adapter": np.full(CHUNK, step, dtype=np.uint8)}

# Rank 0's replicas, as host 1 holds them.
held = f"{shm}/host1/peers"

def held_manifest(step):
    with open(f"{held}/step-{step:012d}/rank-00000.manifest.json") as f:
        return f.read()

def read_back(step):
    # This rank's part of `step`, from the peer tier alone (rank 0's from host 1).
    got = store.reader(step, tiers=["peer"]).get_all()
    want = state(step)
    assert sorted(got) == sorted(want), sorted(got)
    for k in want:
        assert np.array_equal(got[k], want[k]), (step, k)

# After each step, the steps whose held copies are intact then.
intact = {1: [1], 2: [1, 2], 3: [3], 4: [4]}
report = {"rank": rank, "wire": {}, "metrics": {}}
for step in (1, 2, 3, 4):
    if rank == 0 and step == 3:
        # One byte of the unchanged item flips in host 1's copies of steps 1 and 2 (from
        # either, a good copy would be reused).
        for old in (1, 2):
            m = json.loads(held_manifest(old))
            c = next(it for it in m["items"] if it["name"].endswith("base"))["chunks"][5]
            path = f"{held}/step-{old:012d}/" + m["objects"][c["object"]]["name"]
            with open(path, "r+b") as f:
                f.seek(c["stored_offset"] + 100)
                b = f.read(1)
                f.seek(c["stored_offset"] + 100)
                f.write(bytes([b[0] ^ 0x40]))
    if rank == 0 and step == 4:
        # Host 1 loses every copy it held of rank 0.
        for d in glob.glob(f"{held}/step-*"):
            shutil.rmtree(d)
    dist.barrier()
    before = Splicing.proxy.sent if rank == 0 else 0
    h = store.save(step, state(step))
    h.wait(120)
    assert h.states()["peer"] == "committed", h.states()
    dist.barrier()
    if rank == 0:
        report["wire"][step] = Splicing.proxy.sent - before
        report["manifest"] = len(held_manifest(step))
        p = store.metrics()["peer"]
        report["metrics"][step] = [p["last_bytes_sent"], p["last_bytes_replicated"], p["bytes_sent"], p["bytes_replicated"]]
    for s in intact[step]:
        read_back(s)
    dist.barrier()
report["read_back"] = True
dist.barrier()
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"dedup-{rank}.json"), "w") as f:
    json.dump(report, f)
"""

CHUNK = 256 << 10
STEP_BYTES = (8 << 20) + CHUNK


def test_a_holder_with_the_previous_step_is_sent_only_what_changed(tmp_path, shm_root):
    env_of = lambda rank: {"TIERCEL_HOST": f"host{rank}", "OMP_NUM_THREADS": "1"}  # noqa: E731
    run_ranks(WORKER, [str(shm_root), str(tmp_path)], tmp_path, 2, env_of, tag="dedup")
    r0, r1 = (json.loads((tmp_path / f"dedup-{r}.json").read_text()) for r in range(2))
    assert r0["read_back"] and r1["read_back"]
    wire = {int(k): v for k, v in r0["wire"].items()}
    metrics = {int(k): v for k, v in r0["metrics"].items()}
    # The manifest goes twice at most (the push, a restore's fetch), with its frames around it.
    overhead = 2 * r0["manifest"] + (16 << 10)
    # Step 1: everything; step 2: the changed adapter chunk and the manifests only.
    assert wire[1] >= STEP_BYTES, wire
    assert wire[2] <= CHUNK + overhead, wire
    assert metrics[1][:2] == [STEP_BYTES, STEP_BYTES], metrics
    assert metrics[2][:2] == [CHUNK, STEP_BYTES], metrics
    # Step 3: the chunk damaged in the holder's copies is sent again, with the changed one.
    assert 2 * CHUNK <= wire[3] <= 2 * CHUNK + overhead, wire
    assert metrics[3][:2] == [2 * CHUNK, STEP_BYTES], metrics
    # Step 4: the holder lost its copies: the whole step.
    assert wire[4] >= STEP_BYTES, wire
    assert metrics[4] == [STEP_BYTES, STEP_BYTES, 2 * STEP_BYTES + 3 * CHUNK, 4 * STEP_BYTES], metrics
