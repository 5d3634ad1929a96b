"""The communication FSDP issues, each labelled with the unit it serves so a profile reads like the algorithm.

Everything goes through :mod:`shardkit.distributed.collectives`, which handles size-one and dummy groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import GroupLike, group_size, is_dummy


def all_gather_params(full_flat: torch.Tensor, local_shard: torch.Tensor, group: GroupLike, label: str) -> None:
    """Fill ``full_flat`` (padded) with every rank's ``local_shard`` in rank order."""
    c.all_gather_into_tensor(full_flat, local_shard, group=group, label=f"fsdp:unshard:{label}")


def reduce_scatter_grads(grad_shard: torch.Tensor, full_grad: torch.Tensor, group: GroupLike, label: str) -> c.Handle:
    """Start summing ``full_grad`` over ``group``; chunk ``rank`` of the sum lands in ``grad_shard``."""
    return c.reduce_scatter_tensor(grad_shard, full_grad, group=group, async_op=True, label=f"fsdp:reduce:{label}")


def all_reduce_norm(partial: torch.Tensor, group: GroupLike, use_max: bool) -> None:
    """Combine per-rank partial gradient norms (sums of powers, or maxima) in place."""
    op = dist.ReduceOp.MAX if use_max else dist.ReduceOp.SUM
    c.all_reduce(partial, op=op, group=group, label="fsdp:grad_norm")


def all_gather_objects(obj: Any, group: GroupLike) -> list[Any]:
    """Every rank's ``obj`` (used once at wrap time to compare parameter shapes across ranks)."""
    if is_dummy(group) or group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
