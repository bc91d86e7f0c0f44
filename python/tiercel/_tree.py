"""Flattening a state (nested dicts/lists/tuples of arrays, tensors, bytes and scalars) into
items plus a JSON tree, and building it back.

Small Python values (ints, floats, strings, bools, None) and containers stay in the tree,
which goes into the manifest; every other value is a leaf, which the first leaf handler
that claims it (tiercel.leaves: numpy, torch, bytes, adapters' types, else pickle) turns
into an item.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from .leaves import Leaf


def _scalar(v: Any) -> dict | None:
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


#: How deep a value may nest (dicts, lists, tuples): each level is two JSON levels of the
#: tree, which sits inside the manifest, and the core's JSON reader stops at 128.
MAX_DEPTH = 48

#: Exact types that are tree scalars. Subclasses (IntEnum, np.float64) are leaves: a handler
#: (numpy) or the pickle fallback keeps their type.
_SCALARS = (type(None), bool, int, float, str)


class Flattener:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.leaves: list[Leaf] = []
        self._names: set[str] = set()
        self._active: set[int] = set()  # ids of the containers on the current path

    def _name(self, path: list[str]) -> str:
        base = "/".join([self.prefix, *path])
        name, n = base, 1
        while name in self._names:  # keys 1 and "1" must not collide
            n += 1
            name = f"{base}#{n}"
        self._names.add(name)
        return name

    def _display(self, path: list[str]) -> str:
        return "/".join([self.prefix, *path])

    def node(self, v: Any, path: list[str]) -> dict:
        from .leaves import handler_for

        if len(path) > MAX_DEPTH:
            raise TypeError(f"'{self._display(path[:4])}/...' is nested more than {MAX_DEPTH} levels deep; "
                            "flatten it (the manifest's JSON reader has a depth limit)")
        if type(v) in _SCALARS:
            s = _scalar(v)
            assert s is not None
            return s
        if type(v) in _CONTAINERS or isinstance(v, tuple):
            if id(v) in self._active:
                raise TypeError(f"'{self._display(path)}' contains itself (a cycle); a checkpoint must be a tree")
            self._active.add(id(v))
            try:
                return self._container(v, path)
            finally:
                self._active.discard(id(v))
        handler = handler_for(v)
        leaf = handler.describe(v, self._name(path))
        leaf.handler = handler
        self.leaves.append(leaf)
        return {"t": "item", "i": len(self.leaves) - 1}

    def _container(self, v: Any, path: list[str]) -> dict:
        if isinstance(v, dict):
            keys = []
            for k, x in v.items():
                ks = _scalar(k) if type(k) in _SCALARS else None
                if ks is None:
                    raise TypeError(f"'{self._display(path)}' has a key of type {type(k).__name__}; keys must be str, int, float, bool or None")
                keys.append([ks, self.node(x, [*path, str(k)])])
            node: dict[str, Any] = {"t": "dict", "v": keys}
            if type(v) is OrderedDict:
                node["c"] = "OrderedDict"  # torch state_dict()s are OrderedDicts
            return node
        kind = "list" if isinstance(v, list) else "tuple"
        node = {"t": kind, "v": [self.node(x, [*path, str(i)]) for i, x in enumerate(v)]}
        if kind == "tuple" and type(v) is not tuple:
            # namedtuple, torch.Size: the class is recorded and rebuilt when importable.
            node["c"] = f"{type(v).__module__}:{type(v).__qualname__}"
        return node


#: Containers kept as tree structure, besides tuples and their subclasses. Other dict and
#: list subclasses (defaultdict, ...) are leaves, so the pickle fallback keeps their type.
_CONTAINERS = (dict, OrderedDict, list)


def _tuple_class(path: str) -> type | None:
    """The tuple subclass a tree recorded ("collections:Point"), if it can be imported here.
    Only tuple subclasses are ever called: a manifest cannot name an arbitrary callable."""
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, tuple) else None


def flatten(prefix: str, value: Any) -> tuple[dict, list[Leaf]]:
    f = Flattener(prefix)
    return f.node(value, []), f.leaves


def unflatten(node: dict, items: Mapping[int, Any] | Sequence[Any]) -> Any:
    """Rebuilds a tree; `items[i]` is the restored value of item reference i."""
    t = node["t"]
    if t == "item":
        return items[node["i"]]
    if t == "dict":
        d = {_unscalar(k): unflatten(v, items) for k, v in node["v"]}
        return OrderedDict(d) if node.get("c") == "OrderedDict" else d
    if t == "list":
        return [unflatten(v, items) for v in node["v"]]
    if t == "tuple":
        vals = tuple(unflatten(v, items) for v in node["v"])
        cls = _tuple_class(node["c"]) if "c" in node else None
        if cls is None:
            return vals
        return cls(*vals) if hasattr(cls, "_fields") else cls(vals)
    return _unscalar(node)


def tree_items(node: dict) -> list[int]:
    """The item references in a tree, in order."""
    t = node["t"]
    if t == "item":
        return [node["i"]]
    if t == "dict":
        return [i for _, v in node["v"] for i in tree_items(v)]
    if t in ("list", "tuple"):
        return [i for v in node["v"] for i in tree_items(v)]
    return []
