"""One process of a real JAX job (CPU devices) that checkpoints through Orbax's
CheckpointManager with tiercel.orbax's handler; started by tests/test_orbax.py.

    python orbax_worker.py '{"phase": ..., "pid": 0, "nproc": 2, "ndev": 2, "port": ..., ...}'

Each phase writes a JSON report to <out>/<phase>-<pid>.json; an assertion failure exits 1
with the traceback in the log."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tiercel
import tiercel.orbax
from tiercel.leaves import Leaf, LeafHandler, register

from orbax_state import COLS, ROWS, global_values

#: This process's part: phase, pid, nproc, ndev, port, out, policy, dir, ... (see main).
CFG: dict[str, Any] = {}


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def shardings(m: Mesh, w_spec: P, b_spec: P) -> dict[str, NamedSharding]:
    return {"w": NamedSharding(m, w_spec), "b": NamedSharding(m, b_spec), "scale": NamedSharding(m, P())}


def train_state(step: int, sh: dict[str, NamedSharding]) -> dict[str, Any]:
    """A fully sharded matrix, a replicated vector, a scalar (0-d array) and an int step."""
    g = global_values(step)
    arrays = {k: jax.make_array_from_callback(np.shape(g[k]), sh[k], lambda idx, k=k: np.asarray(g[k])[idx]) for k in sh}
    return {"params": {"w": arrays["w"], "b": arrays["b"]}, "scale": arrays["scale"], "step": step}


def abstract(sh: dict[str, NamedSharding]) -> dict[str, Any]:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, train_state(0, sh))


def check(restored: dict[str, Any], step: int, sh: dict[str, NamedSharding]) -> None:
    """Every addressable shard equals the saved global array there, in the target sharding."""
    g = global_values(step)
    got = {"w": restored["params"]["w"], "b": restored["params"]["b"], "scale": restored["scale"]}
    for k, x in got.items():
        assert isinstance(x, jax.Array), (k, type(x))
        assert x.sharding.is_equivalent_to(sh[k], x.ndim), (k, x.sharding, sh[k])
        assert x.dtype == np.float32 and x.shape == np.shape(g[k]), (k, x.dtype, x.shape)
        for s in x.addressable_shards:
            want = np.asarray(g[k])[s.index]
            assert np.asarray(s.data).tobytes() == want.tobytes(), (k, s.index)
    assert restored["step"] == step and type(restored["step"]) is int, restored["step"]


def manager(handler: tiercel.orbax.TiercelCheckpointHandler, directory: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("state", tiercel.orbax.Save, handler)
    reg.add("state", tiercel.orbax.Restore, handler)
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep), handler_registry=reg)


def restore(mngr: ocp.CheckpointManager, step: int, target: Any) -> Any:
    return mngr.restore(step, args=ocp.args.Composite(state=tiercel.orbax.Restore(target)))["state"]


class Crash:
    """A leaf whose copy kills the process: a crash in the middle of a save."""


class CrashHandler(LeafHandler):
    framework = "crash-test"

    def claims(self, value: Any) -> bool:
        return isinstance(value, Crash)

    def describe(self, value: Any, name: str) -> Leaf:
        return Leaf(name, "bytes", "uint8", (4096,), 4096, {"framework": self.framework}, value, handler=self)

    def host_address(self, leaf: Leaf) -> None:
        return None

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class Gate:
    """A leaf whose copy waits until the test opens it: holds a save's background half open
    while the training step runs (the same gate in every copy the save takes)."""

    def __init__(self) -> None:
        import threading

        self.open = threading.Event()
        self.reached = threading.Event()

    def __deepcopy__(self, memo: dict) -> Gate:
        return self


class GateHandler(LeafHandler):
    framework = "gate-test"

    def claims(self, value: Any) -> bool:
        return isinstance(value, Gate)

    def describe(self, value: Any, name: str) -> Leaf:
        return Leaf(name, "bytes", "uint8", (8,), 8, {"framework": self.framework}, value, handler=self)

    def host_address(self, leaf: Leaf) -> None:
        return None

    def copy_into(self, leaf: Leaf, segment: Any, offset: int) -> None:
        leaf.obj.reached.set()
        assert leaf.obj.open.wait(60), "the test never opened the gate"
        memoryview(segment)[offset:offset + 8] = b"gate-ok!"

    def rebuild(self, item: Any, buf: Any) -> Any:
        return bytes(buf)


def report(phase: str, data: dict[str, Any]) -> None:
    with open(os.path.join(CFG["out"], f"{phase}-{CFG['pid']}.json"), "w") as f:
        json.dump(data, f)


# -- phases ------------------------------------------------------------------------------------


def save_phase() -> None:
    """Saves steps 1..4 (max_to_keep=3), waits for every tier, then crashes in step 5."""
    sh = shardings(mesh((2, 2), ("x", "y")), P("x", "y"), P())
    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr = manager(handler, CFG["dir"])
    states = {}
    for step in range(1, CFG.get("steps", 4) + 1):
        assert mngr.save(step, args=ocp.args.Composite(state=tiercel.orbax.Save(train_state(step, sh))))
        mngr.wait_until_finished()
        # The future completed once the memory tier had the step; the rest goes on behind.
        assert handler.last_save is not None
        states[step] = handler.last_save.wait(120)
    handler.store.flush()
    handler.store.coordinator.all_gather("flushed")  # every rank's part is in: steps are final
    report("save", {"all_steps": list(mngr.all_steps()), "states": states, "steps": handler.store.steps(),
                    "blocking": handler.last_save.blocking_seconds})
    # Every peer server must stay up until everyone's replicas are in.
    handler.store.coordinator.all_gather("saved")
    if CFG.get("crash"):
        # Process 0 (which also writes the non-array leaves) dies while copying step 5.
        register(CrashHandler())
        state = train_state(5, sh)
        state["crash"] = Crash()
        mngr.save(5, args=ocp.args.Composite(state=tiercel.orbax.Save(state)))
        mngr.wait_until_finished()
        raise AssertionError("step 5 should not have finished")
    os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown: what a crashed job leaves


def restore_phase() -> None:
    """After a restart: steps listed, restores into the same and into another sharding."""
    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr = manager(handler, CFG["dir"])
    out: dict[str, Any] = {"all_steps": list(mngr.all_steps()), "latest": mngr.latest_step(), "tiers": {}}
    same = shardings(mesh((2, 2), ("x", "y")), P("x", "y"), P())
    step = mngr.latest_step()
    check(restore(mngr, step, abstract(same)), step, same)
    out["tiers"]["same"] = handler.last_restore.tiers
    out["nbytes"] = {"same": handler.last_restore.nbytes}
    other = shardings(mesh((4,), ("z",)), P("z", None), P("z"))  # row quarters instead of blocks
    check(restore(mngr, step, abstract(other)), step, other)
    out["tiers"]["other"] = handler.last_restore.tiers
    out["nbytes"]["other"] = handler.last_restore.nbytes
    for s in CFG.get("also", []):  # older steps, e.g. one the memory tier evicted
        check(restore(mngr, s, abstract(same)), s, same)
        out["tiers"][str(s)] = handler.last_restore.tiers
    # Without a target, as Orbax: every array in the sharding it was saved with.
    check(restore(mngr, step, None), step, same)
    out["dropped"] = tiercel.orbax.sync(mngr, handler)
    report("restore", out)
    mngr.close()
    jax.distributed.shutdown()


def single_phase() -> None:
    """1 process x 4 devices restores the 2-process checkpoint, with and without a target;
    a corrupted shard in RAM comes from disk; after RAM is lost, sync() drops what is gone."""
    from conftest import flip_byte, read_manifest, step_dir

    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr = manager(handler, CFG["dir"])
    out: dict[str, Any] = {"all_steps": list(mngr.all_steps()), "latest": mngr.latest_step()}
    step = mngr.latest_step()
    sh = shardings(mesh((4,), ("a",)), P(None, "a"), P("a"))  # column quarters: strided ranges of each block
    check(restore(mngr, step, abstract(sh)), step, sh)
    out["c"] = handler.last_restore.tiers

    # Without a target, as Orbax: the saved shardings, which name the 2-process job's devices
    # (ids 0, 1, 2048, 2049): Orbax's "Topology mismatch detected", naming the leaf ...
    try:
        restore(mngr, step, None)
        raise AssertionError("a target-less restore on other devices than the save's must fail")
    except ValueError as e:
        out["no_target_error"] = str(e)
    # ... unless a fallback sharding says where to put the arrays.
    fallback = NamedSharding(mesh((4,), ("a",)), P())
    plain = mngr.restore(step, args=ocp.args.Composite(state=tiercel.orbax.Restore(fallback_sharding=fallback)))["state"]
    g = global_values(step)
    assert plain["params"]["w"].sharding == fallback and np.asarray(plain["params"]["w"]).tobytes() == g["w"].tobytes()
    assert np.asarray(plain["params"]["b"]).tobytes() == g["b"].tobytes()
    assert np.asarray(plain["scale"]).tobytes() == g["scale"].tobytes() and plain["step"] == step
    meta = mngr.item_metadata(step)["state"]
    assert meta["params"]["w"].shape == (ROWS, COLS) and meta["params"]["w"].dtype == np.float32, meta

    # Flip a byte of one of rank 1's shards in RAM: that chunk is read from disk instead.
    ram = CFG["policy"]["tier"][0]["root"]
    m = read_manifest(ram, step, rank=1)
    it = next(i for i in m["items"] if (i.get("meta") or {}).get("framework") == "jax")
    chunk = it["chunks"][0]
    flip_byte(step_dir(ram, step) / m["objects"][chunk["object"]]["name"], chunk["stored_offset"] + 5)
    check(restore(mngr, step, abstract(sh)), step, sh)
    out["corrupt"] = {"tiers": handler.last_restore.tiers, "warnings": handler.last_restore.warnings}

    export_dir = os.path.join(CFG["out"], "exported")
    tiercel.orbax.export(handler.store, step, export_dir)
    out["exported"] = export_dir

    # The host's RAM is lost (a reboot): what only RAM held is gone.
    import shutil

    shutil.rmtree(ram)
    handler2 = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr2 = manager(handler2, CFG["dir"])
    try:
        restore(mngr2, 3, abstract(sh))
        raise AssertionError("step 3 lived only in RAM")
    except tiercel.NotFoundError as e:
        out["lost_error"] = str(e)
    out["dropped"] = tiercel.orbax.sync(mngr2, handler2)
    out["after_sync"] = list(mngr2.all_steps())
    check(restore(mngr2, mngr2.latest_step(), abstract(sh)), mngr2.latest_step(), sh)
    out["after_sync_tiers"] = handler2.last_restore.tiers
    report("single", out)
    mngr.close()
    mngr2.close()


def peer_restore_phase() -> None:
    """Two hosts, one of them wiped: it restores its shards from its peer's RAM."""
    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr = manager(handler, CFG["dir"])
    sh = shardings(mesh((2, 2), ("x", "y")), P("x", "y"), P())
    out = {"all_steps": list(mngr.all_steps()), "latest": mngr.latest_step()}
    check(restore(mngr, mngr.latest_step(), abstract(sh)), mngr.latest_step(), sh)
    out["tiers"] = handler.last_restore.tiers
    # Every peer server must stay up until everyone has restored.
    handler.store.coordinator.all_gather("restored")
    report("peer_restore", out)
    mngr.close()
    jax.distributed.shutdown()


