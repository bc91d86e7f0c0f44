"""The Python face of a Store: one per training process (rank). Opens the core from a
policy, joins the job's other ranks through the coordinator, and hands out writers and
readers of steps (tiercel.step)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import _core, environment, members
from .advertise import advertised_address, is_loopback
from .coordinator import Coordinator, barrier, default_coordinator
from .coordinator import counter as coordinator_counter
from .errors import IntegrityError, InvalidArgumentError, NotFoundError, TiercelError
from .metrics import Metrics
from .newest import Need, agree, check_world_size, combined, world_size_error
from .preempt import PreemptReport
from .preempt import install as install_preemption
from .preempt import preempt as run_preempt
from .replicas import Sharing, replica_group_of, share_replicated
from .reshard import Want, check_want
from .reshard import read as read_resharded
from .step import Reader, RestoreInfo, SaveHandle, Writer
from .traffic import Traffic

PolicyLike = str | os.PathLike | Mapping[str, Any]

log = logging.getLogger("tiercel")


class Steps(dict[str, list[int]]):
    """`Store.steps()`: committed steps per tier that could be listed; `errors` maps each tier
    that could not to why."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[str, str] = {}


def _policy_path(policy: PolicyLike | None) -> PolicyLike:
    if policy is not None:
        return policy
    return os.environ.get("TIERCEL_POLICY", "tiercel.toml")


