"""`tiercel export STEP DIR [--format F]`: write a committed step in a framework's own format,
loadable without tiercel (no lock-in), or as safetensors. The formats, their exporters and the
detection of the format a step was saved in are tiercel.exports'; this only parses and reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import exports
from .context import EXIT_OK, Ctx, UsageError
from .output import Progress, json_out


class _Bar:
    """The exporters' progress(done_bytes, total_bytes) as one progress bar (on a terminal)."""

    def __init__(self, label: str):
        self.label = label
        self.bar: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = Progress(self.label, total, total, unit="byte")
        self.bar.update(done, done)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish()


def cmd_export(ctx: Ctx) -> int:
    a = ctx.args
    options: dict[str, Any] = {}
    if a.max_shard_size is not None:
        if a.format != "safetensors":
            raise UsageError("--max-shard-size goes with --format safetensors")
        options["max_shard_size"] = a.max_shard_size
    fmt = exports.resolve(ctx.store, a.step, a.format)
    bar = _Bar(f"export step {a.step} as {fmt}")
    try:
        out = exports.export(ctx.store, a.step, a.dir, format=fmt, progress=bar, **options)
    finally:
        bar.finish()
    skipped = _skipped(out) if fmt == "safetensors" else {}
    if a.json:
        json_out({"step": a.step, "format": fmt, "dir": str(out), **({"skipped": len(skipped)} if skipped else {})})
    else:
        print(f"exported step {a.step} as {fmt} to {out}")
        if skipped:
            print(f"skipped {len(skipped)} value(s) that are not tensors safetensors can hold: "
                  f"listed in {out / 'skipped.json'}")
    return EXIT_OK


def _skipped(out: Path) -> dict[str, Any]:
    from ..safetensors_export import skipped

    return skipped(out)
