"""jax.Array leaves in tiercel's leaf registry (framework "jax").

A sharded jax.Array is stored as one item per distinct shard this process holds: a `JaxShard`
(one device's piece, with the global shape and its offsets in it), which the manifest keeps
with the item as its `Shard`. A jax.Array that lives wholly in this process (one device, or
fully replicated) can also be put into a plain `Store.save`: it is stored whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .. import _dtypes
from ..leaves import Leaf, LeafHandler, register
from ..manifest import Item, Shard


@dataclass(frozen=True)
class JaxShard:
    """One device's piece of a global jax.Array: the box starting at `offsets`, of the
    shape of `data` (a single-device jax.Array, or its bytes on the host as a numpy array)."""

    data: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replica_id: int = 0


def dtype_name(dtype: Any, what: str) -> str:
    """tiercel's name for a JAX dtype; a TypeError naming `what` for those it cannot store."""
    name = _dtypes.numpy_name(np.dtype(dtype))
    if name is None:
        raise TypeError(f"'{what}': dtype {dtype} cannot be stored (supported: {', '.join(_dtypes.ITEMSIZE)})")
    return name


def on_host(x: Any) -> bool:
    """Whether a jax.Array's buffers are host memory (CPU devices): no transfer to wait for."""
    return all(d.platform == "cpu" for d in x.devices())


class JaxHandler(LeafHandler):
    framework = "jax"

    def claims(self, value: Any) -> bool:
        return isinstance(value, (JaxShard, jax.Array))

    def describe(self, value: Any, name: str) -> Leaf:
        if isinstance(value, JaxShard):
            data = value.data
            shard = Shard(tuple(value.global_shape), tuple(value.offsets), value.replica_id)
        else:
            if not value.is_fully_addressable:
                raise TypeError(
                    f"'{name}' is a jax.Array sharded over several processes: save it with tiercel.orbax's "
                    "TiercelCheckpointHandler, which stores each process's shards"
                )
            data, shard = value, None
        if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
            raise TypeError(f"'{name}' is a typed PRNG key array; save jax.random.key_data(key) instead")
        dtype = dtype_name(data.dtype, name)
        nbytes = int(data.size) * np.dtype(data.dtype).itemsize
        return Leaf(name, "array", dtype, tuple(data.shape), nbytes, {"framework": "jax"}, data, shard=shard, handler=self)

    def host_address(self, leaf: Leaf) -> tuple[int, Any] | None:
        # On CPU devices np.asarray is a view of the device buffer: the core copies it with
        # the GIL released. Other devices go through copy_into (one device-to-host copy).
        x = leaf.obj
        if not isinstance(x, np.ndarray) and not (on_host(x) and len(x.devices()) == 1):
            return None
        arr = np.asarray(x)
        if not arr.flags.c_contiguous:
            return None
        return arr.__array_interface__["data"][0], arr

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        arr = np.asarray(leaf.obj)  # the device-to-host transfer (started early by the caller)
        dst = np.frombuffer(segment, dtype=arr.dtype, count=arr.size, offset=offset).reshape(arr.shape)
        np.copyto(dst, arr)

    def rebuild(self, item: Item, buf: Any) -> Any:
        """A shard comes back as the numpy array of its own box; a whole array as a
        jax.Array on the default device."""
        dt = _dtypes.numpy_dtype(item.dtype)
        arr = np.empty(item.shape, dtype=dt) if item.nbytes == 0 else np.frombuffer(buf, dtype=dt).reshape(item.shape)
        return arr if item.shard is not None else jax.numpy.asarray(arr)


HANDLER = JaxHandler()
register(HANDLER)
