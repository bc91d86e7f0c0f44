"""tiercel's exceptions (re-exported as tiercel.TiercelError and its kinds)."""

from ._core import (
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    TiercelError,
    TierUnavailableError,
)

__all__ = [
    "CapacityError",
    "ConfigError",
    "IntegrityError",
    "InvalidArgumentError",
    "NotFoundError",
    "TiercelError",
    "TierUnavailableError",
]
