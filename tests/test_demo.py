"""`make demo` in the suite, shortened: a multi-rank torch.distributed (gloo) DDP job saves
every step, one rank dies of SIGKILL right after a save, the launcher restarts every rank,
they agree on the newest step all can restore, and the resumed run's loss of every step
equals the uninterrupted reference's (examples/torch_demo.py exits 0 only then)."""

from __future__ import annotations

import subprocess

from conftest import PYTHON, TESTS_DIR, child_env

DEMO = TESTS_DIR.parent / "examples" / "torch_demo.py"


def test_short_multi_rank_kill_and_resume_demo():
    args = ["--world", "2", "--steps", "8", "--kill-step", "5", "--kill-rank", "1", "--timeout", "400"]
    r = subprocess.run([PYTHON, str(DEMO), *args], capture_output=True, text=True, timeout=450,
                       env=child_env({"OMP_NUM_THREADS": "1"}))
    assert r.returncode == 0, f"demo exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "SIGKILL" in r.stdout, r.stdout[-2000:]


def test_demo_that_runs_out_of_time_says_it_is_alive_and_how_to_give_it_more():
    """A slow start (ranks importing torch on a busy machine) prints a line every
    --progress-every s; running out of --timeout says how to raise it through `make demo`."""
    args = ["--world", "2", "--kill-rank", "1", "--steps", "30", "--timeout", "6", "--progress-every", "1"]
    r = subprocess.run([PYTHON, str(DEMO), *args], capture_output=True, text=True, timeout=120,
                       env=child_env({"OMP_NUM_THREADS": "1"}))
    assert r.returncode == 2, f"demo exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "time limit: 6 s" in r.stdout, r.stdout
    assert "still running" in r.stdout and "left of the time limit (--timeout)" in r.stdout, r.stdout
    assert 'make demo DEMO_ARGS="--timeout 12"' in r.stderr, r.stderr
