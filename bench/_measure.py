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
