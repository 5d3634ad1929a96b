"""The autograd functions that move activations into and out of a tensor-parallel region.

Each is a pair of collectives, one in forward and its adjoint in backward, over the tensor-parallel group:

=====================  ===========================  ================================
function               forward                      backward
=====================  ===========================  ================================
copy_to_tp             identity                     all-reduce (sum)
reduce_from_tp         all-reduce (sum)             identity
scatter_to_tp          keep this rank's slice       all-gather
gather_from_tp         all-gather (concatenate)     keep this rank's slice
gather_from_sequence   all-gather along ``dim``     reduce-scatter along ``dim``
reduce_scatter_to_seq  reduce-scatter along ``dim`` all-gather along ``dim``
=====================  ===========================  ================================

The first four split the last dimension (fairscale's and Megatron's regions); the last two split the sequence
dimension (sequence parallelism: the activations between blocks stay split, and each block's all-reduce becomes a
reduce-scatter plus an all-gather of the same bytes). Every collective goes through
:mod:`shardkit.distributed.collectives`, so it is labelled in profiles (``shardkit::all_reduce:tp.reduce``) and
counted by the comm meter. None of them modifies its input. ``group`` is the tensor-parallel group (the current
state's when None); a group of one makes each function the identity.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from shardkit.tensor_parallel.layout import divisors
from shardkit.tensor_parallel.state import current_state


def tp_group(group: Optional[dist.ProcessGroup] = None) -> dist.ProcessGroup:
    """``group``, or the current state's tensor-parallel group when None."""
    return group if group is not None else current_state().tp_group


def _sum(x: torch.Tensor, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    out = x.contiguous().clone()
    all_reduce(out, group=group, label=label)
    return out


def _slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} across {size} tensor-parallel ranks; sizes that "
            f"divide it: {divisors(x.shape[dim])}"
        )
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(flat, x.contiguous().view(-1), group=group, label=label)
    rows = flat.view(size, *x.shape)
    # (size, ..., n_dim, ...) -> (..., size * n_dim, ...): rank r's slice lands at position r of ``dim``
    moved = rows.movedim(0, dim)
    return moved.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % size:
        raise ValueError(
            f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} across {size} tensor-parallel ranks; "
            f"sizes that divide it: {divisors(x.shape[dim])}"
        )
    leading = x.movedim(dim, 0).contiguous()  # reduce_scatter splits the first dimension
    out = torch.empty(leading.numel() // size, dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, leading.view(-1), group=group, label=label)
    return out.view(leading.shape[0] // size, *leading.shape[1:]).movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if dist.get_world_size(ctx.group) == 1:
            return grad, None
        return _sum(grad, ctx.group, "tp.copy.backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        if dist.get_world_size(group) == 1:
            return x.view_as(x)
        return _sum(x, group, "tp.reduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _slice(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group, "tp.scatter.backward"), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group, "tp.gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _slice(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group, "sp.gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group, "sp.gather.backward"), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group, "sp.reduce_scatter")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group, "sp.reduce_scatter.backward"), None, None


def copy_to_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated ``x``: identity forward, gradients summed in backward."""
    return _CopyToTP.apply(x, tp_group(group))


def reduce_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing the ranks' partial results (identity backward)."""
    return _ReduceFromTP.apply(x, tp_group(group))


def scatter_to_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of ``x`` along ``dim`` (the last by default); gradients are gathered in backward."""
    return _ScatterToTP.apply(x, tp_group(group), dim)


def gather_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; backward keeps this rank's slice."""
    return _GatherFromTP.apply(x, tp_group(group), dim)


def gather_from_sequence(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism: all-gather the sequence slices along ``dim`` (batch-first: 1); reduce-scatter backward."""
    return _GatherFromSequence.apply(x, tp_group(group), dim)


def reduce_scatter_to_sequence(
    x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = 1
) -> torch.Tensor:
    """Sequence parallelism: sum partial results and keep this rank's sequence slice; all-gather in backward."""
    return _ReduceScatterToSequence.apply(x, tp_group(group), dim)
