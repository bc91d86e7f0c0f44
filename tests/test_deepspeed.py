"""DeepSpeed through tiercel, with real DeepSpeed on the CPU (DS_ACCELERATOR=cpu): two ranks
on gloo over loopback, each a process started as a launcher would (tests/ds_worker.py).

- ZeRO 0, 1, 2, 3: train saving every step, SIGKILL a rank right after a save, restart the
  job, load_checkpoint, continue: every later loss and the final parameters, optimizer and
  scheduler state equal an uninterrupted run's bit for bit.
- A host's RAM wiped: its rank restores from the peer tier, bit-identical.
- Export: stock DeepSpeed (no tiercel) loads the exported directory to the same state, and
  zero_to_fp32.py converts it; save_16bit_model and save_checkpoint at one step both kept.
- Bad input: clear errors naming the tag and the tiers searched, nothing changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_peer import base  # noqa: F401 - the fixture: a run directory with per-host /dev/shm roots

import tiercel
import tiercel.deepspeed
from tiercel.deepspeed.layout import Layout, Save, step_for_tag

from conftest import PYTHON, assert_same, child_env, make_policy
from test_multirank import run_ranks

pytest.importorskip("deepspeed")  # the ranks run it; this process never imports it

WORLD = 2
STEPS = 4
KILL_AFTER = 2
RUN = "from ds_worker import main; main()"
VENV_BIN = str(Path(sys.executable).parent)


def ds_env(rank: int, extra: dict[str, str] | None = None, accelerator: str = "cpu") -> dict[str, str]:
    """DeepSpeed on the CPU (or `accelerator`); its JIT-built communication op is cached across
    runs, and ninja (from the virtualenv) builds it the first time."""
    return {
        "DS_ACCELERATOR": accelerator,
        "LOCAL_RANK": str(rank),
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/tiercel/torch_extensions")),
        "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
        **(extra or {}),
    }


def run_job(tmp_path: Path, cfg: dict, tag: str, *, victim: int | None = None, hosts: list[str] | None = None,
            world: int = WORLD, accelerator: str = "cpu") -> list[dict]:
    """Runs the ranks of tests/ds_worker.py; returns the reports of those that finished."""
    out = tmp_path / tag
    cfg = {**cfg, "out": str(out)}
    env_of = lambda r: ds_env(r, {"TIERCEL_HOST": hosts[r]} if hosts else None, accelerator)  # noqa: E731
    run_ranks(RUN, [json.dumps(cfg)], tmp_path, world, env_of, tag=tag, victim=victim)
    return [json.loads((out / f"report-{r}.json").read_text()) for r in range(world) if (out / f"report-{r}.json").exists()]


def dump(tmp_path: Path, tag: str, kind: str, rank: int) -> dict:
    return torch.load(tmp_path / tag / f"{kind}-{rank}.pt", weights_only=False, map_location="cpu")


def plain(x: Any) -> Any:
    """A state with DeepSpeed's small objects (LossScaler, ...) turned into their attributes,
    so that assert_same compares them by value."""
    if isinstance(x, dict):
        out = type(x)()
        for k, v in x.items():
            out[k] = plain(v)
        return out
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(plain(v) for v in x)
    if hasattr(x, "__dict__") and not isinstance(x, (torch.Tensor, type)):
        return {"__class__": type(x).__qualname__, **{k: plain(v) for k, v in vars(x).items()}}
    return x


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each configuration, without tiercel and without saves: its
    losses and final state are what every interrupted, resumed run must reproduce."""
    runs: dict[tuple, tuple[Path, list[dict]]] = {}

    def get(stage: int, bf16: bool = False) -> tuple[Path, list[dict]]:
        if (stage, bf16) not in runs:
            tmp = tmp_path_factory.mktemp(f"reference-{stage}-{int(bf16)}")
            cfg = {"stage": stage, "bf16": bf16, "steps": STEPS, "mode": "plain"}
            runs[stage, bf16] = (tmp, run_job(tmp, cfg, "ref"))
        return runs[stage, bf16]

    return get


