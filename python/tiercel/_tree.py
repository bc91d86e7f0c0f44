"""Flattening a state (nested dicts/lists/tuples of arrays, tensors, bytes and scalars) into
items plus a JSON tree, and building it back.

Small Python values (ints, floats, strings, bools, None) and containers stay in the tree,
which goes into the manifest; every other value is a leaf, which the first leaf handler
that claims it (tiercel.leaves: numpy, torch, bytes, adapters' types) turns into an item.
A value no handler claims stays in the tree when it is one of the common plain types
(sets, enums, dataclasses, named tuples here; complex numbers, datetimes and paths in
tiercel._plain); only what is left goes to the pickle fallback.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import _plain
from ._nodes import FIELD_TYPES, MAX_DEPTH, SCALAR_TYPES, scalar, unscalar
from ._nodes import check_tree as check_tree  # the names other modules know them by
from ._nodes import tree_items as tree_items
from ._plain import Unbuildable

if TYPE_CHECKING:
    from .leaves import Leaf


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
            s = scalar(v)
            assert s is not None
            return s
        hint = None
        if isinstance(v, enum.Enum):  # before containers: an enum may mix in tuple
            if _plain.importable(type(v)):
                return {"t": "enum", "c": _plain.class_path(type(v)), "v": self.node(v._value_, path)}
            hint = _NOT_IMPORTABLE
        elif type(v) in _CONTAINERS or isinstance(v, tuple):
            hint = _namedtuple_hint(v)
            if hint is None:
                return self._nested(v, path, self._container)
        handler = handler_for(v)
        if handler.framework == "pickle":  # no handler claims it: is it a plain type?
            if type(v) in (set, frozenset):
                return self._nested(v, path, self._set)
            if _is_dataclass(v):
                hint = _dataclass_hint(v)
                if hint is None:
                    return self._nested(v, path, self._dataclass)
            plain = _plain.encode(v)
            if plain is not None:
                return plain
        try:
            leaf = handler.describe(v, self._name(path))
        except TypeError as e:
            raise TypeError(f"{e} ({hint})" if hint else str(e)) from None
        leaf.handler = handler
        self.leaves.append(leaf)
        return {"t": "item", "i": len(self.leaves) - 1}

    def _nested(self, v: Any, path: list[str], build: Any) -> dict:
        if id(v) in self._active:
            raise TypeError(f"'{self._display(path)}' contains itself (a cycle); a checkpoint must be a tree")
        self._active.add(id(v))
        try:
            return build(v, path)
        finally:
            self._active.discard(id(v))

    def _set(self, v: set | frozenset, path: list[str]) -> dict:
        try:  # a stable order: two ranks (or two runs) saving one set write one tree
            elems = sorted(v)
        except Exception:  # mixed types (TypeError), tensors (no truth value): their iteration order
            elems = list(v)
        return {"t": type(v).__name__, "v": [self.node(x, [*path, str(i)]) for i, x in enumerate(elems)]}

    def _dataclass(self, v: Any, path: list[str]) -> dict:
        fields = [f.name for f in dataclasses.fields(v)]
        return {"t": "dataclass", "c": _plain.class_path(type(v)),
                "v": [[name, self.node(getattr(v, name), [*path, name])] for name in fields]}

    def _container(self, v: Any, path: list[str]) -> dict:
        if isinstance(v, dict):
            keys = []
            for k, x in v.items():
                ks = scalar(k) if type(k) in _SCALARS else None
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
        if _is_namedtuple(type(v)):
            return {"t": "namedtuple", "c": _plain.class_path(type(v)),
                    "v": [[name, self.node(x, [*path, name])] for name, x in zip(type(v)._fields, v)]}
        kind = "list" if isinstance(v, list) else "tuple"
        node = {"t": kind, "v": [self.node(x, [*path, str(i)]) for i, x in enumerate(v)]}
        if kind == "tuple" and type(v) is not tuple:
            # torch.Size and other tuple subclasses: the class is recorded and rebuilt when
            # importable (a plain tuple otherwise, as format version 1 has always said).
            node["c"] = _plain.class_path(type(v))
        return node


#: Containers kept as tree structure, besides tuples and their subclasses. Other dict and
#: list subclasses (defaultdict, ...) are leaves, so the pickle fallback keeps their type.
_CONTAINERS = (dict, OrderedDict, list)

_NOT_IMPORTABLE = ("tiercel keeps enums, dataclasses and named tuples without pickle when their class can be "
                   "imported by its module and name; define it at module level")


def _is_namedtuple(cls: type) -> bool:
    fields = getattr(cls, "_fields", None)
    return (issubclass(cls, tuple) and isinstance(fields, tuple) and all(isinstance(f, str) for f in fields)
            and callable(getattr(cls, "_make", None)))


def _namedtuple_hint(v: Any) -> str | None:
    """None when a tuple (or dict, list) is kept as tree structure; why not for a named tuple
    a restore could not rebuild as it is."""
    if not _is_namedtuple(type(v)):
        return None
    if not _plain.importable(type(v)):
        return _NOT_IMPORTABLE
    if getattr(v, "__dict__", None) or len(v) != len(type(v)._fields):
        return "a named tuple is kept without pickle when it holds just its fields, no other attributes"
    return None


def _is_dataclass(v: Any) -> bool:
    return hasattr(type(v), "__dataclass_fields__") and not isinstance(v, type)


def _dataclass_hint(v: Any) -> str | None:
    """None when a dataclass instance can be kept as its fields; else why not."""
    if not _plain.importable(type(v)):
        return _NOT_IMPORTABLE
    names = [f.name for f in dataclasses.fields(v)]
    attrs = getattr(v, "__dict__", None)
    slots_ok = all(hasattr(v, n) for n in names)
    if not slots_ok or (attrs is not None and set(attrs) != set(names)):
        return "a dataclass is kept without pickle when its instance holds exactly its fields"
    return None


def flatten(prefix: str, value: Any) -> tuple[dict, list[Leaf]]:
    f = Flattener(prefix)
    return f.node(value, []), f.leaves


def unflatten(node: dict, items: Mapping[int, Any] | Sequence[Any], where: str = "the tree", **fields: Any) -> Any:
    """Rebuilds a tree; `items[i]` is the restored value of item reference i. A node that
    cannot be rebuilt here (a class that cannot be imported, or has changed) raises an
    InvalidArgumentError naming `where` (step, rank, put), the path in the tree and the
    class; `fields` (step, rank) go onto the error."""
    try:
        return _build(node, items)
    except Unbuildable as e:
        from .errors import IntegrityError, InvalidArgumentError

        path = "/".join(reversed(e.path))
        at = f"{where} at '{path}'" if path else where
        cls = IntegrityError if e.integrity else InvalidArgumentError
        raise cls(f"{at}: {e.why}", **fields) from None


def _build(node: dict, items: Mapping[int, Any] | Sequence[Any]) -> Any:
    t = node["t"]
    if t == "item":
        return items[node["i"]]
    if t in SCALAR_TYPES:
        return unscalar(node)
    if t == "dict":
        d = {}
        for k, v in node["v"]:
            key = unscalar(k)
            d[key] = _inside(v, items, str(key))
        if node.get("c") != "OrderedDict":
            return d
        od = OrderedDict(d)
        for name, value in _inside(node["a"], items, "@attrs").items() if "a" in node else ():
            setattr(od, name, value)
        return od
    if t in ("list", "tuple", "set", "frozenset"):
        vals = [_inside(v, items, str(i)) for i, v in enumerate(node["v"])]
        if t == "list":
            return vals
        if t == "tuple":
            return _tuple(node, tuple(vals))
        try:
            return set(vals) if t == "set" else frozenset(vals)
        except TypeError as e:  # only a damaged tree puts an unhashable value in a set
            raise Unbuildable(f"is a {t} of a value that cannot be in one ({e})", integrity=True) from None
    if t == "enum":
        return _enum(node["c"], _build(node["v"], items))
    if t in FIELD_TYPES:
        values = {name: _inside(v, items, name) for name, v in node["v"]}
        return _dataclass(node["c"], values) if t == "dataclass" else _namedtuple(node["c"], values)
    return _plain.decode(node)


def _inside(node: dict, items: Mapping[int, Any] | Sequence[Any], key: str) -> Any:
    """`_build` of a node inside a container; an error on the way out learns its path."""
    try:
        return _build(node, items)
    except Unbuildable as e:
        e.path.append(key)
        raise


def _tuple(node: dict, vals: tuple) -> Any:
    if "c" not in node:
        return vals
    try:
        cls = _plain.import_class(node["c"])
    except Unbuildable:
        return vals  # format version 1: a tuple subclass that is not importable is a plain tuple
    if not (isinstance(cls, type) and issubclass(cls, tuple)):  # a manifest cannot name an arbitrary callable
        return vals
    try:
        return cls(*vals) if hasattr(cls, "_fields") else cls(vals)
    except Exception as e:  # the class here differs from the one that saved the tree
        raise Unbuildable(f"the tree's tuple class {node['c']} cannot be rebuilt from {len(vals)} values here: {e}",
                          integrity=True) from None


def _class(path: str, what: str, ok: Any) -> Any:
    cls = _plain.import_class(path)
    if not (isinstance(cls, type) and ok(cls)):
        raise Unbuildable(f"{path.replace(':', '.')} is no {what} here; the code changed since the save")
    return cls


def _enum(path: str, value: Any) -> Any:
    cls = _class(path, "Enum", lambda c: issubclass(c, enum.Enum))
    try:
        return cls(value)
    except Exception:  # ValueError; or whatever the enum's _missing_ raises
        raise Unbuildable(f"enum {path.replace(':', '.')} has no member of value {value!r:.60} here; "
                          "the code changed since the save") from None


def _dataclass(path: str, values: dict[str, Any]) -> Any:
    """Rebuilt as pickle does it: the instance made without `__init__` (nor `__post_init__`,
    which already ran before the save), then each field set."""
    cls = _class(path, "dataclass", dataclasses.is_dataclass)
    have = [f.name for f in dataclasses.fields(cls)]
    if set(have) != set(values):
        raise Unbuildable(f"dataclass {path.replace(':', '.')} has the fields {have} here, the checkpoint "
                          f"{list(values)}; the code changed since the save")
    try:
        obj = cls.__new__(cls)
        for name, value in values.items():
            object.__setattr__(obj, name, value)  # frozen dataclasses too
    except Exception as e:
        raise Unbuildable(f"dataclass {path.replace(':', '.')} cannot be rebuilt here: {type(e).__name__}: {e}") from None
    return obj


def _namedtuple(path: str, values: dict[str, Any]) -> Any:
    cls = _class(path, "named tuple", _is_namedtuple)
    if tuple(cls._fields) != tuple(values):
        raise Unbuildable(f"named tuple {path.replace(':', '.')} has the fields {list(cls._fields)} here, the "
                          f"checkpoint {list(values)}; the code changed since the save")
    try:
        return cls._make(values.values())
    except Exception as e:
        raise Unbuildable(f"named tuple {path.replace(':', '.')} cannot be rebuilt here: {type(e).__name__}: {e}") from None


# -- reading a tree without building it (adapters find their items by key) ----------------


def scalar_value(node: dict) -> Any:
    """The Python value of a scalar node (none, bool, int, float, str); ValueError for any
    other node."""
    return unscalar(node)


def dict_entries(node: dict) -> list[tuple[Any, dict]] | None:
    """A dict node's entries as (key, value node), keys as Python values; None when `node`
    is not a dict."""
    if node.get("t") != "dict":
        return None
    return [(unscalar(k), v) for k, v in node["v"]]


def entry(node: dict, key: Any) -> dict | None:
    """The value node of `key` in a dict node; None when there is no such entry or `node`
    is not a dict."""
    for k, v in dict_entries(node) or ():
        if k == key and type(k) is type(key):
            return v
    return None


def item_ref(node: dict) -> int | None:
    """The put's item index an item node refers to; None for any other node."""
    return int(node["i"]) if node.get("t") == "item" else None
