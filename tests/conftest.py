"""Shared fixtures and helpers for the tiercel test suite.

Everything here is real: a memory tier under its own directory in /dev/shm (removed after
each test), an fs tier under pytest's tmp_path, real subprocesses. The helpers are plain
functions so that tests, and the scripts they start in subprocesses, can import them
(`from conftest import ...`; tests/ is on sys.path under pytest's default import mode).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

try:
    import torch
except ImportError:  # pragma: no cover - the suite needs torch, but helpers stay importable
    torch = None

import tiercel

TESTS_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
SHM = Path("/dev/shm")


# -- policies and stores ----------------------------------------------------------------------


def make_policy(
    shm_root: str | os.PathLike,
    disk: str | os.PathLike | None,
    *,
    every: int = 2,
    compression: str = "zstd:3",
    chunk_size: str = "64KiB",
    ram: dict[str, Any] | None = None,
    disk_opts: dict[str, Any] | None = None,
    order: list[str] | None = None,
) -> dict[str, Any]:
    """A dict policy: memory tier "ram" at `shm_root`, fs tier "disk" at `disk` (omitted when
    None), small chunks so that a few-hundred-KB array spans several of them."""
    tiers: list[dict[str, Any]] = [{"name": "ram", "kind": "memory", "root": str(shm_root), **(ram or {})}]
    if disk is not None:
        tiers.append({"name": "disk", "kind": "fs", "url": str(disk), "every": every, "compression": compression, **(disk_opts or {})})
    return {
        "tier": tiers,
        "restore": {"order": order or [t["name"] for t in tiers]},
        # Two cores are shared by everyone on this machine: stay small.
        "store": {"chunk_size": chunk_size, "threads": 2, "io_threads": 2},
    }


def allowing_pickle(policy: dict[str, Any]) -> dict[str, Any]:
    """`policy` with `[store] pickle = "allow"`: restores unpickle (the default refuses)."""
    return {**policy, "store": {**policy.get("store", {}), "pickle": "allow"}}


def new_shm_root(tag: str = "") -> Path:
    return SHM / f"tiercel-test-{tag}{os.getpid()}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def shm_root():
    root = new_shm_root()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def disk_root(tmp_path):
    return tmp_path / "disk"


@pytest.fixture
def policy(shm_root, disk_root):
    """ram (memory, /dev/shm/tiercel-test-*) then disk (fs under tmp_path, every=2, zstd:3);
    restore order ram, disk; 64KiB chunks."""
    return make_policy(shm_root, disk_root)


@pytest.fixture
def make_store(policy):
    """make_store(policy=None, **kwargs) -> an open tiercel.Store, closed after the test."""
    stores: list[tiercel.Store] = []

    def make(pol: dict | str | os.PathLike | None = None, **kwargs: Any) -> tiercel.Store:
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
        s = tiercel.Store(policy if pol is None else pol, **kwargs)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def store(make_store):
    return make_store()


#: What a launcher (torchrun, Slurm) sets that tiercel reads: tiercel.environment, store/job.rs.
LAUNCHER_VARS = ("TIERCEL_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_PROCID",
                 "SLURM_STEP_NUM_TASKS", "SLURMD_NODENAME", "TIERCEL_HOST")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No test depends on how the shell that started pytest was set up."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TIERCEL_POLICY", "MASTER_ADDR", "MASTER_PORT", *LAUNCHER_VARS):
        monkeypatch.delenv(var, raising=False)


# -- paths on a tier ---------------------------------------------------------------------------


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:012d}"


def manifest_path(root: str | os.PathLike, step: int, rank: int = 0) -> Path:
    """Where rank `rank`'s manifest of `step` lies under a tier's directory: the step's
    directory (the memory tier; format versions 1-2), else the rank's area (version 3)."""
    old = step_dir(root, step) / f"rank-{rank:05d}.manifest.json"
    area = rank_area(root, rank) / f"step-{step:012d}.manifest.json"
    return area if area.exists() and not old.exists() else old


def rank_area(root: str | os.PathLike, rank: int) -> Path:
    """A rank's area under a blob tier's directory (format version 3), found by listing."""
    found = list(Path(root).glob(f"ranks/*/rank-{rank:05d}"))
    return found[0] if found else Path(root) / "ranks" / "??" / f"rank-{rank:05d}"


def read_manifest(root: str | os.PathLike, step: int, rank: int = 0) -> dict:
    return json.loads(manifest_path(root, step, rank).read_text())


def chunk_location(root: str | os.PathLike, step: int, item: str, chunk: int = 0, rank: int = 0) -> tuple[Path, int, int]:
    """(data file, stored offset, stored length) of one chunk of an item on a tier."""
    m = read_manifest(root, step, rank)
    it = next(i for i in m["items"] if i["name"] == item)
    c = it["chunks"][chunk]
    obj = m["objects"][c["object"]]
    path = Path(root) / obj["key"] if obj.get("key") else step_dir(root, step) / obj["name"]
    return path, c["stored_offset"], c["stored_len"]


