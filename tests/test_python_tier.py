"""Tiers written in Python (docs/tiers.md): a user's tier defined here (SQLite, in one file),
the fsspec tier and the example directory tier, through real Stores, real child processes
killed with SIGKILL, and the `tiercel` command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tiercel
from tiercel.errors import ConfigError, IntegrityError
from tiercel.testing import check_tier

from conftest import PYTHON, new_shm_root

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


class SqliteTier:
    """A user's tier: every object a row of one SQLite file. `fail` makes every write raise
    (a quota); `pause` (a path) makes data writes touch that file and hang, so that a test
    can kill the writer mid-save."""

    def __init__(self, path: str, fail: bool = False, pause: str | None = None, pause_seconds: float = 60) -> None:
        self.location = f"sqlite://{path}"
        self.fail, self.pause, self.pause_seconds = fail, pause, pause_seconds
        self.lock = threading.Lock()
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self.db.execute("CREATE TABLE IF NOT EXISTS blobs (key TEXT PRIMARY KEY, data BLOB NOT NULL)")

    def _check(self, key: str) -> None:
        if self.fail:
            raise OSError(f"quota exceeded writing {key}")
        if self.pause and key.endswith(".data"):
            Path(self.pause).touch()
            time.sleep(self.pause_seconds)

    def put(self, key: str, data: bytes) -> None:
        self._check(key)
        with self.lock:
            self.db.execute("INSERT OR REPLACE INTO blobs VALUES (?, ?)", (key, bytes(data)))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._check(key)
        with self.lock:
            return self.db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?)", (key, bytes(data))).rowcount == 1

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self.lock:
            row = self.db.execute("SELECT substr(data, ?, ?) FROM blobs WHERE key = ?", (offset + 1, length, key)).fetchone()
        if row is None:
            raise KeyError(key)
        return bytes(row[0] or b"")  # substr of an empty blob is NULL

    def list(self, prefix: str) -> list[str]:
        start = f"{prefix.rstrip('/')}/" if prefix else ""
        with self.lock:
            keys = [k for (k,) in self.db.execute("SELECT key FROM blobs WHERE substr(key, 1, ?) = ?", (len(start), start))]
        return sorted({k[len(start):].split("/", 1)[0] for k in keys})

    def delete(self, key: str) -> None:
        with self.lock:
            self.db.execute("DELETE FROM blobs WHERE key = ?", (key,))


def state(step: int) -> dict:
    """~3 MB, a function of the step only."""
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal(500_000).astype(np.float32), "b": rng.bytes(1_000_000)}, "step": step}


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["model"]["w"].tobytes() == b["model"]["w"].tobytes()
    assert bytes(a["model"]["b"]) == b["model"]["b"]


def env_with_tests() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(EXAMPLES), *sys.path])}


def policy(shm: Path, db: Path, *, disk: Path | None = None, **opts) -> dict:
    tiers = [{"name": "ram", "kind": "memory", "root": str(shm)},
             {"name": "archive", "kind": "python", "factory": "test_python_tier:SqliteTier", "every": 1,
              "options": {"path": str(db), **opts}}]
    if disk is not None:
        tiers.append({"name": "disk", "kind": "fs", "url": str(disk)})
    return {"tier": tiers, "store": {"chunk_size": "256KiB", "threads": 2, "io_threads": 2}}


@pytest.fixture
def shm():
    root = new_shm_root("pytier-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


# --- the conformance suite ------------------------------------------------------------


def test_the_example_directory_tier_passes_check_tier(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    check_tier("directory_tier:DirectoryTier", root=str(tmp_path / "archive"))


def test_the_sqlite_tier_passes_check_tier(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", env_with_tests()["PYTHONPATH"])
    check_tier(SqliteTier, path=str(tmp_path / "blobs.db"))


@pytest.mark.parametrize("url", ["file", "memory"])
def test_the_fsspec_tier_passes_check_tier(tmp_path, url):
    pytest.importorskip("fsspec")
    where = f"file://{tmp_path}/fs" if url == "file" else f"memory://tiercel-check-{os.getpid()}"
    check_tier("tiercel.tiers.fsspec:FsspecTier", url=where)


class ForgetsOffsets(SqliteTier):
    """A broken tier: ranged reads start at the object's beginning."""

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return super().get_range(key, 0, length)


