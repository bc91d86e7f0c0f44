"""`check_tier`: the conformance suite for a tier written in Python, for its author's tests.

    from tiercel.testing import check_tier

    def test_my_tier(tmp_path):
        check_tier("mypkg.tiers:make", root=str(tmp_path))

It runs the core's own suites against the object the factory returns (the same cases every
built-in kind passes: atomic create, ranged reads, listing, deletes, missing keys, large and
streamed objects, corruption caught, gc), then concurrent writers, then a round through a
real `Store`: save, a saving process killed mid-persist, restore after shared memory is
wiped (bit-identical), a corrupted object caught (never returned), gc of what the killed
save left. Every failure is listed in one AssertionError.

The factory must be importable by name (`"module:callable"`, or a module-level callable):
the kill round runs it in a child process. The options must name an empty place (a fresh
directory, a prefix of its own): the round writes steps at the tier's root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import _core
from .errors import IntegrityError
from .tiers import check_protocol, load_factory

__all__ = ["check_tier", "tier_policy"]


def _factory_name(factory: str | Callable[..., Any]) -> str:
    if isinstance(factory, str):
        return factory
    module, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qual:
        raise ValueError(f"check_tier needs a factory importable by name (\"module:callable\"), got {factory!r}")
    return f"{module}:{qual}"


def tier_policy(shm_root: str | os.PathLike, factory: str, options: dict[str, Any], *, name: str = "user",
                every: int = 1, keep: int | None = 3) -> dict[str, Any]:
    """A policy dict: shared memory at `shm_root`, then the Python tier `name` (every step)."""
    tier: dict[str, Any] = {"name": name, "kind": "python", "factory": factory, "every": every, "options": options}
    if keep is not None:
        tier["keep"] = keep
    return {
        "tier": [{"name": "ram", "kind": "memory", "root": str(shm_root)}, tier],
        "store": {"chunk_size": "64KiB", "threads": 2, "io_threads": 2},
    }


def _state(step: int) -> dict[str, Any]:
    """~1.2 MB, a function of the step only; incompressible, so every byte is stored."""
    rng = np.random.default_rng(1000 + step)
    return {"model": {"w": rng.standard_normal(100_000).astype(np.float32),
                      "b": rng.integers(0, 255, 700_000, dtype=np.uint8)},
            "step": step}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["step"] == b["step"] and np.array_equal(a["model"]["w"], b["model"]["w"])
            and a["model"]["w"].tobytes() == b["model"]["w"].tobytes()
            and np.array_equal(a["model"]["b"], b["model"]["b"]))


def _read_all(obj: Any, key: str) -> bytes:
    if hasattr(obj, "get"):
        return bytes(obj.get(key))
    out, want = b"", 1 << 20
    while True:
        piece = bytes(obj.get_range(key, len(out), want))
        out += piece
        if len(piece) < want:
            return out


def _delete_prefix(obj: Any, prefix: str) -> None:
    if hasattr(obj, "delete_prefix"):
        obj.delete_prefix(prefix)
        return
    for name in obj.list(prefix):
        key = f"{prefix.rstrip('/')}/{name}"
        try:
            obj.delete(key)
        except (FileNotFoundError, KeyError):
            pass
        _delete_prefix(obj, key)


def _concurrent_writers(obj: Any, base: str) -> list[str]:
    """put_if_absent by 8 threads at once creates once; 8 puts at once leave one whole."""
    problems: list[str] = []
    key, datas = f"{base}race/COMMIT", [bytes([i]) * (100_000 + i) for i in range(8)]
    won: list[bool] = [False] * 8
    start = threading.Barrier(8)

    def create(i: int) -> None:
        start.wait()
        won[i] = bool(obj.put_if_absent(key, datas[i]))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sum(won) != 1:
        problems.append(f"concurrent_writers: {sum(won)} of 8 concurrent put_if_absent calls returned True; exactly one must")
    elif _read_all(obj, key) != datas[won.index(True)]:
        problems.append("concurrent_writers: the object is not the one put_if_absent said it created")

    key = f"{base}race/data"

    def put(i: int) -> None:
        start.wait()
        obj.put(key, datas[i])

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if _read_all(obj, key) not in datas:
        problems.append("concurrent_writers: 8 concurrent puts of one key left an object that is none of them whole")
    return problems


_SAVER = """
import json, sys
import tiercel
from tiercel.testing import _state
store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
store.save(int(sys.argv[2]), _state(int(sys.argv[2])))
store.flush()
"""


def _store_round(factory: str, options: dict[str, Any], obj: Any) -> list[str]:
    import tiercel

    problems: list[str] = []
    shm = Path("/dev/shm") / f"tiercel-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    policy = tier_policy(shm, factory, options)
    def data_key(store: Any, step: int) -> str:
        """The key of rank 0's data object of `step`: in its rank area (format version 3), or
        in the step's directory."""
        obj0 = json.loads(store._core.manifest_json("user", step, 0))["objects"][0]
        return obj0.get("key") or f"{_core.step_dir_name(step)}/{obj0['name']}"

    def area_names() -> list[str]:
        """The names in rank 0's area (format version 3), found by listing."""
        for p in obj.list("ranks"):
            if "rank-00000" in obj.list(f"ranks/{p}"):
                return obj.list(f"ranks/{p}/rank-00000")
        return []

    try:
        with tiercel.Store(policy, rank=0, world_size=1) as store:
            for step in (1, 2):
                states = store.save(step, _state(step)).wait(commit=True)
                if states.get("user") != "committed":
                    problems.append(f"save: step {step} is {states.get('user')!r} on the tier, not committed")
        # A saving process killed after its data object is written, before its manifest.
        env = {**os.environ, "TIERCEL_FAILPOINT": "persist", "PYTHONPATH": os.pathsep.join(sys.path)}
        child = subprocess.run([sys.executable, "-c", _SAVER, json.dumps(policy), "3"], env=env,
                               capture_output=True, text=True, timeout=300)
        if child.returncode >= 0:
            problems.append(f"kill: the saver of step 3 was not stopped by its failpoint (exit {child.returncode}): {child.stderr[-2000:]}")
        shutil.rmtree(shm, ignore_errors=True)  # the host lost its memory
        with tiercel.Store(policy, rank=0, world_size=1) as store:
            latest = store.latest_step()
            if latest != 2:
                problems.append(f"restore: the newest step is {latest}, expected 2 (step 3 never committed)")
            restored = store.restore(2)
            if not _same(restored, _state(2)):
                problems.append("restore: step 2 read back from the tier differs from what was saved")
            # One flipped byte in the middle of step 2's data object.
            key = data_key(store, 2)
            blob = bytearray(_read_all(obj, key))
            blob[len(blob) // 2] ^= 0x40
            obj.put(key, bytes(blob))
            try:
                bad = store.restore(2)
                problems.append("corrupt: a damaged object was read without an error"
                                + ("" if _same(bad, _state(2)) else ", and the bytes returned were wrong"))
            except IntegrityError:
                pass
            if not _same(store.restore(1), _state(1)):
                problems.append("corrupt: step 1 was not restored intact beside the damaged step 2")
            # gc: once step 4 commits, what the killed save of step 3 left goes.
            store.save(4, _state(4)).wait(commit=True)
            store._core.gc("user", 0.0)
            left = [n for n in obj.list("") + area_names() if n.startswith(_core.step_dir_name(3))]
            if left:
                problems.append(f"gc: the killed save's step 3 is still on the tier: {left}")
    except Exception as e:
        problems.append(f"store round: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return problems


def check_tier(factory: str | Callable[..., Any], **options: Any) -> None:
    """Runs the conformance suite against the tier `factory(**options)` builds; raises one
    AssertionError listing every failure."""
    name = _factory_name(factory)
    make = load_factory(name)
    obj = make(**options)
    check_protocol(obj, name)
    if obj.list(""):
        raise AssertionError(f"check_tier needs an empty tier; {name}({options}) lists {obj.list('')[:5]} at its root")
    location = str(getattr(obj, "location", None) or name)
    base = f"tiercel-check-{uuid.uuid4().hex[:8]}/"
    problems: list[str] = []
    for i, (suite, case) in enumerate(_core.conformance_cases()):
        failed = _core.run_conformance_case(suite, case, obj, "user", location, f"{base}{i:02d}/")
        if failed is not None:
            problems.append(f"{suite}/{case}: {failed}")
    problems += _concurrent_writers(obj, base)
    _delete_prefix(obj, base.rstrip("/"))
    if obj.list(""):
        problems.append(f"delete: deleting everything under {base!r} left {obj.list('')} at the root")
    else:
        problems += _store_round(name, options, obj)
    if problems:
        raise AssertionError(f"tier {name} fails {len(problems)} check(s):\n  " + "\n  ".join(problems))

