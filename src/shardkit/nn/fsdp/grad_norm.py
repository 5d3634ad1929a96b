"""Gradient clipping by the true global norm over sharded gradients.

Each unit's gradient shards partition its parameters across *its own* process group, so a unit's partial norm
is reduced over that group; partial norms of different groups (for example experts in a size-one group
beside a world-sized shared trunk) are then combined locally. The result equals the norm
``torch.nn.utils.clip_grad_norm_`` would compute on this rank's unwrapped model; for a tensor-parallel model,
the norm of the unsplit model (each split parameter's parts are also summed over its tensor-parallel group).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from shardkit.distributed.groups import GroupLike
from shardkit.nn.fsdp import _collectives
from shardkit.nn.fsdp.runtime import Unit
from shardkit.tensor_parallel.grad_norm import power_sum, split_group


def _parts(unit: Unit) -> Iterator[tuple[tuple[GroupLike, ...], list[torch.Tensor]]]:
    """A unit's shard gradients by the groups their norm is summed over: the unit's own group, and for slices of
    tensor-parallel split parameters the tensor-parallel group too (replicated ones count once, split ones once
    per part)."""
    plain: list[torch.Tensor] = []
    split: dict[int, tuple[GroupLike, list[torch.Tensor]]] = {}
    for handle in unit.group.handles:
        grad = handle.shard.grad
        if grad is None:
            continue
        tp_groups = [split_group(module, attr) for module, attr in handle.locations]
        if not any(g is not None for g in tp_groups):
            plain.append(grad)
            continue
        for listed in tp_groups:  # every group of the unit, in this shard or not: the same keys on every rank
            if listed is not None:
                split.setdefault(id(listed), (listed, []))
        for piece in handle.meta.shard_slices():
            part = grad[piece.shard_start : piece.shard_start + piece.param_end - piece.param_start]
            tp_group = tp_groups[piece.param_index]
            if tp_group is None:
                plain.append(part)
            else:
                split.setdefault(id(tp_group), (tp_group, []))[1].append(part)
    yield (unit.group.group,), plain
    for group, grads in split.values():
        yield (unit.group.group, group), grads


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

    by_groups: dict[tuple[int, ...], tuple[tuple[GroupLike, ...], torch.Tensor]] = {}
    for unit in units:  # pre-order: the same order on every rank, so the reductions below line up
        device = unit.group.handles[0].compute_device if unit.group.handles else torch.device("cpu")
        for groups, grads in _parts(unit):
            partial = power_sum(grads, norm_type, device)
            key = tuple(id(g) for g in groups)
            previous = by_groups.get(key)
            by_groups[key] = (groups, partial if previous is None else combine(previous[1], partial))
    total = torch.zeros((), dtype=torch.float32)
    for groups, partial in by_groups.values():
        for group in groups:
            _collectives.all_reduce_norm(partial, group, use_max)
        total = combine(total, partial)
    total_norm = total if use_max else total ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for unit in units:
        for handle in unit.group.handles:
            if handle.shard.grad is not None:
                handle.shard.grad.detach().mul_(clip_coef.to(handle.shard.grad.device, handle.shard.grad.dtype))
    return total_norm
