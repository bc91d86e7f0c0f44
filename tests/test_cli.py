"""The `tiercel` command line, run for real (`python -m tiercel` in a subprocess) against
stores saved here: a memory tier under /dev/shm and an fs tier under tmp_path, two ranks.

Each subprocess pays for importing the package (torch included), so the checks that need a
real process are few and each does a lot; smaller checks call `cli.main()` in-process.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import tiercel
from tiercel import cli
from tiercel.cli.output import Progress, fmt_bytes

from conftest import manifest_path

WORLD = 2
STEPS = (1, 2, 3, 4)

POLICY = """\
# written by tests/test_cli.py
[[tier]]
name = "ram"
kind = "memory"
root = "{shm}"
keep = {ram_keep}

[[tier]]
name = "disk"
kind = "fs"
url = "{disk}"
every = 2
keep = {disk_keep}
compression = "zstd"

[store]
chunk_size = "64KiB"
"""


def state_of(step: int, rank: int) -> dict:
    rng = np.random.default_rng(step * 100 + rank)
    return {
        "model": {
            # Half noise, half zeros: compresses, but not to nothing; 3 chunks of 64 KiB.
            "w": np.concatenate([rng.standard_normal(20000, dtype=np.float32), np.zeros(20000, np.float32)]),
            "b": np.full(10, step + rank / 10, dtype=np.float64),
        },
        "extra": {"blob": bytes([step, rank]) * 50, "note": f"step {step}"},
    }


@dataclass
class Env:
    tmp: Path
    policy: Path
    shm: Path
    disk: Path

    def write_policy(self, path: Path, ram_keep: int = 3, disk_keep: int = 2) -> Path:
        path.write_text(POLICY.format(shm=self.shm, disk=self.disk, ram_keep=ram_keep, disk_keep=disk_keep))
        return path

    def step_dir(self, tier: str, step: int) -> Path:
        return (self.shm if tier == "ram" else self.disk) / f"step-{step:012d}"


@pytest.fixture
def env(tmp_path: Path):
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    e = Env(tmp_path, tmp_path / "tiercel.toml", shm_base / f"tiercel-cli-test-{uuid.uuid4().hex[:12]}", tmp_path / "disk")
    e.write_policy(e.policy)
    try:
        # Rank by rank: each step commits on a tier once the second rank has written it.
        for rank in range(WORLD):
            with tiercel.Store(e.policy, rank=rank, world_size=WORLD) as store:
                # Not `wait()`: it would wait for the other rank's part of each memory commit.
                # A flush after each save: every step reaches the disk tier (a persist still
                # queued when the next save's arrives is skipped by design, and the tests
                # count the disk tier's steps).
                handles = []
                for step in STEPS:
                    handles.append(store.save(step, state_of(step, rank)))
                    store.flush()
                assert not [h.states() for h in handles if "failed" in str(h.states())], [h.states() for h in handles]
        yield e
    finally:
        shutil.rmtree(e.shm, ignore_errors=True)


def run(*args: str, policy: Path | None = None, env_vars: dict | None = None, cwd: Path | None = None):
    cmd = [sys.executable, "-m", "tiercel"]
    if policy is not None:
        cmd += ["--policy", str(policy)]
    e = {k: v for k, v in os.environ.items() if k != "TIERCEL_POLICY"}
    e.update(env_vars or {})
    r = subprocess.run(cmd + list(args), capture_output=True, text=True, env=e, cwd=cwd, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def main(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- through a real process ------------------------------------------------------------------


def test_ls_text_and_json_policy_from_env(env: Env):
    # An uncommitted leftover (a rank that died mid-save) is listed as such.
    left = env.step_dir("disk", 1)
    left.mkdir()
    (left / "rank-00000.data").write_bytes(b"x" * 1000)

    r = run("ls", policy=env.policy)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(l.startswith("ram (memory, ") and "keep 3" in l for l in lines), r.stdout
    assert any(l.startswith("disk (fs, ") and "every 2" in l and "zstd:3" in l for l in lines), r.stdout
    rows = [l.split() for l in lines if l.startswith("  ") and not l.strip().startswith("STEP")]
    committed = [(row[0], row[2]) for row in rows if row[1] == "committed"]
    assert committed == [("2", "2"), ("3", "2"), ("4", "2"), ("2", "2"), ("4", "2")], r.stdout
    assert [row for row in rows if row[1] == "uncommitted"][0][:2] == ["1", "uncommitted"]
    header = next(l for l in lines if l.strip().startswith("STEP"))
    assert header.split() == ["STEP", "STATE", "RANKS", "SIZE", "RAW", "COMMITTED"]

    # $TIERCEL_POLICY, from a directory without a tiercel.toml.
    elsewhere = env.tmp / "elsewhere"
    elsewhere.mkdir()
    r = run("ls", "--json", env_vars={"TIERCEL_POLICY": str(env.policy)}, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["policy"] == str(env.policy)
    tiers = {t["name"]: t for t in doc["tiers"]}
    assert [s["step"] for s in tiers["ram"]["steps"]] == [2, 3, 4]
    disk = {s["step"]: s for s in tiers["disk"]["steps"]}
    assert disk[1]["state"] == "uncommitted" and disk[1]["stored_bytes"] == 1000 and disk[1]["ranks"] == 0
    s4 = disk[4]
    raw = sum(v.nbytes for r_ in range(WORLD) for v in (state_of(4, r_)["model"]["w"], state_of(4, r_)["model"]["b"])) + 2 * 100
    on_disk = stored_size(env.disk, 4)
    assert (s4["state"], s4["world_size"], s4["ranks"], s4["raw_bytes"], s4["stored_bytes"]) == ("committed", 2, 2, raw, on_disk)
    assert s4["stored_bytes"] < s4["raw_bytes"]  # zstd
    assert abs(s4["time"] - time.time()) < 600


def stored_size(root: Path, step: int) -> int:
    """Bytes of the distinct objects the step's manifests refer to (format version 3: in the
    ranks' areas, possibly another step's), as they lie on disk."""
    sizes = {}
    for rank in range(WORLD):
        m = json.loads(manifest_path(root, step, rank).read_text())
        for o in m["objects"]:
            sizes[o["key"]] = (root / o["key"]).stat().st_size
    return sum(sizes.values())


def test_inspect(env: Env):
    r = run("inspect", "4", "--tier", "disk", policy=env.policy)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "step 4 on tier 'disk', world size 2" in out
    assert "committed on: ram, disk" in out
    assert "rank 0:" in out and "rank 1:" in out
    w = next(l.split() for l in out.splitlines() if l.strip().startswith("model/w"))
    # ITEM KIND DTYPE SHAPE BYTES(2 words) CHUNKS CODECS STORED(2) RATIO
    assert w[:4] == ["model/w", "array", "float32", "[40000]"]
    assert w[6:8] == ["3", "zstd"]
    assert float(w[-1].rstrip("x")) > 1.2
    assert any(l.split()[:3] == ["extra/blob", "bytes", "uint8"] for l in out.splitlines())


def test_verify_ok_and_missing_step(env: Env):
    r = run("verify", policy=env.policy)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checksums hold" in r.stdout
    # Not a terminal: one line per step on stderr.
    assert [l.split(":")[1].strip() for l in r.stderr.splitlines()] == [
        "tier 'ram' step 2", "tier 'ram' step 3", "tier 'ram' step 4", "tier 'disk' step 2", "tier 'disk' step 4"]

    r = run("verify", "9", policy=env.policy)
    assert r.returncode == 3
    assert r.stderr.startswith("tiercel: error: step 9 is committed on no tier")


def test_verify_finds_flipped_byte(env: Env):
    m = json.loads(manifest_path(env.disk, 4, 1).read_text())
    item = next(i for i in m["items"] if i["name"] == "model/w")
    c = item["chunks"][1]
    flip_byte(env.disk / m["objects"][c["object"]]["key"], c["stored_offset"] + c["stored_len"] // 2)

    r = run("verify", policy=env.policy)
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [l for l in r.stdout.splitlines() if l.startswith("CORRUPT")]
    assert len(bad) == 1, r.stdout
    assert "tier 'disk' step 4 rank 1 item 'model/w'" in bad[0]
    assert "chunk 1" in bad[0]
    assert "1 corrupt" in r.stdout.splitlines()[-1]


def test_cp_skipped_step_then_restore_from_disk_only(env: Env):
    with tiercel.Store(env.policy, rank=0, world_size=1) as s:
        assert 3 not in s.steps()["disk"]  # `every = 2` skipped it
    r = run("cp", "3", "--from", "ram", "--to", "disk", policy=env.policy)
    assert r.returncode == 0, r.stderr
    assert "copied step 3 (2 ranks" in r.stdout
    assert r.stderr == ""  # not a terminal: no progress bar

    with tiercel.Store(env.policy, rank=0, world_size=1) as s:
        assert 3 in s.steps()["disk"]
        for rank in range(WORLD):
            reader = s.reader(3, rank=rank, tiers=["disk"])
            got = reader.get_all()
            want = state_of(3, rank)
            for k in ("w", "b"):
                a, b = got["model"][k], want["model"][k]
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
            assert got["extra"] == want["extra"]
            assert set(reader.info.tiers) == {"disk"}


def test_gc_removes_leftovers_beyond_keep_and_stale_tmp(env: Env):
    for tier in ("ram", "disk"):  # a rank that died mid-save, older than the newest step
        d = env.step_dir(tier, 1)
        d.mkdir()
        (d / "rank-00000.part-000.data").write_bytes(b"\0" * 64)
    newer = env.step_dir("disk", 9)  # a save in progress: newer than any committed step
    newer.mkdir()
    (newer / "rank-00000.data").write_bytes(b"\0" * 64)
    d4 = env.step_dir("disk", 4)
    old = time.time() - 7200
    stale = d4 / "rank-00000.data.tmp-999999999-0"  # no such process
    live = d4 / f"rank-00001.data.tmp-{os.getpid()}-0"  # its writer is alive
    for p in (stale, live):
        p.write_bytes(b"tmp")
        os.utime(p, (old, old))
    outside = env.tmp / "outside.tmp-999999999-1"
    outside.write_bytes(b"keep me")
    os.symlink(outside, d4 / "link.tmp-999999999-2")

    tighter = env.write_policy(env.tmp / "keep1.toml", ram_keep=1, disk_keep=1)
    r = run("gc", policy=tighter)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ram: removed step 1 (uncommitted leftover)" in out
    assert "ram: removed step 2 (committed; beyond keep 1)" in out
    assert "ram: removed step 3 (committed; beyond keep 1)" in out
    assert "disk: removed step 1 (uncommitted leftover)" in out
    assert "disk: removed step 2 (committed; beyond keep 1)" in out
    assert f"disk: removed temp file step-{4:012d}/{stale.name} (stale temporary file: its writer (pid 999999999) is gone, 3 B)" in out
    # And in the rank areas, the manifests of the removed steps and what only they referred to.
    assert out.splitlines()[-1].startswith("gc: removed 5 steps and 1 temporary file, "), out
    assert "of rank areas" in out.splitlines()[-1]

    assert sorted(p.name for p in env.shm.glob("step-*")) == [f"step-{4:012d}"]
    assert sorted(p.name for p in env.disk.glob("step-*")) == [f"step-{4:012d}", f"step-{9:012d}"]
    assert not stale.exists() and live.exists() and (d4 / "link.tmp-999999999-2").is_symlink()
    assert outside.read_bytes() == b"keep me"
    with tiercel.Store(tighter, rank=0, world_size=1) as s:
        assert s.steps() == {"ram": [4], "disk": [4]}


def test_bad_policy_is_a_usage_error_with_file_and_line(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tier]]\nname = "ram"\nkind = "memory"\nroot = "/dev/shm/never-used"\nkeep = -1\n')
    r = run("ls", policy=bad)
    assert r.returncode == 2
    assert r.stderr.startswith(f"tiercel: error: {bad}:5:"), r.stderr
    assert "keep" in r.stderr
    assert not Path("/dev/shm/never-used").exists()


# -- in-process: the smaller cases -----------------------------------------------------------


def test_inspect_json_default_tier_and_rank(env: Env, capsys):
    code, out, _ = main(capsys, "--policy", str(env.policy), "inspect", "3", "--rank", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert (doc["tier"], doc["on_tiers"], doc["world_size"]) == ("ram", ["ram"], 2)
    [rk] = doc["ranks"]
    assert rk["rank"] == 1 and rk["puts"] == ["model", "extra"]
    items = {i["name"]: i for i in rk["items"]}
    assert items["model/w"]["shape"] == [40000] and items["model/w"]["chunks"] == 3
    assert items["model/w"]["codecs"] == {"raw": 3} and items["model/w"]["ratio"] == 1.0
    assert main(capsys, "--policy", str(env.policy), "inspect", "3", "--rank", "2")[0] == 3
    assert main(capsys, "--policy", str(env.policy), "inspect", "3", "--tier", "disk")[0] == 3


def test_verify_json_one_tier(env: Env, capsys):
    seg = env.step_dir("ram", 2) / "rank-00000.part-000.data"
    flip_byte(seg, 10)
    code, out, _ = main(capsys, "--policy", str(env.policy), "verify", "--tier", "disk", "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    code, out, _ = main(capsys, "--policy", str(env.policy), "verify", "2", "--json")
    assert code == 1
    doc = json.loads(out)
    assert [(c["tier"], c["step"], c["ok"]) for c in doc["checked"]] == [("ram", 2, False), ("disk", 2, True)]
    [p] = doc["problems"]
    assert (p["tier"], p["step"], p["rank"], p["item"], p["kind"]) == ("ram", 2, 0, "model/w", "corrupt")


def test_usage_errors_rm_and_cp_noop(env: Env, capsys, monkeypatch, tmp_path):
    pol = str(env.policy)
    code, _, err = main(capsys, "--policy", pol, "verify", "--tier", "tape")
    assert code == 2 and "no tier named 'tape'" in err and "ram, disk" in err
    assert main(capsys, "--policy", pol, "cp", "2", "--from", "ram", "--to", "ram")[0] == 2
    code, out, _ = main(capsys, "--policy", pol, "cp", "2", "--from", "ram", "--to", "disk")
    assert code == 0 and "already committed" in out
    assert main(capsys, "--policy", pol, "rm", "3", "--tier", "ram")[:2] == (0, "removed step 3 from tier 'ram'\n")
    assert main(capsys, "--policy", pol, "rm", "3", "--tier", "ram")[0] == 3
    # No --policy, no $TIERCEL_POLICY and no ./tiercel.toml.
    monkeypatch.delenv("TIERCEL_POLICY", raising=False)
    monkeypatch.chdir(tmp_path / "disk")
    code, _, err = main(capsys, "ls")
    assert code == 2 and "tiercel.toml" in err and "--policy" in err
    # --policy wins over $TIERCEL_POLICY.
    monkeypatch.setenv("TIERCEL_POLICY", str(tmp_path / "missing.toml"))
    assert main(capsys, "--policy", pol, "ls")[0] == 0
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "-1"])
    assert e.value.code == 2


def test_gc_dry_run_removes_nothing(env: Env, capsys):
    d = env.step_dir("disk", 1)
    d.mkdir()
    tighter = env.write_policy(env.tmp / "keep1.toml", ram_keep=1, disk_keep=1)
    code, out, _ = main(capsys, "--policy", str(tighter), "gc", "--dry-run")
    assert code == 0
    assert out.splitlines()[-1].startswith("gc: would remove 4 steps and 0 temporary files"), out
    assert d.is_dir() and len(list(env.shm.glob("step-*"))) == 3


def test_progress_helper():
    buf = io.StringIO()
    p = Progress("cp", 2, 2048, unit="rank", stream=buf)
    p.update(done=1, nbytes=1024)
    p.update(done=2, nbytes=2048)
    p.finish("done")
    assert buf.getvalue() == "done\n"  # not a terminal: the final message only

    class Tty(io.StringIO):
        def isatty(self):
            return True

    t = Tty()
    now = [100.0]
    p = Progress("verify", 4, 4096, unit="rank", stream=t, clock=lambda: now[0])
    now[0] = 102.0
    p.update(done=2, nbytes=2048)
    now[0] = 104.0
    p.update(done=4, nbytes=4096)
    p.finish("ok")
    one = Tty()
    Progress("gc", 1, unit="tier", stream=one).update(done=1)
    assert one.getvalue() == "\rgc [########################] 1/1 tier\x1b[K"
    assert t.getvalue() == ("\rverify [############............] 2/4 ranks  2.0 KiB / 4.0 KiB  1.0 KiB/s  ETA 0:02\x1b[K"
                            "\rverify [########################] 4/4 ranks  4.0 KiB / 4.0 KiB  1.0 KiB/s  ETA 0:00\x1b[K"
                            "\r\x1b[Kok\n")
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 5 << 30)] == ["0 B", "1023 B", "1.0 KiB", "5.0 GiB"]


def test_placement_command_needs_no_policy(tmp_path):
    p = subprocess.run([sys.executable, "-m", "tiercel", "placement", "--hosts", "8", "--replicas", "2", "--failures", "2"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    # 8 hosts, m = 2, k = 2: 24 of the 28 failure pairs leave every host a copy (group), 20 (ring).
    assert "24 of 28" in p.stdout and "20 of 28" in p.stdout, p.stdout


# -- --json on every command, options anywhere, progress on a terminal, wording --------------


def test_json_on_every_command_and_options_anywhere(env: Env, capsys):
    pol = str(env.policy)

    def doc(*args: str, code: int = 0) -> dict:
        got, out, _ = main(capsys, *args)
        assert got == code, out
        return json.loads(out)

    # --policy and --json before or after the command, options between the positionals.
    ls = doc("ls", "--json", "--policy", pol)
    assert doc("--json", "--policy", pol, "ls") == ls
    assert [t["name"] for t in ls["tiers"]] == ["ram", "disk"]

    cp = doc("--json", "cp", "--from", "ram", "3", "--policy", pol, "--to", "disk")
    assert (cp["step"], cp["from"], cp["to"], cp["copied"], cp["world_size"]) == (3, "ram", "disk", True, 2)
    assert cp["raw_bytes"] == ls["tiers"][0]["steps"][1]["raw_bytes"] and cp["seconds"] >= 0
    assert doc("--policy", pol, "cp", "3", "--from", "ram", "--to", "disk", "--json")["copied"] is False
    assert doc("--policy", pol, "rm", "3", "--tier", "disk", "--json") == {"tier": "disk", "step": 3, "removed": True}

    tighter = str(env.write_policy(env.tmp / "keep1.toml", ram_keep=1, disk_keep=1))
    gc = doc("gc", "--dry-run", "--json", "--policy", tighter)
    counts = {"steps": 3, "temp_files": 0, "uploads": 0, "segments": 0}
    assert gc["dry_run"] is True and {k: v for k, v in gc["counts"].items() if k != "objects"} == counts
    # Step 2's manifests in the disk tier's rank areas (format version 3), and what only they refer to.
    assert gc["counts"]["objects"] >= WORLD
    by_tier = {t["name"]: t for t in gc["tiers"]}
    step = {"what": "step", "path": None, "bytes": None}
    assert by_tier["ram"]["removals"] == [step | {"step": 2, "reason": "committed; beyond keep 1"},
                                          step | {"step": 3, "reason": "committed; beyond keep 1"}]
    assert [r["step"] for r in by_tier["disk"]["removals"] if r["what"] == "step"] == [2]
    gc = doc("gc", "--json", "--policy", tighter)
    assert gc["dry_run"] is False and gc["counts"]["steps"] == 3
    assert doc("ls", "--json", "--policy", tighter)["tiers"][0]["steps"][0]["step"] == 4

    pl = doc("placement", "--hosts", "8", "--replicas", "2", "--failures", "2", "--json")
    assert (pl["hosts"], pl["replicas"], pl["failures"], pl["failure_sets"]) == (8, 2, 2, 28)
    group, ring = pl["strategies"]["group"], pl["strategies"]["ring"]
    assert (group["survivable_sets"], ring["survivable_sets"]) == (24, 20)
    assert group["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and group["closed_form"]["exact"] is True
    assert doc("placement", "--hosts", "8", "--replicas", "3", "--json")["strategies"]["group"] == {
        "possible": False, "why": "3 does not divide 8"}

    # Errors are JSON on stdout too (and one line on stderr), with the exit code.
    code, out, err = main(capsys, "--json", "--policy", pol, "inspect", "99")
    assert code == 3 and err.startswith("tiercel: error: step 99 is committed on no tier")
    none = dict.fromkeys(("tier", "step", "rank", "item", "chunk", "path"))
    assert json.loads(out) == {"ok": False, "exit_code": 3,
                               "error": {"type": "NotFoundError", "message": err[len("tiercel: error: "):].strip(), **none,
                                         "step": 99}}
    code, out, _ = main(capsys, "--json", "--policy", pol, "inspect", "4", "--rank", "5")
    assert code == 3 and {k: json.loads(out)["error"][k] for k in ("tier", "step", "rank")} == {"tier": "ram", "step": 4, "rank": 5}
    code, out, _ = main(capsys, "placement", "--hosts", "1", "--replicas", "2", "--json")
    assert code == 2 and json.loads(out)["error"]["type"] == "InvalidArgumentError"

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"tiercel {tiercel.__version__} (format {tiercel.FORMAT_VERSION})\n"


def run_on_terminal(*args: str, policy: Path) -> tuple[int, str, str]:
    """Runs the command with stderr on a pseudo-terminal (where progress bars are drawn);
    returns the exit code, stdout and what the terminal showed."""
    import pty

    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "tiercel", "--policy", str(policy), *args],
                             stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        shown = b""
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            shown += data
        out = p.stdout.read() if p.stdout else ""
        return p.wait(timeout=120), out, shown.decode()
    finally:
        os.close(master)


def test_progress_with_rate_and_eta_on_a_terminal(env: Env):
    code, out, shown = run_on_terminal("cp", "3", "--from", "ram", "--to", "disk", policy=env.policy)
    assert code == 0 and "copied step 3 (2 ranks" in out
    bars = [b for b in shown.split("\r") if b.startswith("cp step 3 ram -> disk [")]
    # Drawn at most ten times a second: the first chunk's bar (within the first rank), the last.
    assert re.search(r"\] 0/2 ranks  \d+\.\d KiB / ", bars[0]) and "2/2 ranks" in bars[-1], shown
    assert all("/s  ETA " in b for b in bars), shown  # a rate and the time left, once bytes moved
    code, out, shown = run_on_terminal("verify", "3", policy=env.policy)
    assert code == 0 and "all checksums hold" in out
    assert "verify ram step 3 [" in shown and "/s  ETA " in shown, shown


def test_one_rank_is_one_rank(tmp_path: Path, capsys):
    e = Env(tmp_path, tmp_path / "tiercel.toml", Path("/dev/shm") / f"tiercel-cli-test-{uuid.uuid4().hex[:12]}", tmp_path / "disk")
    e.write_policy(e.policy)
    try:
        with tiercel.Store(e.policy, rank=0, world_size=1) as store:
            store.save(1, {"x": np.ones(10)}).wait(30)
        pol = str(e.policy)
        code, out, err = main(capsys, "--policy", pol, "cp", "1", "--from", "ram", "--to", "disk")
        assert code == 0 and "copied step 1 (1 rank, " in out, out
        code, out, err = main(capsys, "--policy", pol, "verify", "1", "--tier", "disk")
        assert code == 0 and "1/1 rank, 1 item," in err and "1 rank, 1 item" in out, (out, err)
        assert main(capsys, "--policy", pol, "inspect", "1", "--rank", "1")[2].endswith("saved by 1 rank; there is no rank 1\n")
    finally:
        shutil.rmtree(e.shm, ignore_errors=True)


# -- a tier out of reach, a peer tier: the others are still listed, checked, cleaned -------


def test_unreachable_tier_and_peer_tier_do_not_hide_the_others(env: Env, capsys, monkeypatch):
    from test_multirank import free_port

    # Nothing listens on the bucket's port: every request is refused at once.
    policy = env.tmp / "more.toml"
    policy.write_text(env.policy.read_text().replace("[store]", f"""\
