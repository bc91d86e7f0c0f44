"""One rank of a real FSDP2 training job (torch.distributed, gloo on 127.0.0.1, CPU) that
checkpoints through tiercel.dcp; started by tests/test_dcp.py as `python -c SCRIPT CONFIG`.

    train   trains steps 1..last, saves (dcp.save or dcp.async_save) after the steps in
            `save`, records every loss and, at each save, this rank's state (and rank 0 the
            full state); then, if `kill`, SIGKILLs itself: no close, no clean-up.
    resume  builds the model afresh, loads the newest step (or `step`) with tiercel.dcp.Reader,
            records what it loaded, saves it again as step `resave` if given, trains on to
            `last`, records the losses.
    saveload  for k = 1..`last`: saves a state whose every value is k (a tensor sharded over
            the ranks, a plain tensor, a byte item), then at once loads the newest step into
            the same layout and into a resharded one (the sharded tensor whole on every
            rank); records the step and values each load got.

Everything a test checks is written as JSON (losses as float.hex: bit for bit) or torch.save
files under `out`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import tiercel.dcp

DIM = 64


def build_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM),
                               torch.nn.GELU(), torch.nn.Linear(DIM, 8))


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's data for a step: the same in every run."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(16, DIM, generator=g), torch.randn(16, 8, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> str:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item()).hex()


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def local_copy(state: Any) -> Any:
    """This rank's shards (DTensors as their local tensors), copied: what it saved."""
    if isinstance(state, DTensor):
        return state.to_local().detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: local_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_copy(v) for v in state)
    return state


def full_copy(state: Any) -> Any:
    """Whole tensors (collective: every rank must call it)."""
    if isinstance(state, DTensor):
        return state.full_tensor().detach().clone()
    if isinstance(state, dict):
        return {k: full_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_copy(v) for v in state)
    return local_copy(state)


def manifest_file(shm_root: str, step: int, rank: int) -> Path:
    return Path(shm_root) / f"step-{step:012d}" / f"rank-{rank:05d}.manifest.json"


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


