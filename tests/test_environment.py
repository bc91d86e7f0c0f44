"""What tiercel reads from Slurm, torchrun (torchelastic) and Kubernetes (issue 32, item 5):
every variable is set in a fresh process, as the launcher would, and its effect is checked on a
real Store: the rank and world size it opens with, the run id and launch in the commit record
it writes, the host it names and the ranks it takes to share that host's memory tier. The
rules are in python/tiercel/environment.py and docs/deploy.md."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PYTHON, child_env, make_policy, step_dir

#: One process of a job: opens a Store from the policy in argv[1] with the environment it was
#: given, saves step argv[3] (unless -1) and waits until every tier committed it, then writes
#: what the Store saw to argv[2]. A tiercel error is written there too, not raised.
WORKER = r"""
import json, os, sys
import numpy as np
import tiercel

policy, out, step = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if os.environ.get("INIT_TORCH"):
    import torch.distributed as dist
    # What a training script under srun does without torchrun: its rank from Slurm's.
    dist.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]),
                            world_size=int(os.environ["SLURM_STEP_NUM_TASKS"]))
try:
    store = tiercel.Store(policy)
except tiercel.TiercelError as e:
    json.dump({"error": type(e).__name__, "message": str(e)}, open(out, "w"))
    sys.exit(0)
seen = {"rank": store.rank, "world_size": store.world_size, "host": store.host, "hosts": store.hosts,
        "run_id": store.run_id}
if step >= 0:
    handle = store.save(step, {"w": np.full(1000, float(store.rank), np.float32)})
    try:
        seen["states"] = handle.wait(float(os.environ.get("WAIT", "60")), commit=True)
    except TimeoutError as e:
        seen["states"] = str(e)
