"""Gradient-norm clipping when each rank holds the gradients of only its own shard.

On a tensor-parallel model (its parameters slices of layers split across the tensor-parallel ranks, OSS sharding
over the data-parallel group), a split parameter's contribution to the norm is also summed over its tensor-parallel
group, and a replicated one (a norm's weight) counts once: the norm is the unsplit model's, the same on every rank.
Which parameters are split comes from :func:`shardkit.tensor_parallel.split_groups`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed import collectives
from shardkit.distributed.groups import GroupLike
from shardkit.tensor_parallel import power_sum, split_groups


def split_parts(
    every_param: Sequence[torch.Tensor], owned: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[tuple[GroupLike, list[torch.Tensor]]]]:
    """The gradients of ``owned`` parameters: ``(replicated, [(tensor-parallel group, split), ...])``.

    The groups are listed from ``every_param`` (the whole partition, the same on every rank of the sharding
    group), so every rank joins every group's reduction even when it owns none of that group's parameters.
    """
    groups: dict[int, tuple[GroupLike, list[torch.Tensor]]] = {}
    for group in split_groups(every_param):
        if group is not None:
            groups.setdefault(id(group), (group, []))
    owned_groups = split_groups(owned)
    replicated = []
    for param, group in zip(owned, owned_groups):
        if param.grad is None:
            continue
        if group is None:
            replicated.append(param.grad)
        else:
            groups[id(group)][1].append(param.grad)
    return replicated, list(groups.values())


@torch.no_grad()
def sharded_clip_grad_norm(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: GroupLike,
    device: torch.device,
    split: Optional[Sequence[tuple[GroupLike, Sequence[torch.Tensor]]]] = None,
) -> torch.Tensor:
    """Clip ``grads`` (this rank's shard) by the norm of the gradients of every shard together; return that norm.

    Each rank reduces its shard to one number (sum of ``|g|^p``, or the max for the inf-norm) and a single
    all-reduce combines them, so the result equals ``torch.nn.utils.clip_grad_norm_`` on the whole model while
    every gradient is read only once, by its owner. ``split`` adds this rank's gradients of tensor-parallel split
    parameters, by their tensor-parallel group (see :func:`split_parts`): their sum is also reduced over it.
    """
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"clip_grad_norm needs norm_type > 0 or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    partial = power_sum(grads, norm_type, device)
    collectives.all_reduce(partial, op=op, group=group, label="oss.grad_norm")
    for tp_group, tp_grads in split or ():
        part = power_sum(tp_grads, norm_type, device)
        collectives.all_reduce(part, op=op, group=group, label="oss.grad_norm")
        collectives.all_reduce(part, op=op, group=tp_group, label="oss.grad_norm.tp")
        partial = torch.maximum(partial, part) if is_inf else partial + part
    total_norm = partial if is_inf else partial ** (1.0 / norm_type)
    # Same rule as torch: the coefficient is clamped at 1, so gradients under the limit are left as they are.
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    every = list(grads) + [g for _, tp_grads in split or () for g in tp_grads]
    for g in every:
        g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
    return total_norm
