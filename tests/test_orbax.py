"""tiercel as an Orbax backend, with real JAX and orbax-checkpoint: jobs of 2 processes x 2
CPU devices (jax.distributed on 127.0.0.1) checkpoint a sharded train state through Orbax's
CheckpointManager with tiercel.orbax's handler, crash, restart and restore into the same
sharding, another mesh and PartitionSpec, and 1 process x 4 devices; a wiped host restores
from its peer; a corrupted shard in RAM is read from disk; an exported step loads with
ocp.StandardCheckpointer alone. The job's code is tests/orbax_worker.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import PYTHON, TESTS_DIR, child_env, make_policy, new_shm_root, run_isolated, run_python
from orbax_state import COLS, ROWS
from test_multirank import free_port

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

WORKER = str(TESTS_DIR / "orbax_worker.py")
#: What one process of the 2x2 job needs: 2 of the 4 matrix blocks, the vector, the scalar;
#: in row quarters on a (4,) mesh, the same blocks' bytes but only half of the vector.
MY_BYTES = 2 * (ROWS // 2) * (COLS // 2) * 4 + COLS * 4 + 4
ROWS_BYTES = 2 * (ROWS // 2) * (COLS // 2) * 4 + COLS // 2 * 4 + 4
TIMEOUT = 300  # JAX and Orbax start slowly on a busy machine


def run_job(
    tmp_path: Path, phase: str, cfg_of: Callable[[int], dict[str, Any]], nproc: int, ndev: int, *, crash: bool = False
) -> list[dict[str, Any]]:
    """Runs `nproc` worker processes of one JAX job; returns their reports. Each process
    gets `cfg_of(pid)` plus its place in the job. A save phase ends with every process
    killing itself (a crash); with `crash`, process 0 dies mid-save and the test kills the
    others once it has."""
    port = free_port()
    env = child_env({"JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    logs = [tmp_path / f"{phase}-{pid}.log" for pid in range(nproc)]
    procs = []
    for pid in range(nproc):
        cfg = {"phase": phase, "pid": pid, "nproc": nproc, "ndev": ndev, "port": port, "out": str(tmp_path), **cfg_of(pid)}
        procs.append(subprocess.Popen([PYTHON, WORKER, json.dumps(cfg)], env=env, cwd=str(TESTS_DIR),
                                      stdout=open(logs[pid], "w"), stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT
    try:
        for pid, p in enumerate(procs):
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            if crash and pid == 0:
                break  # the others wait for it forever: the test plays the cluster manager
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    killed = phase in ("save", "elastic_save")
    for pid, p in enumerate(procs):
        if killed:
            # SIGKILL, or SIGABRT from JAX's client once the coordination service (process 0) is gone.
            assert p.returncode in (-9, -6), f"process {pid} of {phase} ended with {p.returncode}\n{text}"
        else:
            assert p.returncode == 0, f"process {pid} of {phase} ended with {p.returncode}\n{text}"
    return [json.loads((tmp_path / f"{phase}-{pid}.json").read_text()) for pid in range(nproc)]


@pytest.fixture
def shm():
    root = new_shm_root("orbax-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_save_crash_restart_restore_anywhere(tmp_path, shm):
    """One host: memory tier (keep 2) and an fs tier (every 2, keep 2); Orbax keeps 3."""
    disk = tmp_path / "disk"
    policy = make_policy(shm, disk, every=2, ram={"keep": 2}, disk_opts={"keep": 2})
    common = {"policy": policy, "dir": str(tmp_path / "orbax")}

    saved = run_job(tmp_path, "save", lambda pid: {**common, "crash": True}, nproc=2, ndev=2, crash=True)
    for r in saved:
        assert r["all_steps"] == [2, 3, 4], r
        # Orbax dropped step 1 from its list; tiercel's own retention holds RAM [3, 4], disk [2, 4].
        assert r["steps"] == {"ram": [3, 4], "disk": [2, 4]}, r
        # "written": this rank's part is in; the rank that came last committed the step.
        assert r["states"]["4"]["disk"] in ("committed", "written") and r["states"]["3"]["disk"] == "not scheduled", r
        assert r["states"]["4"]["ram"] in ("committed", "written"), r
    # Step 5 died mid-save: Orbax never finalized it, tiercel never committed it.
    assert sorted(p.name for p in (tmp_path / "orbax").iterdir() if p.name.isdigit()) == ["2", "3", "4"]
    # Orbax's step directory holds the handler's marker, not the arrays.
    marker = json.loads((tmp_path / "orbax" / "4" / "state" / "tiercel.json").read_text())
    assert marker["step"] == 4 and marker["item"] == "state" and marker["world_size"] == 2, marker
    assert {p.name for p in (tmp_path / "orbax" / "4" / "state").iterdir()} - {"commit_success.txt"} == {"tiercel.json"}

    restored = run_job(tmp_path, "restore", lambda pid: {**common, "also": [2]}, nproc=2, ndev=2)
    for r in restored:
        assert r["all_steps"] == [2, 3, 4] and r["latest"] == 4, r
        assert set(r["tiers"]["same"]) == {"ram"} and set(r["tiers"]["other"]) == {"ram"}, r
        assert set(r["tiers"]["2"]) == {"disk"}, r  # evicted from RAM by keep = 2
        # Each process read only what its devices hold.
        assert r["nbytes"] == {"same": MY_BYTES, "other": ROWS_BYTES}, r
        assert r["dropped"] == [], r

    (single,) = run_job(tmp_path, "single", lambda pid: common, nproc=1, ndev=4)
    assert "Topology mismatch detected" in single["no_target_error"] and "fallback_sharding" in single["no_target_error"]
    assert single["all_steps"] == [2, 3, 4] and single["latest"] == 4, single
    assert set(single["c"]) == {"ram"}, single
    assert "ram+disk" in single["corrupt"]["tiers"], single
    assert any("checksum" in w or "CRC" in w or "crc" in w for w in single["corrupt"]["warnings"]), single
    # After the RAM is lost: step 3 was only there (disk takes every 2nd step).
    assert "step 3" in single["lost_error"] and "tiercel.orbax.sync" in single["lost_error"], single
    assert single["dropped"] == [3] and single["after_sync"] == [2, 4], single
    assert set(single["after_sync_tiers"]) == {"disk"}, single

    # The exported step loads with Orbax alone, in an interpreter that never imports tiercel.
    out = run_python(EXPORT_CHECK, single["exported"], timeout=TIMEOUT)
    assert "EXPORT OK" in out.stdout, out.stdout + out.stderr


EXPORT_CHECK = r"""
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from orbax_state import global_values
want = global_values(4)
got = ocp.StandardCheckpointer().restore(sys.argv[1])
assert np.asarray(got["params"]["w"]).tobytes() == want["w"].tobytes()
assert np.asarray(got["params"]["b"]).tobytes() == want["b"].tobytes()
assert np.asarray(got["scale"]).tobytes() == want["scale"].tobytes()
assert int(got["step"]) == 4
# Into a sharding of this process's own, as any Orbax checkpoint.
mesh = Mesh(np.array(jax.devices()), ("d",))
sds = lambda v, spec: jax.ShapeDtypeStruct(np.shape(v), np.float32, sharding=NamedSharding(mesh, spec))
target = {"params": {"w": sds(want["w"], P("d")), "b": sds(want["b"], P())}, "scale": sds(want["scale"], P()), "step": 0}
got = ocp.StandardCheckpointer().restore(sys.argv[1], target)
assert isinstance(got["params"]["w"], jax.Array) and len(got["params"]["w"].addressable_shards) == 2
assert np.asarray(got["params"]["w"]).tobytes() == want["w"].tobytes() and got["step"] == 4
assert not any(m == "tiercel" or m.startswith("tiercel.") for m in sys.modules), "tiercel was imported"
print("EXPORT OK")
"""


def test_a_wiped_host_restores_from_its_peer(tmp_path):
    """Two hosts (own shared memory each) with a peer tier and a disk; host 1 loses its RAM.

    Host 1 gets its own shards back from host 0's RAM (its peer). The replicated vector and
    the scalar were saved once, by process 0 (replica 0), and their only peer copy was on
    host 1: host 1 reads those from host 0's own RAM, which host 0's peer server serves too,
    not from disk."""
    base = new_shm_root("orbax-peer-")
    try:

        def cfg_of(pid: int) -> dict[str, Any]:
            host = f"host{pid}"
            policy = {
                "tier": [
                    {"name": "ram", "kind": "memory", "root": f"{base}/{host}", "keep": 3},
                    {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 3},
                    {"name": "disk", "kind": "fs", "url": str(tmp_path / "disk"), "every": 1},
                ],
                "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
            }
            return {"policy": policy, "dir": str(tmp_path / "orbax"), "host": host, "steps": 3}

        saved = run_job(tmp_path, "save", cfg_of, nproc=2, ndev=2)
        for r in saved:
            assert r["all_steps"] == [1, 2, 3], r
            assert all(s["peer"] == "committed" for s in r["states"].values()), r
        shutil.rmtree(f"{base}/host1")
        restored = run_job(tmp_path, "peer_restore", cfg_of, nproc=2, ndev=2)
        assert all(r["all_steps"] == [1, 2, 3] and r["latest"] == 3 for r in restored), restored
        assert set(restored[0]["tiers"]) == {"ram"}, restored
        assert set(restored[1]["tiers"]) == {"peer"}, restored
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_every_kind_of_leaf(tmp_path, shm):
    r = run_isolated("orbax_worker", "leaf_kinds", make_policy(shm, None), str(tmp_path / "orbax"), timeout=TIMEOUT)
    assert r["plain_jax"] == ["bfloat16", True], r
    assert r["plain_np"] == ["ndarray", "int16", [[0, 1, 2], [3, 4, 5]]], r
    assert r["plain_np_scalar"] == ["float64", 2.5], r
    assert r["plain_empty"] == [0, 3], r
    assert r["plain_py"] == [1, 2.5, True, "text", None], r  # an empty subtree, kept (as Orbax keeps it)
    assert r["plain_nested"] == [3.0, 7], r
    assert r["typed_jax"] == ["ArrayImpl", True, True], r
    assert r["typed_tuple"] == "tuple", r
    assert r["typed_py"] == [1, 2.5, True, "text", None], r
    # Exported, every kind loads with Orbax's own StandardCheckpointer.
    assert r["exported"] == [[1, 2.5, True, "text", None], 2.5, [[0, 1, 2], [3, 4, 5]], list(range(12))], r
    assert "zero size: ['empty']" in r["export_error"], r
    assert r["checkpointer"] == [0, 1, 2], r
    assert r["part"] == [["np"], "float32", [[0, 1, 2], [3, 4, 5]]], r
    assert "['np']: the target has shape (3, 2), the checkpoint (2, 3)" in r["shape_error"], r


def test_arrays_donated_or_deleted_right_after_a_save_restore_bit_identical(tmp_path, shm):
    """The copy into shared memory runs after `mngr.save` returns; the arrays it holds stay
    valid when the next jitted step donates them or the caller deletes them."""
    r = run_isolated("orbax_worker", "donated", make_policy(shm, None, ram={"keep": 3}), str(tmp_path / "orbax"), timeout=TIMEOUT)
    assert r["pending_at_step"] == [True, True, True], r  # the step ran while the save was still copying
    assert r["deleted"] == [True], r
    assert r["identical"] == [True] * 6, r


def test_a_step_saved_again_replaces_the_stale_copies(tmp_path, shm):
    policy = make_policy(shm, tmp_path / "disk", every=1)
    got = run_isolated("orbax_worker", "resave", policy, str(tmp_path / "orbax"), timeout=TIMEOUT)
    assert got == {"ram": 2.0, "disk": 2.0}, got


def test_two_items_of_one_step_on_one_policy_both_restore(tmp_path, shm):
    """Issue 28 item 7: items of one Orbax step share one tiercel step, whether each has its
    own handler of the policy or one handler serves both."""
    r = run_isolated("orbax_worker", "two_items", make_policy(shm, tmp_path / "disk", every=1),
                     str(tmp_path / "orbax"), timeout=TIMEOUT)
    for case, base in (("two_handlers", 0), ("one_handler", 10)):
        want = [[float(s), float(s), f"p{s}", True, s] for s in (base + 1, base + 2)]
        assert r[case]["steps"] == [base + 1, base + 2], r
        assert r[case]["now"] == want, r
        assert r[case]["reopened"] == want, r
    assert r["clash"].startswith("InvalidArgumentError") and "step 2" in r["clash"] and "'extra'" in r["clash"], r
    assert r["after_clash"] == [2.0, 2.0, "p2", True, 2], r


def test_a_refused_save_leaves_no_orbax_work_running_behind_it(tmp_path, shm):
    """A save tiercel refuses raises from Orbax's mngr.save after Orbax's own creation of the
    step's directories is over. Before, it left that creation running in Orbax's threads: a
    mngr.close() right after shut the metadata executor it still needed ("cannot schedule new
    futures after shutdown", two_items' intermittent failure on a busy machine) and the item
    directories' thread waited 300 s for its signal, also at the process's exit. Orbax's
    directory creation is slowed by 1 s here so that the close always comes first."""
    r = run_isolated("orbax_worker", "refused_save", make_policy(shm, tmp_path / "disk", every=1),
                     str(tmp_path / "orbax"), 1.0, timeout=TIMEOUT)
    assert r["clash"].startswith("InvalidArgumentError") and "step 1" in r["clash"] and "'extra'" in r["clash"], r
    assert r["orbax_errors"] == [], r
    assert r["orbax_threads"] == [], r
