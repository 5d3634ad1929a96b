"""Building a :class:`~shardkit.distributed.Topology`: agree on the layout, validate it, create groups.

Each builder all-gathers what every rank sees (its environment, or the members of the groups it was given) in
one object collective over the world group, then validates the gathered list. All ranks validate the same list,
so a bad layout raises the same ``ValueError`` on every rank, before any group is created: no rank is left
waiting in a ``new_group`` the others never enter.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from shardkit.distributed.groups import GroupLike, group_rank, group_size, is_dummy
from shardkit.distributed.node_layout import NodeLayout, create_groups, read_env, world_and_rank
from shardkit.distributed.objects import all_gather_objects

_NOTHING = "No process group was created."


class Built(NamedTuple):
    """What a builder agreed on: the fields of a :class:`~shardkit.distributed.Topology`, in order."""

    layout: NodeLayout
    rank: int
    world_group: GroupLike
    intra_group: GroupLike
    inter_group: GroupLike


def build_from_env(group: Optional[GroupLike], nprocs_per_node: Optional[int]) -> Built:
    """See :meth:`~shardkit.distributed.Topology.from_env`."""
    world, rank = world_and_rank(group)
    source = "nprocs_per_node" if nprocs_per_node is not None else "LOCAL_WORLD_SIZE"
    if is_dummy(world):
        return _from_dummy_env(world, rank, nprocs_per_node, source)
    infos = all_gather_objects(read_env(rank, nprocs_per_node), world, "Topology.from_env")
    failed = [info for info in infos if info.error is not None]
    if failed:
        raise ValueError(f"Topology.from_env: rank {failed[0].rank}: {failed[0].error}. {_NOTHING}")
    by_size: dict[Optional[int], list[int]] = defaultdict(list)
    for info in infos:
        by_size[info.local_world_size].append(info.rank)
    if len(by_size) > 1:
        seen = "; ".join(f"{_ranks(ranks)} see {source}={size}" for size, ranks in by_size.items())
        raise ValueError(
            f"Topology.from_env: the ranks disagree on the number of processes per node ({seen}). Start every "
            f"node with the same torchrun --nproc-per-node (shardkit needs equal nodes). {_NOTHING}"
        )
    local_world_size = infos[0].local_world_size
    world_size = len(infos)
    if local_world_size is None:
        layout = NodeLayout((tuple(info.rank for info in infos),))  # not under torchrun: one node
    else:
        layout = _layout_from_keys(infos, local_world_size, world_size, source, world is dist.group.WORLD)
    intra, inter = create_groups(world, layout, rank)
    return Built(layout, rank, world, intra, inter)


def _from_dummy_env(world: GroupLike, rank: int, nprocs_per_node: Optional[int], source: str) -> Built:
    """A world with no peers (planning): the layout is taken as given, consecutive ranks per node."""
    info = read_env(rank, nprocs_per_node)
    if info.error is not None:
        raise ValueError(f"Topology.from_env: {info.error}")
    world_size = group_size(world)
    per_node = world_size if info.local_world_size is None else info.local_world_size
    if world_size % per_node:
        raise ValueError(f"Topology.from_env: {source}={per_node} does not divide the world size {world_size}")
    layout = NodeLayout.contiguous(world_size, per_node)
    intra, inter = create_groups(world, layout, rank)
    return Built(layout, rank, world, intra, inter)


def _layout_from_keys(infos: list[Any], local_world_size: int, world_size: int, source: str, whole: bool) -> NodeLayout:
    """Nodes from ``GROUP_RANK`` when every rank has it, else from consecutive blocks of ``local_world_size``."""
    if whole and world_size % local_world_size:
        raise ValueError(
            f"Topology.from_env: {source}={local_world_size} does not divide the world size {world_size}, so the "
            f"ranks cannot form equal nodes. Run the same number of processes on every node (torchrun "
            f"--nproc-per-node) or pass nprocs_per_node that divides {world_size}. {_NOTHING}"
        )
    keys = [info.node_key for info in infos]
    if any(key is None for key in keys):
        keys = [info.rank // local_world_size for info in infos]
    members: dict[int, list[int]] = defaultdict(list)
    for info, key in zip(infos, keys):
        members[int(key)].append(info.rank)
    sizes = {len(ranks) for ranks in members.values()}
    expected = local_world_size if whole else None
    if len(sizes) != 1 or (expected is not None and sizes != {expected}):
        described = ", ".join(f"node {key}: {_ranks(ranks)}" for key, ranks in sorted(members.items()))
        raise ValueError(
            f"Topology.from_env: the nodes do not hold the same number of ranks ({described}; {source}="
            f"{local_world_size}). Every node must run the same number of processes of this group. {_NOTHING}"
        )
    return NodeLayout(tuple(tuple(ranks) for ranks in members.values()))


def build_from_groups(intra_group: GroupLike, inter_group: GroupLike, group: Optional[GroupLike]) -> Built:
    """See :meth:`~shardkit.distributed.Topology.from_groups`."""
    world, rank = world_and_rank(group)
    if is_dummy(world):
        return _from_dummy_groups(intra_group, inter_group, world)
    error: Optional[str] = None
    members: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    try:
        members = (_members_of(intra_group, "intra_group"), _members_of(inter_group, "inter_group"))
    except (TypeError, ValueError) as err:
        error = str(err)
    gathered = all_gather_objects((rank, members, error), world, "Topology.from_groups")
    for other, _, other_error in gathered:
        if other_error is not None:
            raise ValueError(f"Topology.from_groups: rank {other}: {other_error}. {_NOTHING}")
    layout = _layout_from_members([(r, m[0], m[1]) for r, m, _ in gathered])
    return Built(layout, rank, world, intra_group, inter_group)


def _members_of(group: Any, name: str) -> tuple[int, ...]:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup this rank belongs to, got {type(group).__name__} "
            "(pass dist.new_group(...)'s result for the groups this rank is in)"
        )
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _layout_from_members(gathered: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> NodeLayout:
    """Check that the intra groups split the world evenly and each inter group pairs equal local ranks."""
    world = sorted(rank for rank, _, _ in gathered)
    intra_of = {rank: intra for rank, intra, _ in gathered}
    inter_of = {rank: inter for rank, _, inter in gathered}
    nodes = sorted(set(intra_of.values()))
    sizes = {len(node) for node in nodes}
    inter_sizes = {len(inter) for inter in inter_of.values()}
    if len(sizes) != 1 or len(inter_sizes) != 1 or next(iter(sizes)) * next(iter(inter_sizes)) != len(world):
        raise ValueError(
            f"Topology.from_groups: intra-node group sizes {sorted(sizes)} times inter-node group sizes "
            f"{sorted(inter_sizes)} must equal the world size {len(world)}: give every rank an intra-node group of "
            f"the ranks on its node and an inter-node group of one rank per node. {_NOTHING}"
        )
    for rank, intra in intra_of.items():
        if rank not in intra or any(intra_of.get(other) != intra for other in intra):
            raise ValueError(
                f"Topology.from_groups: rank {rank}'s intra-node group {list(intra)} is not the same group on all "
                f"its members (or does not contain rank {rank}); the intra-node groups must split the world into "
                f"disjoint nodes. {_NOTHING}"
            )
    for rank, inter in inter_of.items():
        positions = {intra_of[other].index(other) if other in intra_of else -1 for other in inter}
        node_count = len({intra_of.get(other) for other in inter})
        if rank not in inter or len(positions) != 1 or node_count != len(inter):
            raise ValueError(
                f"Topology.from_groups: rank {rank}'s inter-node group {list(inter)} must hold one rank of every "
                f"node, all at the same position on their node (local rank), and include rank {rank}. {_NOTHING}"
            )
    return NodeLayout(tuple(nodes))


def _from_dummy_groups(intra_group: Any, inter_group: Any, world: GroupLike) -> Built:
    if not (is_dummy(intra_group) and is_dummy(inter_group)):
        raise TypeError("Topology.from_groups on a DummyProcessGroup world needs dummy intra and inter groups too")
    nprocs, num_nodes = group_size(intra_group), group_size(inter_group)
    if nprocs * num_nodes != group_size(world):
        raise ValueError(
            f"Topology.from_groups: intra-node size {nprocs} times inter-node size {num_nodes} must equal the world "
            f"size {group_size(world)}"
        )
    rank = group_rank(inter_group) * nprocs + group_rank(intra_group)
    return Built(NodeLayout.contiguous(group_size(world), nprocs), rank, world, intra_group, inter_group)


def build_from_mesh(mesh: Any, group: Optional[GroupLike]) -> Built:
    """See :meth:`~shardkit.distributed.Topology.from_mesh`."""
    world, rank = world_and_rank(group)
    error: Optional[str] = None
    rows: list[list[int]] = []
    try:
        rows = _mesh_rows(mesh)
    except (TypeError, ValueError) as err:
        error = str(err)
    gathered = all_gather_objects((rank, rows, error), world, "Topology.from_mesh")
    for other, _, other_error in gathered:
        if other_error is not None:
            raise ValueError(f"Topology.from_mesh: rank {other}: {other_error}. {_NOTHING}")
    if any(other_rows != gathered[0][1] for _, other_rows, _ in gathered):
        raise ValueError(f"Topology.from_mesh: the ranks passed different meshes; build one mesh on all. {_NOTHING}")
    world_ranks = sorted(other for other, _, _ in gathered)
    if sorted(r for row in rows for r in row) != world_ranks:
        raise ValueError(
            f"Topology.from_mesh: the mesh {rows} must cover exactly the world group's ranks {world_ranks}; build "
            f"it with init_device_mesh(device, (num_nodes, nprocs_per_node)) over the same ranks. {_NOTHING}"
        )
    layout = NodeLayout(tuple(tuple(row) for row in rows))
    return Built(layout, rank, world, mesh.get_group(1), mesh.get_group(0))


def _mesh_rows(mesh: Any) -> list[list[int]]:
    ranks = getattr(mesh, "mesh", None)
    if ranks is None or not callable(getattr(mesh, "get_group", None)):
        raise TypeError(f"expected a torch DeviceMesh, got {type(mesh).__name__}")
    if ranks.ndim != 2:
        raise ValueError(
            f"the mesh has {ranks.ndim} dimension(s) (shape {list(ranks.shape)}); a node topology needs a 2-D mesh "
            "of shape (num_nodes, nprocs_per_node): dim 0 across nodes, dim 1 inside a node"
        )
    return [list(map(int, row)) for row in ranks.tolist()]


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


__all__ = ["Built", "build_from_env", "build_from_groups", "build_from_mesh"]
