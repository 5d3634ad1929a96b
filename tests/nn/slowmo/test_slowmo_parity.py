"""Every rank's parameters after every step equal the single-process simulation of SlowMo's equations.

One multi-process job per (world size, nprocs_per_node) trains all cases in turn (a job start costs more than a
case); the tests then compare each case's trajectory. nprocs_per_node=2 simulates nodes of two ranks each.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from slowmo_reference import Case, PlainSGD, flat_params, make_batch, make_model, simulate

from shardkit.nn.data_parallel import SlowMoDistributedDataParallel
from shardkit.testing import run_distributed

SLOW = dict(slowmo_lr=1.3, slowmo_momentum=0.5)

CASES = [
    Case("localsgd", localsgd_frequency=2),
    Case("localsgd_slowmo_plain", localsgd_frequency=2, **SLOW),  # type: ignore[arg-type]
    Case("localsgd_slowmo_sharded", localsgd_frequency=2, memory_efficient=True, **SLOW),  # type: ignore[arg-type]
    Case("localsgd_slowmo_3shards", localsgd_frequency=2, memory_efficient=True, num_shards=3, **SLOW),  # type: ignore[arg-type]
    Case("localsgd_slowmo_offgrid", localsgd_frequency=3, **SLOW),  # type: ignore[arg-type]
    Case("sgp_pushsum_default_graph", algorithm="sgp", graph="default"),
    Case("sgp_pushsum_ring", algorithm="sgp", graph="ring"),
    Case("sgp_pushsum_bipartite", algorithm="sgp", graph="bipartite_exp"),
    Case("sgp_pushsum_npdde2", algorithm="sgp", graph="npdde2"),
    Case("sgp_pushsum_star_skewed", algorithm="sgp", graph="star", skewed=True),
    Case("sgp_pushpull_dde", algorithm="sgp", graph="dde", push_sum=False),
    Case("sgp_pushpull_bipartite_lin", algorithm="sgp", graph="bipartite_lin", push_sum=False),
    Case("sgp_slowmo_plain", algorithm="sgp", graph="star", skewed=True, **SLOW),  # type: ignore[arg-type]
    Case("sgp_slowmo_sharded", algorithm="sgp", graph="star", skewed=True, memory_efficient=True, **SLOW),  # type: ignore[arg-type]
    Case("sgp_overlap", algorithm="sgp", graph="star", skewed=True, overlap=True, **SLOW),  # type: ignore[arg-type]
    Case("sgp_average_params", algorithm="sgp", graph="dde", average_params=True, slowmo_frequency=3),
]
LAYOUTS = [(2, 1), (4, 1), (4, 2), (2, 2)]
SHARDED_PAIRS = [
    ("localsgd_slowmo_plain", "localsgd_slowmo_sharded"),
    ("localsgd_slowmo_plain", "localsgd_slowmo_3shards"),
    ("sgp_slowmo_plain", "sgp_slowmo_sharded"),
]


def _train_cases(rank: int, world_size: int, nprocs_per_node: int, cases: list[Case]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    node, nodes = rank // nprocs_per_node, world_size // nprocs_per_node
    for case in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # off-grid frequencies and one-node layouts warn on purpose
            net = SlowMoDistributedDataParallel(make_model(), nprocs_per_node, **case.wrapper_kwargs(node, nodes))
        opt = PlainSGD(net.parameters(), lr=case.lr)
        trajectory = []
        for step in range(case.steps):
            x, y = make_batch(rank, step)
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            net.perform_slowmo(opt)  # type: ignore[arg-type]
            trajectory.append(_snapshot(net))
        if case.overlap:
            net.eval()  # finishes the round in flight
            trajectory.append(_snapshot(net))
        results[case.name] = trajectory
    return results


def _snapshot(net: SlowMoDistributedDataParallel) -> tuple[list[float], float]:
    # Plain lists: tensors would travel through shared memory that dies with the worker process.
    weight = net.state_dict().get("ps_weight", torch.ones(1))
    return flat_params(net.module).tolist(), float(weight[0])


@functools.cache
def _job(world_size: int, nprocs_per_node: int) -> list[dict[str, Any]]:
    results = run_distributed(_train_cases, world_size, nprocs_per_node, CASES, timeout_s=120)
    return [
        {name: [(torch.tensor(x), w) for x, w in trajectory] for name, trajectory in per_rank.items()}
        for per_rank in results
    ]


@pytest.mark.parametrize("world_size,nprocs_per_node", LAYOUTS, ids=[f"ws{w}-npn{n}" for w, n in LAYOUTS])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_rank_follows_the_simulation(case: Case, world_size: int, nprocs_per_node: int) -> None:
    per_rank = [result[case.name] for result in _job(world_size, nprocs_per_node)]
    expected = simulate(case, world_size, nprocs_per_node, drain_at_end=case.overlap)
    assert len(per_rank[0]) == len(expected)
    for step, states in enumerate(expected):
        for rank, (x_expected, w_expected) in enumerate(states):
            x, w = per_rank[rank][step]
            assert torch.allclose(x, x_expected, rtol=1e-5, atol=1e-6), (
                f"{case.name} step {step} rank {rank}: max diff {(x - x_expected).abs().max().item():.3g}"
            )
            assert abs(w - w_expected) < 1e-5, f"{case.name} step {step} rank {rank}: weight {w} != {w_expected}"
    # The trajectory really moves, and replicas really differ between synchronisations (except where gossip
    # between two nodes with equal shares is itself an exact average).
    assert not torch.equal(per_rank[0][0][0], per_rank[0][-1][0])
    nodes = world_size // nprocs_per_node
    if nodes > 2 or (nodes == 2 and (case.algorithm == "localsgd" or case.skewed)):
        assert any(not torch.equal(per_rank[0][s][0], per_rank[-1][s][0]) for s in range(case.steps))


@pytest.mark.parametrize("world_size,nprocs_per_node", LAYOUTS, ids=[f"ws{w}-npn{n}" for w, n in LAYOUTS])
@pytest.mark.parametrize("name", [c.name for c in CASES if c.slowmo_lr != 1.0])
def test_every_rank_holds_identical_parameters_after_each_slow_momentum_step(
    name: str, world_size: int, nprocs_per_node: int
) -> None:
    case = next(c for c in CASES if c.name == name)
    per_rank = [result[name] for result in _job(world_size, nprocs_per_node)]
    for step in range(case.slowmo_frequency - 1, case.steps, case.slowmo_frequency):
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][step][0], per_rank[0][step][0]), f"{name}: rank {rank} step {step}"


@pytest.mark.parametrize("world_size,nprocs_per_node", LAYOUTS, ids=[f"ws{w}-npn{n}" for w, n in LAYOUTS])
@pytest.mark.parametrize("plain,sharded", SHARDED_PAIRS)
def test_memory_efficient_and_plain_slow_momentum_agree(
    plain: str, sharded: str, world_size: int, nprocs_per_node: int
) -> None:
    results = _job(world_size, nprocs_per_node)
    for rank in range(world_size):
        for (a, wa), (b, wb) in zip(results[rank][plain], results[rank][sharded]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and abs(wa - wb) < 1e-6
