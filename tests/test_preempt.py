"""Flush on preemption (issue 32, 1): the `[preemption]` signal handler and `Store.preempt`.

Real processes and real signals: a training process (tests/preempt_worker.py) whose fs tier
persists only every 1000th step, limited to 1 MB/s, has saved steps 1..3 (8 MiB per rank,
newest only in RAM); a SIGTERM makes it flush step 3 to the fs tier, unthrottled, and die
of the signal within the grace. A fresh process with the RAM wiped restores step 3
bit-identical. Two ranks on torch.distributed (gloo): both parts persist and commit; a rank
SIGKILLed before its flush is named in the other's report, and the step does not commit; a
rank one save ahead of the other when the notice comes flushes the step both hold, not its own
newest, so that one commits.
"""

from __future__ import annotations

import json
import re
import selectors
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import tiercel

from conftest import PYTHON, TESTS_DIR, child_env, error_of, make_policy
from preempt_worker import state

WORKER = TESTS_DIR / "preempt_worker.py"
GRACE = 20.0
#: The fs tier's limit: 8 MiB per rank would take 8 s at it; the flush lifts it.
THROTTLED = 8.0


def preempt_policy(shm_root, disk_root, **preemption) -> dict:
    policy = make_policy(shm_root, disk_root, every=1000, compression="none", chunk_size="1MiB",
                         disk_opts={"bandwidth": "1MB/s"})
    policy["preemption"] = {"grace": f"{GRACE:g}s", **preemption}
    return policy


def without_handler(policy: dict) -> dict:
    """The same tiers, no `[preemption]` (a reader that installs no handler in pytest) and no
    bandwidth limit (its restore reads would take it)."""
    tiers = [{k: v for k, v in t.items() if k != "bandwidth"} for t in policy["tier"]]
    return {**{k: v for k, v in policy.items() if k != "preemption"}, "tier": tiers}


def port_in_range(low: int = 42300) -> int:
    """A free port of a test's range (`low` and the 99 after it; 42300-42399 by default)."""
    for port in range(low, low + 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + 99}")


def start(policy: dict, world: int, tmp_path: Path, steps: list[str] | None = None, low_port: int = 42300) -> list[subprocess.Popen]:
    """`world` workers; `steps[rank]`: the steps that rank saves ("1,2,3" by default)."""
    port = port_in_range(low_port)
    procs = []
    for rank in range(world):
        env = child_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "PREEMPT_STEPS": steps[rank] if steps else "1,2,3"})
        err = open(tmp_path / f"rank-{rank}.err", "w")
        procs.append(subprocess.Popen([PYTHON, str(WORKER), json.dumps(policy)], stdout=subprocess.PIPE, stderr=err, text=True,
                                      env=env))
    return procs


def wait_ready(procs: list[subprocess.Popen], tmp_path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        assert p.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        ready = sel.select(max(0.0, deadline - time.monotonic()))
        line = p.stdout.readline() if ready else ""
        if line.strip() != "ready":
            for q in procs:
                q.kill()
            pytest.fail(f"rank {rank} never got ready ({line!r}):\n{logs(tmp_path, len(procs))}")


def logs(tmp_path: Path, world: int) -> str:
    return "\n".join(f"--- rank {r}\n{(tmp_path / f'rank-{r}.err').read_text()[-3000:]}" for r in range(world))


def report_line(tmp_path: Path, rank: int) -> str:
    text = (tmp_path / f"rank-{rank}.err").read_text()
    found = re.findall(r"rank \d+: preemption flush of step .*", text)
    assert found, text[-3000:]
    return found[-1]


def flush_seconds(line: str) -> float:
    m = re.search(r"in ([0-9.]+) s", line)
    assert m, line
    return float(m.group(1))


def terminate(procs: list[subprocess.Popen], tmp_path: Path, sig: int = signal.SIGTERM) -> list[float]:
    """Sends `sig` to every process still running; returns each one's seconds to exit."""
    sent = time.monotonic()
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    took = []
    for p in procs:
        try:
            p.wait(GRACE + 30)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"a process outlived the grace period:\n{logs(tmp_path, len(procs))}")
        took.append(time.monotonic() - sent)
    return took


