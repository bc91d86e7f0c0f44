"""Replicated puts and the replica-group restore: 4 ranks of a real torch.distributed job
(gloo on 127.0.0.1) on 2 "hosts" (their own TIERCEL_HOST and shared-memory root), one S3
server (moto) reached through a proxy that counts the bytes the bucket serves.

- The bucket holds one copy of a replicated put, not four; a rank whose "replicated" data
  differs is reported when the step commits there.
- With RAM wiped, a restore in `single` and in `striped` mode is bit-identical on every rank
  and the bucket serves about one copy (`all`: four).
- A receiver that dies, a sender that dies, a corrupted chunk on the wire: the others
  finish, bit-identical, well within the deadline.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import PYTHON, child_env, new_shm_root
from faultproxy import FaultProxy
from servers import moto_server, s3_env  # noqa: F401 (fixtures)
from test_multirank import free_port

WORLD = 4
MiB = 1 << 20
TIMEOUT = 180


def replicated_state(step: int) -> dict:
    """The same on every rank: 6 MiB in 24 chunks of 256 KiB."""
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal(4 * MiB // 8), "b": rng.integers(0, 255, 2 * MiB, dtype=np.uint8)}}


def own_state(rank: int) -> dict:
    return {"rank": rank, "noise": np.random.default_rng(100 + rank).integers(0, 255, 1000, dtype=np.uint8)}


WORKER = r"""
import json, os, shutil, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from conftest import assert_same
from test_replicas import replicated_state, own_state

phases, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
report = {}
for ph in phases:
    dist.barrier()
    if ph.get("wipe") and rank in (0, 2):  # one rank per host empties that host's memory tier
        root = os.environ["REPLICAS_TEST_ROOT"]
        for name in os.listdir(root):
            if name.startswith("step-"):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier()
    ph["policy"]["tier"][0]["root"] = os.environ["REPLICAS_TEST_ROOT"]  # this host's memory tier
    store = tiercel.Store(ph["policy"])
    if ph["what"] == "save":
        data = replicated_state(1)
        if rank == ph.get("differs"):
            data["model"]["b"][12345] ^= 1
        with store.writer(1) as w:
            w.put("model", data["model"], replicated=True)
            w.put("own", own_state(rank))
        try:
            report[ph["name"]] = {"states": w.handle.wait(60)}
        except tiercel.TiercelError as e:
            report[ph["name"]] = {"error": f"{type(e).__name__}: {e}"}
        dist.barrier()
    elif ph["what"] == "missing":  # rank 3 asks for a step nobody has: it fails, the others go on
        try:
            got = store.restore(99 if rank == 3 else 1)
            report[ph["name"]] = {"ok": True}
        except tiercel.NotFoundError as e:
            report[ph["name"]] = {"error": str(e)}
    else:
        got = store.restore(1)
        assert_same(got["model"], replicated_state(1)["model"])
        assert_same(got["own"], own_state(rank))
        info = store.last_restore
        report[ph["name"]] = {"broadcast": info.broadcast, "tiers": info.tiers, "seconds": info.seconds}
    store.close()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
if not phases[-1].get("no_barrier"):
    dist.barrier()
