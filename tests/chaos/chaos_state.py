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


def lora(step: int, nbytes: int) -> dict[str, Any]:
    """A LoRA-like step: a frozen base of about `nbytes` bytes, the same every step, and a small
    adapter that changes every step (what a dedup tier stores once, then refers to)."""
    base = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    rng = np.random.default_rng(1000 + step)
    return {"base": {"w": base}, "adapter": {"a": rng.standard_normal(4096).astype(np.float32), "step": step}}
