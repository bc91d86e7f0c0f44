"""DeepSpeed's own files under `save_dir`, written in the background (`attach(engine, policy,
mirror=True)`, or TIERCEL_DEEPSPEED_MIRROR=1): for the tools that read them (zero_to_fp32.py,
`torch.load` of a model-states file, ds_to_universal.py), with tiercel's saves as they are.

After a save's snapshot is in the memory tier, a thread of each rank reads that rank's files
of the save back from tiercel (from shared memory, never from the live tensors, which
training is changing by then) and writes each with torch.save, as DeepSpeed's
TorchCheckpointEngine would. Nothing of this runs on the training thread.

What a reader of `save_dir` sees, whatever moment a process is killed at:

- A tag folder appears whole or not at all. Its files are written into a staging folder
  `save_dir/.tiercel-staging/<save id>/` (each to a temporary name, fsynced, renamed); each
  rank then leaves a marker `<save id>.rank-NNNNN`. Rank 0, once every rank's marker is
  there, renames the staging folder to `save_dir/<tag>` (a folder of that tag from an
  earlier save is moved aside first, and removed after). Where a rank could not write its
  files (retention removed the step before the mirror, behind the saves, read it back; the
  save itself failed), its marker says so, and rank 0 drops the staging folder instead: that
  tag is skipped, the next save's is written.
- `latest` names a tag only once its folder is whole: DeepSpeed's own write of `latest` is
  turned off (its save_checkpoint runs with save_latest=False) and rank 0 writes `latest`
  (temporary name, rename) after the folder's rename.
- Files outside the tag folder (save_16bit_model's) are written in place, each through a
  temporary name and a rename.

A killed process leaves at most a staging folder, which rank 0 removes at its next save
(the save id names the launch: folders of other launches are leftovers). `save_dir` must be
on a filesystem every rank sees (as zero_to_fp32.py needs anyway). Every save is written, as
DeepSpeed would write it: nothing is pruned.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import NotFoundError, TiercelError
from ..step import Reader, SaveHandle
from ..store import Store
from .layout import Save
from .snapshot import Snapshot

log = logging.getLogger("tiercel.deepspeed")

#: The environment knob that turns the mirror on for every attach() of the process.
ENV = "TIERCEL_DEEPSPEED_MIRROR"
STAGING = ".tiercel-staging"
#: A rank's marker when it wrote its files of a save (otherwise the marker says why not).
OK = "ok"
#: How long rank 0 waits for the other ranks' files of a save before it gives up on that
#: save's tag folder and `latest` (a rank died; the job is failing anyway).
RANKS_WAIT_S = 600.0
#: How long a rank waits for its save to be committed in the memory tier.
COMMIT_WAIT_S = 60.0
#: How many recent steps' newest saves the mirror remembers (a step is saved again right
#: after its first save, or not at all).
_STEPS_KEPT = 4


def enabled(mirror: bool | None) -> bool:
    """attach()'s `mirror`, else $TIERCEL_DEEPSPEED_MIRROR (1/true/yes/on)."""
    if mirror is not None:
        return mirror
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Mirror:
    """One rank's writer of DeepSpeed's files, one save at a time, in save order. `launch`:
    a token every rank of this launch of the job shares (attach agrees on it)."""

    def __init__(self, store: Store, launch: str):
        self.store = store
        self.launch = launch
        self._saves = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercel-mirror")
        self._last: Future | None = None
        #: The last save whose files this rank wrote ((tag, seconds)), and the last error.
        self.last_written: tuple[str, float] | None = None
        self.last_error: BaseException | None = None
        #: The newest save of each recent step: it carries this rank's files of the step's
        #: earlier saves under the same put names (DeepSpeedEngine.commit).
        self._newest: dict[int, Snapshot] = {}

    def submit(self, snapshot: Snapshot, save: Save, files: dict[str, str]) -> None:
        """Queues the files of one save (relative path -> put), written once `snapshot`
        has committed the step. Every rank calls it for every save, files or not."""
        self._saves += 1
        save_id = f"{self.launch}-{self._saves:06d}"
        self._newest[snapshot.step] = snapshot
        for old in sorted(self._newest)[:-_STEPS_KEPT]:
            del self._newest[old]
        self._last = self._executor.submit(self._run, snapshot, save, dict(files), save_id)

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the queued saves' files (and, on rank 0, their tag folders and `latest`)."""
        if self._last is not None:
            self._last.result(timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # -- on the mirror thread ---------------------------------------------------------------

    def _run(self, snapshot: Snapshot, save: Save, files: dict[str, str], save_id: str) -> None:
        t0 = time.perf_counter()
        try:
            snapshot.join()
            if snapshot.error is not None:  # the save failed (and says so on the training thread)
                status = f"the save failed: {snapshot.error}"
            else:
                try:
                    self._write_rank(snapshot, save, files, save_id)
                    status = OK
                except TiercelError as e:
                    # Retention removed the step before this thread read it: the mirror is
                    # behind the saves. The tag is skipped; a later save's is written.
                    status = f"not read back from tiercel: {e}"
                except Exception as e:  # noqa: BLE001 - a full disk, a permission: said in the marker
                    status = f"not written: {type(e).__name__}: {e}"
            # Every rank leaves its marker, whatever happened: rank 0 waits for them all.
            os.makedirs(os.path.join(save.dir, STAGING), exist_ok=True)
            _write_bytes(self._marker(save, save_id, self.store.rank), status.encode())
            if self.store.rank == 0:
                self._publish(save, save_id)
            if status == OK:
                self.last_written = (save.tag, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - a failed copy must not stop training
            self.last_error = e
            log.error("tiercel: DeepSpeed's files of '%s' (%s) were not written under %s: %s", save.tag, save_id,
                      save.dir, e)

    @staticmethod
    def _marker(save: Save, save_id: str, rank: int) -> str:
        return os.path.join(save.dir, STAGING, f"{save_id}.rank-{rank:05d}")

    def _write_rank(self, snapshot: Snapshot, save: Save, files: dict[str, str], save_id: str) -> None:
        """This rank's files of the save: those of the tag folder into the staging folder,
        the others in place."""
        if not files:
            return
        staging = os.path.join(save.dir, STAGING, save_id)
        reader = self._reader(snapshot)
        for rel in sorted(files):
            inside = rel.startswith(save.tag + "/")
            dest = os.path.join(staging, os.path.relpath(rel, save.tag)) if inside else os.path.join(save.dir, rel)
            write_file(reader.get(files[rel]), dest)

    def _reader(self, snapshot: Snapshot) -> Reader:
        """This rank's part of the step, once the memory tier committed it (a few
        milliseconds after the snapshot on the slowest rank of the host). A step retention
        removed since raises NotFoundError at once. Where the step was saved again before this
        thread got to it (save_16bit_model, then save_checkpoint of the same tag: the other
        ranks' second save replaces the first before it is read here), the newer save is read:
        it carries this save's files under the same names."""
        memory = self.store.tiers()[0]["name"]
        while True:
            handle = snapshot.handle
            assert handle is not None
            state = _final_state(handle, memory)
            if state == "committed":
                try:
                    return Reader(self.store, snapshot.step, trust_pickles=True)
                except NotFoundError:  # committed, and taken back since by a newer save of the step
                    newer = self._newer(snapshot)
                    if newer is None:
                        raise
            else:
                newer = self._newer(snapshot) if state.startswith("skipped") else None
                if newer is None:
                    raise TiercelError(f"step {snapshot.step}: the memory tier '{memory}' {state}")
            newer.join()
            if newer.error is not None:
                raise TiercelError(f"step {snapshot.step}: the memory tier '{memory}' {state}, and the save "
                                   f"that replaced it failed: {newer.error}")
            snapshot = newer

    def _newer(self, snapshot: Snapshot) -> Snapshot | None:
        """The save of the same step submitted after `snapshot`, if one was (the training
        thread submits it just after starting its snapshot: a moment is allowed for that)."""
        deadline = time.monotonic() + 2.0
        while (newer := self._newest.get(snapshot.step, snapshot)) is snapshot:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return newer

    def _publish(self, save: Save, save_id: str) -> None:
        """Rank 0: once every rank's marker is there, the tag folder and `latest`, if every
        rank wrote its files; else the staging folder goes."""
        root = os.path.join(save.dir, STAGING)
        staging = os.path.join(root, save_id)
        markers = [self._marker(save, save_id, r) for r in range(self.store.world_size)]
        deadline = time.monotonic() + RANKS_WAIT_S
        while not all(os.path.exists(m) for m in markers):
            if time.monotonic() > deadline:
                missing = [r for r, m in enumerate(markers) if not os.path.exists(m)]
                raise TiercelError(f"ranks {missing} did not write their files of '{save.tag}' within "
                                   f"{RANKS_WAIT_S:.0f} s: the tag folder and `latest` are left as they were")
            time.sleep(0.05)
        self._remove_leftovers(root)
        failed = {}
        for r, m in enumerate(markers):
            with open(m, "rb") as f:
                status = f.read().decode()
            if status != OK:
                failed[r] = status
        if failed:
            shutil.rmtree(staging, ignore_errors=True)
            log.warning("tiercel: DeepSpeed's files of '%s' are not written under %s (%s); `latest` stays as it was. "
                        "The files of a step are read back from tiercel after the save: give the memory tier a `keep` "
                        "that covers the saves the disk is behind", save.tag, save.dir,
                        "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))
        else:
            if os.path.isdir(staging):
                tag_dir = os.path.join(save.dir, save.tag)
                old = f"{staging}.old"
                if os.path.exists(tag_dir):
                    os.rename(tag_dir, old)
                os.rename(staging, tag_dir)
                _fsync_dir(save.dir)
                shutil.rmtree(old, ignore_errors=True)
            if save.latest:
                _write_bytes(os.path.join(save.dir, "latest"), save.tag.encode())
        for m in markers:
            os.unlink(m)

    def _remove_leftovers(self, root: str) -> None:
        """Staging folders and markers of earlier launches (killed while writing), and their
        temporary files. This launch's stay: another rank may be writing its marker of a later
        save right now (under a temporary name, which was taken for a leftover: its rename
        failed, and rank 0 waited for that marker until RANKS_WAIT_S)."""
        for name in os.listdir(root):
            if not _save_id_of(name).startswith(self.launch + "-"):
                path = os.path.join(root, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)


def _final_state(handle: SaveHandle, memory: str) -> str:
    """The memory tier's state of the save once it is final, or after COMMIT_WAIT_S."""
    deadline = time.monotonic() + COMMIT_WAIT_S
    while (state := handle.states().get(memory, "missing")) != "committed":
        if state.startswith(("failed", "skipped", "missing", "not scheduled")):
            return state
        if time.monotonic() > deadline:  # "running", or "written" while another rank of the host copies
            return f"has not committed it after {COMMIT_WAIT_S:.0f} s (still {state})"
        time.sleep(0.01)
    return state


def _save_id_of(name: str) -> str:
    """The save id that a name in the staging root starts with, a temporary name's too
    (`.tmp-<pid>-<save id>.rank-NNNNN`, see `_write_bytes`)."""
    return name.split("-", 2)[-1] if name.startswith(".tmp-") else name


def write_file(value: Any, dest: str) -> None:
    """One DeepSpeed file, as torch.save writes it, through a temporary name: fsynced, then
    renamed into place."""
    import torch

    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = os.path.join(os.path.dirname(dest), f".tmp-{os.getpid()}-{os.path.basename(dest)}")
    with open(tmp, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)


def _write_bytes(dest: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(dest), f".tmp-{os.getpid()}-{os.path.basename(dest)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
