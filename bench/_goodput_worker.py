"""One rank of bench/goodput.py, inside its host's network namespace: a real training loop
(an MLP under DDP on gloo, Adam, synthetic regression batches that depend only on the
iteration and the rank, so a restored job sees the data it would have seen) that
checkpoints by one method and, after a restart, restores the newest checkpoint it can:

- "tiercel": every iteration through a Store (memory, peer, and the object store as the
  durable tier), `[traffic] mode = "learned"` with `tiercel.torch.interleave`, and
  `[preemption]`: on SIGTERM the newest step in RAM goes to the object store;
- "persist": tiercel's s3 tier only (restore order: the bucket), every `k` iterations,
  each save blocking until the step is committed in the bucket;
- "dcp": torch.distributed.checkpoint to a shared directory every `k` iterations.

The first launch trains `warmup` iterations without checkpoints (the step time without
them), then times its first checkpoint and, for the interval methods, picks `k` from
Young/Daly's rule for that cost (bench/goodput_model.py). Everything the orchestrator needs
goes to stdout as lines "GP <json>" with the machine-wide monotonic clock, which every
namespace shares."""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import sys
import time

T0 = time.monotonic()  # before the imports: a restart's cost includes them


def emit(event: str, **fields: object) -> None:
    print("GP " + json.dumps({"ev": event, "t": time.monotonic(), **fields}), flush=True)


emit("start", t_start=T0)

from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tiercel  # noqa: E402
import tiercel.torch  # noqa: E402

from goodput_model import interval_in_iterations  # noqa: E402


