"""DeepSpeed's own files under save_dir, written in the background by tiercel's mirror
(`attach(engine, policy, mirror=True)`, tiercel/deepspeed/mirror.py), with real DeepSpeed on
the CPU: two ranks on gloo, as tests/test_deepspeed.py runs them.

- The tools that read save_dir work on it: zero_to_fp32.py converts it and `torch.load`
  loads the model-states file, each file equal to what tiercel holds for the step (its
  export), and the job still loads from tiercel.
- A kill in the middle of the mirror's write never leaves `latest` naming a torn tag folder;
  the next launch removes the leftovers.
- A kill while rank 0 copies DeepSpeed's zero_to_fp32.py into save_dir (it does at every
  save, on the training thread) leaves the script of the save before whole.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from test_deepspeed import fp32_of, plain, run_job

import tiercel.deepspeed
from tiercel.deepspeed.mirror import STAGING, Mirror

from conftest import assert_same, make_policy

pytest.importorskip("deepspeed")  # the ranks run it; this process never imports it

STEPS = 3


def tag_files(d: Path) -> dict[str, object]:
    """Every file of a tag folder, loaded as torch.load would (plain values, to compare)."""
    return {f.name: plain(torch.load(f, weights_only=False)) for f in sorted(d.iterdir())}


def assert_whole(save_dir: Path, tag: str, policy: dict, tmp_path: Path) -> None:
    """`tag`'s folder under save_dir holds exactly what tiercel holds for that step, file by
    file, and zero_to_fp32.py converts it to what it converts tiercel's export to."""
    export = tmp_path / f"export-{tag}"
    tiercel.deepspeed.export(policy, tag, export)
    assert tag_files(save_dir / tag).keys() == tag_files(export / tag).keys()
    assert_same(tag_files(save_dir / tag), tag_files(export / tag), tag)
    models = sorted((save_dir / tag).glob("*model_states.pt"))
    for path in models:  # mp_rank_00_model_states.pt, or one per rank under ZeRO-3
        model = torch.load(path, weights_only=False)
        assert model["global_steps"] == int(tag.removeprefix("global_step")), path
    assert models
    assert_same(fp32_of(save_dir, tmp_path / f"fp32-{tag}"), fp32_of(export, tmp_path / f"fp32-export-{tag}"))


@pytest.mark.parametrize("stage,lag", [(2, True), (3, False)])
def test_the_mirror_writes_files_that_zero_to_fp32_and_torch_load_read(stage, lag, tmp_path, shm_root, disk_root):
    """Every tag is written while each step stays in RAM until the mirror has read it. With
    `lag`, the mirror reads step 1 only after retention (`keep = 1`, no disk tier) removed
    it: that tag is skipped whole, with a warning, and the later ones are written."""
    policy = make_policy(shm_root, None, ram={"keep": 1}) if lag else make_policy(shm_root, disk_root, ram={"keep": 5})
    save_dir = tmp_path / "ckpt"
    cfg = {"stage": stage, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(save_dir), "mirror": True}
    # save_16bit_model before the last checkpoint: its file lands in save_dir itself.
    run_job(tmp_path, {**cfg, "model_file": True, "mirror_lag": lag}, "trained")
    assert (save_dir / "latest").read_text() == f"global_step{STEPS}"
    tags = sorted(p.name for p in save_dir.iterdir() if p.name.startswith("global_step"))
    if lag:
        assert "global_step1" not in tags and f"global_step{STEPS}" in tags, tags
        assert "DeepSpeed's files of 'global_step1' are not written" in (tmp_path / "trained-0.out").read_text()
    else:
        assert tags == [f"global_step{s}" for s in range(1, STEPS + 1)]
    for tag in tags:  # whichever were written are whole
        assert sorted(os.listdir(save_dir / tag)) == sorted(os.listdir(save_dir / f"global_step{STEPS}")), tag
    assert not list((save_dir / STAGING).iterdir()), "staging folders or markers left behind"
    assert not [p for p in save_dir.rglob(".tmp-*")], "temporary files left behind"
    assert_whole(save_dir, f"global_step{STEPS}", policy, tmp_path)
    if not lag:
        # With `keep = 1` the model file's save may be gone (retention, at the last
        # checkpoint's save) before a lagging mirror reaches it: skipped like a tag, not checked.
        model_file = torch.load(save_dir / "pytorch_model.bin", weights_only=False)
        assert_same(dict(model_file), dict(torch.load(tmp_path / f"export-global_step{STEPS}" / "pytorch_model.bin",
                                                      weights_only=False)))

    # The job still loads from tiercel (the files on disk are for other tools).
    resumed = run_job(tmp_path, {**cfg, "steps": STEPS + 1, "resume": True}, "resumed")
    for r in resumed:
        assert r["loaded"]["global_steps"] == STEPS and set(r["loaded"]["tiers"]) == {"ram"}, r["loaded"]
    assert (save_dir / "latest").read_text() == f"global_step{STEPS + 1}"


