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

# Errors cross process boundaries (DCP pickles each rank's exception to its coordinator, and
# raises them all there): they pickle by reference to the names they are public under.
for _cls in (CapacityError, ConfigError, IntegrityError, InvalidArgumentError, NotFoundError, TiercelError,
             TierUnavailableError):
    _cls.__module__ = "tiercel"

__all__ = [
    "CapacityError",
    "ConfigError",
    "IntegrityError",
    "InvalidArgumentError",
    "NotFoundError",
    "TiercelError",
    "TierUnavailableError",
]
