"""`tiercel export STEP DIR --format F`: write a committed step in a framework's own format,
loadable without tiercel (no lock-in). Each adapter owns its format (plain saves:
tiercel.torch_export); this only dispatches."""

from __future__ import annotations

import importlib

from .context import EXIT_OK, Ctx, UsageError
from .output import Progress, json_out

#: --format -> the adapter module whose `export(store, step, out_dir)` writes it.
FORMATS = {
    "deepspeed": "tiercel.deepspeed",
    "orbax": "tiercel.orbax",
    "dcp": "tiercel.dcp",
    # Plain saves (Store.save, tiercel.torch.save_state): one torch.save file per rank.
    "torch": "tiercel.torch_export",
}


class _Bar:
    """The exporters' `progress` callbacks as one progress bar (on a terminal): DeepSpeed's
    (files done, files, bytes done, bytes), Orbax's (leaves done, leaves), DCP's and torch's
    (bytes done, bytes)."""

    def __init__(self, label: str, fmt: str):
        self.label, self.fmt = label, fmt
        self.bar: Progress | None = None

    def __call__(self, *args: int) -> None:
        if self.fmt == "deepspeed":
            done, total, nbytes, total_bytes, unit = *args, "file"
        elif self.fmt == "orbax":
            (done, total), nbytes, total_bytes, unit = args, None, None, "leaf"
        else:
            done, total, nbytes, total_bytes, unit = args[0], args[1], args[0], args[1], "byte"
        if self.bar is None:
            self.bar = Progress(self.label, total, total_bytes, unit=unit)
        self.bar.update(done, nbytes)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish()


def cmd_export(ctx: Ctx) -> int:
    a = ctx.args
    module_name = FORMATS[a.format]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--format {a.format} needs {module_name}, which cannot be imported here: {e}") from None
    bar = _Bar(f"export step {a.step} as {a.format}", a.format)
    try:
        out = str(module.export(ctx.store, a.step, a.dir, progress=bar) or a.dir)
    finally:
        bar.finish()
    if a.json:
        json_out({"step": a.step, "format": a.format, "dir": out})
    else:
        print(f"exported step {a.step} as {a.format} to {out}")
    return EXIT_OK
