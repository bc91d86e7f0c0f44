"""One canonical dtype name per element type, shared by numpy and torch items.

The manifest stores these names, so a checkpoint written from torch can be inspected (and,
where numpy has the type, read) without torch, and the other way round.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Canonical name -> itemsize. numpy names where numpy has the type.
ITEMSIZE = {
    "bool": 1,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


def numpy_name(dtype: np.dtype) -> str | None:
    """Canonical name of a numpy dtype, or None when tiercel stores it as a pickled object
    (object, string, structured dtypes)."""
    name = dtype.name
    if name in ITEMSIZE and dtype.itemsize == ITEMSIZE[name]:
        return name
    return None


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype for a canonical name; bfloat16 and float8 need the ml_dtypes package."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)

        return np.dtype(getattr(ml_dtypes, name))
    except (ImportError, AttributeError):
        raise TypeError(
            f"numpy has no dtype '{name}'; install ml_dtypes, or restore this item as a torch tensor"
        ) from None


def torch_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"this torch has no dtype '{name}'")
    return dt
