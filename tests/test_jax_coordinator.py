"""JAX's distributed client as the coordinator: two real JAX processes
(`jax.distributed.initialize` on 127.0.0.1, CPU devices) open Stores with a peer tier on two
simulated hosts, exchange addresses and the secret through JAX's key-value store, replicate to
each other, and agree on the step to restore, with no torch.distributed anywhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from conftest import PYTHON, child_env
from test_multirank import free_port

pytest.importorskip("jax")

WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid, port, base, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
disk = f"{out}/disk"  # one directory both processes write: its commit counts them in through JAX
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
import tiercel
host = f"host{pid}"
policy = {
    "tier": [
        {"name": "ram", "kind": "memory", "root": f"{base}/{host}", "keep": 2},
        {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2},
        {"name": "disk", "kind": "fs", "url": disk, "every": 1, "compression": "none"},
    ],
    "restore": {"order": ["ram", "peer"]},
}
os.environ["TIERCEL_HOST"] = host
store = tiercel.Store(policy)
assert type(store.coordinator).__name__ == "JaxCoordinator", store.coordinator
assert (store.rank, store.world_size) == (pid, 2)
assert store._core.has_counter(), "no counter from JAX's key_value_increment: the disk commit lists"
for step in (1, 2):
    w = np.full((1000,), step * 10 + pid, dtype=np.float32)
    # commit=True: the process that did not write the disk's commit learns of it by its probe.
    states = store.save(step, {"w": {"x": w}}).wait(60, commit=True)
    assert states == {"ram": "committed", "peer": "committed", "disk": "committed"}, states
# Every peer server must stay up until everyone's replicas are in.
store.coordinator.all_gather("saved")
store.close()
# Host 1 loses its RAM; a new store on it restores from host 0's copy.
if pid == 1:
    import shutil
    shutil.rmtree(f"{base}/{host}")
store.coordinator.all_gather("wiped")
store = tiercel.Store(policy)
got = store.restore()
info = store.last_restore
assert np.array_equal(got["w"]["x"], np.full((1000,), 20 + pid, dtype=np.float32))
json.dump({"step": info.step, "tiers": info.tiers}, open(f"{out}/jax-{pid}.json", "w"))
store.coordinator.all_gather("restored")
store.close()
jax.distributed.shutdown()
"""


def test_jax_processes_coordinate_through_jax(tmp_path):
    base = f"/dev/shm/tiercel-jax-test-{tmp_path.name}"
    shutil.rmtree(base, ignore_errors=True)
    port = free_port()
    env = child_env({"JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen([PYTHON, "-c", WORKER, str(i), str(port), base, str(tmp_path)], env=env,
                         stdout=open(tmp_path / f"jax-{i}.log", "w"), stderr=subprocess.STDOUT)
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 180
        for p in procs:
            p.wait(max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(base, ignore_errors=True)
    logs = "\n".join((tmp_path / f"jax-{i}.log").read_text()[-3000:] for i in range(2))
    assert all(p.returncode == 0 for p in procs), logs
    r0, r1 = (json.loads((tmp_path / f"jax-{i}.json").read_text()) for i in range(2))
    assert r0 == {"step": 2, "tiers": {"ram": 1}}, r0
    assert r1 == {"step": 2, "tiers": {"peer": 1}}, r1
