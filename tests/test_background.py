"""Waiting for the background work, bounded and interruptible: `flush(timeout)` raises
TimeoutError naming what is left, `close(timeout)` returns in time and says what it left
unpersisted (committed steps stay), a progress line while a wait lasts, Ctrl-C twice leaves
a `close()` that waits on a slow tier; and `SaveHandle.wait(commit=True)`, which waits for
the step's commit record on every tier this rank wrote it to (2 real ranks).

The slow tier is real: an fs tier limited to `bandwidth = "1MB/s"`, given a few MB.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import numpy as np
import pytest

import tiercel

from conftest import PYTHON, TESTS_DIR, child_env, make_policy
from test_multirank import run_ranks

MiB = 1 << 20


def slow_policy(shm_root, disk_root) -> dict:
    return make_policy(shm_root, disk_root, every=1, compression="none", disk_opts={"bandwidth": "1MB/s"})


def big(step: int, nbytes: int = 3 * MiB) -> dict:
    return {"w": np.full(nbytes // 4, step, dtype=np.float32)}


def in_memory(handles, timeout: float = 60) -> None:
    """Waits until each save is committed on the memory tier (its persists are queued then)."""
    deadline = time.monotonic() + timeout
    while any(h.states()["ram"] != "committed" for h in handles):
        assert time.monotonic() < deadline, [h.states() for h in handles]
        time.sleep(0.01)


def test_flush_and_close_with_a_timeout_return_in_time_and_say_what_is_left(shm_root, disk_root, capfd):
    store = tiercel.Store(slow_policy(shm_root, disk_root), rank=0, world_size=1)
    small = store.save(1, big(1, 64 << 10))
    small.wait(60)
    handles = [store.save(2, big(2)), store.save(3, big(3))]
    in_memory(handles)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        store.flush(timeout=0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.5, took
    assert str(ei.value) == ("rank 0: background work not finished after 0.3 s: tier 'disk': step 2 (running), "
                             "step 3 (6.0 MiB in all)"), ei.value

    capfd.readouterr()
    t0 = time.monotonic()
    assert store.close(timeout=0.5) is False
    took = time.monotonic() - t0
    assert 0.5 <= took < 1.5, took
    err = capfd.readouterr().err
    assert ("tiercel warn: rank 0: closed with background work unfinished: tier 'disk': step 2 (running), step 3 "
            "(6.0 MiB in all); it was not persisted there (committed steps stay committed)") in err, err
    # The running persist stops at its next chunk, the queued one never runs; nothing of
    # either is visible on the tier, and the step committed before stays.
    assert handles[0].wait(10)["disk"] == "skipped: the store was closed before it finished"
    assert handles[1].wait(10)["disk"] == "skipped: the store was closed before it ran"
    with tiercel.Store(slow_policy(shm_root, disk_root), rank=0, world_size=1) as again:
        assert again.steps() == {"ram": [2, 3], "disk": [1]}  # ram keeps 2


def test_close_without_timeout_finishes_and_says_so_while_it_waits(shm_root, disk_root, capfd):
    store = tiercel.Store(slow_policy(shm_root, disk_root), rank=0, world_size=1)
    h = store.save(1, big(1))
    in_memory([h])
    assert store.close() is True
    err = capfd.readouterr().err
    progress = [l for l in err.splitlines() if "for background work" in l]
    # ~3 s at 1 MB/s: one line after 2 s.
    assert len(progress) == 1 and progress[0].startswith("tiercel warn: rank 0: waiting 2 s for background work: "
                                                         "tier 'disk': step 1 (running) (3.0 MiB in all)"), err
    assert h.wait(1)["disk"] == "committed"


SIGINT_CHILD = r"""
import signal, sys, time, numpy as np, tiercel
# Ctrl-C raises KeyboardInterrupt, as in a terminal, even where this test runs in a background
# job: a shell starts those with SIGINT ignored, and Python then installs no handler of its own.
signal.signal(signal.SIGINT, signal.default_int_handler)
from conftest import make_policy
policy = make_policy(sys.argv[1], sys.argv[2], every=1, compression="none", disk_opts={"bandwidth": "1MB/s"})
store = tiercel.Store(policy, rank=0, world_size=1)
store.save(1, {"w": np.ones(16 << 10, dtype=np.float32)}).wait(60)
# 8 MiB: ~8 s at 1 MB/s. Not ones, as step 1: its chunks would be stored already (dedup).
h = store.save(2, {"w": np.full(2 << 20, 2, dtype=np.float32)})
while h.states()["ram"] != "committed":
    time.sleep(0.01)