class Store:
    """One per training process (rank): saves steps into the tiers of a policy and restores
    them from the fastest tier that still has them.

    `policy` is a TOML file path or a dict of the same shape. rank/world_size default to
    torch.distributed's, else $RANK/$WORLD_SIZE, else a single process. `tool=True` opens it
    for tools that look at the tiers as they are (every job's steps count; the CLI does).
    `replica_group`: which ranks hold identical copies of this rank's replicated puts
    (`put(..., replicated=True)`): this rank's group as a list of ranks, or every group as a
    list of lists; default all ranks (pure data parallelism).
    """

    def __init__(
        self,
        policy: PolicyLike | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        coordinator: Coordinator | None = None,
        tool: bool = False,
        replica_group: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ):
        if coordinator is not None:
            rank, world_size = coordinator.rank, coordinator.world_size
        else:
            coordinator, rank, world_size = default_coordinator(rank, world_size)
        self.coordinator = coordinator
        policy = _policy_path(policy)
        # What the tiers hold (a missing bucket, other jobs' steps) costs requests at the
        # tiers' roots: with a coordinator rank 0 checks, and the members round hands its
        # answer to every rank (`_join_cluster`); alone, each rank checks as it opens.
        check = coordinator is None or world_size == 1
        if isinstance(policy, Mapping):
            self._core = _core.Store(rank, world_size, policy_json=json.dumps(policy), tool=tool, check=check)
        else:
            self._core = _core.Store(rank, world_size, path=str(Path(policy)), tool=tool, check=check)
        self.rank: int = rank
        self.world_size: int = world_size
        #: The training job's communication signals (`with store.traffic.training_comm():`).
        self.traffic = Traffic(self._core.traffic())
        #: The ranks that hold the same replicated data as this one (itself included), sorted.
        self.replica_group: list[int] = replica_group_of(replica_group, rank, world_size)
        #: This process's host, the failure domain: $TIERCEL_HOST, else $SLURMD_NODENAME, else
        #: the machine's name (tiercel.environment).
        self.host: str = environment.host()
        #: Every rank's host, by rank: learned when the store joins its cluster, on rank 0
        #: only (the rank that plans for all, as DCP's coordinator); None on the others,
        #: which learn only their own host's ranks and their peers' (docs/scale.md).
        self.hosts: list[str] | None = [self.host] * world_size if self.rank == 0 else None
        self.last_restore: RestoreInfo | None = None
        #: What a restore shared with the replica group leaves for the next (tiercel.replicas).
        self._sharing = Sharing()
        self._skipped: list[str] = []
        #: The save (generation) of the step the ranks last agreed on.
        self._save: str | None = None
        self._closed = False
        #: This launch of the job, the same on every rank (joining the cluster learns it):
        #: names the keys of a preemption's agreement (tiercel.preempt).
        self._launch: str | None = None
        self._join_cluster()
        if not tool:
            # The policy's `[preemption]` section: a signal handler that flushes (tiercel.preempt).
            install_preemption(self)

    def _join_cluster(self) -> None:
        """Learns which ranks share this host (its memory tier commits a step once they all
        have it) and, with a peer tier, the peer addresses of the hosts its placement pairs
        with this one. Collective when the job has several ranks: one round through the
        coordinator in which each rank receives its host's part (tiercel.members).

        The host name is the failure domain (`environment.host`). The
        peer secret comes from the policy or $TIERCEL_PEER_SECRET, else rank 0 makes one and
        hands it out over the coordinator (the job's own channel). The job id that peer
        connections carry is the store's run id when it has one, else rank 0 makes one."""
        # A job of one process has no peers to replicate to: its peer tier stays idle (as it
        # does for the CLI, which opens the store as a single process).
        if self.world_size == 1:
            self._core.set_launch(environment.launch_token())
            return
        has_peer = any(t["cluster"] for t in self._core.tiers())
        if self.coordinator is None:
            if has_peer:
                raise InvalidArgumentError(
                    "a peer tier needs a coordinator to exchange addresses: initialize torch.distributed "
                    "(or jax.distributed) before opening the Store, or pass coordinator="
                )
            return  # without one, all ranks are taken to share one host
        host = self.host
        addr = secret = job = None
        # This launch of the job: a save's generation names it (see `Store.set_launch`).
        launch = environment.launch_token() if self.rank == 0 else None
        if has_peer:
            listen = self._core.peer_address()
            assert listen is not None  # the policy has a peer tier
            addr = advertised_address(listen)
            if self.rank == 0:
                if not self._core.peer_has_secret():
                    secret = secrets.token_hex(32)
                job = getattr(self._core, "run_id", None) or secrets.token_hex(8)
        refused: Exception | None = None
        if self.rank == 0:
            try:
                self._core.check_open()
            except Exception as e:  # noqa: BLE001 -- every rank raises it, after the round
                refused = e
        # One round: each rank learns its own host's part only (tiercel.members).
        neighbours = self._core.peer_neighbours if has_peer else None
        entry = (host, addr, secret, job, launch, members.refusal(refused) if refused is not None else None)
        part = members.learn(self.coordinator, self.rank, entry, neighbours)
        if part.refused is not None:
            self._close(None, interrupted=False)
            raise refused if refused is not None else members.refused_error(part.refused)
        self.hosts = part.every_host
        self._core.set_local_ranks(part.local)
        self._core.set_launch(part.launch)
        self._launch = part.launch
        # Commits on shared tiers count ranks in through the coordinator (docs/scale.md, "Commit").
        self._core.set_counter(coordinator_counter(self.coordinator))
        if has_peer:
            if part.error is not None:
                raise InvalidArgumentError(f"rank {self.rank}: the peer tier's placement: {part.error}")
            others = [a for i, _, ranks in part.members if i != part.host_index for _, a in ranks]
            if addr is not None and is_loopback(addr) and any(not is_loopback(a) for a in others):
                raise InvalidArgumentError(
                    f"rank {self.rank} (host {host}) advertises the loopback address {addr} for its peer server, "
                    "which other hosts cannot reach: set TIERCEL_ADVERTISE to this host's address on the job's "
                    "network, or give the peer tier's `listen` that address"
                )
            assert part.job is not None  # rank 0 hands one out with a peer tier
            self._core.connect_peer_hosts(part.job, part.hosts, part.members,
                                          part.secret.encode() if part.secret else None)
            # No rank pushes a replica before every peer server knows the job's members.
            barrier(self.coordinator)

    @property
    def run_id(self) -> str | None:
        """This job's run id: policy `[store] run`, else $TIERCEL_RUN_ID, $TORCHELASTIC_RUN_ID or
        $SLURM_JOB_ID; None without one (the job is then known by its world size and policy)."""
        return self._core.run_id

    @classmethod
    def open(cls, policy: PolicyLike | None = None, **kwargs: Any) -> Store:
        """Opens a store from a policy file ($TIERCEL_POLICY, else ./tiercel.toml) or dict."""
        return cls(policy, **kwargs)

    # -- saving -----------------------------------------------------------------------------

    def writer(self, step: int) -> Writer:
        """A writer for `step`: `with store.writer(step) as w: w.put("model", sd)`."""
        return Writer(self, _check_step(step))

    def save(self, step: int, state: Mapping[str, Any], *, replicated: bool = False) -> SaveHandle:
        """Saves a dict state; each top-level key becomes one put ("model", "optim", ...).
        Returns once the state is in the memory tier; the rest happens in the background.
        `replicated=True`: every rank of the replica group saves the same state (see
        `Writer.put`)."""
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise InvalidArgumentError(
                f"save() takes a dict with str keys (e.g. {{'model': ..., 'optim': ...}}), got {type(state).__name__}; "
                "use store.writer(step).put(name, value) for anything else"
            )
        w = self.writer(step)
        try:
            for name, value in state.items():
                w.put(name, value, replicated=replicated)
        except BaseException:
            w.abort()
            raise
        return w.commit()

    # -- restoring --------------------------------------------------------------------------

    def steps(self) -> Steps:
        """Committed steps per tier: {"ram": [3, 4], "disk": [2, 4]}. A tier that cannot be
        listed right now (a server down) is left out and named in `.errors` with the reason."""
        out = Steps()
        for name, steps, error in self._core.steps():
            if error is None:
                out[name] = list(steps or [])
            else:
                out.errors[name] = error
        return out

    def metrics(self) -> Metrics:
        """What this process has done per tier: {"disk": {"steps_written": 12, "bytes_written":
        ..., "write_seconds": ..., "write_bytes_per_second": ..., "steps_read": ...,
        "bytes_read": ..., "last_step": 40, "lag_steps": 3, "lag_seconds": 9.5, "queue_depth":
        1, "skips": 2, "failures": 0, "effective_interval": None}, ...}; `None` where nothing
        is known yet. `.timings`: what the framework adapters timed where training waits on
        them, {"deepspeed_stall": {"count": 40, "seconds": 1.2, "last_seconds": 0.01}, ...}.
        tiercel.metrics has them as Prometheus text and serves them."""
        return Metrics(self._core.metrics(), self._core.timings())

    def latest_step(self, *, reshard: bool = False) -> int | None:
        """The newest step of this job that every rank can restore at this world size
        (collective when the job has several ranks), or None when the job has saved none.

        A step counts for a rank only if the rank can open it: a commit record and its own
        manifest readable on some tier in restore order. So when one rank's copy of the newest
        step is gone (its manifest lost or corrupt on every tier), all ranks fall back together
        to the newest step that each of them can still read. A step this process has just
        saved counts as soon as `save` returned (this waits for its memory commit).

        Raises WorldSizeError when the newest step was saved by another number of ranks: a
        plain restore reads each rank's own part and cannot continue from it. `reshard=True`
        (for readers that reshard, such as tiercel.dcp): the newest step whatever world size
        saved it, of which every saved rank's part opens."""
        return self._newest(Need(reshard=reshard))

    def _newest(self, need: Need, below: int | None = None, opened: dict[int, _core.StepReader] | None = None) -> int | None:
        agreed = agree(self, need, below=below)
        self._skipped = agreed.skipped
        self._save = agreed.save
        if opened is not None:
            opened.update(agreed.readers)
        return agreed.step

    def reader(self, step: int | None = None, *, rank: int | None = None, tiers: list[str] | None = None,
               job: str | None = None) -> Reader:
        """A reader of `step` (default: the newest step restorable by every rank, as
        `restore`). `rank`: read saved rank `rank`'s part (default: this rank's, which needs
        the step saved at this world size: else WorldSizeError). `job`: see `restore`."""
        opened: dict[int, _core.StepReader] = {}
        if step is None:
            _no_job_without_step(job)
            step = self._require_latest(Need(rank=rank), opened=opened)
        return self._open(_check_step(step), rank, tiers, job, None if tiers else opened.get(self._rank(rank)))

    def _open(self, step: int, rank: int | None, tiers: list[str] | None, job: str | None,
              opened: _core.StepReader | None = None) -> Reader:
        """A reader of `step`: saved rank `rank`'s part, or this rank's own part of a step
        saved at this world size (else WorldSizeError). `opened`: the core's reader of it that
        choosing the step opened (so the step's metadata is read once)."""
        try:
            r = Reader(self, step, rank, tiers, job, opened=opened)
        except InvalidArgumentError:
            if rank is None:  # the step has no rank of this number: say why
                check_world_size(self, step)
            raise
        if rank is None and r.manifest.world_size != self.world_size:
            raise world_size_error(self, step, r.manifest.world_size, [step])
        return r

    def restore(self, step: int | None = None, *, job: str | None = None, rank: int | None = None,
                reshard: Want | None = None) -> dict[str, Any]:
        """Restores a step as the dict that was saved. Arrays from the memory tier are
        zero-copy views over shared memory; writing to them never changes the checkpoint.

        Without `step`, collective over the job's ranks: the newest step that every rank can
        read, verified. When a rank finds a chunk of the newest step damaged on every tier,
        all ranks fall back together to the step before (one extra reduction), and
        `last_restore.warnings` (and the log) say which steps were skipped and why. With
        `step`, that step or an IntegrityError.

        Each rank reads its own part, so the step must have been saved by as many ranks as
        the job has now: else WorldSizeError, which names the steps and how to reshard.
        `rank=r` reads saved rank r's part instead, on purpose (any world size).

        `reshard=`: a restore at any world size of a step whose arrays were saved as pieces of
        global arrays (`tiercel.Sharded`): each sharded item comes back as the box of its
        global array this rank asks for, put together from every saved rank's pieces that
        overlap it, each read from the nearest tier that holds it (own RAM, a peer, then the
        durable tiers). `True`: every sharded item whole; `{"w": np.s_[a:b]}`: rows a:b of
        item "w" (a tuple of slices for more dimensions), the other sharded items whole; a
        callable `(item name, global shape) -> index or None` (None: whole). Values saved
        without shard information, and the structure, come from saved rank 0's part
        (tiercel.reshard). Without `step`, the ranks agree on the newest step of which every
        saved rank's part opens (`latest_step(reshard=True)`).

        Only this job's steps are restored (and those of `[restore] resume_from`): a step
        another job saved into the same tiers is passed over. `job="<run id>"` (with `step`)
        restores a step of that run, `job="*"` of any job. `last_restore.warnings` names the
        newer steps passed over and why (also logged).

        With `[restore] replicated` other than "all", collective over the job's ranks: the
        ranks of a replica group read its replicated puts from a persistent tier once between
        them (docs/restore.md); `last_restore.broadcast` says how."""
        if reshard is False:  # as latest_step(reshard=False): this rank's own part
            reshard = None
        if reshard is not None:
            check_want(reshard)
            if rank is not None or job is not None:
                raise InvalidArgumentError(
                    f"rank {self.rank}: restore(reshard=...) reads every saved rank's pieces of this job's steps; it "
                    f"takes neither rank= (got {rank!r}) nor job= (got {job!r})")
        if step is not None:
            _check_step(step)
            state, info = self._read_step(step, job, rank, reshard=reshard)
            self.last_restore = info
            return state
        _no_job_without_step(job)
        need = Need(rank=rank, reshard=reshard is not None)
        skipped: list[str] = []
        below = None
        while True:
            opened: dict[int, _core.StepReader] = {}
            step = self._require_latest(need, below, skipped, opened)
            skipped += self._skipped
            error: Exception | None = None
            result = None
            try:
                result = self._read_step(step, None, rank, opened.get(self._rank(rank)), reshard, save=self._save)
            except Exception as e:  # every rank takes part in the reduction below first
                error = e
            failed = self._failures(error)
            damaged = all(kind == "IntegrityError" for kind, _ in failed.values())
            if error is not None and not (damaged and isinstance(error, IntegrityError)):
                raise error
            if result is not None and (not failed or not damaged):
                break  # read; a rank that failed otherwise raises its own error
            skipped.append(f"step {step} skipped: " + "; ".join(
                f"rank {r} cannot read it from any tier: {why}" for r, (_, why) in sorted(failed.items())))
            log.warning("rank %d: %s; trying an older step", self.rank, skipped[-1])
            below = step
        assert result is not None
        state, info = result
        for w in skipped:
            log.warning("rank %d restores step %d: %s", self.rank, step, w)
        info.warnings = skipped + info.warnings
        self.last_restore = info
        return state

    def _read_step(self, step: int, job: str | None, rank: int | None, opened: _core.StepReader | None = None,
                   reshard: Want | None = None, **save: Any) -> tuple[dict[str, Any], RestoreInfo]:
        """Reads every put of `step` (saved rank `rank`'s part; default this rank's), every
        chunk verified (a zero-copy view is checked when it is mapped). `reshard`: the boxes
        this rank wants of every saved rank's pieces (tiercel.reshard), of the agreed `save`."""
        if reshard is not None:
            share_replicated(self, None)  # the replica groups' shared read: none here, but collective
            return read_resharded(self, step, reshard, **save)
        t0 = time.perf_counter()
        try:
            r = self._open(step, rank, None, job, opened)
        except TiercelError:
            share_replicated(self, None)  # still take part, so that the others do not wait
            raise
        # Another rank's part is not this rank's replica group's to share.
        r.info.broadcast = share_replicated(self, r if r.rank == self.rank else None)
        state = r.get_all()
        r.info.seconds = time.perf_counter() - t0
        return state, r.info

    def _failures(self, error: Exception | None) -> dict[int, tuple[str, str]]:
        """{rank: (error class, message)} of the ranks whose read of the chosen step failed
        (one reduction when the job has several ranks: each rank gets only the failures)."""
        mine = None if error is None else (type(error).__name__, str(error))
        return combined(self, mine, _failed)

    def _rank(self, rank: int | None) -> int:
        """The saved rank a read of `rank` (None: this rank's own part) reads."""
        return self.rank if rank is None else rank

    def _require_latest(self, need: Need, below: int | None = None, skipped: list[str] | None = None,
                        opened: dict[int, _core.StepReader] | None = None) -> int:
        step = self._newest(need, below, opened)
        if step is None:
            listed = self.steps()
            steps: Any = dict(listed) | {t: f"cannot list: {e}" for t, e in listed.errors.items()}
            why = "".join(f"; {s}" for s in [*(skipped or []), *self._skipped])
            if below is not None:  # every newer step was damaged
                raise IntegrityError(
                    f"rank {self.rank}: no step can be restored and verified by every rank from tiers "
                    f"{self._core.restore_order} (committed here: {steps}){why}")
            raise NotFoundError(
                f"rank {self.rank}: no step can be restored by every rank from tiers {self._core.restore_order} "
                f"(committed here: {steps}){why}"
            )
        return step

    # -- housekeeping ---------------------------------------------------------------------------

    def tiers(self) -> list[dict[str, Any]]:
        return self._core.tiers()

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every background job (flush, replicate, persist, evict) has finished,
        at most `timeout` seconds (None: as long as it takes). At the timeout it raises
        TimeoutError naming the tiers, steps and bytes still pending; the work goes on in the
        background. Waiting longer than 2 s logs what it waits for; Ctrl-C interrupts it
        (KeyboardInterrupt; the work goes on)."""
        left = self._core.flush(timeout)
        if left is not None:
            raise TimeoutError(f"rank {self.rank}: background work not finished after {timeout} s: {left}")

    def preempt(self, grace: float | None = None) -> PreemptReport:
        """Flushes for a preemption: the newest step this rank holds in RAM goes to every tier
        that persists now, whatever their `every`, ahead of all other background work and with
        bandwidth limits lifted, for at most `grace` seconds (None: the policy's
        `[preemption] grace`, else 30). Returns (and logs) the report: per tier, the step it
        holds committed, or why not (timed out, failed, the ranks whose part is missing).
        Each rank flushes its own part; a tier commits the step once every rank's is there.
        Training may go on after it returns (limits apply again). The `[preemption]` signal
        handler calls this."""
        if self._closed:
            raise InvalidArgumentError(f"rank {self.rank}: preempt() on a closed Store: nothing can be flushed any more")
        return run_preempt(self, grace)

    def prefault(self, nbytes: int | Sequence[int]) -> None:
        """Prepares shared memory for this process's first save of about `nbytes` (one rank's
        state; a list: one size per `put` of the first step), in the background. A brand-new
        job's first save otherwise faults in every page of it while training waits (several
        times a memcpy); call this when the state is built, well before the first save. A
        store that restored from RAM does this by itself. Once per process, up to the memory
        tier's `capacity`."""
        sizes = [nbytes] if isinstance(nbytes, int) else list(nbytes)
        if any(not isinstance(s, int) or s < 0 for s in sizes):
            raise InvalidArgumentError(f"prefault takes a byte count or a list of them, got {nbytes!r}")
        self._core.prefault(sizes)

    def close(self, timeout: float | None = None) -> bool:
        """Finishes background work and releases this process's spare shared memory.

        Waits for the background work (persists, replication) at most `timeout` seconds
        (None: as long as it takes), logging which tiers, steps and bytes it waits for once it
        takes longer than 2 s. What is not done by then is abandoned and logged as not
        persisted there; committed steps stay committed, and a step cut off on a tier is never
        visible there. Ctrl-C while it waits says what is pending; a second Ctrl-C abandons
        it and raises KeyboardInterrupt (a `with` block left by Ctrl-C needs only one more).
        Returns True when every background job finished, False when some were abandoned."""
        return self._close(timeout, interrupted=False)

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (a closed Store saves and restores nothing more)."""
        return self._closed

    def _close(self, timeout: float | None, interrupted: bool) -> bool:
        if self._closed:
            return True
        self._closed = True
        return self._core.close(timeout, interrupted) is None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._close(None, interrupted=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass



def _failed(failures: list[tuple[str, str] | None]) -> dict[int, tuple[str, str]]:
    """{rank: (error class, message)} of the ranks whose read failed, of every rank's."""
    return {r: f for r, f in enumerate(failures) if f is not None}


def _no_job_without_step(job: str | None) -> None:
    if job is not None:
        raise InvalidArgumentError(f"job={job!r} needs a step: restore(step=N, job=...) reads step N of that job")


def _check_step(step: Any) -> int:
    """A step is a non-negative int (the core refuses steps its on-tier names cannot hold)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidArgumentError(f"a step is a non-negative int, got {step!r}")
    return step