"""


def run_job(tmp_path, roots, phases: list[dict], env_of=None, dies: int | None = None) -> list[dict]:
    """Runs the 4 ranks through `phases`; returns each rank's report (None for `dies`, the rank
    a failpoint aborts). Fails on a hang (TIMEOUT) or any other rank failing."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(WORLD),
                         "TIERCEL_HOST": f"host{rank // 2}", "TIERCEL_RELAY_LISTEN": "127.0.0.1:0",
                         "REPLICAS_TEST_ROOT": str(roots[rank // 2]),
                         **(env_of(rank) if env_of else {})})
        log = open(tmp_path / f"rank-{rank}.log", "w")
        procs.append((subprocess.Popen([PYTHON, "-c", WORKER, json.dumps(phases), str(tmp_path)], stdout=log,
                                       stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank, (p, _) in enumerate(procs):
            try:
                p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} hung: {logs(tmp_path)}")
            if rank == dies:
                assert p.returncode != 0, f"rank {rank} was to die: {logs(tmp_path)}"
            else:
                assert p.returncode == 0, f"rank {rank} exited with {p.returncode}: {logs(tmp_path)}"
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
            log.close()
    return [None if r == dies else json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def logs(tmp_path) -> str:
    return "".join(f"\n--- rank {r}\n" + (tmp_path / f"rank-{r}.log").read_text()[-3000:] for r in range(WORLD))


class Cluster:
    """Two hosts' memory roots, a bucket, and a counting proxy per phase."""

    def __init__(self, server, bucket: str):
        self.server, self.bucket = server, bucket
        self.roots = [new_shm_root(f"replicas{h}") for h in range(2)]
        self.proxies: dict[str, FaultProxy] = {}

    def phase(self, name: str, what: str, mode: str = "auto", **extra) -> dict:
        proxy = self.proxies[name] = FaultProxy(self.server.endpoint, faults={})
        policy = {
            "tier": [{"name": "ram", "kind": "memory", "root": "<per host>"},
                     {"name": "s3", "kind": "s3", "url": f"s3://{self.bucket}/ckpt", "endpoint": proxy.endpoint,
                      "allow_http": True, "compression": "none"}],
            "restore": {"order": ["ram", "s3"], "replicated": mode, "relay_window": "1MiB", "relay_timeout": 10},
            "store": {"chunk_size": "256KiB", "threads": 2, "io_threads": 2},
        }
        return {"name": name, "what": what, "policy": policy, "wipe": what == "restore", **extra}

    def stored(self) -> int:
        """Bytes of data objects in the bucket."""
        s3 = self.server.client()
        objs = s3.list_objects_v2(Bucket=self.bucket, Prefix="ckpt/").get("Contents", [])
        return sum(o["Size"] for o in objs if o["Key"].endswith(".data"))

    def close(self) -> None:
        for p in self.proxies.values():
            p.close()
        for r in self.roots:
            shutil.rmtree(r, ignore_errors=True)


@pytest.fixture
def cluster(moto_server, s3_env):  # noqa: F811 (fixture)
    c = Cluster(moto_server, moto_server.new_bucket())
    yield c
    c.close()


ONE_COPY = sum(v.nbytes for v in replicated_state(1)["model"].values())


def test_one_copy_in_the_bucket_and_single_and_striped_read_it_once(cluster, tmp_path):
    phases = [cluster.phase("save", "save"), cluster.phase("all", "restore", "all"),
              cluster.phase("single", "restore", "single"), cluster.phase("striped", "restore", "striped"),
              cluster.phase("auto", "restore", "auto"), cluster.phase("missing", "missing", "single")]
    reports = run_job(tmp_path, cluster.roots, phases)
    assert all("failed" not in json.dumps(r["save"]) for r in reports), reports
    assert any(r["save"]["states"]["s3"] == "committed" for r in reports), reports
    # One copy of the replicated put, plus each rank's own small put.
    stored = cluster.stored()
    assert ONE_COPY <= stored < ONE_COPY + 64 * 1024, (stored, ONE_COPY)
    served = {name: cluster.proxies[name].downloaded for name in ("all", "single", "striped", "auto")}
    # Manifests, listings and HTTP heads on top of the data: well under a chunk per rank.
    assert WORLD * ONE_COPY <= served["all"] < WORLD * ONE_COPY + 2 * MiB, served
    # A rank that cannot open its step fails alone and clearly; the others restore without it.
    assert [r["missing"].get("ok") for r in reports] == [True, True, True, None], [r["missing"] for r in reports]
    assert "step 99" in reports[3]["missing"]["error"], reports[3]["missing"]
    # `auto` (a fresh store: nothing measured yet) reads striped.
    assert all(r["auto"]["broadcast"]["mode"] == "striped" for r in reports), [r["auto"] for r in reports]
    for mode in ("single", "striped", "auto"):
        assert ONE_COPY <= served[mode] < ONE_COPY + 1 * MiB, (mode, served)
        stats = [r[mode]["broadcast"] for r in reports]
        assert all(s and s["mode"] in (mode, "striped") and s["fallbacks"] == 0 for s in stats), stats
        assert sum(s["bytes_read"] for s in stats) == ONE_COPY, stats
    # Striped: each rank read a quarter; single: rank 0 read it all and each rank passed it on once.
    assert [r["striped"]["broadcast"]["bytes_read"] for r in reports] == [ONE_COPY // WORLD] * WORLD
    assert [r["single"]["broadcast"]["bytes_sent"] for r in reports] == [ONE_COPY] * 3 + [0]


def test_a_rank_whose_replicated_data_differs_is_reported(cluster, tmp_path):
    reports = run_job(tmp_path, cluster.roots, [cluster.phase("save", "save", differs=3)])
    errors = [r["save"].get("error", "") for r in reports]
    assert any("rank 3's replicated item 'model/b' differs from rank 0's copy" in e for e in errors), errors
    assert all("committed" != r["save"].get("states", {}).get("s3") for r in reports), reports


@pytest.mark.parametrize("failpoint, victim", [("relay_recv:3", 2), ("relay_send:3", 1), ("relay_corrupt:2", None)],
                         ids=["receiver-dies", "sender-dies", "corrupt-chunk"])
def test_the_others_finish_when_a_rank_dies_or_a_chunk_is_corrupted(cluster, tmp_path, failpoint, victim):
    # single mode, chain 0 -> 1 -> 2 -> 3. relay_recv: rank 2 dies after its 3rd chunk (rank 1
    # drops it, rank 3 reads the rest itself); relay_send: rank 1 dies sending its 3rd chunk;
    # relay_corrupt: rank 0 flips a bit in the 2nd chunk it sends (rank 1 reads that one itself).
    arm = victim if victim is not None else 0
    phases = [cluster.phase("save", "save"), cluster.phase("single", "restore", "single", no_barrier=True)]
    t0 = time.monotonic()
    reports = run_job(tmp_path, cluster.roots, phases, env_of=lambda r: {"TIERCEL_FAILPOINT": failpoint} if r == arm else {},
                      dies=victim)
    assert time.monotonic() - t0 < TIMEOUT
    stats = {r: rep["single"]["broadcast"] for r, rep in enumerate(reports) if rep is not None}
    fallbacks = sum(s["fallbacks"] for s in stats.values())
    assert fallbacks >= 1, stats
    if victim is None:
        assert any("checksum" in w for w in stats[1]["warnings"]), stats[1]
        assert stats[1]["fallbacks"] == 1, stats


def test_replica_groups_are_checked():
    import tiercel
    from tiercel.replicas import replica_group_of

    assert replica_group_of(None, 2, 4) == [0, 1, 2, 3]
    assert replica_group_of([2, 0], 2, 4) == [0, 2]
    assert replica_group_of([[0, 2], [1, 3]], 3, 4) == [1, 3]
    for bad, why in [([1, 3], "must hold this rank"), ([0, 0, 2], "each rank once"), ([0, 2, 9], "0..3"),
                     ([[0, 2], [2, 3]], "exactly one"), (["0", 2], "a list of ranks")]:
        with pytest.raises(tiercel.InvalidArgumentError, match=why):
            replica_group_of(bad, 2, 4)
