"""The model and families of the universal-layout tests: plain, torch DDP, OSS under DDP, OSS + ShardedDataParallel.

The model ties two weights and carries a buffer; the optimizer is Adam with two param groups (weights, and biases
at half the learning rate), so a checkpoint carries per-element state, Adam's scalar ``step`` and group settings.
Every family at every world size averages the gradient of the same global batch, so all follow the single-process
trajectory (within fp32 reduction-order differences).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from shardkit.strategies.registry import OptimizerSpec, get_strategy
from testkit import data_parallel_rows, regression_batch, state_difference, train_step

GLOBAL_BATCH = 8
LR = 0.02
#: The registry strategy each family builds (``plain`` is the unwrapped model in one process).
REGISTRY_NAMES = {"ddp": "ddp", "oss": "oss_ddp", "oss_sdp": "oss_sdp"}


class TiedNet(nn.Module):
    """Linear(6, 6) twice with one shared weight, then Linear(6, 3) and a persistent gain buffer."""

    def __init__(self, seed: int, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, width)
        self.b = nn.Linear(width, width)
        self.b.weight = self.a.weight if width == 6 else self.b.weight  # tied (same shape only)
        self.out = nn.Linear(width, 3)
        self.register_buffer("gain", torch.full((3,), 1.0 + 0.5 * seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.gain


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weights at ``LR``, biases at half of it."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": LR / 2},
    ]


@dataclass
class Family:
    """A model as trained (possibly wrapped), its optimizer, and this rank's share of the batch."""

    name: str
    model: nn.Module
    optimizer: Any
    inner: nn.Module
    dp_rank: int
    dp_size: int


def build(name: str, seed: int, width: int = 6) -> Family:
    """``plain`` (one process), ``ddp``, ``oss`` (OSS under torch DDP) or ``oss_sdp``."""
    inner = TiedNet(seed, width)
    if name == "plain":
        return Family(name, inner, torch.optim.Adam(param_groups(inner), lr=LR), inner, 0, 1)
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    adam = OptimizerSpec(torch.optim.Adam, {"lr": LR}, param_groups=param_groups)
    model, optimizer, _ = get_strategy(REGISTRY_NAMES[name]).build(inner, adam)
    return Family(name, model, optimizer, inner, rank, size)


def train(family: Family, steps: range) -> None:
    """One optimizer step per global batch; each rank takes its contiguous rows."""
    for step in steps:
        x, y = regression_batch(100 + step, rows=GLOBAL_BATCH)
        x, y = (data_parallel_rows(t, family.dp_rank, family.dp_size) for t in (x, y))
        train_step(family.model, family.optimizer, lambda _, x=x, y=y: (x, y))


def state(family: Family) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, cloned."""
    return {k: v.detach().clone() for k, v in family.inner.state_dict().items()}


def optimizer_state(family: Family) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """Per parameter name, the Adam state this rank holds (OSS: only the parameters it owns)."""
    local = getattr(family.optimizer, "optim", family.optimizer)
    names = {id(p): n for n, p in family.inner.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in local.state.items() if id(p) in names}


def close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> Optional[str]:
    """None when both state dicts have the same keys and values within fp32 reduction-order tolerance."""
    return state_difference(expected, got)


def reference(seed: int, steps: int) -> dict[str, torch.Tensor]:
    """The single-process run after ``steps`` steps."""
    family = build("plain", seed)
    train(family, range(steps))
    return state(family)
