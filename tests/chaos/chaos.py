"""The chaos harness: a saver process killed over and over (kill -9 at a random moment, or
abort at a deterministic failpoint), and after every kill a check that each committed step
restores bit-identical from each tier alone and nothing uncommitted is visible.

`Chaos.kill_cycle` is one cycle; tests/chaos/test_chaos.py runs a short campaign in
`make test` and `make chaos` a long one (TIERCEL_CHAOS_KILLS sets the count)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiercel

import chaos_state
from conftest import PYTHON, assert_same, child_env

# The points the core can abort at (rust/tiercel-core/src/failpoint.rs).
FAILPOINTS = ("commit", "commit_counted", "evict", "persist")

# The trainer loop the campaign kills (shared with tests/test_kill.py).
SAVER = Path(__file__).resolve().parent.parent / "saver.py"


@dataclass
class Chaos:
    policy: dict[str, Any]
    nbytes: int
    log_dir: Path
    rnd: random.Random
    kills: Counter = field(default_factory=Counter)
    checks: int = 0
    steps_verified: int = 0
    # The saver's state: a function of chaos_state, (step, nbytes) -> state.
    state: str = "state"
    # Failpoints of the campaign (`campaign`'s planned cycles).
    failpoints: tuple[str, ...] = FAILPOINTS

    def kill_cycle(self, failpoint: str | None = None, count: int = 1, max_delay: float = 0.6) -> str:
        """Runs the saver until it is killed: at `failpoint`'s `count`-th hit when given (it
        aborts itself; if that point is not reached within 30 s it is killed at random and
        the cycle counts as random), else by SIGKILL at a random moment after it is ready.
        Returns how it died ("random", or the failpoint's name)."""
        extra = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), child_env()["PYTHONPATH"]])}
        if failpoint:
            extra["TIERCEL_FAILPOINT"] = f"{failpoint}:{count}"
        err_path = self.log_dir / f"saver-{time.monotonic_ns()}.stderr"
        lines: list[str] = []
        with open(err_path, "w") as err:
            p = subprocess.Popen([PYTHON, str(SAVER), json.dumps(self.policy), f"chaos_state:{self.state}", "--nbytes", str(self.nbytes),
                                  "--flush-every", "5"], stdout=subprocess.PIPE,
                                 stderr=err, text=True, env=child_env(extra))
        assert p.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
        reader.start()
        how = "random"
        try:
            if failpoint:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    pass
                if p.returncode == -signal.SIGABRT and "failpoint" in err_path.read_text():
                    how = failpoint
            if p.poll() is None:
                deadline = time.monotonic() + 120
                while not any(line.startswith("ready") for line in lines):
                    assert p.poll() is None, f"saver exited early ({p.returncode}): {err_path.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, "saver never became ready"
                    time.sleep(0.005)
                time.sleep(self.rnd.uniform(0.0, max_delay))
                p.kill()
            p.wait(30)
            assert p.returncode in (-signal.SIGKILL, -signal.SIGABRT), (p.returncode, err_path.read_text()[-3000:])
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(30)
            reader.join(10)
            p.stdout.close()
        err_path.unlink()
        self.kills[how] += 1
        self.check()
        return how

    def check(self) -> None:
        """Every committed step restores bit-identical from each tier alone; steps on a tier
        without a commit record are never returned."""
        store = tiercel.Store(self.policy, rank=0, world_size=1)
        try:
            committed = store.steps()
            for tier, steps in committed.items():
                for step in steps:
                    r = store.reader(step, tiers=[tier])
                    assert_same(r.get_all(), getattr(chaos_state, self.state)(step, self.nbytes), f"{tier} step {step}")
                    self.steps_verified += 1
                for step in set(store._core.all_steps(tier)) - set(steps):
                    try:
                        store.reader(step, tiers=[tier])
                    except tiercel.NotFoundError:
                        continue
                    raise AssertionError(f"uncommitted step {step} of tier {tier} is readable")
        finally:
            store.close()
        self.checks += 1

    def campaign(self, kills: int) -> dict[str, Any]:
        """`kills` cycles: first each failpoint at hits 1-3, then random kills."""
        planned = [(fp, c) for c in (1, 2, 3) for fp in self.failpoints][:kills]
        t0 = time.monotonic()
        for fp, c in planned:
            self.kill_cycle(fp, c)
        for _ in range(kills - len(planned)):
            self.kill_cycle()
        return {"kills": sum(self.kills.values()), "by": dict(self.kills), "checks": self.checks,
                "steps_verified": self.steps_verified, "seconds": round(time.monotonic() - t0, 1)}
