"""The export registry (tiercel.exports) and the safetensors export (issue 29, items 1-2).

- Each adapter's step (a plain save, DCP, Orbax, DeepSpeed's engine) is exported through
  the registry with the format read from the step, and loads with the framework alone.
- `--format safetensors` writes files that `safetensors.torch.load_file` loads, in an
  interpreter that cannot import tiercel, bit for bit the tensors saved, one file or sharded
  with `model.safetensors.index.json`; values that are not tensors are listed in skipped.json.
- Detection errors name the formats.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercel
import tiercel.exports
from tiercel import safetensors_export as st

from conftest import PYTHON, error_of, make_policy, raw_bytes

#: Loads safetensors files with the safetensors package in `python -I -S` (no tiercel on the
#: path) and prints, per tensor, its dtype, shape and a hash of its bytes.
LOAD_WITHOUT_TIERCEL = r"""
import hashlib, importlib.util, json, sys
sys.path.append(sys.argv[1])
assert importlib.util.find_spec("tiercel") is None, "tiercel is importable here"
import torch
from safetensors.torch import load_file
out = {}
for path in sys.argv[2:]:
    for name, t in load_file(path).items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]
print(json.dumps(out))
"""


def site_packages() -> str:
    return str(Path(torch.__file__).parent.parent)


def fingerprint(t: torch.Tensor) -> list[Any]:
    import hashlib

    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw_bytes(t)).hexdigest()]


def load_without_tiercel(files: list[Path]) -> dict[str, list[Any]]:
    p = subprocess.run([PYTHON, "-I", "-S", "-c", LOAD_WITHOUT_TIERCEL, site_packages(), *map(str, files)],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    loaded: dict[str, list[Any]] = json.loads(p.stdout)
    return loaded


def cli(policy: dict[str, Any], tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    toml = tmp_path / "tiercel.toml"
    toml.write_text(_toml(policy))
    return subprocess.run([sys.executable, "-m", "tiercel", "--policy", str(toml), *args],
                          capture_output=True, text=True, timeout=180)


def _toml(policy: dict[str, Any]) -> str:
    lines = []
    for t in policy["tier"]:
        lines.append("[[tier]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
    for section in ("restore", "store"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in policy[section].items()]
    return "\n".join(lines) + "\n"


def plain_state() -> dict[str, Any]:
    """A model's state dict of several dtypes (a transposed view, a 0-d and an empty tensor
    among them), an optimizer-like nest, numpy arrays and values that are not tensors."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 10, generator=g)
    return {
        "model": {"0.weight": w.t(), "0.bias": torch.randn(6, generator=g).to(torch.bfloat16),
                  "1.scale": torch.tensor(2.5, dtype=torch.float16), "1.count": torch.arange(7, dtype=torch.int64),
                  "1.mask": torch.tensor([True, False, True]), "1.empty": torch.empty(0, 4),
                  "big": torch.randn(300, 40, generator=g)},
        "optim": {"state": [{"exp_avg": torch.full((3, 3), -0.0), "step": 7}], "lr": 0.01, "name": "adamw"},
        "np": {"a": np.arange(12, dtype=np.int32).reshape(3, 4), "blob": b"\x00raw"},
    }


