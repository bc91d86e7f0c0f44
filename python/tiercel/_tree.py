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


#: Node types a tree holds, and the scalar ones among them (dict keys are scalar nodes).
_SCALAR_TYPES = ("none", "bool", "int", "float", "str")
_NODE_TYPES = (*_SCALAR_TYPES, "item", "dict", "list", "tuple")

#: Python refuses to parse an int of more digits than this (sys.int_info's default limit).
_INT_DIGITS = 4300


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


#: How deep a value may nest (dicts, lists, tuples), so that flattening never meets Python's
#: recursion limit. The core's own limit is on the tree's JSON (format::MAX_TREE_DEPTH, 100
#: levels; a list is two of them, a dict three) and is checked at save as at read.
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
                attrs = getattr(v, "__dict__", None)
                if attrs:  # ... with a `_metadata` attribute (module versions, read by load_state_dict)
                    node["a"] = self.node(dict(attrs), [*path, "@attrs"])
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
    except Exception:  # not importable here (ImportError, an empty or odd name, a failing import)
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
        if node.get("c") != "OrderedDict":
            return d
        od = OrderedDict(d)
        for name, value in unflatten(node["a"], items).items() if "a" in node else ():
            setattr(od, name, value)
        return od
    if t == "list":
        return [unflatten(v, items) for v in node["v"]]
    if t == "tuple":
        vals = tuple(unflatten(v, items) for v in node["v"])
        cls = _tuple_class(node["c"]) if "c" in node else None
        if cls is None:
            return vals
        try:
            return cls(*vals) if hasattr(cls, "_fields") else cls(vals)
        except Exception as e:  # the class here differs from the one that saved the tree
            from .errors import IntegrityError

            raise IntegrityError(f"the tree's tuple class {node['c']} cannot be rebuilt from {len(vals)} values here: {e}") from None
    return _unscalar(node)


def check_tree(tree: Any, where: str) -> list[int]:
    """Checks a tree read from a manifest before anything uses it, and returns its item
    references in order (as `tree_items`). A tree that this module would not have written
    (a damaged or hand-edited manifest) is an IntegrityError naming `where` (step, rank,
    put) and the path in the tree, never a KeyError or TypeError later. The references must
    number the put's items 0..n-1, each once."""
    from .errors import IntegrityError

    refs: list[int] = []

    def bad(path: str, why: str) -> IntegrityError:
        return IntegrityError(f"{where}: the tree at '{path or '$'}' {why}; the manifest is damaged")

    def scalar(node: dict, path: str) -> None:
        t, v = node["t"], node.get("v")
        ok = (t == "none" or (t == "bool" and isinstance(v, bool)) or (t == "str" and isinstance(v, str))
              or (t in ("int", "float") and isinstance(v, str) and len(v) <= _INT_DIGITS))
        if ok and t in ("int", "float"):
            try:
                int(str(v)) if t == "int" else float.fromhex(str(v))
            except (ValueError, OverflowError):  # "0x1p+9999" overflows a float
                ok = False
        if not ok:
            raise bad(path, f"is a '{t}' node with the value {v!r:.60}")

    def walk(node: Any, path: str, depth: int) -> None:
        if depth > 2 * MAX_DEPTH + 8:
            raise bad(path, "nests deeper than any tree tiercel writes")
        if not isinstance(node, dict) or node.get("t") not in _NODE_TYPES:
            raise bad(path, f"is not a tree node: {node!r:.80}")
        t = node["t"]
        if t in _SCALAR_TYPES:
            scalar(node, path)
        elif t == "item":
            i = node.get("i")
            if type(i) is not int:
                raise bad(path, f"refers to item {i!r:.40}, not an item number")
            refs.append(i)
        elif not isinstance(node.get("v"), list):
            raise bad(path, f"is a '{t}' without a list of entries")
        elif t == "dict":
            if node.get("c", "OrderedDict") != "OrderedDict" or ("a" in node and node.get("c") != "OrderedDict"):
                raise bad(path, f"is a dict of an unknown class {node.get('c')!r:.60}")
            for n, pair in enumerate(node["v"]):
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict)
                        and pair[0].get("t") in _SCALAR_TYPES):
                    raise bad(f"{path}/{n}", f"is not a [scalar key, value] pair: {pair!r:.80}")
                scalar(pair[0], f"{path}/{n}")
                walk(pair[1], f"{path}/{_unscalar(pair[0])}", depth + 1)
            if "a" in node:
                attrs = node["a"]
                walk(attrs, f"{path}/@attrs", depth + 1)
                names = [k.get("v") if k["t"] == "str" else None for k, _ in attrs["v"]] if attrs["t"] == "dict" else [None]
                if not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in names):
                    raise bad(f"{path}/@attrs", "is not a dict of attribute names")
        else:
            if "c" in node and (t != "tuple" or not isinstance(node["c"], str)):
                raise bad(path, f"names a class {node['c']!r:.60} a '{t}' cannot have")
            for n, x in enumerate(node["v"]):
                walk(x, f"{path}/{n}", depth + 1)

    walk(tree, "", 0)
    if sorted(refs) != list(range(len(refs))):
        raise bad("", f"refers to items {refs[:20]}, not to each of its {len(refs)} items once")
    return refs


def tree_items(node: dict) -> list[int]:
    """The item references in a tree, in order."""
    t = node["t"]
    if t == "item":
        return [node["i"]]
    if t == "dict":
        # An OrderedDict's attributes ("a") are flattened after its entries.
        return [i for _, v in node["v"] for i in tree_items(v)] + (tree_items(node["a"]) if "a" in node else [])
    if t in ("list", "tuple"):
        return [i for v in node["v"] for i in tree_items(v)]
    return []