def replicas_phase() -> None:
    """Two data-parallel replicas (one per process and host), each holding the whole state
    sharded over its own 2 devices: process 0 saves each shard once (replica 0) to the
    bucket. Then, for each of CFG["modes"], both hosts lose their RAM and restore from the
    bucket; the test counts what the bucket served in each."""
    sh = shardings(mesh((2, 2), ("data", "model")), P(None, "model"), P("model"))
    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policies"]["save"])
    mngr = manager(handler, CFG["dir"])
    assert mngr.save(1, args=ocp.args.Composite(state=tiercel.orbax.Save(train_state(1, sh))))
    mngr.wait_until_finished()
    out: dict[str, Any] = {"states": handler.last_save.wait(120), "modes": {}}
    handler.store.flush()
    handler.store.coordinator.all_gather("flushed")
    mngr.close()
    import shutil

    for mode in CFG["modes"]:
        root = CFG["policies"][mode]["tier"][0]["root"]
        for name in os.listdir(root):
            if name.startswith("step-"):
                shutil.rmtree(os.path.join(root, name))
        h = tiercel.orbax.TiercelCheckpointHandler(CFG["policies"][mode])
        m = manager(h, CFG["dir"])
        h.store.coordinator.all_gather(f"wiped for {mode}")
        check(restore(m, 1, abstract(sh)), 1, sh)
        info = h.last_restore
        out["modes"][mode] = {"tiers": info.tiers, "broadcast": info.broadcast, "nbytes": info.nbytes}
        h.store.coordinator.all_gather(f"restored {mode}")  # every relay stays up until all are done
        m.close()
    report("replicas", out)
    jax.distributed.shutdown()


