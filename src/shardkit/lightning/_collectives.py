"""The collectives the Lightning strategies issue themselves (barrier, object broadcast, metric reduce, sync).

Labelled like every shardkit collective, so a profile of a Lightning run shows which hook talked.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import collectives
from shardkit.distributed.objects import broadcast_object as _broadcast_object


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier(device: torch.device, name: Optional[str] = None) -> None:
    """Block until every rank arrives; NCCL needs the device to run the barrier on."""
    if not is_initialized():
        return
    collectives.barrier(label=f"lightning.{name or 'barrier'}", device=device)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from global rank ``src`` on every rank."""
    if not is_initialized():
        return obj
    return _broadcast_object(obj, src, None, label="lightning.broadcast")


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def reduce(
    tensor: torch.Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
) -> torch.Tensor:
    """All-reduce a copy of ``tensor`` (metrics, decisions); ``"mean"``/``"avg"`` divide the sum by the group size."""
    if not is_initialized():
        return tensor
    group = group if group is not None else dist.group.WORLD
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    op: Any
    mean = reduce_op is None or name in ("mean", "avg")
    if mean or name == "sum":
        op = dist.ReduceOp.SUM
    elif name is not None:
        if name not in _OPS:
            raise ValueError(f"unknown reduce_op {reduce_op!r}; use 'mean', 'sum', 'max', 'min' or a ReduceOp")
        op = _OPS[name]
    else:
        op = reduce_op
    result = tensor.detach().clone()
    if mean and not result.is_floating_point():
        result = result.float()
    collectives.all_reduce(result, op=op, group=group, label="lightning.reduce")
    if mean:
        result = result / dist.get_world_size(group)
    return result


@torch.no_grad()
def sync_module_states(module: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank (evaluation runs that build no wrapper)."""
    if not is_initialized():
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        collectives.broadcast(tensor.data, 0, group=dist.group.WORLD, label="lightning.sync_module_states")
