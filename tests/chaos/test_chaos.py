"""Chaos: kill -9 at random moments and abort at every failpoint, over memory+fs and
memory+s3 (multipart uploads), checking after every kill that each committed step restores
bit-identical from each tier alone and nothing torn is visible (tests/chaos/chaos.py).

`make test` runs TIERCEL_CHAOS_KILLS (default 60) kills over memory+fs and half as many over memory+s3; `make chaos`
runs the long campaign (>= 1,000 kills). Each test prints its figures as one JSON line."""

from __future__ import annotations

import json
import os
import random

import pytest

from chaos import FAILPOINTS, Chaos
from conftest import make_policy
from servers import moto_server, s3_env  # noqa: F401 (fixtures)

KILLS = int(os.environ.get("TIERCEL_CHAOS_KILLS", "60"))
SEED = int(os.environ.get("TIERCEL_CHAOS_SEED", "14"))


def report(name: str, figures: dict) -> None:
    print(f"\nCHAOS {name} " + json.dumps(figures))


def test_chaos_memory_and_fs(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, every=2, chunk_size="64KiB", disk_opts={"keep": 3})
    chaos = Chaos(policy, 256 << 10, tmp_path, random.Random(SEED))
    figures = chaos.campaign(KILLS)
    report("memory+fs", figures)
    assert set(chaos.kills) >= set(FAILPOINTS), f"a failpoint never fired: {chaos.kills}"
    assert chaos.steps_verified > 0


def test_chaos_memory_and_s3_multipart(tmp_path, shm_root, moto_server, s3_env):  # noqa: F811
    bucket = moto_server.new_bucket()
    policy = make_policy(shm_root, None, chunk_size="1MiB")
    policy["tier"].append({"name": "s3", "kind": "s3", "url": f"s3://{bucket}/chaos", "endpoint": moto_server.endpoint,
                           "every": 3, "keep": 2, "part_size": "5MiB", "concurrency": 2, "compression": "none"})
    policy["restore"]["order"].append("s3")
    # 6 MiB a step: every s3 object is a multipart upload of two parts.
    chaos = Chaos(policy, 6 << 20, tmp_path, random.Random(SEED + 1))
    figures = chaos.campaign(max(KILLS // 2, len(FAILPOINTS)))
    report("memory+s3", figures)
    assert set(chaos.kills) >= set(FAILPOINTS), f"a failpoint never fired: {chaos.kills}"


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
