"""Training loops and gradient averaging shared by the parity tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.testing.models import loss_for

from .data import Batch, rank_batch

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def train_step(
    model: Callable[..., Any],
    optimizer: Any,
    batch_of: Callable[[int], Batch],
    micro_batches: int = 1,
    loss_fn: LossFn = F.mse_loss,
    *,
    no_sync: Optional[Callable[[], Any]] = None,
    scaler: Optional[Any] = None,
    after_backward: Callable[[], None] = lambda: None,
) -> float:
    """One optimizer step: clear the gradients, run forward and backward on ``batch_of(0)``, ...,
    ``batch_of(micro_batches - 1)`` (each made just before its forward pass), then step.

    ``no_sync`` (a wrapper's ``no_sync``) skips gradient communication on all but the last micro-batch;
    ``scaler`` (a GradScaler) scales the loss, steps and updates; ``after_backward`` runs between the last backward
    and the step (e.g. :func:`average_grads` for a reference without DDP). Returns the sum of the micro-batch losses.

    Example::

        loss = train_step(model, opt, lambda micro: regression_batch(100 * step + micro), micro_batches=2)
    """
    optimizer.zero_grad()
    total = 0.0
    for micro in range(micro_batches):
        quiet = no_sync is not None and micro < micro_batches - 1
        with no_sync() if quiet else contextlib.nullcontext():  # type: ignore[misc]
            x, y = batch_of(micro)
            loss = loss_fn(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.item()
    after_backward()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return total


def average_grads(model: nn.Module, skip: tuple[nn.Parameter, ...] = (), group: Optional[Any] = None) -> None:
    """What torch DDP does to gradients after backward, by hand: divide each by the size of ``group`` (default: the
    world) and all-reduce it over that group.

    For references whose trainable set or execution changes between steps (DDP fixes both at construction);
    ``skip`` keeps per-rank parameters (e.g. a rank's own expert) out of the average.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    skipped = {id(p) for p in skip}
    for p in model.parameters():
        if p.grad is not None and id(p) not in skipped:
            p.grad.div_(size)
            dist.all_reduce(p.grad, group=group)


def train_harness_model(
    name: str,
    model: nn.Module,
    optimizer: Any,
    rank: int,
    steps: Iterable[int],
    accumulate: int = 1,
    after_backward: Callable[[], None] = lambda: None,
) -> None:
    """Train harness reference model ``name`` on this rank's :func:`~testkit.data.rank_batch` of each step in
    ``steps``; with ``accumulate`` > 1 each step has that many micro-batches and torch DDP skips its all-reduce on
    all but the last."""
    no_sync = model.no_sync if isinstance(model, DDP) else None
    for step in steps:
        train_step(
            model,
            optimizer,
            lambda micro, step=step: rank_batch(name, model, rank, step, micro),  # type: ignore[misc]
            accumulate,
            lambda out, y: loss_for(name, out, y),
            no_sync=no_sync,
            after_backward=after_backward,
        )
