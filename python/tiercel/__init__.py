"""tiercel: a tiered checkpoint store for distributed training.

    store = tiercel.Store.open("tiercel.toml")
    handle = store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    state = store.restore()
"""

from . import exports, metrics
from ._core import FORMAT_VERSION
from .coordinator import Coordinator, JaxCoordinator, KVStoreCoordinator, LocalCoordinator, TorchCoordinator
from .errors import (
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    TiercelError,
    TierUnavailableError,
    WorldSizeError,
)
from .leaves import Leaf, LeafHandler, Sharded, register_leaf_handler
from .manifest import Item, Manifest, Shard
from .preempt import PreemptReport, TierReport
from .step import Reader, RestoreInfo, SaveHandle, Writer
from .store import Store

__all__ = [
    "FORMAT_VERSION",
    "CapacityError",
    "ConfigError",
    "Coordinator",
    "IntegrityError",
    "InvalidArgumentError",
    "Item",
    "JaxCoordinator",
    "KVStoreCoordinator",
    "Leaf",
    "LeafHandler",
    "LocalCoordinator",
    "Manifest",
    "NotFoundError",
    "PreemptReport",
    "Reader",
    "RestoreInfo",
    "SaveHandle",
    "Shard",
    "Sharded",
    "Store",
    "TiercelError",
    "TierReport",
    "TierUnavailableError",
    "TorchCoordinator",
    "WorldSizeError",
    "Writer",
    "exports",
    "metrics",
    "register_leaf_handler",
]
__version__ = "0.1.0"
