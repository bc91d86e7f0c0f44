"""tiercel as an Orbax checkpoint backend: an AsyncCheckpointHandler selected through
CheckpointManager's handler registry.

    import orbax.checkpoint as ocp, tiercel.orbax
    handler = tiercel.orbax.TiercelCheckpointHandler("tiercel.toml")   # or a policy dict
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("state", tiercel.orbax.Save, handler)
    reg.add("state", tiercel.orbax.Restore, handler)
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=3),
                                 handler_registry=reg)
    mngr.save(step, args=ocp.args.Composite(state=tiercel.orbax.Save(train_state)))
    abstract = jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "shape") else x, train_state)
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(state=tiercel.orbax.Restore(abstract)))

Importing this module registers the jax.Array leaf handler with tiercel.leaves. See
docs/orbax.md.
"""

from ._leaf import JaxHandler, JaxShard
from .export import export
from .handler import MARKER, Restore, Save, TiercelCheckpointHandler, sync

__all__ = ["MARKER", "JaxHandler", "JaxShard", "Restore", "Save", "TiercelCheckpointHandler", "export", "sync"]