def expected_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors the documented naming rule gives: tree paths joined with "."."""
    return {
        **{f"model.{k}": v for k, v in state["model"].items()},
        "optim.state.0.exp_avg": state["optim"]["state"][0]["exp_avg"],
        "np.a": torch.from_numpy(state["np"]["a"]),
    }


def test_the_markers_are_the_adapters_own():
    from tiercel.dcp import _layout as dcp_layout
    from tiercel.deepspeed import layout as ds_layout
    from tiercel.orbax import _layout as orbax_layout

    assert tiercel.exports.DEEPSPEED_PUT == ds_layout.LAYOUT_PUT
    assert tiercel.exports.DCP_PUT == dcp_layout.PUT_METADATA
    assert tiercel.exports.ORBAX_FORMAT == orbax_layout.FORMAT
    assert sorted(tiercel.exports.formats()) == ["dcp", "deepspeed", "orbax", "safetensors", "torch"]


def test_a_plain_step_as_safetensors_one_file_and_sharded_bit_for_bit(tmp_path, shm_root, disk_root, make_store):
    policy = make_policy(shm_root, disk_root, every=1)
    state = plain_state()
    store = make_store(policy)
    store.save(3, state).wait()
    want = {name: fingerprint(t) for name, t in expected_tensors(state).items()}

    # One file (the default limit), through the command line: --format names it.
    one = tmp_path / "one"
    p = cli(policy, tmp_path, "export", "3", str(one), "--format", "safetensors", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout) == {"step": 3, "format": "safetensors", "dir": str(one), "skipped": 4}
    assert sorted(os.listdir(one)) == ["model.safetensors", "skipped.json"]
    assert load_without_tiercel([one / "model.safetensors"]) == want
    assert json.loads((one / "skipped.json").read_text()) == {
        "optim.state.0.step": {"type": "int", "value": 7}, "optim.lr": {"type": "float", "value": 0.01},
        "optim.name": {"type": "str", "value": "adamw"}, "np.blob": {"type": "bytes item"}}

    # Sharded: at most 1000 bytes a file; the 48 000-byte tensor alone in its file.
    sharded = tmp_path / "sharded"
    seen: list[tuple[int, int]] = []
    tiercel.exports.export(store, 3, sharded, format="safetensors", max_shard_size="1KB",
                           progress=lambda d, t: seen.append((d, t)))
    total = sum(math.prod(t.shape) * t.element_size() for t in expected_tensors(state).values())
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen), seen
    index = json.loads((sharded / st.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors")), files
    assert all(f"-of-{len(files):05d}.safetensors" in f for f in files), files
    assert index["metadata"]["total_size"] == total
    for f in files:
        size = os.path.getsize(sharded / f)
        names = [n for n, g in index["weight_map"].items() if g == f]
        assert len(names) == 1 or size < 1000 + 1000, (f, size, names)  # data <= 1000, plus its header
    loaded = load_without_tiercel([sharded / f for f in files])
    assert loaded == want
    assert {n: index["weight_map"][n] for n in loaded} == index["weight_map"]

    # The export never writes into a directory that holds files.
    msg = error_of(lambda: tiercel.exports.export(store, 3, sharded, format="safetensors"), tiercel.InvalidArgumentError)
    assert str(sharded) in msg and "not an empty directory" in msg, msg


def test_detection_and_its_errors(tmp_path, shm_root, disk_root, make_store):
    policy = make_policy(shm_root, None)
    store = make_store(policy)
    store.save(1, {"w": torch.ones(2)}).wait()
    assert tiercel.exports.detect(store, 1) == "torch"
    # A step with two adapters' marks (a plain save that happens to use DeepSpeed's and DCP's
    # put names): detection refuses and names every format.
    store.save(2, {"_deepspeed": {"x": 1}, "dcp-metadata": b"x"}).wait()
    msg = error_of(lambda: tiercel.exports.detect(store, 2), tiercel.InvalidArgumentError)
    assert "deepspeed, dcp" in msg and "dcp, deepspeed, orbax, safetensors, torch" in msg and "step 2" in msg, msg
    p = cli(policy, tmp_path, "export", "2", str(tmp_path / "out"))
    assert p.returncode == 2 and "--format" in p.stderr and "safetensors" in p.stderr, p.stderr
    msg = error_of(lambda: tiercel.exports.export(store, 1, tmp_path / "x", format="onnx"), tiercel.InvalidArgumentError)
    assert "'onnx'" in msg and "dcp, deepspeed, orbax, safetensors, torch" in msg, msg
    p = cli(policy, tmp_path, "export", "1", str(tmp_path / "y"), "--max-shard-size", "1GB")
    assert p.returncode == 2 and "--format safetensors" in p.stderr, p.stderr
    # Two values that flatten to one name; a dtype safetensors has no name for.
    store.save(3, {"a": {"b.c": torch.ones(1), "b": {"c": torch.zeros(1)}}}).wait()
    msg = error_of(lambda: tiercel.exports.export(store, 3, tmp_path / "clash", format="safetensors"),
                   tiercel.InvalidArgumentError)
    assert msg.startswith("step 3: ") and "'a.b.c'" in msg and "--format" in msg, msg
    store.save(4, {"w": torch.ones(2), "z": torch.zeros(2, dtype=torch.complex128)}).wait()
    out = tiercel.exports.export(store, 4, tmp_path / "complex", format="safetensors")
    assert json.loads((out / st.SKIPPED_FILE).read_text()) == {
        "z": {"type": "tensor of dtype complex128, which safetensors has no name for"}}
    msg = error_of(lambda: st.parse_size("5 parsecs"), tiercel.InvalidArgumentError)
    assert "5GB" in msg, msg
    assert st.parse_size("5GB") == 5 * 10**9 and st.parse_size("2GiB") == 2 * 2**30 and st.parse_size(123) == 123


def test_a_dcp_step_through_the_registry(tmp_path, shm_root, disk_root, make_store):
    import torch.distributed.checkpoint as dcp

    import tiercel.dcp

    policy = make_policy(shm_root, disk_root, every=1)
    store = make_store(policy)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    state = {"model": model.state_dict(), "epoch": 3}
    dcp.save(state, storage_writer=tiercel.dcp.Writer(store, step=5))
    assert tiercel.exports.detect(store, 5) == "dcp"

    # Detected: a DCP directory that stock DCP loads.
    out = tiercel.exports.export(store, 5, tmp_path / "dcp")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "epoch": 0}
    dcp.load(target, storage_reader=dcp.FileSystemReader(out))
    assert target["epoch"] == 3
    for k, v in state["model"].items():
        assert raw_bytes(target["model"][k]) == raw_bytes(v), k

    # safetensors: DCP's own names, tensors whole; the epoch (a DCP-serialized object) skipped.
    st_dir = tiercel.exports.export(store, 5, tmp_path / "st", format="safetensors")
    assert load_without_tiercel([st_dir / st.SINGLE_FILE]) == {f"model.{k}": fingerprint(v) for k, v in state["model"].items()}
    assert json.loads((st_dir / st.SKIPPED_FILE).read_text()) == {"epoch": {"type": "a DCP-serialized object"}}


def test_an_orbax_step_through_the_registry(tmp_path, shm_root, disk_root):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import tiercel.orbax

    policy = make_policy(shm_root, disk_root, every=1)
    state = {"params": {"dense": {"kernel": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
                                  "bias": jnp.ones(4, dtype=jnp.bfloat16)}},
             "step": 9, "np": np.arange(5, dtype=np.int16)}
    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    try:
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(tmp_path / "orbax-dir", args=tiercel.orbax.Save(state, step=6))
        handler.store.flush()
        assert tiercel.exports.detect(handler.store, 6) == "orbax"
        seen: list[tuple[int, int]] = []
        out = tiercel.exports.export(handler.store, 6, tmp_path / "exported", progress=lambda d, t: seen.append((d, t)))
        assert seen[-1] == (12 * 4 + 4 * 2 + 5 * 2,) * 2, seen
        st_dir = tiercel.exports.export(handler.store, 6, tmp_path / "st", format="safetensors")
    finally:
        handler.close()
    plain = ocp.StandardCheckpointer().restore(out)
    assert np.asarray(plain["params"]["dense"]["kernel"]).tobytes() == np.asarray(state["params"]["dense"]["kernel"]).tobytes()
    assert plain["step"] == 9
    want = {"params.dense.kernel": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "params.dense.bias": torch.ones(4, dtype=torch.bfloat16), "np": torch.arange(5, dtype=torch.int16)}
    assert load_without_tiercel([st_dir / st.SINGLE_FILE]) == {k: fingerprint(v) for k, v in want.items()}
    assert json.loads((st_dir / st.SKIPPED_FILE).read_text()) == {"step": {"type": "int", "value": 9}}


def test_a_deepspeed_step_through_the_registry(tmp_path, shm_root, disk_root, make_store):
    """The engine as DeepSpeed drives it (create, save per file, commit); the full job, loaded
    by stock DeepSpeed, is tests/test_deepspeed.py's export test."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from tiercel.deepspeed.engine import TiercelCheckpointEngine

    policy = make_policy(shm_root, disk_root, every=1)
    store = make_store(policy)
    engine = TiercelCheckpointEngine(store, lambda: 40)
    save_dir = tmp_path / "save"
    info = CheckpointCommitInfo(tag="global_step40", save_dir=str(save_dir), save_latest=True)
    module = {"linear.weight": torch.randn(3, 5), "linear.bias": torch.randn(3).to(torch.float16)}
    engine.create(info)
    engine.save({"module": module, "global_steps": 40, "ds_version": "0.x"},
                str(save_dir / "global_step40" / "mp_rank_00_model_states.pt"))
    engine.commit(info)
    engine.finish_snapshot()
    assert engine.last_handle is not None
    engine.last_handle.wait()

    assert tiercel.exports.detect(store, 40) == "deepspeed"
    out = tiercel.exports.export(store, 40, tmp_path / "ds")
    assert (out / "latest").read_text() == "global_step40"
    loaded = torch.load(out / "global_step40" / "mp_rank_00_model_states.pt", weights_only=False)
    assert {k: raw_bytes(v) for k, v in loaded["module"].items()} == {k: raw_bytes(v) for k, v in module.items()}

    st_dir = tiercel.exports.export(store, "global_step40", tmp_path / "st", format="safetensors")
    prefix = "global_step40/mp_rank_00_model_states.pt/"
    assert load_without_tiercel([st_dir / st.SINGLE_FILE]) == {f"{prefix}module.{k}": fingerprint(v) for k, v in module.items()}
    assert json.loads((st_dir / st.SKIPPED_FILE).read_text()) == {
        f"{prefix}global_steps": {"type": "int", "value": 40}, f"{prefix}ds_version": {"type": "str", "value": "0.x"}}
