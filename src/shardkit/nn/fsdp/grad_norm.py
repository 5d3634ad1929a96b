"""Gradient clipping by the true global norm over sharded gradients.

Each unit's gradient shards partition its parameters across *its own* process group, so a unit's partial norm
is reduced over that group; partial norms of different groups (for example experts in a size-one group
beside a world-sized shared trunk) are then combined locally. The result equals the norm
``torch.nn.utils.clip_grad_norm_`` would compute on this rank's unwrapped model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardkit.nn.fsdp import _collectives
from shardkit.nn.fsdp.runtime import Unit


def _partial_norm(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Sum of |g|^p (or the max of |g| for p = inf) over local shard gradients, as an FP32 scalar."""
    partial = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        g = grad.detach().float().to(device)
        if math.isinf(norm_type):
            partial = torch.maximum(partial, g.abs().max() if g.numel() else partial)
        else:
            partial = partial + g.norm(norm_type) ** norm_type
    return partial


def clip_grad_norm_(units: Sequence[Unit], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every unit's shard gradients so their global ``norm_type``-norm is at most ``max_norm``.

    Every rank must call this (it communicates over each unit's group). Returns the global norm before
    clipping, as an FP32 scalar tensor.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    use_max = math.isinf(norm_type)

    def combine(acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        partial = partial.to(acc.device)
        return torch.maximum(acc, partial) if use_max else acc + partial

    by_group: dict[int, tuple[Unit, torch.Tensor]] = {}
    for unit in units:  # pre-order: the same order on every rank, so the reductions below line up
        grads = [h.shard.grad for h in unit.group.handles if h.shard.grad is not None]
        device = unit.group.handles[0].compute_device if unit.group.handles else torch.device("cpu")
        partial = _partial_norm(grads, norm_type, device)
        first, acc = by_group.get(id(unit.group.group), (unit, None))
        by_group[id(unit.group.group)] = (first, partial if acc is None else combine(acc, partial))
    total = torch.zeros((), dtype=torch.float32)
    for unit, partial in by_group.values():
        _collectives.all_reduce_norm(partial, unit.group.group, use_max)
        total = combine(total, partial)
    total_norm = total if use_max else total ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for unit in units:
        for handle in unit.group.handles:
            if handle.shard.grad is not None:
                handle.shard.grad.detach().mul_(clip_coef.to(handle.shard.grad.device, handle.shard.grad.dtype))
    return total_norm