def resave(policy: dict, directory: str) -> dict:
    """A step Orbax deleted is saved again with other values (training went back): the new
    values come back from every tier, not the stale ones. Run through conftest.run_isolated."""
    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    mngr = manager(handler, directory)
    for value in (1.0, 2.0):
        mngr.save(4, args=ocp.args.Composite(state=tiercel.orbax.Save({"x": jnp.full((1000,), value)})))
        mngr.wait_until_finished()
        handler.last_save.wait()
        if value == 1.0:
            mngr.delete(4)
    got = {}
    for tier in [t["name"] for t in policy["tier"]]:
        h = tiercel.orbax.TiercelCheckpointHandler({**policy, "restore": {"order": [tier]}})
        m = manager(h, directory)
        got[tier] = float(restore(m, 4, None)["x"][0])
        m.close()
    mngr.close()
    return got


def donated(policy: dict, directory: str) -> dict:
    """Each save is followed at once, while its background half still runs (held open by a
    Gate), by a jitted step that donates the saved arrays, an explicit `delete()` of them and
    an in-place change of a numpy leaf: every step restores bit-identical to what was saved.
    Run through conftest.run_isolated."""
    jax.config.update("jax_num_cpu_devices", 2)
    register(GateHandler())
    m = mesh((2,), ("x",))
    sh = {"w": NamedSharding(m, P("x")), "b": NamedSharding(m, P())}
    g = global_values(1)
    state: dict[str, Any] = {k: jax.make_array_from_callback(np.shape(g[k]), sh[k], lambda idx, k=k: g[k][idx]) for k in sh}
    state["np"] = np.arange(1000, dtype=np.float32)
    train = jax.jit(lambda s: {k: v * 1.5 + 1 for k, v in s.items()}, donate_argnums=0)
    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    mngr = manager(handler, directory)
    want, out = {}, {"pending_at_step": [], "donated": [], "deleted": []}
    for step in (1, 2, 3):
        want[step] = {k: np.asarray(v).copy() for k, v in state.items()}
        gate = Gate()
        mngr.save(step, args=ocp.args.Composite(state=tiercel.orbax.Save({**state, "gate": gate})))
        assert gate.reached.wait(60), "the background half never started"
        out["pending_at_step"].append(not gate.open.is_set())
        saved = {k: state[k] for k in sh}
        new = train(saved)  # donates the saved arrays (XLA copies instead while tiercel holds them)
        out["donated"].append(any(x.is_deleted() for x in saved.values()))
        if step == 2:
            for x in saved.values():
                x.delete()
            out["deleted"].append(all(x.is_deleted() for x in saved.values()))
        del saved
        state = {**new, "np": state["np"]}
        state["np"] += 1  # in place: the save took its own copy
        for _ in range(3):  # more steps, more buffers: a freed buffer would be reused here
            state = {**train({k: state[k] for k in sh}), "np": state["np"]}
        jax.block_until_ready(state)
        gate.open.set()
        mngr.wait_until_finished()
    target = {k: ocp.utils.to_shape_dtype_struct(v) for k, v in state.items() if k in sh}
    target["np"] = jax.ShapeDtypeStruct((1000,), np.float32)
    out["identical"] = []
    for step in (1, 2, 3):
        got = restore(mngr, step, target)
        out["identical"].append(all(np.asarray(got[k]).tobytes() == want[step][k].tobytes() for k in want[step]))
        plain = restore(mngr, step, None)
        out["identical"].append(plain["gate"] == b"gate-ok!")
    mngr.close()
    return out


