"""`tiercel.torch.interleave` on a real 2-rank DDP job (gloo, loopback): the comm hook runs
around every gradient bucket, the signals reach the store, and the gradients are those of
DDP without the hook. `tiercel.deepspeed.interleave` on a real DeepSpeed engine (ZeRO-1, CPU):
signals around backward and step, training unchanged."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import PYTHON, child_env
from test_multirank import free_port, run_ranks

WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
import tiercel
import tiercel.torch

shm, out_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
rank = dist.get_rank()
torch.manual_seed(0)
def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
# Small buckets: several all-reduces per backward pass.
plain = torch.nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=0.02)
hooked = torch.nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=0.02)
store = tiercel.Store({"tier": [{"name": "ram", "kind": "memory", "root": f"{shm}/{rank}"}],
                       "traffic": {"mode": "learned", "warmup": 2}})
store.traffic.record()
handle = tiercel.torch.interleave(hooked, store)
steps, same = 3, True
for step in range(steps):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + rank))
    for m in (plain, hooked):
        m.zero_grad()
        m(x).pow(2).sum().backward()
    same = same and all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), hooked.parameters()))
    # The hook averaged across ranks: gradients differ from this rank's local ones.
kinds = [e[1] for e in store.traffic.timeline()]
stats = store.traffic.stats()
handle.remove()
try:
    tiercel.torch.interleave(torch.nn.Linear(2, 2), store)
    wrong = None
except tiercel.InvalidArgumentError as e:
    wrong = str(e)
report = {"same": same, "iterations": kinds.count("iteration"), "busy": kinds.count("busy"), "idle": kinds.count("idle"),
          "still_busy": stats["busy"], "profiled": stats["profiled"], "wrong": wrong,
          "buckets": len(list(hooked.parameters()))}
# Each stage prints a mark, so a rank's log shows how far it got if the teardown fails.
dist.barrier()
print("barrier passed", flush=True)
store.close()
print("store closed", flush=True)
dist.destroy_process_group()
print("process group destroyed", flush=True)
with open(os.path.join(out_dir, f"interleave-{rank}.json"), "w") as f:
    json.dump(report, f)
# The DDP models still hold the Python comm hook; torn down by the interpreter's exit while
# gloo's C++ threads end, they can end the process in std::terminate (exit -6: seen once in
# CI, in a rank that had reached the barrier, since its peer passed it; not reproduced in 100
# loaded runs). Leave without running those destructors, as tests/ds_worker.py does.
os._exit(0)
"""


def test_ddp_comm_hook_signals_around_each_bucket(tmp_path, shm_root):
    run_ranks(WORKER, [str(shm_root), str(tmp_path)], tmp_path, 2, lambda r: {"OMP_NUM_THREADS": "1"}, tag="interleave")
    for r in range(2):
        rep = json.loads((tmp_path / f"interleave-{r}.json").read_text())
        assert rep["same"], "gradients with the hook differ from DDP's own"
        assert rep["iterations"] == 3
        # Several buckets per step, each one busy/idle pair (nested ones count once).
        assert rep["busy"] >= 3 and rep["busy"] == rep["idle"], rep
        assert not rep["still_busy"]
        assert rep["profiled"] == 2
        assert "DistributedDataParallel" in rep["wrong"]



DEEPSPEED = r"""
import json, os, sys
import torch
from ds_worker import batch, make_engine
import tiercel, tiercel.deepspeed

cfg = json.loads(sys.argv[1])
def train(engine, steps):
    for step in range(1, steps + 1):
        x, y = batch(step, 0, torch.float32)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}
plain = train(make_engine(1, False), 3)
engine = make_engine(1, False)
store = tiercel.Store({"tier": [{"name": "ram", "kind": "memory", "root": cfg["shm"]}]})
store.traffic.record()
tiercel.deepspeed.interleave(engine, store)
hooked = train(engine, 3)
kinds = [e[1] for e in store.traffic.timeline()]
try:
    tiercel.deepspeed.interleave(engine.module, store)
    wrong = None
except tiercel.InvalidArgumentError as e:
    wrong = str(e)
out = {"same": all(torch.equal(plain[k], hooked[k]) for k in plain), "iterations": kinds.count("iteration"),
       "busy": kinds.count("busy"), "idle": kinds.count("idle"), "still_busy": store.traffic.stats()["busy"], "wrong": wrong}
store.close()
print("RESULT " + json.dumps(out))
"""


def test_deepspeed_engine_signals_around_backward_and_step(tmp_path, shm_root):
    from test_deepspeed import ds_env  # skips without deepspeed

    env = child_env({**ds_env(0), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    p = subprocess.run([PYTHON, "-c", DEEPSPEED, json.dumps({"shm": str(shm_root)})], capture_output=True, text=True,
                       env=env, timeout=300, cwd=str(Path(__file__).parent))
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, p.stdout[-3000:] + p.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["same"], "training with the signals differs from without"
    # Each of 3 steps: one iteration mark, backward and step each busy once.
    assert (out["iterations"], out["busy"], out["idle"], out["still_busy"]) == (3, 6, 6, False), out
    assert "deepspeed.initialize" in out["wrong"]
