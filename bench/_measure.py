"""What the benchmarks share: timing and cold-cache set-up."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable


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