def assert_continues_like(reference_run: tuple[Path, list[dict]], tmp_path: Path, tag: str, resumed: list[dict]) -> int:
    """The resumed run's later losses and final state are the reference's, bit for bit;
    returns the step it resumed from."""
    ref_tmp, ref = reference_run
    steps = {r["loaded"]["global_steps"] for r in resumed}
    assert len(steps) == 1, f"the ranks resumed from different steps: {resumed}"
    step = steps.pop()
    for r in range(len(ref)):
        later = {s: v for s, v in ref[r]["losses"].items() if int(s) > step}
        assert resumed[r]["losses"] == later, f"rank {r}: losses after step {step} differ"
        assert resumed[r]["loaded"]["client_state"]["data_step"] == step
        assert_same(plain(dump(tmp_path, tag, "final", r)), plain(dump(ref_tmp, "ref", "final", r)), f"rank {r} final")
    return step


# -- ZeRO 0-3: kill a rank, restart, resume ------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_kill_a_rank_after_a_save_then_resume_bit_identical(stage, tmp_path, shm_root, disk_root, reference):
    policy = make_policy(shm_root, disk_root, ram={"keep": 3}, every=2)
    cfg = {"stage": stage, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(tmp_path / "ckpt")}
    victim = stage % 2
    killed = run_job(tmp_path, {**cfg, "kill_after": KILL_AFTER, "victim": victim}, "killed", victim=victim)
    assert killed == [], "a rank finished although its peer was killed"
    # The save directory holds only what DeepSpeed writes itself (`latest`, the recovery
    # scripts); the checkpoint is in tiercel.
    assert not (tmp_path / "ckpt" / f"global_step{KILL_AFTER}").exists()
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{KILL_AFTER}"

    resumed = run_job(tmp_path, {**cfg, "resume": True}, "resumed")
    step = assert_continues_like(reference(stage), tmp_path, "resumed", resumed)
    # The step saved right before the kill is committed unless the killed rank's background
    # commit had not run yet; then the job resumes one step earlier, never more.
    assert step in (KILL_AFTER - 1, KILL_AFTER), step
    for r in resumed:
        assert set(r["loaded"]["tiers"]) == {"ram"}, r["loaded"]
        assert r["states"]["ram"] in ("committed", "written"), r["states"]
    # No placeholder DeepSpeed needed during the load is left behind.
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(["latest"] + (["zero_to_fp32.py", "zero_to_torch.py"] if stage else []))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_snapshot_racing_the_next_update_and_a_kill_during_it_resume_bit_identical(stage, tmp_path, shm_root, disk_root,
                                                                                      reference):
    """save_checkpoint returns before the tensors are copied: each snapshot here sleeps first,
    so the next optimizer step must wait for it (a stall, measured), and the victim dies while
    its last snapshot sleeps: its step was never committed, the job resumes one step earlier,
    and a run whose every save races the next update ends bit-identical to the reference."""
    policy = make_policy(shm_root, disk_root, ram={"keep": 3}, every=2)
    cfg = {"stage": stage, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(tmp_path / "ckpt"),
           "snapshot_delay": 0.3}
    victim = 1
    killed = run_job(tmp_path, {**cfg, "kill_after": KILL_AFTER, "victim": victim}, "killed", victim=victim)
    assert killed == [], "a rank finished although its peer was killed"

    resumed = run_job(tmp_path, {**cfg, "resume": True}, "resumed")
    step = assert_continues_like(reference(stage), tmp_path, "resumed", resumed)
    assert step == KILL_AFTER - 1, "the victim's last snapshot never finished: its step must not be restorable"
    for r in resumed:
        assert r["loaded"]["client_state"]["ema"] == [float(step)] * 8, r["loaded"]
        # Only the job's own tensor was copied while the save blocked; DeepSpeed's (parameters,
        # ZeRO's partitions, optimizer states) went to the snapshot.
        # (by the ranks that write model states: rank 0; every rank under ZeRO-3).
        assert r["copied_bytes"] == (8 * 4 if r["rank"] == 0 or stage == 3 else 0), r
        # Every save but the last was followed by an update that waited for its snapshot.
        assert r["stalls"]["count"] == STEPS - step - 1, r["stalls"]
        assert r["stalls"]["seconds"] > 0.1 * r["stalls"]["count"], r["stalls"]
        # ... and the store's metrics say the same (store.metrics().timings, Prometheus).
        timing = r["stall_timing"]
        assert (timing["count"], timing["seconds"]) == (r["stalls"]["count"], pytest.approx(r["stalls"]["seconds"])), r