def flip_byte(path: str | os.PathLike, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"{path} has no byte at {offset}"
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def du(root: str | os.PathLike) -> int:
    """Bytes allocated under `root` (blocks, as the memory tier counts them). Files are
    counted once by inode: the walk is not atomic, and a segment renamed from the pool into
    a step while it runs would otherwise be seen in both places."""
    seen: dict[int, int] = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            seen[st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def files_under(root: str | os.PathLike) -> list[str]:
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# -- data --------------------------------------------------------------------------------------


def random_bytes(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def random_numpy(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """An array of random *bit patterns* (NaN payloads, subnormals, -0.0 included)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = random_bytes(n * dtype.itemsize, seed)
    if dtype == np.bool_:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def random_torch(dtype: Any, shape: tuple[int, ...], seed: int) -> Any:
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = random_bytes(n * itemsize, seed)
    if dtype == torch.bool:
        raw %= 2
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def raw_bytes(x: Any) -> bytes:
    """The C-order bytes of an array or tensor."""
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        if t.numel() == 0:
            return b""
        return t.view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def assert_same(got: Any, want: Any, path: str = "$") -> None:
    """Strict, bit-level equality of two state trees: same types, dtypes, shapes and bytes;
    floats compared by their bits (NaN, -0.0); dict keys in the same order."""
    if torch is not None and isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{path}: got {type(got).__name__}, want torch.Tensor"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.device.type == "cpu", f"{path}: device {got.device}"
        assert got.requires_grad == want.requires_grad, f"{path}: requires_grad {got.requires_grad} != {want.requires_grad}"
        assert raw_bytes(got) == raw_bytes(want), f"{path}: bytes differ ({want.dtype}, {tuple(want.shape)})"
        return
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, f"{path}: got {type(got).__name__}, want numpy.ndarray"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert raw_bytes(got) == raw_bytes(want), f"{path}: bytes differ ({want.dtype}, {want.shape})"
        return
    if isinstance(want, np.generic):
        assert type(got) is type(want), f"{path}: got {type(got).__name__}, want {type(want).__name__}"
        assert got.tobytes() == want.tobytes(), f"{path}: {got!r} != {want!r}"
        return
    assert type(got) is type(want), f"{path}: got {type(got).__name__} {got!r:.80}, want {type(want).__name__} {want!r:.80}"
    if isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r} (bitwise)"
    elif isinstance(want, dict):
        gk, wk = list(got), list(want)
        assert len(gk) == len(wk), f"{path}: keys {gk!r} != {wk!r}"
        for g, w in zip(gk, wk):
            assert_same(g, w, f"{path}.<key {w!r}>")
        for (g, gv), (w, wv) in zip(got.items(), want.items()):
            assert_same(gv, wv, f"{path}[{w!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r:.200} != {want!r:.200}"


def walk_leaves(tree: Any, path: str = "$"):
    """(path, leaf) for every array/tensor in a tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk_leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from walk_leaves(v, f"{path}[{i}]")
    elif isinstance(tree, np.ndarray) or (torch is not None and isinstance(tree, torch.Tensor)):
        yield path, tree


def buffer_base(arr: np.ndarray) -> Any:
    """The tiercel._core.Buffer at the end of a numpy array's base chain, or None."""
    b = arr
    while b is not None:
        if isinstance(b, tiercel._core.Buffer):
            return b
        b = getattr(b, "base", None) if not isinstance(b, memoryview) else b.obj
    return None


# -- subprocesses ------------------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TIERCEL_POLICY", *LAUNCHER_VARS):
        env.pop(var, None)
    env.update(extra or {})
    return env


def run_python(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (tests/ on its path); fails the test on error."""
    p = subprocess.run(
        [PYTHON, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=child_env(env), cwd=str(TESTS_DIR)
    )
    if check and p.returncode != 0:
        raise AssertionError(f"subprocess exited with {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
    return p


def error_of(fn: Callable[[], Any], kind: type[BaseException]) -> str:
    """Calls fn, which must raise `kind`; returns the message."""
    with pytest.raises(kind) as ei:
        fn()
    return str(ei.value)


ISOLATED = r"""
import faulthandler, importlib, json, sys
# A hang shows where it is: every thread's Python stack, then exit.
faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)
mod = importlib.import_module(sys.argv[1])
result = getattr(mod, sys.argv[2])(*json.loads(sys.argv[3]))
print("RESULT " + json.dumps(result))
"""


def run_isolated(module: str, func: str, *args: Any, timeout: float = 90) -> Any:
    """Runs `module.func(*args)` (JSON arguments) in a fresh interpreter and returns what it
    returned. For steps that could hang (a deadlock with the GIL released cannot be
    interrupted in-process): the child is killed after `timeout` and the test fails."""
    try:
        p = run_python(ISOLATED, module, func, json.dumps(args), str(max(timeout - 15, timeout / 2)), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{module}.{func} hung: killed after {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}")
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, f"no result from {module}.{func}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return json.loads(lines[-1][len("RESULT "):])
