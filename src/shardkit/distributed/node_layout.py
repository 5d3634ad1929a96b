"""Which global ranks share a node (:class:`NodeLayout`), and the collective creation of a layout's groups.

This is the groups-free, communication-free half of :mod:`shardkit.distributed.topology`: the comm meter needs
only the layout, and the topology builders use :func:`create_groups` once the ranks have agreed on it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.exit_release import release_at_exit
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

    def node_of_rank(self) -> dict[int, int]:
        """``{global rank: node index}`` for every rank of the layout (a copy)."""
        return dict(self._node_of)

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
        self._members_only: dict[tuple[int, ...], Any] = {}

    def members_only_group(self, ranks: tuple[int, ...]) -> Any:
        """The group of exactly ``ranks`` created with ``use_local_synchronization`` (only its members call).

        torch names such a group after its ranks, so creating the same ranks twice would make the second group
        meet in the first one's store keys; one group per rank set is created and then reused.
        """
        with self._lock:
            group = self._members_only.get(ranks)
        if group is None:
            group = dist.new_group(list(ranks), use_local_synchronization=True)
            with self._lock:
                self._members_only[ranks] = group
        return group

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

    def clear(self) -> None:
        """Forget every cached group (at exit: see :mod:`shardkit.distributed.exit_release`)."""
        with self._lock:
            self._entries.clear()
            self._members_only.clear()


#: Groups already created in this process (group creation is collective; see :class:`_GroupCache`).
GROUP_CACHE = _GroupCache()
release_at_exit("Topology's node groups", GROUP_CACHE.clear)


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
    whole_job = world is dist.group.WORLD
    mine: list[Any] = []
    for ranks in (*layout.nodes, *layout.inter_node_ranks()):
        if set(ranks) == world_ranks:
            created: Any = world
        elif whole_job:
            created = dist.new_group(list(ranks))
        elif rank in ranks:
            created = GROUP_CACHE.members_only_group(tuple(ranks))
        else:
            continue  # members-only creation: ranks outside the new group do not take part
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


__all__ = ["GROUP_CACHE", "EnvInfo", "NodeLayout", "create_groups", "read_env", "world_and_rank"]
