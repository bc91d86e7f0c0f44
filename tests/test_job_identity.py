"""One job identity (issue 14.6, issue 13.2): every commit record names the job that saved
the step (run id, world size, policy fingerprint); a restore never returns another job's
step unless asked, and another job's steps in the same tiers neither win `latest` nor fall
to this job's retention. And (issue 13.3) every rank says which newer steps it passed over."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tiercel

from conftest import assert_same, error_of, make_policy, step_dir
from test_multirank import run_ranks


def state(step: int, n: int = 1000) -> dict:
    return {"model": {"w": np.full(n, float(step), np.float32)}, "optim": {"step": step}}


def with_run(policy: dict, run: str | None, **store: object) -> dict:
    p = json.loads(json.dumps(policy))
    if run is not None:
        p["store"]["run"] = run
    p["store"].update(store)
    return p


def test_higher_steps_of_an_older_run_do_not_win(shm_root, disk_root):
    """Repro: steps 100 and 101 of an older run in the root; a new run saves 0, 1, 2: every
    handle said `committed`, retention evicted the new steps (older than 101: "uncommitted
    leftovers" or beyond keep), and restore() returned the old run's step 101. Now the old
    run's steps are ignored (never restored, never removed, not counted towards keep)."""
    base = make_policy(shm_root, disk_root, every=1, ram={"keep": 2})
    with tiercel.Store(with_run(base, "old"), rank=0, world_size=1) as old:
        for step in (100, 101):
            old.save(step, state(step)).wait(60)
    new = tiercel.Store(with_run(base, "new"), rank=0, world_size=1)
    try:
        assert new.run_id == "new"
        for step in (0, 1, 2):
            assert new.save(step, state(step)).wait(60) == {"ram": "committed", "disk": "committed"}
        assert new.latest_step() == 2
        assert new.restore()["optim"]["step"] == 2
        # keep = 2 applied to this run's steps only; the old run's are all still there.
        assert new.steps()["ram"] == [1, 2, 100, 101], new.steps()
        msg = error_of(lambda: new.restore(101), tiercel.NotFoundError)
        assert "saved by run 'old'" in msg and "job=" in msg, msg
        # Asked for by name, the old run's step is read.
        assert new.restore(101, job="old")["optim"]["step"] == 101
        assert new.restore(101, job="*")["optim"]["step"] == 101
        error_of(lambda: new.restore(job="old"), tiercel.InvalidArgumentError)
        record = json.loads((step_dir(disk_root, 2) / "COMMIT").read_text())
        assert record["job"]["run"] == "new" and record["job"]["world_size"] == 1 and record["job"]["policy"]
    finally:
        new.close()


def test_resume_from_continues_another_run(shm_root, disk_root):
    """`[restore] resume_from = "<run id>"`: a new run restores the named run's steps."""
    base = make_policy(shm_root, disk_root, every=1)
    with tiercel.Store(with_run(base, "first"), rank=0, world_size=1) as first:
        first.save(5, state(5)).wait(60)
    p = with_run(base, "second")
    p["restore"]["resume_from"] = "first"
    with tiercel.Store(p, rank=0, world_size=1) as second:
        assert second.restore()["optim"]["step"] == 5
        second.save(6, state(6)).wait(60)
        assert second.latest_step() == 6


def test_other_jobs_refuse_fails_at_open(shm_root, disk_root):
    """`[store] other_jobs = "refuse"`: opening tiers that hold another job's steps fails."""
    base = make_policy(shm_root, disk_root, every=1)
    with tiercel.Store(with_run(base, "a"), rank=0, world_size=1) as a:
        a.save(3, state(3)).wait(60)
    msg = error_of(lambda: tiercel.Store(with_run(base, "b", other_jobs="refuse"), rank=0, world_size=1), tiercel.ConfigError)
    assert "run 'a'" in msg and "other_jobs" in msg and "resume_from" in msg, msg
    # The tools see every job's steps.
    t = tiercel.Store(with_run(base, "b", other_jobs="refuse"), rank=0, world_size=1, tool=True)
    assert t.restore(3)["optim"]["step"] == 3
    t.close()


def test_run_id_comes_from_policy_then_environment(shm_root, monkeypatch):
    """Run id: `[store] run`, else $TIERCEL_RUN_ID, else $TORCHELASTIC_RUN_ID / $SLURM_JOB_ID
    (torchrun's "none" is no id), else none."""
    base = make_policy(shm_root, None)
    for var in ("TIERCEL_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)

    def run_id(policy: dict) -> str | None:
        with tiercel.Store(policy, rank=0, world_size=1) as s:
            return s.run_id

    assert run_id(base) is None
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert run_id(base) == "4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert run_id(base) == "4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert run_id(base) == "elastic-7"
    monkeypatch.setenv("TIERCEL_RUN_ID", "mine")
    assert run_id(base) == "mine"
    assert run_id(with_run(base, "policy")) == "policy"


def test_another_world_size_is_another_job_by_run_id_and_said_without(shm_root, disk_root):
    """Repro (issue 13.2): a new 2-rank job in a directory holding a committed step of an
    earlier 3-rank job restored the old job's step (100 MB states instead of 5 MB), with no
    word about world size 3 vs 2. With run ids the old job's step is refused; without, the
    two cannot be told from one job resuming resharded (DCP does), and a plain restore of
    this rank's own part refuses it with both world sizes named."""
    base = make_policy(shm_root, disk_root, every=1)
    stores = [tiercel.Store(with_run(base, "three"), rank=r, world_size=3) for r in range(3)]
    handles = [s.save(9, state(9 + r)) for r, s in enumerate(stores)]
    for h in handles:  # each waits for the others' parts of the memory commit
        h.wait(60)
    for s in stores:
        s.close()
    with tiercel.Store(with_run(base, "two"), rank=0, world_size=2) as s:
        assert s._core.restorable_steps() == []
        msg = error_of(lambda: s.restore(9), tiercel.NotFoundError)
        assert "run 'three' (world size 3)" in msg, msg
    with tiercel.Store(with_run(base, "two"), rank=0, world_size=2) as s:
        # Its own part of a step of 3 ranks is no rank's of 2: refused, both world sizes named
        # (issue 28); saved rank 0's part, asked for, is read.
        msg = error_of(lambda: s.restore(9, job="three"), tiercel.WorldSizeError)
        assert "saved by 3 rank(s) and this job has 2" in msg, msg
        assert_same(s.restore(9, job="three", rank=0), state(9))


TWO_HOSTS = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import tiercel
from test_job_identity import state

policies, out_dir = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = tiercel.Store(policies[rank])
for step in (1, 2, 3):
    store.save(step, state(step + rank)).wait(60)
dist.barrier()
if rank == 1:  # this "host" loses its memory
    import shutil
    shutil.rmtree(os.path.join(policies[1]["tier"][0]["root"], "step-000000000003"))
dist.barrier()
got = store.restore()
report = {"step": store.last_restore.step, "warnings": store.last_restore.warnings, "value": float(got["model"]["w"][0])}
store.close()
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_every_rank_says_which_newer_steps_it_passed_over(tmp_path):
    """Repro (issue 13.3): with two hosts wiped, all ranks fell back from step 5 to 4 together
    (right), but RestoreInfo.warnings was []. Two ranks on two "hosts" (own memory roots):
    host 1 loses step 3; both restore step 2 and both name step 3 and rank 1."""
    from conftest import new_shm_root
    roots = [new_shm_root(f"host{r}-") for r in range(2)]
    policies = [make_policy(root, None, ram={"keep": 3}) for root in roots]
    out = tmp_path / "reports"
    out.mkdir()
    try:
        run_ranks(TWO_HOSTS, [json.dumps(policies), str(out)], tmp_path, world=2,
                  env_of=lambda r: {"TIERCEL_HOST": f"host{r}"})
    finally:
        import shutil
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(reports):
        assert r["step"] == 2 and r["value"] == 2 + rank, r
        assert any("step 3 passed over" in w and "[1]" in w for w in r["warnings"]), r


@pytest.mark.parametrize("var", ["TIERCEL_RUN_ID"])
def test_commit_records_name_the_run(shm_root, monkeypatch, var):
    monkeypatch.setenv(var, "job-42")
    with tiercel.Store(make_policy(shm_root, None), rank=0, world_size=1) as s:
        s.save(1, state(1)).wait(60)
        assert json.loads(s._core.job)["run"] == "job-42"
    body = (step_dir(shm_root, 1) / "COMMIT").read_text()
    assert json.loads(body)["job"]["run"] == "job-42"


def test_without_run_ids_another_world_size_is_a_resharded_resume_and_said_at_open(shm_root, disk_root, capfd):
    """Without run ids a job cannot be told from the same job resuming resharded (DCP 2->1,
    an Orbax mesh change): its steps stay restorable by a resharding reader (a plain restore
    of this rank's own part says WorldSizeError, naming both world sizes), and opening the store logs once that the tiers hold steps of a job without a run
    id of another world size, naming the setting that keeps jobs apart."""
    base = make_policy(shm_root, disk_root, every=1)
    stores = [tiercel.Store(base, rank=r, world_size=3) for r in range(3)]
    for h in [s.save(4, state(4 + r)) for r, s in enumerate(stores)]:
        h.wait(60)
    for s in stores:
        s.close()
    capfd.readouterr()
    with tiercel.Store(base, rank=0, world_size=2) as s:
        err = capfd.readouterr().err
        assert "a job without a run id (world size 3" in err and "`[store] run` or $TIERCEL_RUN_ID" in err, err
        assert s._core.restorable_steps() == [4]
        # Restorable by a resharding reader, or a saved rank's part on purpose; this rank's
        # own part of a step of 3 ranks is refused, naming both world sizes (issue 28).
        assert_same(s.restore(4, rank=1), state(5))
        msg = error_of(lambda: s.restore(4), tiercel.WorldSizeError)
        assert "saved by 3 rank(s) and this job has 2" in msg, msg
    with tiercel.Store(base, rank=0, world_size=3) as s:  # the same job again: nothing to say
        assert "without a run id" not in capfd.readouterr().err


WRITER = r"""
import json, sys
import numpy as np
import tiercel
store = tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1)
store.save(1, {"w": np.full(1000, 1.0, np.float32)}).wait(60)
print("saved", flush=True)
sys.stdin.readline()  # alive until told, or killed
store.close()
"""


def start_writer(policy: dict):
    """A real second process that saves step 1 of rank 0 with `policy`, then stays alive."""
    import subprocess

    from conftest import PYTHON, TESTS_DIR, child_env

    p = subprocess.Popen([PYTHON, "-c", WRITER, json.dumps(policy)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env(), cwd=str(TESTS_DIR))
    line = p.stdout.readline()
    assert line.strip() == "saved", f"writer: {line!r} {p.stderr.read() if p.poll() is not None else ''}"
    return p


@pytest.mark.parametrize("shared", ["memory", "fs"])
def test_a_second_live_writer_of_a_rank_into_one_tier_is_refused(shared, shm_root, disk_root, tmp_path):
    """Repro (issue 28.4): two processes saving rank 0 into one root replaced each other's
    steps without a word (only checksums caught a torn read). Now the second live writer is
    refused before it writes a byte, with an error naming the tier, its location, the rank and
    the other process; once that process is gone (SIGKILL: no close), a new one saves."""
    from conftest import new_shm_root

    other_root = new_shm_root("other-")
    if shared == "memory":  # one memory root, no disk tier
        first, second = make_policy(shm_root, None), make_policy(shm_root, None)
        tier, location = "ram", str(shm_root)
    else:  # each its own memory root, one disk directory
        first, second = make_policy(other_root, disk_root, every=1), make_policy(shm_root, disk_root, every=1)
        tier, location = "disk", str(disk_root)
    p = start_writer(first)
    try:
        with tiercel.Store(second, rank=0, world_size=1) as s:
            # Reading is fine: only a save claims the rank.
            assert s.restore(1)["w"][0] == 1.0
            for step in (1, 2):
                with pytest.raises(tiercel.ConfigError) as ei:
                    s.save(step, {"w": np.full(1000, 2.0, np.float32)})
                msg, e = str(ei.value), ei.value
                assert f"tier '{tier}' ({location})" in msg and "rank 0" in msg and f"pid {p.pid}" in msg, msg
                assert "another live process" in msg and "its own tiers" in msg, msg
                assert e.tier == tier and e.rank == 0 and e.path.endswith(".writers/rank-00000"), e.fields()
            # Nothing of the second writer reached the tier: the first one's step is whole.
            assert s.restore(1)["w"][0] == 1.0
            assert 2 not in s.steps()[tier]
        p.kill()  # a crash: the kernel drops the lease
        p.wait(30)
        with tiercel.Store(second, rank=0, world_size=1) as s:
            assert s.save(2, {"w": np.full(1000, 2.0, np.float32)}).wait(60)[tier] == "committed"
            assert s.restore(2)["w"][0] == 2.0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        import shutil
        shutil.rmtree(other_root, ignore_errors=True)


def test_a_writer_that_closed_lets_the_next_one_save(shm_root):
    """A store that closed hands the rank over (a job run twice one after another), and two
    stores of one process share the rank (a reader opened beside the trainer's store)."""
    p = start_writer(make_policy(shm_root, None))
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(60) == 0, p.stderr.read()
    a = tiercel.Store(make_policy(shm_root, None), rank=0, world_size=1)
    b = tiercel.Store(make_policy(shm_root, None), rank=0, world_size=1)
    try:
        a.save(2, {"w": np.zeros(10)}).wait(60)
        b.save(3, {"w": np.ones(10)}).wait(60)
        assert b.steps()["ram"][-2:] == [2, 3] and b.restore(3)["w"][0] == 1.0
    finally:
        a.close()
        b.close()


def test_job_warnings_are_one_line_per_cause_not_one_per_rank_and_open(shm_root, disk_root, capfd):
    """Repro (issue 28.15): every rank, at every open, logged the same "holds committed steps
    of other jobs" line and the same run-id advice (a 3-rank job opened twice: 6 of each).
    Now each cause is one line per job: rank 0 says it, once per process."""
    base = make_policy(shm_root, disk_root, every=1)
    with tiercel.Store(with_run(base, "old"), rank=0, world_size=1) as s:
        s.save(1, state(1)).wait(60)
    two = [tiercel.Store(base, rank=r, world_size=2) for r in range(2)]
    for h in [s.save(5, state(5 + r)) for r, s in enumerate(two)]:
        h.wait(60)
    for s in two:
        s.close()
    capfd.readouterr()
    for _ in range(2):  # a job that opens its stores twice (an adapter's store per save)
        stores = [tiercel.Store(base, rank=r, world_size=3) for r in range(3)]
        for s in stores:
            s.close()
    err = capfd.readouterr().err
    assert err.count("holds committed steps of other jobs") == 1, err
    assert err.count("holds steps of a job without a run id") == 1, err
    assert "run 'old'" in err and "`[store] run` or $TIERCEL_RUN_ID" in err, err


def test_a_persistent_tier_without_a_writer_lease_does_not_stop_saves(shm_root, disk_root, capfd):
    """A writer lease that cannot be taken on a persistent tier (here: its place is taken by
    a file) is said once; the save into memory, and the persist, go on as before."""
    disk_root.mkdir(parents=True)
    (disk_root / ".writers").write_text("not a directory")
    with tiercel.Store(make_policy(shm_root, disk_root, every=1), rank=0, world_size=1) as s:
        assert s.save(1, state(1)).wait(60) == {"ram": "committed", "disk": "committed"}
    err = capfd.readouterr().err
    assert err.count("saves go on without this rank's writer lease there") == 1 and "tier 'disk'" in err, err
