"""Measure a real multi-process run the way the planner predicts one, with an instrument independent of ours.

Each gloo rank builds the model with the same builder the planner uses, trains the same steps, and reports its peak
as torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) saw it, its state (the storages of its
parameters, gradients and optimizer state after the reported step, counted on the real tensors), and what
shardkit's comm meter counted in the
reported step. Used by the accuracy tests and ``shardkit bench plan``.

Example::

    real = measure_real(Workload.bench_lm(), ["ddp", "fsdp"], world_size=2)
    print(real["fsdp"][0].peak_bytes, real["fsdp"][0].comm_wire_bytes)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.bench.memory import training_memory
from shardkit.distributed import Topology, count_comm_bytes, set_topology
from shardkit.plan.runner import WARMUP_STEPS, call_model
from shardkit.plan.strategies import get
from shardkit.plan.workloads import Workload
from shardkit.testing.harness import run_distributed


@dataclass(frozen=True)
class RealRank:
    """What one rank of a real run held and sent."""

    peak_bytes: int
    state_bytes: int
    #: Bytes per collective kind the comm meter counted in the reported step (its wire estimate).
    comm_wire_bytes: dict[str, int]
    #: The part of them that crossed nodes (empty without a node layout).
    inter_node_bytes: dict[str, int]


def _peak(snapshot: dict[Any, dict[str, int]]) -> int:
    return sum(int(per_device.get("Total", 0)) for per_device in snapshot.values())


def _measure_one(workload: Workload, strategy: str, topology: Optional[Topology]) -> RealRank:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    batch = workload.batch()
    with MemTracker() as tracker:
        model = workload.build()
        wrapped, optimizer, after_step = get(strategy).build(
            model, workload.optimizer, dict(workload.optimizer_options), dict(workload.strategy_options), topology
        )
        tracker.track_external(wrapped, optimizer)
        state = 0
        for step in range(WARMUP_STEPS + 1):
            with count_comm_bytes() as meter:
                loss = workload.loss(call_model(wrapped, batch), batch)
                loss.backward()
                del loss
                optimizer.step()
                after_step()
            if step == WARMUP_STEPS:
                # Counted on the real tensors themselves: MemTracker files gradients that a strategy assigns
                # (rather than autograd accumulating them) under temporaries.
                state = training_memory(wrapped, optimizer).total
            optimizer.zero_grad()
            tracker.reset_mod_stats()  # MemTracker refuses a second forward of a module without it
        peak = _peak(tracker.get_tracker_snapshot("peak"))
    dist.barrier()
    return RealRank(peak, state, dict(meter.wire_bytes), dict(meter.inter_node_bytes))


def _worker(rank: int, world_size: int, workload: Workload, strategies: list[str]) -> dict[str, RealRank]:
    torch.set_num_threads(1)
    topology = None
    if workload.nprocs_per_node is not None:
        topology = Topology.from_env(nprocs_per_node=workload.nprocs_per_node)
        set_topology(topology)  # the meter's view of the nodes, as the planner sets it
    return {name: _measure_one(workload, name, topology) for name in strategies}


def measure_real(workload: Workload, strategies: Sequence[str], world_size: int) -> dict[str, list[RealRank]]:
    """Train ``workload`` with each of ``strategies`` in turn on ``world_size`` gloo processes.

    Returns every rank's measurements per strategy, in rank order.
    """
    per_rank = run_distributed(_worker, world_size, workload, list(strategies))
    return {name: [ranks[name] for ranks in per_rank] for name in strategies}


__all__ = ["RealRank", "measure_real"]
