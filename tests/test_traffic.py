"""The traffic scheduler from Python: training-communication signals pause checkpoint bytes on
the peer link (counted at a real socket between two ranks), `[traffic]` settings and errors,
and the learned profile from real signals."""

from __future__ import annotations

import json
import time

import tiercel

from conftest import error_of
from test_multirank import run_ranks

# Rank 0 replicates to rank 1's peer server through a counting TCP proxy (started in rank 0's
# process, spliced into the address exchange), and pauses it with training_comm().
WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from tiercel.coordinator import TorchCoordinator

shm, out_dir = sys.argv[1], sys.argv[2]
host = os.environ["TIERCEL_HOST"]

from peer_proxy import Splicing
Splicing.install()

policy = {
    "tier": [
        {"name": "ram", "kind": "memory", "root": f"{shm}/{host}", "keep": 2},
        {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2, "bandwidth": "8MB/s"},
    ],
    "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
    "traffic": {"mode": "signals"},
}
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy, coordinator=TorchCoordinator())
state = {"w": np.random.default_rng(rank).integers(0, 255, 4 << 20, dtype=np.uint8)}
report = {"rank": rank}
h = store.save(1, state)
if rank == 0:
    p = Splicing.proxy
    while p.sent < 256 << 10:
        time.sleep(0.002)
    with store.traffic.training_comm():
        # A chunk admitted before the signal finishes (64 KiB at 8 MB/s: 8 ms): then none.
        time.sleep(0.15)
        at_pause = p.sent
        time.sleep(0.6)
        at_resume = p.sent
    report.update(at_pause=at_pause, at_resume=at_resume, stats=store.traffic.stats())
h.wait(120)
report["states"] = h.states()
if rank == 0:
    report["total"] = Splicing.proxy.sent
dist.barrier()
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"traffic-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_no_checkpoint_bytes_leave_on_the_peer_link_during_training_comm(tmp_path, shm_root):
    env_of = lambda rank: {"TIERCEL_HOST": f"host{rank}", "OMP_NUM_THREADS": "1"}  # noqa: E731
    run_ranks(WORKER, [str(shm_root), str(tmp_path)], tmp_path, 2, env_of, tag="traffic")
    r0, r1 = (json.loads((tmp_path / f"traffic-{r}.json").read_text()) for r in range(2))
    assert r0["at_resume"] == r0["at_pause"], f"{r0['at_resume'] - r0['at_pause']} bytes left during training_comm()"
    # The push was cut in the middle (not over before the pause) and finished after it.
    assert r0["at_pause"] < 4 << 20 < r0["total"]
    assert r0["stats"]["waits"] >= 1 and r0["stats"]["wait_seconds"] > 0.3, r0["stats"]
    assert r0["states"]["peer"] == "committed" and r1["states"]["peer"] == "committed", (r0, r1)


def test_traffic_settings_reach_the_store_and_bad_ones_are_config_errors(make_store, policy):
    store = make_store({**policy, "traffic": {"mode": "learned", "mu": 0.5, "floor": "1MB/s", "warmup": 3}})
    st = store.traffic.stats()
    assert (st["mode"], st["mu"], st["floor"], st["warmup"]) == ("learned", 0.5, 1_000_000, 3)
    assert st["links"]["ram"]["network"] is False
    msg = error_of(lambda: make_store({**policy, "traffic": {"mode": "fast"}}), tiercel.ConfigError)
    assert "traffic.mode" in msg and "learned" in msg
    msg = error_of(lambda: make_store({**policy, "traffic": {"mu": 2}}), tiercel.ConfigError)
    assert "traffic.mu" in msg


def test_idle_without_busy_is_a_clear_error(store):
    msg = error_of(store.traffic.idle, tiercel.InvalidArgumentError)
    assert "without a matching busy()" in msg
    with store.traffic.training_comm():
        assert store.traffic.stats()["busy"]
    assert not store.traffic.stats()["busy"]


def test_learned_profile_from_real_signals(make_store, policy):
    """Three iterations of 60 ms: idle 20 ms, communication 20 ms, idle 20 ms."""
    store = make_store({**policy, "traffic": {"mode": "learned", "warmup": 3}})
    t = store.traffic
    t.record()
    for _ in range(4):
        t.iteration()
        time.sleep(0.02)
        with t.training_comm():
            time.sleep(0.02)
        time.sleep(0.02)
    st = t.stats()
    assert st["profiled"] == 3 and st["iterations"] == 4
    spans = st["profile"]["spans"]
    assert len(spans) == 2, spans
    # Sleeps only ever last longer than asked: each span is at least its 20 ms.
    assert all(length >= 0.019 for _, length, _ in spans), spans
    kinds = [e[1] for e in t.timeline()]
    assert kinds.count("iteration") == 4 and kinds.count("busy") == 4 and kinds.count("idle") == 4

