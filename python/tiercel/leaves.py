"""Leaf handlers: how a value that is not tree structure (an array, a tensor, a byte string)
becomes an item and comes back.

One handler per framework, tried in registration order (newest first); the first whose
`claims` says yes describes the value. The manifest records the handler's `framework` name
in the item's meta, and the same handler rebuilds the item on restore. numpy, torch, bytes and
the pickle fallback are built in; adapters register theirs (tiercel.orbax adds jax.Array).

    class MyHandler(LeafHandler):
        framework = "mylib"
        def claims(self, value): return isinstance(value, mylib.Array)
        def describe(self, value, name): return Leaf(name, "array", "float32", ..., handler=self)
        def rebuild(self, item, buf): return mylib.from_buffer(buf, item.dtype, item.shape)
    tiercel.leaves.register(MyHandler())

A sharded leaf (one piece of a global array) carries a `Shard` (global shape, offsets,
replica id), which the manifest keeps with the item so a restore can place it again. An
adapter's handler sets it (jax.Array); a plain `Store.save` says it with `Sharded(value,
global_shape, offsets)`, which `Store.restore(reshard=...)` reads back at any world size.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _dtypes
from ._plain import where
from .errors import InvalidArgumentError
from .manifest import Item, Shard

__all__ = ["PICKLE_MODE", "PICKLE_TRUSTED", "Leaf", "LeafHandler", "PickleWarning", "Shard", "Sharded", "check_unpickle",
           "handler_for", "rebuilder", "register", "register_leaf_handler"]


class PickleWarning(UserWarning):
    """A value was stored by pickling it: no zero-copy restore, and unpickling runs code."""


#: The policy's `[store] pickle` for the put being flattened in this thread or task ("warn",
#: "error" or "allow"): set by the Writer, read by the pickle fallback.
PICKLE_MODE: ContextVar[str] = ContextVar("tiercel_pickle_mode", default="warn")
#: Whether the put being flattened is restored by a reader that unpickles it whatever the
#: policy says (`Writer.prepare(trust_pickles=True)`: an adapter whose framework unpickles its
#: own objects, as DeepSpeed's torch.load does). Under "warn" such a put may be pickled.
PICKLE_TRUSTED: ContextVar[bool] = ContextVar("tiercel_pickle_trusted", default=False)


def check_unpickle(item: Item, mode: str, step: int, rank: int) -> None:
    """Restores unpickle only where the policy says `[store] pickle = "allow"`: unpickling runs
    code chosen by whoever wrote the checkpoint."""
    if item.framework == "pickle" and mode != "allow":
        raise InvalidArgumentError(
            f"step {step} rank {rank} item '{item.name}' is a pickled {item.meta.get('class', 'object')}; unpickling "
            f"runs code chosen by whoever wrote the checkpoint, so it is refused under [store] pickle = \"{mode}\": set "
            "pickle = \"allow\" in the policy for checkpoints you trust (Reader.read() returns the item's bytes either way)",
            step=step, rank=rank, item=item.name)


@dataclass
class Leaf:
    """One item to store: what the manifest records, and the object to copy from."""

    name: str
    kind: str  # "array" or "bytes"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    meta: dict[str, Any]
    #: What the bytes are copied from: an ndarray, a tensor, a bytes-like object.
    obj: Any
    shard: Shard | None = None
    handler: LeafHandler | None = field(default=None, repr=False, compare=False)


class LeafHandler:
    """Turns one kind of value into a Leaf and back. Subclasses set `framework` and implement
    `claims`, `describe` and `rebuild`; `host_address` and `copy_into` have defaults for
    objects that export the buffer protocol."""

    #: Recorded in every item this handler writes (meta["framework"]); selects the rebuilder.
    framework: str = ""

    def claims(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self, value: Any, name: str) -> Leaf:
        """The item for `value`. Raise TypeError with a message naming `name` for values of
        this type that cannot be stored."""
        raise NotImplementedError

    def host_address(self, leaf: Leaf) -> tuple[int, Any] | None:
        """(address, owner) when the leaf's bytes lie contiguous in host memory: the core then
        copies them on its threads with the GIL released. `owner` is kept alive meanwhile.
        None makes the store call `copy_into` instead."""
        mv = memoryview(leaf.obj)
        if not mv.c_contiguous:
            return None
        arr = np.frombuffer(mv, dtype=np.uint8)
        return arr.__array_interface__["data"][0], (arr, mv)

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        """Copies the leaf into `segment` (a writable buffer) at `offset`: one copy, made by the
        framework (device-to-host, or a strided gather)."""
        dst = np.frombuffer(segment, dtype=np.uint8, count=leaf.nbytes, offset=offset)
        np.copyto(dst, np.frombuffer(memoryview(leaf.obj).tobytes(), dtype=np.uint8))

    def rebuild(self, item: Item, buf: Any) -> Any:
        """The value back from the item's bytes (`buf` supports the buffer protocol; it may be
        a zero-copy view over shared memory)."""
        raise NotImplementedError


def _torch() -> Any:
    """torch if this process has imported it: a value can only be a tensor then, and a
    numpy-only job (or the CLI) never pays for importing torch."""
    return sys.modules.get("torch")


class NumpyHandler(LeafHandler):
    framework = "numpy"

    def claims(self, value: Any) -> bool:
        return isinstance(value, (np.ndarray, np.generic)) and _dtypes.numpy_name(np.asarray(value).dtype) is not None

    def describe(self, value: Any, name: str) -> Leaf:
        if isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"'{name}' is a numpy masked array; save its .data and .mask separately")
        if isinstance(value, np.matrix):
            raise TypeError(f"'{name}' is a numpy matrix, which would come back a plain array; save np.asarray(it)")
        arr = np.asarray(value)
        dtype = _dtypes.numpy_name(arr.dtype)
        assert dtype is not None
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        meta: dict[str, Any] = {"framework": "numpy"}
        if isinstance(value, np.generic):
            meta["scalar"] = True
        return Leaf(name, "array", dtype, tuple(arr.shape), arr.nbytes, meta, arr, handler=self)

    def host_address(self, leaf: Leaf) -> tuple[int, Any] | None:
        arr = leaf.obj
        return (arr.__array_interface__["data"][0], arr) if arr.flags.c_contiguous else None

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        arr = leaf.obj
        np.copyto(np.frombuffer(segment, dtype=arr.dtype, count=arr.size, offset=offset).reshape(arr.shape), arr)

    def rebuild(self, item: Item, buf: Any) -> Any:
        dt = _dtypes.numpy_dtype(item.dtype)
        arr = np.empty(item.shape, dtype=dt) if item.nbytes == 0 else np.frombuffer(buf, dtype=dt).reshape(item.shape)
        return arr[()] if item.meta.get("scalar") else arr


class TorchHandler(LeafHandler):
    framework = "torch"

    def claims(self, value: Any) -> bool:
        torch = _torch()
        return torch is not None and isinstance(value, torch.Tensor)

    def describe(self, value: Any, name: str) -> Leaf:
        torch = _torch()
        t = value
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"item '{name}': {t.layout} tensors are not supported; convert with .to_dense()")
        if t.device.type == "meta":
            raise TypeError(f"item '{name}' is a tensor on device 'meta', which holds no data to save")
        if t.is_quantized:
            raise TypeError(f"item '{name}': quantized tensors are not supported; dequantize first")
        dtype = _dtypes.torch_name(t.dtype)
        if dtype not in _dtypes.ITEMSIZE:
            # Not in the format (docs/format.md, Dtypes): sub-byte, packed or bit types.
            raise TypeError(f"item '{name}': torch dtype {dtype} cannot be stored; store t.view(torch.uint8) "
                            "and its dtype name beside it")
        meta: dict[str, Any] = {"framework": "torch", "device": str(t.device)}
        if t.requires_grad:
            meta["requires_grad"] = True
        data = t.detach()
        # A lazily conjugated or negated view (`z.conj()`, `x._neg_view()`) shares its data
        # with the original and only carries a flag: its bytes are not its values.
        if data.is_conj():
            data = data.resolve_conj()
        if data.is_neg():
            data = data.resolve_neg()
        nbytes = t.numel() * t.element_size()
        return Leaf(name, "array", dtype, tuple(t.shape), nbytes, meta, data, handler=self)

    def host_address(self, leaf: Leaf) -> tuple[int, Any] | None:
        t = leaf.obj
        return (t.data_ptr(), t) if t.device.type == "cpu" and t.is_contiguous() else None

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        # One copy straight into shared memory: a single device-to-host transfer for a GPU
        # tensor, a strided gather for a non-contiguous one.
        torch = _torch()
        t = leaf.obj
        dst = torch.frombuffer(segment, dtype=torch.uint8, count=leaf.nbytes, offset=offset)
        dst.view(t.dtype).view(t.shape).copy_(t)

    def rebuild(self, item: Item, buf: Any) -> Any:
        try:
            import torch
        except ImportError:
            raise InvalidArgumentError(f"item '{item.name}' is a torch tensor; install torch to restore it") from None
        tdt = _dtypes.torch_dtype(item.dtype)
        if item.nbytes == 0:
            t = torch.empty(item.shape, dtype=tdt)
        else:
            t = torch.frombuffer(buf, dtype=torch.uint8).view(tdt).reshape(item.shape)
        if item.meta.get("requires_grad"):
            t.requires_grad_(True)
        return t


@dataclass(frozen=True)
class Sharded:
    """`value` (a numpy array or a torch tensor) saved as one piece of a larger, global array:
    the box of `value`'s shape at `offsets` of an array of `global_shape`. Copies of one box
    on data-parallel replicas differ in `replica_id`. `store.save(step, {"w": Sharded(w_rows,
    (4096, 1024), (rank * 1024, 0))})`; a job at another world size reads back the boxes it
    wants with `store.restore(reshard=...)` (tiercel.reshard). Restores give the array back,
    without the wrapper."""

    value: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replica_id: int = 0


class ShardedHandler(LeafHandler):
    """`Sharded` values: the wrapped value's own handler describes and copies it, and its
    item carries the shard. It writes no items of its own (the item names the wrapped
    value's framework, which rebuilds it)."""

    framework = "sharded"

    def claims(self, value: Any) -> bool:
        return isinstance(value, Sharded)

    def describe(self, value: Any, name: str) -> Leaf:
        inner = handler_for(value.value)
        if inner.framework not in ("numpy", "torch"):
            raise TypeError(f"'{name}': Sharded wraps a numpy array or a torch tensor, got {type(value.value).__name__}")
        leaf = inner.describe(value.value, name)
        try:
            shape, offsets = tuple(int(n) for n in value.global_shape), tuple(int(o) for o in value.offsets)
        except (TypeError, ValueError):
            raise TypeError(f"'{name}': Sharded's global_shape and offsets are sequences of ints, got "
                            f"{value.global_shape!r} and {value.offsets!r}") from None
        if len(shape) != len(leaf.shape) or len(offsets) != len(leaf.shape) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, leaf.shape, shape)):
            raise TypeError(f"'{name}': a piece of shape {leaf.shape} at offsets {offsets} does not lie inside the "
                            f"global shape {shape} (one offset and one global size per dimension of the piece)")
        leaf.shard = Shard(shape, offsets, int(value.replica_id))
        return leaf

    # The leaf's object is the wrapped value's data: its own handler copies it.
    def host_address(self, leaf: Leaf) -> tuple[int, Any] | None:
        return handler_for(leaf.obj).host_address(leaf)

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        handler_for(leaf.obj).copy_into(leaf, segment, offset)