class Reports(logging.Handler):
    """Passes tiercel's preemption report (a log line per rank) on to the orchestrator."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "preemption" in msg:
            emit("preempt_report", message=msg)


def policy(cfg: dict, rank: int) -> dict:
    host = os.environ["TIERCEL_HOST"]
    s3 = {"name": "bucket", "kind": "s3", "url": cfg["url"], "endpoint": cfg["endpoint"], "allow_http": True,
          "compression": "none", "keep": 3}
    ram = {"name": "ram", "kind": "memory", "root": f"{cfg['shm']}/{host}", "keep": 2}
    store = {"chunk_size": "1MiB", "threads": 2, "io_threads": 2}
    if cfg["method"] == "persist":
        return {"tier": [ram, s3], "restore": {"order": ["bucket"]}, "store": store}
    peer = {"name": "peer", "kind": "peer", "listen": f"{cfg['addrs'][rank]}:0", "replicas": 2, "keep": 2}
    return {"tier": [ram, peer, s3], "restore": {"order": ["ram", "peer", "bucket"]}, "store": store,
            "traffic": {"mode": cfg["traffic"], "warmup": cfg["traffic_warmup"]},
            "preemption": {"grace": f"{cfg['grace']}s", "signals": ["SIGTERM"]}}


def build(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank and every launch starts from the same weights
    w = cfg["width"]
    layers: list[torch.nn.Module] = []
    for _ in range(cfg["depth"]):
        layers += [torch.nn.Linear(w, w), torch.nn.GELU()]
    layers.append(torch.nn.Linear(w, w))
    return torch.nn.Sequential(*layers)


def batch(cfg: dict, it: int, rank: int, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it * 1000 + rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    return x, torch.tanh(x @ teacher)


def newest_dcp(root: Path) -> Path | None:
    """The newest complete DCP checkpoint: DCP writes `.metadata` last."""
    done = sorted(p for p in root.glob("step-*") if (p / ".metadata").exists())
    return done[-1] if done else None


def main() -> None:
    cfg = json.loads(sys.argv[1])
    method = cfg["method"]
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    logging.getLogger("tiercel").addHandler(Reports())
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=cfg["pg_timeout"]))
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(build(cfg))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    teacher = torch.randn(cfg["width"], cfg["width"], generator=torch.Generator().manual_seed(1)) / cfg["width"] ** 0.5
    store = None
    if method == "tiercel":
        # Installed before the Store opens, so tiercel's handler chains it after its flush:
        # it says when the flush ended, then the process goes as the notice means it to.
        def preempted(signum: int, frame: object) -> None:
            emit("preempt_exit", rank=rank)
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, preempted)
    if method in ("tiercel", "persist"):
        store = tiercel.Store(policy(cfg, rank))
        if method == "tiercel":
            tiercel.torch.interleave(model, store)
    emit("ready", rank=rank)

    # -- restore ------------------------------------------------------------------------
    t = time.monotonic()
    step, tiers = 0, ""
    if store is not None:
        got = tiercel.torch.load_state(store, model=model.module, optimizer=optimizer, rng=False)
        if got is not None:
            step = got
            assert store.last_restore is not None
            tiers = "+".join(sorted(store.last_restore.tiers))  # e.g. "ram", "peer", "bucket"
    else:
        root = Path(cfg["dcp_dir"])
        pick = [str(newest_dcp(root) or "")] if rank == 0 else [""]
        dist.broadcast_object_list(pick, src=0)  # one answer, whatever each rank's listing
        if pick[0]:
            from torch.distributed.checkpoint import load
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(model, optimizer)
            sd: dict[str, Any] = {"model": msd, "optim": osd}
            load(sd, checkpoint_id=pick[0])  # in place
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            step, tiers = int(Path(pick[0]).name.split("-")[1]), "dir"
    dist.barrier()
    emit("restored", rank=rank, step=step, seconds=time.monotonic() - t, tiers=tiers)

    # -- train --------------------------------------------------------------------------
    plan = cfg.get("plan")  # {k, warmup}: set by the first launch, kept by the restarts
    warmup_times: list[float] = []
    prev = None  # the previous checkpoint's handle: how far its background tiers got in one step
    for it in range(step + 1, cfg["max_iter"] + 1):
        start = time.monotonic()
        x, y = batch(cfg, it, rank, teacher)
        if cfg["compute_s"]:
            time.sleep(cfg["compute_s"])  # the accelerator's share of the step, host idle
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        trained = time.monotonic()
        save_s, handle = None, None
        if plan is None:
            warmup_times.append(trained - start)
            if it == cfg["warmup"]:
                save_s, handle = checkpoint(method, cfg, store, model, optimizer, it)
                plan = make_plan(method, cfg, warmup_times, save_s, it)
                if rank == 0:
                    emit("plan", **plan)
        elif it >= plan["warmup"] and (it - plan["warmup"]) % plan["k"] == 0:
            save_s, handle = checkpoint(method, cfg, store, model, optimizer, it)
        if method == "tiercel" and rank == 0 and plan is not None and it == plan["warmup"] + 2 * cfg["traffic_warmup"]:
            assert store is not None  # what the traffic schedule learned, once it has (diagnostics)
            emit("traffic", it=it, stats=store.traffic.stats(checkpoint_bytes=12 * sum(p.numel() for p in model.parameters())))
        behind = prev.states() if prev is not None and method == "tiercel" else None
        if rank == 0:
            emit("iter", it=it, step_s=time.monotonic() - start, save_s=save_s, loss=loss.detach().item(),
                 prev_states=behind)
        elif behind is not None:
            emit("tiers", it=it, prev_states=behind)  # each rank's replication runs on its own
        prev = handle or prev
    dist.barrier()
    emit("finished", rank=rank)
    if store is not None:
        store.close()
    dist.destroy_process_group()


def checkpoint(method: str, cfg: dict, store: tiercel.Store | None, model: torch.nn.parallel.DistributedDataParallel,
               optimizer: torch.optim.Optimizer, it: int) -> tuple[float, tiercel.SaveHandle | None]:
    """Checkpoints iteration `it`; returns the seconds it blocked training (and tiercel's
    handle, whose states say how far the step's background tiers got)."""
    t = time.monotonic()
    if method == "tiercel":
        assert store is not None
        h = tiercel.torch.save_state(store, it, model=model.module, optimizer=optimizer, rng=False)
        return time.monotonic() - t, h
    elif method == "persist":
        assert store is not None
        h = tiercel.torch.save_state(store, it, model=model.module, optimizer=optimizer, rng=False)
        h.wait(cfg["pg_timeout"], commit=True)  # in the bucket, every rank's part: durable
    else:
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        save({"model": msd, "optim": osd}, checkpoint_id=f"{cfg['dcp_dir']}/step-{it:08d}")
    return time.monotonic() - t, None


def make_plan(method: str, cfg: dict, times: list[float], save_s: float, it: int) -> dict:
    """The checkpoint interval, agreed by the ranks (the slowest rank's step and cost):
    every iteration for tiercel, Young/Daly's for the others at the configured MTBF."""
    steady = times[2:] or times
    t = torch.tensor([statistics.median(steady), save_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step_s, cost = float(t[0]), float(t[1])
    k = 1 if method == "tiercel" else interval_in_iterations(cost, cfg["mtbf_s"], step_s)
    return {"k": k, "warmup": it, "step_s": step_s, "first_save_s": cost}


if __name__ == "__main__":
    main()
