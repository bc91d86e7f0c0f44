"""tiercel as a torch.distributed.checkpoint (DCP) storage backend.

    import torch.distributed.checkpoint as dcp, tiercel.dcp
    dcp.save(state_dict, storage_writer=tiercel.dcp.Writer("tiercel.toml", step=step))
    fut = dcp.async_save(state_dict, storage_writer=tiercel.dcp.Writer("tiercel.toml", step=step))
    dcp.load(state_dict, storage_reader=tiercel.dcp.Reader("tiercel.toml"))          # newest restorable step
    dcp.load(state_dict, storage_reader=tiercel.dcp.Reader("tiercel.toml", step=40))
    tiercel.dcp.export("tiercel.toml", 40, "/ckpt/step-40")    # a plain DCP directory

DCP builds and plans the state dicts (FSDP2, DTensor, resharding on load); tiercel stores each
rank's part of a step in its tiers. See docs/pytorch.md.
"""

from ._stores import close
from .export import export
from .reader import Reader
from .writer import Writer

__all__ = ["Reader", "Writer", "close", "export"]
