"""One rank of bench/interleave.py, inside its host's network namespace: a DDP model whose
gradient all-reduce moves `grad_mb` per step (gloo over the shaped link), `compute_s` of
forward compute (idle network time), and, unless mode is "nockpt", a save every step that
the peer tier replicates to the other host. Writes its step times (and rank 0's traffic
timeline) as JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import tiercel
import tiercel.torch


class Model(torch.nn.Module):
    """One flat parameter of `n` floats (its gradient is what DDP all-reduces) and a
    forward pass that computes for `compute_s` seconds without touching the network."""

    def __init__(self, n: int, compute_s: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))
        self.compute_s = compute_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.perf_counter() + self.compute_s
        while time.perf_counter() < end:  # compute (a busy CPU, as a GPU kernel would be)
            pass
        return (self.w * x).sum()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    host = os.environ["TIERCEL_HOST"]
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": f"{cfg['shm']}/{host}", "keep": 2},
            {"name": "peer", "kind": "peer", "listen": f"{cfg['addrs'][rank]}:0", "replicas": 2, "keep": 2},
        ],
        "store": {"chunk_size": cfg["chunk"], "threads": 2, "io_threads": 2},
        "traffic": {"mode": "off" if cfg["mode"] in ("nockpt", "off") else cfg["mode"], "warmup": cfg["warmup"]},
    }
    store = tiercel.Store(policy)
    n = cfg["grad_mb"] * (1 << 20) // 4
    model = torch.nn.parallel.DistributedDataParallel(Model(n, cfg["compute_s"]))
    tiercel.torch.interleave(model, store)
    state = {"w": np.random.default_rng(rank).integers(0, 255, cfg["ckpt_mb"] << 20, dtype=np.uint8)}
    x = torch.ones(n)
    times: list[float] = []
    store.traffic.record()
    t0 = store.traffic.now()
    for step in range(1, cfg["steps"] + 1):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).backward()
        if cfg["mode"] != "nockpt":
            state["w"][:8] = step % 251  # a new state every step
            store.save(step, state)
        times.append(time.perf_counter() - start)
        if rank == 0 and step % max(1, cfg["steps"] // 5) == 0:
            print(f"[{cfg['mode']}] step {step}/{cfg['steps']}: {np.median(times[-10:]) * 1e3:.1f} ms", flush=True)
    stats = store.traffic.stats(checkpoint_bytes=cfg["ckpt_mb"] << 20)
    timeline = [(t - t0, k, link, b, s) for t, k, link, b, s in store.traffic.timeline()]
    store.flush()  # the replication backlog, if any, is part of the result
    metrics = store.metrics()
    dist.barrier()
    store.close()
    dist.destroy_process_group()
    with open(os.path.join(cfg["out"], f"{cfg['mode']}-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "times": times, "timeline": timeline if rank == 0 else [], "stats": stats,
                   "peer": metrics.get("peer")}, f)


if __name__ == "__main__":
    main()
