"""The memory tier's capacity, retention and segment recycling.

Saves that must evict to make room run in a child process (`run_isolated`) with a timeout:
a hang in the core, which holds the tier's lock with the GIL released, would otherwise stall
the whole suite instead of failing one test.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

import tiercel

from conftest import (
    assert_same,
    du,
    files_under,
    make_policy,
    random_numpy,
    run_isolated,
    step_dir,
)

STEP = 256 << 10  # bytes per step: one put of one 256 KiB array
PAGE = 4096


def step_state(step: int) -> dict:
    return {"w": random_numpy(np.uint8, (STEP,), step)}


def ram_policy(root, **ram) -> dict:
    return make_policy(root, None, ram=ram)


def open_store(root, **ram) -> tiercel.Store:
    return tiercel.Store(ram_policy(root, **ram), rank=0, world_size=1)


def part_inode(root, step: int, part: int = 0) -> int:
    return os.stat(step_dir(root, step) / f"rank-00000.part-{part:03d}.data").st_ino


def my_pool(root) -> dict[str, int]:
    """This process's spare segments: {file name: inode}."""
    pool = Path(root) / ".pool"
    return {p.name: p.stat().st_ino for p in pool.iterdir() if p.name.startswith(f"{os.getpid()}-")}


class PeakSampler:
    """Samples the bytes under a root on a thread, as fast as it can, while saves run."""

    def __init__(self, root):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.0005):  # often, yet leaving the CPU to the saves
            self.peak = max(self.peak, du(self.root))

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


# -- bodies run in a child process ---------------------------------------------------------------


def body_many_saves(root: str) -> dict:
    cap = int(2.5 * STEP)
    s = open_store(root, capacity=cap, keep=100)  # capacity, not keep, decides what goes
    history = []
    with PeakSampler(root) as sampler:
        for step in range(1, 13):
            h = s.save(step, step_state(step))
            assert h.wait(60) == {"ram": "committed"}, h.states()
            s.flush()
            used = s._core.memory_used()
            ram = s.steps()["ram"]
            history.append((step, ram, used))
            assert used <= cap, f"step {step}: {used} bytes used, capacity {cap}"
            # Oldest first: what is left is always the newest steps, without gaps.
            assert ram == list(range(ram[0], step + 1)), f"step {step}: {ram}"
            assert len(ram) == min(step, 2), f"step {step}: {ram} (2 steps fit in 2.5 steps of capacity)"
    assert sampler.peak <= cap, f"peak {sampler.peak} bytes under {root}, capacity {cap}"
    for step in s.steps()["ram"]:
        assert_same(s.restore(step), step_state(step))
    assert_same(s.restore(), step_state(12))
    s.close()
    return {"history": history, "peak": sampler.peak}


