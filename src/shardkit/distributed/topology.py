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

import os
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.groups import GroupLike, group_rank, is_dummy, resolve_group


@dataclass(frozen=True)
class NodeLayout:
    """Which global ranks live on which node; pure data, no process groups.

    ``nodes[i]`` holds the global ranks of node ``i``, ascending; a rank's position there is its local rank.
    Nodes are ordered by their smallest rank (torchrun's node order). Every node holds the same number of ranks.

    Example::

        layout = NodeLayout.contiguous(world_size=4, nprocs_per_node=2)   # ((0, 1), (2, 3))
        layout.is_same_node(1, 2)                                          # False
    """

    nodes: tuple[tuple[int, ...], ...]
    _node_of: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        nodes = tuple(tuple(sorted(int(r) for r in node)) for node in self.nodes)
        nodes = tuple(sorted(nodes, key=lambda node: node[0] if node else -1))
        if not nodes or any(not node for node in nodes):
            raise ValueError(f"NodeLayout needs at least one node and no empty node, got {self.nodes}")
        if len({len(node) for node in nodes}) != 1:
            sizes = [len(node) for node in nodes]
            raise ValueError(f"NodeLayout needs the same number of ranks on every node, got node sizes {sizes}")
        node_of: dict[int, int] = {}
        for index, node in enumerate(nodes):
            for rank in node:
                if rank in node_of:
                    raise ValueError(f"NodeLayout: rank {rank} is on two nodes ({node_of[rank]} and {index})")
                node_of[rank] = index
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "_node_of", node_of)

    @classmethod
    def contiguous(cls, world_size: int, nprocs_per_node: int) -> NodeLayout:
        """Nodes of ``nprocs_per_node`` consecutive ranks, as torchrun assigns them."""
        if nprocs_per_node < 1 or world_size < 1 or world_size % nprocs_per_node:
            raise ValueError(
                f"{world_size} ranks cannot be split into nodes of {nprocs_per_node}: the number of processes per "
                "node must be at least 1 and divide the world size"
            )
        starts = range(0, world_size, nprocs_per_node)
        return cls(tuple(tuple(range(start, start + nprocs_per_node)) for start in starts))

    @property
    def nprocs_per_node(self) -> int:
        """Ranks on each node."""
        return len(self.nodes[0])

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        """Ranks over all nodes."""
        return self.num_nodes * self.nprocs_per_node

    def node_of(self, rank: int) -> int:
        """The node index of global ``rank``; a ``ValueError`` for a rank outside the layout."""
        try:
            return self._node_of[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is on none of the nodes {self.nodes}") from None

    def local_rank_of(self, rank: int) -> int:
        """The position of global ``rank`` on its node."""
        return self.nodes[self.node_of(rank)].index(rank)

    def is_same_node(self, rank_a: int, rank_b: int) -> bool:
        """True when the two global ranks run on the same node."""
        return self.node_of(rank_a) == self.node_of(rank_b)

    def nodes_spanned(self, ranks: Any) -> int:
        """How many distinct nodes the given global ranks run on."""
        return len({self.node_of(int(rank)) for rank in ranks})

    def inter_node_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The cross-node groups: for each local rank ``i``, the ``i``-th rank of every node, in node order."""
        return tuple(tuple(node[i] for node in self.nodes) for i in range(self.nprocs_per_node))


@dataclass(frozen=True)
class Topology:
    """This process's view of the nodes: the layout plus its world, intra-node and inter-node groups.

    ``intra_group`` holds this process's node (group rank = :attr:`local_rank`); ``inter_group`` holds the ranks
    with the same local rank on every node (for torchrun's contiguous ranks, group rank = :attr:`node_rank`).
    Build it with :meth:`from_env`, :meth:`from_groups` or :meth:`from_mesh`, never directly.

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
        from shardkit.distributed.topology_build import build_from_env

        return build_from_env(group, nprocs_per_node)

    @classmethod
    def from_groups(cls, intra_group: GroupLike, inter_group: GroupLike, group: Optional[GroupLike] = None) -> Topology:
        """The nodes an ``(intra_node_group, inter_node_group)`` pair describes; ``group`` is the world.

        The intra-node groups must split the world into equal parts, and each inter-node group must hold one rank
        of every node, all with the same position on their nodes (how hybrid sharding pairs up shards).
        """
        from shardkit.distributed.topology_build import build_from_groups

        return build_from_groups(intra_group, inter_group, group)

    @classmethod
    def from_mesh(cls, mesh: Any, group: Optional[GroupLike] = None) -> Topology:
        """The nodes of a 2-D ``DeviceMesh``: dim 0 across nodes (replicas), dim 1 inside a node (shards).

        This is the layout ``init_device_mesh(device, (num_nodes, nprocs_per_node))`` gives under torchrun and
        what torch FSDP's ``HYBRID_SHARD`` takes. The mesh must cover exactly the world group's ranks.
        """
        from shardkit.distributed.topology_build import build_from_mesh

        return build_from_mesh(mesh, group)


class EnvInfo(NamedTuple):
    """What one rank's environment says about its node (None where a variable is unset)."""

    rank: int
    local_world_size: Optional[int]
    node_key: Optional[int]
    error: Optional[str]


def read_env(rank: int, nprocs_per_node: Optional[int]) -> EnvInfo:
    """This rank's node description from torchrun's variables (or ``nprocs_per_node``); errors as text."""
    try:
        if nprocs_per_node is not None:
            if not isinstance(nprocs_per_node, int) or nprocs_per_node < 1:
                raise ValueError(f"nprocs_per_node must be a positive int, got {nprocs_per_node!r}")
            return EnvInfo(rank, nprocs_per_node, None, None)
        local_world_size = _env_int("LOCAL_WORLD_SIZE")
        node_key = _env_int("GROUP_RANK")
        if local_world_size is not None and local_world_size < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE must be at least 1, got {local_world_size}")
        return EnvInfo(rank, local_world_size, node_key, None)
    except ValueError as err:
        return EnvInfo(rank, None, None, str(err))


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


class _GroupCache:
    """The intra/inter groups created so far in this process, per world group and layout.

    Creating a group is collective and costs connections, so a second :class:`Topology` of the same layout
    reuses the first one's groups. The cache keeps the world group object alive, so its ``id`` cannot be reused
    by a later group while the entry exists.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, tuple[tuple[int, ...], ...]], tuple[Any, Any, Any]] = {}

    def get(self, world: GroupLike, layout: NodeLayout) -> Optional[tuple[Any, Any]]:
        with self._lock:
            entry = self._entries.get((id(world), layout.nodes))
        if entry is None or entry[0] is not world:
            return None
        return entry[1], entry[2]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, world: GroupLike, layout: NodeLayout, intra: Any, inter: Any) -> None:
        with self._lock:
            self._entries[(id(world), layout.nodes)] = (world, intra, inter)


#: Groups already created in this process (group creation is collective; see :class:`_GroupCache`).
GROUP_CACHE = _GroupCache()


def create_groups(world: GroupLike, layout: NodeLayout, rank: int) -> tuple[GroupLike, GroupLike]:
    """This rank's intra- and inter-node groups for ``layout``, created collectively on first use.

    Every member of ``world`` walks the same list (every node's group, then every cross-node group) so each
    creation is entered by the same ranks in the same order. On the default group that is torch's plain
    ``new_group`` rule (all ranks call every creation); inside a smaller world, only the members of each new
    group synchronise (``use_local_synchronization``), since ranks outside the world never call. A group that
    would equal the world reuses it.
    """
    if is_dummy(world):
        local = layout.local_rank_of(rank)
        node = layout.node_of(rank)
        return (
            DummyProcessGroup(rank=local, size=layout.nprocs_per_node),
            DummyProcessGroup(rank=node, size=layout.num_nodes),
        )
    cached = GROUP_CACHE.get(world, layout)
    if cached is not None:
        return cached
    assert isinstance(world, dist.ProcessGroup)
    world_ranks = set(dist.get_process_group_ranks(world))
    local_sync = world is not dist.group.WORLD
    mine: list[Any] = []
    for ranks in (*layout.nodes, *layout.inter_node_ranks()):
        if set(ranks) == world_ranks:
            created: Any = world
        else:
            created = dist.new_group(list(ranks), use_local_synchronization=local_sync)
        if rank in ranks:
            mine.append(created)
    intra, inter = mine  # this rank is in exactly one node group and one cross-node group
    GROUP_CACHE.put(world, layout, intra, inter)
    return intra, inter


def world_and_rank(group: Optional[GroupLike]) -> tuple[GroupLike, int]:
    """The world group (the default one when None) and this process's global rank."""
    world = resolve_group(group, "Topology")
    if is_dummy(world):
        return world, group_rank(world)
    return world, dist.get_rank()


__all__ = ["EnvInfo", "NodeLayout", "Topology", "create_groups", "read_env", "world_and_rank"]
