"""The chaos saver's step states, importable without the test suite's helpers (which pull
in torch: seconds per saver start, hundreds of starts per campaign)."""

from __future__ import annotations

from typing import Any

import numpy as np


def state(step: int, nbytes: int) -> dict[str, Any]:
    """A step's state, a function of the step number only (about `nbytes` bytes)."""
    rng = np.random.default_rng(step)
    return {
        "model": {"w": rng.standard_normal(nbytes // 8).astype(np.float32), "b": np.full(1000, step, np.int64)},
        "optim": {"m": rng.integers(0, 256, nbytes // 2, dtype=np.uint8), "step": step},
    }
