"""One rank of a small DeepSpeed job on the CPU (gloo), for tests/test_deepspeed.py.

    python ds_worker.py '<json config>'

Config keys: stage, bf16, steps (train up to this global step), mode ("plain": no tiercel,
no saves; "tiercel": attach and save every step; "stock": stock DeepSpeed loads
`load_dir` and saves it again to `save_dir`), policy ("{host}" in it becomes
$TIERCEL_HOST), save_dir, load_dir, resume (load first), kill_after/victim (that rank
SIGKILLs itself right after saving that step), snapshot_delay (seconds each save's background
snapshot sleeps before it copies: the next optimizer step must wait for it), model_file (save_16bit_model before the last
checkpoint), mirror (attach with mirror=True: DeepSpeed's files under save_dir too),
mirror_kill/victim (that rank SIGKILLs itself on the mirror thread, right after it wrote
the first file of that step's save into the staging folder), mirror_lag (the mirror reads
step 1 only once retention removed it), script_kill/victim (that rank SIGKILLs itself as soon as
a zero_to_fp32.py under save_dir is opened for writing at that step's save: the moment its
bytes are being copied), resave_rank0 (after the last step, one more update,
then rank 0 alone saves the last step's tag again; with resume and steps = the loaded step: a
relaunch redoing it), out (a directory for this rank's report and state dumps).

The model, the data of each step and every seed are functions of the step and rank only, so
that any run that reaches a step in the same state computes the same losses bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

MODEL = (16, 64, 4)  # a few KB of parameters


def ds_config(stage: int, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 3}},
        "steps_per_print": 10**6,
    }


def make_engine(stage: int, bf16: bool):
    import deepspeed

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(MODEL[0], MODEL[1]), torch.nn.LayerNorm(MODEL[1]), torch.nn.ReLU(),
                                torch.nn.Linear(MODEL[1], MODEL[2]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, bf16))
    return engine


def batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(4, MODEL[0], generator=g).to(dtype), torch.randn(4, MODEL[2], generator=g).to(dtype)


def live_state(engine) -> dict:
    """What must come back bit for bit: parameters, optimizer and scheduler state, counters."""
    return {
        "module": engine.module.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
    }


def _saved_here(engine) -> bool:
    """Whether this process saved a checkpoint (a job that only loads and redoes a save on
    rank 0 has not, on the other ranks)."""
    ce = engine.checkpoint_engine
    ce.finish_snapshot()
    return ce.last_handle is not None


def resave_on_rank0(engine, cfg: dict, rank: int, dtype: torch.dtype) -> None:
    """One more update on every rank (no save), then rank 0 alone saves the last step's tag
    again, with the newer state, and waits until its part is persisted: the step's save now
    differs between the ranks (rank 0's RAM and disk: the new one; rank 1's RAM: the old).
    As a relaunched job that redoes a step would, when rank 1 dies before its save."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    step = cfg["steps"] + 1
    x, y = (t.to(engine.device) for t in batch(step, rank, dtype))
    engine.backward(((engine(x).float() - y.float()) ** 2).mean())
    engine.step()
    if rank == 0:
        # What save_checkpoint does on one rank, without its collectives (barriers, the tag
        # check): the engine's create, DeepSpeed's own files, commit.
        ce, tag = engine.checkpoint_engine, f"global_step{cfg['steps']}"
        info = CheckpointCommitInfo(tag=tag, save_dir=cfg["save_dir"], save_latest=True)
        ce.create(info)
        engine._save_checkpoint(cfg["save_dir"], tag, client_state={"data_step": step})
        if engine.save_zero_checkpoint:
            engine._save_zero_checkpoint(cfg["save_dir"], tag)
        ce.commit(info)
        ce.wait(60)
        ce.store.flush(60)
    torch.distributed.barrier()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    out = cfg["out"]
    os.makedirs(out, exist_ok=True)
    engine = make_engine(cfg["stage"], cfg.get("bf16", False))
    dtype = torch.bfloat16 if cfg.get("bf16") else torch.float32
    report: dict = {"rank": rank, "losses": {}}
    if cfg["mode"] == "tiercel":
        import tiercel.deepspeed

        # One memory root per simulated host: "{host}" in the policy is this rank's host.
        policy = json.loads(json.dumps(cfg["policy"]).replace("{host}", os.environ.get("TIERCEL_HOST", "")))
        assert tiercel.deepspeed.attach(engine, policy, mirror=cfg.get("mirror")) is engine
        if cfg.get("mirror_lag"):
            import time

            import tiercel.deepspeed.mirror as mirror
            from tiercel.step import Reader

            write_rank = mirror.Mirror._write_rank

            def lagging(self, snapshot, save, files, save_id):  # type: ignore[no-untyped-def]
                # The mirror falls behind: it reads step 1 only once retention removed it.
                deadline = time.monotonic() + 60
                while snapshot.step == 1 and time.monotonic() < deadline:
                    try:
                        Reader(self.store, 1, trust_pickles=True)
                    except tiercel.NotFoundError:
                        break
                    time.sleep(0.05)
                return write_rank(self, snapshot, save, files, save_id)

            mirror.Mirror._write_rank = lagging  # type: ignore[method-assign]
        if cfg.get("mirror_kill") and rank == cfg.get("victim"):
            import tiercel.deepspeed.mirror as mirror

            write_file = mirror.write_file
            marker = f"-{cfg['mirror_kill']:06d}{os.sep}"  # the save id of that step's save

            def write_then_die(value, dest):  # type: ignore[no-untyped-def]
                write_file(value, dest)
                if marker in dest:
                    os.kill(os.getpid(), signal.SIGKILL)  # one file of the tag written, the rest not

            mirror.write_file = write_then_die
        if cfg.get("script_kill") and rank == cfg.get("victim"):
            import builtins

            real_open = builtins.open
            save_dir = os.path.realpath(cfg["save_dir"])

            def open_then_die(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
                f = real_open(file, mode, *args, **kwargs)
                if ("w" in mode and isinstance(file, (str, os.PathLike)) and engine.global_steps == cfg["script_kill"]
                        and os.path.basename(os.fspath(file)).endswith("zero_to_fp32.py")
                        and os.path.realpath(os.fspath(file)).startswith(save_dir + os.sep)):
                    os.kill(os.getpid(), signal.SIGKILL)  # opened (truncated, if in place), not written
                return f

            builtins.open = open_then_die
        if cfg.get("snapshot_delay"):
            import time

            from tiercel.step import Writer

            write = Writer.write

            def slow_write(self, prepared, delay=cfg["snapshot_delay"]):  # type: ignore[no-untyped-def]
                if prepared is not None:
                    time.sleep(delay)  # on the snapshot thread, once per file
                return write(self, prepared)

            Writer.write = slow_write  # type: ignore[method-assign]
    start = 0
    if cfg.get("resume") or cfg["mode"] == "stock":
        path, client = engine.load_checkpoint(cfg.get("load_dir") or cfg["save_dir"])
        start = engine.global_steps
        client_state = {"data_step": client["data_step"], "keys": sorted(client)} if client else client
        if client and "ema" in client:
            client_state["ema"] = client["ema"].tolist()
        report["loaded"] = {"path": path, "client_state": client_state, "global_steps": start}
        ce = engine.checkpoint_engine
        if getattr(ce, "last_load", None) is not None:
            report["loaded"]["tiers"] = ce.last_load.tiers
        torch.save(live_state(engine), os.path.join(out, f"loaded-{rank}.pt"))
    if cfg["mode"] == "stock":
        engine.save_checkpoint(cfg["save_dir"])
    for step in range(start + 1, cfg["steps"] + 1):
        x, y = (t.to(engine.device) for t in batch(step, rank, dtype))
        loss = ((engine(x).float() - y.float()) ** 2).mean()
        engine.backward(loss)
        engine.step()
        report["losses"][step] = loss.item().hex()
        if cfg["mode"] == "tiercel":
            if cfg.get("model_file") and step == cfg["steps"]:
                # As HF's Trainer does under ZeRO-3: the 16-bit model, then the checkpoint.
                engine.save_16bit_model(cfg["save_dir"])
            client_state: dict = {"data_step": step}
            if cfg.get("snapshot_delay"):
                # A tensor of the job's own, changed in place right after the save (as an EMA
                # would be): the save must have copied it while it blocked.
                client_state["ema"] = ema = torch.full((8,), float(step))
            engine.save_checkpoint(cfg["save_dir"], tag=f"global_step{step}", client_state=client_state)
            if cfg.get("snapshot_delay"):
                ema.fill_(-1.0)
                report["copied_bytes"] = engine.checkpoint_engine.last_copied_bytes
            if cfg.get("kill_after") == step and rank == cfg.get("victim"):
                os.kill(os.getpid(), signal.SIGKILL)  # right after the save returned
    if cfg.get("resave_rank0"):
        resave_on_rank0(engine, cfg, rank, dtype)
    saved_here = cfg["mode"] == "tiercel" and _saved_here(engine)
    if saved_here:
        report["states"] = engine.checkpoint_engine.wait(60)
        gate = engine.checkpoint_engine.gate
        report["stalls"] = {"count": gate.stalls, "seconds": gate.stall_seconds}
        report["stall_timing"] = engine.checkpoint_engine.store.metrics().timings["deepspeed_stall"]
    torch.save(live_state(engine), os.path.join(out, f"final-{rank}.pt"))
    with open(os.path.join(out, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    if saved_here:
        engine.checkpoint_engine.wait(60)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    # DeepSpeed's CPU shared-memory comm op leaves C++ threads that, torn down by the
    # interpreter's exit, now and then end the process in std::terminate (exit -6) after all
    # its work is done and reported; leave without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
