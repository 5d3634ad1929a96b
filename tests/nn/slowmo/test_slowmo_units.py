"""Pure unit tests (no processes): gossip graphs, mixing, the step schedule, argument checking."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from slowmo_reference import SkewedMixing, StarGraph

from shardkit.nn.slowmo import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
    SlowMoBaseAlgorithm,
    UniformMixing,
)
from shardkit.nn.slowmo.config import configs_from_arguments
from shardkit.nn.slowmo.layout import ProcessLayout
from shardkit.nn.slowmo.schedule import plan_step
from shardkit.nn.slowmo.topology import resolve_topology

BUILTIN_GRAPHS = [
    RingGraph,
    DynamicDirectedExponentialGraph,
    NPeerDynamicDirectedExponentialGraph,
    DynamicBipartiteExponentialGraph,
    DynamicDirectedLinearGraph,
    DynamicBipartiteLinearGraph,
]

DEFAULTS: dict[str, Any] = dict(
    world_size=4,
    slowmo_base_algorithm="localsgd",
    broadcast_buffers=True,
    slowmo_momentum=0.5,
    slowmo_memory_efficient=True,
    slowmo_frequency=48,
    slowmo_lr=1.0,
    slowmo_num_shards=32,
    localsgd_frequency=3,
    push_sum=True,
    overlap=False,
    synch_freq=0,
    use_streams=True,
    slowmo_sgp_average_params=False,
    verbose=False,
    profile_mode=False,
    comm_device=None,
)


def _config(**overrides: Any) -> Any:
    return configs_from_arguments(**{**DEFAULTS, **overrides})


# ----------------------------------------------------------------------------- graphs and mixing


def test_directed_exponential_graph_cycles_through_powers_of_two() -> None:
    graph = DynamicDirectedExponentialGraph(rank=0, world_size=4)
    assert [graph.out_peers(r) for r in range(4)] == [[1], [3], [2], [1]]
    assert [graph.in_peers(r) for r in range(3)] == [[3], [1], [2]]


def test_ring_is_static_and_npeer_sends_to_several_peers() -> None:
    ring = RingGraph(2, 4)
    assert ring.out_peers(0) == ring.out_peers(5) == [3] and ring.in_peers(3) == [1]
    npeer = NPeerDynamicDirectedExponentialGraph(0, 4, peers_per_itr=2)
    assert npeer.out_peers(0) == [1, 2] and npeer.in_peers(0) == [2, 3]


def test_exponential_graph_reaches_exact_powers_of_two() -> None:
    # 9 nodes: distance 8 = 2**3 must be present (a float log2(8) that rounds down would drop it).
    assert 8 in NPeerDynamicDirectedExponentialGraph(0, 9).phone_book[0]


@pytest.mark.parametrize("graph_cls", BUILTIN_GRAPHS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("num_nodes", [2, 4, 6, 8])
def test_builtin_graphs_are_consistent_and_regular(graph_cls: Any, num_nodes: int) -> None:
    graphs = [graph_cls(n, num_nodes) for n in range(num_nodes)]
    for round_index in range(6):
        for n, graph in enumerate(graphs):
            assert n not in graph.out_peers(round_index)
            for peer in graph.out_peers(round_index):
                assert n in graphs[peer].in_peers(round_index)
        receivers = [peer for g in graphs for peer in g.out_peers(round_index)]
        assert sorted(set(receivers)) == list(range(num_nodes)) and len(receivers) == num_nodes * len(
            graphs[0].out_peers(0)
        )
    assert graphs[0].is_regular_graph()


@pytest.mark.parametrize("graph_cls", [DynamicBipartiteExponentialGraph, DynamicBipartiteLinearGraph])
def test_bipartite_graphs_need_an_even_number_of_nodes(graph_cls: Any) -> None:
    with pytest.raises(ValueError, match="even number of nodes"):
        graph_cls(0, 5)
    graph = graph_cls(1, 4)
    assert all(graph.is_passive(p) for p in graph.phone_book[1]) and not graph.is_passive()


def test_graph_needs_two_nodes() -> None:
    with pytest.raises(ValueError, match="nobody to gossip with"):
        RingGraph(0, 1)


def test_star_graph_is_not_regular_and_mixing_shares_sum_to_one() -> None:
    assert not StarGraph(0, 4).is_regular_graph()
    shares = UniformMixing(DynamicDirectedExponentialGraph(0, 8)).shares([1, 2, 3])
    assert shares.keep == 0.25 and sum(shares.send.values()) + shares.keep == 1.0
    assert UniformMixing(RingGraph(0, 4)).is_regular()
    assert not SkewedMixing(RingGraph(0, 4)).is_regular()


# ----------------------------------------------------------------------------- the schedule


def _plans(config: Any, steps: int, num_nodes: int = 2) -> list[Any]:
    return [plan_step(config, s, num_nodes) for s in range(steps)]


def test_localsgd_averages_every_few_steps_and_memory_efficient_slowmo_replaces_that_average() -> None:
    efficient = _plans(_config(localsgd_frequency=3, slowmo_frequency=6), 12)
    assert [p.step for p in efficient if p.exact_average] == [2, 8]
    assert [p.step for p in efficient if p.slow_momentum] == [5, 11]
    plain = _plans(_config(localsgd_frequency=3, slowmo_frequency=6, slowmo_memory_efficient=False), 12)
    assert [p.step for p in plain if p.exact_average] == [2, 5, 8, 11]
    disabled = _plans(_config(localsgd_frequency=3, slowmo_frequency=6, slowmo_momentum=0.0), 12)
    assert not any(p.slow_momentum for p in disabled)


def test_sgp_gossips_every_step_except_when_an_exact_average_replaces_it() -> None:
    plans = _plans(_config(slowmo_base_algorithm="sgp", slowmo_frequency=4), 8)
    assert [p.step for p in plans if not p.gossip] == [3, 7]
    assert [p.step for p in plans if p.slow_momentum] == [3, 7]
    periodic = _plans(_config(slowmo_base_algorithm="sgp", slowmo_frequency=4, slowmo_momentum=0.0), 8)
    assert all(p.gossip and not p.exact_average for p in periodic)  # slow momentum off: pure gossip
    averaged = _config(
        slowmo_base_algorithm="sgp", slowmo_frequency=4, slowmo_momentum=0.0, slowmo_sgp_average_params=True
    )
    assert [p.step for p in _plans(averaged, 8) if p.exact_average] == [3, 7]


def test_overlap_drains_on_sync_steps_and_before_every_exact_average() -> None:
    plans = _plans(_config(slowmo_base_algorithm="sgp", overlap=True, synch_freq=3, slowmo_frequency=8), 8)
    assert [p.step for p in plans if p.drain_gossip] == [2, 5, 7]
    every = _plans(_config(slowmo_base_algorithm="sgp", overlap=True, synch_freq=0), 3)
    assert all(p.drain_gossip for p in every)


def test_one_node_only_runs_slow_momentum_and_eval_starts_no_gossip() -> None:
    plans = _plans(_config(slowmo_base_algorithm="sgp", slowmo_frequency=2), 4, num_nodes=1)
    assert not any(p.gossip or p.exact_average for p in plans) and [p.slow_momentum for p in plans][1]
    assert not plan_step(_config(slowmo_base_algorithm="sgp"), 0, 4, gossip_enabled=False).gossip
    assert "exact_average" in _plans(_config(), 3)[2].describe()


# ----------------------------------------------------------------------------- argument checking


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(slowmo_base_algorithm="gossip"), "unknown slowmo_base_algorithm"),
        (dict(slowmo_frequency=0), "slowmo_frequency"),
        (dict(localsgd_frequency=1.5), "localsgd_frequency"),
        (dict(synch_freq=-1), "synch_freq"),
        (dict(slowmo_lr=0.0), "slowmo_lr"),
        (dict(slowmo_momentum=-0.1), "slowmo_momentum"),
    ],
)
def test_bad_arguments_raise_with_the_argument_name(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_slowmo_frequency_off_the_localsgd_grid_warns_only_when_it_matters() -> None:
    with pytest.warns(UserWarning, match="not a multiple of localsgd_frequency"):
        _config(slowmo_frequency=10, localsgd_frequency=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config(slowmo_frequency=12, localsgd_frequency=3)
        _config(slowmo_frequency=10, localsgd_frequency=3, slowmo_momentum=0.0)  # slow momentum off
        _config(slowmo_frequency=10, localsgd_frequency=3, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP)
    assert _config(slowmo_num_shards=32).slow_momentum.num_shards == 4


def test_unknown_graph_and_mixing_combinations_raise() -> None:
    layout = ProcessLayout(process_rank=0, world_size=4, nprocs_per_node=1)
    sgp = SlowMoBaseAlgorithm.SGP
    with pytest.raises(ValueError, match="push-pull"):
        resolve_topology(sgp, layout, StarGraph(0, 4), None, push_sum=False)
    ring = RingGraph(0, 4)
    with pytest.raises(ValueError, match="mixing is not uniform"):
        resolve_topology(sgp, layout, ring, SkewedMixing(ring), push_sum=False)
    with pytest.raises(ValueError, match="different graph"):
        resolve_topology(sgp, layout, RingGraph(0, 4), UniformMixing(RingGraph(0, 4)), push_sum=True)
    with pytest.raises(ValueError, match="does not match this job"):
        resolve_topology(sgp, layout, RingGraph(1, 4), None, push_sum=True)
    with pytest.raises(ValueError, match="does not match this job"):
        resolve_topology(sgp, layout, RingGraph(0, 8), None, push_sum=True)
    with pytest.raises(TypeError, match="GraphManager"):
        resolve_topology(sgp, layout, "ring", None, push_sum=True)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="LocalSGD does not gossip"):
        assert resolve_topology(SlowMoBaseAlgorithm.LOCALSGD, layout, RingGraph(0, 4), None, True) is None
    graph, mixing = resolve_topology(sgp, layout, None, None, push_sum=False)  # type: ignore[misc]
    assert isinstance(graph, NPeerDynamicDirectedExponentialGraph) and isinstance(mixing, UniformMixing)
    assert resolve_topology(sgp, layout, None, UniformMixing(ring), push_sum=True)[0] is ring  # type: ignore[index]
