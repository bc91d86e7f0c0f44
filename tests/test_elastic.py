"""Elastic restore from RAM and peers (docs/restore.md, "Elastic restore"): a job of 3 "hosts"
on one machine (separate processes, each its own $TIERCEL_HOST and memory root, a peer tier
with replicas = 2 on loopback, an fs tier as the durable tier) saves a sharded state; host C
is killed and its root wiped; the job restarts on 2 hosts and reshards the step from the
survivors' memory and peer tiers, bit-identical, reading no byte from the durable tier.

With 3 hosts and replicas = 2 the placement is a ring (A's copies on B, B's on C, C's on
A), so after C is lost: saved rank 0 is in A's RAM and B's replica store, saved rank 1 only
in B's RAM (its replica was on C), saved rank 2 only in A's replica store. The new rank 0
(host A) needs part of saved rank 1 (B's own RAM, over the peer transport) and the new rank 1
(host B) saved rank 2 (A's replica store).

The DCP and plain-store cases run each host in a Linux network namespace of its own (its
own address and network stack, one bridge between them: tests/netns.py; gloo and the peer
tier on that network) where the machine lets a test make them (root, iproute2), else on
loopback (the `loopback` variant, skipped where namespaces can be made). The Orbax case runs
on loopback (multi-process JAX's coordinator, tests/test_orbax.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dcp import SCRIPT as DCP_WORKER
from test_dcp import load

from conftest import assert_same
from netns import Net, unavailable
from test_multirank import run_ranks

HOSTS = ["hostA", "hostB", "hostC"]


def elastic_policy(shm_root: Path, disk: Path, listen: str = "127.0.0.1:0") -> dict[str, Any]:
    """RAM per host, peer replicas on 2 hosts, and a durable fs tier that gets every step."""
    return {
        "tier": [
            {"name": "ram", "kind": "memory", "root": f"{shm_root}/{{host}}", "keep": 2},
            {"name": "peer", "kind": "peer", "listen": listen, "replicas": 2, "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(disk), "every": 1},
        ],
        "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
    }


class Hosts:
    """Where the test's hosts run: host i in network namespace i of `net` (rank 0's host
    the job's master, gloo on eth0, each peer server on the address that reaches it), or,
    without `net`, every host a set of processes on loopback."""

    def __init__(self, net: Net | None):
        self.net = net

    @property
    def listen(self) -> str:
        """The peer tier's `listen`: any address in a namespace (the host advertises the one
        that reaches the master), loopback otherwise."""
        return "0.0.0.0:0" if self.net else "127.0.0.1:0"

    def run(self, script: str, args: list[str], tmp_path: Path, hosts: list[int], tag: str, killed: bool = False) -> None:
        """One rank per entry of `hosts` (its host index), on that host."""
        net = self.net

        def env_of(rank: int) -> dict[str, str]:
            env = {"TIERCEL_HOST": HOSTS[hosts[rank]], "OMP_NUM_THREADS": "1"}
            if net is not None:
                env |= {"MASTER_ADDR": net.addr(hosts[0]), "GLOO_SOCKET_IFNAME": "eth0"}
            return env

        prefix_of: Callable[[int], list[str]] | None = None
        if net is not None:
            prefix_of = lambda rank: net.exec_prefix(hosts[rank])  # noqa: E731
        run_ranks(script, args, tmp_path, world=len(hosts), env_of=env_of, tag=tag, killed=killed, prefix_of=prefix_of)


@pytest.fixture(params=["netns", "loopback"])
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """The 3 hosts: in network namespaces, or (where this machine cannot make them) on loopback."""
    why = unavailable()
    if request.param == "loopback":
        if why is None:
            pytest.skip("the netns variant runs the hosts in network namespaces here")
        yield Hosts(None)
        return
    if why is not None:
        pytest.skip(why)
    net = Net(len(HOSTS))
    try:
        yield Hosts(net)
    finally:
        net.close()


def run_dcp(hosts: Hosts, tmp_path: Path, cfg: dict[str, Any], on: list[int], killed: bool = False) -> list[dict[str, Any]]:
    """The FSDP2 worker (tests/dcp_worker.py) on hosts `on`; its reports by rank."""
    out = Path(cfg["out"])
    out.mkdir(exist_ok=True)
    hosts.run(DCP_WORKER, [json.dumps(cfg)], tmp_path, on, tag=cfg["mode"], killed=killed)
    return [json.loads((out / f"{cfg['mode']}-{r}.json").read_text()) for r in range(len(on))]


def lose_host_c(shm_root: Path) -> None:
    """Host C is gone: its own steps and the replicas it held for host B."""
    shutil.rmtree(shm_root / "hostC")


def test_dcp_fsdp2_reshards_3_to_2_hosts_from_ram_and_peers(tmp_path, shm_root, hosts):
    out = tmp_path / "out"
    policy = elastic_policy(shm_root, tmp_path / "disk", hosts.listen)
    base = {"policy": policy, "out": str(out), "saved_world": 3}
    trained = run_dcp(hosts, tmp_path, {**base, "mode": "train", "last": 3, "save": [3], "kill": True}, [0, 1, 2],
                      killed=True)
    for t in trained:
        assert t["states"]["3"] in ({"ram": "committed", "peer": "committed", "disk": d} for d in ("written", "committed"))
    # The durable tier has the step: reading none of it is the restore's choice.
    assert (tmp_path / "disk" / "step-000000000003" / "COMMIT").exists()
    lose_host_c(shm_root)
    resumed = run_dcp(hosts, tmp_path, {**base, "mode": "resume", "last": 3}, [0, 1])
    assert [r["step"] for r in resumed] == [3, 3], resumed
    # Bit-identical: the whole state the 2 ranks loaded is the one the 3 saved.
    assert_same(load(out / "loaded-full-3-w2.pt"), load(out / "full-3.pt"))
    for rank, r in enumerate(resumed):
        assert r["bytes_read"]["disk"] == 0, (rank, r)
        assert set(r["tiers"]) <= {"ram", "peer"}, (rank, r)
    # Each new rank read pieces of a saved rank its own host does not hold, from a peer.
    assert all(r["bytes_read"]["peer"] > 0 for r in resumed), resumed
    print("bytes read per tier:", [r["bytes_read"] for r in resumed])


SAVE_3 = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

policy = json.loads(sys.argv[1].replace("{host}", os.environ["TIERCEL_HOST"]))
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank = dist.get_rank()
store = tiercel.Store(policy)
rng = np.random.default_rng(rank)
state = {"w": rng.standard_normal((64, 1024)).astype(np.float32), "b": np.arange(1000 + rank)}
states = store.save(5, state).wait(60, commit=True)
np.savez(os.path.join(sys.argv[2], f"saved-{rank}.npz"), **state)
with open(os.path.join(sys.argv[2], f"states-{rank}.json"), "w") as f:
    json.dump(states, f)
dist.barrier()
os.kill(os.getpid(), 9)  # the whole job dies: no close
"""

