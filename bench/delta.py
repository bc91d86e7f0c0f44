"""Delta encoding of dense updates: does XOR-with-an-earlier-step before zstd pay?

Issue 31 item 4 asks for numbers before a promise. This trains two small models here with
torch on CPU and takes their state at chosen steps:

  - a transformer (token embedding, encoder layers, output head) on synthetic sequences from
    a random Markov chain, trained with AdamW (learning rate 1e-3 decaying along a cosine to
    a tenth over the run): its float32 weights, a bfloat16 copy of them, and AdamW's exp_avg
    and exp_avg_sq;
  - an embedding table (EmbeddingBag with sparse gradients, ids drawn Zipf-like) trained with
    SparseAdam: only the rows a batch looks up change in a step, in the weights and in both
    moments (the "few rows per step" case of recommendation models).

For each kind of tensor, at an early and a late step, it compares the stored size of:

  - `zstd:L`            the step as it is, plain zstd;
  - `bytegroup+zstd:L`  the step as it is, byte planes then zstd: tiercel's codec today, the
                        reference every delta row is compared against;
  - `xor+zstd:L`        the step's bits XOR the bits of the same tensor d steps earlier
                        (the base), then zstd;
  - `xor+bytegroup+zstd:L`  the XOR, then byte planes, then zstd.

Every size is tiercel's own codec, not a reimplementation: each row is saved by a real Store to
an fs tier with that `compression` (in /dev/shm, so the disk plays no part), and the size is
the sum of `stored_len` of the items' chunks in the tier's manifest (4 MiB chunks, a chunk
that would not shrink stored raw, as tiercel does). An XOR'd tensor is saved with the
tensor's own float dtype (its bits reinterpreted), so `bytegroup` regroups it as it would the
values. Each XOR'd step is read back from the tier and XOR'd with its base again: the result
must equal the step bit for bit (checked, or the run stops).

L is tiercel's default level (3) and 9 (the higher level bench/compression.py measures). The
distance d is 1 (the previous step) and, where the run is long enough, 10 and 100: with
chains bounded to one base plus one delta, a delta refers to the last base, which lies d
steps back, not always to the previous step.

Beside the sizes, per kind and distance: the share of values that changed, and the share of
bytes in chunks (4 MiB, tiercel's default, and 64 KiB, its smallest) with any change: what
storing unchanged chunks only once (issue 31 item 1) would still write.

Speed: persist MB/s of raw data through the fs tier (save until the handle is done: copy into
the memory tier, CRC32C, encode, write), for each compression, and the XOR pass alone
(numpy, one thread). The machine may be shared: speeds are indicative; sizes do not depend
on the load.

    python bench/delta.py [--steps 400] [--quick]

--quick: a tiny model and a few steps (seconds; what tests/test_delta_bench.py runs).
Writes bench/results/delta.json (--out).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import tiercel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent

#: Unsigned integer dtype of the same width, to XOR a float tensor's bits.
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}

#: The kinds of tensor measured, in table order.
KINDS = ["weights-f32", "weights-bf16", "exp_avg", "exp_avg_sq", "emb-weights", "emb-exp_avg", "emb-exp_avg_sq"]


# -- the XOR delta ------------------------------------------------------------------------------


def xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The bits of `a` XOR the bits of `b`, as a tensor of their (float) dtype. Its own
    inverse: xor(xor(a, b), b) is `a` bit for bit (NaN payloads, -0.0 and infinities too,
    since only bits are touched, never values)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"xor: {a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}: a delta needs the same dtype and shape")
    ib = BITS[a.dtype]
    return torch.bitwise_xor(a.contiguous().view(ib), b.contiguous().view(ib)).view(a.dtype)


def xor_state(cur: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: xor(t, base[k]) for k, t in cur.items()}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))


# -- training -----------------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


class Table(nn.Module):
    """An embedding table with sparse gradients and a small MLP on the pooled rows."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids)).squeeze(-1)


def config(quick: bool, steps: int) -> dict[str, Any]:
    if quick:
        return {"vocab": 256, "dim": 64, "layers": 1, "seq": 16, "batch": 4, "rows": 4096, "emb_dim": 16, "bag": 4,
                "emb_batch": 32, "early": 3, "late": 12, "distances": [1, 10]}
    return {"vocab": 1024, "dim": 256, "layers": 4, "seq": 64, "batch": 16, "rows": 50_000, "emb_dim": 64, "bag": 8,
            "emb_batch": 128, "early": 10, "late": steps, "distances": [1, 10, 100]}