def test_bf16_zero2_resumes_bit_identical(tmp_path, shm_root, disk_root, reference):
    policy = make_policy(shm_root, disk_root, ram={"keep": 3}, every=2)
    cfg = {"stage": 2, "bf16": True, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(tmp_path / "ckpt")}
    run_job(tmp_path, {**cfg, "steps": KILL_AFTER}, "first")
    resumed = run_job(tmp_path, {**cfg, "resume": True}, "resumed")
    assert assert_continues_like(reference(2, True), tmp_path, "resumed", resumed) == KILL_AFTER
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        files = store.reader(KILL_AFTER, rank=0).names()  # saved by 2 ranks: rank 0's part, on purpose
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in files, files


# -- a host loses its RAM ------------------------------------------------------------------


def test_a_wiped_host_restores_from_its_peer(tmp_path, base, reference):  # noqa: F811
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": f"{base}/shm/{{host}}", "keep": 2},
            {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2},
        ],
        "restore": {"order": ["ram", "peer"]},
        "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
    }
    hosts = ["hostA", "hostB"]
    cfg = {"stage": 2, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(tmp_path / "ckpt")}
    saved = run_job(tmp_path, {**cfg, "steps": KILL_AFTER}, "saved", hosts=hosts)
    assert all(r["states"]["peer"] == "committed" for r in saved), saved
    shutil.rmtree(base / "shm" / "hostB")  # a replacement machine: no RAM copies, no replicas
    shutil.rmtree(tmp_path / "ckpt")  # ... and no local disk: not even `latest`
    resumed = run_job(tmp_path, {**cfg, "resume": True}, "resumed", hosts=hosts)
    assert assert_continues_like(reference(2), tmp_path, "resumed", resumed) == KILL_AFTER
    # Rank 1 (host B) read its own shard from its peer; the model states, which rank 0
    # wrote and host B no longer holds, from host A's RAM too (host A's peer server serves
    # its own memory tier's steps), not broadcast by rank 0. Rank 0 read everything from RAM.
    assert set(resumed[0]["loaded"]["tiers"]) == {"ram"}, resumed[0]["loaded"]
    assert set(resumed[1]["loaded"]["tiers"]) == {"peer"}, resumed[1]["loaded"]


# -- export: no lock-in --------------------------------------------------------------------


