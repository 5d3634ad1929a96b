"""The communication FSDP issues, each labelled with the unit it serves so a profile reads like the algorithm.

Everything goes through :mod:`shardkit.distributed.collectives`, which handles size-one and dummy groups,
labels, counts and (under ``comm_delay``) slows every call. Gathers and reductions are issued asynchronously
and return a :class:`~shardkit.distributed.collectives.Handle` to wait on, so communication overlaps
computation.

On gloo (CPU tensors) the gather and the reduce-scatter are carried out as direct point-to-point exchanges
(``by_sends=True`` of :func:`~shardkit.distributed.collectives.all_gather_into_tensor` and
:func:`~shardkit.distributed.collectives.reduce_scatter_tensor`), which gloo runs about two to three times faster
than its own collectives; NCCL keeps its native collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import GroupLike, group_size, group_timeout, is_dummy, planned_on_gloo, torch_group
from shardkit.distributed.objects import all_gather_objects


def _by_sends(group: GroupLike, tensor: torch.Tensor) -> bool:
    """True when the direct exchange replaces gloo's collective (CPU tensors on a real gloo group of 2+ ranks)."""
    if planned_on_gloo(group, tensor):  # shardkit.plan planning a gloo run on meta tensors
        return needs_channel(group)
    return (
        tensor.device.type == "cpu"
        and needs_channel(group)
        and dist.get_backend(torch_group(group, "FullyShardedDataParallel")) == dist.Backend.GLOO
    )


def all_gather_params(
    full_flat: torch.Tensor, local_shard: torch.Tensor, group: GroupLike, label: str, async_op: bool = False
) -> c.Handle:
    """Fill ``full_flat`` (padded) with every rank's ``local_shard`` in rank order."""
    return c.all_gather_into_tensor(
        full_flat,
        local_shard,
        group=group,
        async_op=async_op,
        label=f"fsdp:unshard:{label}",
        by_sends=_by_sends(group, full_flat),
    )


def reduce_scatter_grads(grad_shard: torch.Tensor, full_grad: torch.Tensor, group: GroupLike, label: str) -> c.Handle:
    """Start summing ``full_grad`` over ``group``; chunk ``rank`` of the sum lands in ``grad_shard``."""
    return c.reduce_scatter_tensor(
        grad_shard,
        full_grad,
        group=group,
        async_op=True,
        label=f"fsdp:reduce:{label}",
        by_sends=_by_sends(group, full_grad),
    )


def broadcast_start_values(tensor: torch.Tensor, group: GroupLike, label: str) -> c.Handle:
    """Start overwriting ``tensor`` with member 0's values (at wrap, where the ranks held different values)."""
    return c.broadcast(tensor, 0, group=group, async_op=True, label=f"fsdp:sync_module_states:{label}")


def all_reduce_norm(partial: torch.Tensor, group: GroupLike, use_max: bool) -> None:
    """Combine per-rank partial gradient norms (sums of powers, or maxima) in place."""
    op = dist.ReduceOp.MAX if use_max else dist.ReduceOp.SUM
    c.all_reduce(partial, op=op, group=group, label="fsdp:grad_norm")


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
    pgs = [torch_group(g, "FullyShardedDataParallel") for g in distinct.values()]
    mine = [(tuple(dist.get_process_group_ranks(pg)), str(dist.get_backend(pg))) for pg in pgs]
    if all(len(ranks) == world_size for ranks, _ in mine):
        ordered = list(dict.fromkeys(mine))  # groups spanning the world are the same on every rank: no exchange needed
    else:
        everyone = all_gather_objects(mine, None, "fsdp:reduce_channels")
        ordered = []
        for rank_lists in everyone:
            for entry in rank_lists:
                if tuple(entry) not in ordered:
                    ordered.append(tuple(entry))
    created: dict[tuple[tuple[int, ...], str], Any] = {}
    # new_group's default timeout is torch's (30 min on gloo), not the world's: a reduction stuck behind a
    # desynchronised rank must fail as soon as the world's collectives do.
    timeout = group_timeout()
    for ranks, backend in ordered:
        created[(ranks, backend)] = dist.new_group(list(ranks), backend=backend, timeout=timeout)
    return {key: created[entry] for key, entry in zip(distinct, mine)}


def all_reduce_replicas(grad_shard: torch.Tensor, replica: GroupLike, label: str) -> c.Handle:
    """Start summing a reduced gradient shard with the ranks holding the same shard (hybrid sharding: the same
    local rank on the other nodes; NO_SHARD: every rank)."""
    return c.all_reduce(grad_shard, group=replica, async_op=True, label=f"fsdp:replicate:{label}")
