"""`tiercel export STEP DIR --format F`: write a committed step in a framework's own format,
loadable without tiercel (no lock-in). Each adapter owns its format (plain saves:
tiercel.torch_export); this only dispatches."""

from __future__ import annotations

import importlib

from .context import EXIT_OK, Ctx, UsageError
from .output import json_out

#: --format -> the adapter module whose `export(store, step, out_dir)` writes it.
FORMATS = {
    "deepspeed": "tiercel.deepspeed",
    "orbax": "tiercel.orbax",
    "dcp": "tiercel.dcp",
    # Plain saves (Store.save, tiercel.torch.save_state): one torch.save file per rank.
    "torch": "tiercel.torch_export",
}


def cmd_export(ctx: Ctx) -> int:
    a = ctx.args
    module_name = FORMATS[a.format]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--format {a.format} needs {module_name}, which cannot be imported here: {e}") from None
    out = str(module.export(ctx.store, a.step, a.dir) or a.dir)
    if a.json:
        json_out({"step": a.step, "format": a.format, "dir": out})
    else:
        print(f"exported step {a.step} as {a.format} to {out}")
    return EXIT_OK
