"""Topology: node layouts from torchrun's environment, from group pairs and from a 2-D DeviceMesh; bad layouts
refused on every rank before any group is created."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardkit.distributed import DummyProcessGroup, NodeLayout, Topology
from shardkit.distributed.node_layout import GROUP_CACHE
from shardkit.testing import run_distributed

TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2), "LOCAL_RANK": str(rank % 2)} for rank in range(4)]


def test_layout_contiguous_and_lookups() -> None:
    layout = NodeLayout.contiguous(world_size=6, nprocs_per_node=3)
    assert layout.nodes == ((0, 1, 2), (3, 4, 5))
    assert (layout.num_nodes, layout.nprocs_per_node, layout.world_size) == (2, 3, 6)
    assert layout.is_same_node(0, 2) and not layout.is_same_node(2, 3)
    assert layout.local_rank_of(4) == 1 and layout.node_of(4) == 1
    assert layout.inter_node_ranks() == ((0, 3), (1, 4), (2, 5))
    assert layout.nodes_spanned([0, 1]) == 1 and layout.nodes_spanned([2, 3, 5]) == 2
    # Given out of order, nodes are sorted by smallest rank and ranks inside a node ascending.
    assert NodeLayout(((3, 2), (1, 0))).nodes == ((0, 1), (2, 3))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: NodeLayout.contiguous(4, 3), "divide the world size"),
        (lambda: NodeLayout(((0, 1), (2,))), "same number of ranks"),
        (lambda: NodeLayout(((0, 1), (1, 2))), "on two nodes"),
        (lambda: NodeLayout.contiguous(4, 2).node_of(7), "none of the nodes"),
    ],
)
def test_layout_rejects_bad_nodes(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_dummy_world_gets_dummy_groups() -> None:
    topo = Topology.from_env(DummyProcessGroup(rank=5, size=8), nprocs_per_node=4)
    assert (topo.num_nodes, topo.nprocs_per_node, topo.node_rank, topo.local_rank) == (2, 4, 1, 1)
    assert (topo.intra_group.rank(), topo.intra_group.size()) == (1, 4)
    assert (topo.inter_group.rank(), topo.inter_group.size()) == (1, 2)
    pair = Topology.from_groups(topo.intra_group, topo.inter_group, DummyProcessGroup(rank=5, size=8))
    assert pair.layout == topo.layout and pair.rank == 5


def _sums(topo: Topology, rank: int) -> tuple[float, float]:
    intra, inter = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    dist.all_reduce(intra, group=topo.intra_group)
    dist.all_reduce(inter, group=topo.inter_group)
    return intra.item(), inter.item()


def _three_ways(rank: int, world_size: int) -> dict:
    topo = Topology.from_env()
    again = Topology.from_env()  # cached: the same group objects, no new collective creation
    pair = Topology.from_groups(topo.intra_group, topo.inter_group)
    mesh = Topology.from_mesh(init_device_mesh("cpu", (2, 2)))
    return {
        "facts": (topo.num_nodes, topo.nprocs_per_node, topo.node_rank, topo.local_rank),
        "same_node": [topo.is_same_node(rank, other) for other in range(world_size)],
        "cached": again.intra_group is topo.intra_group and again.inter_group is topo.inter_group,
        "group_ranks": (dist.get_rank(topo.intra_group), dist.get_rank(topo.inter_group)),
        "env": _sums(topo, rank),
        "pair": (pair.layout == topo.layout, _sums(pair, rank)),
        "mesh": (mesh.layout == topo.layout, mesh.node_rank, mesh.local_rank, _sums(mesh, rank)),
    }


def test_env_pair_and_mesh_describe_the_same_two_nodes() -> None:
    results = run_distributed(_three_ways, 4, rank_env=TWO_NODES)
    for rank, got in enumerate(results):
        node, local = divmod(rank, 2)
        node_sum = float(4 * node + 1)  # ranks 2n and 2n+1
        cross_sum = float(local + local + 2)  # ranks l and l+2
        assert got["facts"] == (2, 2, node, local)
        assert got["same_node"] == [other // 2 == node for other in range(4)]
        assert got["cached"]
        assert got["group_ranks"] == (local, node)
        assert got["env"] == (node_sum, cross_sum)
        assert got["pair"] == (True, (node_sum, cross_sum))
        assert got["mesh"] == (True, node, local, (node_sum, cross_sum))


def _subworld(rank: int, world_size: int) -> object:
    sub = dist.new_group([0, 2, 3])
    if rank == 1:
        return None
    topo = Topology.from_env(sub, nprocs_per_node=None)
    return topo.layout.nodes, topo.node_rank, _sums(topo, rank)


def test_subgroup_world_keeps_its_members_per_node() -> None:
    # Nodes {0,1} and {2,3}; the world [0, 2, 3] has unequal nodes: refused on all its members, nothing hangs.
    with pytest.raises(Exception, match="do not hold the same number of ranks"):
        run_distributed(_subworld, 4, rank_env=TWO_NODES)


def _subworld_even(rank: int, world_size: int) -> object:
    sub = dist.new_group([0, 2])
    other = dist.new_group([0, 2])  # a second world of the same ranks: its node groups are the first one's
    if rank in (1, 3):
        return None
    topo = Topology.from_env(sub)
    again = Topology.from_env(other)
    shared = again.intra_group is topo.intra_group and again.inter_group is other
    return topo.layout.nodes, topo.node_rank, topo.nprocs_per_node, _sums(topo, rank), shared, _sums(again, rank)


def test_subgroup_world_one_rank_per_node() -> None:
    results = run_distributed(_subworld_even, 4, rank_env=TWO_NODES)
    assert results[0] == (((0,), (2,)), 0, 1, (0.0, 2.0), True, (0.0, 2.0))
    assert results[2] == (((0,), (2,)), 1, 1, (2.0, 2.0), True, (2.0, 2.0))


def _refuse(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "no error"


def _bad_inputs(rank: int, world_size: int) -> dict:
    out = {}
    os.environ["LOCAL_WORLD_SIZE"] = "3" if rank == 3 else "2"
    out["differs"] = _refuse(Topology.from_env)
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    os.environ.pop("GROUP_RANK", None)
    out["divide"] = _refuse(Topology.from_env)
    os.environ["LOCAL_WORLD_SIZE"] = "two" if rank == 1 else "2"
    out["garbage"] = _refuse(Topology.from_env)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["mesh_1d"] = _refuse(lambda: Topology.from_mesh(init_device_mesh("cpu", (4,))))
    world = dist.group.WORLD
    out["sizes"] = _refuse(lambda: Topology.from_groups(world, world))
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    out["crossed"] = _refuse(lambda: Topology.from_groups(nodes[rank // 2], crossed[0 if rank in (0, 3) else 1]))
    out["created"] = len(GROUP_CACHE)
    check = torch.ones(1)
    dist.all_reduce(check)  # the ranks are still in step after every refusal
    out["after"] = check.item()
    return out


def test_bad_layouts_fail_on_every_rank_before_any_group() -> None:
    results = run_distributed(_bad_inputs, 4, timeout_s=60)
    for got in results:
        assert "disagree on the number of processes per node" in got["differs"]
        assert "ranks [0, 1, 2] see LOCAL_WORLD_SIZE=2; rank 3 see LOCAL_WORLD_SIZE=3" in got["differs"]
        assert "LOCAL_WORLD_SIZE=3 does not divide the world size 4" in got["divide"]
        assert "rank 1: LOCAL_WORLD_SIZE='two' is not an integer" in got["garbage"]
        assert "1 dimension(s)" in got["mesh_1d"] and "2-D mesh" in got["mesh_1d"]
        assert "must equal the world size 4" in got["sizes"]
        assert "same position on their node" in got["crossed"]
        assert all("No process group was created" in got[key] for key in ("differs", "divide", "garbage", "sizes"))
        assert got["created"] == 0 and got["after"] == 4.0


def test_harness_needs_one_environment_per_rank() -> None:
    with pytest.raises(ValueError, match="one dict per rank"):
        run_distributed(_sums, 2, rank_env=[{}])