def two_items(policy: dict, directory: str) -> dict:
    """One Orbax step of two items, each with a TiercelCheckpointHandler of the same policy,
    then of two items served by one handler: every item of every step restores, in this
    process and after the managers were closed and made again. A later save of a saved step
    with another item (a second manager) fails at once instead of replacing the step's other
    items. Run through conftest.run_isolated."""
    def values(step: int) -> dict[str, Any]:
        return {"params": {"w": jnp.full((64, 8), float(step)), "name": f"p{step}"},
                "opt": {"m": np.full((100,), step, dtype=np.int32), "count": step}}

    def mngr_of(handlers: dict[str, Any], where: str) -> ocp.CheckpointManager:
        reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, h in handlers.items():
            reg.add(item, tiercel.orbax.Save, h)
            reg.add(item, tiercel.orbax.Restore, h)
        return ocp.CheckpointManager(os.path.join(directory, where), handler_registry=reg,
                                     options=ocp.CheckpointManagerOptions(max_to_keep=5))

    def restored(mngr: ocp.CheckpointManager, step: int) -> list[Any]:
        got = mngr.restore(step, args=ocp.args.Composite(params=tiercel.orbax.Restore(), opt=tiercel.orbax.Restore()))
        return [float(np.asarray(got["params"]["w"]).min()), float(np.asarray(got["params"]["w"]).max()),
                got["params"]["name"], np.asarray(got["opt"]["m"]).tolist() == [step] * 100, int(got["opt"]["count"])]

    out: dict[str, Any] = {}
    for case, make in (("two_handlers", lambda: {"params": tiercel.orbax.TiercelCheckpointHandler(policy),
                                                  "opt": tiercel.orbax.TiercelCheckpointHandler(policy)}),
                       ("one_handler", lambda: dict.fromkeys(("params", "opt"), tiercel.orbax.TiercelCheckpointHandler(policy)))):
        base = 10 if case == "one_handler" else 0
        mngr = mngr_of(make(), case)
        for step in (base + 1, base + 2):
            v = values(step)
            mngr.save(step, args=ocp.args.Composite(params=tiercel.orbax.Save(v["params"]), opt=tiercel.orbax.Save(v["opt"])))
        mngr.wait_until_finished()
        out[case] = {"steps": list(mngr.all_steps()), "now": [restored(mngr, s) for s in (base + 1, base + 2)]}
        mngr.close()
        again = mngr_of(make(), case)
        out[case]["reopened"] = [restored(again, s) for s in (base + 1, base + 2)]
        again.close()
    # Another manager of the same policy saves step 2 again with an item step 2 does not have.
    other = mngr_of({"extra": tiercel.orbax.TiercelCheckpointHandler(policy)}, "other")
    try:
        other.save(2, args=ocp.args.Composite(extra=tiercel.orbax.Save({"x": np.zeros(3)})))
        other.wait_until_finished()
        out["clash"] = "saved"
    except Exception as e:  # noqa: BLE001 - the report says what it was
        out["clash"] = f"{type(e).__name__}: {e}"
    try:
        other.close()
    except Exception:  # noqa: BLE001, S110 - the failed save may be reported again here
        pass
    check = mngr_of({"params": tiercel.orbax.TiercelCheckpointHandler(policy),
                     "opt": tiercel.orbax.TiercelCheckpointHandler(policy)}, "two_handlers")
    out["after_clash"] = restored(check, 2)
    check.close()
    return out


