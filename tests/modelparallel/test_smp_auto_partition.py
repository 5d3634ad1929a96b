"""Auto-partitioning: tracing, atom selection and the balanced cut (single process, no training)."""

from __future__ import annotations

import itertools
import random

import torch
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel.partitioning.auto_partition import balanced_cut
from shardkit.modelparallel.partitioning.partitioner import plan_partition
from shardkit.testing.models import LMConfig, TransformerLM


def test_bench_lm_two_stages_are_balanced_and_printable() -> None:
    with torch.device("meta"):  # shapes and FLOPs only: no memory, no compute
        model = TransformerLM(LMConfig.bench())
    tokens = torch.zeros(1, LMConfig.bench().seq_len, dtype=torch.long, device="meta")
    plan, placement = plan_partition(model, (tokens,), partitions=2)
    costs = placement.stage_costs
    assert (max(costs) - min(costs)) / max(costs) <= 0.15, placement
    assert placement.modules_on(0)[:2] == ["embed", "blocks.0"] and placement.modules_on(1)[-2:] == ["ln_f", "head"]
    # Whole blocks are placed (never opened), and only the hand-over between stages crosses: one activation.
    assert all(name.count(".") <= 1 for name, _ in placement.modules)
    edges = [(c.unit, dst) for c in plan.calls for leaf in c.consumers for dst in leaf]
    assert len(edges) == 1 and edges[0][1] == 1
    # The tied embedding lives on both stages; the positional parameter of the root is used by glue code.
    assert plan.holders["embed.weight"] == (0, 1) and "pos" in plan.replicated
    text = str(placement)
    assert "stage" in text and "blocks.3" in text and "head" in text


class HugeBlock(nn.Module):
    """Most of the model's compute, in sub-layers that each run once."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 256)
        self.d = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(torch.relu(self.b(torch.relu(self.a(x))))))


def test_one_huge_layer_with_sublayers_is_split_across_stages() -> None:
    model = nn.Sequential(nn.Linear(32, 32), HugeBlock(), nn.Linear(32, 32))
    plan, placement = plan_partition(model, (torch.randn(4, 32),), partitions=2, memory_weight=0.5)
    stages = {placement.stage_of(n) for n, _ in placement.modules if n.startswith("1.")}
    assert stages == {0, 1}, placement  # the huge block was opened and its layers spread over both stages
    assert placement.imbalance < 0.2, placement
    whole = plan_partition(model, (torch.randn(4, 32),), partitions=1)[1].stage_costs[0]
    assert max(placement.stage_costs) < 0.6 * whole  # unopened, the block alone would cost ~0.9 of it
    assert plan.monotone


def test_one_huge_leaf_layer_gets_a_stage_of_its_own() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1024), nn.Linear(1024, 16))
    _, placement = plan_partition(model, (torch.randn(4, 16),), partitions=3, memory_weight=0.0)
    assert all(placement.modules_on(s) for s in range(3)), placement
    assert len(placement.modules_on(placement.stage_of("2"))) == 1, placement  # the huge layer sits alone


def test_balanced_cut_is_optimal_and_contiguous() -> None:
    rng = random.Random(0)
    for _ in range(40):
        n, p = rng.randint(1, 9), rng.randint(1, 4)
        weights = [rng.random() for _ in range(n)]
        stages = balanced_cut(weights, p)
        assert stages == sorted(stages) and len(stages) == n
        if n >= p:
            assert set(stages) == set(range(p))
        best = min(
            max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
            for cuts in itertools.combinations(range(1, n), min(p, n) - 1)
        )
        got = max(sum(w for w, s in zip(weights, stages) if s == k) for k in set(stages))
        assert abs(got - best) < 1e-12


def test_manual_partition_marks_modules_created_inside() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with smp.partition(1):
                self.child0 = nn.Linear(4, 4)
                with smp.partition(2):
                    self.child1 = nn.Linear(4, 4)
                self.child2 = nn.Linear(4, 4)
                layers = [nn.Linear(4, 4) for _ in range(2)]
            self.child3 = nn.Linear(4, 4)
            self.stack = nn.ModuleList(layers)  # created inside, registered outside: keeps partition 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.child3(self.child2(self.child1(self.child0(x))))
            for layer in self.stack:
                x = layer(x)
            return x

    model = Model()
    plan, _ = plan_partition(model, (torch.randn(2, 4),), partitions=3, auto_partition=False)
    assert plan.units == {"child0": 1, "child1": 2, "child2": 1, "child3": 0, "stack": 1}
    assert not plan.monotone  # child3 (stage 0) consumes child2's output (stage 1)
