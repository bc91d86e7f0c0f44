"""Checkpoint traffic that makes way for a DeepSpeed engine's own communication.

DeepSpeed reduces gradients inside `engine.backward` (all-reduce at the accumulation
boundary, or ZeRO's bucketed reduce-scatters, overlapped with the backward pass) and
gathers updated partitions inside `engine.step`; it offers no per-bucket hook. So the
signals are call-level: each `engine.backward` and `engine.step` counts as communication,
and each forward pass marks an iteration. The forward pass (and whatever the loop does
between steps) is then the idle time checkpoint chunks use.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..errors import InvalidArgumentError
from ..store import Store


def interleave(engine: Any, store: Store) -> Any:
    """Signals `store.traffic` around `engine.backward` and `engine.step`, and marks an
    iteration at each forward pass. Returns the forward pre-hook's handle."""
    if not all(callable(getattr(engine, name, None)) for name in ("backward", "step")) or not hasattr(engine, "module"):
        raise InvalidArgumentError(
            f"tiercel.deepspeed.interleave() takes the engine deepspeed.initialize returned, got {type(engine).__name__}"
        )
    traffic = store.traffic

    def signalled(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def run(*args: Any, **kwargs: Any) -> Any:
            with traffic.training_comm():
                return call(*args, **kwargs)

        return run

    # Instance attributes: DeepSpeed's own callers (and the user's) find them first.
    engine.backward = signalled(engine.backward)
    engine.step = signalled(engine.step)
    return engine.register_forward_pre_hook(lambda _module, _args: traffic.iteration())