def test_sigterm_flushes_the_newest_step_in_ram_and_exits_as_the_signal_would(shm_root, disk_root, tmp_path):
    policy = preempt_policy(shm_root, disk_root)
    [p] = start(policy, 1, tmp_path)
    wait_ready([p], tmp_path)
    assert sorted(Path(disk_root).glob("step-*")) == []  # every 1000th step: nothing durable yet
    [took] = terminate([p], tmp_path)
    assert p.returncode == -signal.SIGTERM, logs(tmp_path, 1)
    assert took < GRACE, took
    line = report_line(tmp_path, 0)
    assert line.endswith("tier 'disk': holds step 3"), line
    # The 1 MB/s limit was lifted: 8 MiB went in far less than the 8 s it allows.
    assert flush_seconds(line) < THROTTLED / 2, line
    print(f"signal to exit {took:.2f} s, flush {flush_seconds(line):.2f} s")

    # A new host: its RAM is empty; step 3 comes from the fs tier, bit for bit.
    shutil.rmtree(shm_root)
    with tiercel.Store(without_handler(policy), rank=0, world_size=1) as fresh:
        assert fresh.latest_step() == 3
        got = fresh.restore(3)
        assert fresh.last_restore is not None and fresh.last_restore.tiers == {"disk": 1}
    want = state(3, 0)["model"]["w"]
    assert got["model"]["w"].dtype == want.dtype and np.array_equal(got["model"]["w"], want)


def each_rank_restores_from_disk_alone(policy: dict, shm_root, step: int) -> None:
    """RAM wiped (a new host): each of the 2 ranks restores `step` bit-identical from the fs tier."""
    shutil.rmtree(shm_root)
    for rank in (0, 1):
        with tiercel.Store(without_handler(policy), rank=rank, world_size=2) as fresh:
            assert fresh.steps()["disk"] == [step]
            got = fresh.restore(step)
            assert fresh.last_restore is not None and fresh.last_restore.tiers == {"disk": 1}
        want = state(step, rank)["model"]["w"]
        assert got["model"]["w"].dtype == want.dtype and np.array_equal(got["model"]["w"], want)


def test_two_ranks_both_persist_and_commit(shm_root, disk_root, tmp_path):
    policy = preempt_policy(shm_root, disk_root)
    procs = start(policy, 2, tmp_path)
    wait_ready(procs, tmp_path)
    took = terminate(procs, tmp_path)
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2, logs(tmp_path, 2)
    assert max(took) < GRACE, took
    for rank in (0, 1):
        assert report_line(tmp_path, rank).endswith("tier 'disk': holds step 3"), logs(tmp_path, 2)
    print(f"signal to exit {max(took):.2f} s, flush {[flush_seconds(report_line(tmp_path, r)) for r in (0, 1)]} s")
    each_rank_restores_from_disk_alone(policy, shm_root, 3)


def test_a_rank_killed_before_its_flush_is_named_and_the_step_does_not_commit(shm_root, disk_root, tmp_path):
    # A short grace: rank 0 waits for rank 1's part until then.
    policy = preempt_policy(shm_root, disk_root, grace="3s")
    procs = start(policy, 2, tmp_path)
    wait_ready(procs, tmp_path)
    procs[1].kill()
    procs[1].wait(30)
    [took] = terminate(procs[:1], tmp_path)
    assert procs[0].returncode == -signal.SIGTERM, logs(tmp_path, 2)
    assert took < 3 + 2, took
    line = report_line(tmp_path, 0)
    assert line.endswith("tier 'disk': not committed: ranks [1] had not written their part by the deadline"), line
    # The agreement on the step waited min(2 s, grace / 4) for rank 1, then took rank 0's newest.
    assert "this rank's newest: 1 of 2 ranks came within 0.75 s to agree on the step" in line, line
    print(f"signal to exit {took:.2f} s (grace 3 s)")
    with tiercel.Store(without_handler(policy), rank=0, world_size=2, tool=True) as look:
        assert look.steps()["disk"] == []
        # Rank 0's part is there, uncommitted: no reader sees it.
        assert look._core.step_ranks("disk", 3) == [0]