READ_ALL = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

policy = json.loads(sys.argv[1].replace("{host}", os.environ["TIERCEL_HOST"]))
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
store = tiercel.Store(policy)
step = store.latest_step(reshard=True)
report = {"step": step, "tiers": {}}
for saved in range(3):  # every rank reads every saved rank's part
    got = store.restore(step=step, rank=saved)
    want = np.load(os.path.join(sys.argv[2], f"saved-{saved}.npz"))
    assert all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want), saved
    report["tiers"][saved] = store.last_restore.tiers
report["bytes_read"] = {t: m["bytes_read"] or 0 for t, m in store.metrics().items()}
with open(os.path.join(sys.argv[2], f"read-{rank}.json"), "w") as f:
    json.dump(report, f, default=dict)
dist.barrier()
store.close()
dist.destroy_process_group()
"""


def test_every_saved_rank_reads_from_ram_and_peers_on_2_of_3_hosts(tmp_path, shm_root, hosts):
    out = tmp_path / "out"
    out.mkdir()
    policy = json.dumps(elastic_policy(shm_root, tmp_path / "disk", hosts.listen))
    hosts.run(SAVE_3, [policy, str(out)], tmp_path, [0, 1, 2], tag="save", killed=True)
    every = {"ram": "committed", "peer": "committed", "disk": "committed"}
    assert all(json.loads((out / f"states-{r}.json").read_text()) == every for r in range(3))
    lose_host_c(shm_root)
    hosts.run(READ_ALL, [policy, str(out)], tmp_path, [0, 1], tag="read")
    reports = [json.loads((out / f"read-{r}.json").read_text()) for r in range(2)]
    print("bytes read per tier:", [r["bytes_read"] for r in reports])
    for rank, r in enumerate(reports):
        assert r["step"] == 5, r
        assert r["bytes_read"]["disk"] == 0, (rank, r)
        assert r["tiers"][str(rank)] == {"ram": 2}, (rank, r)  # its own host's saved rank, from RAM
    # Host A: saved rank 1 from host B's RAM, saved rank 2 from its own replica store;
    # host B: saved rank 0 from its replica store, saved rank 2 from host A's.
    assert reports[0]["tiers"]["1"] == {"peer": 2} and reports[0]["tiers"]["2"] == {"peer": 2}, reports
    assert reports[1]["tiers"]["0"] == {"peer": 2} and reports[1]["tiers"]["2"] == {"peer": 2}, reports


def test_orbax_reshards_3_to_2_hosts_from_ram_and_peers(tmp_path, shm_root):
    """Multi-process JAX (tests/orbax_worker.py): 3 processes x 2 CPU devices save a (3, 2)
    mesh's shards; 2 processes x 2 devices restore them on a (2, 2) mesh."""
    pytest.importorskip("orbax.checkpoint")
    from test_orbax import run_job as run_jax

    def cfg_of(pid: int) -> dict[str, Any]:
        policy = json.loads(json.dumps(elastic_policy(shm_root, tmp_path / "disk")).replace("{host}", HOSTS[pid]))
        return {"policy": policy, "dir": str(tmp_path / "orbax"), "host": HOSTS[pid]}

    saved = run_jax(tmp_path, "elastic_save", cfg_of, nproc=3, ndev=2)
    every = {"ram": "committed", "peer": "committed", "disk": "committed"}
    assert all(s["states"] == every for s in saved), saved
    lose_host_c(shm_root)
    restored = run_jax(tmp_path, "elastic_restore", cfg_of, nproc=2, ndev=2)
    print("bytes read per tier:", [r["bytes_read"] for r in restored])
    for pid, r in enumerate(restored):
        assert r["bytes_read"]["disk"] == 0, (pid, r)
        assert set(r["tiers"]) <= {"ram", "peer"}, (pid, r)
    assert all(r["bytes_read"]["peer"] > 0 for r in restored), restored
