"""The comm meter splits bytes into intra- and inter-node by the ring model; comm_delay can slow only the bytes
that cross nodes."""

import time

import pytest
import torch
from link_spy import link_sleeps

from shardkit.distributed import NodeLayout, Topology, comm_delay, count_comm_bytes, set_topology
from shardkit.distributed import collectives as C
from shardkit.distributed.node_traffic import active_layout, inter_node_share, node_of
from shardkit.testing import run_distributed

TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2), "LOCAL_RANK": str(rank % 2)} for rank in range(4)]


@pytest.fixture
def two_by_two():
    set_topology(NodeLayout.contiguous(4, 2))
    yield
    set_topology(None)


def test_share_model_for_each_pattern(two_by_two) -> None:
    assert inter_node_share([0, 1], "ring") == 0.0  # one node: nothing leaves it
    assert inter_node_share([0, 1, 2, 3], "ring") == 0.5  # 2 of the ring's 4 links join nodes
    assert inter_node_share([0, 2], "ring") == 1.0  # one rank per node: every byte crosses
    assert inter_node_share([0, 2, 1, 3], "ring") == 1.0  # interleaved ring: every link crosses
    assert inter_node_share([0, 1, 2, 3], "exchange") == pytest.approx(8 / 12)
    assert inter_node_share([0, 1, 2, 3], "rooted", me=1) == pytest.approx(2 / 3)
    assert inter_node_share([1], "p2p", 0, peer=0) == 0.0 and inter_node_share([1], "p2p", 0, peer=3) == 1.0
    with pytest.raises(ValueError, match="unknown traffic pattern"):
        inter_node_share([0, 2], "tree")


def test_layout_falls_back_to_the_environment(monkeypatch) -> None:
    assert active_layout() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert [node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert node_of(5) == 0  # no layout anywhere: one node
    with pytest.raises(TypeError, match="set_topology takes"):
        set_topology(4)  # type: ignore[arg-type]


def test_meter_record_splits_and_resets() -> None:
    from shardkit.distributed import CommMeter

    meter = CommMeter()
    meter.record("all_reduce", 100, 150.0, 50.0)
    meter.record("all_reduce", 100, 150.0, 0.0)
    assert meter.inter_node_bytes["all_reduce"] == 50 and meter.intra_node_bytes["all_reduce"] == 250
    assert meter.total_inter_node_bytes + meter.total_intra_node_bytes == meter.total_wire_bytes == 300
    meter.reset()
    assert meter.total_inter_node_bytes == 0 and not meter.intra_node_bytes


def _timed_all_reduce(group, label: str) -> dict[str, object]:
    with link_sleeps() as slept:
        start = time.perf_counter()
        C.all_reduce(torch.ones(256), group=group, label=label)
        elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "slept": slept}


def _metered(rank: int, world_size: int) -> dict:
    topo = Topology.from_env()
    out = {}
    nbytes = 256 * 4
    with count_comm_bytes() as meter:  # layout from LOCAL_WORLD_SIZE: nothing set yet
        C.all_reduce(torch.ones(256), label="world")
        C.all_reduce(torch.ones(256), group=topo.intra_group, label="node")
        C.all_gather_into_tensor(torch.empty(512), torch.ones(256), group=topo.inter_group, label="cross")
        C.reduce_scatter_tensor(torch.empty(256), torch.ones(1024), label="rs", by_sends=True)
        peer = rank ^ 2  # the same local rank on the other node
        handles = [C.send(torch.ones(256), peer), C.recv(torch.empty(256), peer)]
        C.wait_all(handles)
    out["wire"] = dict(meter.wire_bytes)
    out["inter"] = dict(meter.inter_node_bytes)
    out["intra"] = dict(meter.intra_node_bytes)
    out["expected_world"] = int(2 * 3 / 4 * nbytes)
    set_topology(NodeLayout(((0, 1, 2, 3),)))  # say it is one node after all: nothing crosses
    with count_comm_bytes() as one_node:
        C.all_reduce(torch.ones(256), label="world")
    out["one_node_inter"] = one_node.total_inter_node_bytes
    try:
        set_topology(NodeLayout.contiguous(2, 1))  # ranks 2 and 3 on no node: refused before anything is counted
    except ValueError as err:
        out["partial"] = str(err)
    set_topology(topo)
    with comm_delay(0.3, None, scope="inter_node"):
        out["t_node"] = _timed_all_reduce(topo.intra_group, "node")
        out["t_cross"] = _timed_all_reduce(topo.inter_group, "cross")
    return out


def test_meter_and_inter_node_link_on_two_simulated_nodes() -> None:
    for got in run_distributed(_metered, 4, rank_env=TWO_NODES):
        world = got["expected_world"]
        assert got["wire"]["all_reduce"] == world + 2 * (1 / 2) * 1024  # world + node all-reduces
        assert got["inter"]["all_reduce"] == world // 2  # half the world ring's links cross; the node's none
        assert got["inter"]["all_gather"] == got["wire"]["all_gather"] == 1024  # (2-1)/2 of 2 KiB, all across
        assert got["inter"]["reduce_scatter"] == int(3 / 4 * 4096 * 8 / 12)  # 8 of 12 sender/receiver pairs
        assert got["inter"]["send"] == 1024 and got["intra"]["send"] == 0
        for op, wire in got["wire"].items():
            assert got["inter"][op] + got["intra"][op] == wire
        assert got["one_node_inter"] == 0
        assert "must place every global rank 0..3 of this job on a node" in got["partial"]
        assert got["t_node"]["slept"] == []  # the node's all-reduce never waited on the slow link
        assert len(got["t_cross"]["slept"]) == 1 and got["t_cross"]["elapsed"] >= 0.29  # the cross one did


def test_comm_delay_scope_is_validated() -> None:
    with pytest.raises(ValueError, match="'all' or 'inter_node'"), comm_delay(0.1, scope="cross"):
        pass