def refused_save(policy: dict, directory: str, delay: float) -> dict:
    """A save that tiercel refuses (an item that a step this process saved does not have),
    while Orbax creates the step's directories slowly (`delay` s more, as on a loaded
    machine), and its manager closed right after, as two_items does: the errors Orbax logged
    and the threads of Orbax's still running once that creation is over. Run through
    conftest.run_isolated."""
    import logging
    import threading
    import time

    # Where Orbax's async save creates a step's temporary directory, in a thread of its own
    # (internal to Orbax: this fails loudly if it moves).
    from orbax.checkpoint._src.path import atomicity

    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage()[:300])

    logging.getLogger().addHandler(Errors(logging.ERROR))
    first = manager(tiercel.orbax.TiercelCheckpointHandler(policy), os.path.join(directory, "first"))
    first.save(1, args=ocp.args.Composite(state=tiercel.orbax.Save({"x": np.ones(3)})))
    first.wait_until_finished()
    first.close()

    create = atomicity._create_tmp_directory

    async def slowly(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(delay)
        return await create(*args, **kwargs)

    atomicity._create_tmp_directory = slowly
    other = mngr_of_item("extra", policy, os.path.join(directory, "other"))
    out: dict[str, Any] = {}
    try:
        other.save(1, args=ocp.args.Composite(extra=tiercel.orbax.Save({"x": np.zeros(3)})))
        other.wait_until_finished()
        out["clash"] = "saved"
    except Exception as e:  # noqa: BLE001 - the report says what it was
        out["clash"] = f"{type(e).__name__}: {e}"
    other.close()
    time.sleep(delay + 1.0)  # the slowed creation, had nothing waited for it, is over by now
    atomicity._create_tmp_directory = create
    out["orbax_errors"] = errors
    out["orbax_threads"] = [t.name for t in threading.enumerate() if type(t).__module__.startswith("orbax") and t.is_alive()]
    if out["orbax_threads"]:
        # One waits for a directory signal that never comes, for Orbax's 300 s, and the
        # interpreter's exit would wait for it: report and leave now.
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)
    return out