def toml_policy(policy: dict, path: Path) -> Path:
    """The policy dict as a TOML file (the CLI reads TOML)."""
    def value(v: Any) -> str:
        return json.dumps(v)  # strings, numbers and lists of strings are the same in TOML

    lines = []
    for t in policy["tier"]:
        lines += ["[[tier]]"] + [f"{k} = {value(v)}" for k, v in t.items()]
    for section in ("restore", "store"):
        lines += [f"[{section}]"] + [f"{k} = {value(v)}" for k, v in policy.get(section, {}).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


TO_FP32 = """
import sys
sys.path.insert(0, sys.argv[1])
import zero_to_fp32
zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2], max_shard_size=None)
"""


def fp32_of(ckpt_dir: Path, out: Path) -> dict:
    """Converts a checkpoint directory with the zero_to_fp32.py that sits in it. (Its command
    line always shards, which needs huggingface_hub; unsharded, it writes one file.)"""
    p = subprocess.run([PYTHON, "-c", TO_FP32, str(ckpt_dir), str(out)], timeout=300, capture_output=True, text=True,
                       env=child_env(ds_env(0)))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return torch.load(out / "pytorch_model.bin", weights_only=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_export_loads_in_stock_deepspeed_and_zero_to_fp32_converts_it(stage, tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, ram={"keep": 2}, every=2)
    cfg = {"stage": stage, "steps": STEPS, "mode": "tiercel", "policy": policy, "save_dir": str(tmp_path / "ckpt"),
           "model_file": True}
    run_job(tmp_path, cfg, "trained")
    export = tmp_path / "export"
    if stage == 3:  # the CLI, as a user without Python would; the format read from the step
        r = subprocess.run([PYTHON, "-m", "tiercel", "--policy", str(toml_policy(policy, tmp_path / "tiercel.toml")),
                            "--json", "export", str(STEPS), str(export)],
                           capture_output=True, text=True, env=child_env(ds_env(0)), timeout=300)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["format"] == "deepspeed", r.stdout
    else:
        assert tiercel.deepspeed.export(policy, f"global_step{STEPS}", export) == str(export)
    # What DeepSpeed's own engine writes: `latest`, the tag folder, the recovery scripts; and
    # save_16bit_model's file, saved at the same step just before the checkpoint.
    assert (export / "latest").read_text() == f"global_step{STEPS}"
    assert (export / "zero_to_fp32.py").is_file() and (export / "pytorch_model.bin").is_file()

    # Stock DeepSpeed, no tiercel: loads the export, then saves it again with its own engine.
    stock = run_job(tmp_path, {"stage": stage, "steps": STEPS, "mode": "stock", "load_dir": str(export),
                               "save_dir": str(tmp_path / "stock")}, "stock")
    assert sorted(os.listdir(export / f"global_step{STEPS}")) == sorted(os.listdir(tmp_path / "stock" / f"global_step{STEPS}"))
    for r in range(WORLD):
        assert stock[r]["loaded"]["global_steps"] == STEPS and stock[r]["loaded"]["client_state"]["data_step"] == STEPS
        # The state stock DeepSpeed loaded is the one the tiercel job ended with.
        assert_same(plain(dump(tmp_path, "stock", "loaded", r)), plain(dump(tmp_path, "trained", "final", r)), f"rank {r}")
    # zero_to_fp32.py converts the export exactly as DeepSpeed's own checkpoint of that state;
    # with fp32 training that is the 16-bit model file too.
    fp32 = fp32_of(export, tmp_path / "fp32-export")
    assert_same(fp32, fp32_of(tmp_path / "stock", tmp_path / "fp32-stock"))
    model_file = torch.load(export / "pytorch_model.bin", weights_only=False)
    assert_same(dict(model_file), {k: v.detach() for k, v in fp32.items()})  # zero_to_fp32 sets requires_grad


# -- bad input -----------------------------------------------------------------------------

ERRORS = r"""
import json, os, sys
import torch
from ds_worker import make_engine
import tiercel, tiercel.deepspeed
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

cfg = json.loads(sys.argv[1])
engine = make_engine(0, False)
stock_dir = os.path.join(cfg["dir"], "stock")
engine.save_checkpoint(stock_dir)  # before the job adopted tiercel: DeepSpeed's own files
before = type(engine.checkpoint_engine)
params = {k: v.clone() for k, v in engine.module.state_dict().items()}
out = {}
def error(fn):
    try:
        fn()
    except tiercel.TiercelError as e:
        return [type(e).__name__, str(e)]
    raise AssertionError("no error")

bad = os.path.join(cfg["dir"], "bad.toml")
with open(bad, "w") as f:
    f.write('[[tier]]\nname = "ram"\nkind = "memory"\nroot = "/dev/shm/x"\ncapacity = "lots"\n')
out["bad_policy"] = error(lambda: tiercel.deepspeed.attach(engine, bad))
assert type(engine.checkpoint_engine) is before  # nothing changed
out["not_an_engine"] = error(lambda: tiercel.deepspeed.attach(engine.module, cfg["policy"]))

tiercel.deepspeed.attach(engine, cfg["policy"])
save_dir = cfg["save_dir"]
out["fresh"] = list(engine.load_checkpoint(save_dir))  # nothing saved yet: DeepSpeed's (None, None)
out["again"] = error(lambda: tiercel.deepspeed.attach(engine, cfg["policy"]))
engine.save_checkpoint(save_dir, tag="global_step1")
engine.save_checkpoint(save_dir, tag="best")
# A save DeepSpeed never committed (it raised half-way): on no tier.
ce = engine.checkpoint_engine
ce.create(CheckpointCommitInfo(tag="global_step7", save_dir=save_dir, save_latest=True))
ce.save({"w": torch.ones(3)}, os.path.join(save_dir, "global_step7", "mp_rank_00_model_states.pt"))
out["unknown"] = error(lambda: engine.load_checkpoint(save_dir, tag="nope"))
out["uncommitted"] = error(lambda: engine.load_checkpoint(save_dir, tag="global_step7"))
# A new save_dir while tiercel holds checkpoints of another one: stock DeepSpeed finds no
# `latest` there and starts fresh, and so does the job with tiercel (issue 28 item 12).
import logging
class Notes(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())
notes = Notes()
logging.getLogger("tiercel.deepspeed").addHandler(notes)
out["other_dir"] = list(engine.load_checkpoint(os.path.join(cfg["dir"], "elsewhere")))
out["other_dir_note"] = notes.lines[-1] if notes.lines else ""
out["other_dir_tag"] = error(lambda: engine.load_checkpoint(os.path.join(cfg["dir"], "elsewhere"), tag="global_step1"))
out["from_disk"] = engine.load_checkpoint(stock_dir)[0]  # tiercel does not hold it: DeepSpeed reads the disk
out["params_kept"] = all(torch.equal(v, params[k]) for k, v in engine.module.state_dict().items())
path, client = engine.load_checkpoint(save_dir, tag="best")
out["best"] = [path, engine.global_steps]
print("RESULT " + json.dumps(out))
"""


def test_bad_input_is_a_clear_error_and_changes_nothing(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root)
    cfg = {"dir": str(tmp_path), "policy": policy, "save_dir": str(tmp_path / "ckpt")}
    env = child_env({**ds_env(0), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(__import__("test_multirank").free_port())})
    p = subprocess.run([PYTHON, "-c", ERRORS, json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(Path(__file__).parent))
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, p.stdout[-3000:] + p.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])
    kind, msg = out["bad_policy"]
    assert kind == "ConfigError" and "bad.toml:5" in msg and "capacity" in msg, msg
    assert out["not_an_engine"][0] == "InvalidArgumentError" and "deepspeed.initialize" in out["not_an_engine"][1]
    assert out["fresh"] == [None, None]
    assert out["again"][0] == "InvalidArgumentError"
    kind, msg = out["unknown"]
    assert kind == "NotFoundError" and "tag 'nope'" in msg and "['ram', 'disk']" in msg, msg
    assert "'global_step1'" in msg and "'best'" in msg, msg  # what there is instead
    kind, msg = out["uncommitted"]
    assert kind == "NotFoundError" and "tag 'global_step7' (step 7)" in msg and "['ram', 'disk']" in msg, msg
    assert out["other_dir"] == [None, None]  # as stock DeepSpeed: a fresh start
    note = out["other_dir_note"]
    assert "elsewhere" in note and str(tmp_path / "ckpt") in note and "fresh start" in note, note
    kind, msg = out["other_dir_tag"]  # a tag asked for is never a fresh start
    assert kind == "NotFoundError" and "elsewhere" in msg and str(tmp_path / "ckpt") in msg, msg
    assert out["params_kept"]
    assert out["from_disk"] == str(tmp_path / "stock" / "global_step0" / "mp_rank_00_model_states.pt")
    # "best" went to the engine's global step then, 0; loading it sets the engine back to 0.
    assert out["best"] == [str(tmp_path / "ckpt" / "best" / "mp_rank_00_model_states.pt"), 0]


# -- the layout: tags, several saves in one step, the glob ---------------------------------


def test_tags_map_to_steps():
    assert step_for_tag("global_step40", 7) == 40
    assert step_for_tag("global_step0", 7) == 0
    assert step_for_tag("best", 7) == 7  # any other tag: the engine's global step
    assert step_for_tag("global_step040", 7) == 7  # not DeepSpeed's spelling of 40
    assert step_for_tag("global_step40x", 7) == 7
    with pytest.raises(tiercel.InvalidArgumentError, match="global_step1000000000000"):
        step_for_tag("global_step1000000000000", 0)


def test_a_later_save_at_a_step_keeps_the_files_it_does_not_rewrite(tmp_path):
    d = str(tmp_path)
    layout = Layout(5)
    layout.add(Save(d, "global_step5", False, 5, {"pytorch_model.bin": [0, "pytorch_model.bin"]}))
    ckpt = {"global_step5/mp_rank_00_model_states.pt": [0, "mp_rank_00_model_states.pt"],
            "global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt": [1, "zero_pp_rank_1_mp_rank_00_optim_states.pt"]}
    layout.add(Save(d, "global_step5", True, 5, dict(ckpt)))
    assert [sorted(s.files) for s in layout.saves] == [["pytorch_model.bin"], sorted(ckpt)]
    assert [s.is_checkpoint() for s in layout.saves] == [False, True]
    # The same checkpoint again: the new files replace the old ones.
    layout.add(Save(d, "global_step5", True, 5, {"global_step5/mp_rank_00_model_states.pt": [0, "x"]}))
    assert [sorted(s.files) for s in layout.saves] == [["pytorch_model.bin"], ["global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
                                                      ["global_step5/mp_rank_00_model_states.pt"]]
    # Any spelling of a path finds its file; the glob answers as glob.glob would.
    rel = os.path.join(os.path.relpath(d), "global_step5", ".", "mp_rank_00_model_states.pt")
    assert layout.owner(rel)[2:] == (0, "x")
    assert layout.glob(os.path.join(d, "global_step5", "mp_rank_*_model_states.pt")) == [
        os.path.join(d, "global_step5", "mp_rank_00_model_states.pt")]
    assert layout.glob(os.path.join(d, "global_step4", "mp_rank_*_model_states.pt")) == []
    back = Layout.from_tree(layout.to_tree(), "test")
    assert back == layout


def test_a_load_merges_the_ranks_layouts(tmp_path):
    # Each rank records every save of the step with its own files; rank 1 wrote nothing for
    # save_16bit_model and only its optimizer states for the checkpoint.
    d = str(tmp_path)
    ranks = [Layout(3), Layout(3)]
    ranks[0].add(Save(d, "global_step3", False, 3, {"pytorch_model.bin": [0, "pytorch_model.bin"]}))
    ranks[1].add(Save(d, "global_step3", False, 3, {}))
    for r in (0, 1):
        files = {f"global_step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": [r, "optim"]}
        if r == 0:
            files["global_step3/mp_rank_00_model_states.pt"] = [0, "model"]
        ranks[r].add(Save(d, "global_step3", True, 3, files))
    merged = Layout.merge(ranks, "step 3")
    assert [len(s.files) for s in merged.saves] == [1, 3]
    assert [s.is_checkpoint() for s in merged.saves] == [False, True]
    assert merged.checkpoints(d, "global_step3") == [merged.saves[1]] and merged.checkpoints(d + "x") == []
    assert merged.owner(os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))[2:] == (1, "optim")
    ranks[1].saves.pop(0)
    with pytest.raises(tiercel.InvalidArgumentError, match="rank 1 recorded other DeepSpeed saves"):
        Layout.merge(ranks, "step 3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_rank_saves_and_resumes_bit_identical(tmp_path, shm_root, disk_root):
    # One rank on the GPU (NCCL wants a device per rank): parameters and optimizer state are
    # copied device-to-host once, into shared memory, and come back bit-identical.
    policy = make_policy(shm_root, disk_root, ram={"keep": 3}, every=2)
    cfg = {"stage": 2, "steps": STEPS, "policy": policy, "save_dir": str(tmp_path / "ckpt")}
    cuda = {"world": 1, "accelerator": "cuda"}
    ref = run_job(tmp_path, {**cfg, "mode": "plain"}, "ref", **cuda)
    run_job(tmp_path, {**cfg, "mode": "tiercel", "steps": KILL_AFTER}, "first", **cuda)
    resumed = run_job(tmp_path, {**cfg, "mode": "tiercel", "resume": True}, "resumed", **cuda)
    assert assert_continues_like((tmp_path, ref), tmp_path, "resumed", resumed) == KILL_AFTER
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        devices = {it.meta.get("device") for it in store.reader(STEPS).items() if it.framework == "torch"}
    assert any(d and d.startswith("cuda") for d in devices), devices