class DieMidWrite(DefaultSavePlanner):
    """Rank 0 dies inside its write_data, once rank 1 has committed its part of the step
    and both ranks' training loops are through the step that raced the save (`raced`
    files): the step then has every rank's data but rank 0's, and no DCP metadata."""

    def __init__(self, shm_root: str, step: int, raced: list[Path]):
        super().__init__()
        self._wait = [manifest_file(shm_root, step, 1), *raced]

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == 0:
            for path in self._wait:
                wait_for(path)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def train(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    policy, out = cfg["policy"], Path(cfg["out"])
    model, opt = build(world)
    # DCP's background saves talk on a group of their own, so that they never interleave with
    # the training loop's collectives on the default group.
    ckpt_pg = dist.new_group(backend="gloo") if cfg.get("async") else None
    losses: dict[int, str] = {}
    pending: Any = None
    report: dict[str, Any] = {"states": {}}
    for step in range(1, cfg["last"] + 1):
        losses[step] = train_step(model, opt, step, rank)
        if step not in cfg["save"]:
            continue
        if pending is not None:
            pending[0].result()
            report["states"][pending[1].step_saved] = pending[1].handle.wait(60)
        state = app_state(model, opt)
        torch.save(local_copy(state), out / f"local-{step}-{rank}.pt")
        full = full_copy(state)
        if rank == 0:
            torch.save(full, out / f"full-{step}.pt")
        writer = tiercel.dcp.Writer(policy, step=step)
        writer.step_saved = step  # type: ignore[attr-defined]
        if cfg.get("async"):
            dying = cfg.get("die_at") == step
            raced = [out / f"raced-{r}" for r in range(world)]
            planner = DieMidWrite(cfg["shm"], step, raced) if dying else None
            fut = dcp.async_save(state, storage_writer=writer, process_group=ckpt_pg, planner=planner)
            pending = (fut, writer)
            if dying:
                # The next step races the background save, which kills rank 0 in the middle;
                # rank 1 dies too once its part is in.
                losses[step + 1] = train_step(model, opt, step + 1, rank)
                _write(out / f"train-{rank}.json", {"losses": losses, **report})
                raced[rank].touch()
                if rank == 1:
                    wait_for(manifest_file(cfg["shm"], step, 1))
                    os.kill(os.getpid(), signal.SIGKILL)
                fut.result()
                raise AssertionError("rank 0 survived a save that kills it")
        else:
            dcp.save(state, storage_writer=writer)
            report["states"][step] = writer.handle.wait(60) if writer.handle else None
    if pending is not None:
        pending[0].result()
        report["states"][pending[1].step_saved] = pending[1].handle.wait(60)
    report["losses"] = losses
    _write(out / f"train-{rank}.json", report)
    dist.barrier()
    if cfg.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    return report


def resume(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    out = Path(cfg["out"])
    model, opt = build(world)
    state = app_state(model, opt)
    reader = tiercel.dcp.Reader(cfg["policy"], step=cfg.get("step"))
    if cfg.get("expect_error"):
        try:
            dcp.load(state, storage_reader=reader)
        except CheckpointException as e:  # DCP gathers every rank's error and raises them on all
            report = {"error": str(e)}
            _write(out / f"resume-{rank}.json", report)
            return report
        raise AssertionError("the load did not fail")
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = reader.step
    assert step is not None
    loaded = app_state(model, opt)
    # Bytes this process read from each tier (the elastic restore reads none from a durable one).
    read = {tier: m["bytes_read"] or 0 for tier, m in reader.store.metrics().items()}
    report: dict[str, Any] = {"step": step, "tiers": dict(reader.tiers), "bytes_read": read}
    if world == int(cfg["saved_world"]):
        torch.save(local_copy(loaded), out / f"loaded-{step}-{rank}.pt")
    full = full_copy(loaded)
    if rank == 0:
        torch.save(full, out / f"loaded-full-{step}-w{world}.pt")
    if cfg.get("resave") is not None:
        dcp.save(loaded, storage_writer=tiercel.dcp.Writer(cfg["policy"], step=cfg["resave"]))
    losses = {s: train_step(model, opt, s, rank) for s in range(step + 1, cfg["last"] + 1)}
    report["losses"] = losses
    _write(out / f"resume-{rank}.json", report)
    return report


def saveload(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state(k: float, place: Any) -> dict[str, Any]:
        full = torch.full((4 * world, 6), k)
        return {"sharded": distribute_tensor(full, mesh, [place]), "plain": torch.full((5,), k), "meta": {"k": k}}

    def values(loaded: dict[str, Any]) -> list[Any]:
        t = loaded["sharded"].to_local()
        return [sorted(set(t.flatten().tolist())), sorted(set(loaded["plain"].tolist())), loaded["meta"]["k"]]

    report: dict[str, Any] = {"loads": []}
    for k in range(1, cfg["last"] + 1):
        dcp.save(state(float(k), Shard(0)), storage_writer=tiercel.dcp.Writer(cfg["policy"], step=k))
        for place in (Shard(0), Replicate()):  # as saved; resharded
            target = state(-1.0, place)
            reader = tiercel.dcp.Reader(cfg["policy"])
            try:
                dcp.load(target, storage_reader=reader)
                report["loads"].append([k, reader.step, *values(target)])
            except CheckpointException as e:
                report["loads"].append([k, reader.step, f"error: {e}"[:2000]])
    _write(Path(cfg["out"]) / f"saveload-{rank}.json", report)
    return report


def _write(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


def main() -> None:
    # A policy may give each host its own memory root: "root": ".../{host}".
    cfg = json.loads(sys.argv[1].replace("{host}", os.environ.get("TIERCEL_HOST", "")))
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    {"train": train, "resume": resume, "saveload": saveload}[cfg["mode"]](cfg, rank, world)
    tiercel.dcp.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
