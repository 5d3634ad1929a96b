"""Shared pieces of the OSS tests: side-by-side training of a reference and an OSS copy of one model."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.optim import OSS
from shardkit.testing.models import LMConfig, build, loss_for, make_batch

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def tiny_model(name: str, seed: int = 0) -> nn.Module:
    """A reference model small enough for many steps on two shared cores."""
    if name == "lm":
        return build("lm", seed=seed, cfg=LMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, seq_len=8))
    return build(name, seed=seed)


def batch(name: str, model: nn.Module, rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    inner = model.module if isinstance(model, DDP) else model
    return make_batch(name, inner, 4, seed=1000 * step + 10 * rank + micro)


def train_steps(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    steps: Iterable[int],
    accumulate: int = 1,
    after_backward: Callable[[], None] = lambda: None,
) -> None:
    """Run ``steps`` optimizer steps; with ``accumulate`` > 1 the first micro-batches skip DDP's all-reduce."""
    for step in steps:
        optimizer.zero_grad()
        for micro in range(accumulate):
            quiet = micro < accumulate - 1 and isinstance(model, DDP)
            with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                x, y = batch(name, model, rank, step, micro)
                loss_for(name, model(x), y).backward()
        after_backward()
        optimizer.step()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def average_grads(model: nn.Module) -> None:
    """What DDP does to gradients, by hand: for tests whose trainable set changes between steps."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


def ddp_pair(name: str, optim: str, freeze: bool = False) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, OSS]:
    """A DDP reference with the plain optimizer and a DDP copy with OSS, from identical weights."""
    cls, kwargs = OPTIMIZERS[optim]
    base = tiny_model(name)
    if freeze:  # freeze roughly the first half of the parameter tensors
        params = list(base.parameters())
        for p in params[: len(params) // 2]:
            p.requires_grad_(False)
    ref_model, oss_model = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    ref_opt = cls(ref_model.parameters(), **kwargs)
    oss_opt = OSS(oss_model.parameters(), optim=cls, **kwargs)
    return ref_model, oss_model, ref_opt, oss_opt


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two torch.optim state dicts hold the same groups and (to 1e-6) the same state tensors."""
    if a["param_groups"] != b["param_groups"] or sorted(a["state"]) != sorted(b["state"]):
        return False
    for pid, state in a["state"].items():
        other = b["state"][pid]
        if sorted(state) != sorted(other):
            return False
        if not all(torch.allclose(state[k].cpu(), other[k].cpu(), atol=1e-6) for k in state):
            return False
    return True
