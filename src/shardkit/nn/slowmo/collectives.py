"""The communication patterns of SlowMo, each a few labelled shardkit collectives.

Everything goes through :mod:`shardkit.distributed.collectives`, so a profile names each step of the algorithm
(``shardkit::all_reduce:slowmo.exact_average``), ``count_comm_bytes`` sees it and ``comm_delay`` slows it. The one
exception is gossip between CUDA tensors, which needs a batched point-to-point group that shardkit's collectives
do not offer yet (:func:`batched_exchange`; labelled, but not counted or delayed).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.distributed import GroupLike, global_rank, group_rank
from shardkit.distributed import collectives as C
from shardkit.nn.slowmo.layout import ProcessLayout, SlowMoGroups


def node_broadcast(flat: torch.Tensor, groups: SlowMoGroups, label: str) -> None:
    """Copy the node master's ``flat`` to the other ranks of its node (no-op with one process per node)."""
    if groups.node_group is not None:
        C.broadcast(flat, 0, groups.node_group, label=f"slowmo.{label}")


def node_average(flat: torch.Tensor, groups: SlowMoGroups, layout: ProcessLayout) -> None:
    """Average ``flat`` over the ranks of this node (the intra-node gradient reduction)."""
    if groups.node_group is not None:
        C.all_reduce(flat, group=groups.node_group, label="slowmo.node_grad_average")
        flat.div_(layout.nprocs_per_node)


def average_over_nodes(flat: torch.Tensor, groups: SlowMoGroups, layout: ProcessLayout) -> None:
    """Replace ``flat`` on every rank by its exact average over nodes: masters all-reduce, then tell their node.

    Ranks of one node hold equal values, so the average over masters is the average over all ranks.
    """
    if groups.master_group is not None:
        C.all_reduce(flat, group=groups.master_group, label="slowmo.exact_average")
        flat.div_(layout.num_nodes)
    node_broadcast(flat, groups, "exact_average_to_node")


def broadcast_from_rank0(flat: torch.Tensor, group: GroupLike, label: str) -> None:
    """Broadcast ``flat`` from rank 0 of ``group`` (initial parameters, buffers)."""
    C.broadcast(flat, 0, group, label=f"slowmo.{label}")


def reduce_to_shards(
    padded: torch.Tensor, shard: Optional[torch.Tensor], num_shards: int, group: GroupLike, group_size: int
) -> None:
    """Sum ``padded`` (``num_shards`` equal chunks) over ``group``; rank ``s < num_shards`` gets chunk ``s``.

    With one shard per rank this is one reduce-scatter (the bytes of half an all-reduce); with fewer shards, one
    reduce per shard to its owner. Other ranks' ``padded`` becomes scratch.
    """
    chunks = padded.chunk(num_shards)
    if num_shards == group_size:
        assert shard is not None
        C.reduce_scatter_tensor(shard, padded, group=group, label="slowmo.sharded_average")
        return
    for owner, chunk in enumerate(chunks):
        C.reduce(chunk, owner, group=group, label="slowmo.sharded_average")
    if shard is not None:
        shard.copy_(chunks[group_rank(group)])


def gather_from_shards(
    padded: torch.Tensor, shard: Optional[torch.Tensor], num_shards: int, group: GroupLike, group_size: int
) -> None:
    """Every rank receives every owner's updated ``shard`` into its chunk of ``padded``."""
    if num_shards == group_size:
        assert shard is not None
        C.all_gather_into_tensor(padded, shard, group=group, label="slowmo.sharded_update")
        return
    chunks = padded.chunk(num_shards)
    if shard is not None:
        chunks[group_rank(group)].copy_(shard)
    for owner, chunk in enumerate(chunks):
        C.broadcast(chunk, owner, group=group, label="slowmo.sharded_update")


def exchange(outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], group: GroupLike) -> list[C.Handle]:
    """Start one gossip round: send ``outgoing[peer]`` and receive into ``incoming[peer]`` (peers: ranks in ``group``).

    CPU tensors (gloo): every receive is posted before any send and all are asynchronous, so the round cannot
    deadlock whatever the graph; they go through shardkit's labelled ``send``/``recv`` (counted, and slowed by
    ``comm_delay``). CUDA tensors (NCCL): one ``batch_isend_irecv`` group, because NCCL may run every point-to-point
    operation of a group on one communicator and stream, where separately issued sends and receives of a cycle
    would wait on each other. Messages between one pair of ranks are matched in order either way, which keeps
    overlapping rounds apart.
    """
    if any(t.device.type == "cuda" for t in (*outgoing.values(), *incoming.values())):
        return batched_exchange(outgoing, incoming, group)
    handles = [C.recv(buf, global_rank(group, peer), group, label="slowmo.gossip") for peer, buf in incoming.items()]
    handles += [C.send(buf, global_rank(group, peer), group, label="slowmo.gossip") for peer, buf in outgoing.items()]
    return handles


def batched_exchange(
    outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], group: GroupLike
) -> list[C.Handle]:
    """:func:`exchange` as one ``batch_isend_irecv`` (labelled; not seen by ``count_comm_bytes``/``comm_delay``,
    which only wrap shardkit's own collectives)."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"gossip needs a real process group, got {group!r}")
    C.check_p2p_tensors([*outgoing.values(), *incoming.values()], group, "SlowMo gossip")
    ops = [dist.P2POp(dist.irecv, buf, global_rank(group, peer), group) for peer, buf in incoming.items()]
    ops += [dist.P2POp(dist.isend, buf, global_rank(group, peer), group) for peer, buf in outgoing.items()]
    if not ops:
        return []
    with record_function("shardkit::batch_send_recv:slowmo.gossip"):
        return [C.Handle(work, what="SlowMo gossip send/recv") for work in dist.batch_isend_irecv(ops)]