class BytesHandler(LeafHandler):
    """bytes, bytearray and memoryview: stored as they are, rebuilt as the same type (a
    memoryview comes back as bytes)."""

    framework = "bytes"

    def claims(self, value: Any) -> bool:
        return isinstance(value, (bytes, bytearray, memoryview))

    def describe(self, value: Any, name: str) -> Leaf:
        mv = memoryview(value).cast("B")
        # Format version 1 names byte items by "type", without "framework".
        return Leaf(name, "bytes", "uint8", (mv.nbytes,), mv.nbytes, {"type": type(value).__name__}, mv, handler=self)

    def rebuild(self, item: Item, buf: Any) -> Any:
        data = bytes(memoryview(buf)) if item.nbytes else b""
        return bytearray(data) if item.meta.get("type") == "bytearray" else data


class PickleHandler(LeafHandler):
    """The fallback for values no other handler claims and the tree cannot hold. Pickled
    values get no zero-copy restore and no compression, and unpickling runs code: a save
    pickles only where the restore will unpickle (`[store] pickle = "allow"`, or a trusted
    adapter's put under "warn"), and refuses the value, naming it, everywhere else."""

    framework = "pickle"

    def claims(self, value: Any) -> bool:
        return True

    def describe(self, value: Any, name: str) -> Leaf:
        cls = type(value)
        what = f"{where(name)}: {cls.__module__}.{cls.__qualname__}"
        if isinstance(value, (np.ndarray, np.generic)):  # a dtype the format has no name for
            what += f" of dtype {value.dtype}"
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"{what} cannot be stored: it is none of the types tiercel stores (docs/api.md, What can "
                            f"be stored), and pickling it failed: {e}") from None
        mode = PICKLE_MODE.get()
        if mode == "error":
            raise TypeError(f"{what} can only be stored by pickling it, which the policy forbids ([store] pickle = "
                            "\"error\"); convert it to arrays, tensors or plain Python values, or register a leaf handler")
        if mode == "warn" and not PICKLE_TRUSTED.get():
            # A restore under this policy would refuse to unpickle it (check_unpickle): a
            # checkpoint that cannot be restored is refused now, not found out at the restore.
            raise TypeError(f"{what} can only be stored by pickling it, and restores refuse to unpickle under "
                            "[store] pickle = \"warn\" (the default), so the step could not be restored: convert it "
                            "to a type tiercel stores (docs/api.md, What can be stored: arrays, tensors, bytes, plain "
                            "Python values, sets, enums, dataclasses, named tuples, datetimes, paths; vars(namespace) "
                            "for an argparse Namespace), register a leaf handler, or set pickle = \"allow\" in the "
                            "policy for checkpoints you trust")
        if mode == "warn":
            warnings.warn(f"{what} is stored by pickling it (no zero-copy restore; this writer's reader unpickles it)",
                          PickleWarning, stacklevel=6)
        return Leaf(name, "bytes", "uint8", (len(data),), len(data), {"type": "pickle", "class": cls.__qualname__},
                    data, handler=self)

    def rebuild(self, item: Item, buf: Any) -> Any:
        return pickle.loads(bytes(memoryview(buf)) if item.nbytes else b"")


