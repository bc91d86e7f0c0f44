"""The adapter kit: what every framework adapter (DeepSpeed, Orbax, torch DCP) and every
exporter shares after the save, so that each adapter's own files keep only what is specific
to its framework.

This module grows with the kit; today it holds the one way to open or borrow a Store.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .store import PolicyLike, Store


@contextmanager
def borrow(store: Store | PolicyLike) -> Iterator[Store]:
    """Yields `store` itself when it is an open Store (never closed here: its owner closes it),
    or a Store opened from the policy `store` names as a single process (rank 0 of 1, as the
    CLI and the exporters open one), closed on the way out."""
    if isinstance(store, Store):
        yield store
        return
    with Store(store, rank=0, world_size=1) as opened:
        yield opened
