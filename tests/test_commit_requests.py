"""Requests per rank per step on an object store, counted at the server: a save costs each
rank O(1) requests whatever the number of ranks (docs/scale.md, "Commit").

Real ranks: processes forked from one parent that imported torch and tiercel once (as
tests/test_coordinator_scale.py does, to keep memory and CPU low), one real TCPStore (the
job's coordinator: its `add` is the commit counter), each rank with its own Store, a memory
tier and an S3 tier on moto behind the fault proxy in counting mode (no faults). The steps
after the first are counted: every request of every rank, by kind."""

from __future__ import annotations

import json
import statistics
import subprocess
import time

import pytest

from conftest import PYTHON, child_env
from faultproxy import FaultProxy
from fork_ranks import FORK_RANKS
from servers import moto_server, s3_env  # noqa: F401 (fixtures)
from test_object_store import shm  # noqa: F401 (fixture)

td = pytest.importorskip("torch.distributed")

STEPS = 4  # counted; one more before them is not (the store's first listing, the bucket check)

WORKER = r"""
import datetime, json, os, sys, traceback
import numpy as np
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, policies, steps, out = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]


def rank_main(rank):
    kv = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
    c = tc.KVStoreCoordinator(kv, rank, world, prefix="commit-requests")
    store = tiercel.Store(policies[rank], coordinator=c)
    state = {"w": np.full(1024, rank, dtype=np.float32)}
    for step in range(1, steps + 2):
        store.save(step, state).wait(timeout=60)
        store.flush()
        tc.barrier(c)  # every rank's persist of this step is over
        if rank == 0:
            open(f"{out}/step-{step}", "w").close()
        tc.barrier(c)  # the parent takes its counts between steps
    store.close()
""" + FORK_RANKS


def counted(world: int, shm, tmp_path, bucket: str, endpoint: str) -> tuple[list[list[int]], list[int], list[str]]:
    """Runs `world` ranks for STEPS + 1 steps, each rank's S3 requests through a proxy of its
    own. For each step after the first: every rank's requests, by rank; the LISTs of all
    ranks together; and the busiest rank's requests, as "KIND target" lines (for messages)."""
    proxies = [FaultProxy(endpoint, faults={}) for _ in range(world)]
    try:
        ram = shm()
        policies = [{
            "tier": [
                {"name": "ram", "kind": "memory", "root": str(ram), "keep": 2},
                {"name": "s3", "kind": "s3", "url": f"s3://{bucket}/run{world}", "endpoint": p.endpoint, "allow_http": True,
                 "compression": "none", "keep": 2},
            ],
            "store": {"threads": 1, "io_threads": 1},
        } for p in proxies]
        master = td.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
        out = tmp_path / f"w{world}"
        out.mkdir()
        proc = subprocess.Popen([PYTHON, "-c", WORKER, str(master.port), str(world), json.dumps(policies), str(STEPS), str(out)],
                                env=child_env({"OMP_NUM_THREADS": "1", "TIERCEL_HOST": "one-host"}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        marks: list[list[tuple[int, int, int]]] = []  # per step end: per rank (requests, LISTs, log length)
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if len(list(out.glob("step-*"))) > len(marks):
                marks.append([(sum(p.requests.values()), p.requests["LIST"], len(p.request_log)) for p in proxies])
            time.sleep(0.005)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
        assert len(marks) == STEPS + 1, f"saw {len(marks)} steps end, not {STEPS + 1}"
        by_rank, lists, busiest = [], [], []
        for before, after in zip(marks, marks[1:]):
            reqs = [a[0] - b[0] for a, b in zip(after, before)]
            by_rank.append(reqs)
            lists.append(sum(a[1] - b[1] for a, b in zip(after, before)))
            r = max(range(world), key=lambda r: reqs[r])
            busiest.append(proxies[r].request_log[before[r][2] : after[r][2]])
        return by_rank, lists, busiest[0]
    finally:
        for p in proxies:
            p.close()


# A rank that does not commit, in one step: its manifest (and its data object, unless every
# chunk is reused), a look at one or two commit records, one batched delete. Which step's
# window a rank's sweep falls in depends on when it learns of a commit, so a single step may
# show 1 or 3 where the mean is 2: the bounds are on the mean over the steps, and constant.
OTHER_RANK_MEAN = 4
OTHER_RANK_MOST = 6
COMMITTER_MOST = 16  # its own save, the commit record, retention of one step (2 LISTs, deletes)


def test_a_save_costs_each_rank_the_same_requests_at_4_and_24_ranks(moto_server, s3_env, shm, tmp_path):  # noqa: F811
    """A rank's requests per step are bounded by the same constants at 4 and at 24 ranks:
    every rank but the one that commits makes a few (mean and most), the one that commits
    and runs retention a bounded number more, whatever N; no rank lists on the save path
    (the retaining rank lists the root, and a step it removes)."""
    bucket = moto_server.new_bucket()
    seen = {}
    for world in (4, 24):
        by_rank, lists, busiest = counted(world, shm, tmp_path, bucket, moto_server.endpoint)
        others = [n for step in by_rank for n in sorted(step)[:-1]]  # each step's committer left out
        mean, most = statistics.mean(others), max(others)
        committer = max(max(step) for step in by_rank)
        seen[world] = {"other ranks, mean": round(mean, 2), "other ranks, most": most, "committer": committer,
                       "all ranks": round(sum(map(sum, by_rank)) / STEPS, 1), "LISTs": lists}
        what = f"{world} ranks: {seen[world]}; the busiest rank's requests in the first counted step:\n" + "\n".join(busiest)
        assert max(lists) <= 2, f"LISTs per step {lists}, at most 2 on one host; {what}"
        assert mean <= OTHER_RANK_MEAN, f"a rank that does not commit made {mean:.2f} requests a step, more than {OTHER_RANK_MEAN}; {what}"
        assert most <= OTHER_RANK_MOST, f"a rank that does not commit made {most} requests in a step, more than {OTHER_RANK_MOST}; {what}"
        assert committer <= COMMITTER_MOST, f"the committing rank made {committer} requests in a step, more than {COMMITTER_MOST}; {what}"
    print("requests per step:", json.dumps(seen))