json.dump(seen, open(out, "w"))
store.close()
"""


def launch(tmp_path: Path, policy: dict, envs: list[dict[str, str]], step: int = -1, timeout: float = 120) -> list[dict]:
    """Starts one process per entry of `envs` (its launcher's variables), all at once, as a
    launcher starts a job's tasks; returns what each one's Store saw."""
    procs = []
    for i, env in enumerate(envs):
        out = tmp_path / f"proc-{i}.json"
        log = open(tmp_path / f"proc-{i}.log", "w")
        cmd = [PYTHON, "-c", WORKER, json.dumps(policy), str(out), str(step)]
        procs.append((subprocess.Popen(cmd, env=child_env(env), stdout=log, stderr=subprocess.STDOUT), log, out))
    deadline = time.monotonic() + timeout
    seen = []
    try:
        for i, (p, log, out) in enumerate(procs):
            code = p.wait(max(1.0, deadline - time.monotonic()))
            log.close()
            text = (tmp_path / f"proc-{i}.log").read_text()
            assert code == 0, f"process {i} exited with {code}:\n{text[-4000:]}"
            seen.append(json.loads(out.read_text()))
    finally:
        for p, log, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
            log.close()
    return seen


def one(tmp_path: Path, policy: dict, env: dict[str, str], step: int = -1) -> dict:
    return launch(tmp_path, policy, [env], step)[0]


def commit_record(disk: Path, step: int) -> dict:
    return json.loads((step_dir(disk, step) / "COMMIT").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Slurm -----------------------------------------------------------------------------------


def srun_task(procid: int, ntasks: int, node: str, localid: int = 0, job: str = "4711") -> dict[str, str]:
    """What srun sets in one task of a step of `ntasks` tasks (those tiercel reads, and
    neighbours it must not read)."""
    return {"SLURM_JOB_ID": job, "SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(localid), "SLURM_NODEID": "0", "SLURMD_NODENAME": node,
            "SLURM_STEP_ID": "0"}


def test_srun_tasks_without_torchrun_are_ranks_of_one_job(tmp_path, shm_root, disk_root):
    """`srun -n 2 python train.py` on one node, no torchrun: each task's Store is its
    $SLURM_PROCID of $SLURM_STEP_NUM_TASKS, on host $SLURMD_NODENAME, and the step they save
    commits with the run id $SLURM_JOB_ID. (Before: both tasks were rank 0 of 1 and wrote the
    same rank's files.)"""
    policy = make_policy(shm_root, disk_root, every=1)
    seen = launch(tmp_path, policy, [srun_task(r, 2, "gpu017", localid=r) for r in range(2)], step=3)
    assert [(s["rank"], s["world_size"], s["host"], s["run_id"]) for s in seen] == [
        (0, 2, "gpu017", "4711"), (1, 2, "gpu017", "4711")], seen
    assert all(s["states"] == {"ram": "committed", "disk": "committed"} for s in seen), seen
    record = commit_record(disk_root, 3)
    assert record["job"]["run"] == "4711" and record["job"]["world_size"] == 2, record
    # Each rank's manifest in its own area (format version 3).
    assert sorted(p.parent.name for p in disk_root.glob("ranks/*/rank-*/step-000000000003.manifest.json")) == [
        "rank-00000", "rank-00001"]


def test_a_process_of_the_batch_script_is_one_process(tmp_path, shm_root, disk_root):
    """`python train.py` in the batch script itself, not under srun: Slurm sets $SLURM_PROCID=0
    and $SLURM_NTASKS (the allocation's tasks) there too, but no $SLURM_STEP_NUM_TASKS: it is a
    job of one process, not rank 0 of 8 waiting for 7 others forever."""
    env = {"SLURM_JOB_ID": "4712", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
           "SLURMD_NODENAME": "gpu017"}
    s = one(tmp_path, make_policy(shm_root, disk_root, every=1), env, step=1)
    assert (s["rank"], s["world_size"], s["run_id"]) == (0, 1, "4712"), s
    assert s["states"] == {"ram": "committed", "disk": "committed"}, s


def test_torchrun_under_srun_takes_torchruns_ranks(tmp_path, shm_root):
    """`srun --ntasks-per-node=1 torchrun ...`: the workers see Slurm's task (one per node) and
    torchrun's rank; torchrun's pair wins, never one variable from each launcher."""
    env = {**srun_task(1, 2, "gpu018"), "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
    s = one(tmp_path, make_policy(shm_root, None), env)
    assert (s["rank"], s["world_size"], s["host"]) == (5, 8, "gpu018"), s


BAD = [
    # (the environment, the variable the error must name, what else it must say)
    ({**srun_task(0, 2, "n"), "SLURM_PROCID": "abc"}, "SLURM_PROCID='abc'", "not an integer"),
    ({**srun_task(0, 2, "n"), "SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS='two'", "not an integer"),
    ({**srun_task(0, 2, "n"), "SLURM_PROCID": "2"}, "$SLURM_PROCID=2", "$SLURM_STEP_NUM_TASKS=2"),
    ({**srun_task(0, 2, "n"), "SLURM_PROCID": ""}, "$SLURM_PROCID is not", "set both"),
    ({**srun_task(0, 2, "n"), "SLURM_STEP_NUM_TASKS": "0"}, "$SLURM_STEP_NUM_TASKS=0", "below 1"),
    ({"RANK": "1"}, "$WORLD_SIZE is not", "set both"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "$RANK=-1", "below 0"),
    ({"RANK": "x", "WORLD_SIZE": "2", **srun_task(0, 1, "n")}, "RANK='x'", "torchrun"),
    ({"TORCHELASTIC_RESTART_COUNT": "once"}, "TORCHELASTIC_RESTART_COUNT='once'", "not an integer"),
]


@pytest.mark.parametrize("env,var,also", BAD, ids=[b[1] for b in BAD])
def test_a_malformed_value_is_an_error_naming_its_variable(tmp_path, shm_root, env, var, also):
    """(Before: `int()`'s ValueError, naming no variable, or a rank silently out of its world.)"""
    s = one(tmp_path, make_policy(shm_root, None), env)
    assert s.get("error") == "ConfigError", s
    assert var in s["message"] and also in s["message"], s["message"]


def test_the_host_is_tiercel_host_then_the_slurm_node_then_the_machine(tmp_path, shm_root):
    policy = make_policy(shm_root, None)
    assert one(tmp_path, policy, {"SLURMD_NODENAME": "gpu017"})["host"] == "gpu017"
    assert one(tmp_path, policy, {"SLURMD_NODENAME": "gpu017", "TIERCEL_HOST": "rack3-gpu017"})["host"] == "rack3-gpu017"
    assert one(tmp_path, policy, {})["host"] == socket.gethostname()


def test_slurm_nodes_are_the_hosts_whose_ranks_share_a_memory_tier(tmp_path):
    """Two tasks on two Slurm nodes (two memory roots standing in for the two nodes' /dev/shm),
    inside containers that give both the same host name: $SLURMD_NODENAME makes them two hosts,
    so each node's memory tier commits the step with its own rank. (Before: both took the
    machine's name, each memory tier waited for the other node's rank, and the step never
    committed in memory.)"""
    from conftest import new_shm_root

    roots = [new_shm_root(f"node{r}-") for r in range(2)]
    try:
        port = free_port()
        envs = [{**srun_task(r, 2, f"node{r}"), "INIT_TORCH": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "WAIT": "10"} for r in range(2)]
        # One policy per node: the memory root is that node's /dev/shm.
        seen = []
        procs = []
        for r, env in enumerate(envs):
            policy = make_policy(roots[r], None)
            out = tmp_path / f"node-{r}.json"
            log = open(tmp_path / f"node-{r}.log", "w")
            procs.append((subprocess.Popen([PYTHON, "-c", WORKER, json.dumps(policy), str(out), "2"], env=child_env(env),
                                           stdout=log, stderr=subprocess.STDOUT), log, out))
        for r, (p, log, out) in enumerate(procs):
            code = p.wait(120)
            log.close()
            assert code == 0, (tmp_path / f"node-{r}.log").read_text()[-4000:]
            seen.append(json.loads(out.read_text()))
        # Every rank's host is known on rank 0 only (docs/scale.md, "Coordination").
        assert [s["hosts"] for s in seen] == [["node0", "node1"], None], seen
        assert [s["states"] for s in seen] == [{"ram": "committed"}] * 2, seen
    finally:
        import shutil

        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


# -- torchrun (torchelastic) -------------------------------------------------------------------


def torchrun_worker(rank: int, world: int, run: str, restarts: int) -> dict[str, str]:
    """What torchrun sets in a worker (those tiercel reads, and neighbours it must not read)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": run, "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": "3"}


def test_torchrun_run_id_and_restart_count_go_into_the_commit_record(tmp_path, shm_root, disk_root):
    """$TORCHELASTIC_RUN_ID (`--rdzv-id`) is the run id, ahead of $SLURM_JOB_ID, and the
    restart count begins the launch that every commit record's generation carries: a step
    says which restart wrote it. (Before: the generation was a bare random token.)"""
    policy = make_policy(shm_root, disk_root, every=1)
    env = {**torchrun_worker(0, 1, "llm-7b", 2), "SLURM_JOB_ID": "4713"}
    s = one(tmp_path, policy, env, step=4)
    assert s["run_id"] == "llm-7b" and s["states"] == {"ram": "committed", "disk": "committed"}, s
    record = commit_record(disk_root, 4)
    assert record["job"]["run"] == "llm-7b", record
    assert record["generation"].startswith("restart2-") and record["generation"].endswith(".1"), record
    # The next restart of the same job: same run id, its own launch, and it sees the step.
    env["TORCHELASTIC_RESTART_COUNT"] = "3"
    s = one(tmp_path, policy, env, step=5)
    assert commit_record(disk_root, 5)["generation"].startswith("restart3-")
    assert commit_record(disk_root, 5)["job"] == record["job"]


def test_torchrun_without_rdzv_id_falls_back_to_slurms_job(tmp_path, shm_root, disk_root):
    """torchrun without `--rdzv-id` sets $TORCHELASTIC_RUN_ID=none: not a run id."""
    env = {**torchrun_worker(0, 1, "none", 0), "SLURM_JOB_ID": "4714"}
    s = one(tmp_path, make_policy(shm_root, disk_root, every=1), env, step=0)
    assert s["run_id"] == "4714"
    assert commit_record(disk_root, 0)["job"]["run"] == "4714"


def test_tiercel_run_id_beats_the_launchers(tmp_path, shm_root, disk_root):
    """$TIERCEL_RUN_ID (a run pinned across a chain of Slurm jobs) wins over torchrun's and
    Slurm's ids; the policy's `[store] run` wins over it (tests/test_job_identity.py)."""
    env = {**torchrun_worker(0, 1, "rdzv-1", 0), "SLURM_JOB_ID": "4715", "TIERCEL_RUN_ID": "llm-7b"}
    s = one(tmp_path, make_policy(shm_root, disk_root, every=1), env, step=0)
    assert s["run_id"] == "llm-7b"
    assert commit_record(disk_root, 0)["job"]["run"] == "llm-7b"


def test_no_launcher_is_one_process_with_a_bare_launch(tmp_path, shm_root, disk_root):
    s = one(tmp_path, make_policy(shm_root, disk_root, every=1), {}, step=0)
    assert (s["rank"], s["world_size"], s["run_id"]) == (0, 1, None), s
    generation = commit_record(disk_root, 0)["generation"]
    assert len(generation.split(".")[0]) == 16 and "restart" not in generation, generation


# -- docs/deploy.md ---------------------------------------------------------------------------


def deploy_doc() -> dict[str, list[str]]:
    """docs/deploy.md's code blocks by language."""
    from test_docs import blocks

    out: dict[str, list[str]] = {}
    for b in blocks("docs/deploy.md"):
        out.setdefault(b.lang, []).append(b.code)
    return out


def seconds(text: str) -> float:
    assert text.endswith("s"), text
    return float(text[:-1])


def flag(command: list[str] | str, name: str) -> str:
    words = command.split() if isinstance(command, str) else command
    found = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
    assert len(found) == 1, (name, words)
    return found[0]


def test_the_deploy_doc_names_the_variables_tiercel_reads():
    """docs/deploy.md's table names exactly the launcher variables tiercel reads (the
    environment module's and the core's run id variables), so neither can drift."""
    import re

    from tiercel import environment

    text = (Path(__file__).parent.parent / "docs" / "deploy.md").read_text()
    table = text.split("## What tiercel reads from the launcher", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    named = lambda row: re.findall(r"\$([A-Z_]+)", rows[row])  # noqa: E731
    assert named("rank, world size") == [v for _, r, w, _ in environment.LAUNCHERS for v in (r, w)]
    assert named("host (the failure domain, and the ranks that share a memory tier)") == list(environment.HOST_VARS)
    assert named("launch (begins every save's generation)") == [environment.RESTART_VAR]
    job_rs = (Path(__file__).parent.parent / "rust/tiercel-core/src/store/job.rs").read_text()
    run_vars = re.search(r"RUN_ID_VARS: \[&str; \d\] = \[(.*?)\];", job_rs).group(1)
    assert named("run id (which job a step belongs to)") == re.findall(r'"([A-Z_]+)"', run_vars)


def test_the_deploy_doc_launchers_fit_its_policy(tmp_path):
    """The sbatch script, the JobSet and the torchrun command agree with the policy beside
    them: each notice outlasts `grace`, torchrun's shutdown timeout outlasts it and the pod's
    grace period outlasts that; the pod names its host from the node, mounts a memory
    emptyDir at the memory root's /dev/shm, large enough for `capacity`, and lists the ports
    the per-rank snippet picks."""
    import tomllib

    import yaml

    doc = deploy_doc()
    policies = [tomllib.loads(t) for t in doc["toml"]]
    policy = next(p for p in policies if "tier" in p)
    grace = seconds(next(p for p in policies if "preemption" in p)["preemption"]["grace"])
    memory = policy["tier"][0]
    sizes = {"GiB": 2**30, "Gi": 2**30}

    def size(text: str) -> int:
        unit = next(u for u in sizes if text.endswith(u))
        return int(text[: -len(unit)]) * sizes[unit]

    sbatch, *_ = [s for s in doc["sh"] if s.startswith("#!/bin/bash")]
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch)
    subprocess.run(["bash", "-n", str(script)], check=True)
    signal_at = [line.split("@")[1] for line in sbatch.splitlines() if line.startswith("#SBATCH --signal=TERM@")]
    assert len(signal_at) == 1 and int(signal_at[0]) - 60 > grace, signal_at  # Slurm may signal 60 s early
    assert "TIERCEL_RUN_ID=" in sbatch and "srun " in sbatch

    jobset = yaml.safe_load(doc["yaml"][0])
    job = jobset["spec"]["replicatedJobs"][0]
    pod = job["template"]["spec"]["template"]["spec"]
    trainer = pod["containers"][0]
    shutdown = int(flag(trainer["command"], "shutdown-timeout"))
    assert grace < shutdown < pod["terminationGracePeriodSeconds"], (grace, shutdown, pod)
    env = {e["name"]: e for e in trainer["env"]}
    assert env["TIERCEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert flag(trainer["command"], "rdzv-id") == jobset["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = next(n for n, v in volumes.items() if v.get("emptyDir", {}).get("medium") == "Memory")
    assert Path(memory["root"]).is_relative_to(mounts[shm]), (memory["root"], mounts)
    assert size(volumes[shm]["emptyDir"]["sizeLimit"]) >= size(memory["capacity"])
    assert Path(env["TIERCEL_POLICY"]["value"]).parent == Path(mounts[next(n for n, v in volumes.items() if "configMap" in v)])
    assert "preStop" in trainer["lifecycle"] and "torchrun" in trainer["lifecycle"]["preStop"]["exec"]["command"][-1]
    ports = [p["containerPort"] for p in trainer["ports"]]
    per_rank = next(code for code in doc["python"] if '"listen"' in code)
    base = int(per_rank.split('f"0.0.0.0:{', 1)[1].split(" + ", 1)[0])
    assert ports == [base + r for r in range(int(flag(trainer["command"], "nproc-per-node")))], ports
    hostpath = yaml.safe_load(doc["yaml"][1])["volumes"][0]
    assert hostpath["name"] == shm and hostpath["hostPath"]["path"].startswith("/dev/shm/")

    torchrun = next(s for s in doc["sh"] if s.startswith("torchrun"))
    assert int(flag(torchrun.replace("\\\n", " "), "shutdown-timeout")) > grace
    assert flag(torchrun.replace("\\\n", " "), "rdzv-id")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
