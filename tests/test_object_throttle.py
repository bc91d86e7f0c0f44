"""503 SlowDown storms against a real S3 server (moto), from the fault proxy: the tier's
throttle (rust/tiercel-core/src/object/throttle.rs, gate.rs) backs off, lowers the tier's
request rate and ramps it up again; saves complete, slower, with nothing lost; a storm that
never ends fails the persist with an error that names tier, step, rank, object and how often
and for how long the server refused. `store.metrics()` counts the requests by kind.
"""

from __future__ import annotations

import time

import pytest

import tiercel

from faultproxy import FaultProxy
from servers import moto_server, s3_env  # noqa: F401 (fixtures)
from test_object_store import MiB, assert_same, policy, restore_from, shm, state, step_keys  # noqa: F401 (fixture)

REQUEST_KEYS = ("requests_get", "requests_put", "requests_list", "requests_head", "requests_delete", "requests_part",
                "requests_multipart")


@pytest.fixture
def moto(moto_server, s3_env):
    return moto_server, moto_server.new_bucket()


def tier_pol(ram, url, endpoint, **kw):
    # Parts of 5 MiB, two at once: a 12 MiB object is a multipart upload of three parts.
    return policy(ram, url, endpoint=endpoint, part_size="5MiB", concurrency=2, compression="none", **kw)


def settled(store, proxy) -> dict:
    """The tier's metrics once the save's retention (after the commit the wait saw) is over
    too: every 503 the proxy sent has reached the gate and been counted there."""
    deadline = time.monotonic() + 60
    while True:
        m = store.metrics()["s3"]
        done = m["requests_throttled"] == proxy.fired["503"]
        if done or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def quiet(store) -> dict:
    """The tier's metrics once its requests have stopped for a second: the last save's
    retention, which runs after the commit a wait sees, is over."""
    last, since = None, time.monotonic()
    while time.monotonic() - since < 1.0:
        m = store.metrics()["s3"]
        n = sum(m[k] for k in REQUEST_KEYS)
        if n != last:
            last, since = n, time.monotonic()
        time.sleep(0.05)
    return m


def test_a_save_during_a_slowdown_storm_completes_and_restores_bit_identical(moto, shm):
    server, bucket = moto
    want = {s: state(60 + s, noise_bytes=12 * MiB, floats=10_000) for s in (1, 2, 3)}
    with FaultProxy(server.endpoint, seed=3, budget=0, faults={"503": 0.5}) as proxy:
        pol = tier_pol(shm(), f"s3://{bucket}/storm", proxy.endpoint, ramp_period=2)
        with tiercel.Store(pol, rank=0, world_size=1) as store:
            t = time.monotonic()
            assert store.save(1, want[1]).wait(120)["s3"] == "committed"
            calm = time.monotonic() - t
            m = quiet(store)
            assert m["requests_throttled"] == 0 and m["request_rate_limit"] is None, m
            # Step 1: 3 parts, start and completion, the marker's PUT and DELETE, the manifest
            # and the commit record; and reads for the commit (and the bucket check at open).
            assert m["requests_part"] == 3 and m["requests_multipart"] == 2, m
            assert m["save_step"] == 1 and 9 <= m["save_requests"] <= sum(m[k] for k in REQUEST_KEYS), m

            proxy.budget = 10  # the storm: half of the new connections answered 503 SlowDown
            t = time.monotonic()
            assert store.save(2, want[2]).wait(300)["s3"] == "committed"
            stormy = time.monotonic() - t
            m = settled(store, proxy)
            assert proxy.fired["503"] >= 5, proxy.fired
            # Every 503 the proxy sent reached the gate and was counted there.
            assert m["requests_throttled"] == proxy.fired["503"], (m, proxy.fired)
            assert m["throttle_wait_seconds"] > 0 and m["request_rate_limit"] is not None, m
            assert m["save_step"] == 2 and m["save_throttled"] == proxy.fired["503"], m
            limit_after_storm = m["request_rate_limit"]
            # Refused requests went again: the save's requests count every one.
            assert m["save_requests"] >= m["save_throttled"] + 9, m
            print(f"\nsave of 12 MiB: {calm:.2f} s calm, {stormy:.2f} s in a storm of {proxy.fired['503']} "
                  f"SlowDowns; rate limit after it {limit_after_storm:.2f}/s; {m['save_requests']} requests")

            # The storm is over: saves go on, and the ramp raises the limit while they succeed.
            proxy.budget = 0
            assert store.save(3, want[3]).wait(120)["s3"] == "committed"
            m = store.metrics()["s3"]
            assert m["request_rate_limit"] > limit_after_storm, (m, limit_after_storm)
            text = tiercel.metrics.prometheus_text(store)
            assert f'tiercel_requests_throttled_total{{tier="s3",rank="0"}} {float(proxy.fired["503"])}' in text
            assert 'tiercel_requests_part_total{tier="s3",rank="0"}' in text
            # A memory tier sends no requests: nothing to count.
            assert store.metrics()["ram"]["requests_get"] is None
        for s in (1, 2, 3):
            got, info = restore_from(pol, shm(), s)
            assert_same(got, want[s])
            assert info.tier == "s3"
    assert server.uploads(bucket) == []


def test_a_storm_that_never_ends_fails_the_persist_clearly(moto, shm):
    server, bucket = moto
    with FaultProxy(server.endpoint, budget=0, faults={"503": 1.0}) as proxy:
        pol = tier_pol(shm(), f"s3://{bucket}/endless", proxy.endpoint, throttle_timeout=3)
        with tiercel.Store(pol, rank=0, world_size=1) as store:
            assert store.save(1, state(71, 100_000, 1000)).wait(120)["s3"] == "committed"
            proxy.budget = 10**9  # every request from now on: 503 SlowDown
            want = state(72, noise_bytes=12 * MiB, floats=1000)
            t = time.monotonic()
            h = store.save(2, want)
            with pytest.raises(tiercel.TierUnavailableError) as ei:
                h.wait(120)
            took = time.monotonic() - t
            msg = str(ei.value)
            # The first request refused for 3 s names its object: the rank's data object of
            # step 2, in its area (a rank holding no manifest of the step takes nothing back first).
            for part in ("tier 's3'", "step 2", "rank 0", f"s3://{bucket}/endless/ranks/", "/step-000000000002.",
                         "SlowDown", "throttle_timeout = 3 s", "times over"):
                assert part in msg, (part, msg)
            # Each request gives up after its own 3 s, not after object_store's retries too.
            assert took < 30, (took, msg)
            m = store.metrics()["s3"]
            assert m["requests_throttled"] >= 3 and m["failures"] == 1, m
            # Nothing lost: the memory tier has step 2; nothing torn on the bucket.
            assert_same(store.restore(2), want)
            proxy.budget = 0
            assert store.steps()["s3"] == [1]
            assert not any(k.endswith("COMMIT") for k in step_keys(server, bucket, "endless", 2))


def test_throttle_settings_are_checked(shm):
    for bad, why in ((0, "positive integer"), (901, "up to 840")):
        with pytest.raises(tiercel.ConfigError, match=why):
            tiercel.Store(policy(shm(), "s3://bkt/x", endpoint="http://127.0.0.1:1", throttle_timeout=bad),
                          rank=0, world_size=1)
    with pytest.raises(tiercel.ConfigError, match="ramp_period"):
        tiercel.Store(policy(shm(), "s3://bkt/x", endpoint="http://127.0.0.1:1", ramp_period=-5), rank=0, world_size=1)