def test_a_kill_while_the_mirror_writes_never_leaves_latest_at_a_torn_tag(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, ram={"keep": 3}, every=1)
    save_dir = tmp_path / "ckpt"
    cfg = {"stage": 2, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(save_dir), "mirror": True}
    # Rank 0 (which publishes tag folders and `latest`) dies on its mirror thread right after
    # the first file of step 2's save: one file of the tag written, the others not.
    killed = run_job(tmp_path, {**cfg, "mirror_kill": 2, "victim": 0}, "killed", victim=0)
    # Rank 1 may have finished its own saves and report before rank 0's mirror, behind the
    # training, reached step 2: only rank 0 surely has none.
    assert [r["rank"] for r in killed] in ([], [1]), killed
    # Step 1 was published before step 2's files were started (one save at a time, in order);
    # step 2's file went to a staging folder, never to a tag folder `latest` names.
    assert (save_dir / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith("global_step")) == ["global_step1"]
    assert [p for p in (save_dir / STAGING).iterdir() if p.is_dir()], "no staging folder: the kill came too late"
    assert_whole(save_dir, "global_step1", policy, tmp_path)

    # The next launch resumes from tiercel, removes the leftovers and publishes its own saves.
    resumed = run_job(tmp_path, {**cfg, "steps": STEPS + 1, "resume": True}, "resumed")
    step = resumed[0]["loaded"]["global_steps"]
    assert step in (2, 3), resumed[0]["loaded"]  # rank 1's later saves may be committed
    assert (save_dir / "latest").read_text() == f"global_step{STEPS + 1}"
    assert not list((save_dir / STAGING).iterdir()), "the killed launch's staging folder was not removed"
    assert_whole(save_dir, f"global_step{STEPS + 1}", policy, tmp_path)
    assert os.listdir(save_dir / f"global_step{STEPS + 1}")


def test_a_kill_while_rank_0_copies_zero_to_fp32_leaves_the_script_whole(tmp_path, shm_root, disk_root):
    """DeepSpeed's own copy opens save_dir/zero_to_fp32.py truncated, then writes it: rank 0
    killed in between (here at step 2's save; in the test above, by its mirror thread while
    the training thread copied) left an empty script, which then had no
    convert_zero_checkpoint_to_fp32_state_dict. attach() copies through a temporary name."""
    policy = make_policy(shm_root, disk_root, ram={"keep": 3}, every=1)
    save_dir = tmp_path / "ckpt"
    cfg = {"stage": 2, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(save_dir), "mirror": True}
    assert run_job(tmp_path, {**cfg, "script_kill": 2, "victim": 0}, "killed", victim=0) == []
    spec = importlib.util.find_spec("deepspeed")  # found, not imported
    assert spec is not None and spec.origin is not None
    stock = (Path(spec.origin).parent / "utils" / "zero_to_fp32.py").read_bytes()
    assert (save_dir / "zero_to_fp32.py").read_bytes() == stock, "step 1's zero_to_fp32.py is torn"


def test_rank_0_removes_only_earlier_launches_leftovers_from_the_staging_folder(tmp_path):
    """Rank 0, publishing a save, removes what killed launches left in the staging root, but
    nothing of its own launch: another rank may be writing its marker of the next save under
    a temporary name. (Removing that file failed the marker's rename, and rank 0 waited 10
    minutes for the marker: a busy machine's failure of the test above, with `lag`.)"""
    root = tmp_path / STAGING
    folders = ["new0-000003", "old0-000001"]  # staging folders of a save, the rest markers
    ours = ["new0-000003", "new0-000004.rank-00000", ".tmp-4242-new0-000004.rank-00001"]
    theirs = ["old0-000001", "old0-000001.rank-00000", ".tmp-99-old0-000002.rank-00001"]
    root.mkdir()
    for name in ours + theirs:
        if name in folders:
            (root / name).mkdir()
            (root / name / "mp_rank_00_model_states.pt").write_bytes(b"x")
        else:
            (root / name).write_bytes(b"ok")
    mirror = Mirror(None, "new0")  # type: ignore[arg-type]  # the staging root is all it reads
    try:
        mirror._remove_leftovers(str(root))
    finally:
        mirror.close()
    assert sorted(os.listdir(root)) == sorted(ours)
