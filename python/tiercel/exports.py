"""The export registry: every format a committed step can be written out in, loadable without
tiercel, behind one signature and one progress callback, and the format a step was saved in,
read from the step itself.

    tiercel.exports.export("tiercel.toml", 40, "/ckpt/step-40")                        # the step's own format
    tiercel.exports.export(store, 40, "/ckpt/st", format="safetensors", progress=bar)  # bar(done_bytes, total_bytes)

Every exporter is `exporter(store, step, dest, *, progress=None, **options) -> Path`:
`store` an open Store (the registry opens or borrows it: `tiercel.kit.borrow`), `step` a
step number (DeepSpeed also takes a tag), `dest` a directory that must not exist or be empty,
`progress(done, total)` counting bytes of the step's data. The framework a format needs is
imported only when that format is used, so detecting one costs no import of torch or JAX.

Detection reads rank 0's manifest: which adapter wrote the step shows in its puts (each
adapter's marker is named below, beside the constant it mirrors). A step no adapter marked is
a plain save (`Store.save`, `tiercel.torch.save_state`): format "torch". safetensors is never
detected (no adapter writes it); it is asked for, and reads the step through the detected
format's tensors (tiercel.safetensors_export).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import InvalidArgumentError
from .kit import borrow
from .manifest import Manifest
from .store import PolicyLike, Store

#: progress(done, total): bytes of the step's data exported so far, of all it will export.
Progress = Callable[[int, int], Any]


class Exporter(Protocol):
    def __call__(self, store: Store, step: int | str, dest: Path, *, progress: Progress | None = None,
                 **options: Any) -> Path: ...


@dataclass(frozen=True)
class Format:
    """One export format: its name (`--format`), what it writes, where its exporter lives
    ("module:function", imported on use), and how to tell a step it fits (None: only on request)."""

    name: str
    writes: str
    exporter: str
    detect: Callable[[Manifest], bool] | None = None

    def load(self) -> Exporter:
        module, _, func = self.exporter.partition(":")
        try:
            found: Exporter = getattr(importlib.import_module(module), func)
        except ImportError as e:
            raise InvalidArgumentError(f"export format '{self.name}' needs {module}, which cannot be imported here: {e}; "
                                       "install the framework it exports for") from None
        return found


_FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> None:
    """Adds a format (a later registration of a name replaces the earlier one)."""
    _FORMATS[fmt.name] = fmt


def formats() -> dict[str, Format]:
    """The registered formats, by name."""
    return dict(_FORMATS)


def _names() -> str:
    return ", ".join(sorted(_FORMATS))


# -- detection -----------------------------------------------------------------------------
# The markers mirror the adapters' constants without importing the adapters (they import torch
# or JAX); tests/test_exports.py checks that they still agree.

#: tiercel.deepspeed.layout.LAYOUT_PUT: every rank's step holds the DeepSpeed layout put.
DEEPSPEED_PUT = "_deepspeed"
#: tiercel.dcp._layout.PUT_METADATA: rank 0's step holds DCP's pickled Metadata.
DCP_PUT = "dcp-metadata"
#: tiercel.orbax._layout.FORMAT: a put whose dict says {"format": "tiercel-orbax", ...}.
ORBAX_FORMAT = "tiercel-orbax"


def _is_orbax(m: Manifest) -> bool:
    return bool(orbax_items(m))


def orbax_items(m: Manifest) -> list[str]:
    """The puts of a step that hold an Orbax item (tiercel.orbax's layout)."""
    marker = [{"t": "str", "v": "format"}, {"t": "str", "v": ORBAX_FORMAT}]
    return [put for put, tree in m.trees.items() if tree.get("t") == "dict" and marker in tree.get("v", [])]


def _is_adapters(m: Manifest) -> bool:
    return any(f.detect(m) for f in _FORMATS.values() if f.detect is not None and f.name != "torch")


def detect(store: Store, step: int) -> str:
    """The format step `step` was saved in, from rank 0's manifest. Raises InvalidArgumentError
    naming the formats when two adapters' marks are in the step."""
    manifest = store.reader(step, rank=0).manifest
    found = [f.name for f in _FORMATS.values() if f.detect is not None and f.detect(manifest)]
    if len(found) == 1:
        return found[0]
    what = f"the marks of several ({', '.join(found)})" if found else "no format's mark"
    raise InvalidArgumentError(f"step {step}: cannot tell which format to export: its puts ({', '.join(manifest.puts())}) "
                               f"carry {what}; pass the format (--format / format=) from: {_names()}")


for _fmt in (
    Format("deepspeed", "a DeepSpeed checkpoint directory (latest, the tag folder, zero_to_fp32.py)",
           "tiercel.deepspeed.exporter:write", lambda m: DEEPSPEED_PUT in m.trees),
    Format("dcp", "a torch.distributed.checkpoint directory (__<rank>_0.distcp, .metadata)",
           "tiercel.dcp.export:write", lambda m: DCP_PUT in m.trees),
    Format("orbax", "a standard Orbax checkpoint", "tiercel.orbax.export:write", _is_orbax),
    Format("torch", "one torch.save file per saving rank (a plain save: Store.save, tiercel.torch.save_state)",
           "tiercel.torch_export:write", lambda m: not _is_adapters(m)),
    Format("safetensors", "Hugging Face safetensors files (sharded above max_shard_size, with an index)",
           "tiercel.safetensors_export:write"),
):
    register(_fmt)


# -- export --------------------------------------------------------------------------------


def fresh_dir(dest: str | os.PathLike) -> Path:
    """`dest` as an absolute path, checked to be a directory an export may write: absent or
    empty (an export never mixes its files with others')."""
    out = Path(dest).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidArgumentError(f"{out} exists and is not an empty directory; export writes a new one")
    return out


def resolve(store: Store, step: int | str, format: str | None) -> str:
    """The format to export `step` in: `format` when given (checked), else the detected one."""
    if format is not None:
        if format not in _FORMATS:
            raise InvalidArgumentError(f"unknown export format '{format}'; the formats: {_names()}")
        return format
    if isinstance(step, str) and not step.isdigit():  # a DeepSpeed tag names no step number to look at
        return "deepspeed"
    return detect(store, int(step))


def export(store: Store | PolicyLike, step: int | str, dest: str | os.PathLike, *, format: str | None = None,
           progress: Progress | None = None, **options: Any) -> Path:
    """Writes step `step` to the new directory `dest` in `format` (default: the format the step
    was saved in); returns the directory. `store`: an open Store, or a policy opened here as
    one process. `options` go to the format's exporter (safetensors: `max_shard_size`; orbax:
    `item`, `tiers`)."""
    with borrow(store) as opened:
        name = resolve(opened, step, format)
        out = fresh_dir(dest)
        return _FORMATS[name].load()(opened, step, out, progress=progress, **options)
