"""Export: a step as the directory DeepSpeed's own TorchCheckpointEngine would have written
(`latest`, the tag folder with the same file names, zero_to_fp32.py), which stock DeepSpeed
loads and zero_to_fp32.py converts without tiercel.

Needs torch (each file is written with torch.save), not deepspeed: zero_to_fp32.py is copied
from an installed deepspeed when there is one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import stat
from pathlib import Path

from .. import exports
from ..errors import InvalidArgumentError
from ..exports import Progress
from ..step_view import StepView
from ..store import PolicyLike, Store
from .layout import Layout, Save
from .resolve import find_local, merged_layout

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def export(store: Store | PolicyLike, step_or_tag: int | str, out_dir: str | os.PathLike, *,
           progress: Progress | None = None) -> str:
    """Writes step `step_or_tag` (a step number, or a DeepSpeed tag such as "global_step40"
    or "best") as a plain DeepSpeed checkpoint directory under `out_dir` (new or empty);
    returns its path.

    `store` is an open tiercel.Store, or a policy (opened here as a single process, as the
    CLI does). Each file is written to a temporary name and renamed, and `latest` last: an
    interrupted export never looks complete. `progress(done_bytes, total_bytes)` is called
    after each file."""
    return str(exports.export(store, step_or_tag, out_dir, format="deepspeed", progress=progress))


def write(store: Store, step_or_tag: int | str, out: Path, *, progress: Progress | None = None) -> Path:
    """The registry's exporter (tiercel.exports): `out` is new or empty."""
    _, saves, view = select(store, step_or_tag)
    files = step_files(saves)
    reader = view.reader
    sizes = {rel: sum(it.nbytes for it in reader(rank).items(put)) for rel, (rank, put) in files.items()}
    total = sum(sizes.values())
    import torch

    out.mkdir(parents=True, exist_ok=True)
    done = 0
    for rel in sorted(files):
        rank, put = files[rel]
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".tmp-{dest.name}")
        torch.save(reader(rank).get(put), tmp)
        os.replace(tmp, dest)
        done += sizes[rel]
        if progress is not None:
            progress(done, total)
    checkpoints = [s for s in saves if s.is_checkpoint()]
    if any("optim_states" in rel for s in checkpoints for rel in s.files):
        copy_recovery_scripts(out)
    latest = [s for s in checkpoints if s.latest] or checkpoints
    if latest:
        _write(out / "latest", latest[-1].tag)
    return out


def step_files(saves: list[Save]) -> dict[str, tuple[int, str]]:
    """The files of the saves, by path under the save directory: (rank, put). Later saves win
    where two wrote the same path (as they would have on disk)."""
    files: dict[str, tuple[int, str]] = {}
    for s in saves:
        for rel, (rank, put) in s.files.items():
            files[rel] = (rank, put)
    return files


def select(store: Store, step_or_tag: int | str) -> tuple[Layout, list[Save], StepView]:
    """The layout and the saves to export (every save of a step, or the newest of a tag),
    and the step's view, whose per-rank readers (opened once) read the files."""
    if isinstance(step_or_tag, bool) or not isinstance(step_or_tag, (int, str)):
        raise InvalidArgumentError(f"export takes a step number or a DeepSpeed tag, got {step_or_tag!r}")
    if isinstance(step_or_tag, int) or step_or_tag.isdigit():
        view = StepView(store, int(step_or_tag), trust_pickles=True)
        layout = merged_layout(store, int(step_or_tag), view)
        return layout, layout.saves, view
    found = find_local(store, step_or_tag, checkpoints_only=False)
    saves = [s for s in found.layout.saves if s.tag == step_or_tag and s.dir == found.save.dir]
    return found.layout, saves, StepView(store, found.layout.step, trust_pickles=True)


def copy_recovery_scripts(save_dir: str | os.PathLike) -> None:
    """DeepSpeed's recovery scripts (zero_to_fp32.py, ...) into `save_dir`, from the installed
    deepspeed (found without importing it), when there is one: for export, and for every save
    of an attached engine in place of DeepSpeed's own copy, which truncates the script first
    (a process killed right then left an empty zero_to_fp32.py in save_dir). Each goes through
    a temporary name and a rename: a killed copy leaves the old script whole. (No fsync: this
    runs on the training thread at every save, as DeepSpeed's copy does.)"""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return
    utils = Path(spec.origin).parent / "utils"
    for name in RECOVERY_SCRIPTS:
        src = utils / name
        if src.is_file():
            dest = Path(save_dir) / name
            # One fixed temporary name per script: a killed copy's is taken by the next one.
            tmp = dest.with_name(f".tmp-{name}")
            shutil.copyfile(src, tmp)
            with contextlib.suppress(PermissionError):  # some file shares refuse it; DeepSpeed goes on too
                tmp.chmod(tmp.stat().st_mode | stat.S_IEXEC)
            os.replace(tmp, dest)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)
