"""Common plain Python types kept in the tree itself (no pickle): complex numbers, datetimes,
dates, times, timedeltas and paths here; sets, enums, dataclasses and named tuples, which hold
other values, in tiercel._tree. Each is stored by its exact type only: a subclass (a pandas
Timestamp is a datetime) would come back as its base class, so it is left to a leaf handler
or the pickle fallback, which keep its type.

Node forms (docs/format.md, Trees):

    {"t": "complex", "v": [real.hex(), imag.hex()]}         (a NaN part: "nan:" + its 64 bits in hex)
    {"t": "datetime", "v": "2026-12-03T19:03:34.000001", "z": ..., "fold": 1}
    {"t": "date", "v": "2026-12-03"}
    {"t": "time", "v": "19:03:34.000001", "z": ..., "fold": 1}
    {"t": "timedelta", "v": [days, seconds, microseconds]}
    {"t": "path", "c": "PosixPath", "v": "runs/a"}

`z`, only on aware values, is the time zone: `{"o": offset in microseconds}` (plus `"n": name`
when the `datetime.timezone` was given one) or `{"zone": "Europe/Berlin"}` (a
`zoneinfo.ZoneInfo`); `fold` (0 unless 1) tells apart the two wall times a clock shows twice.
"""

from __future__ import annotations

import datetime as dt
import importlib
import pathlib
import struct
from typing import Any

#: Node types of this module (tiercel._tree checks and rebuilds them through here).
NODE_TYPES = ("complex", "datetime", "date", "time", "timedelta", "path")

#: pathlib's concrete and pure classes, by name: what a "path" node may name.
PATH_CLASSES = {c.__name__: c for c in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
                                         pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath)}

_ONE_DAY_US = 86_400_000_000


def _fhex(x: float) -> str:
    """A float as exact text: float.hex(), which writes every NaN as "nan", so a NaN (its
    sign and payload) as its bits."""
    return x.hex() if x == x else "nan:" + struct.pack(">d", x).hex()


def _unfhex(s: str) -> float:
    if s.startswith("nan:"):
        raw = bytes.fromhex(s[4:])
        if len(raw) != 8:
            raise ValueError(f"{s} is not 64 bits")
        x: float = struct.unpack(">d", raw)[0]
        if x == x:
            raise ValueError(f"{s} is not a NaN")
        return x
    return float.fromhex(s)


class Unbuildable(Exception):
    """A tree node that cannot be rebuilt here. `path` (the keys from the put's root, filled
    in on the way up) says where; `integrity` tells a damaged tree from a missing class."""

    def __init__(self, why: str, *, integrity: bool = False):
        super().__init__(why)
        self.why = why
        self.integrity = integrity
        self.path: list[str] = []


def where(name: str) -> str:
    """A leaf name ("extra/when/0") as the put and the path inside it, for messages."""
    put, _, path = name.partition("/")
    return f"'{name}' (put '{put}', path '{path}')" if path else f"'{name}' (put '{put}', the whole value)"


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def import_class(path: str) -> Any:
    """The object a tree names as "module:qualname", or raises Unbuildable saying why.
    Callers check what it is before calling it: a manifest never picks a callable."""
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # ImportError, an empty or odd name, a module failing to import
        raise Unbuildable(f"{path.replace(':', '.')} cannot be imported here (module '{module}': "
                          f"{type(e).__name__}: {e}); make it importable before restoring") from None
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise Unbuildable(f"module '{module}' has no '{qualname}' here; the class was renamed or moved since the "
                          "save, or defined inside a function") from None
    return obj


def importable(cls: type) -> bool:
    """Whether a restore can find `cls` by its module and qualified name (a class defined
    inside a function or replaced since cannot be)."""
    try:
        return import_class(class_path(cls)) is cls
    except Unbuildable:
        return False


def _zone(tz: dt.tzinfo | None) -> dict | None | bool:
    """A time zone's node, None for naive values, False for a tzinfo this module does not
    keep (pytz, dateutil: it would come back as another class)."""
    if tz is None:
        return None
    if type(tz) is dt.timezone:
        off = tz.utcoffset(None)
        node: dict[str, Any] = {"o": (off.days * 86_400 + off.seconds) * 1_000_000 + off.microseconds}
        args = tz.__getinitargs__()  # type: ignore[attr-defined]  # (offset,) or (offset, name)
        if len(args) == 2:
            node["n"] = args[1]
        return node
    try:
        from zoneinfo import ZoneInfo
    except ImportError:  # pragma: no cover - Python < 3.9
        return False
    if type(tz) is ZoneInfo and tz.key is not None:
        try:
            if ZoneInfo(tz.key) is tz:  # not one made by ZoneInfo.no_cache or from_file
                return {"zone": tz.key}
        except Exception:
            return False
    return False


