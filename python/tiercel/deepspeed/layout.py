"""What a tiercel step holds for DeepSpeed: the files DeepSpeed asked to write, as a small
directory tree kept in the step's `_deepspeed` put, and how a tag names a step.

A DeepSpeed save is `(save_dir, tag)` plus the files its ranks wrote under it (paths
relative to `save_dir`: `global_step7/mp_rank_00_model_states.pt`, or `pytorch_model.bin`
for `save_16bit_model`). Each file is one put of the rank that wrote it. Each rank's layout
lists every save of the step, in order, with that rank's own files, so a save needs no word
with the other ranks; a load merges the ranks' layouts (`merge`).

Tag -> step: `global_stepN` is step N; any other tag is the engine's global step at the
time of the save. Several saves at one step (`save_16bit_model` and `save_checkpoint` of
the same step, or two tags) share the step: a later save keeps the earlier files it does
not rewrite, as a directory on disk would.

Nothing here imports deepspeed or torch.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError

#: The put that holds a step's layout (no DeepSpeed file name starts with "_").
LAYOUT_PUT = "_deepspeed"
LAYOUT_FORMAT = "tiercel-deepspeed"
LAYOUT_VERSION = 1

#: Step directories have 12 digits (docs/format.md).
MAX_STEP = 10**12 - 1

_GLOBAL_STEP = re.compile(r"global_step(0|[1-9][0-9]*)")


def step_for_tag(tag: str, global_steps: int) -> int:
    """The step a save of `tag` goes to: N for DeepSpeed's own `global_stepN` tags, else the
    engine's global step (`global_steps`) when the save is made."""
    m = _GLOBAL_STEP.fullmatch(tag)
    step = int(m.group(1)) if m else global_steps
    if not 0 <= step <= MAX_STEP:
        raise InvalidArgumentError(f"DeepSpeed tag '{tag}': step {step} is outside 0..{MAX_STEP}")
    return step


def tag_step(tag: str) -> int | None:
    """The step a tag names by itself (`global_stepN` -> N), or None for any other tag, whose
    step is found in the layouts."""
    m = _GLOBAL_STEP.fullmatch(tag)
    return int(m.group(1)) if m else None


def norm_dir(path: str | os.PathLike) -> str:
    """The form a save directory is recorded and compared in: absolute, symlinks resolved."""
    return os.path.realpath(os.fspath(path))


@dataclass
class Save:
    """One DeepSpeed save: its directory, tag, whether it asked for `latest`, and its files
    (path relative to `dir` -> [rank, put])."""

    dir: str
    tag: str
    latest: bool
    global_steps: int
    files: dict[str, list] = field(default_factory=dict)

    def path(self, rel: str) -> str:
        return os.path.join(self.dir, rel)

    def is_checkpoint(self) -> bool:
        """A save_checkpoint (not a save_16bit_model): it has model states under its tag."""
        return any(rel.startswith(self.tag + "/") and rel.endswith("model_states.pt") for rel in self.files)

    def to_tree(self) -> dict[str, Any]:
        return {"dir": self.dir, "tag": self.tag, "latest": self.latest, "global_steps": self.global_steps,
                "files": {rel: list(owner) for rel, owner in self.files.items()}}

    @classmethod
    def from_tree(cls, d: dict[str, Any]) -> Save:
        return cls(d["dir"], d["tag"], d["latest"], d["global_steps"], {k: list(v) for k, v in d["files"].items()})


@dataclass
class Layout:
    """Every save a step holds, oldest first."""

    step: int
    saves: list[Save] = field(default_factory=list)

    def to_tree(self) -> dict[str, Any]:
        return {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "step": self.step,
                "saves": [s.to_tree() for s in self.saves]}

    @classmethod
    def from_tree(cls, d: Any, where: str) -> Layout:
        if not isinstance(d, dict) or d.get("format") != LAYOUT_FORMAT:
            raise InvalidArgumentError(f"{where}: '{LAYOUT_PUT}' is not a tiercel DeepSpeed layout")
        if d.get("version", 0) > LAYOUT_VERSION:
            raise InvalidArgumentError(f"{where}: DeepSpeed layout version {d['version']} is newer than this "
                                       f"tiercel reads ({LAYOUT_VERSION}); upgrade tiercel")
        return cls(d["step"], [Save.from_tree(s) for s in d["saves"]])

    def add(self, save: Save) -> None:
        """Adds a newer save. Files it rewrites (same directory and path) leave the older saves,
        as if both had been written to disk."""
        for old in self.saves:
            if old.dir == save.dir:
                old.files = {rel: o for rel, o in old.files.items() if rel not in save.files}
        self.saves.append(save)

    def put_names(self, rank: int) -> set[str]:
        return {o[1] for s in self.saves for o in s.files.values() if o[0] == rank}

    def owner(self, path: str) -> tuple[Save, str, int, str] | None:
        """(save, relative path, rank, put) of the file at `path` (any spelling of it)."""
        full = norm_dir(path)
        for save in reversed(self.saves):
            rel = os.path.relpath(full, save.dir)
            if rel in save.files:
                rank, put = save.files[rel]
                return save, rel, rank, put
        return None

    def glob(self, pattern: str) -> list[str]:
        """The files a `glob.glob(pattern)` would find in this step, sorted, spelled with the
        pattern's own directory (the glob over the tag folder that DeepSpeed runs before it
        loads anything)."""
        head, tail = os.path.split(pattern)
        tag_dir = norm_dir(head)
        out = []
        for save in self.saves:
            for rel in save.files:
                full = save.path(rel)
                if os.path.dirname(full) == tag_dir and fnmatch.fnmatchcase(os.path.basename(full), tail):
                    out.append(os.path.join(head, os.path.basename(full)))
        return sorted(set(out))

    def checkpoints(self, load_dir: str | None = None, tag: str | None = None) -> list[Save]:
        """The loadable saves (checkpoints, not 16-bit model files), newest last, of one
        directory and/or tag."""
        return [s for s in self.saves if s.is_checkpoint() and (load_dir is None or s.dir == load_dir)
                and (tag is None or s.tag == tag)]

    @classmethod
    def merge(cls, layouts: list[Layout], where: str) -> Layout:
        """One view of a step from every rank's layout: each save with all ranks' files, a
        later save's file replacing an earlier one at the same path, saves left without
        files dropped."""
        first = layouts[0]
        for rank, other in enumerate(layouts):
            if [(s.dir, s.tag) for s in other.saves] != [(s.dir, s.tag) for s in first.saves]:
                raise InvalidArgumentError(f"{where}: rank {rank} recorded other DeepSpeed saves "
                                           f"({other.describe()}) than rank 0 ({first.describe()})")
        saves = []
        for i, s in enumerate(first.saves):
            files: dict[str, list] = {}
            for other in layouts:
                files.update(other.saves[i].files)
            saves.append(Save(s.dir, s.tag, s.latest, s.global_steps, files))
        merged = cls(first.step)
        for save in saves:
            merged.add(save)
        merged.saves = [s for s in merged.saves if s.files]
        return merged

    def describe(self) -> str:
        return ", ".join(f"'{s.tag}' in {s.dir}" for s in self.saves) or "nothing"
