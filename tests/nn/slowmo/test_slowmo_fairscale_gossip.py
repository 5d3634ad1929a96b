"""fairscale's gossip-package API: stateful graph peers, mixing weights, the PushSum/PushPull gossipers (checked
against a simulation of the same rounds), communicate and CudaEventRecorder."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardkit.experimental.nn.data_parallel.gossip as gossip
from shardkit.experimental.nn.data_parallel import SlowMoDistributedDataParallel
from shardkit.nn.slowmo import MixingManager, MixingShares
from shardkit.testing import run_distributed

WORLD = 4
ROUNDS = 5


class LopsidedMixing(MixingManager):
    """Keeps 0.6 and splits 0.4 over the out-peers: not uniform, so push-sum weights must travel."""

    def is_uniform(self) -> bool:
        return False

    def shares(self, out_peers: list[int]) -> MixingShares:
        return MixingShares(keep=0.6, send={p: 0.4 / len(out_peers) for p in out_peers})


def _start(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64) * (rank + 1) + rank**2


def _simulate(graph_cls: type, mixing_cls: type, rounds: int) -> tuple[list[torch.Tensor], list[float]]:
    """The same rounds computed in one process from the graphs' stateless peers."""
    graphs = [graph_cls(r, WORLD) for r in range(WORLD)]
    mixings = [mixing_cls(g) for g in graphs]
    x = [_start(r) for r in range(WORLD)]
    w = [1.0] * WORLD
    for round_index in range(rounds):
        new_x = [torch.zeros_like(x[0]) for _ in range(WORLD)]
        new_w = [0.0] * WORLD
        for r in range(WORLD):
            shares = mixings[r].shares(graphs[r].out_peers(round_index))
            new_x[r] += shares.keep * x[r]
            new_w[r] += shares.keep * w[r]
            for peer, share in shares.send.items():
                new_x[peer] += share * x[r]
                new_w[peer] += share * w[r]
        x, w = new_x, new_w
    return x, w


def _gossip_job(rank: int, world_size: int, graph_name: str, gossiper_name: str, mixing_name: str) -> dict[str, Any]:
    graph = getattr(gossip, graph_name)(rank, world_size)
    mixing = LopsidedMixing(graph) if mixing_name == "lopsided" else gossip.UniformMixing(graph, None)
    gossiper = getattr(gossip, gossiper_name)(_start(rank), graph, mixing=mixing, rank=rank, world_size=world_size)
    x, w = _start(rank), torch.ones(1, dtype=torch.float64)
    for _ in range(ROUNDS):
        lo = float(gossiper.mixing_weights["lo"])
        x, w = x * lo, w * lo
        received, received_w = gossiper.mix(x, w)
        x, w = x + received, w + received_w
    return dict(x=x, w=float(w))


@pytest.mark.parametrize(
    "graph_name,gossiper_name,mixing_name",
    [
        ("DynamicDirectedExponentialGraph", "PushSum", "lopsided"),
        ("RingGraph", "PushPull", "uniform"),
        ("NPeerDynamicDirectedExponentialGraph", "PushSum", "uniform"),
    ],
)
def test_gossipers_follow_the_simulated_rounds(graph_name: str, gossiper_name: str, mixing_name: str) -> None:
    results = run_distributed(_gossip_job, WORLD, graph_name, gossiper_name, mixing_name, timeout_s=90)
    mixing_cls = LopsidedMixing if mixing_name == "lopsided" else gossip.UniformMixing
    expected_x, expected_w = _simulate(getattr(gossip, graph_name), mixing_cls, ROUNDS)
    # Mixing weights are float32 tensors (as in fairscale), so float64 messages agree to float32 precision.
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["x"], expected_x[rank], rtol=1e-6, atol=1e-6)
        assert result["w"] == pytest.approx(expected_w[rank], rel=1e-6)
    # Mass is conserved: the sum of the values and of the weights is what it was.
    total = sum(r["x"] for r in results)
    torch.testing.assert_close(total, sum(_start(r) for r in range(WORLD)), rtol=1e-6, atol=1e-6)
    assert sum(r["w"] for r in results) == pytest.approx(WORLD, rel=1e-6)


