"""A memory tier on a tmpfs with huge pages (docs/config.md, "Huge pages"): the store sees the
mount option, the segments really are backed by 2 MiB pages, and steps round-trip through
them bit-identical; a root under /dev/shm (4 KiB pages) says so too. On huge pages read_into
copies out of the mapped object, each chunk verified as it lands: whole items, ranges cut
inside chunks, and a bad chunk read from the disk tier (or an error naming it)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tiercel

from conftest import assert_same, chunk_location, flip_byte, random_numpy


@pytest.fixture
def huge_tmpfs():
    where = Path(tempfile.mkdtemp(prefix="tiercel-test-huge-"))
    mount = ["mount", "-t", "tmpfs", "-o", "huge=within_size,size=256m,mode=0700", "tiercel-test", str(where)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        shutil.rmtree(where)
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
        shutil.rmtree(where)


def shmem_huge_bytes() -> int:
    """Shared memory the kernel backs by huge pages, host-wide (/proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no ShmemHugePages in /proc/meminfo")


def policy(ram: Path, disk: Path) -> dict:
    return {
        "tier": [
            {"name": "ram", "kind": "memory", "root": str(ram), "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(disk), "keep": 1},
        ],
        "store": {"chunk_size": "1MiB", "threads": 2, "io_threads": 2},
    }


def test_a_memory_tier_on_huge_pages(huge_tmpfs, tmp_path):
    state = {"w": random_numpy(np.float32, (4 << 20,), 1), "b": random_numpy(np.int64, (1000,), 2)}
    before = shmem_huge_bytes()
    store = tiercel.Store(policy(huge_tmpfs / "ram", tmp_path / "disk"), rank=0, world_size=1)
    try:
        assert store.tiers()[0]["huge_pages"] == "huge=within_size"
        for step in (1, 2, 3):
            state["w"][step] = step
            store.save(step, state).wait()
        # 16 MiB of data per step, two steps kept and one pre-faulted for the next save: most
        # of it in whole 2 MiB pages.
        assert shmem_huge_bytes() - before >= 32 << 20, (before, shmem_huge_bytes())
        assert_same(store.restore(3), state)
        assert store.last_restore.tiers == {"ram": 2}
    finally:
        store.close()


def test_read_into_from_huge_pages_verifies_every_chunk(huge_tmpfs, tmp_path):
    w = random_numpy(np.float32, (3 << 20,), 3)  # 12 MiB: 12 chunks of 1 MiB
    store = tiercel.Store(policy(huge_tmpfs / "ram", tmp_path / "disk"), rank=0, world_size=1)
    try:
        assert store.save(1, {"w": w}).wait(60) == {"ram": "committed", "disk": "committed"}
        want = w.view(np.uint8)
        r = store.reader(1)
        out = np.empty_like(w)
        r.read_into("w", out)
        assert np.array_equal(out.view(np.uint8), want)
        for start, n in ((0, 1), ((1 << 20) - 3, 7), (12345, 5 << 20), (len(want) - 5, 5)):
            got = np.full(n, 0xAA, dtype=np.uint8)
            r.read_into("w", got, start=start)
            assert np.array_equal(got, want[start:start + n]), (start, n)
        assert set(r.info.tiers) == {"ram"}
        path, off, _ = chunk_location(huge_tmpfs / "ram", 1, "w", chunk=5)
        flip_byte(path, off + 99)
        r = store.reader(1)
        out = np.empty_like(w)
        r.read_into("w", out)
        assert np.array_equal(out.view(np.uint8), want)
        assert r.info.tiers == {"ram+disk": 1}
        assert any("chunk 5" in m and "disk" in m for m in r.info.warnings), r.info.warnings
        with pytest.raises(tiercel.IntegrityError, match=r"'w'.*chunk 5"):
            store.reader(1, tiers=["ram"]).read_into("w", out)
    finally:
        store.close()


def test_dev_shm_says_it_has_small_pages(shm_root, tmp_path):
    store = tiercel.Store(policy(shm_root, tmp_path / "disk"), rank=0, world_size=1)
    try:
        assert store.tiers()[0]["huge_pages"] is None
        assert [t.get("huge_pages", "absent") for t in store.tiers()[1:]] == ["absent"]
    finally:
        store.close()
