"""Restores from an S3 tier (moto and SeaweedFS on 127.0.0.1) fetch neighbouring chunks in
ranged GETs of a part each, not one GET per chunk: counted at a proxy in front of the server,
a restore sends no more ranged GETs than boto3's managed download of the same object with the
same part size. Every chunk is still checked on its own: a bad one inside a merged read is
read again, from the next tier that has a good copy, and named."""

from __future__ import annotations

import io
import json
import logging

import boto3
import numpy as np
from boto3.s3.transfer import TransferConfig

import tiercel

from faultproxy import FaultProxy
from servers import ACCESS_KEY, SECRET_KEY, moto_server, s3_env, seaweed_server  # noqa: F401 (fixtures)
from test_object_store import assert_same, s3, shm  # noqa: F401 (fixtures)

MiB = 1 << 20
PART = 5 * MiB
# Rank 0's manifest of step 1, in its area (format version 3); its data object's key (a
# per-save token in its name) is found by listing: `data_key`.
MANIFEST = "run/ranks/3d/rank-00000/step-000000000001.manifest.json"


def data_key(server, bucket: str) -> str:
    [key] = [k for k in server.keys(bucket, "run/ranks/") if "/step-000000000001." in k and k.endswith(".data")]
    return key


def big_state() -> dict:
    rng = np.random.default_rng(7)
    return {"a": rng.integers(0, 256, 24 * MiB, dtype=np.uint8), "b": rng.standard_normal(2 * MiB).astype(np.float32)}


def policy(ram, disk, bucket: str, endpoint: str, compression: str) -> dict:
    return {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(ram)},
            {"name": "s3", "kind": "s3", "url": f"s3://{bucket}/run", "endpoint": endpoint, "allow_http": True,
             "compression": compression, "part_size": "5MiB"},
            {"name": "disk", "kind": "fs", "url": str(disk), "compression": "none"},
        ],
        "store": {"chunk_size": "1MiB", "threads": 2, "io_threads": 2},
    }


def boto3_ranged_gets(endpoint: str, bucket: str, key: str) -> int:
    """Ranged GETs boto3's managed download of the step's data object sends, at the part size."""
    with FaultProxy(endpoint, faults={}) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        client.download_fileobj(bucket, key, io.BytesIO(), Config=TransferConfig(multipart_threshold=PART, multipart_chunksize=PART))
        return proxy.ranged_gets


def test_a_restore_sends_no_more_ranged_gets_than_boto3(s3, shm, tmp_path):
    server, bucket = s3
    want = big_state()
    for compression in ("none", "zstd:1"):
        with FaultProxy(server.endpoint, faults={}) as proxy:
            pol = policy(shm(), tmp_path / compression, bucket, proxy.endpoint, compression)
            with tiercel.Store(pol, rank=0, world_size=1) as store:
                assert store.save(1, want).wait(120)["s3"] == "committed"
                before = proxy.ranged_gets
                got = store.reader(1, tiers=["s3"]).get_all()
                gets = proxy.ranged_gets - before
            assert_same(got, want)
        chunks = sum(-(-v.nbytes // MiB) for v in want.values())
        stored = server.client().head_object(Bucket=bucket, Key=data_key(server, bucket))["ContentLength"]
        boto = boto3_ranged_gets(server.endpoint, bucket, data_key(server, bucket))
        # One GET per 5 MiB of each item's stored chunks (items are read one after another),
        # where one per chunk would be 32.
        assert gets <= boto and gets <= len(want) + stored // PART, (compression, gets, boto, chunks, stored)
        assert chunks == 32 and gets < chunks / 2, (gets, chunks)


def test_a_bad_chunk_inside_a_merged_read_is_read_again_from_the_next_tier(s3, shm, tmp_path, caplog):
    server, bucket = s3
    want = big_state()
    pol = policy(shm(), tmp_path / "disk", bucket, server.endpoint, "none")
    with tiercel.Store(pol, rank=0, world_size=1) as store:
        assert store.save(1, want).wait(120) == {"ram": "committed", "s3": "committed", "disk": "committed"}
        client = server.client()
        m = json.loads(client.get_object(Bucket=bucket, Key=MANIFEST)["Body"].read())
        item = next(i for i in m["items"] if i["name"].endswith("a"))
        chunk = item["chunks"][6]  # inside the second 5 MiB run of the item
        key = data_key(server, bucket)
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[chunk["stored_offset"] + 123] ^= 0x01
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        with caplog.at_level(logging.WARNING):
            r = store.reader(1, tiers=["s3", "disk"])
            got = r.get_all()
        assert_same(got, want)
        assert r.info.tiers == {"s3+disk": 1, "s3": 1}, r.info.tiers
        said = " ".join(r.info.warnings)
        for part in (f"item '{item['name']}' chunk 6", "read from tier 'disk'", "checksum mismatch"):
            assert part in said, (part, said)
        # From S3 alone the same chunk is an integrity error that names it.
        try:
            store.reader(1, tiers=["s3"]).get_all()
        except tiercel.IntegrityError as e:
            assert f"item '{item['name']}' chunk 6" in str(e) and "checksum mismatch" in str(e), str(e)
        else:
            raise AssertionError("a bad chunk with no other copy must fail the read")