def mngr_of_item(item: str, policy: dict, directory: str) -> ocp.CheckpointManager:
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    reg.add(item, tiercel.orbax.Save, handler)
    reg.add(item, tiercel.orbax.Restore, handler)
    return ocp.CheckpointManager(directory, handler_registry=reg)


def leaf_kinds(policy: dict, directory: str) -> dict:
    """A single process (one CPU device): every kind of leaf through CheckpointManager and
    back, with and without a target. Run through conftest.run_isolated."""
    import ml_dtypes

    state = {
        "jax": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "py": [1, 2.5, True, "text", None],
        "nested": ({"a": jnp.float32(3.0)}, [np.uint8(7)]),
    }
    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    mngr = manager(handler, directory)
    mngr.save(7, args=ocp.args.Composite(state=tiercel.orbax.Save(state)))
    mngr.wait_until_finished()
    plain = restore(mngr, 7, None)
    target = jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "shape") else x, state)
    typed = restore(mngr, 7, target)
    # A target naming one leaf, in another dtype: just that leaf, cast.
    part = restore(mngr, 7, {"np": jax.ShapeDtypeStruct((2, 3), np.float32)})
    try:
        restore(mngr, 7, {"np": jax.ShapeDtypeStruct((3, 2), np.int16)})
        raise AssertionError("a target of another shape must be refused")
    except tiercel.InvalidArgumentError as e:
        shape_error = str(e)
    # Orbax's plain Checkpointer (no manager): a directory that names no step, so Save names it.
    plain_dir = os.path.join(directory, "plain")
    with ocp.Checkpointer(tiercel.orbax.TiercelCheckpointHandler(policy)) as ckptr:
        ckptr.save(plain_dir, args=tiercel.orbax.Save({"v": np.arange(3)}, step=100))
        by_marker = ckptr.restore(plain_dir, args=tiercel.orbax.Restore())  # the marker names the step
    try:
        tiercel.orbax.export(handler.store, 7, os.path.join(directory, "exported"))
        raise AssertionError("Orbax cannot store the empty array")
    except tiercel.InvalidArgumentError as e:
        export_error = str(e)
    del state["empty"]
    mngr.save(8, args=ocp.args.Composite(state=tiercel.orbax.Save(state)))
    mngr.wait_until_finished()
    exported = tiercel.orbax.export(handler.store, 8, os.path.join(directory, "exported"))
    plain_orbax = ocp.StandardCheckpointer().restore(exported)
    mngr.close()
    return {
        "plain_jax": [str(plain["jax"].dtype), plain["jax"].tolist() == np.arange(12).reshape(3, 4).tolist()],
        "plain_np": [type(plain["np"]).__name__, str(plain["np"].dtype), plain["np"].tolist()],
        "plain_np_scalar": [type(plain["np_scalar"]).__name__, float(plain["np_scalar"])],
        "plain_empty": list(plain["empty"].shape),
        "plain_py": plain["py"],
        "plain_nested": [float(plain["nested"][0]["a"]), int(plain["nested"][1][0])],
        "typed_jax": [type(typed["jax"]).__name__, typed["jax"].dtype == ml_dtypes.bfloat16,
                      np.asarray(typed["jax"]).astype(np.float32).tolist() == np.arange(12).reshape(3, 4).tolist()],
        "typed_tuple": type(typed["nested"]).__name__,
        "typed_py": typed["py"],
        "export_error": export_error,
        "checkpointer": by_marker["v"].tolist(),
        "part": [sorted(part), str(part["np"].dtype), part["np"].tolist()],
        "shape_error": shape_error,
        "exported": [plain_orbax["py"], float(plain_orbax["np_scalar"]), np.asarray(plain_orbax["np"]).tolist(),
                     np.asarray(plain_orbax["jax"]).astype(np.float32).ravel().tolist()],
    }


