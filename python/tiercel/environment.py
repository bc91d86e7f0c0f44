"""What tiercel reads from the launcher's environment (torchrun, Slurm's srun, Kubernetes),
in one place, each rule in its order of precedence. docs/deploy.md tells users the same.

| what                | first that is set                                                          |
| ------------------- | -------------------------------------------------------------------------- |
| rank, world size    | the coordinator (torch.distributed, jax.distributed, `coordinator=`);       |
|                     | `rank=`/`world_size=`; $RANK/$WORLD_SIZE (torchrun); $SLURM_PROCID/         |
|                     | $SLURM_STEP_NUM_TASKS (a task of an srun step); else one process            |
| host                | $TIERCEL_HOST; $SLURMD_NODENAME (Slurm); the machine's name                 |
| launch              | a fresh token, prefixed "restart<n>-" under torchrun ($TORCHELASTIC_RESTART_COUNT) |
| run id              | the core reads it (`store/job.rs`, `RUN_ID_VARS`): `[store] run`;           |
|                     | $TIERCEL_RUN_ID; $TORCHELASTIC_RUN_ID (unless "none"); $SLURM_JOB_ID        |

Why these and not others:

- Rank and world size come from one launcher as a pair, never one from each: torchrun's
  workers under `srun torchrun` also see Slurm's (one task per node), and torchrun's are
  theirs. Slurm's world size is $SLURM_STEP_NUM_TASKS, which only srun sets: a process
  started by the batch script itself also sees $SLURM_PROCID=0 and $SLURM_NTASKS (the
  allocation's tasks), but it is one process, not rank 0 of many.
- The host is the failure domain and the set of ranks that share a memory root. Under
  Slurm $SLURMD_NODENAME is the node the task runs on, the same in every task there (a
  container may give each task a host name of its own), and the name Slurm's own tools
  (`squeue`, `scontrol`) show. Kubernetes has no such variable: a pod's host name is the
  pod's, so a manifest sets $TIERCEL_HOST from the downward API (`spec.nodeName`).
- No local rank ($LOCAL_RANK, $SLURM_LOCALID) and no $GROUP_RANK: which ranks share a host
  is learned from the host names through the coordinator, and GROUP_RANK (torchrun's node
  index) is renumbered when the nodes change, so it names no machine.
- $TORCHELASTIC_RESTART_COUNT is not part of the job's identity (every restart of one job
  must restore the others' steps); it goes into the launch token, which every manifest and
  commit record carry in their generation, so a step says which restart wrote it.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping

from .errors import ConfigError

#: The launchers whose environment gives a rank and a world size, in order: (who, the
#: variable of the rank, the variable of the world size, what must be set for them to count).
LAUNCHERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", ("RANK", "WORLD_SIZE")),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", ("SLURM_STEP_NUM_TASKS",)),
)

#: The variables that name this process's host, in order, before the machine's name.
HOST_VARS = ("TIERCEL_HOST", "SLURMD_NODENAME")

#: torchrun's count of restarts of the worker group so far (0 at the first launch).
RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"


def _get(environ: Mapping[str, str], var: str) -> str | None:
    value = environ.get(var, "").strip()
    return value or None


def _integer(environ: Mapping[str, str], var: str, who: str, other: str, least: int) -> int:
    what = f"{who}'s {'rank' if least == 0 else 'world size'}"
    value = _get(environ, var)
    if value is None:
        raise ConfigError(f"${other} is set but ${var} is not ({who} sets both): set both, or neither, or pass "
                          f"Store({'rank' if least == 0 else 'world_size'}=...)")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"${var}={environ[var]!r} is not an integer ({what}): set it to one, or unset it") from None
    if n < least:
        raise ConfigError(f"${var}={n} is below {least} ({what}): set it to {least} or more, or unset it")
    return n


def launcher_job(rank: int | None = None, world_size: int | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This process's (rank, world size) where no coordinator says: `rank`/`world_size` as
    given, the rest from the first launcher in LAUNCHERS whose variables are set, else a
    single process. A malformed or inconsistent value is a ConfigError naming the variable."""
    if rank is not None and world_size is not None:
        return rank, world_size  # the core checks them
    env = os.environ if environ is None else environ
    for who, rank_var, size_var, markers in LAUNCHERS:
        if not any(_get(env, v) is not None for v in markers):
            continue
        r = rank if rank is not None else _integer(env, rank_var, who, size_var, 0)
        w = world_size if world_size is not None else _integer(env, size_var, who, rank_var, 1)
        if r >= w:
            said = [f"${rank_var}={r}" if rank is None else f"rank={r}", f"${size_var}={w}" if world_size is None else f"world_size={w}"]
            raise ConfigError(f"{said[0]} is not below {said[1]} ({who}): a rank is 0 to world size - 1; "
                              "fix the launcher's variables")
        return r, w
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def host(environ: Mapping[str, str] | None = None) -> str:
    """This process's host, the failure domain: the first of HOST_VARS that is set, else the
    machine's name."""
    env = os.environ if environ is None else environ
    for var in HOST_VARS:
        value = _get(env, var)
        if value is not None:
            return value
    return socket.gethostname()


def restart_count(environ: Mapping[str, str] | None = None) -> int | None:
    """How many times torchrun has restarted this job's workers, or None outside torchrun."""
    env = os.environ if environ is None else environ
    value = _get(env, RESTART_VAR)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"${RESTART_VAR}={env[RESTART_VAR]!r} is not an integer (torchrun's restart count)") from None
    if n < 0:
        raise ConfigError(f"${RESTART_VAR}={n} is below 0 (torchrun's restart count)")
    return n


def launch_token(environ: Mapping[str, str] | None = None) -> str:
    """A token for this launch of the job (a save's generation begins with it): 16 random hex
    digits, after "restart<n>-" under torchrun, so that a commit record says which restart
    wrote its step. Rank 0's is the job's (`Store._join_cluster`)."""
    n = restart_count(environ)
    token = secrets.token_hex(8)
    return token if n is None else f"restart{n}-{token}"
