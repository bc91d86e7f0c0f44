"""kill -9 of a saving process at random moments: what is committed is whole, and nothing
uncommitted is ever returned."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tiercel

from conftest import PYTHON, assert_same, child_env, make_policy

SEED = 20240601
RUNS = 6


def step_state(step: int) -> dict:
    """~2.5 MB, a function of the step number only."""
    rng = np.random.default_rng(step)
    return {
        "model": {
            "w": rng.standard_normal(300_000).astype(np.float32),
            "emb": torch.from_numpy(rng.integers(0, 2**15, (500, 300), dtype=np.int16)),
            "b": torch.full((1000,), float(step), dtype=torch.bfloat16),
        },
        "optim": {"m": rng.standard_normal(100_000), "step": step},
        "rng": rng.bytes(1000),
    }


# The trainer loop this test kills (shared with the chaos campaign).
SAVER = Path(__file__).resolve().parent / "saver.py"


def policy_for(shm_root, disk_root) -> dict:
    # 1 MiB chunks: a step is a few chunks per item, not hundreds.
    return make_policy(shm_root, disk_root, chunk_size="1MiB", disk_opts={"keep": 3})


def run_and_kill(policy: dict, delay: float, log_dir: Path) -> list[int]:
    """Starts a saver, lets it save for `delay` seconds once it is ready, then kills it with
    SIGKILL. Returns the steps whose save() call had returned."""
    lines: list[str] = []
    err_path = log_dir / f"saver-{time.monotonic_ns()}.stderr"
    with open(err_path, "w") as err:
        p = subprocess.Popen([PYTHON, str(SAVER), json.dumps(policy), "test_kill:step_state", "--wait", "60"],
                             stdout=subprocess.PIPE, stderr=err, text=True, env=child_env())
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(l.startswith("ready") for l in lines):
            assert p.poll() is None, f"saver exited early ({p.returncode}): {err_path.read_text()}"
            assert time.monotonic() < deadline, "saver never became ready"
            time.sleep(0.01)
        time.sleep(delay)
        assert p.poll() is None, f"saver died by itself ({p.returncode}): {err_path.read_text()}"
        p.kill()  # SIGKILL, at whatever the saver was doing
        p.wait(30)
        assert p.returncode == -9, p.returncode
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        reader.join(10)
        p.stdout.close()
    return [int(l.split()[1]) for l in lines if l.startswith("saved")]


def test_kill_during_saves(shm_root, disk_root, make_store):
    policy = policy_for(shm_root, disk_root)
    rnd = random.Random(SEED)
    delays = [rnd.uniform(0.05, 1.5) for _ in range(RUNS)]
    returned: list[int] = []
    for delay in delays:
        returned += run_and_kill(policy, delay, disk_root.parent)
    assert returned, f"no save returned in {RUNS} runs (delays {delays})"
    print(f"delays {[round(d, 2) for d in delays]}: saves returned {returned}")

    store = make_store(policy)
    committed = store.steps()
    newest = max(s for steps in committed.values() for s in steps)
    # The saver waits for save N-1 to be final before it starts save N+1: of the saves that
    # returned, all but the last two were surely committed.
    assert newest >= max(returned) - 2, (newest, returned, committed)

    # 1. restore() gives the newest committed step, bit for bit.
    got = store.restore()
    assert store.last_restore.step == newest
    assert_same(got, step_state(newest))

    # 2. Every committed step on every tier verifies, read from that tier alone.
    for tier, steps in committed.items():
        assert steps, f"nothing committed on {tier}: {committed}"
        for step in steps:
            r = store.reader(step, tiers=[tier])
            assert_same(r.get_all(), step_state(step), f"{tier} step {step}")
            assert set(r.info.tiers) == {tier}

    # 3. Leftovers of killed saves are never returned.
    for tier in committed:
        for step in set(store._core.all_steps(tier)) - set(committed[tier]):
            with pytest.raises(tiercel.NotFoundError):
                store.reader(step, tiers=[tier])
    for step in range(newest + 1, newest + 3):
        with pytest.raises(tiercel.NotFoundError):
            store.restore(step)

    # 4. Spare segments of the dead savers were reclaimed when this store opened.
    pool = Path(shm_root) / ".pool"
    owners = {name.split("-")[0] for name in os.listdir(pool)}
    assert owners <= {str(os.getpid())}, owners

    # 5. One more restart goes on from there, and memory retention (keep = 2) held.
    more = run_and_kill(policy, 1.5, disk_root.parent)
    assert more and more[0] == newest + 1, (newest, more)
    last = store.latest_step()
    assert last is not None and last > newest, (newest, last)
    assert_same(store.restore(), step_state(last))
    assert len(store.steps()["ram"]) <= 2, store.steps()
    stale = [s for s in store._core.all_steps("ram") if s < last - 2]
    assert stale == [], f"old steps left in ram: {stale}"


MID_SAVE = r"""
import json, sys
import numpy as np
import tiercel
store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
for step in (1, 2):
    store.save(step, {"w": np.full(1000, float(step))}).wait(60)
