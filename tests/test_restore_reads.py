"""A restore reads each tier's commit record and manifest of the step once.

Choosing the step (`latest_step`'s rule: the newest step every rank can open, and which
save of it) opens the step on every tier in restore order; the restore then reads through
what that opened, instead of opening it again (and the saved world size comes from that
opening too). Counted where it costs most: the GETs an S3 tier (moto on 127.0.0.1, behind a
counting proxy) receives during the restore, in a store opened afresh as a restarted job's
is. (Opening the store reads each step's commit record once, to keep other jobs' steps out;
that is remembered, not read again by the restore.)
"""

from __future__ import annotations

from collections import Counter

import numpy as np

import tiercel

from conftest import assert_same
from faultproxy import FaultProxy
from servers import moto_server, s3_env  # noqa: F401 (fixtures)


def policy(shm_root, bucket: str, endpoint: str, order: list[str] | None = None) -> dict:
    return {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(shm_root)},
            {"name": "s3", "kind": "s3", "url": f"s3://{bucket}/job", "endpoint": endpoint, "allow_http": True},
        ],
        "restore": {"order": order or ["ram", "s3"]},
        "store": {"chunk_size": "64KiB", "threads": 2, "io_threads": 2, "run": "reads"},
    }


def state(step: int) -> dict:
    return {"model": {"w": np.arange(50_000, dtype=np.float32) + step}, "step": step}


def metadata_reads(proxy: FaultProxy, before: Counter[str]) -> dict[str, int]:
    """The GETs of commit records and manifests since `before`, by step directory and file."""
    out: dict[str, int] = {}
    for request, n in (proxy.reads - before).items():
        method, path = request.split(" ", 1)
        if method == "GET" and path.endswith(("/COMMIT", ".manifest.json")):
            key = "/".join(path.split("/")[-2:])
            out[key] = out.get(key, 0) + n
    return out


COMMIT_2 = "step-000000000002/COMMIT"
# In rank 0's area (format version 3): the last two parts of its key.
MANIFEST_2 = "rank-00000/step-000000000002.manifest.json"


def test_a_restore_reads_each_commit_record_and_manifest_once(moto_server, s3_env, shm_root, tmp_path):  # noqa: F811
    bucket = moto_server.new_bucket()
    with FaultProxy(moto_server.endpoint, faults={}) as proxy:
        pol = policy(shm_root, bucket, proxy.endpoint)
        with tiercel.Store(pol, rank=0, world_size=1) as saver:
            for step in (1, 2):
                assert saver.save(step, state(step)).wait(120)["s3"] == "committed"
        # A restarted job: a fresh store, its own restore picks the step. (With the bucket
        # first in restore order, the saved world size is read there too.)
        for how in ("restore()", "reader()", "restore(step=2)", "latest_step(reshard=True)"):
            order = ["s3", "ram"] if how.startswith(("latest", "reader")) else None
            with tiercel.Store(policy(shm_root, bucket, proxy.endpoint, order), rank=0, world_size=1) as store:
                before = proxy.reads.copy()
                if how == "restore()":
                    got = store.restore()
                elif how == "reader()":
                    got = store.reader().get_all()
                elif how == "restore(step=2)":
                    got = store.restore(step=2)
                else:
                    assert store.latest_step(reshard=True) == 2
                    got = state(2)
                reads = metadata_reads(proxy, before)
            assert_same(got, state(2))
            # Step 2's commit record and manifest on the s3 tier: one GET each, nothing else.
            assert reads == {COMMIT_2: 1, MANIFEST_2: 1}, (how, reads)
