"""Processes, nodes and the process groups SlowMo talks over.

A *node* is ``nprocs_per_node`` consecutive ranks of the global group (on a real cluster: the GPUs of one
machine). Gradients are averaged inside a node every step, so all ranks of a node hold the same parameters; only
the node's first rank (its *master*) takes part in the inter-node algorithm and then broadcasts to its node.
Simulating nodes on one machine is the same thing: ``nprocs_per_node=2`` at world size 4 makes two "nodes".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from shardkit.distributed import GroupLike, global_rank, group_rank, group_size, is_dummy


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits: its rank in the global group and in its node, and the node counts."""

    process_rank: int
    world_size: int
    nprocs_per_node: int

    @property
    def node_rank(self) -> int:
        """Index of this process's node (fairscale's ``logical_rank``)."""
        return self.process_rank // self.nprocs_per_node

    @property
    def num_nodes(self) -> int:
        """Number of nodes (fairscale's ``logical_world_size``)."""
        return self.world_size // self.nprocs_per_node

    @property
    def local_rank(self) -> int:
        """Rank of this process inside its node."""
        return self.process_rank % self.nprocs_per_node

    @property
    def is_node_master(self) -> bool:
        """Whether this process speaks for its node between nodes."""
        return self.local_rank == 0

    def node_ranks(self, node: int) -> list[int]:
        """Ranks (in the global group) of node ``node``."""
        return list(range(node * self.nprocs_per_node, (node + 1) * self.nprocs_per_node))

    def master_ranks(self) -> list[int]:
        """Ranks (in the global group) of every node's master."""
        return [node * self.nprocs_per_node for node in range(self.num_nodes)]


def make_layout(
    global_group: GroupLike, nprocs_per_node: int, process_rank: Optional[int], process_world_size: Optional[int]
) -> ProcessLayout:
    """Check the advanced-user rank arguments against ``global_group`` and the node size against the world size."""
    if isinstance(nprocs_per_node, bool) or not isinstance(nprocs_per_node, int) or nprocs_per_node < 1:
        raise ValueError(f"nprocs_per_node must be an integer >= 1 (processes per node), got {nprocs_per_node!r}")
    rank, size = group_rank(global_group), group_size(global_group)
    if process_rank is not None and process_rank != rank:
        raise ValueError(f"process_rank={process_rank} but this process is rank {rank} of the global group")
    if process_world_size is not None and process_world_size != size:
        raise ValueError(f"process_world_size={process_world_size} but the global group has {size} ranks")
    if size % nprocs_per_node != 0:
        raise ValueError(
            f"world size {size} is not a multiple of nprocs_per_node={nprocs_per_node}: SlowMo treats every "
            f"{nprocs_per_node} consecutive ranks as one node. Launch a whole number of nodes or fix nprocs_per_node."
        )
    return ProcessLayout(rank, size, nprocs_per_node)


@dataclass(frozen=True)
class SlowMoGroups:
    """The process groups of one wrapper; a group is None on ranks that are not members (or when not needed).

    ``global_group``: every rank (buffers, the sharded slow-momentum step). ``node_group``: this node's ranks
    (gradient averaging, broadcasts from the node master). ``master_group``: every node's master (exact
    averages). ``gossip_group``: the masters again, but a separate group, so gossip messages in flight never
    interleave with the masters' collectives.
    """

    global_group: GroupLike
    node_group: Optional[GroupLike]
    master_group: Optional[GroupLike]
    gossip_group: Optional[GroupLike]


def _new_group(ranks: list[int], global_group: GroupLike) -> Optional[GroupLike]:
    """A group of ``ranks`` (ranks of ``global_group``); every rank must call it. None on non-members."""
    group = dist.new_group([global_rank(global_group, r) for r in ranks])
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return group


def create_groups(
    layout: ProcessLayout,
    global_group: GroupLike,
    master_group: Optional[GroupLike],
    local_node_group: Optional[GroupLike],
    want_gossip_group: bool,
) -> SlowMoGroups:
    """Create the groups the caller did not pass; every rank must call this with the same arguments."""
    if is_dummy(global_group) or layout.world_size == 1:
        return SlowMoGroups(global_group, None, None, None)
    node_group: Optional[GroupLike] = local_node_group
    if layout.nprocs_per_node > 1 and node_group is None:
        for node in range(layout.num_nodes):
            created = _new_group(layout.node_ranks(node), global_group)
            if node == layout.node_rank:
                node_group = created
    if layout.nprocs_per_node == 1:
        node_group = None
    if node_group is not None and group_size(node_group) != layout.nprocs_per_node:
        raise ValueError(f"local_node_group has {group_size(node_group)} ranks, expected {layout.nprocs_per_node}")
    masters: Optional[GroupLike] = None
    gossip: Optional[GroupLike] = None
    if layout.num_nodes > 1:
        masters = master_group
        if masters is None:
            masters = global_group if layout.nprocs_per_node == 1 else _new_group(layout.master_ranks(), global_group)
        if not layout.is_node_master:
            masters = None
        if masters is not None and group_size(masters) != layout.num_nodes:
            raise ValueError(
                f"master_group has {group_size(masters)} ranks, expected one per node ({layout.num_nodes})"
            )
        if want_gossip_group:
            gossip = _new_group(layout.master_ranks(), global_group)
    return SlowMoGroups(global_group, node_group, masters, gossip)


__all__ = ["ProcessLayout", "SlowMoGroups", "create_groups", "make_layout"]
