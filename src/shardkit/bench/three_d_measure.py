"""The workers of ``shardkit bench 3d``: train each smp layout on this rank, time its steps, measure its memory.

Every layout trains :func:`shardkit.models.smp_lm.smp_lm` through smp's public API (``smp.init`` with the layout's
``partitions`` / ``tensor_parallel_degree`` / ``ddp``, ``smp.DistributedModel``, ``smp.DistributedOptimizer`` over
AdamW, one ``@smp.step`` per step), on the same global batch. The layouts take turns in rounds (the order reversed
every round, each step behind a barrier), so load on the machine hits them alike. After the timed rounds each layout
trains once more under :func:`shardkit.plan.measure.measure_rank`: the peak (shardkit's ``MemoryTracker``), the state
after the step (the real tensors) and the bytes sent (the comm meter), as the planner's accuracy checks measure them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import shardkit.modelparallel as smp
from shardkit.plan.layouts import Layout
from shardkit.plan.measure import RealRank, measure_rank
from shardkit.plan.pipeline import initialised_build, pipeline_forward_backward
from shardkit.plan.workloads import Workload, next_token_cross_entropy


@dataclass(frozen=True)
class ThreeDSettings:
    """The model, batch and schedule; plain data handed to every worker."""

    vocab: int = 512
    dim: int = 128
    heads: int = 4
    layers: int = 4
    seq: int = 64
    #: Sequences per rank (one replica of ``p`` stages feeds ``p`` times this, ``p x t`` with ``prescaled_batch`` over
    #: ``t`` tensor ranks): every layout's global batch is ``batch x world size``.
    batch: int = 2
    steps: int = 4
    warmup: int = 1
    rounds: int = 2

    def workload(self, layout: Layout) -> Workload:
        """What one replica of ``layout`` trains (the planner plans the same)."""
        sizes = {"vocab": self.vocab, "dim": self.dim, "heads": self.heads, "layers": self.layers}
        return Workload.smp_lm(
            overrides=sizes, batch_size=self.batch * layout.replica_ranks, seq_len=self.seq,
            strategy_options=layout.options(self.batch),
        )  # fmt: skip


@dataclass
class LayoutRun:
    """One layout on one rank: its timed steps (seconds, in order) and its measured memory and traffic."""

    label: str
    step_s: list[float]
    real: RealRank


def _time_steps(work: Workload, s: ThreeDSettings) -> list[float]:
    """``s.warmup`` untimed then ``s.steps`` timed steps of a freshly built model (smp initialised and reset)."""
    config = dict(work.strategy_options)
    torch.manual_seed(0)  # the same weights on every rank, as a training script seeds them
    model = smp.DistributedModel(initialised_build(config, work.build))
    try:
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        batch = work.batch()
        times = []
        for step in range(s.warmup + s.steps):
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            pipeline_forward_backward(model, batch, next_token_cross_entropy)  # one @smp.step for all
            optimizer.step()
            if step >= s.warmup:
                times.append(time.perf_counter() - start)
        return times
    finally:
        smp.reset()


def worker(s: ThreeDSettings, layouts: list[Layout]) -> list[LayoutRun]:
    """Every layout on this rank: the timed rounds, then one measured step each."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {layout.label: [] for layout in layouts}
    for round_ in range(s.rounds):
        for layout in layouts if round_ % 2 == 0 else layouts[::-1]:
            times[layout.label] += _time_steps(s.workload(layout), s)
    runs = [LayoutRun(x.label, times[x.label], measure_rank(s.workload(x), "smp")) for x in layouts]
    dist.destroy_process_group()
    return runs


def quick(s: ThreeDSettings) -> ThreeDSettings:
    """Toy sizes and one step per round: seconds, for the plumbing test."""
    return replace(s, vocab=64, dim=32, layers=2, seq=16, steps=1, warmup=1, rounds=2)


__all__ = ["LayoutRun", "ThreeDSettings", "quick", "worker"]
