"""Persistence falling behind shows: `store.metrics()` per tier (written, read, rate, last
step, lag, queue, skips, failures), the same as Prometheus text and over HTTP for
`tiercel stats`; skips told once when they start and summed up at close, one log line per
failure at the default level, and `TIERCEL_LOG` levels that mean what config.md says.

A real slow tier: an fs tier whose `bandwidth` makes each persist take ~0.3 s while saves come
every few milliseconds, so queued persists are replaced by newer ones (skipped), and never an
older save for a newer one, even when background flushes finish out of order (a failpoint
makes them); a real failing tier: an s3 tier at a port nobody listens on; a real hung tier: an
s3 tier whose server (moto, behind a proxy) stops answering.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import tiercel
from tiercel import _core, cli, metrics

from conftest import make_policy, run_python
from faultproxy import FaultProxy
from servers import moto_server, s3_env  # noqa: F401 (fixtures)
from test_multirank import free_port

STEP_BYTES = 256 << 10


def state(step: int) -> dict:
    return {"w": np.full(STEP_BYTES // 4, step, dtype=np.float32)}


@pytest.fixture
def slow(shm_root, disk_root, make_store):
    """ram, then disk with every = 1 at 1 MB/s: a 256 KiB persist takes ~0.26 s."""
    return make_store(make_policy(shm_root, disk_root, every=1, compression="none", disk_opts={"bandwidth": "1MB/s"}))


def test_counts_lag_skips_and_one_log_line_for_the_skips(slow, capfd):
    handles = [slow.save(s, state(s)) for s in range(1, 9)]
    slow.flush()
    states = [h.wait(60)["disk"] for h in handles]
    skipped = [s for s in states if s.startswith("skipped")]
    assert skipped, states  # 8 saves in milliseconds, persists ~0.26 s each
    m = slow.metrics()
    ram, disk = m["ram"], m["disk"]
    assert (ram["steps_written"], ram["bytes_written"], ram["last_step"], ram["lag_steps"]) == (8, 8 * STEP_BYTES, 8, 0)
    assert ram["failures"] == 0 and ram["skips"] == 0 and ram["queue_depth"] == 0
    assert disk["steps_written"] + disk["skips"] == 8 and disk["skips"] == len(skipped)
    assert disk["bytes_written"] == disk["steps_written"] * STEP_BYTES
    assert disk["last_step"] == 8 and disk["lag_steps"] == 0 and disk["queue_depth"] == 0  # the newest is never replaced
    # Written at 1 MB/s: the rate says so (the token bucket allows a 50 ms burst).
    assert 0.5e6 < disk["write_bytes_per_second"] < 2e6, disk
    # The first skip is told with its reason; the others are counted (metrics), not logged.
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if "skipped" in l]
    assert len(lines) == 1, err
    assert re.match(r"tiercel warn: tier 'disk': step \d+ of rank 0 skipped: a newer save \(step \d+\) replaced it "
                    r"while it waited; the tier falls behind the saves .*summed up every 100 and at close", lines[0]), err

    # Lag while a persist runs: a save the disk tier has not reached yet.
    slow.save(9, state(9))
    slow.save(10, state(10))
    lagging = slow.metrics()["disk"]
    assert lagging["lag_steps"] >= 1 and lagging["lag_seconds"] >= 0
    slow.flush()

    # Reads: from ram (zero-copy) and from disk alone.
    slow.restore()
    slow.reader(8, tiers=["disk"]).get_all()
    m = slow.metrics()
    assert (m["ram"]["steps_read"], m["ram"]["bytes_read"]) == (1, STEP_BYTES)
    assert (m["disk"]["steps_read"], m["disk"]["bytes_read"]) == (1, STEP_BYTES)

    # At close, the sum: one line.
    capfd.readouterr()
    slow.close()
    err = capfd.readouterr().err
    assert [l for l in err.splitlines() if "skipped" in l] == [
        f"tiercel warn: tier 'disk': {m['disk']['skips']} saves of rank 0 were skipped in all: newer saves replaced them "
        f"while they waited (newest on the tier: step {m['disk']['last_step']})"], err


LATE_CHILD = r"""
import json, sys, numpy as np, tiercel
from conftest import make_policy
policy = make_policy(sys.argv[1], sys.argv[2], every=1, compression="none", disk_opts={"bandwidth": "512KB/s"})
with tiercel.Store(policy, rank=0, world_size=1) as s:
    handles = [s.save(step, {"w": np.full(65536, step, dtype=np.float32)}) for step in range(1, 9)]
    s.flush()
    states = {h.step: h.wait(60)["disk"] for h in handles}
    print(json.dumps({"states": states, "disk": s.metrics()["disk"], "steps": s.steps()["disk"]}))
