"""Chaos over a dedup tier (format version 3: rank areas, chunks shared between steps): the
saver killed at random and at every failpoint (the rank's sweep of its area among them), and
`tiercel gc` killed at random moments and at its own failpoint. After every kill each
committed step restores bit-identical from each tier alone (`Chaos.check`); after every gc
that ran to its end no data object is left that no manifest refers to, but those of a save
in flight.

`make test` runs a short campaign (TIERCEL_CHAOS_KILLS // 6 kills); `make chaos` the long one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from pathlib import Path

from chaos import FAILPOINTS, Chaos
from conftest import PYTHON, child_env, make_policy

KILLS = int(os.environ.get("TIERCEL_CHAOS_KILLS", "60"))
SEED = int(os.environ.get("TIERCEL_CHAOS_SEED", "14"))


def toml(policy: dict) -> str:
    """`policy` (tables of scalars and lists, `[[tier]]`s) as TOML, for the command line."""
    lines = []
    for t in policy["tier"]:
        lines += ["[[tier]]"] + [f"{k} = {json.dumps(v)}" for k, v in t.items()]
    for section in ("restore", "store"):
        lines += [f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in policy.get(section, {}).items()]
    return "\n".join(lines) + "\n"


def gc(policy_path: Path, kill_after: float | None, failpoint: str | None = None) -> int:
    """`tiercel gc --tmp-age 0`, killed after `kill_after` seconds (None: to its end)."""
    extra = {"TIERCEL_FAILPOINT": failpoint} if failpoint else {}
    p = subprocess.Popen([PYTHON, "-m", "tiercel", "--policy", str(policy_path), "gc", "--tmp-age", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(extra))
    try:
        p.communicate(timeout=kill_after if kill_after is not None else 120)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
    return p.returncode


def unreferenced(disk: Path) -> list[str]:
    """Data objects of the rank areas that no manifest there refers to, except those of steps
    newer than the newest committed one (a save in flight writes its data before its manifest)."""
    committed = [int(d.name[5:]) for d in disk.glob("step-*") if (d / "COMMIT").exists()]
    newest = max(committed, default=-1)
    referenced = set()
    for m in disk.glob("ranks/*/rank-*/step-*.manifest.json"):
        referenced.update(o["key"] for o in json.loads(m.read_text())["objects"])
    return [str(p.relative_to(disk)) for p in disk.glob("ranks/*/rank-*/step-*.data")
            if str(p.relative_to(disk)) not in referenced and int(p.name[5:17]) <= newest]


def test_chaos_dedup_saves_sweeps_and_gc(tmp_path, shm_root, disk_root):
    policy = make_policy(shm_root, disk_root, every=1, chunk_size="64KiB", disk_opts={"keep": 2})
    policy_path = tmp_path / "tiercel.toml"
    policy_path.write_text(toml(policy))
    rnd = random.Random(SEED + 7)
    chaos = Chaos(policy, 1 << 20, tmp_path, rnd, state="lora", failpoints=(*FAILPOINTS, "sweep"))
    kills = max(KILLS // 6, len(chaos.failpoints))
    figures = chaos.campaign(kills)
    # gc: killed at random moments, at its failpoint, and run to its end.
    gc_kills = 0
    for i in range(max(kills // 2, 3)):
        how = ("gc:1", None) if i == 0 else (None, rnd.uniform(0.05, 1.5))
        if gc(policy_path, how[1], how[0]) != 0:
            gc_kills += 1
        chaos.check()
        assert gc(policy_path, None) == 0
        chaos.check()
        assert unreferenced(disk_root) == [], "a gc left data objects nothing refers to"
        chaos.kill_cycle()  # and the saver goes on over what the gc left
    held = sum(p.stat().st_size for p in disk_root.rglob("*") if p.is_file())
    print("\nCHAOS dedup " + json.dumps(figures | {"gc_runs_killed": gc_kills, "bytes_held": held}))
    assert "sweep" in chaos.kills, f"the sweep's failpoint never fired: {chaos.kills}"
    assert chaos.steps_verified > 0
    # keep = 2 over a frozen base of 1 MiB: the tier holds about one step, not one per step.
    assert held < 3 << 20, held
