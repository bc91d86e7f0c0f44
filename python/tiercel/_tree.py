"""Flattening a state (nested dicts/lists/tuples of arrays, tensors, bytes and scalars) into
items plus a JSON tree, and building it back.

Arrays, tensors and byte strings become items, stored in chunks; small Python values (ints,
floats, strings, bools, None) stay in the tree, which goes into the manifest. Other objects
are pickled into a byte item (DeepSpeed puts argparse namespaces and enums in its states).

Two container subclasses keep their class, because code reads it back: `OrderedDict` (every
torch `state_dict()`, with its `_metadata` attribute of module versions) and `torch.Size`
(DeepSpeed's `param_shapes`, on which `zero_to_fp32.py` calls `.numel()`). Any other subclass
of dict, list or tuple (a namedtuple, a defaultdict) is pickled whole, so it too comes back
as it was.
"""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _dtypes


def _torch() -> Any:
    """torch if this process has imported it: a value can only be a tensor then, and a
    numpy-only job (or the CLI) never pays for importing torch."""
    return sys.modules.get("torch")


@dataclass
class Leaf:
    """One item to store: what the manifest records, and the object to copy from."""

    name: str
    kind: str  # "array" or "bytes"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    meta: dict[str, Any]
    obj: Any  # np.ndarray, torch.Tensor or a bytes-like object
    extra: dict[str, Any] = field(default_factory=dict)


def _scalar(v: Any, exact: bool = False) -> dict | None:
    """The tree node of a small Python value, or None. `exact`: only the plain types, so that
    a subclass (an IntEnum such as DeepSpeed's ZeroStageEnum) is pickled and keeps its class;
    dict keys are taken by isinstance."""
    if exact and type(v) not in (type(None), bool, int, float, str):
        return None
    # bool before int: bool is an int subclass.
    if v is None:
        return {"t": "none"}
    if isinstance(v, bool):
        return {"t": "bool", "v": v}
    if isinstance(v, int):
        return {"t": "int", "v": str(v)}  # as text: JSON loses ints beyond 2**53
    if isinstance(v, float):
        return {"t": "float", "v": v.hex()}  # exact, and NaN/inf survive
    if isinstance(v, str):
        return {"t": "str", "v": v}
    return None


def _unscalar(node: dict) -> Any:
    t = node["t"]
    if t == "none":
        return None
    if t == "bool":
        return node["v"]
    if t == "int":
        return int(node["v"])
    if t == "float":
        return float.fromhex(node["v"])
    if t == "str":
        return node["v"]
    raise ValueError(f"not a scalar node: {t}")


