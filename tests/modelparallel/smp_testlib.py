"""Shared pieces of the smp tests: small models, a reference trainer, and one pipelined training run."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing.models import LMConfig, TransformerLM, lm_batch
from testkit import max_state_diff, regression_batch


def mlp() -> nn.Module:
    """Seven modules in a row: enough to give each of four stages something; in-place ReLUs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),  # at the start of a stage with four: updates a received activation in place
        nn.Linear(16, 4),
    )


class PairBlock(nn.Module):
    """Returns a tuple; its second output skips the next module."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(16, 16)
        self.right = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.left(h)), self.right(h)


class ResidualNet(nn.Module):
    """Not a Sequential: residuals that cross stages, tuple and dict outputs, a parameter used in glue code,
    an in-place update of a module output that other stages also use.

    With ``stages`` set, modules are placed with ``smp.partition`` (embed, pair, mix, head on stages
    0, 1, 2, 3 for four stages; 0, 0, 1, 1 for two).
    """

    def __init__(self, stages: int = 0) -> None:
        super().__init__()
        torch.manual_seed(1)
        where = [0, 1, 2, 3] if stages == 4 else [0, 0, 1, 1]
        with smp.partition(where[0]) if stages else contextlib.nullcontext():
            self.embed = nn.Linear(8, 16)
        with smp.partition(where[1]) if stages else contextlib.nullcontext():
            self.pair = PairBlock()
        with smp.partition(where[2]) if stages else contextlib.nullcontext():
            self.mix = nn.Linear(16, 16)
        with smp.partition(where[3]) if stages else contextlib.nullcontext():
            self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        e = self.embed(x)
        h = torch.relu(e)
        e.mul_(0.5)  # in place after e was sent on: the gradient coming back must skip this
        a, b = self.pair(h)
        z = self.mix(a * self.scale) + h  # h comes from the first stage
        out = self.head(z + b + e)
        return out, {"aux": (a * a).mean(dim=1)}


def tiny_lm() -> nn.Module:
    """The default LMConfig's TransformerLM, seeded."""
    torch.manual_seed(2)
    return TransformerLM(LMConfig())


def loss_of(name: str, out: Any, y: torch.Tensor) -> torch.Tensor:
    """Model ``name``'s training loss (the residual net adds its auxiliary output)."""
    if name == "residual":
        pred, extra = out
        return F.mse_loss(pred, y) + 0.1 * extra["aux"].mean()
    if name.startswith("lm"):  # "lm" and variants of it other tests register
        return TransformerLM.loss_fn(out, y)
    return F.mse_loss(out, y)


def batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` rows for model ``name``: token ids for the LM, else 8 features in and 4 out."""
    if name.startswith("lm"):  # "lm" and variants of it other tests register
        return lm_batch(LMConfig(), size, seed)
    return regression_batch(seed, rows=size, inputs=8, outputs=4)


BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "residual": ResidualNet, "lm": tiny_lm}


@smp.step
def train_step(model: smp.DistributedModel, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = loss_of(name, model(x), y)
    model.backward(loss)
    return loss


def train_steps(model: smp.DistributedModel, opt: Any, name: str, batch_size: int, steps: range) -> list[float]:
    """One optimizer step of :func:`train_step` per step in ``steps`` on ``batch(name, batch_size, step)`` (the same
    batch on every replica); each step's loss averaged over the micro-batches."""
    losses = []
    for s in steps:
        x, y = batch(name, batch_size, s)
        opt.zero_grad()
        losses.append(train_step(model, name, x, y).reduce_mean().item())
        opt.step()
    return losses


def reference_run(
    name: str, steps: int, batch_size: int, replicas: int = 1, accumulate: int = 1, lr: float = 0.05
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Single-process training on the global batch (stepping every ``accumulate`` batches); returns per-step
    per-replica losses and the final weights."""
    model = BUILDERS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for s in range(steps):
        parts = [batch(name, batch_size, 100 * s + d) for d in range(replicas)]
        per_replica = [loss_of(name, model(x), y) for x, y in parts]
        if s % accumulate == 0:
            opt.zero_grad()
        (sum(per_replica) / replicas).backward()
        if (s + 1) % accumulate == 0:
            opt.step()
        losses.append([loss.item() for loss in per_replica])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def smp_run(
    name: str,
    config: dict[str, Any],
    steps: int,
    batch_size: int,
    model_kwargs: Optional[dict[str, Any]] = None,
    lr: float = 0.05,
    **model_options: Any,
) -> tuple[list[float], dict[str, torch.Tensor], smp.DistributedModel]:
    """Train with smp under ``config``; returns this replica's losses, the full final state dict, the model.

    With ``backward_passes_per_step=k`` among ``model_options`` the optimizer steps every ``k`` steps.
    """
    smp.init(config)
    model = smp.DistributedModel(BUILDERS[name](**(model_kwargs or {})), **model_options)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    accumulate = model_options.get("backward_passes_per_step", 1)
    losses = []
    for s in range(steps):
        x, y = batch(name, batch_size, 100 * s + smp.dp_rank())
        if s % accumulate == 0:
            opt.zero_grad()
        losses.append(train_step(model, name, x, y).reduce_mean().item())
        if (s + 1) % accumulate == 0:
            opt.step()
    return losses, model.state_dict(), model


#: The old name, still imported by test_smp_zero_bubble.py (left to the branch that is changing that file).
max_diff = max_state_diff
