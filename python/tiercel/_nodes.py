"""The nodes of a put's tree: the JSON vocabulary a manifest's trees are written in
(docs/format.md, Trees), the scalars among them, and the check of a tree read from a
manifest.

This is the bottom of the tree code: `manifest` checks trees with it while it parses a
manifest, and `_tree` (which needs the leaf handlers, which need the manifest's types)
writes and reads trees with it. It imports nothing of tiercel's but `_plain` and `errors`.
"""

from __future__ import annotations

from typing import Any

from . import _plain
from .errors import IntegrityError


def scalar(v: Any) -> dict | None:
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
SCALAR_TYPES = ("none", "bool", "int", "float", "str")
NODE_TYPES = (*SCALAR_TYPES, "item", "dict", "list", "tuple",
              # Added after format version 1 shipped: a reader from before refuses them by
              # name ("not a tree node"), never misreads them (docs/format.md, Trees).
              "set", "frozenset", "enum", "dataclass", "namedtuple", *_plain.NODE_TYPES)
#: Nodes that record their fields as [name, node] pairs.
FIELD_TYPES = ("dataclass", "namedtuple")

#: Python refuses to parse an int of more digits than this (sys.int_info's default limit).
INT_DIGITS = 4300


def unscalar(node: dict) -> Any:
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


def check_tree(tree: Any, where: str) -> list[int]:
    """Checks a tree read from a manifest before anything uses it, and returns its item
    references in order (as `tree_items`). A tree that tiercel._tree would not have written
    (a damaged or hand-edited manifest) is an IntegrityError naming `where` (step, rank,
    put) and the path in the tree, never a KeyError or TypeError later. The references must
    number the put's items 0..n-1, each once."""
    refs: list[int] = []

    def bad(path: str, why: str) -> IntegrityError:
        return IntegrityError(f"{where}: the tree at '{path or '$'}' {why}; the manifest is damaged")

    def scalar(node: dict, path: str) -> None:
        t, v = node["t"], node.get("v")
        ok = (t == "none" or (t == "bool" and isinstance(v, bool)) or (t == "str" and isinstance(v, str))
              or (t in ("int", "float") and isinstance(v, str) and len(v) <= INT_DIGITS))
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
        if isinstance(node, dict) and isinstance(node.get("t"), str) and node["t"] not in NODE_TYPES:
            raise IntegrityError(f"{where}: the tree at '{path or '$'}' is a '{node['t']:.40}' node, which this tiercel "
                                 "does not know: the step was written by a newer tiercel (upgrade this one), or the "
                                 "manifest is damaged")
        if not isinstance(node, dict) or node.get("t") not in NODE_TYPES:
            raise bad(path, f"is not a tree node: {node!r:.80}")
        t = node["t"]
        if t in SCALAR_TYPES:
            scalar(node, path)
        elif t in _plain.NODE_TYPES:
            why = _plain.check(node)
            if why:
                raise bad(path, why)
        elif t == "item":
            i = node.get("i")
            if type(i) is not int:
                raise bad(path, f"refers to item {i!r:.40}, not an item number")
            refs.append(i)
        elif t == "enum":
            if not isinstance(node.get("c"), str):
                raise bad(path, f"is an enum of no class: {node.get('c')!r:.60}")
            walk(node.get("v"), path, depth + 1)
        elif not isinstance(node.get("v"), list):
            raise bad(path, f"is a '{t}' without a list of entries")
        elif t in FIELD_TYPES:
            if not isinstance(node.get("c"), str):
                raise bad(path, f"is a {t} of no class: {node.get('c')!r:.60}")
            names: set[str] = set()
            for n, pair in enumerate(node["v"]):
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                        and pair[0].isidentifier() and pair[0] not in names):
                    raise bad(f"{path}/{n}", f"is not a [field name, value] pair: {pair!r:.80}")
                names.add(pair[0])
                walk(pair[1], f"{path}/{pair[0]}", depth + 1)
        elif t == "dict":
            if node.get("c", "OrderedDict") != "OrderedDict" or ("a" in node and node.get("c") != "OrderedDict"):
                raise bad(path, f"is a dict of an unknown class {node.get('c')!r:.60}")
            for n, pair in enumerate(node["v"]):
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict)
                        and pair[0].get("t") in SCALAR_TYPES):
                    raise bad(f"{path}/{n}", f"is not a [scalar key, value] pair: {pair!r:.80}")
                scalar(pair[0], f"{path}/{n}")
                walk(pair[1], f"{path}/{unscalar(pair[0])}", depth + 1)
            if "a" in node:
                attrs = node["a"]
                walk(attrs, f"{path}/@attrs", depth + 1)
                keys = [k.get("v") if k["t"] == "str" else None for k, _ in attrs["v"]] if attrs["t"] == "dict" else [None]
                if not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in keys):
                    raise bad(f"{path}/@attrs", "is not a dict of attribute names")
        else:  # list, tuple, set, frozenset
            if "c" in node and (t != "tuple" or not isinstance(node["c"], str)):
                raise bad(path, f"names a class {node['c']!r:.60} a '{t}' cannot have")
            for n, x in enumerate(node["v"]):
                walk(x, f"{path}/{n}", depth + 1)

    walk(tree, "", 0)
    if sorted(refs) != list(range(len(refs))):
        raise bad("", f"refers to items {refs[:20]}, not to each of its {len(refs)} items once")
    return refs


def tree_items(node: dict) -> list[int]:
    """The item references in a tree, in order (the order `flatten` made the leaves in)."""
    t = node["t"]
    if t == "item":
        return [node["i"]]
    if t == "dict":
        # An OrderedDict's attributes ("a") are flattened after its entries.
        return [i for _, v in node["v"] for i in tree_items(v)] + (tree_items(node["a"]) if "a" in node else [])
    if t in ("list", "tuple", "set", "frozenset"):
        return [i for v in node["v"] for i in tree_items(v)]
    if t in FIELD_TYPES:
        return [i for _, v in node["v"] for i in tree_items(v)]
    if t == "enum":
        return tree_items(node["v"])
    return []