def body_too_big(root: str) -> dict:
    cap = int(2.5 * STEP)
    s = open_store(root, capacity=cap, keep=100)
    for step in (1, 2):
        s.save(step, step_state(step)).wait(60)
    s.flush()
    assert s.steps()["ram"] == [1, 2]
    messages = []
    # One put larger than the capacity, and a step whose second put does not fit.
    for state in ({"w": np.zeros(4 * STEP, np.uint8)}, {"a": np.ones(STEP // 2, np.uint8), "b": np.ones(2 * STEP, np.uint8)}):
        try:
            s.save(3, state)
        except tiercel.CapacityError as e:
            messages.append(str(e))
        else:
            raise AssertionError("a step larger than the capacity was accepted")
        s.flush()
        assert not step_dir(root, 3).exists() or files_under(step_dir(root, 3)) == [], files_under(root)
        assert s._core.memory_used() <= cap
        if len(state) == 1:
            # A put that could never fit is refused before anything is evicted.
            assert s.steps()["ram"] == [1, 2], s.steps()
    # A step whose first put fits (by evicting step 1) and whose second cannot: the core
    # cannot know the second put's size when it makes room for the first.
    left = s.steps()["ram"]
    # Whatever is left is intact, and the newest step is among it.
    assert 2 in left, left
    for step in left:
        assert_same(s.restore(step), step_state(step))
    assert_same(s.restore(), step_state(2))
    # And saving goes on.
    s.save(4, step_state(4)).wait(60)
    assert_same(s.restore(), step_state(4))
    s.close()
    return {"messages": messages, "left": left}


def body_recycle_under_pressure(root: str) -> dict:
    """At capacity, the segment of the step evicted to make room is reused for the new one,
    not deleted and allocated afresh (first-touch tmpfs pages cost ~10x a warm copy)."""
    cap = int(2.5 * STEP)
    s = open_store(root, capacity=cap, keep=100)
    inodes = {}
    for step in range(1, 9):
        s.save(step, step_state(step)).wait(60)
        s.flush()
        inodes[step] = part_inode(root, step)
    fresh = [step for step in range(4, 9) if inodes[step] not in {inodes[k] for k in range(1, step)}]
    s.close()
    assert fresh == [], f"steps {fresh} got newly allocated segments: {inodes}"
    return inodes


# -- tests ------------------------------------------------------------------------------------------


def test_many_saves_stay_within_capacity(shm_root):
    out = run_isolated("test_capacity", "body_many_saves", str(shm_root))
    assert out["peak"] > 2 * STEP  # the sampler saw real data


def test_step_larger_than_capacity(shm_root):
    out = run_isolated("test_capacity", "body_too_big", str(shm_root))
    assert len(out["messages"]) == 2
    for m in out["messages"]:
        for part in ("'ram'", "step 3", "capacity"):
            assert part in m, m


def test_put_larger_than_capacity_evicts_nothing(shm_root):
    # body_too_big asserts that the oversized put left steps 1 and 2 alone.
    out = run_isolated("test_capacity", "body_too_big", str(shm_root))
    assert out["left"] == [2], out


def test_segments_recycled_at_capacity(shm_root):
    run_isolated("test_capacity", "body_recycle_under_pressure", str(shm_root))


def test_capacity_holds_at_the_exact_boundary(shm_root):
    # Room for exactly: two committed steps (data + manifest + COMMIT, a page each) and one
    # more step's data.
    cap = 2 * (STEP + 2 * PAGE) + STEP
    s = open_store(shm_root, capacity=cap, keep=100)
    try:
        for step in (1, 2, 3):
            s.save(step, step_state(step)).wait(60)
            s.flush()
            assert s._core.memory_used() <= cap, f"step {step}: {s._core.memory_used()} > {cap}"
    finally:
        s.close()


def test_keep_one_leaves_one_step(shm_root):
    s = open_store(shm_root, keep=1)
    try:
        for step in range(1, 6):
            s.save(step, step_state(step)).wait(60)
            s.flush()
            assert s.steps()["ram"] == [step]
            assert sorted(p.name for p in Path(shm_root).glob("step-*")) == [step_dir(shm_root, step).name]
            # One step's data plus its metadata, plus at most one spare segment for the next.
            assert s._core.memory_used() <= 2 * STEP + 4 * PAGE
        assert_same(s.restore(), step_state(5))
    finally:
        s.close()


def test_segments_are_recycled(shm_root):
    s = open_store(shm_root, keep=2)
    try:
        inodes = {}
        pools = {}
        for step in range(1, 8):
            s.save(step, step_state(step)).wait(60)
            s.flush()
            inodes[step] = part_inode(shm_root, step)
            pools[step] = my_pool(shm_root)
            # After each save a spare segment for the next one is ready.
            assert s._core.pool_len() == len(pools[step]) >= 1, pools[step]
            if step > 1:
                # The segment the save wrote into was a spare one.
                assert inodes[step] in pools[step - 1].values(), (step, inodes[step], pools[step - 1])
        # From the fourth step on, every step reuses the segment of the step evicted three
        # saves earlier: three segments in rotation, no new allocation.
        for step in range(4, 8):
            assert inodes[step] == inodes[step - 3], inodes
        assert s.steps()["ram"] == [6, 7]
        for step in (6, 7):
            assert_same(s.restore(step), step_state(step))
    finally:
        s.close()
    # close() gives the spare segments back.
    assert my_pool(shm_root) == {}


def test_restored_view_survives_eviction_and_recycling(shm_root):
    s = open_store(shm_root, keep=2)
    try:
        s.save(1, step_state(1)).wait(60)
        held = s.restore()["w"]  # a zero-copy view of step 1's segment
        for step in range(2, 7):
            s.save(step, step_state(step)).wait(60)
            s.flush()
        assert 1 not in s.steps()["ram"]
        # Step 1's segment was evicted; had it been recycled while mapped, later steps would
        # show through the view.
        assert_same(held, step_state(1)["w"])
        del held
        for step in s.steps()["ram"]:
            assert_same(s.restore(step), step_state(step))
    finally:
        s.close()


def test_dead_process_pool_is_reclaimed(shm_root):
    """A process that died without close() leaves spare segments; the next store to open the
    tier removes them."""
    pool = Path(shm_root) / ".pool"
    pool.mkdir(parents=True)
    dead = pool / "999999999-0.seg"  # no such pid
    dead.write_bytes(b"\0" * STEP)
    assert du(shm_root) >= STEP
    s = open_store(shm_root)
    try:
        assert not dead.exists()
    finally:
        s.close()


def test_saving_a_step_again_keeps_later_steps_intact(shm_root):
    """Saving a step number again in the same process (a "final" save twice) must not leave a
    stale segment behind that is later recycled under another step's file name (fixed in
    MemoryTier::allocate; needs the extension rebuilt)."""
    s = open_store(shm_root, keep=2)
    try:
        s.save(2, step_state(100)).wait(60)
        try:
            s.save(2, step_state(2)).wait(60)
            again = True
        except tiercel.InvalidArgumentError:  # refusing is fine too; corrupting is not
            again = False
        assert_same(s.restore(2), step_state(2) if again else step_state(100))
        for step in range(3, 9):
            s.save(step, step_state(step)).wait(60)
            s.flush()
            for kept in s.steps()["ram"]:
                assert_same(s.reader(kept, tiers=["ram"]).get_all(), step_state(kept), f"after step {step}: ram step {kept}")
    finally:
        s.close()


def test_a_new_job_prefaults_its_first_save_when_told_the_size(shm_root):
    s = open_store(shm_root, keep=2)
    try:
        state = step_state(1)
        with pytest.raises(tiercel.InvalidArgumentError, match="byte count"):
            s.prefault(-1)
        s.prefault(sum(v.nbytes for v in state.values()))
        s.flush()
        pooled = my_pool(shm_root)
        assert len(pooled) == 1, "one segment, faulted in before the first save"
        s.save(1, state).wait(60)
        assert part_inode(shm_root, 1) in pooled.values(), "the first save wrote into the pre-faulted segment"
        assert s.restore(1)["w"].tobytes() == state["w"].tobytes()
    finally:
        s.close()