def test_ranks_at_different_steps_flush_the_newest_step_every_rank_holds(shm_root, disk_root, tmp_path):
    """The notice comes mid-iteration: rank 0 has saved step 4, rank 1 only step 3. Each
    flushing its own newest (4 and 3) would commit neither on the fs tier, which held no step
    before; the ranks agree on step 3, the newest both hold in RAM, and it commits."""
    policy = preempt_policy(shm_root, disk_root)
    procs = start(policy, 2, tmp_path, steps=["1,2,3,4", "1,2,3"], low_port=41700)
    wait_ready(procs, tmp_path)
    took = terminate(procs, tmp_path)
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2, logs(tmp_path, 2)
    with tiercel.Store(without_handler(policy), rank=0, world_size=2, tool=True) as look:
        assert look.steps()["disk"] == [3], logs(tmp_path, 2)
    for rank in (0, 1):
        line = report_line(tmp_path, rank)
        assert line.startswith(f"rank {rank}: preemption flush of step 3 in "), line
        assert "the newest step all 2 ranks hold" in line and line.endswith("tier 'disk': holds step 3"), line
    assert "this rank's newest: 4" in report_line(tmp_path, 0)
    assert max(took) < GRACE / 2, took  # no rank waited for a part that never came
    print(f"signal to exit {max(took):.2f} s, flush {[flush_seconds(report_line(tmp_path, r)) for r in (0, 1)]} s")
    each_rank_restores_from_disk_alone(policy, shm_root, 3)


RETURNS = textwrap.dedent("""
    import json, logging, os, signal, sys, threading
    import numpy as np
    import tiercel
    logging.basicConfig(level=logging.WARNING)
    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))  # the framework's own handler
    policy = json.loads(sys.argv[1])
    store = tiercel.Store(policy, rank=0, world_size=1)
    for step in (1, 2, 3):
        store.save(step, {"w": np.full(1 << 18, step, np.float32)}).wait(60)
    os.kill(os.getpid(), signal.SIGUSR1)  # the notice; the handler runs before the next line
    out = {"chained": seen, "disk": store.steps()["disk"]}
    # Training goes on: a later save is not held back by the flush.
    h = store.save(4, {"w": np.full(1 << 18, 4, np.float32)})
    out["after"] = h.wait(60)
    # A Store opened off the main thread installs nothing, and says so once.
    t = threading.Thread(target=lambda: tiercel.Store(policy, rank=0, world_size=1).close())
    t.start(); t.join()
    store.close()
    print(json.dumps(out))
""")


