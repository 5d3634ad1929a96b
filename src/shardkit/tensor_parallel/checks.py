"""Refuse tensor-parallel ranks that are given different inputs where they must get the same ones.

Every rank of a tensor-parallel group computes a slice of the same layer on the same activations, so the token ids
and the activations entering a region (a column-parallel layer's input, an embedding's ids) must be identical on
every rank. The usual way to break that is a data loader sharded by the global rank instead of the data-parallel
rank: training then runs, silently wrong. Each layer checks its input once, at its first forward: the ranks
all-gather a fingerprint of it (shape, sum, sum of squares: a few numbers) and all raise the same ``ValueError`` if
any two differ. Later forwards are not checked (one small all-gather per layer, once).

:func:`check_data_parallel_group` refuses the other silent mistake of 2-D training: a data-parallel wrapper (FSDP,
OSS, ShardedDataParallel) given a group that holds two ranks of one tensor-parallel group, whose slices it would
mix up as if they were replicas. It compares rank lists only: no communication.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import all_gather_into_tensor
from shardkit.distributed.rehearsal import rehearsing
from shardkit.tensor_parallel.grad_norm import split_groups
from shardkit.tensor_parallel.sharding import TensorParallelModule, TPGroup

_SHAPE_SLOTS = 8


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    values = x.detach().to(torch.float64)
    shape = list(x.shape)[:_SHAPE_SLOTS] + [-1] * (_SHAPE_SLOTS - min(x.dim(), _SHAPE_SLOTS))
    stats = [values.sum(), values.pow(2).sum()] if x.numel() else [values.new_zeros(()), values.new_zeros(())]
    return torch.cat([torch.tensor(shape, dtype=torch.float64, device=x.device), torch.stack(stats)])


def gather_rows(mine: torch.Tensor, group: dist.ProcessGroup, size: int, label: str) -> torch.Tensor:
    """Every rank's 1-D ``mine`` (all the same length) as the rows of a ``(size, len)`` tensor, in group-rank order:
    the exchange behind the checks that compare a few numbers across the tensor-parallel ranks (a collective)."""
    rows = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
    all_gather_into_tensor(rows, mine.contiguous(), group=group, label=label)
    return rows.view(size, -1)


def check_same_input(x: torch.Tensor, tp: TPGroup, who: str) -> None:
    """Raise on every rank of ``tp`` unless all hold the same ``x`` (compared by fingerprint; a collective)."""
    if tp.size == 1 or x.device.type == "meta":  # meta tensors (shardkit plan) hold no values to compare
        return
    rows = gather_rows(_fingerprint(x), tp.group, tp.size, "tp.check_input")
    same = (rows == rows[0]) | (rows.isnan() & rows[0].isnan())
    differing = [r for r in range(1, tp.size) if not bool(same[r].all())]
    if differing:
        raise ValueError(
            f"{who}: tensor-parallel ranks 0 and {differing[0]} of this group got different inputs (shape "
            f"{[int(v) for v in rows[0, :_SHAPE_SLOTS] if v >= 0]} against "
            f"{[int(v) for v in rows[differing[0], :_SHAPE_SLOTS] if v >= 0]}, or different values). Every rank of a "
            "tensor-parallel group must get the same batch: shard the data by the data-parallel rank "
            "(get_data_parallel_rank() / get_data_parallel_world_size()), not by the global rank."
        )


def once_check_same_input(layer: TensorParallelModule, x: torch.Tensor) -> None:
    """:func:`check_same_input` at ``layer``'s first forward only (a forward rehearsed alone, as smp's partition
    trace on rank 0, compares nothing and leaves the check to the first real one)."""
    if layer.input_checked or rehearsing():
        return
    check_same_input(x, layer.tp, f"{type(layer).__name__}({layer.extra_repr()})")
    layer.input_checked = True


def _ranks(group: Any) -> Optional[list[int]]:
    """The global ranks of ``group`` (the world for None), or None for a group torch does not know (a dummy)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if group is None:
        return list(range(dist.get_world_size()))
    if not isinstance(group, dist.ProcessGroup):
        return None
    try:
        return dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError):
        return None


def check_data_parallel_group(params: Iterable[torch.Tensor], groups: Iterable[Any], who: str) -> None:
    """Raise ``ValueError`` if any of ``groups`` (a wrapper's shard or replica group; None: the world) holds two
    ranks of the tensor-parallel group one of ``params`` is split across. Every rank given the same groups decides
    the same, before any collective."""
    tp_groups = {id(g): g for g in split_groups(params) if g is not None}
    for tp_group in tp_groups.values():
        tp_ranks = set(dist.get_process_group_ranks(tp_group))
        for group in groups:
            ranks = _ranks(group)
            shared = sorted(tp_ranks & set(ranks or ()))
            if len(shared) > 1:
                raise ValueError(
                    f"{who}: its process group (ranks {ranks}) holds ranks {shared} of one tensor-parallel group, "
                    "whose parameters are different slices of the same layers, not replicas. Give data-parallel "
                    "wrappers the data-parallel group: get_data_parallel_group() (fairscale's names) or "
                    "tensor_parallel.current_state().group('data')."
                )
