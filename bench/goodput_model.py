"""The goodput model of bench/goodput.py: effective training time ratio (ETTR, the share of
wall-clock time that advances training) against the mean time between failures (MTBF) of a
job, from checkpoint and recovery costs that the benchmark measured. Pure functions: every
time is in seconds.

A job computes in segments of `interval` seconds, each followed by a checkpoint that blocks
it for `cost` seconds. Failures arrive at random, `mtbf` seconds apart on average; each
wastes `waste` seconds: restarting, restoring and redoing the work since the checkpoint it
restores. Over a long run the failures take `waste / mtbf` of the wall clock, and of the
rest `interval / (interval + cost)` is training:

    ETTR = interval / (interval + cost) * (1 - waste / mtbf)        (0 when waste >= mtbf)

The first-order model of Young (1974) and Daly (2006); it ignores a failure during a
recovery, which matters only where the ETTR is low anyway.

How a method checkpoints decides `interval`, `cost` and `waste`:
- at an interval: `cost` is what one checkpoint blocks, `interval` what Young/Daly's rule
  picks for that cost and the MTBF, and a failure redoes half a segment on average:
  waste = restart + restore + (interval + cost) / 2 (`interval_ettr`);
- every iteration (tiercel): `interval` is the iteration's compute, `cost` the step time
  that checkpointing adds, and a failure redoes the iterations the restored step lacks, plus
  half an iteration on average (`per_iteration_ettr`).

The MTBF of a job of N GPUs (`mtbf_of`) follows the two job-level figures Meta published
for its research clusters (a fit over eleven months of jobs on A100 GPUs): 7.9 hours for
1,024 GPUs and 1.8 hours for 16,384. Between and beyond them the MTBF follows the power law
through both points (MTBF proportional to N^-0.533), in place of the 1/N of independent
failures, which would give 0.49 hours at 16,384 GPUs against the 1.8 measured."""

from __future__ import annotations

import math
from dataclasses import dataclass

HOUR = 3600.0

#: Job MTBF by GPU count, Meta's research-cluster figures (seconds).
PUBLISHED_MTBF = {1024: 7.9 * HOUR, 16384: 1.8 * HOUR}
#: A cross-check: Llama 3's 54-day pre-training run on 16,384 H100 GPUs had 419 unexpected
#: interruptions (466 with the planned ones): one every 3.1 hours.
LLAMA3_MTBF = (16384, 54 * 24 * HOUR / 419)
#: Published goodput figures to set beside the model: GEMINI's recovery from in-memory
#: checkpoints wasting 13x less time than from remote persistent storage, and ByteRobust's
#: 97% ETTR over a three-month job on 9,600 GPUs.
GEMINI_WASTE_RATIO = 13.0
BYTEROBUST_ETTR = (9600, 0.97)
#: The GPU counts the model reports, 16 to 16,384.
GPU_COUNTS = [16 * 4**k for k in range(6)] + [16384]


def mtbf_of(gpus: float) -> float:
    """A job's MTBF in seconds at `gpus` GPUs: the power law through PUBLISHED_MTBF."""
    if gpus <= 0:
        raise ValueError(f"mtbf_of({gpus}): a job has at least one GPU")
    (n1, m1), (n2, m2) = sorted(PUBLISHED_MTBF.items())
    alpha = math.log(m1 / m2) / math.log(n2 / n1)
    return m1 * (gpus / n1) ** -alpha


def young_interval(cost: float, mtbf: float) -> float:
    """Young's optimal compute time between checkpoints: sqrt(2 * cost * mtbf)."""
    return math.sqrt(2.0 * cost * mtbf)


def young_daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints (Young's rule
    with Daly's correction terms): for cost < 2 * mtbf,
    sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C; else mtbf."""
    if cost < 0 or mtbf <= 0:
        raise ValueError(f"young_daly_interval(cost={cost}, mtbf={mtbf}): cost >= 0 and mtbf > 0")
    if cost >= 2.0 * mtbf:
        return mtbf
    r = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost


def interval_in_iterations(cost: float, mtbf: float, iteration: float) -> int:
    """Young/Daly's interval as whole iterations of `iteration` seconds (at least 1)."""
    return max(1, round(young_daly_interval(cost, mtbf) / iteration))


def ettr(interval: float, cost: float, waste: float, mtbf: float) -> float:
    """The share of wall-clock time that advances training (the module's formula)."""
    if interval <= 0 or cost < 0 or waste < 0 or mtbf <= 0:
        raise ValueError(f"ettr(interval={interval}, cost={cost}, waste={waste}, mtbf={mtbf}): out of range")
    return interval / (interval + cost) * max(0.0, 1.0 - waste / mtbf)


def interval_ettr(cost: float, restart: float, restore: float, mtbf: float, iteration: float | None = None) -> float:
    """ETTR of checkpointing at Young/Daly's interval for `cost` (rounded to whole iterations
    when `iteration` is given): a failure redoes half a segment on average."""
    tau = young_daly_interval(cost, mtbf)
    if iteration is not None:
        tau = interval_in_iterations(cost, mtbf, iteration) * iteration
    return ettr(tau, cost, restart + restore + (tau + cost) / 2.0, mtbf)


def per_iteration_ettr(iteration: float, overhead: float, restart: float, restore: float,
                       lost_iterations: float, mtbf: float) -> float:
    """ETTR of checkpointing every iteration: `iteration` seconds of compute, `overhead`
    seconds added to each by the checkpoint, and a failure redoing `lost_iterations` whole
    iterations plus half of the one it interrupted."""
    step = iteration + overhead
    return ettr(iteration, overhead, restart + restore + (lost_iterations + 0.5) * step, mtbf)


@dataclass
class Costs:
    """One method's measured costs (seconds), what the model needs of it. `interval`: None
    for a method that checkpoints at Young/Daly's interval for `cost`; 1 for every
    iteration (then `cost` is the step time it adds, and `lost_iterations` what a failure
    lost)."""

    iteration: float
    cost: float
    restart: float
    restore: float
    every_iteration: bool = False
    lost_iterations: float = 0.0

    def ettr(self, mtbf: float) -> float:
        if self.every_iteration:
            return per_iteration_ettr(self.iteration, self.cost, self.restart, self.restore, self.lost_iterations, mtbf)
        return interval_ettr(self.cost, self.restart, self.restore, mtbf, self.iteration)

    def waste_per_failure(self, mtbf: float) -> float:
        """Expected seconds one failure wastes at this MTBF."""
        if self.every_iteration:
            return self.restart + self.restore + (self.lost_iterations + 0.5) * (self.iteration + self.cost)
        tau = interval_in_iterations(self.cost, mtbf, self.iteration) * self.iteration
        return self.restart + self.restore + (tau + self.cost) / 2.0


def curves(methods: dict[str, Costs], gpus: list[int] | None = None) -> dict[str, dict[int, float]]:
    """{method: {gpus: ETTR}} over `gpus` (default GPU_COUNTS), each at mtbf_of(gpus)."""
    return {name: {n: c.ettr(mtbf_of(n)) for n in (gpus or GPU_COUNTS)} for name, c in methods.items()}
