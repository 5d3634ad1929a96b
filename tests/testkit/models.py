"""Small models and optimizer settings shared by the ZeRO tests (OSS and ShardedDataParallel)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.testing.models import LMConfig, build

#: Optimizer class and settings by the name the parity tests are parametrised with.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


class BranchyNet(nn.Module):
    """Which branch runs is chosen per call, so parameters go unused on some ranks; ``idle`` is never used.

    Takes the ``nested`` reference model's batches (8 features in, 8 out).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(8, 8)
        self.branch_a = nn.Linear(8, 8)
        self.branch_b = nn.Linear(8, 8)
        self.idle = nn.Linear(8, 8)
        self.fc_out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool = False) -> torch.Tensor:
        x = torch.tanh(self.fc_in(x))
        x = self.branch_b(x) if use_b else self.branch_a(x)
        return self.fc_out(F.relu(x))


def tiny_model(name: str, seed: int = 0) -> nn.Module:
    """A harness reference model (``shardkit.testing.models``) small enough for many steps on two shared cores:
    the LM shrunk to 2 blocks of width 16; ``branchy`` is :class:`BranchyNet`."""
    if name == "lm":
        return build("lm", seed=seed, cfg=LMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, seq_len=8))
    if name == "branchy":
        torch.manual_seed(seed)
        return BranchyNet()
    return build(name, seed=seed)


class ScaleWithWeightGrad(torch.autograd.Function):
    """``x * w`` whose backward returns the input's and the weight's gradients together: a node a split backward
    cannot run in halves (the zero-bubble schedules must fall back to the unsplit backward for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)