w = store.writer(3)  # mid-save of step 3: a put copied into memory, no commit
w.__enter__()
w.put("model", {"w": np.full(200_000, 3.0)})
print("mid-save", flush=True)
sys.stdin.readline()  # alive until killed
"""


def start_mid_save(policy: dict) -> subprocess.Popen:
    p = subprocess.Popen([PYTHON, "-c", MID_SAVE, json.dumps(policy)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env())
    line = p.stdout.readline()
    assert line.strip() == "mid-save", f"{line!r} {p.stderr.read() if p.poll() is not None else ''}"
    return p


def gc_json(policy_file: Path, *args: str) -> dict:
    r = subprocess.run([PYTHON, "-m", "tiercel", "gc", "--json", "--policy", str(policy_file), *args],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def test_gc_removes_a_killed_writers_uncommitted_step_from_memory(tmp_path):
    """Repro (issue 28.16): a writer killed with SIGKILL mid-save left its uncommitted step in
    /dev/shm, and `tiercel gc` kept it although nothing held the writer's leases. Now gc
    removes it (and never a committed step), while a live writer's uncommitted step, in
    another root, stays."""
    from conftest import new_shm_root

    roots = {"killed": new_shm_root("killed-"), "live": new_shm_root("live-")}
    files = {}
    for name, root in roots.items():
        files[name] = tmp_path / f"{name}.toml"
        files[name].write_text(f'[[tier]]\nname = "ram"\nkind = "memory"\nroot = "{root}"\nkeep = 3\n')
    procs = {name: start_mid_save(make_policy(root, None, ram={"keep": 3})) for name, root in roots.items()}
    try:
        procs["killed"].kill()
        procs["killed"].wait(30)
        for name, root in roots.items():
            assert (Path(root) / "step-000000000003").is_dir(), name
        dry = gc_json(files["killed"], "--dry-run")
        assert [(r["step"], r["reason"]) for r in dry["tiers"][0]["removals"]] == [
            (3, "uncommitted; no process writes to this tier: its writer is gone")], dry
        done = gc_json(files["killed"])
        assert [r["step"] for r in done["tiers"][0]["removals"]] == [3], done
        assert not (Path(roots["killed"]) / "step-000000000003").exists()
        with tiercel.Store(files["killed"], rank=0, world_size=1) as s:
            assert s.steps()["ram"] == [1, 2]
            assert s.restore()["w"][0] == 2.0
        # The live writer's step stays: it may still commit.
        assert gc_json(files["live"])["tiers"][0]["removals"] == []
        assert (Path(roots["live"]) / "step-000000000003").is_dir()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


# -- the counted commit of several ranks (docs/scale.md, "Commit") -----------------------------

COMMIT_RANKS = 3

COMMIT_WORKER = r"""
import json, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

policy, step = json.loads(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policy)
assert store._core.has_counter(), "the job's coordinator gave no counter: the commit would list"
state = lambda s: {"w": np.full(5000, s * 10 + rank, dtype=np.float32)}
if step:
    h = store.save(step, state(step))
    store.flush()  # no collective after the save: a rank may abort in its persist
    print(json.dumps(h.wait(60)), flush=True)
