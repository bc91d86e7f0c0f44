"""DeepSpeed checkpoints through tiercel: the calls a DeepSpeed job already makes, with saves
that block only for the copy into shared memory and restores from the fastest tier.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    tiercel.deepspeed.attach(engine, "tiercel.toml")              # once, on every rank
    engine.save_checkpoint(save_dir, tag=f"global_step{step}")    # unchanged
    path, client_state = engine.load_checkpoint(save_dir)         # newest step every rank can restore

`export(store, step_or_tag, out_dir)` writes a step as a plain DeepSpeed checkpoint
directory that DeepSpeed loads without tiercel (`tiercel export STEP DIR --format deepspeed`).

Importing this module does not import deepspeed (the CLI's export needs only torch); `attach`
and `TiercelCheckpointEngine` do. See docs/deepspeed.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .exporter import export
from .layout import step_for_tag

if TYPE_CHECKING:
    from .engine import TiercelCheckpointEngine

__all__ = ["TiercelCheckpointEngine", "attach", "export", "interleave", "step_for_tag"]


def attach(engine: Any, policy: Any = None, **store_kwargs: Any) -> Any:
    """Makes `engine.save_checkpoint` / `engine.load_checkpoint` go through tiercel; returns
    the engine (see tiercel.deepspeed.install.attach)."""
    from .install import attach as _attach

    return _attach(engine, policy, **store_kwargs)


def interleave(engine: Any, store: Any) -> Any:
    """Lets checkpoint traffic make way for the engine's backward and step communication
    (see tiercel.deepspeed.traffic)."""
    from .traffic import interleave as _interleave

    return _interleave(engine, store)


def __getattr__(name: str) -> Any:
    if name == "TiercelCheckpointEngine":  # a subclass of DeepSpeed's: imports deepspeed
        from .engine import TiercelCheckpointEngine

        return TiercelCheckpointEngine
    raise AttributeError(f"module 'tiercel.deepspeed' has no attribute '{name}'")
