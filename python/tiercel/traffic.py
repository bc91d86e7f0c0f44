"""What the training loop tells the store about its own communication (`store.traffic`).

Checkpoint traffic on the links that training traffic uses (peer and object-store tiers)
makes way for it, as the policy's `[traffic]` section says:

    with store.traffic.training_comm():    # around the job's own collectives
        dist.all_reduce(grad)

    for batch in loader:
        with store.traffic.training_step():  # JAX: the whole step (XLA hides its collectives)
            state = train_step(state, batch)

Inside, no new checkpoint chunk leaves on those links (a chunk already on its way finishes),
or they keep the `floor` rate; outside, they resume. `tiercel.torch.interleave` signals
around each DDP gradient bucket by itself. In mode "learned" the first `warmup` iterations
are profiled, and later chunks are sized into the idle spans they showed (see docs/traffic.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from . import _core


class Traffic:
    """The training job's communication signals to one store's scheduler."""

    def __init__(self, core: _core.Traffic):
        self._core = core

    def busy(self) -> None:
        """The training job starts communicating (nested calls count)."""
        self._core.busy()

    def idle(self) -> None:
        """The communication `busy()` announced is over. InvalidArgumentError without one."""
        self._core.idle()

    def iteration(self) -> None:
        """A training iteration starts (what mode "learned" profiles and plans by)."""
        self._core.iteration()

    @contextmanager
    def training_comm(self) -> Iterator[None]:
        """Checkpoint traffic on network links pauses (or keeps its floor) inside."""
        self._core.busy()
        try:
            yield
        finally:
            self._core.idle()

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """One whole training step, its collectives inside: for frameworks that do not show
        them (JAX/XLA). Marks an iteration and counts the step as communication, so that
        checkpoint chunks go between steps (input pipeline, logging, evaluation)."""
        self._core.iteration()
        self._core.busy()
        try:
            yield
        finally:
            self._core.idle()

    def stats(self, checkpoint_bytes: int | None = None) -> dict[str, Any]:
        """The mode and settings, the signals seen, how often and how long chunks waited, the
        learned idle spans, and per link its measured alpha/bandwidth (and, for a checkpoint of
        `checkpoint_bytes`, the learned plan with its effective checkpoint interval)."""
        return self._core.stats(checkpoint_bytes)

    def record(self, on: bool = True) -> None:
        """Starts (clearing it) or stops keeping the timeline of signals and chunks."""
        self._core.record(on)

    def timeline(self) -> list[tuple[float, str, str, int, float | None]]:
        """[(t, kind, link, bytes, seconds)] since `record()`: kind "busy", "idle", "iteration"
        or "chunk"; t on the clock of `now()`."""
        return self._core.timeline()

    def now(self) -> float:
        """Seconds on the timeline's clock (since the store opened)."""
        return self._core.now()