"""


def test_an_older_save_reaching_the_scheduler_late_never_replaces_a_newer_one(shm_root, disk_root):
    # The 7th flush queues its persist only after the 8th has queued its own (as when two
    # flushes on two workers finish in the other order): step 7 is the one skipped.
    p = run_python(LATE_CHILD, str(shm_root), str(disk_root), env={"TIERCEL_FAILPOINT": "persist_late:7"})
    got = json.loads(p.stdout.splitlines()[-1])
    states, disk = got["states"], got["disk"]
    assert states["8"] == "committed", (states, p.stderr)
    assert states["7"] == "skipped: a newer save (step 8) replaced it while it waited", (states, p.stderr)
    assert disk["last_step"] == 8 and disk["lag_steps"] == 0, disk
    assert got["steps"][-1] == 8
    assert "step 8 of rank 0 skipped" not in p.stderr, p.stderr


def test_a_hung_tier_lags_from_its_oldest_unpersisted_save(moto_server, s3_env, shm_root, make_store):
    """A bucket that stops answering before the tier's first write: lag in steps and in
    seconds (growing) from the oldest save it has not got, in metrics and in Prometheus."""
    bucket = moto_server.new_bucket()
    with FaultProxy(moto_server.endpoint, budget=0) as proxy:  # no faults but the hold
        tier = {"name": "bucket", "kind": "s3", "url": f"s3://{bucket}/lag", "endpoint": proxy.endpoint, "every": 2,
                "timeout": 60, "retries": 0}
        store = make_store({"tier": [{"name": "ram", "kind": "memory", "root": str(shm_root)}, tier]})
        assert store.metrics()["bucket"]["lag_seconds"] is None  # nothing handed to it yet
        proxy.hold = True
        handles = [store.save(s, state(s)) for s in (2, 3, 4, 5)]
        deadline = time.monotonic() + 60
        while any(h.states()["ram"] != "committed" for h in handles):  # flushed: handed to the bucket
            assert time.monotonic() < deadline, [h.states() for h in handles]
            time.sleep(0.01)
        first = store.metrics()["bucket"]
        time.sleep(1.0)
        later = store.metrics()["bucket"]
        assert (first["last_step"], first["steps_written"], first["lag_steps"]) == (None, 0, 4), first  # 5 - 2 + 1
        assert later["lag_seconds"] >= first["lag_seconds"] + 0.9, (first, later)
        parsed = metrics.parse_prometheus(metrics.prometheus_text(store))[("bucket", 0)]
        assert parsed["lag_steps"] == 4 and parsed["lag_seconds"] >= later["lag_seconds"], parsed
        proxy.hold = False
        store.flush(120)
    done = store.metrics()["bucket"]
    assert (done["last_step"], done["lag_steps"], done["lag_seconds"]) == (4, 1, 0.0), done


def test_failures_are_counted_and_logged(make_store, policy, monkeypatch, capfd):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    bucket = {"name": "bucket", "kind": "s3", "url": "s3://tiercel-test/m", "endpoint": f"http://127.0.0.1:{free_port()}",
              "retries": 0, "timeout": 5}
    store = make_store({**policy, "tier": policy["tier"] + [bucket]})
    for s in (2, 4):
        with pytest.raises(tiercel.TierUnavailableError, match=f"step {s}: tier 'bucket' failed: "):
            store.save(s, state(s)).wait(60)
    m = store.metrics()["bucket"]
    # Failed saves are not on the tier: it lags from the oldest (step 2; the newest save is 4).
    assert (m["failures"], m["steps_written"], m["last_step"], m["lag_steps"]) == (2, 0, None, 3)
    assert m["lag_seconds"] >= 0
    err = capfd.readouterr().err
    assert len([l for l in err.splitlines() if l.startswith("tiercel error: persisting step")]) == 2, err


#: Gauges that are ages, which grow between two scrapes of the same state.
AGES = ("committed_age_seconds",)


def steady(text: str) -> str:
    """A Prometheus text without its age samples: the same for two scrapes of one state."""
    return "\n".join(l for l in text.splitlines() if not l.startswith(tuple(f"tiercel_{a}{{" for a in AGES)))


def test_prometheus_text_serve_and_tiercel_stats(slow, capsys):
    slow.save(2, state(2)).wait(60)
    text = metrics.prometheus_text(slow)
    assert "# TYPE tiercel_steps_written_total counter" in text and "# TYPE tiercel_lag_steps gauge" in text
    assert 'tiercel_steps_written_total{tier="disk",rank="0"} 1.0' in text
    parsed = metrics.parse_prometheus(text)
    for tier, m in slow.metrics().items():
        assert {k: v for k, v in parsed[(tier, 0)].items() if k not in AGES} == \
            {k: float(v) for k, v in m.items() if v is not None and k not in AGES}
        assert parsed[(tier, 0)]["committed_age_seconds"] <= m["committed_age_seconds"]  # the text was taken first

    server = metrics.serve(slow)
    try:
        url = f"127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert steady(r.read().decode()) == steady(metrics.prometheus_text(slow))
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{url}/other", timeout=10)

        assert cli.main(["stats", "--url", url]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split() == ["TIER", "RANK", "STEPS", "WRITTEN", "RATE", "LAST", "LAG", "LAG", "S", "COMMITTED",
                                  "AGE", "S", "UNWRITTEN", "QUEUE", "SKIPS", "FAILS", "READ", "REQUESTS",
                                  "SLOWDOWNS"]
        assert [l.split()[:3] for l in out[1:]] == [["ram", "0", "1"], ["disk", "0", "1"]]
        assert cli.main(["stats", "--json", "--url", f"http://{url}/metrics"]) == 0
        rows = json.loads(capsys.readouterr().out)["tiers"]
        assert [(r["tier"], r["rank"], r["steps_written"], r["last_step"]) for r in rows] == [("ram", 0, 1, 2), ("disk", 0, 1, 2)]
    finally:
        server.close()
    code = cli.main(["stats", "--url", f"127.0.0.1:{free_port()}"])
    assert code == 4 and "cannot read metrics from http://127.0.0.1:" in capsys.readouterr().err


LOG_CHILD = r"""
import sys, numpy as np, tiercel
policy = {"tier": [{"name": "ram", "kind": "memory", "root": sys.argv[1]},
                   {"name": "disk", "kind": "fs", "url": sys.argv[2]}]}
