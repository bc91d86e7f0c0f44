"""What the benchmarks share: timing and cold-cache set-up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator


def median_time(fn: Callable[[], object], repeat: int) -> tuple[float, list[float]]:
    """Median wall time of `repeat` calls, and every sample. What a call returns is released
    after its clock stops: freeing a restored state (unmapping its views, freeing its
    tensors) is not part of restoring it, as freeing memcpy's destination is not part of
    the copy."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times), times


def settle_memory(seconds: float = 3.0) -> None:
    """Waits before a timed operation until the memory the last one freed is cold again. On
    a VM whose balloon reports free memory to its host (free page reporting, as on the VM
    docs/performance.md was measured on), free 2 MiB blocks are handed back within 2-3 s and
    the host must back them again on first touch. Without the wait, a method timed right
    after another's free runs on warm memory: 256 MiB touched in 14 ms 0-1 s after a free,
    437-658 ms after 3-30 s. With it every timed operation starts on cold memory, as after a
    restart. Elsewhere the wait changes nothing but the run's length."""
    time.sleep(seconds)


def drop_page_cache() -> bool:
    """Drops the page cache, for cold reads; only root on a kernel that allows it can."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def write_results(path: str, out: dict) -> None:
    """Writes a benchmark's results (bench/results/*.json) and says where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")


@contextlib.contextmanager
def huge_tmpfs(size_bytes: int) -> Iterator[Path | None]:
    """A tmpfs mounted with huge=within_size (2 MiB pages, docs/config.md "Huge pages") in
    a temporary directory, unmounted on exit; None where this process cannot mount (not
    root, or no such kernel support)."""
    where = Path(tempfile.mkdtemp(prefix="tiercel-bench-huge-"))
    size = f"{(size_bytes >> 20) + 64}m"
    cmd = ["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={size},mode=0700", "tiercel-bench", str(where)]
    mounted = subprocess.run(cmd, capture_output=True).returncode == 0
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def map_and_read_once(root: Path, nbytes: int, repeat: int) -> tuple[tuple[float, list[float]], tuple[float, list[float]]]:
    """The physical limit of a restore from RAM that copies nothing and verifies every byte:
    map the pages of a stored file (MADV_POPULATE_READ: page-table entries, no copy) and read
    each byte once (an XOR over them), both on every core. Returns (median, samples) of each
    part. The file is written under `root`, so its pages are backed as the memory tier's are
    (4 KiB or huge pages); freeing the mapping is not timed, as in `median_time`."""
    import ctypes
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes releases the GIL: one call per core
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    populate_read = 22  # MADV_POPULATE_READ, Linux 5.14
    n = os.cpu_count() or 1
    nbytes = nbytes // (4096 * n) * 4096 * n  # whole pages per core
    cuts = [(i * nbytes // n, (i + 1) * nbytes // n) for i in range(n)]
    path = root / "map-and-read-once.bin"
    root.mkdir(parents=True, exist_ok=True)
    maps, reads = [], []
    with ThreadPoolExecutor(n) as pool:
        try:
            with open(path, "wb") as f:  # written, as a stored step is: no holes
                block = np.arange(1 << 20, dtype=np.uint64).tobytes()  # 8 MiB
                for at in range(0, nbytes, len(block)):
                    f.write(block[: nbytes - at])
            with open(path, "r+b") as f:
                for _ in range(repeat):
                    m = mmap.mmap(f.fileno(), nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                    words = np.frombuffer(m, np.uint64)
                    base = words.ctypes.data
                    t0 = time.perf_counter()
                    if any(pool.map(lambda c: madvise(base + c[0], c[1] - c[0], populate_read), cuts)):
                        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ) failed: Linux 5.14 or later needed")
                    maps.append(time.perf_counter() - t0)
                    slices = [words[a // 8 : b // 8] for a, b in cuts]
                    t0 = time.perf_counter()
                    list(pool.map(np.bitwise_xor.reduce, slices))
                    reads.append(time.perf_counter() - t0)
                    del words, slices  # the mapping closes only once no array holds it
                    m.close()
        finally:
            path.unlink(missing_ok=True)
    return (statistics.median(maps), maps), (statistics.median(reads), reads)