print("closing", flush=True)
if sys.argv[3] == "with":
    with store:
        import os, signal
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C leaves the training loop
        time.sleep(5)
else:
    store.close()
print("closed", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "with"])
def test_ctrl_c_twice_leaves_a_close_that_waits_on_a_slow_tier(how, shm_root, disk_root):
    """`close()`: the first Ctrl-C says what it waits for, the second leaves. A `with` block
    left by a Ctrl-C: the next one leaves. Committed steps stay committed."""
    p = subprocess.Popen([PYTHON, "-c", SIGINT_CHILD, str(shm_root), str(disk_root), how], cwd=str(TESTS_DIR),
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "closing\n"
        time.sleep(1.0)
        if how == "close":
            p.send_signal(signal.SIGINT)
            time.sleep(1.0)
        assert p.poll() is None  # still waiting: the first Ctrl-C in close() does not leave
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert p.returncode != 0 and took < 3.0, (took, err)
    assert "closed" not in out and err.rstrip().endswith("KeyboardInterrupt"), err
    if how == "close":
        assert ("tiercel warn: rank 0: interrupted while closing; still waiting for tier 'disk': step 2 (running) "
                "(8.0 MiB in all). Press Ctrl-C again to leave") in err, err
    assert "closed with background work unfinished: tier 'disk': step 2 (running)" in err, err
    with tiercel.Store(slow_policy(shm_root, disk_root), rank=0, world_size=1) as again:
        assert again.steps()["disk"] == [1]


COMMIT_WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from conftest import make_policy

shm_base, disk, out_dir = sys.argv[1:4]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
# Each rank its own host and memory root: its memory tier commits on its own, and the disk
# tier, shared, commits once both ranks have written.
store = tiercel.Store(make_policy(f"{shm_base}-{rank}", disk, every=1))
flag = os.path.join(out_dir, "rank0-written")
report = {}
if rank == 0:
    h = store.save(1, {"x": np.arange(1000)})
    report["wait"] = h.wait(60)
    open(flag, "w").close()  # now rank 1 saves its part
    report["commit"] = h.wait(60, commit=True)
    report["steps"] = store.steps()["disk"]
else:
    while not os.path.exists(flag):
        time.sleep(0.01)
    report["commit"] = store.save(1, {"x": np.arange(1000) + 1}).wait(60, commit=True)
dist.barrier()
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_wait_for_the_commit_on_two_ranks(tmp_path, shm_root):
    """Rank 0 writes its part of step 1 first: `wait()` says "written" (final for the rank),
    `wait(commit=True)` returns once rank 1 has written its part and the commit record."""
    out = tmp_path / "out"
    out.mkdir()
    try:
        run_ranks(COMMIT_WORKER, [str(shm_root), str(tmp_path / "disk"), str(out)], tmp_path, world=2,
                  env_of=lambda r: {"TIERCEL_HOST": f"host{r}"})
    finally:
        for r in range(2):
            subprocess.run(["rm", "-rf", f"{shm_root}-{r}"], check=False)
    r0, r1 = (json.loads((out / f"rank-{r}.json").read_text()) for r in range(2))
    assert r0["wait"] == {"ram": "committed", "disk": "written"}, r0
    assert r0["commit"] == {"ram": "committed", "disk": "committed"}, r0
    assert r1["commit"] == {"ram": "committed", "disk": "committed"}, r1
    assert r0["steps"] == [1]


def test_wait_for_the_commit_times_out_naming_the_tier(shm_root, disk_root):
    """Alone on a tier another rank never writes: `wait(commit=True)` times out."""
    policy = make_policy(shm_root, disk_root, every=1)
    with tiercel.Store(policy, rank=0, world_size=2) as store:  # no coordinator: one host
        store._core.set_local_ranks([0])
        h = store.save(1, {"x": np.arange(10)})
        assert h.wait(60)["disk"] == "written"
        with pytest.raises(TimeoutError, match=r"step 1: background tiers not done after 0.3 s: .*'disk': 'written'"):
            h.wait(0.3, commit=True)

