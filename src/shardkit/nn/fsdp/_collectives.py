"""The communication FSDP issues, each labelled with the unit it serves so a profile reads like the algorithm.

Everything goes through :mod:`shardkit.distributed.collectives`, which handles size-one and dummy groups,
labels, counts and (under ``comm_delay``) slows every call. Gathers and reductions are issued asynchronously
and return a :class:`~shardkit.distributed.collectives.Handle` to wait on, so communication overlaps
computation.

On gloo (CPU tensors) the gather and the reduce-scatter are carried out as direct point-to-point exchanges:
every rank posts one receive per peer and sends each peer its chunk, then (reduce-scatter) sums what arrived.
That moves exactly the bytes a ring would, ``(n-1)/n`` of the buffer per rank, but measured on the bench LM's
12 MiB flat parameters gloo's own ``all_gather_into_tensor`` took about twice and its ``reduce_scatter_tensor``
two to three times as long as the exchange (gloo implements them through generic, copying paths). NCCL keeps
its native collectives.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import GroupLike, group_size, is_dummy


def _exchange_ranks(group: GroupLike, tensor: torch.Tensor) -> Optional[tuple[list[int], int]]:
    """Global ranks of ``group`` and this rank's index in it, when the exchange replaces gloo's collective."""
    if tensor.device.type != "cpu" or not needs_channel(group) or dist.get_backend(group) != dist.Backend.GLOO:  # type: ignore[arg-type]
        return None
    ranks = dist.get_process_group_ranks(group)  # type: ignore[arg-type]
    return ranks, ranks.index(dist.get_rank())


def _post(recvs: list[tuple[torch.Tensor, int]], sends: list[tuple[torch.Tensor, int]], group: GroupLike) -> list[Any]:
    works = [dist.irecv(buf, src=peer, group=group) for buf, peer in recvs]  # type: ignore[arg-type]
    works += [dist.isend(buf, dst=peer, group=group) for buf, peer in sends]  # type: ignore[arg-type]
    return works


def all_gather_params(
    full_flat: torch.Tensor, local_shard: torch.Tensor, group: GroupLike, label: str, async_op: bool = False
) -> c.Handle:
    """Fill ``full_flat`` (padded) with every rank's ``local_shard`` in rank order."""
    label = f"fsdp:unshard:{label}"
    found = _exchange_ranks(group, full_flat)
    if found is None:
        return c.all_gather_into_tensor(full_flat, local_shard, group=group, async_op=async_op, label=label)
    ranks, me = found
    chunks = full_flat.view(len(ranks), -1)

    def run() -> c.Works:
        peers = [(j, peer) for j, peer in enumerate(ranks) if j != me]
        works = _post([(chunks[j], peer) for j, peer in peers], [(local_shard, peer) for _, peer in peers], group)
        chunks[me].copy_(local_shard)
        return c.Works(works)

    n, nbytes = len(ranks), full_flat.numel() * full_flat.element_size()
    return c.custom_collective("all_gather", label, full_flat, group, (n - 1) / n * nbytes, async_op, run)


def reduce_scatter_grads(grad_shard: torch.Tensor, full_grad: torch.Tensor, group: GroupLike, label: str) -> c.Handle:
    """Start summing ``full_grad`` over ``group``; chunk ``rank`` of the sum lands in ``grad_shard``."""
    label = f"fsdp:reduce:{label}"
    found = _exchange_ranks(group, full_grad)
    if found is None:
        return c.reduce_scatter_tensor(grad_shard, full_grad, group=group, async_op=True, label=label)
    ranks, me = found
    n = len(ranks)
    chunks = full_grad.view(n, -1)

    def run() -> c.Works:
        peers = [(j, peer) for j, peer in enumerate(ranks) if j != me]
        sends = [(chunks[j], peer) for j, peer in peers]
        if n == 2:  # receive straight into the result, then add our own chunk (a + b == b + a exactly)
            works = _post([(grad_shard, peers[0][1])], sends, group)
            return c.Works(works, lambda: grad_shard.add_(chunks[me]))
        rows = torch.empty(n, grad_shard.numel(), dtype=grad_shard.dtype, device=grad_shard.device)
        works = _post([(rows[j], peer) for j, peer in peers], sends, group)

        def total() -> None:  # summed in rank order, the same on every run
            rows[me].copy_(chunks[me])
            torch.sum(rows, dim=0, out=grad_shard)

        return c.Works(works, total)

    nbytes = full_grad.numel() * full_grad.element_size()
    return c.custom_collective("reduce_scatter", label, full_grad, group, (n - 1) / n * nbytes, True, run)


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


def group_timeout(group: Optional[GroupLike] = None) -> timedelta:
    """How long a collective of ``group`` (default: the world) waits before it fails: the timeout the group was
    created with (torch's default when it cannot be read)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):  # a group may run on either, or both
        with contextlib.suppress(Exception):
            timeout = pg._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
            if isinstance(timeout, timedelta):
                return timeout
    return dist.default_pg_timeout


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
    # new_group's default timeout is torch's (30 min on gloo), not the world's: a reduction stuck behind a
    # desynchronised rank must fail as soon as the world's collectives do.
    timeout = group_timeout()
    for ranks, backend in ordered:
        created[(ranks, backend)] = dist.new_group(list(ranks), backend=backend, timeout=timeout)
    return {key: created[entry] for key, entry in zip(distinct, mine)}