[[tier]]
name = "peer"
kind = "peer"

[[tier]]
name = "bucket"
kind = "s3"
url = "s3://ckpt/run1"
endpoint = "http://127.0.0.1:{free_port()}"
retries = 0
timeout = 5

[store]"""))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    pol = str(policy)

    code, out, err = main(capsys, "ls", "--policy", pol)
    assert code == 4, out + err
    assert "    4  committed" in out and "ram (memory" in out and "disk (fs" in out  # the reachable tiers, in full
    assert "peer (peer, 0.0.0.0:0, keep 2)\n  (not looked at: a peer tier's replicas" in out
    assert "bucket (s3, s3://ckpt/run1, keep all, zstd:3)\n  (cannot list: " in out
    assert "tiercel: error: tier 'bucket' cannot be listed: " in err
    doc = json.loads(main(capsys, "ls", "--policy", pol, "--json")[1])
    by_name = {t["name"]: t for t in doc["tiers"]}
    assert [s["step"] for s in by_name["ram"]["steps"]] == [2, 3, 4] and by_name["ram"]["error"] is None
    assert by_name["peer"]["skipped"] and by_name["peer"]["error"] is None
    assert by_name["bucket"]["error"] and by_name["bucket"]["steps"] == []

    code, out, _ = main(capsys, "verify", "--policy", pol)
    assert code == 4, out
    assert out.startswith("ERROR: tier 'bucket': cannot list the tier: ")
    assert "verified 5 step copies on ram, disk" in out and "1 unreadable" in out
    code, out, _ = main(capsys, "verify", "--policy", pol, "--json")
    assert code == 4 and [(p["tier"], p["step"]) for p in json.loads(out)["problems"]] == [("bucket", None)]

    assert main(capsys, "inspect", "4", "--policy", pol)[0] == 0
    code, out, err = main(capsys, "gc", "--dry-run", "--policy", pol, "--json")
    gc = {t["name"]: t for t in json.loads(out)["tiers"]}
    assert code == 4 and gc["peer"]["skipped"] and gc["bucket"]["error"] and gc["ram"]["error"] is None
    for args in (("verify", "--tier", "peer"), ("cp", "4", "--from", "ram", "--to", "peer"), ("rm", "4", "--tier", "peer")):
        code, _, err = main(capsys, *args, "--policy", pol)
        assert code == 2 and "tier 'peer' is a peer tier" in err, (args, err)

    # A peer tier alone does not make a command fail.
    peer_only = env.tmp / "peer.toml"
    peer_only.write_text(env.policy.read_text().replace("[store]", '[[tier]]\nname = "peer"\nkind = "peer"\n\n[store]'))
    for args in (("ls",), ("verify",), ("gc", "--dry-run")):
        assert main(capsys, *args, "--policy", str(peer_only))[0] == 0, args


def test_the_version_line_is_the_one_docs_cli_shows(capsys):
    """Repro (issue 28.18): `tiercel --version` printed format 2 while docs/cli.md said 1."""
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    printed = capsys.readouterr().out.strip()
    shown = re.findall(r"tiercel \d+\.\d+\.\d+ \(format \d+\)", (Path(__file__).parent.parent / "docs" / "cli.md").read_text())
    assert shown, "docs/cli.md shows no --version line"
    want = printed.replace(tiercel.__version__, "0.1.0")
    assert set(shown) == {want}, (shown, printed)


def test_json_errors_carry_the_fields_their_message_names(env: Env, capsys):
    """Repro (issue 28.18): with --json, an error's tier/step/rank were null although its
    message named them ("step 99 is committed on no tier ...": step null)."""
    def error(*args: str) -> dict:
        code, out, _ = main(capsys, "--policy", str(env.policy), "--json", *args)
        doc = json.loads(out)
        assert doc["ok"] is False and doc["exit_code"] == code, doc
        return doc["error"]

    cases = [
        (("inspect", "99"), {"step": 99, "tier": None}),
        (("verify", "99"), {"step": 99}),
        (("cp", "99", "--from", "ram", "--to", "disk"), {"step": 99}),
        (("rm", "99", "--tier", "disk"), {"tier": "disk", "step": 99}),
        (("inspect", "4", "--tier", "nope"), {"tier": "nope"}),
        (("inspect", "4", "--rank", "7"), {"tier": "ram", "step": 4, "rank": 7}),
        # An error the CLI does not raise itself: its fields as the message names them.
        (("export", "4", str(env.tmp / "out"), "--format", "dcp"), {"step": 4}),
    ]
    for args, want in cases:
        e = error(*args)
        assert {k: e[k] for k in want} == want, (args, e)