class Flattener:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.leaves: list[Leaf] = []
        self._names: set[str] = set()

    def _name(self, path: list[str]) -> str:
        base = "/".join([self.prefix, *path])
        name, n = base, 1
        while name in self._names:  # keys 1 and "1" must not collide
            n += 1
            name = f"{base}#{n}"
        self._names.add(name)
        return name

    def _leaf(self, leaf: Leaf) -> dict:
        self.leaves.append(leaf)
        return {"t": "item", "i": len(self.leaves) - 1}

    def node(self, v: Any, path: list[str]) -> dict:
        # numpy scalars first: np.float64 and np.str_ subclass float and str, and would come
        # back as plain Python values.
        if isinstance(v, np.generic):
            leaf = self._array(v, path)
            if leaf is not None:
                return self._leaf(leaf)
            return self._pickled(v, path)
        s = _scalar(v, exact=True)
        if s is not None:
            return s
        torch = _torch()
        cls = _container_class(v, torch)
        if cls is None and isinstance(v, (dict, list, tuple)):
            return self._pickled(v, path)  # a subclass the tree cannot name
        if isinstance(v, dict):
            keys = []
            for k, x in v.items():
                ks = _scalar(k)
                if ks is None:
                    raise TypeError(f"'{self._display(path)}' has a key of type {type(k).__name__}; keys must be str, int, float, bool or None")
                keys.append([ks, self.node(x, [*path, str(k)])])
            node: dict[str, Any] = {"t": "dict", "v": keys}
            if cls == "OrderedDict":
                node["c"] = cls
                attrs = getattr(v, "__dict__", None)
                if attrs:  # torch's state_dict()._metadata
                    node["a"] = self.node(dict(attrs), [*path, "@attrs"])
            return node
        if isinstance(v, (list, tuple)):
            kind = "list" if isinstance(v, list) else "tuple"
            node = {"t": kind, "v": [self.node(x, [*path, str(i)]) for i, x in enumerate(v)]}
            if cls == "torch.Size":
                node["c"] = cls
            return node
        if torch is not None and isinstance(v, torch.Tensor):
            return self._leaf(self._tensor(v, path))
        if isinstance(v, np.ndarray) or isinstance(v, np.generic):
            leaf = self._array(v, path)
            if leaf is not None:
                return self._leaf(leaf)
        if isinstance(v, (bytes, bytearray, memoryview)):
            mv = memoryview(v).cast("B")
            return self._leaf(Leaf(self._name(path), "bytes", "uint8", (mv.nbytes,), mv.nbytes, {"type": type(v).__name__}, mv))
        return self._pickled(v, path)

    def _pickled(self, v: Any, path: list[str]) -> dict:
        data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        return self._leaf(Leaf(self._name(path), "bytes", "uint8", (len(data),), len(data), {"type": "pickle", "class": type(v).__qualname__}, data))

    def _display(self, path: list[str]) -> str:
        return "/".join([self.prefix, *path])

    def _array(self, v: Any, path: list[str]) -> Leaf | None:
        arr = np.asarray(v)
        name = _dtypes.numpy_name(arr.dtype)
        if name is None:
            return None  # object/str/structured: pickled by the caller
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        meta = {"framework": "numpy"}
        if isinstance(v, np.generic):
            meta["scalar"] = True
        return Leaf(self._name(path), "array", name, tuple(arr.shape), arr.nbytes, meta, arr)

    def _tensor(self, t: Any, path: list[str]) -> Leaf:
        name = self._name(path)
        if t.is_sparse or t.layout != _torch().strided:
            raise TypeError(f"item '{name}': {t.layout} tensors are not supported; convert with .to_dense()")
        if t.device.type == "meta":
            raise TypeError(f"item '{name}' is a tensor on device 'meta', which holds no data to save")
        if t.is_quantized:
            raise TypeError(f"item '{name}': quantized tensors are not supported; dequantize first")
        meta = {"framework": "torch", "device": str(t.device)}
        if t.requires_grad:
            meta["requires_grad"] = True
        data = t.detach()
        # A lazily conjugated or negated view (`z.conj()`, `x._neg_view()`) shares its data
        # with the original and only carries a flag: its bytes are not its values.
        if data.is_conj():
            data = data.resolve_conj()
        if data.is_neg():
            data = data.resolve_neg()
        return Leaf(name, "array", _dtypes.torch_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), meta, data)


def _container_class(v: Any, torch: Any) -> str | None:
    """The name a tree node gives the class of a dict/list/tuple: "" for the plain type,
    "OrderedDict" or "torch.Size" for the two subclasses the tree keeps, None for any other
    subclass (and for non-containers)."""
    t = type(v)
    if t in (dict, list, tuple):
        return ""
    if t is OrderedDict:
        return "OrderedDict"
    if torch is not None and t is torch.Size:
        return "torch.Size"
    return None


def flatten(prefix: str, value: Any) -> tuple[dict, list[Leaf]]:
    f = Flattener(prefix)
    return f.node(value, []), f.leaves


def unflatten(node: dict, items: list[Any]) -> Any:
    """Rebuilds a tree; `items[i]` is the restored value of item reference i."""
    t = node["t"]
    if t == "item":
        return items[node["i"]]
    if t == "dict":
        pairs = ((_unscalar(k), unflatten(v, items)) for k, v in node["v"])
        if node.get("c") == "OrderedDict":
            od: OrderedDict = OrderedDict(pairs)
            for name, value in unflatten(node["a"], items).items() if "a" in node else ():
                setattr(od, name, value)
            return od
        return dict(pairs)
    if t == "list":
        return [unflatten(v, items) for v in node["v"]]
    if t == "tuple":
        values = tuple(unflatten(v, items) for v in node["v"])
        if node.get("c") == "torch.Size":
            import torch  # a torch.Size was saved: the job that reads it has torch

            return torch.Size(values)
        return values
    return _unscalar(node)


def tree_items(node: dict) -> list[int]:
    """The item references in a tree, in order."""
    t = node["t"]
    if t == "item":
        return [node["i"]]
    if t == "dict":
        # Attributes ("a") are flattened after the entries: their items come last.
        return [i for _, v in node["v"] for i in tree_items(v)] + (tree_items(node["a"]) if "a" in node else [])
    if t in ("list", "tuple"):
        return [i for v in node["v"] for i in tree_items(v)]
    return []