def _unzone(z: Any) -> dt.tzinfo | None:
    if z is None:
        return None
    if isinstance(z, dict) and isinstance(z.get("zone"), str) and len(z) == 1:
        try:
            from zoneinfo import ZoneInfo

            return ZoneInfo(z["zone"])
        except Exception as e:
            raise Unbuildable(f"time zone '{z['zone']}' is not known here ({type(e).__name__}: {e}); install tzdata") from None
    if isinstance(z, dict) and type(z.get("o")) is int and set(z) <= {"o", "n"} and -_ONE_DAY_US < z["o"] < _ONE_DAY_US:
        off = dt.timedelta(microseconds=z["o"])
        if "n" in z:
            if not isinstance(z["n"], str):
                raise Unbuildable(f"has a time zone name {z['n']!r:.40}", integrity=True)
            return dt.timezone(off, z["n"])
        return dt.timezone(off)
    raise Unbuildable(f"has a time zone {z!r:.60} tiercel does not write", integrity=True)


def encode(v: Any) -> dict | None:
    """The node of a plain value of this module's types, or None (not one of them, or one
    that would not come back the same: a subclass, a tzinfo of another library)."""
    t = type(v)
    if t is complex:
        return {"t": "complex", "v": [_fhex(v.real), _fhex(v.imag)]}
    if t is dt.datetime or t is dt.time:
        z = _zone(v.tzinfo)
        if z is False:
            return None
        naive = v.replace(tzinfo=None, fold=0)
        node = {"t": "datetime" if t is dt.datetime else "time", "v": naive.isoformat(timespec="microseconds")}
        if z is not None:
            node["z"] = z
        if v.fold:
            node["fold"] = 1
        return node
    if t is dt.date:
        return {"t": "date", "v": v.isoformat()}
    if t is dt.timedelta:
        return {"t": "timedelta", "v": [v.days, v.seconds, v.microseconds]}
    if t.__name__ in PATH_CLASSES and PATH_CLASSES[t.__name__] is t:
        return {"t": "path", "c": t.__name__, "v": str(v)}
    return None


def decode(node: dict) -> Any:
    """A value from its node (checked by `check`), or raises Unbuildable."""
    t, v = node["t"], node["v"]
    if t == "complex":
        return complex(_unfhex(v[0]), _unfhex(v[1]))
    if t in ("datetime", "time"):
        cls = dt.datetime if t == "datetime" else dt.time
        return cls.fromisoformat(v).replace(tzinfo=_unzone(node.get("z")), fold=node.get("fold", 0))
    if t == "date":
        return dt.date.fromisoformat(v)
    if t == "timedelta":
        return dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
    if t == "path":
        try:
            return PATH_CLASSES[node["c"]](v)
        except NotImplementedError as e:  # a WindowsPath on POSIX, a PosixPath on Windows
            raise Unbuildable(f"is a {node['c']}, which cannot be made on this system ({e}); "
                              "restore it where it was saved, or save a Pure path") from None
    raise Unbuildable(f"is not a plain-value node: {t}", integrity=True)


def check(node: dict) -> str | None:
    """Why a node of this module's types is malformed, or None: run on every tree read
    from a manifest, so that a damaged one fails with a clear message, never a KeyError."""
    t, v = node["t"], node.get("v")
    try:
        if t == "complex":
            ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) and len(x) < 40 for x in v)
            if ok:
                decode(node)
        elif t in ("datetime", "date", "time"):
            ok = isinstance(v, str) and len(v) < 40 and node.get("fold", 0) in (0, 1)
            if ok:
                decode(node)
        elif t == "timedelta":
            ok = isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v)
            if ok:
                decode(node)
        elif t == "path":
            ok = isinstance(v, str) and node.get("c") in PATH_CLASSES
        else:
            ok = False
    except Unbuildable as e:
        if e.integrity:
            return e.why
        ok = True  # a zone or path class this system lacks: said at restore, where it matters
    except (ValueError, OverflowError, TypeError):
        ok = False
    return None if ok else f"is a '{t}' node with the value {v!r:.60}"
