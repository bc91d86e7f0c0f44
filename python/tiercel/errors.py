"""tiercel's exceptions: `TiercelError` and one subclass per kind of failure.

The Rust core raises these (`tiercel._core` re-exports the same class objects), with what the
error is about as attributes: `tier`, `step`, `rank`, `item`, `chunk`, `path` (None when
unknown). The message names the same facts for people; programs read the attributes.

    try:
        store.restore(step=40)
    except tiercel.IntegrityError as e:
        print(e.tier, e.step, e.rank, e.item, e.chunk)

This module imports nothing from tiercel: the extension module imports it while it loads.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CapacityError",
    "ConfigError",
    "IntegrityError",
    "InvalidArgumentError",
    "NotFoundError",
    "TierUnavailableError",
    "TiercelError",
    "WorldSizeError",
]

#: The context fields every tiercel error carries, in this order.
FIELDS = ("tier", "step", "rank", "item", "chunk", "path")


def _rebuild(cls: type[TiercelError], message: str, fields: dict[str, Any]) -> TiercelError:
    """Unpickles an error (see `TiercelError.__reduce__`)."""
    return cls(message, **fields)


class TiercelError(Exception):
    """Base class of every tiercel error."""

    __module__ = "tiercel"

    tier: str | None
    step: int | None
    rank: int | None
    item: str | None
    chunk: int | None
    path: str | None

    def __init__(
        self,
        message: str = "",
        *,
        tier: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        item: str | None = None,
        chunk: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.tier = tier
        self.step = step
        self.rank = rank
        self.item = item
        self.chunk = chunk
        self.path = path

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def fields(self) -> dict[str, Any]:
        """The context fields that are known, by name."""
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles its args only; the fields are keyword-only.
        return (_rebuild, (type(self), self.message, self.fields()))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.fields().items())
        return f"{type(self).__name__}({self.message!r}{extra})"


class ConfigError(TiercelError):
    """A policy file or value is wrong (`path` is the policy file)."""

    __module__ = "tiercel"


class IntegrityError(TiercelError):
    """Stored bytes fail their checksum or cannot be decoded, or a manifest is damaged."""

    __module__ = "tiercel"


class NotFoundError(TiercelError):
    """The step, rank or item exists on no tier that was asked."""

    __module__ = "tiercel"


class TierUnavailableError(TiercelError):
    """A tier cannot be read or written right now (I/O error, permission, server down)."""

    __module__ = "tiercel"


class CapacityError(TiercelError):
    """A step does not fit into a tier's capacity."""

    __module__ = "tiercel"


class InvalidArgumentError(TiercelError):
    """Something tiercel cannot store, or a call out of order."""

    __module__ = "tiercel"


class WorldSizeError(InvalidArgumentError):
    """A restore of this rank's own part of a step that another number of ranks saved: the
    job's committed steps cannot be continued at this world size without resharding. The
    message names the steps, their world sizes and the ways on (`restore(rank=...)`,
    `restore(reshard=...)`, a resharding adapter)."""

    __module__ = "tiercel"
