"""`make peer-suites` (suites/run.py) runs the frameworks' own tests with tiercel in place of
their stock backends, through suites/shim/sitecustomize.py. The suites take most of an hour,
so `make test` checks only that the substitution takes hold (and stays off for the stock
runs): in a fresh interpreter set up as the runner sets up every test process, the names the
frameworks' tests import are tiercel's, and a DCP save through them lands in tiercel's memory
tier instead of the directory."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import PYTHON, TESTS_DIR, child_env

SHIM = TESTS_DIR.parent / "suites" / "shim"

PROBE = r"""
import json, os, pathlib, tempfile
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, save
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_args
import deepspeed

found = {
    "dcp_writer": FileSystemWriter.__module__,
    "dcp_reader": FileSystemReader.__module__,
    "orbax_handler": ocp.handlers.StandardCheckpointHandler.__module__,
    "orbax_args": checkpoint_args.get_registered_handler_cls(ocp.args.StandardSave).__module__,
    "deepspeed_initialize": deepspeed.initialize.__module__,
}
with tempfile.TemporaryDirectory() as path:
    save({"w": torch.arange(12.0)}, storage_writer=FileSystemWriter(path))
    found["in_directory"] = sorted(p.name for p in pathlib.Path(path).iterdir())
root = pathlib.Path(os.environ["TIERCEL_PEER_SUITE_ROOT"])
found["in_memory_tier"] = sorted({int(p.name.split("-")[-1]) for p in root.glob("*/step-*")}) if root.exists() else []
print(json.dumps(found))
"""


def probe(backend: str, tmp_path) -> dict:
    env = child_env({
        "TIERCEL_PEER_SUITE": backend,
        "TIERCEL_PEER_SUITE_ROOT": str(tmp_path / "shm"),
        "PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
        "DS_ACCELERATOR": "cpu",
        "JAX_PLATFORMS": "cpu",
    })  # fmt: skip
    r = subprocess.run([PYTHON, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_shim_puts_tiercel_in_place_of_each_stock_backend(tmp_path):
    got = probe("tiercel", tmp_path)
    assert got == {
        "dcp_writer": "sitecustomize",
        "dcp_reader": "sitecustomize",
        "orbax_handler": "sitecustomize",
        "orbax_args": "sitecustomize",
        "deepspeed_initialize": "sitecustomize",
        "in_directory": [],
        "in_memory_tier": [1],
    }, got


def test_the_stock_runs_get_the_stock_backends(tmp_path):
    got = probe("stock", tmp_path)
    assert got["dcp_writer"] == got["dcp_reader"] == "torch.distributed.checkpoint.filesystem", got
    assert got["orbax_handler"] == got["orbax_args"] == "orbax.checkpoint._src.handlers.standard_checkpoint_handler", got
    assert got["deepspeed_initialize"] == "deepspeed", got
    assert ".metadata" in got["in_directory"] and got["in_memory_tier"] == [], got
