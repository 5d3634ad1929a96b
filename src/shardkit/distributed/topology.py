"""Which ranks share a machine: the world, node-local and cross-node groups, built once and agreed by every rank.

A :class:`Topology` holds three groups for this process: the *world* (every rank of the job, or of the group it
was built for), the *intra-node* group (the ranks on this process's node: fast links) and the *inter-node* group
(one rank per node, the ranks with this process's local rank: the slow network). Hybrid sharding shards inside
the node and all-reduces across nodes over exactly these two groups; the comm meter uses :class:`NodeLayout`, the
groups-free part, to label every byte intra- or inter-node.

Three ways to describe the nodes:

* :meth:`Topology.from_env`: torchrun's ``LOCAL_WORLD_SIZE`` (processes per node) and ``GROUP_RANK`` (node rank).
  torchrun gives a node's processes contiguous ranks, so node ``i`` holds ranks ``i*L .. i*L+L-1``.
* :meth:`Topology.from_groups`: an ``(intra_node_group, inter_node_group)`` pair you built yourself.
* :meth:`Topology.from_mesh`: a 2-D ``DeviceMesh`` laid out as torch FSDP's ``HYBRID_SHARD`` expects it:
  **dim 0 runs across nodes (replicas), dim 1 inside a node (shards)**; row ``i`` of ``mesh.mesh`` is node ``i``.

Every rank of the world must call the same constructor with the same arguments, in the same order as its other
group creations (torch's rule for ``new_group``). Each constructor first all-gathers what every rank sees
(environment or group membership) and validates it: a bad layout raises the same ``ValueError`` on every rank
before any group is created, so nothing hangs and nothing is half built. The groups of one layout are created
once per process and reused by later calls.

Example::

    dist.init_process_group("nccl")            # under torchrun --nnodes 2 --nproc-per-node 8
    topo = Topology.from_env()
    topo.num_nodes, topo.nprocs_per_node       # (2, 8)
    dist.all_reduce(grad_shard, group=topo.inter_group)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from shardkit.distributed.groups import GroupLike, group_size
from shardkit.distributed.node_layout import NodeLayout
from shardkit.distributed.topology_build import build_from_env, build_from_groups, build_from_mesh


@dataclass(frozen=True)
class Topology:
    """This process's view of the nodes: the layout plus its world, intra-node and inter-node groups.

    ``intra_group`` holds this process's node (group rank = :attr:`local_rank`); ``inter_group`` holds the ranks
    with the same local rank on every node (for torchrun's contiguous ranks, group rank = :attr:`node_rank`).
    Build it with :meth:`from_env`, :meth:`from_groups`, :meth:`from_mesh` or (a layout decided without asking
    peers) :meth:`planned`, never directly.

    Example::

        topo = Topology.from_env()
        if topo.num_nodes > 1:
            dist.all_reduce(shard_grad, group=topo.inter_group)
    """

    layout: NodeLayout
    rank: int
    world_group: GroupLike
    intra_group: GroupLike
    inter_group: GroupLike

    @property
    def world_size(self) -> int:
        """Ranks in the world group."""
        return self.layout.world_size

    @property
    def nprocs_per_node(self) -> int:
        """Ranks on each node."""
        return self.layout.nprocs_per_node

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.layout.num_nodes

    @property
    def node_rank(self) -> int:
        """This process's node index (torchrun's ``GROUP_RANK`` under torchrun)."""
        return self.layout.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This process's position on its node (its rank in :attr:`intra_group`)."""
        return self.layout.local_rank_of(self.rank)

    def is_same_node(self, rank_a: int, rank_b: int) -> bool:
        """True when global ranks ``rank_a`` and ``rank_b`` run on the same node."""
        return self.layout.is_same_node(rank_a, rank_b)

    @classmethod
    def from_env(cls, group: Optional[GroupLike] = None, *, nprocs_per_node: Optional[int] = None) -> Topology:
        """The nodes torchrun describes: ``LOCAL_WORLD_SIZE`` processes per node, node rank ``GROUP_RANK``.

        ``group`` is the world to split (the default group when None). ``nprocs_per_node`` replaces
        ``LOCAL_WORLD_SIZE`` (nodes are then consecutive ranks). Without either, the whole group is one node. For
        a subgroup of the job, each node keeps the members of the group that run on it. On a
        ``DummyProcessGroup`` the groups are dummies too (for planning without peers).
        """
        return cls(*build_from_env(group, nprocs_per_node))

    @classmethod
    def from_groups(cls, intra_group: GroupLike, inter_group: GroupLike, group: Optional[GroupLike] = None) -> Topology:
        """The nodes an ``(intra_node_group, inter_node_group)`` pair describes; ``group`` is the world.

        The intra-node groups must split the world into equal parts, and each inter-node group must hold one rank
        of every node, all with the same position on their nodes (how hybrid sharding pairs up shards).
        """
        return cls(*build_from_groups(intra_group, inter_group, group))

    @classmethod
    def from_mesh(cls, mesh: Any, group: Optional[GroupLike] = None) -> Topology:
        """The nodes of a 2-D ``DeviceMesh``: dim 0 across nodes (replicas), dim 1 inside a node (shards).

        This is the layout ``init_device_mesh(device, (num_nodes, nprocs_per_node))`` gives under torchrun and
        what torch FSDP's ``HYBRID_SHARD`` takes. The mesh must cover exactly the world group's ranks.
        """
        return cls(*build_from_mesh(mesh, group))

    @classmethod
    def planned(
        cls, layout: NodeLayout, rank: int, world_group: GroupLike, intra_group: GroupLike, inter_group: GroupLike
    ) -> Topology:
        """A layout known in advance, with its groups already made: nothing is asked of the peers.

        For callers that decide the layout themselves, such as ``shardkit.plan``, whose peers only mirror the
        planned rank and cannot answer the all-gather the other constructors start with. The group sizes are
        checked against the layout (every rank's view is the caller's to keep consistent).

        Example::

            layout = NodeLayout.contiguous(dist.get_world_size(), 8)
            topo = Topology.planned(layout, dist.get_rank(), dist.group.WORLD, node_group, cross_node_group)
        """
        sizes = (group_size(world_group), group_size(intra_group), group_size(inter_group))
        wanted = (layout.world_size, layout.nprocs_per_node, layout.num_nodes)
        if not 0 <= rank < layout.world_size or sizes != wanted:
            raise ValueError(
                f"Topology.planned: rank {rank} and group sizes (world, intra, inter) {sizes} do not fit the layout "
                f"{wanted}: pass this rank's node group and the group of its local rank across nodes"
            )
        return cls(layout, rank, world_group, intra_group, inter_group)


__all__ = ["NodeLayout", "Topology"]
