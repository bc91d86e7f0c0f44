"""One rank of bench/interleave.py, inside its host's network namespace: a DDP model of
`buckets` layers whose gradients (`grad_mb` in all, one DDP bucket per layer) are
all-reduced by gloo over the shaped link while the backward pass computes the layers below
(as DDP overlaps them), `compute_s` of forward and `backward_s` of backward compute (idle
network time), and, unless mode is "nockpt", a save every step that the peer tier
replicates to the other host (mode "local": a memory tier only, the save's own cost with no
replication). Writes its step times (and rank 0's traffic timeline) as JSON.

Pattern "fsdp" instead: no DDP; each layer's collective runs on its own, with the layer's
compute between them, as FSDP without prefetching does: in forward the layer's parameters
are gathered, then it computes; in backward it computes, then its gradient is reduced. The
link is then idle in many short spans across the step instead of one long one."""

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


def compute(seconds: float, spin: bool) -> None:
    """`seconds` of compute. A GPU kernel leaves the host's cores free (sleep); `spin` keeps
    one core busy instead, as a CPU-bound step would."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Layer(torch.autograd.Function):
    """z + sum(w): forward computes `fwd_s`, backward `bwd_s`, then hands w its gradient, which
    makes that layer's DDP bucket ready while the layers below still compute."""

    @staticmethod
    def forward(ctx, z, w, fwd_s, bwd_s, spin):
        compute(fwd_s, spin)
        ctx.bwd_s, ctx.spin, ctx.n = bwd_s, spin, w.numel()
        return z + w[0]

    @staticmethod
    def backward(ctx, g):
        compute(ctx.bwd_s, ctx.spin)
        return g, g.expand(ctx.n).contiguous(), None, None, None


class Model(torch.nn.Module):
    """`layers` parameters of `n` floats each, chained so that backward runs them one after
    the other, last layer first (as in any deep network)."""

    def __init__(self, layers: int, n: int, fwd_s: float, bwd_s: float, spin: bool):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for _ in range(layers))
        self.fwd_s, self.bwd_s, self.spin = fwd_s / layers, bwd_s / layers, spin

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        for w in self.w:
            z = Layer.apply(z, w, self.fwd_s, self.bwd_s, self.spin)
        return z


def fsdp_step(store: tiercel.Store, bufs: list[torch.Tensor], fwd_s: float, bwd_s: float, spin: bool) -> None:
    """One step of the "fsdp" pattern, its collectives signalled to the store. An all-reduce
    of the layer's bytes stands in for FSDP's all-gather and reduce-scatter (gloo has no
    reduce-scatter); what matters here is when the link is busy, and for how long."""
    store.traffic.iteration()
    for buf in bufs:
        with store.traffic.training_comm():
            dist.all_reduce(buf)
        compute(fwd_s / len(bufs), spin)
    for buf in reversed(bufs):
        compute(bwd_s / len(bufs), spin)
        with store.traffic.training_comm():
            dist.all_reduce(buf)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    host = os.environ["TIERCEL_HOST"]
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    tiers = [{"name": "ram", "kind": "memory", "root": f"{cfg['shm']}/{host}", "keep": 2}]
    if cfg["mode"] != "local":
        tiers.append({"name": "peer", "kind": "peer", "listen": f"{cfg['addrs'][rank]}:0", "replicas": 2, "keep": 2})
    policy = {
        "tier": tiers,
        "store": {"chunk_size": cfg["chunk"], "threads": 2, "io_threads": 2},
        "traffic": {"mode": "off" if cfg["mode"] in ("nockpt", "local", "off") else cfg["mode"], "warmup": cfg["warmup"]},
    }
    if cfg.get("mu") is not None:
        policy["traffic"]["mu"] = cfg["mu"]
    store = tiercel.Store(policy)
    layers = cfg["buckets"]
    n = cfg["grad_mb"] * (1 << 20) // 4 // layers
    fsdp = cfg["pattern"] == "fsdp"
    bufs = [torch.zeros(n) for _ in range(layers)]
    if not fsdp:
        net = Model(layers, n, cfg["compute_s"], cfg["backward_s"], cfg["spin"])
        # A bucket cap just under one layer's gradient: each layer is a bucket of its own
        # (DDP never splits a parameter), as a model with many layers per 25 MiB bucket would be.
        cap = (n * 4 - 1) / 2**20
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap)
        tiercel.torch.interleave(model, store)
    state = {"w": np.random.default_rng(rank).integers(0, 255, cfg["ckpt_mb"] << 20, dtype=np.uint8)}
    x = torch.zeros(())
    times: list[float] = []
    store.traffic.record()
    t0 = store.traffic.now()
    for step in range(1, cfg["steps"] + 1):
        start = time.perf_counter()
        if fsdp:
            fsdp_step(store, bufs, cfg["compute_s"], cfg["backward_s"], cfg["spin"])
        else:
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
