"""A training process for tests/test_preempt.py: opens a Store from the policy (JSON, argv[1]),
saves steps 1..3 of `state(step, rank)` (or $PREEMPT_STEPS, e.g. "1,2,3,4": a rank one save
ahead of the others, whose newest save then reaches only its own part in RAM), prints "ready"
and trains on (a sleep loop) until a signal ends it. With WORLD_SIZE > 1 it joins torch.distributed (gloo) first, and the ranks
pass a barrier before "ready". Logs go to stderr (the report of the preemption's flush)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np

#: float32 values per rank and step: 8 MiB, 8 s on a 1 MB/s link.
N = 2 << 20


def state(step: int, rank: int) -> dict:
    return {"model": {"w": np.random.default_rng(1000 * step + rank).standard_normal(N, dtype=np.float32)}}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    import tiercel

    policy = json.loads(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    store = tiercel.Store(policy)
    steps = [int(s) for s in os.environ.get("PREEMPT_STEPS", "1,2,3").split(",")]
    handles = [store.save(step, state(step, store.rank)) for step in steps]
    for h in handles:
        if h.step > 3:  # a step the other ranks never save: its RAM commit waits for them
            deadline = time.monotonic() + 120
            while h.states()["ram"] != "written" and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            h.wait(120)
    if world > 1:
        dist.barrier()
    print("ready", flush=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the training loop, until the signal
        time.sleep(0.05)
    print("never signalled", flush=True)


if __name__ == "__main__":
    main()