with tiercel.Store(policy, rank=0, world_size=1) as s:
    s.save(3, {"x": np.ones(10)}).wait(60)
"""


@pytest.mark.parametrize("level, shown", [("info", True), ("warn", False), ("off", False)])
def test_tiercel_log_levels(level, shown, shm_root, disk_root):
    p = run_python(LOG_CHILD, str(shm_root), str(disk_root), env={"TIERCEL_LOG": level})
    line = "tiercel info: tier 'disk': step 3 of rank 0 committed (80 bytes in "
    assert (line in p.stderr) is shown, p.stderr
    if level == "off":
        assert p.stderr == ""


def test_every_field_is_defined_once_in_the_core_and_documented(store):
    """The core's field lists are what `metrics()`, the Prometheus text and docs/api.md show:
    a new metric is one line in tiercel-core's store/metrics.rs (and its line in the docs,
    which this test asks for)."""
    m = store.metrics()
    assert [f for f, _, _ in metrics.FIELDS] == [f for f, _, _ in _core.TIER_FIELDS]
    assert all(list(tier) == [f for f, _, _ in metrics.FIELDS] for tier in m.values()), m
    assert list(m.timings) == list(metrics.TIMINGS) == ["deepspeed_stall", "orbax_blocking", "dcp_staging"]
    assert all(list(t) == [f for f, _, _ in metrics.TIMING_FIELDS] for t in m.timings.values()), m.timings
    text = metrics.prometheus_text(store)
    for fields, prefix in ((metrics.FIELDS, "tiercel_"), (metrics.TIMING_FIELDS, "tiercel_timing_")):
        for field, kind, help_text in fields:
            name = prefix + field + ("_total" if kind == "counter" else "")
            assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" in text, name
    doc = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    section = doc[doc.index("## Metrics"):doc.index("## Exceptions")]
    documented = set(re.findall(r"^\| (`[^|]+) \|", section, re.M))
    names = {n.strip("` ") for row in documented for n in row.split(",")}
    missing = [f for f, _, _ in metrics.FIELDS + metrics.TIMING_FIELDS if f not in names]
    missing += [t for t in metrics.TIMINGS if t not in names]
    assert not missing, f"docs/api.md's Metrics tables do not name {missing}"
