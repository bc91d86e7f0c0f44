"""Store open with a peer tier at scale: what each rank receives from the coordinator does not
grow with the number of ranks. N ranks (forked processes, two per $TIERCEL_HOST host) open a
Store with a memory tier and a peer tier through a KVStoreCoordinator on one real TCPStore,
every store call counted by a proxy that forwards to it (counting, not mocking); then each
saves a step, which its peer tier replicates to its placement's holders, and reads it back
from them. Costs asserted here are the formulas of docs/scale.md, "Coordination"."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest

from conftest import PYTHON, child_env
from fork_ranks import FORK_RANKS

td = pytest.importorskip("torch.distributed")

PER_HOST = 2

WORKER = r"""
import datetime, json, os, sys, traceback
import numpy as np
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, base, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
per_host = PER_HOST


class Counting:
    # Forwards every call to the real store; counts calls, and the bytes of every `get` by
    # what it read: a round's "in" key (every rank's value: the combining rank only) or a
    # result ("part": all that a rank that did not combine receives).
    def __init__(self, store):
        self._store, self.calls, self.got = store, 0, {"in": 0, "part": 0}

    def __getattr__(self, name):
        real = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls += 1
            result = real(*args, **kwargs)
            if name == "get":
                key = str(args[0])
                self.got["in" if key.endswith("/in") else "part"] += len(result)
            return result

        return call


def rank_main(rank):
    host = f"h{rank // per_host}"
    os.environ["TIERCEL_HOST"] = host
    policy = {"tier": [{"name": "ram", "kind": "memory", "root": f"{base}/{host}"},
                       {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2}],
              "store": {"threads": 1, "io_threads": 1}}
    real = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=90))
    counting = Counting(real)
    c = tc.KVStoreCoordinator(counting, rank, world, prefix=f"open{world}")
    s = tiercel.Store(policy, coordinator=c)
    got = {"calls": counting.calls, "in": counting.got["in"], "part": counting.got["part"],
           "hosts": s.hosts}
    s.save(1, {"w": np.full(256, rank, dtype=np.int32)}).wait(60, commit=True)
    tc.barrier(c)
    # Read back from the holders alone: the peer tier found them from what it learned.
    back = s.reader(1, tiers=["peer"]).get("w")
    got["peer_steps"] = s.steps().get("peer", [])
    got["back"] = bool((back == rank).all())
    tc.barrier(c)
    s.close()
    with open(f"{out}/open{world}-{rank}.json", "w") as f:
        json.dump(got, f)


""".replace("PER_HOST", str(PER_HOST)) + FORK_RANKS


def open_at(tmp_path, shm_root, world: int) -> list[dict]:
    master = td.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    proc = subprocess.run([PYTHON, "-c", WORKER, str(master.port), str(world), str(shm_root / f"w{world}"), str(tmp_path)],
                          env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    left = [k for k in master.list_keys() if k.startswith(f"open{world}")]
    assert left == [], f"the coordinator left {len(left)} keys in the store, e.g. {left[:5]}"
    return [json.loads((tmp_path / f"open{world}-{r}.json").read_text()) for r in range(world)]


def test_store_open_hands_each_rank_its_hosts_part_whatever_the_world_size(tmp_path, shm_root):
    """At 6 ranks (3 hosts) and 12 (6 hosts): every rank replicates to its peers and reads
    its step back from them, and a rank that did not combine a round (nor is rank 0, which
    also receives every rank's host for DCP's planning) receives the same bytes at 12 ranks
    as at 6 (within 10%: host names grow a digit; the median of those ranks), in as many
    store calls; an all-gather of every rank's address hands each rank N of them."""
    received, calls = {}, {}
    for world in (6, 12):
        got = open_at(tmp_path, shm_root, world)
        bad = [r for r, g in enumerate(got) if not g["back"] or 1 not in g["peer_steps"]]
        assert not bad, f"{world} ranks: ranks {bad} did not replicate and read back step 1: {[got[r] for r in bad]}"
        assert got[0]["hosts"] == [f"h{r // PER_HOST}" for r in range(world)]
        assert all(g["hosts"] is None for g in got[1:]), "only rank 0 learns every rank's host"
        others = [g for r, g in enumerate(got) if r != 0 and g["in"] == 0]
        assert others, f"{world} ranks: every rank combined a round"
        # Most ranks' bytes; the one that reads last also reads what it deletes (which rank
        # that is, and so whether it combined, is timing): bounded, not compared.
        parts = sorted(g["part"] for g in others)
        received[world] = statistics.median(parts)
        assert parts[-1] <= 2 * received[world], f"{world} ranks: a rank received {parts[-1]} bytes at open, most {received[world]}"
        # Most ranks' calls: not the combining rank's, nor the last reader's (it deletes the
        # round's O(hosts) parts: O(N) in total).
        counts = [g["calls"] for g in got]
        calls[world] = (max(set(counts), key=counts.count), max(counts))
    print({"bytes received by most ranks that did not combine": received, "store calls (most ranks, busiest)": calls})
    assert received[12] <= 1.1 * received[6], f"bytes most ranks receive at Store open grew with N: {received}"
    assert calls[12][0] == calls[6][0], f"store calls of most ranks grew with N: {calls}"
    # Two rounds (the exchange, the barrier after connecting) of at most 9 calls each, and a
    # delete per part (one per host, and rank 0's).
    assert calls[12][1] <= 2 * 9 + 12 // PER_HOST + 1, f"the busiest rank made more than O(1) + one delete per part: {calls}"


ERROR_WORKER = r"""
import datetime, os, sys, traceback
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def rank_main(rank):
    os.environ["TIERCEL_HOST"] = f"h{rank}"
    policy = {"tier": [{"name": "ram", "kind": "memory", "root": f"{base}/h{rank}"},
                       {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "placement": "group"}]}
    real = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    try:
        tiercel.Store(policy, coordinator=tc.KVStoreCoordinator(real, rank, world, prefix="bad"))
    except tiercel.InvalidArgumentError as e:
        assert "2 does not divide 3" in str(e) and "hosts: h0, h1, h2" in str(e) and f"rank {rank}" in str(e), e
        return
    raise AssertionError(f"rank {rank} opened a store whose placement cannot be made")


""" + FORK_RANKS


def test_a_placement_that_cannot_be_made_fails_every_rank_none_waits(tmp_path, shm_root):
    """Group placement of 2 replicas over 3 hosts: the rank that combines finds it cannot be
    made, and every rank raises InvalidArgumentError naming it and the hosts."""
    master = td.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    proc = subprocess.run([PYTHON, "-c", ERROR_WORKER, str(master.port), "3", str(shm_root)],
                          env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
