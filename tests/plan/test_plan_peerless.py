"""The peerless process group: collectives complete at once and every peer mirrors the planned rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import collectives, count_comm_bytes
from shardkit.distributed.groups import planned_on_gloo
from shardkit.distributed.objects import all_gather_objects
from shardkit.plan.peerless import peerless_world


def test_collectives_mirror_this_rank_and_are_counted() -> None:
    with peerless_world(world_size=4, rank=1) as traffic:
        assert dist.get_world_size() == 4 and dist.get_rank() == 1
        out = torch.zeros(8)
        collectives.all_gather_into_tensor(out, torch.tensor([1.0, 2.0]))
        assert out.tolist() == [1.0, 2.0] * 4
        shard = torch.zeros(2)
        collectives.reduce_scatter_tensor(shard, torch.arange(8.0))
        assert shard.tolist() == [2.0, 3.0]  # rank 1's chunk
        assert all_gather_objects({"sig": 7}, None, "test") == [{"sig": 7}] * 4
        with count_comm_bytes() as meter:
            collectives.all_reduce(torch.ones(16))
        assert meter.wire_bytes["all_reduce"] == int(2 * 3 / 4 * 64)
        assert traffic.payload_bytes["all_reduce"] == 64
    assert not dist.is_initialized()


def test_meta_tensors_cost_nothing_and_the_group_is_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), peerless_world(world_size=64):
        full = torch.empty(64 * 10**9, device="meta")
        collectives.all_gather_into_tensor(full, torch.empty(10**9, device="meta"))
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_refuses_a_process_that_has_its_own_group() -> None:
    with peerless_world(world_size=2), pytest.raises(RuntimeError, match="child process"), peerless_world(2):
        pass


def test_a_gloo_plan_holds_transfers_until_waited_and_stands_for_gloo() -> None:
    meta = torch.empty(4, device="meta")
    with peerless_world(world_size=2, backend="gloo"):
        assert planned_on_gloo(None, meta) and not planned_on_gloo(None, torch.empty(4))
        assert planned_on_gloo(dist.new_group([0, 1]), meta)  # groups made inside the plan stand for gloo too
        arrived = torch.full((4,), 7.0)
        work = dist.irecv(arrived, src=1)
        assert work is not None
        assert arrived.tolist() == [1.0] * 4  # what no planned rank sent reads as ones, not as stale memory
        assert not work.is_completed()  # on gloo a transfer may still be running when code polls it
        work.wait()
        assert work.is_completed()
    with peerless_world(world_size=2):  # accelerator plans: collectives, transfers done at once
        assert not planned_on_gloo(None, meta)
        sent = dist.isend(torch.ones(2), dst=1)
        assert sent is not None and sent.is_completed()


def test_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="'nccl' or 'gloo'"), peerless_world(world_size=2, backend="mpi"):
        pass
    assert not dist.is_initialized()


def test_a_planned_topology_checks_its_groups_against_the_layout() -> None:
    from shardkit.distributed import NodeLayout, Topology

    with peerless_world(world_size=4):
        world = dist.group.WORLD
        assert world is not None
        node, across = dist.new_group([0, 1]), dist.new_group([0, 2])
        topo = Topology.planned(NodeLayout.contiguous(4, 2), 0, world, node, across)
        assert (topo.num_nodes, topo.local_rank, topo.node_rank) == (2, 0, 0)
        with pytest.raises(ValueError, match="do not fit the layout"):
            Topology.planned(NodeLayout.contiguous(4, 2), 0, world, across, world)  # groups swapped for sizes
