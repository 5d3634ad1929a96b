"""smp helpers: the MSE training step most smp tests run, and a single-process reference over micro-batches."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp

from .data import Batch


@smp.step
def mse_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An ``@smp.step`` training step with an MSE loss (smp checks a step's outputs per function and model, so
    one shared function behaves as one defined in each test)."""
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


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


__all__ = ["microbatch_reference", "mse_step"]
