"""Requests at store open in a job with a coordinator (docs/scale.md, "Store open"): rank 0
checks what the tiers hold (the bucket exists: one LIST of one key; other jobs' steps: one
LIST of each tier's root) and the members round hands its answer to every rank, so the
other ranks send no request at open; a refused open fails on every rank, naming the tier.

Real ranks: processes forked from one parent (tests/test_coordinator_scale.py), one real
TCPStore, each rank with its own Store on moto behind a counting proxy of its own."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import PYTHON, child_env
from faultproxy import FaultProxy
from fork_ranks import FORK_RANKS
from servers import moto_server, s3_env  # noqa: F401 (fixtures)
from test_object_store import shm  # noqa: F401 (fixture)

td = pytest.importorskip("torch.distributed")

WORLD = 4

WORKER = r"""
import datetime, json, os, sys, traceback
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, policies, out = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]


def rank_main(rank):
    kv = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    c = tc.KVStoreCoordinator(kv, rank, world, prefix="open-requests")
    try:
        tiercel.Store(policies[rank], coordinator=c).close()
        got = {"ok": True}
    except tiercel.TiercelError as e:
        got = {"error": type(e).__name__, "message": str(e), "tier": e.tier}
    with open(f"{out}/rank-{rank}.json", "w") as f:
        json.dump(got, f)
""" + FORK_RANKS


def open_world(shm, tmp_path, url: str, endpoint: str, **store) -> tuple[list[dict], list[dict[str, int]]]:  # noqa: F811
    """Opens a store on WORLD ranks; each rank's outcome and its requests by kind."""
    proxies = [FaultProxy(endpoint, faults={}) for _ in range(WORLD)]
    try:
        policies = [{
            "tier": [
                {"name": "ram", "kind": "memory", "root": str(shm())},
                {"name": "s3", "kind": "s3", "url": url, "endpoint": p.endpoint, "allow_http": True},
            ],
            "store": {"threads": 1, "io_threads": 1, **store},
        } for p in proxies]
        master = td.TCPStore("127.0.0.1", 0, WORLD + 1, True, wait_for_workers=False)
        proc = subprocess.run([PYTHON, "-c", WORKER, str(master.port), str(WORLD), json.dumps(policies), str(tmp_path)],
                              env=child_env({"OMP_NUM_THREADS": "1", "TIERCEL_HOST": "one-host"}),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        outcomes = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
        return outcomes, [{k: v for k, v in p.requests.items() if v} for p in proxies]
    finally:
        for p in proxies:
            p.close()


def test_only_rank_0_sends_requests_at_open(moto_server, s3_env, shm, tmp_path):  # noqa: F811
    bucket = moto_server.new_bucket()
    outcomes, requests = open_world(shm, tmp_path, f"s3://{bucket}/run", moto_server.endpoint)
    assert outcomes == [{"ok": True}] * WORLD, outcomes
    # Rank 0: the bucket check and one listing of the root (other jobs' steps).
    assert requests[0] == {"LIST": 2}, requests
    assert requests[1:] == [{}] * (WORLD - 1), f"ranks 1..{WORLD - 1} sent requests at open: {requests}"


def test_a_missing_bucket_fails_every_rank_naming_the_tier(moto_server, s3_env, shm, tmp_path):  # noqa: F811
    outcomes, requests = open_world(shm, tmp_path, "s3://no-such-bucket-here/run", moto_server.endpoint)
    for rank, got in enumerate(outcomes):
        assert got.get("error") == "ConfigError", (rank, outcomes)
        for part in ("tier 's3'", "bucket 'no-such-bucket-here' does not exist"):
            assert part in got["message"], (rank, part, got)
        assert got["tier"] == "s3", (rank, got)
    assert requests[1:] == [{}] * (WORLD - 1), requests


def test_other_jobs_refused_fails_every_rank(moto_server, s3_env, shm, tmp_path):  # noqa: F811
    import numpy as np

    import tiercel

    bucket = moto_server.new_bucket()
    url = f"s3://{bucket}/run"
    first = {"tier": [{"name": "ram", "kind": "memory", "root": str(shm())},
                      {"name": "s3", "kind": "s3", "url": url, "endpoint": moto_server.endpoint, "allow_http": True}],
             "store": {"run": "first"}}
    with tiercel.Store(first, rank=0, world_size=1) as store:
        assert store.save(1, {"w": np.zeros(16, dtype=np.float32)}).wait(60)["s3"] == "committed"
    outcomes, requests = open_world(shm, tmp_path, url, moto_server.endpoint, run="second", other_jobs="refuse")
    for rank, got in enumerate(outcomes):
        assert got.get("error") == "ConfigError", (rank, outcomes)
        for part in ("tier 's3'", "committed steps of other jobs", "other_jobs = \"refuse\""):
            assert part in got["message"], (rank, part, got)
    assert requests[1:] == [{}] * (WORLD - 1), requests
