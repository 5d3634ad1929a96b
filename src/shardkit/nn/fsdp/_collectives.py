"""The communication FSDP issues, each labelled with the unit it serves so a profile reads like the algorithm.

Everything goes through :mod:`shardkit.distributed.collectives`, which handles size-one and dummy groups.
Gathers and reductions are issued asynchronously and return a :class:`~shardkit.distributed.collectives.Handle`
to wait on, so communication overlaps computation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import GroupLike, group_size, is_dummy


def all_gather_params(
    full_flat: torch.Tensor, local_shard: torch.Tensor, group: GroupLike, label: str, async_op: bool = False
) -> c.Handle:
    """Fill ``full_flat`` (padded) with every rank's ``local_shard`` in rank order."""
    return c.all_gather_into_tensor(
        full_flat, local_shard, group=group, async_op=async_op, label=f"fsdp:unshard:{label}"
    )


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


def needs_channel(group: GroupLike) -> bool:
    """True for a real process group of more than one rank (the only kind that gets a reduce channel)."""
    return not is_dummy(group) and group_size(group) > 1


def create_reduce_channels(groups: list[GroupLike]) -> dict[int, GroupLike]:
    """One extra process group per distinct group in ``groups`` (keyed by ``id``), over the same ranks.

    Reduce-scatters run on these channels so they never queue behind prefetching all-gathers on the
    parameter group. ``new_group`` must be called by every rank of the world in the same order, even by ranks
    outside the new group; ranks may shard over different subgroups (hybrid sharding), so the rank lists
    are first exchanged over the world and every rank creates the union, in one agreed order. Called once, at
    the root's first forward, on every rank.
    """
    distinct: dict[int, GroupLike] = {}
    for group in groups:
        if needs_channel(group):
            distinct.setdefault(id(group), group)
    if not distinct or not dist.is_available() or not dist.is_initialized():
        return {}
    world_size = dist.get_world_size()
    mine = [(tuple(dist.get_process_group_ranks(g)), str(dist.get_backend(g))) for g in distinct.values()]  # type: ignore[arg-type]
    if all(len(ranks) == world_size for ranks, _ in mine):
        ordered = list(dict.fromkeys(mine))  # groups spanning the world are the same on every rank: no exchange needed
    else:
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, mine)
        ordered = []
        for rank_lists in everyone:
            for entry in rank_lists:
                if tuple(entry) not in ordered:
                    ordered.append(tuple(entry))
    created: dict[tuple[tuple[int, ...], str], Any] = {}
    for ranks, backend in ordered:
        created[(ranks, backend)] = dist.new_group(list(ranks), backend=backend)
    return {key: created[entry] for key, entry in zip(distinct, mine)}
