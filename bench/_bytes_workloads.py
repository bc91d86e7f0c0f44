"""The three training workloads of bench/bytes.py, trained here with torch on CPU.

Each workload is a model and its AdamW optimizer; `step()` runs one real optimizer step and
`state()` is what a user saves after it: {"model": the state_dict, "optim": per trainable
parameter its exp_avg, exp_avg_sq and step count}, keyed by parameter name (a plain Store
takes string keys; torch's own optimizer state_dict keys by position).

  - lora: a frozen base (float32 linear layers, requires_grad=False, so its bytes are the
    same at every step) and a low-rank adapter (A, B per layer) that AdamW trains.
  - moe: a router, a shared input and output projection and E experts (two linear layers
    each); each step routes every token to one of a quarter of the experts, drawn at random,
    so only that quarter (and the shared parts) get gradients and change. AdamW skips
    parameters without a gradient, so the other experts and their moments stay bit-identical.
    A first step, before any save, routes to every expert so that each has its moments.
  - dense: an MLP of which every parameter changes every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MiB = 1 << 20


def _optim_state(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p, st in opt.state.items():
        out[names[p]] = {k: (v.detach().clone() if k == "step" else v) for k, v in st.items()}
    return out


class Workload:
    name = ""
    model: nn.Module
    opt: torch.optim.Optimizer

    def __init__(self) -> None:
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.gen = torch.Generator().manual_seed(1)

    def step(self) -> float:
        loss = self.loss()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def loss(self) -> torch.Tensor:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The state a user saves after a step (tensors of the live model, not copies: a save
        copies them into the memory tier before it returns)."""
        return {"model": {k: v.detach() for k, v in self.model.state_dict().items()},
                "optim": _optim_state(self.opt, self.names)}

    def describe(self) -> dict[str, Any]:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        trainable = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return {"workload": self.name, "param_bytes": total, "trainable_bytes": trainable}


class LoRA(Workload):
    """`layers` frozen `dim` x `dim` float32 layers (the base) with rank-`rank` adapters."""

    name = "lora"

    def __init__(self, base_mib: int, rank: int = 16, batch: int = 8) -> None:
        torch.manual_seed(0)
        # Layers of 16 MiB (2048 x 2048 float32) for a big base, smaller ones for a small one.
        dim = 2048 if base_mib >= 64 else 1024
        layers = max(1, base_mib * MiB // (dim * dim * 4))
        self.dim, self.batch = dim, batch
        self.model = nn.ModuleDict({
            "base": nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(layers)]),
            "lora_a": nn.ParameterList([nn.Parameter(torch.randn(rank, dim) / dim**0.5) for _ in range(layers)]),
            "lora_b": nn.ParameterList([nn.Parameter(torch.zeros(dim, rank)) for _ in range(layers)]),
        })
        for p in self.model["base"].parameters():
            p.requires_grad_(False)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-3)
        super().__init__()

    def loss(self) -> torch.Tensor:
        x = torch.randn(self.batch, self.dim, generator=self.gen)
        h = x
        m = self.model
        for base, a, b in zip(m["base"], m["lora_a"], m["lora_b"]):
            h = torch.tanh(base(h) + (h @ a.t()) @ b.t())
        return (h - x).pow(2).mean()


class MoE(Workload):
    """`experts` experts of `dim` -> `hidden` -> `dim`; a quarter of them active per step."""

    name = "moe"

    def __init__(self, experts: int, dim: int, hidden: int, batch: int = 64) -> None:
        torch.manual_seed(0)
        self.dim, self.batch, self.experts = dim, batch, experts
        self.active = max(1, experts // 4)
        self.model = nn.ModuleDict({
            "inp": nn.Linear(dim, dim),
            "router": nn.Linear(dim, experts, bias=False),
            "experts": nn.ModuleList([nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                      for _ in range(experts)]),
            "out": nn.Linear(dim, dim),
        })
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.pick = torch.Generator().manual_seed(2)
        super().__init__()
        # One step (not saved) that routes to every expert, so that each has its moments, as
        # in a model trained for a while: from then on a step changes a quarter of them.
        quarter, self.active = self.active, experts
        self.step()
        self.active = quarter

    def loss(self) -> torch.Tensor:
        m = self.model
        x = torch.randn(self.batch, self.dim, generator=self.gen)
        h = m["inp"](x)
        # This step's quarter of the experts; the router chooses among them (top-1), so the
        # other experts get no gradient. Every chosen expert gets at least one token.
        chosen = torch.randperm(self.experts, generator=self.pick)[: self.active]
        scores = m["router"](h)[:, chosen]
        top = scores.argmax(dim=1)
        top[: self.active] = torch.arange(self.active)
        gate = torch.softmax(scores, dim=1).gather(1, top[:, None])
        y = torch.zeros_like(h)
        for j, e in enumerate(chosen.tolist()):
            rows = (top == j).nonzero().squeeze(1)
            y = y.index_add(0, rows, gate[rows] * m["experts"][e](h[rows]))
        return (m["out"](y) - x).pow(2).mean()


class Dense(Workload):
    """An MLP of `layers` `dim` x `dim` layers: every parameter changes every step."""

    name = "dense"

    def __init__(self, param_mib: int, batch: int = 16) -> None:
        torch.manual_seed(0)
        dim = 1024 if param_mib >= 16 else 512
        layers = max(1, param_mib * MiB // (dim * dim * 4))
        self.dim, self.batch = dim, batch
        self.model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        super().__init__()

    def loss(self) -> torch.Tensor:
        x = torch.randn(self.batch, self.dim, generator=self.gen)
        return (self.model(x) - x).pow(2).mean()


def make(name: str, quick: bool) -> Workload:
    """The workload `name` at its full size (LoRA: a 256 MiB base; MoE and dense: 64 MiB of
    parameters, 192 MiB with AdamW's moments) or at --quick's (16 MiB base; 8 MiB)."""
    if name == "lora":
        return LoRA(16 if quick else 256, rank=8 if quick else 16)
    if name == "moe":
        return MoE(8, 256, 512) if quick else MoE(16, 512, 1024)
    if name == "dense":
        return Dense(8 if quick else 64)
    raise ValueError(f"no workload {name!r} (lora, moe, dense)")


WORKLOADS = ["lora", "moe", "dense"]


def flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state by its path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        out.update(flat(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of a state's tensors (to check a restore bit for bit later)."""
    return {k: t.clone() for k, t in flat(state).items()}


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in flat(state).values())