def test_exit_false_returns_control_after_chaining_the_previous_handler(shm_root, disk_root, tmp_path):
    policy = preempt_policy(shm_root, disk_root, signals=["USR1"], exit=False)
    r = subprocess.run([PYTHON, "-c", RETURNS, json.dumps(policy)], capture_output=True, text=True, env=child_env(), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["chained"] == [signal.SIGUSR1]
    assert out["disk"] == [3]
    assert out["after"] == {"ram": "committed", "disk": "not scheduled"}
    assert "rank 0: preemption flush of step 3" in r.stderr
    assert r.stderr.count("only the main thread may handle signals") == 1, r.stderr[-3000:]


def test_no_section_no_handler(shm_root, disk_root):
    before = signal.getsignal(signal.SIGTERM)
    with tiercel.Store(make_policy(shm_root, disk_root), rank=0, world_size=1) as store:
        assert store._core.preemption is None
        assert signal.getsignal(signal.SIGTERM) is before
        # Store.preempt works without the section (grace 30 s by default).
        store.save(1, {"w": np.arange(1000, dtype=np.float32)}).wait(30)
        report = store.preempt()
        assert report.ok and report.step == 1 and report.grace == 30.0
        assert {t: r.step for t, r in report.tiers.items()} == {"disk": 1}


@pytest.mark.parametrize("body, line, words", [
    ('grace = "30 parsecs"\n', 13, ["preemption.grace", "is not a duration"]),
    ('signals = ["SIGTERM", "SIGBOGUS"]\n', 13, ["preemption.signals[1]", "SIGBOGUS", "SIGUSR1"]),
    ('exit = true\nsignals = ["KILL"]\n', 14, ["preemption.signals[0]", "cannot be caught"]),
])
def test_policy_errors_name_file_and_line(tmp_path, shm_root, body, line, words):
    path = tmp_path / "tiercel.toml"
    path.write_text(textwrap.dedent(f"""\
        [[tier]]
        name = "ram"
        kind = "memory"
        root = "{shm_root}"

        [[tier]]
        name = "disk"
        kind = "fs"
        url = "{tmp_path / 'disk'}"
        every = 1000

        [preemption]
        """) + body)
    msg = error_of(lambda: tiercel.Store(str(path), rank=0, world_size=1), tiercel.ConfigError)
    assert msg.startswith(f"{path}:{line}: "), msg
    for w in words:
        assert w in msg, msg


def test_a_running_persist_finishes_unthrottled_and_queued_ones_give_way(shm_root, disk_root):
    """Persists that fell behind (every step, 1 MB/s): step 1's runs, steps 2 and 3 wait. The
    flush lifts the limit (step 1 finishes at once), replaces the queued persists with its own
    job for step 3 and commits it; then the limit is back for the saves after it."""
    policy = without_handler(preempt_policy(shm_root, disk_root))
    policy["tier"][1].update(every=1, bandwidth="1MB/s")
    mib2 = 1 << 19  # float32s: 2 MiB, 2 s at 1 MB/s
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        # Step 1's persist must be running before steps 2 and 3 arrive: saved together, step 2
        # may replace step 1 while it still waits in the queue (a loaded machine showed it).
        handles = [store.save(1, {"w": np.full(mib2, 1, np.float32)})]
        deadline = time.monotonic() + 30
        while handles[0].states()["disk"] != "running":
            assert time.monotonic() < deadline, handles[0].states()
            time.sleep(0.01)
        handles += [store.save(s, {"w": np.full(mib2, s, np.float32)}) for s in (2, 3)]
        report = store.preempt(grace=10)
        assert report.ok and report.step == 3, report
        assert report.seconds < 1.5, report  # throttled, steps 1 and 3 alone would take 4 s
        assert handles[0].wait(10)["disk"] == "committed"
        assert handles[1].wait(10)["disk"].startswith("skipped: a newer save")
        assert store.steps()["disk"] == [1, 3]
        # Training goes on: the limit applies again to the next save's persist.
        t0 = time.monotonic()
        assert store.save(4, {"w": np.full(mib2, 4, np.float32)}).wait(30)["disk"] == "committed"
        assert time.monotonic() - t0 > 1.0


EXITS = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import tiercel
    def previous(signum, frame):
        print("previous handler ran", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, previous)
    store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
    store.save(1, {"w": np.arange(1000, dtype=np.float32)}).wait(60)
    os.kill(os.getpid(), signal.SIGTERM)
    print("not reached", flush=True)
""")


def test_exit_true_lets_the_handler_installed_before_decide_how_the_process_ends(shm_root, disk_root):
    policy = preempt_policy(shm_root, disk_root)
    r = subprocess.run([PYTHON, "-c", EXITS, json.dumps(policy)], capture_output=True, text=True, env=child_env(), timeout=240)
    assert r.returncode == 7, r.stderr[-3000:]
    assert r.stdout == "previous handler ran\n"
    assert "tier 'disk': holds step 1" in r.stderr
