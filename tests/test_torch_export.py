"""`tiercel export STEP DIR --format torch` (and tiercel.torch_export.export): a plain step
(`Store.save`, `tiercel.torch.save_state`) of two ranks as one torch.save file per rank,
which a Python that cannot import tiercel loads with torch.load, bit for bit the state each
rank saved (issue 28 item 17)."""

from __future__ import annotations

import copy
import json
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
import tiercel.torch
import tiercel.torch_export

from conftest import PYTHON, error_of, make_policy, raw_bytes

#: Run as `python -I -S`: no PYTHONPATH, no site (so no tiercel.pth); only torch's own
#: site-packages directory on the path. Compares each exported file with the state the test
#: saved (a pickle of the originals), strictly: types, dtypes, shapes, bytes, float bits.
NO_TIERCEL = r"""
import importlib.util, struct, sys
sys.path.append(sys.argv[1])
assert importlib.util.find_spec("tiercel") is None, "tiercel is importable here"
import numpy as np, torch

def same(got, want, path="$"):
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape, path
        assert got.requires_grad == want.requires_grad, path
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size(), (path, "a storage bigger than the tensor")
        assert got.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() == want.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), path
    elif isinstance(want, (np.ndarray, np.generic)):
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, float):
        assert type(got) is float and struct.pack("<d", got) == struct.pack("<d", want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (path, list(got), list(want))
        for k in want:
            same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{path}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (path, got, want)

for spec in sys.argv[2:]:
    exported, expected, weights_only = spec.split(",")
    got = torch.load(exported, weights_only=weights_only == "1")
    same(got, torch.load(expected, weights_only=False))
    print("same", exported)
"""


def torch_site() -> str:
    return str(Path(torch.__file__).parent.parent)


def load_without_tiercel(specs: list[tuple[Path, Path, bool]]) -> str:
    p = subprocess.run([PYTHON, "-I", "-S", "-c", NO_TIERCEL, torch_site(),
                        *(f"{e},{w},{int(weights_only)}" for e, w, weights_only in specs)],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    return model, opt


def test_a_plain_step_of_two_ranks_exports_as_torch_save_files_that_load_without_tiercel(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, every=1)
    ranks = [tiercel.Store(policy, rank=r, world_size=2) for r in range(2)]
    want: dict[int, dict[int, Any]] = {3: {}, 4: {}}
    try:
        for r, store in enumerate(ranks):
            # Step 3: tiercel.torch.save_state of a real model and optimizer, with the generators.
            model, opt = model_and_optimizer(r)
            np.random.seed(r)
            want[3][r] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "extra": {"epoch": r, "lr": 0.1 + r, "name": f"rank{r}", "flags": [True, None]},
                                        "rng": tiercel.torch.rng_state()})
            tiercel.torch.save_state(store, 3, model=model, optimizer=opt, extra=want[3][r]["extra"])
            # Step 4: Store.save of tensors only (a bfloat16 and a non-contiguous one among them).
            t = torch.arange(24, dtype=torch.float32).reshape(4, 6) + r
            want[4][r] = {"weights": {"w": t.t().contiguous(), "h": t.to(torch.bfloat16), "i": torch.tensor(r)},
                          "step": {"n": 4}}
            store.save(4, {"weights": {"w": t.t(), "h": t.to(torch.bfloat16), "i": torch.tensor(r)}, "step": {"n": 4}})
        for store in ranks:
            store.flush()
        # Step 4 through the command line, step 3 from Python with progress.
        cli_dir = tmp_path / "cli"
        toml = tmp_path / "tiercel.toml"
        toml.write_text(_toml(policy))
        # No --format: a step no adapter marked is a plain save.
        p = subprocess.run([sys.executable, "-m", "tiercel", "--policy", str(toml), "export", "4", str(cli_dir), "--json"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert json.loads(p.stdout) == {"step": 4, "format": "torch", "dir": str(cli_dir)}
        seen: list[tuple[int, int]] = []
        py_dir = tiercel.torch_export.export(policy, 3, tmp_path / "py", progress=lambda d, t: seen.append((d, t)))
        # safetensors of the two ranks' tensors: each rank's names behind "rank<R>/".
        st_dir = tiercel.exports.export(ranks[0], 4, tmp_path / "st", format="safetensors")
        assert seen and seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == sorted(d for d, _ in seen), seen
    finally:
        for store in ranks:
            store.close()

    assert sorted(os.listdir(cli_dir)) == ["MANIFEST.json", "rank-00000.pt", "rank-00001.pt"]
    assert json.loads((cli_dir / "MANIFEST.json").read_text()) == {
        "format": "torch", "step": 4, "world_size": 2, "files": ["rank-00000.pt", "rank-00001.pt"]}
    specs = []
    for step, out in ((3, py_dir), (4, cli_dir)):
        for r in range(2):
            torch.save(want[step][r], tmp_path / f"want-{step}-{r}.pt")
            # Tensors and plain values load with weights_only=True; save_state's "rng" holds
            # numpy's generator state, which needs weights_only=False.
            specs.append((out / f"rank-{r:05d}.pt", tmp_path / f"want-{step}-{r}.pt", step == 4))
    assert load_without_tiercel(specs).count("same") == 4
    from safetensors.torch import load_file

    tensors = load_file(st_dir / "model.safetensors")
    assert sorted(tensors) == sorted(f"rank{r}/weights.{k}" for r in range(2) for k in "whi"), sorted(tensors)
    for r in range(2):
        for k, t in want[4][r]["weights"].items():
            got = tensors[f"rank{r}/weights.{k}"]
            assert got.dtype == t.dtype and got.shape == t.shape and raw_bytes(got) == raw_bytes(t), (r, k)
    assert json.loads((st_dir / "skipped.json").read_text()) == {f"rank{r}/step.n": {"type": "int", "value": 4} for r in range(2)}
    # weights_only=True refuses numpy values: the documented reason to load such a file with False.
    with pytest.raises(Exception, match="numpy"):
        torch.load(py_dir / "rank-00000.pt", weights_only=True)

    # An export never writes into a directory that holds files.
    msg = error_of(lambda: tiercel.torch_export.export(policy, 4, cli_dir), tiercel.InvalidArgumentError)
    assert str(cli_dir) in msg and "not an empty directory" in msg, msg


def _toml(policy: dict[str, Any]) -> str:
    """The dict policy as TOML (the command line reads a file)."""
    lines = []
    for t in policy["tier"]:
        lines.append("[[tier]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
    for section in ("restore", "store"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in policy[section].items()]
    return "\n".join(lines) + "\n"
