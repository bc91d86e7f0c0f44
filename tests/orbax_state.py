"""The train state's global values in tests/test_orbax.py, numpy only: importable by a check
that must not import tiercel (or JAX)."""

from __future__ import annotations

import numpy as np

ROWS, COLS = 256, 512  # the matrix: 512 KiB of float32, 128 KiB per shard on a 2x2 mesh


def global_values(step: int) -> dict[str, np.ndarray]:
    """The global arrays of the train state at `step` (the same in every process)."""
    w = (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1000.0 * step) / 7.0
    b = np.arange(COLS, dtype=np.float32) * step - 0.5
    return {"w": w, "b": b, "scale": np.float32(0.25 * step)}
