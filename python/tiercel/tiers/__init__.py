"""Tiers written in Python: how the core builds one from a policy's `[[tier]]`.

A tier is any object with five methods, the blob protocol (docs/tiers.md):

    put(key, data)                      atomically replace `key` with `data` (bytes)
    put_if_absent(key, data) -> bool    atomic create: True if this call created `key`
    get_range(key, offset, length)      up to `length` bytes at `offset` (fewer only where
                                        the object ends)
    list(prefix) -> [names]             the names directly under `prefix` ("" for the root)
    delete(key)                         remove `key`

Keys are '/'-separated paths. A missing key raises `FileNotFoundError` or `KeyError`. Where
the object has them, the core also uses `get(key)` (a whole object), `exists(key)`,
`delete_prefix(prefix)` and `writer(key)` (a streaming write: `write(data)` per piece,
`commit()` makes the object appear, `abort()` drops it).

`kind = "python"` names the object's factory (`factory = "module:callable"`); `kind = "fsspec"`
is `tiercel.tiers.fsspec`; any other kind is looked up among the entry points of group
`tiercel.tiers` that installed packages declare. The factory is called with `[tier.options]`
as keywords, plus `url` where the tier has one.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import json
from typing import Any, Callable

from .. import _core
from ..errors import ConfigError

#: The entry point group through which a package adds a kind of tier.
ENTRY_POINTS = "tiercel.tiers"

#: The methods every tier's object has.
REQUIRED = ("put", "put_if_absent", "get_range", "list", "delete")


# Background threads call into Python tiers; once the interpreter exits they must not (see
# `pytier::exiting`): registered at import, which is when the first Python tier is opened.
atexit.register(_core.exiting)


def plugin_kinds() -> list[str]:
    """The kinds installed packages register (entry point group `tiercel.tiers`)."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)})


def load_factory(spec: str, at: str = "factory") -> Callable[..., Any]:
    """The callable `module:callable` names (`mypkg.tiers:make`, `mypkg:Tier.open`)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{at}: cannot import module {module_name!r} of factory {spec!r}: {type(e).__name__}: {e}"
                          " (is it installed, or on PYTHONPATH?)") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ConfigError(f"{at}: module {module_name!r} has no {attr!r} (factory {spec!r})") from e
    if not callable(obj):
        raise ConfigError(f"{at}: factory {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def _plugin(kind: str, at: str) -> Callable[..., Any]:
    eps = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS) if ep.name == kind]
    if not eps:
        raise ConfigError(f"{at}.kind: no installed package registers tier kind {kind!r} (entry point group {ENTRY_POINTS!r})")
    try:
        factory = eps[0].load()
    except Exception as e:
        raise ConfigError(f"{at}.kind: the entry point {eps[0].value!r} of kind {kind!r} does not load: {type(e).__name__}: {e}") from e
    if not callable(factory):
        raise ConfigError(f"{at}.kind: the entry point {eps[0].value!r} of kind {kind!r} is not callable")
    return factory


def check_protocol(obj: Any, what: str) -> None:
    """Raises ConfigError naming the methods of the blob protocol `obj` lacks."""
    missing = [m for m in REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(f"{what} returned a {type(obj).__name__} without {', '.join(missing)}: a tier implements "
                          f"{', '.join(REQUIRED)} (docs/tiers.md)")


def open_tier(at: str, name: str, kind: str, factory: str | None, url: str | None, options: str) -> tuple[Any, str]:
    """Builds tier `name` of a policy (`at`: where it stands there, for errors): its object
    and its location for messages. Called by the core (`tier::external`)."""
    kwargs = json.loads(options)
    if url is not None:
        kwargs["url"] = url
    if kind == "python":
        assert factory is not None, "the policy requires a factory for kind 'python'"
        make, label = load_factory(factory, f"{at}.factory"), factory
    elif kind == "fsspec":
        from .fsspec import FsspecTier
        make, label = FsspecTier, "tiercel.tiers.fsspec:FsspecTier"
    else:
        make, label = _plugin(kind, at), f"kind {kind!r}"
    try:
        obj = make(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{at}: {label}({_show(kwargs)}) raised {type(e).__name__}: {e}") from e
    check_protocol(obj, f"{at}: {label}")
    location = url or getattr(obj, "location", None) or f"{kind}:{factory or kind}"
    return obj, str(location)


def _show(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
