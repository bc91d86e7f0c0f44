"""Format version 3 through the Store (issues 31, 34): a LoRA-like state saved every step to
S3 (moto) stores the frozen base once, costs each step O(1) requests, and every kept step
restores from that tier alone; a damaged shared chunk fails every step that uses it on that
tier and the restore takes the chunk from another tier; a tier written by main's code
(format version 2, every object in the step's directory) is read and gc'd."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tiercel

from conftest import flip_byte, make_policy, manifest_path, new_shm_root
from servers import moto_server, s3_env  # noqa: F401 (fixtures)

BASE = 2 << 20
STEPS = 8


def lora(step: int) -> dict:
    base = np.random.default_rng(0).standard_normal(BASE // 4).astype(np.float32)
    return {"base": {"w": base}, "adapter": {"a": np.random.default_rng(100 + step).standard_normal(8192).astype(np.float32)}}


def same(got: dict, want: dict) -> bool:
    return all(got[k][n].tobytes() == want[k][n].tobytes() for k in want for n in want[k])


def test_lora_on_s3_stores_the_base_once_with_o1_requests_per_step(shm_root, moto_server, s3_env):  # noqa: F811
    bucket = moto_server.new_bucket()
    policy = make_policy(shm_root, None)
    policy["tier"].append({"name": "s3", "kind": "s3", "url": f"s3://{bucket}/lora", "endpoint": moto_server.endpoint,
                           "allow_http": True, "compression": "none", "keep": 2})
    client = moto_server.client()

    def held() -> int:
        objs = client.list_objects_v2(Bucket=bucket, Prefix="lora/").get("Contents", [])
        return sum(o["Size"] for o in objs)

    kinds = ("get", "put", "list", "head", "delete", "part", "multipart")

    def requests(store: tiercel.Store) -> dict[str, int]:
        m = store.metrics()["s3"]
        return {k: m[f"requests_{k}"] or 0 for k in kinds}

    per_step = []
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        for step in range(1, STEPS + 1):
            before = requests(store)
            store.save(step, lora(step)).wait(60)
            store.flush()
            after = requests(store)
            per_step.append({k: after[k] - before[k] for k in kinds})
        for step in (STEPS - 1, STEPS):
            assert same(store.reader(step, tiers=["s3"]).get_all(), lora(step)), step
        assert store.steps()["s3"] == [STEPS - 1, STEPS]
    one_step = BASE + 8192 * 4
    assert held() <= 1.35 * one_step, f"the bucket holds {held()} bytes, one step is {one_step}"
    total = [sum(r.values()) for r in per_step]
    # The LISTs of the committer's retention (the root, and the step it removes, as before
    # format 3); the rank's sweep of its area lists nothing.
    assert all(r["list"] <= 2 for r in per_step[1:]), f"LISTs on a save's path: {per_step}"
    print("requests per step:", per_step)
    # After the first steps: the same few requests each step (data, manifest, commit,
    # retention, the sweep's looks and its batched delete), not growing with the steps.
    assert max(total[3:]) <= min(total[3:]) + 4 and max(total[3:]) <= 24, per_step


def test_a_damaged_shared_chunk_is_caught_on_every_step_and_read_from_another_tier(shm_root, tmp_path):
    policy = make_policy(shm_root, tmp_path / "disk", every=1, compression="none")
    policy["tier"].append({"name": "disk2", "kind": "fs", "url": str(tmp_path / "disk2"), "compression": "none"})
    policy["restore"]["order"] = ["disk", "disk2"]
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        for step in (1, 2, 3):
            store.save(step, lora(step)).wait(60)
        store.flush()
        m = json.loads(manifest_path(tmp_path / "disk", 3, 0).read_text())
        base = next(i for i in m["items"] if i["name"] == "base/w")
        key = m["objects"][base["chunks"][0]["object"]]["key"]
        assert key.rsplit("/", 1)[-1].startswith("step-000000000001."), "step 3 refers to step 1's base"
        flip_byte(tmp_path / "disk" / key, base["chunks"][0]["stored_offset"] + 10)
        for step in (1, 2, 3):
            with pytest.raises(tiercel.IntegrityError, match="item 'base/w'"):
                store.reader(step, tiers=["disk"]).get_all()
            assert same(store.reader(step, tiers=["disk", "disk2"]).get_all(), lora(step)), step


# An fs tier that the code before format 3 wrote (commit 12fb1ab's parent: every object in
# the step's directory), steps 1 and 2 of {"x": {"a": np.full(50000, step, np.float32)}}:
# tiercel reads every older format it wrote.
FORMAT2 = Path(__file__).parent / "fixtures" / "format2-fs"


def test_a_tier_of_format_2_is_read_saved_on_and_gcd(tmp_path):
    """Saved by the code before format 3 (the format 2 layout), then read, saved on and gc'd."""
    ram = new_shm_root("format2")
    shutil.copytree(FORMAT2, tmp_path / "disk")
    assert (tmp_path / "disk" / "step-000000000001" / "rank-00000.manifest.json").exists(), "the fixture has the old layout"
    policy = make_policy(ram, tmp_path / "disk", every=1, disk_opts={"keep": 1})
    try:
        with tiercel.Store(policy, rank=0, world_size=1) as s:
            for step in (1, 2):
                got = s.reader(step, tiers=["disk"]).get_all()
                assert got["x"]["a"].tobytes() == np.full(50000, step, np.float32).tobytes()
            s.save(3, {"x": {"a": np.full(50000, 3, np.float32)}}).wait(60)
            s.flush()
            assert s.steps()["disk"] == [3]
            s._core.gc("disk", 0.0)
            assert not (tmp_path / "disk" / "step-000000000001").exists() and not (tmp_path / "disk" / "step-000000000002").exists()
            assert s.reader(3, tiers=["disk"]).get_all()["x"]["a"][0] == 3
    finally:
        shutil.rmtree(ram, ignore_errors=True)
