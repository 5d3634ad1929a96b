"""Gradient-norm clipping when each rank holds the gradients of only its own shard."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardkit.distributed import collectives
from shardkit.distributed.groups import GroupLike


@torch.no_grad()
def sharded_clip_grad_norm(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: GroupLike,
    device: torch.device,
) -> torch.Tensor:
    """Clip ``grads`` (this rank's shard) by the norm of the gradients of every shard together; return that norm.

    Each rank reduces its shard to one number (sum of ``|g|^p``, or the max for the inf-norm) and a single
    all-reduce combines them, so the result equals ``torch.nn.utils.clip_grad_norm_`` on the whole model while
    every gradient is read only once, by its owner.
    """
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"clip_grad_norm needs norm_type > 0 or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    partial = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        g32 = g.detach().to(device=device, dtype=torch.float32)
        if is_inf:
            partial = torch.maximum(partial, g32.abs().max()) if g32.numel() else partial
        else:
            partial = partial + torch.linalg.vector_norm(g32, norm_type) ** norm_type
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    collectives.all_reduce(partial, op=op, group=group, label="oss.grad_norm")
    total_norm = partial if is_inf else partial ** (1.0 / norm_type)
    # Same rule as torch: the coefficient is clamped at 1, so gradients under the limit are left as they are.
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
    return total_norm