class CreatesTwice(SqliteTier):
    """A broken tier: put_if_absent replaces and says it created."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.put(key, data)
        return True


@pytest.mark.parametrize("broken,case", [(ForgetsOffsets, "ranged_reads_are_exact"), (CreatesTwice, "put_if_absent_creates_once")])
def test_check_tier_fails_a_broken_tier_naming_the_case(tmp_path, broken, case):
    with pytest.raises(AssertionError, match=case):
        check_tier(broken, path=str(tmp_path / "blobs.db"))


# --- a user's tier under a Store ------------------------------------------------------


def test_kill_mid_save_then_restore_after_ram_is_wiped(tmp_path, shm):
    db = tmp_path / "blobs.db"
    p = policy(shm, db)
    with tiercel.Store(p, rank=0, world_size=1) as store:
        for step in (1, 2):
            assert store.save(step, state(step)).wait(commit=True)["archive"] == "committed"
    # A process whose persist of step 3 hangs inside the tier's put is killed with SIGKILL.
    marker = tmp_path / "in-put"
    saver = textwrap.dedent("""
        import json, sys, tiercel, test_python_tier as t
        store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
        store.save(3, t.state(3)).wait(commit=True)
    """)
    child = subprocess.Popen([PYTHON, "-c", saver, json.dumps(policy(shm, db, pause=str(marker)))], env=env_with_tests())
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, "the saver ended before its write began"
        assert time.monotonic() < deadline, "the saver never reached the tier's put"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    shutil.rmtree(shm)  # the host's memory is gone
    with tiercel.Store(p, rank=0, world_size=1) as store:
        assert store.latest_step() == 2
        assert_same(store.restore(), state(2))
        assert set(store.last_restore.tiers) == {"archive"}, store.last_restore


def _flip_data_byte(db: Path, step: int) -> None:
    tier = SqliteTier(str(db))
    # Rank 0's data object of the step, in its rank area (format version 3).
    [(key,)] = tier.db.execute("SELECT key FROM blobs WHERE key LIKE ?", (f"ranks/%/rank-00000/step-{step:012d}.%.data",)).fetchall()
    data = bytearray(tier.get_range(key, 0, 1 << 30))
    data[len(data) // 2] ^= 0x10
    tier.put(key, bytes(data))


def test_a_corrupted_object_is_caught_never_returned(tmp_path, shm):
    db, disk = tmp_path / "blobs.db", tmp_path / "disk"
    with tiercel.Store(policy(shm, db, disk=disk), rank=0, world_size=1) as store:
        store.save(1, state(1)).wait(commit=True)
    shutil.rmtree(shm)
    _flip_data_byte(db, 1)
    # With another copy: the damaged chunk comes from the next tier.
    with tiercel.Store(policy(shm, db, disk=disk), rank=0, world_size=1) as store:
        assert_same(store.restore(1), state(1))
        assert any("disk" in t for t in store.last_restore.tiers), store.last_restore
        assert any("checksum mismatch" in w for w in store.last_restore.warnings), store.last_restore
    # Without one: an IntegrityError, never the damaged bytes.
    shutil.rmtree(shm)
    with tiercel.Store(policy(shm, db), rank=0, world_size=1) as store:
        with pytest.raises(IntegrityError):
            store.restore(1)


def test_the_tiers_exceptions_name_it_and_spare_the_other_tiers(tmp_path, shm):
    disk = tmp_path / "disk"
    with tiercel.Store(policy(shm, tmp_path / "blobs.db", disk=disk, fail=True), rank=0, world_size=1) as store:
        handle = store.save(1, state(1))
        with pytest.raises(tiercel.errors.TiercelError) as e:
            handle.wait(commit=True)
        msg = str(e.value)
        assert "tier 'archive'" in msg and "quota exceeded" in msg and "step-000000000001." in msg, msg
        assert "test_python_tier.py:" in msg, f"the user's file and line are missing: {msg}"
        states = handle.states()
        assert states["ram"] == "committed" and states["disk"] == "committed", states
        assert states["archive"].startswith("failed"), states
        assert_same(store.restore(1), state(1))


def test_the_cli_lists_verifies_and_collects_on_it(tmp_path, shm):
    db = tmp_path / "blobs.db"
    toml = tmp_path / "tiercel.toml"
    toml.write_text(textwrap.dedent(f"""
        [[tier]]
        name = "ram"
        kind = "memory"
        root = "{shm}"

        [[tier]]
        name = "archive"
        kind = "python"
        factory = "test_python_tier:SqliteTier"
        keep = 1
        [tier.options]
        path = "{db}"
    """))
    with tiercel.Store(str(toml), rank=0, world_size=1) as store:
        for step in (1, 2):
            store.save(step, state(step)).wait(commit=True)
    SqliteTier(str(db)).put("step-000000000001/rank-00000.data", b"left over")  # retention already removed step 1

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "tiercel", "--policy", str(toml), *args], env=env_with_tests(),
                              capture_output=True, text=True, timeout=300)

    ls = cli("ls", "--json")
    assert ls.returncode == 0, ls.stderr
    tiers = {t["name"]: t for t in json.loads(ls.stdout)["tiers"]}
    assert tiers["archive"]["kind"] == "python", tiers
    assert "2" in ls.stdout
    verify = cli("verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    _flip_data_byte(db, 2)
    bad = cli("verify")
    assert bad.returncode != 0 and "archive" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    gc = cli("gc")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert "step-000000000001" not in SqliteTier(str(db)).list("")


# --- fsspec in a new process ----------------------------------------------------------


def test_an_fsspec_restore_in_a_new_process_is_bit_identical(tmp_path, shm):
    pytest.importorskip("fsspec")
    p = {"tier": [{"name": "ram", "kind": "memory", "root": str(shm)},
                  {"name": "remote", "kind": "fsspec", "url": f"file://{tmp_path}/fsspec", "every": 1}],
         "store": {"chunk_size": "256KiB", "threads": 2, "io_threads": 2}}
    with tiercel.Store(p, rank=0, world_size=1) as store:
        store.save(7, state(7)).wait(commit=True)
    shutil.rmtree(shm)
    out = tmp_path / "restored.npy"
    reader = textwrap.dedent("""
        import json, sys, numpy as np, tiercel
        store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
        s = store.restore()
        assert set(store.last_restore.tiers) == {"remote"}, store.last_restore.tiers
        np.save(sys.argv[2], np.frombuffer(s["model"]["w"].tobytes() + bytes(s["model"]["b"]), dtype=np.uint8))
    """)
    r = subprocess.run([PYTHON, "-c", reader, json.dumps(p), str(out)], env=env_with_tests(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    want = state(7)
    assert np.load(out).tobytes() == want["model"]["w"].tobytes() + want["model"]["b"]


def test_a_process_that_exits_mid_persist_exits_cleanly(tmp_path, shm):
    """A background persist into a Python tier still running when the interpreter exits must
    not call into a finalizing interpreter (CPython would end the thread inside Rust and
    abort the process): the call in flight returns, later calls fail as the tier's failure,
    and the exit status is the script's."""
    marker = tmp_path / "in-put"
    script = textwrap.dedent("""
        import json, sys, time, tiercel, test_python_tier as t
        store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
        store.save(1, t.state(1))
        while not __import__("os").path.exists(sys.argv[2]):
            time.sleep(0.01)
    """)
    p = policy(shm, tmp_path / "blobs.db", pause=str(marker), pause_seconds=3)
    r = subprocess.run([PYTHON, "-c", script, json.dumps(p), str(marker)], env=env_with_tests(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "FATAL" not in r.stderr, (r.returncode, r.stderr)
    assert "the Python interpreter is exiting" in r.stderr, r.stderr


def test_the_store_says_what_each_tier_is(tmp_path, shm):
    p = policy(shm, tmp_path / "blobs.db", disk=tmp_path / "disk")
    p["tier"].append({"name": "local", "kind": "fsspec", "url": f"file://{tmp_path}/fsspec"})
    with tiercel.Store(p, rank=0, world_size=1) as store:
        caps = {t["name"]: (t["network"], t["persists"], t["commit_records"], t["memory_layout"], t["cluster"], t["directory"])
                for t in store.tiers()}
    assert caps == {"ram": (False, False, True, True, False, str(shm)),
                    "archive": (True, True, True, False, False, None),
                    "disk": (False, True, True, False, False, str(tmp_path / "disk")),
                    "local": (False, True, True, False, False, None)}


# --- the policy -----------------------------------------------------------------------


def write_policy(tmp_path: Path, shm: Path, tier_lines: str) -> Path:
    p = tmp_path / "tiercel.toml"
    p.write_text(f'[[tier]]\nname = "ram"\nkind = "memory"\nroot = "{shm}"\n\n[[tier]]\nname = "archive"\n{tier_lines}')
    return p


@pytest.mark.parametrize("lines,expect", [
    ('kind = "python"\nfactory = "not a factory"\n', r'tiercel.toml:9: tier\[1\] \("archive"\).factory: expected "module:callable"'),
    ('kind = "python"\n', r'tiercel.toml:6: tier\[1\] \("archive"\): missing `factory`'),
    ('kind = "python"\nfactory = "no_such_module_here:make"\n', r"tiercel.toml:6: tier\[1\] \(\"archive\"\).factory: cannot import module 'no_such_module_here'"),
    ('kind = "python"\nfactory = "json:no_such_name"\n', r"tiercel.toml:6: .*module 'json' has no 'no_such_name'"),
    ('kind = "python"\nfactory = "json:dumps"\n', r"tiercel.toml:6: .*json:dumps\(\) raised TypeError"),
    ('kind = "python"\nfactory = "collections:OrderedDict"\n', r"returned a OrderedDict without put, put_if_absent, get_range, list, delete"),
    ('kind = "fsspec"\n', r'tiercel.toml:6: tier\[1\] \("archive"\): missing `url`'),
    ('kind = "fsspec"\nurl = "/no/protocol"\n', r'tiercel.toml:9: tier\[1\] \("archive"\).url: expected an fsspec URL'),
    ('kind = "hdfs"\n', r'tiercel.toml:8: tier\[1\] \("archive"\).kind: unknown kind "hdfs"; known kinds: .*"python", "fsspec".*tiercel.tiers'),
    ('kind = "fs"\nurl = "/tmp/x"\nfactory = "a:b"\n', r"`factory` is only valid for Python tiers"),
])
def test_policy_errors_name_the_file_and_line(tmp_path, shm, lines, expect):
    with pytest.raises(ConfigError, match=expect):
        tiercel.Store(str(write_policy(tmp_path, shm, lines)), rank=0, world_size=1)


def test_an_installed_package_adds_a_kind_by_entry_point(tmp_path, shm):
    site = tmp_path / "site"
    dist = site / "tiercel_dirtier-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiercel-dirtier\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tiercel.tiers]\ndirtier = directory_tier:DirectoryTier\n")
    toml = write_policy(tmp_path, shm, f'kind = "dirtier"\nevery = 1\n[tier.options]\nroot = "{tmp_path}/plugin"\n')
    script = textwrap.dedent("""
        import sys, tiercel, test_python_tier as t
        with tiercel.Store(sys.argv[1], rank=0, world_size=1) as store:
            assert [x["kind"] for x in store.tiers()] == ["memory", "dirtier"], store.tiers()
            assert store.save(5, t.state(5)).wait(commit=True)["archive"] == "committed"
    """)
    env = env_with_tests()
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    r = subprocess.run([PYTHON, "-c", script, str(toml)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "plugin" / "step-000000000005" / "COMMIT").exists()
