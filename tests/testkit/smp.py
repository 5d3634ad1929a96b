"""smp helpers: the MSE training step most smp tests run, and a single-process reference over micro-batches."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp

from .data import Batch


def new_mse_step() -> Callable[..., Any]:
    """A new ``@smp.step`` training step with an MSE loss: smp checks a step function's outputs on its first call
    per model, so a test that wants that check again (or the behaviour of a step defined inside a function) takes a
    new one."""

    @smp.step
    def step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return step


#: One shared MSE step for the tests that define theirs once at module level.
mse_step = new_mse_step()


def microbatch_reference(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, batch_of: Callable[[int], Batch], microbatches: int
) -> list[float]:
    """What smp computes, in one process: each step's batch cut into ``microbatches`` chunks, the gradient of their
    mean MSE loss, one optimizer step. Returns every micro-batch's loss in order."""
    losses: list[float] = []
    for s in range(steps):
        x, y = batch_of(s)
        optimizer.zero_grad()
        per_mb = [F.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
        (sum(per_mb) / microbatches).backward()  # type: ignore[operator]
        optimizer.step()
        losses.extend(loss.item() for loss in per_mb)
    return losses


__all__ = ["microbatch_reference", "mse_step", "new_mse_step"]