def _misc_job(rank: int, world_size: int) -> dict[str, Any]:
    tensors = [torch.full((2, 3), float(rank)), torch.full((4,), rank, dtype=torch.int64), torch.ones(1) * rank]
    gossip.communicate(tensors, functools.partial(dist.all_reduce))
    graph = gossip.RingGraph(rank, world_size)
    errors = []
    for make in (
        lambda: gossip.PushPull(torch.zeros(3), graph, mixing=LopsidedMixing(graph)),
        lambda: gossip.PushSum(torch.zeros(3), graph, rank=rank + 1),
        lambda: gossip.PushSum(torch.zeros(3), gossip.RingGraph((rank + 1) % world_size, world_size)),
    ):
        try:
            make()
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    return dict(sums=[t.tolist() for t in tensors], errors=errors)


def test_communicate_and_bad_gossiper_arguments() -> None:
    results = run_distributed(_misc_job, 2, timeout_s=60)
    for result in results:
        assert result["sums"] == [[[1.0] * 3] * 2, [1] * 4, [1.0]]  # 0 + 1 on every element, dtypes kept
        push_pull, wrong_rank, wrong_node = result["errors"]
        assert "doubly stochastic" in push_pull
        assert "rank=" in wrong_rank
        assert "built for node" in wrong_node


def test_stateful_peers_and_edges_rotate_like_fairscale() -> None:
    # Expected values are fairscale 0.4.13's for the same graphs (out-peers in process ranks, in-peers in nodes).
    graph = gossip.NPeerDynamicDirectedExponentialGraph(1, 4, nprocs_per_node=2, local_rank=0, peers_per_itr=1)
    assert graph.get_peers() == ([4], [0])
    assert graph.get_peers(rotate=True) == ([6], [3])
    assert graph.get_peers(rotate=True) == ([4], [0])
    out_edges, in_edges = graph.get_edges()
    assert [(e.src, e.dest) for e in out_edges] == [(2, 4)] and [(e.src, e.dest) for e in in_edges] == [(0, 2)]
    with pytest.raises(AttributeError, match="point-to-point"):
        _ = out_edges[0].process_group
    ring = gossip.RingGraph(0, 4, peers_per_itr=2)
    assert ring.get_peers() == ([1, 3], [3, 1])  # in-peers by peer slot, then node


def test_mixing_weights_in_fairscale_form() -> None:
    graph = gossip.NPeerDynamicDirectedExponentialGraph(1, 4, 2, 1, 2)
    mixing = gossip.UniformMixing(graph, None)
    third = torch.tensor([1 / 3])
    plain = mixing.get_mixing_weights(residual_adjusted=False)
    assert set(plain) == {"lo", "uniform", 4, 6} and all(torch.allclose(v, third) for v in plain.values())
    adjusted = mixing.get_mixing_weights()
    assert torch.allclose(adjusted["lo"], third)
    assert all(torch.allclose(adjusted[k], torch.ones(1)) for k in ("uniform", 4, 6))


def test_event_recorder_times_on_cpu() -> None:
    recorder = gossip.CudaEventRecorder("sleep")
    with pytest.raises(RuntimeError, match="stop"):
        recorder.find_time_elapsed()
    time.sleep(0.02)
    recorder.stop()
    assert 15.0 <= recorder.find_time_elapsed() < 5000.0


def test_fairscale_submodule_paths() -> None:
    from shardkit.experimental.nn.data_parallel.gossip import distributed, gossiper, graph_manager, mixing_manager
    from shardkit.experimental.nn.data_parallel.gossip.utils import communicate
    from shardkit.experimental.nn.data_parallel.gossip.utils.cuda_metering import CudaEventRecorder

    assert distributed.SlowMoDistributedDataParallel is SlowMoDistributedDataParallel
    assert gossiper.PushSum is gossip.PushSum and graph_manager.RingGraph is gossip.RingGraph
    assert mixing_manager.UniformMixing is gossip.UniformMixing
    assert communicate is gossip.communicate and CudaEventRecorder is gossip.CudaEventRecorder
