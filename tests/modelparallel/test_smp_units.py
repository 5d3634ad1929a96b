"""Unit tests without processes: config, topology, schedules, micro-batch splitting, StepOutput."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from shardkit.modelparallel import StepOutput
from shardkit.modelparallel.config import ModelParallelConfig, config_differences
from shardkit.modelparallel.pipeline.pipeline_parallel import Action, one_f_one_b_schedule, simple_schedule
from shardkit.modelparallel.step import split_microbatch
from shardkit.modelparallel.topology import Topology


def test_config_validates_and_names_unknown_keys() -> None:
    cfg = ModelParallelConfig.from_dict({"pipeline_parallel_degree": 2, "microbatches": 4, "optimize": "speed"})
    assert cfg.partitions == 2 and cfg.effective_memory_weight == 0.2
    assert ModelParallelConfig().effective_memory_weight == 0.8
    with pytest.raises(ValueError, match=r"'micro_batches': not an smp config key(.|\n)*supported keys"):
        ModelParallelConfig.from_dict({"micro_batches": 4})
    with pytest.raises(ValueError, match="pipeline"):
        ModelParallelConfig(pipeline="1f1b")
    with pytest.raises(ValueError, match="default_partition=2 must be smaller than partitions=2"):
        ModelParallelConfig(partitions=2, default_partition=2)
    with pytest.raises(ValueError, match="memory_weight"):
        ModelParallelConfig(memory_weight=1.5)
    with pytest.raises(TypeError, match="microbatches"):
        ModelParallelConfig(microbatches=2.0)  # type: ignore[arg-type]
    assert config_differences([{"a": 1, "b": 2}, {"a": 1, "b": 3}]) == ["  b: rank 0: 2, rank 1: 3"]


def test_topology_cluster_and_spread() -> None:
    cluster = [Topology(8, r, 2, "cluster") for r in range(8)]
    assert cluster[0].mp_group_ranks(0) == [0, 1] and cluster[0].dp_group_ranks(0) == [0, 2, 4, 6]
    spread = [Topology(8, r, 2, "spread") for r in range(8)]
    assert spread[0].mp_group_ranks(0) == [0, 4] and spread[6].dp_rank == 2 and spread[6].mp_rank == 1
    for topo in cluster + spread:
        assert topo.rank_of(topo.mp_rank, topo.dp_rank) == topo.rank
    with pytest.raises(ValueError, match="multiple of partitions"):
        Topology(6, 0, 4)


def test_one_f_one_b_is_warmup_steady_cooldown() -> None:
    assert [repr(a) for a in one_f_one_b_schedule(0, 4, 6)] == (
        ["F0", "F1", "F2"] + ["F3", "B0", "F4", "B1", "F5", "B2"] + ["B3", "B4", "B5"]
    )
    assert [repr(a) for a in one_f_one_b_schedule(3, 4, 3)] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert [repr(a) for a in one_f_one_b_schedule(0, 4, 2)] == ["F0", "F1", "B0", "B1"]
    for stage in range(4):
        for m in (1, 3, 8):
            actions = one_f_one_b_schedule(stage, 4, m)
            assert sorted(actions) == sorted(simple_schedule(m))
            for k in range(m):  # every backward after its forward; at most (stages - stage) in flight
                assert actions.index(Action("F", k)) < actions.index(Action("B", k))
            in_flight = [
                sum(1 for a in actions[: i + 1] if a.kind == "F") - sum(1 for a in actions[: i + 1] if a.kind == "B")
                for i in range(len(actions))
            ]
            assert max(in_flight) <= 4 - stage


def test_split_microbatch_handles_containers_and_errors() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.arange(8).view(8, 1), "pair": Pair(torch.arange(4), "tag"), "scalar": torch.tensor(3.0)}
    second = split_microbatch(batch, 4, 1, 0, "'batch'")
    assert second["x"].flatten().tolist() == [2, 3] and second["pair"].x.tolist() == [1]
    assert second["pair"].y == "tag" and second["scalar"].item() == 3.0
    with pytest.raises(ValueError, match=r"'batch'\['x'\]: size 8 along axis 0 is not divisible by microbatches=3"):
        split_microbatch(batch, 3, 0, 0, "'batch'")

    class Custom:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def smp_slice(self, num_mb: int, mb: int, axis: int) -> Custom:
            return Custom(self.t.chunk(num_mb, axis)[mb])

    assert split_microbatch(Custom(torch.arange(6)), 3, 2, 0, "c").t.tolist() == [4, 5]


def test_step_output_reductions() -> None:
    out = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    assert out.reduce_mean().tolist() == [2.0, 4.0] and out.reduce_sum().tolist() == [4.0, 8.0]
    assert out.concat().tolist() == [1.0, 2.0, 3.0, 6.0] and out.stack().shape == (2, 2)