def elastic_values(step: int) -> dict[str, np.ndarray]:
    """The state of the elastic phases: rows that 3 and 2 processes (x 2 devices) divide."""
    w = (np.arange(384 * 256, dtype=np.float32).reshape(384, 256) + 1000.0 * step) / 7.0
    return {"w": w, "b": np.arange(256, dtype=np.float32) * step - 0.5}


def elastic_state(step: int, m: Mesh) -> dict[str, Any]:
    sh = {"w": NamedSharding(m, P("x", "y")), "b": NamedSharding(m, P())}
    g = elastic_values(step)
    return {k: jax.make_array_from_callback(g[k].shape, sh[k], lambda idx, k=k: g[k][idx]) for k in sh}


def elastic_save_phase() -> None:
    """3 processes (hosts) x 2 devices save one step on a (3, 2) mesh, wait for every tier,
    then all die."""
    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr = manager(handler, CFG["dir"])
    assert mngr.save(1, args=ocp.args.Composite(state=tiercel.orbax.Save(elastic_state(1, mesh((3, 2), ("x", "y"))))))
    mngr.wait_until_finished()
    assert handler.last_save is not None
    states = handler.last_save.wait(120, commit=True)
    handler.store.flush()
    handler.store.coordinator.all_gather("flushed")
    report("elastic_save", {"states": states})
    handler.store.coordinator.all_gather("saved")  # every peer server up until all replicas are in
    os.kill(os.getpid(), signal.SIGKILL)


def elastic_restore_phase() -> None:
    """2 processes (a host fewer) x 2 devices restore that step on a (2, 2) mesh: each
    addressable shard bit-identical; the bytes read per tier reported."""
    handler = tiercel.orbax.TiercelCheckpointHandler(CFG["policy"])
    mngr = manager(handler, CFG["dir"])
    m = mesh((2, 2), ("x", "y"))
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, elastic_state(0, m))
    restored = restore(mngr, 1, target)
    g = elastic_values(1)
    for k, x in restored.items():
        assert x.sharding.is_equivalent_to(target[k].sharding, x.ndim), (k, x.sharding)
        for s in x.addressable_shards:
            assert np.asarray(s.data).tobytes() == g[k][s.index].tobytes(), (k, s.index)
    out = {"tiers": handler.last_restore.tiers,
           "bytes_read": {t: v["bytes_read"] or 0 for t, v in handler.store.metrics().items()}}
    handler.store.coordinator.all_gather("restored")  # every peer server up until all have read
    report("elastic_restore", out)
    mngr.close()
    jax.distributed.shutdown()


def main() -> None:
    CFG.update(json.loads(sys.argv[1]))
    if CFG.get("failpoint"):  # read by the core at its first use
        os.environ["TIERCEL_FAILPOINT"] = CFG["failpoint"]
    # Before anything touches a device: CPU devices, then the job.
    jax.config.update("jax_num_cpu_devices", CFG["ndev"])
    if CFG["nproc"] > 1:
        jax.distributed.initialize(f"127.0.0.1:{CFG['port']}", num_processes=CFG["nproc"], process_id=CFG["pid"])
    if CFG.get("host"):
        os.environ["TIERCEL_HOST"] = CFG["host"]
    {"save": save_phase, "restore": restore_phase, "single": single_phase, "peer_restore": peer_restore_phase,
     "replicas": replicas_phase, "elastic_save": elastic_save_phase,
     "elastic_restore": elastic_restore_phase}[CFG["phase"]]()


if __name__ == "__main__":
    main()