_PICKLE = PickleHandler()
#: Claim order: newest registration first, so an adapter can take over a type.
_handlers: list[LeafHandler] = [ShardedHandler(), TorchHandler(), NumpyHandler(), BytesHandler()]
#: Frameworks whose handler lives in an adapter module, imported when an item needs it.
_LAZY = {"jax": "tiercel.orbax"}


def register(handler: LeafHandler, *, first: bool = True) -> None:
    """Adds a handler (replacing one of the same framework). `first`: tried before the
    others, so it can claim values another handler would also take."""
    if not handler.framework:
        raise InvalidArgumentError(f"{type(handler).__name__} has no `framework` name")
    _handlers[:] = [h for h in _handlers if h.framework != handler.framework]
    _handlers.insert(0 if first else len(_handlers), handler)


def handler_for(value: Any) -> LeafHandler:
    """The handler that stores `value`: the first registered one that claims it, else the
    pickle fallback."""
    for h in _handlers:
        if h.claims(value):
            return h
    return _PICKLE


def rebuilder(item: Item) -> LeafHandler:
    """The handler that rebuilds `item`, importing the adapter that provides it if needed."""
    fw = item.framework
    if fw == _PICKLE.framework:
        return _PICKLE
    for h in _handlers:
        if h.framework == fw:
            return h
    module = _LAZY.get(fw)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise InvalidArgumentError(f"item '{item.name}' was saved by the {fw} adapter ({module}), "
                                       f"which cannot be imported here: {e}") from None
        for h in _handlers:
            if h.framework == fw:
                return h
    raise InvalidArgumentError(f"item '{item.name}' was saved by a '{fw}' leaf handler that is not registered here; "
                               "import the module that registers it before restoring")


#: The public name (tiercel.register_leaf_handler).
register_leaf_handler = register