def train(cfg: dict[str, Any], log=print) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Trains both models up to cfg["late"] + 1 steps; returns the state, by kind, after each
    step that some row needs (early, early + 1; late + 1 - d for every d; late + 1)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    early, late = cfg["early"], cfg["late"]
    wanted = {early, early + 1, late + 1} | {late + 1 - d for d in cfg["distances"]}
    vocab, seq, batch = cfg["vocab"], cfg["seq"], cfg["batch"]
    # Synthetic language: a random Markov chain over the vocabulary with peaked transitions.
    logits = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) * 3
    trans = torch.softmax(logits, dim=-1)
    model = Transformer(vocab, cfg["dim"], cfg["layers"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    # Cosine decay to a tenth of the peak over the run, as most runs are scheduled: late
    # steps take smaller steps than early ones (which favours deltas late in training).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s / (late + 1), 1.0))))
    rows, bag = cfg["rows"], cfg["bag"]
    table = Table(rows, cfg["emb_dim"])
    truth = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    emb_opt = torch.optim.SparseAdam(list(table.table.parameters()), lr=1e-2)
    mlp_opt = torch.optim.AdamW(table.mlp.parameters(), lr=1e-3)
    names = dict(model.named_parameters())
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    t0 = time.perf_counter()
    for step in range(1, late + 2):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(vocab, (batch,))
        for i in range(seq):
            x[:, i + 1] = torch.multinomial(trans[x[:, i]], 1).squeeze(-1)
        loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        # Zipf-like ids: a few hot rows, a long tail; a batch touches a few hundred rows.
        ids = torch.from_numpy((rng.zipf(1.3, size=(cfg["emb_batch"], bag)) - 1) % rows)
        target = truth[ids].sum(-1)
        emb_loss = nn.functional.mse_loss(table(ids), target)
        emb_opt.zero_grad()
        mlp_opt.zero_grad()
        emb_loss.backward()
        emb_opt.step()
        mlp_opt.step()
        if step in wanted:
            st = opt.state
            ew = table.table.weight
            es = emb_opt.state[ew]
            out[step] = {
                "weights-f32": {n: p.detach().clone() for n, p in names.items()},
                "weights-bf16": {n: p.detach().to(torch.bfloat16) for n, p in names.items()},
                "exp_avg": {n: st[p]["exp_avg"].clone() for n, p in names.items()},
                "exp_avg_sq": {n: st[p]["exp_avg_sq"].clone() for n, p in names.items()},
                "emb-weights": {"table": ew.detach().clone()},
                "emb-exp_avg": {"table": es["exp_avg"].clone()},
                "emb-exp_avg_sq": {"table": es["exp_avg_sq"].clone()},
            }
        if step % 100 == 0 or step == late + 1:
            log(f"  step {step}: loss {loss.item():.3f}, table loss {emb_loss.item():.3f}, {time.perf_counter() - t0:.0f} s")
    return out


# -- measuring ----------------------------------------------------------------------------------


def nbytes(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, int]:
    return {k: sum(t.numel() * t.element_size() for t in ts.values()) for k, ts in state.items()}


class Tier:
    """A Store with one fs tier (in /dev/shm) of one compression; saves a state and says how
    many bytes each put (kind) took there, and how long the persist took."""

    def __init__(self, compression: str, shm: Path):
        slug = compression.replace(":", "-").replace("+", "-")
        policy = {
            "tier": [
                {"name": "ram", "kind": "memory", "root": str(shm / f"ram-{slug}"), "keep": 1},
                {"name": "disk", "kind": "fs", "url": str(shm / f"disk-{slug}"), "compression": compression, "keep": 1},
            ],
            "store": {"threads": 1, "io_threads": 1},  # the machine is shared; also: one core's speed
        }
        self.compression = compression
        self.store = tiercel.Store(policy, rank=0, world_size=1)
        self.step = 0

    def save(self, state: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, int], float, int]:
        """(stored bytes per kind, persist seconds, step) of one save of `state`."""
        self.step += 1
        t0 = time.perf_counter()
        states = self.store.save(self.step, state).wait()
        seconds = time.perf_counter() - t0
        if states.get("disk") != "committed":
            raise RuntimeError(f"bench/delta.py: {self.compression}: step {self.step} on the fs tier: {states}")
        stored: dict[str, int] = {}
        for it in self.store.reader(self.step, tiers=["disk"]).manifest.items:
            stored[it.put] = stored.get(it.put, 0) + it.stored_bytes
        return stored, seconds, self.step

    def read(self, step: int) -> dict[str, Any]:
        return self.store.reader(step, tiers=["disk"]).get_all()

    def close(self) -> None:
        self.store.close()


def check_round_trip(tier: Tier, step: int, cur: dict, base: dict, what: str) -> None:
    """The XOR'd step read back from the tier, XOR'd with its base: bit for bit the step."""
    back = tier.read(step)
    for kind, ts in cur.items():
        for name, t in ts.items():
            if not bit_equal(xor(back[kind][name], base[kind][name]), t):
                raise RuntimeError(f"bench/delta.py: {what}: {kind}/{name} did not come back bit-exact from base XOR delta")


#: Chunk sizes at which to count changed chunks: tiercel's default, and its smallest.
CHUNK_SIZES = [4 << 20, 64 << 10]


def changed(cur: dict[str, dict[str, torch.Tensor]], base: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Per kind: the share of values that differ from the base, and the share of chunks (each
    item cut at CHUNK_SIZES, as tiercel cuts items) with any value that differs: the bytes
    that storing unchanged chunks once (issue 31 item 1) would still write."""
    out: dict[str, dict[str, float]] = {}
    for kind, ts in cur.items():
        values = diff = 0
        chunks = {c: [0, 0] for c in CHUNK_SIZES}
        for name, t in ts.items():
            ne = xor(t, base[kind][name]).view(BITS[t.dtype]).reshape(-1) != 0
            values += ne.numel()
            diff += int(ne.sum())
            for c in CHUNK_SIZES:
                per = max(c // t.element_size(), 1)
                n = -(-ne.numel() // per)
                padded = torch.zeros(n * per, dtype=torch.bool)
                padded[: ne.numel()] = ne
                hit = padded.view(n, per).any(dim=1)
                sizes = torch.full((n,), per * t.element_size())
                sizes[-1] = (ne.numel() - (n - 1) * per) * t.element_size()
                chunks[c][0] += int(sizes.sum())
                chunks[c][1] += int(sizes[hit].sum())
        out[kind] = {"values": diff / values, **{f"chunk_bytes_{c >> 10}KiB": h / a for c, (a, h) in chunks.items()}}
    return out


def xor_speed(state: dict[str, dict[str, torch.Tensor]], base: dict[str, dict[str, torch.Tensor]]) -> float:
    """MB/s of the XOR pass alone over all kinds (best of 3)."""
    raw = sum(nbytes(state).values())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for k in state:
            xor_state(state[k], base[k])
        best = min(best, time.perf_counter() - t0)
    return raw / best / 1e6


def measure(snaps: dict[int, dict], cfg: dict[str, Any], levels: list[int], shm: Path, log=print) -> dict[str, Any]:
    tiers = {c: Tier(c, shm) for c in ["none"] + [f"{bg}zstd:{lv}" for lv in levels for bg in ("", "bytegroup+")]}
    rows: list[dict[str, Any]] = []
    speeds: dict[str, list[float]] = {}
    changes: dict[str, dict[str, dict[str, float]]] = {}

    def save(comp: str, state: dict, label: str, phase: str, step: int, d: int | None) -> int:
        stored, seconds, saved = tiers[comp].save(state)
        raw = nbytes(state)
        speeds.setdefault(label, []).append(sum(raw.values()) / seconds / 1e6)
        for kind in state:
            rows.append({"phase": phase, "step": step, "distance": d, "kind": kind, "encoding": label,
                         "raw_bytes": raw[kind], "stored_bytes": stored[kind]})
        return saved

    try:
        for phase, step in (("early", cfg["early"] + 1), ("late", cfg["late"] + 1)):
            cur = snaps[step]
            save("none", cur, "none", phase, step, None)
            for lv in levels:
                save(f"zstd:{lv}", cur, f"zstd:{lv}", phase, step, None)
                save(f"bytegroup+zstd:{lv}", cur, f"bytegroup+zstd:{lv}", phase, step, None)
            distances = [1] if phase == "early" else cfg["distances"]
            for d in distances:
                base = snaps[step - d]
                changes[f"{phase} d={d}"] = changed(cur, base)
                delta = {k: xor_state(cur[k], base[k]) for k in cur}
                # The higher level only at d = 1: the question there is whether it adds
                # much over the default level; the distances are asked at the default.
                for lv in levels if d == 1 else levels[:1]:
                    save(f"zstd:{lv}", delta, f"xor+zstd:{lv}", phase, step, d)
                    saved = save(f"bytegroup+zstd:{lv}", delta, f"xor+bytegroup+zstd:{lv}", phase, step, d)
                    check_round_trip(tiers[f"bytegroup+zstd:{lv}"], saved, cur, base, f"{phase} step {step} d={d} level {lv}")
            log(f"  {phase} (step {step}) measured")
        xor_mb_s = xor_speed(snaps[cfg["late"] + 1], snaps[cfg["late"]])
    finally:
        for t in tiers.values():
            t.close()
    return {"rows": rows, "changed": changes, "persist_mb_s": {k: max(v) for k, v in speeds.items()}, "xor_mb_s": xor_mb_s}


# -- the table ----------------------------------------------------------------------------------


#: Rows that add kinds up: what one checkpoint of each model holds.
TOTALS = {"transformer (f32 + moments)": ["weights-f32", "exp_avg", "exp_avg_sq"],
          "table (f32 + moments)": ["emb-weights", "emb-exp_avg", "emb-exp_avg_sq"]}


def table(res: dict[str, Any], level: int) -> str:
    """Ratio (raw / stored) per kind, step and encoding at one level; a delta's cell also
    gives plain bytegroup's stored bytes over the delta's (>1: the delta stores fewer)."""
    sums: dict[tuple, list[int]] = {}
    for r in res["rows"]:
        for k in [r["kind"]] + [t for t, kinds in TOTALS.items() if r["kind"] in kinds]:
            s = sums.setdefault((r["phase"], k, r["encoding"], r["distance"]), [0, 0])
            s[0] += r["raw_bytes"]
            s[1] += r["stored_bytes"]
    late_ds = res["config"]["distances"]
    cols: list[tuple[str, int | None]] = [(f"zstd:{level}", None), (f"bytegroup+zstd:{level}", None),
                                          (f"xor+zstd:{level}", 1)]
    cols += [(f"xor+bytegroup+zstd:{level}", d) for d in late_ds]
    head = ["kind", "MB", "step"] + [e + (f" d={d}" if d else "") for e, d in cols]
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: | --- |" + " ---: |" * len(cols)]
    steps = {"early": res["config"]["early"] + 1, "late": res["config"]["late"] + 1}
    for kind in KINDS + list(TOTALS):
        for phase, step in steps.items():
            raw = sums[(phase, kind, f"zstd:{level}", None)][0]
            ref = sums[(phase, kind, f"bytegroup+zstd:{level}", None)][1]
            cells = [kind, f"{raw / 1e6:.1f}", str(step)]
            for e, d in cols:
                s = sums.get((phase, kind, e, d))
                if s is None:
                    cells.append("")
                    continue
                cells.append(f"{s[0] / s[1]:.2f}" + (f" ({ref / s[1]:.2f}x)" if d else ""))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def changed_table(res: dict[str, Any]) -> str:
    """Per kind and distance: % of values changed, % of bytes in changed chunks (4 MiB, 64 KiB)."""
    cols = list(res["changed"])
    head = ["kind"] + [f"{c}: values / 4 MiB chunks / 64 KiB chunks changed" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(cols)]
    for kind in KINDS:
        cells = [kind]
        for c in cols:
            x = res["changed"][c][kind]
            cells.append(f"{100 * x['values']:.1f}% / {100 * x['chunk_bytes_4096KiB']:.0f}% / {100 * x['chunk_bytes_64KiB']:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="the late step pair is steps -> steps + 1")
    ap.add_argument("--levels", default="3,9", help="zstd levels, comma-separated (the first is the one every distance is measured at)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and a few steps: seconds")
    ap.add_argument("--out", default=str(HERE / "results" / "delta.json"))
    args = ap.parse_args()
    cfg = config(args.quick, args.steps)
    levels = [int(x) for x in args.levels.split(",")]
    torch.set_num_threads(1)  # the machine is shared
    load0 = os.getloadavg()[0]
    print(f"training {cfg['late'] + 1} steps (transformer dim {cfg['dim']} x {cfg['layers']} layers, table {cfg['rows']} x {cfg['emb_dim']})", flush=True)
    t0 = time.perf_counter()
    snaps = train(cfg, log=lambda s: print(s, flush=True))
    train_s = time.perf_counter() - t0
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-delta-", dir="/dev/shm"))
    try:
        res = measure(snaps, cfg, levels, shm, log=print)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    res.update({
        "benchmark": "delta",
        "date": time.strftime("%Y-%m-%d"),
        "config": cfg,
        "levels": levels,
        "train_s": train_s,
        "environment": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "tiercel_format": tiercel.FORMAT_VERSION, "loadavg_1min_start": load0,
                        "loadavg_1min_end": os.getloadavg()[0]},
    })
    for lv in levels:
        print(f"\nratio raw/stored at zstd level {lv}; in brackets: stored bytes of plain bytegroup / of the delta\n")
        print(table(res, lv))
    print("\nchanged since the base: share of values / of bytes in chunks with a change (4 MiB, 64 KiB)\n")
    print(changed_table(res))
    print("\npersist MB/s (raw data, through the fs tier, best of the saves):")
    for k, v in res["persist_mb_s"].items():
        print(f"  {k:<24} {v:7.0f}")
    print(f"  {'XOR pass alone':<24} {res['xor_mb_s']:7.0f}")
    write_results(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
