"""tiercel: a tiered checkpoint store for distributed training.

    store = tiercel.Store.open("tiercel.toml")
    handle = store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    state = store.restore()
"""

from ._core import (
    FORMAT_VERSION,
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    TiercelError,
    TierUnavailableError,
)
from .coordinator import Coordinator, LocalCoordinator, TorchCoordinator
from .store import Reader, RestoreInfo, SaveHandle, Store, Writer

__all__ = [
    "FORMAT_VERSION",
    "CapacityError",
    "ConfigError",
    "Coordinator",
    "IntegrityError",
    "InvalidArgumentError",
    "LocalCoordinator",
    "NotFoundError",
    "Reader",
    "RestoreInfo",
    "SaveHandle",
    "Store",
    "TiercelError",
    "TierUnavailableError",
    "TorchCoordinator",
    "Writer",
]
__version__ = "0.1.0"