else:
    got = store.restore()
    print(json.dumps({"step": store.last_restore.step, "ok": bool((got["w"] == state(store.last_restore.step)["w"]).all())}), flush=True)
store.close()
"""


def launch(policy: dict, step: int, tmp_path: Path, failpoint_of) -> list[tuple[int, str]]:
    """Runs COMMIT_RANKS ranks (gloo on loopback) that save `step` (0: restore the newest);
    `failpoint_of(rank)` arms a failpoint in that rank. Each rank's (exit code, output)."""
    from test_multirank import free_port

    port = free_port()
    procs = []
    for rank in range(COMMIT_RANKS):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(COMMIT_RANKS)}
        if failpoint_of(rank):
            env["TIERCEL_FAILPOINT"] = failpoint_of(rank)
        out = open(tmp_path / f"step{step}-rank{rank}.out", "w+")
        procs.append((subprocess.Popen([PYTHON, "-c", COMMIT_WORKER, json.dumps(policy), str(step)], stdout=out,
                                       stderr=subprocess.STDOUT, env=child_env(env)), out))
    results = []
    for p, out in procs:
        p.wait(180)
        out.seek(0)
        results.append((p.returncode, out.read()))
        out.close()
    return results


def test_a_counted_commit_survives_the_death_of_its_committer_or_of_a_rank_before_its_manifest(tmp_path, shm_root, disk_root):
    """Three ranks (torch.distributed gloo: the c10d store counts them in) save step 1, then
    step 2 with the rank whose add completes the count aborted between the count and the
    commit record (failpoint `commit_counted`, armed in every rank: only that one reaches it),
    then step 3 with rank 1 aborted before its manifest (failpoint `persist`). Neither step
    commits on the fs tier: step 2 has every manifest and no record, step 3 lacks rank 1's;
    a relaunch on a host whose memory tier is gone restores step 1 on every rank."""
    policy = make_policy(shm_root, disk_root, every=1, compression="none", disk_opts={"keep": 5})
    every_rank_ok = launch(policy, 1, tmp_path, lambda r: None)
    assert all(code == 0 for code, _ in every_rank_ok), every_rank_ok
    assert (disk_root / "step-000000000001" / "COMMIT").exists()

    step2 = launch(policy, 2, tmp_path, lambda r: "commit_counted")
    died = [r for r, (code, out) in enumerate(step2) if code != 0]
    assert len(died) == 1 and step2[died[0]][0] == -signal.SIGABRT and "failpoint 'commit_counted'" in step2[died[0]][1], step2
    assert all(code == 0 and '"written"' in out for code, out in step2 if code == 0), step2
    dir2 = disk_root / "step-000000000002"
    # Every rank's manifest of step 2, each in its rank's area (format version 3).
    written = sorted(p.parent.name for p in disk_root.glob("ranks/*/rank-*/step-000000000002.manifest.json"))
    assert written == [f"rank-{r:05d}" for r in range(COMMIT_RANKS)]
    assert not (dir2 / "COMMIT").exists(), "committed although its committer died before the record"

    step3 = launch(policy, 3, tmp_path, lambda r: "persist" if r == 1 else None)
    assert step3[1][0] == -signal.SIGABRT and "failpoint 'persist'" in step3[1][1], step3
    assert step3[0][0] == 0 and step3[2][0] == 0, step3
    dir3 = disk_root / "step-000000000003"
    assert not list(disk_root.glob("ranks/*/rank-00001/step-000000000003.manifest.json")) and not (dir3 / "COMMIT").exists()

    shutil.rmtree(shm_root)  # the host is gone: only the fs tier is left
    restored = [json.loads(out.strip().splitlines()[-1]) for code, out in launch(policy, 0, tmp_path, lambda r: None) if code == 0]
    assert restored == [{"step": 1, "ok": True}] * COMMIT_RANKS, restored
