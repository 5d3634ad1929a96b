"""Measure a real multi-process run the way the planner predicts one, with an instrument independent of ours.

Each gloo rank builds the model with the same builder the planner uses and trains the same steps. It reports its
peak as torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) saw it (for smp, whose micro-batches run
each module several times per step, which MemTracker refuses: shardkit's ``MemoryTracker``); its state, the
storages of its parameters, gradients, optimizer state and buffers (a BERT's position ids: the planner counts them
with the parameters) after the reported step, counted on the real tensors;
and what shardkit's comm meter counted in the reported step. Used by the accuracy tests and ``shardkit bench plan``.

Example::

    real = measure_real(Workload.bench_lm(), ["ddp", "fsdp"], world_size=2)
    print(real["fsdp"][0].peak_bytes, real["fsdp"][0].comm_wire_bytes)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

import shardkit.modelparallel as smp
from shardkit.distributed import Topology, count_comm_bytes, set_topology
from shardkit.distributed.spawn import run_distributed
from shardkit.memory import MemoryTracker
from shardkit.memory.meter import training_memory
from shardkit.plan._torch_private import mem_tracker
from shardkit.plan.pipeline import builder, initialised_build, pipeline_forward_backward, smp_config
from shardkit.plan.runner import call_model, warmup_steps
from shardkit.plan.strategies import PIPELINE, get
from shardkit.plan.tensor_parallel import data_group, tensor_parallel_state
from shardkit.plan.workloads import Workload
from shardkit.strategies.registry import OptimizerSpec
from shardkit.tensor_parallel import step_check


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


class _TorchTracker:
    """torch's ``MemTracker``: the peak over every step."""

    def __init__(self) -> None:
        self.tracker = mem_tracker()

    def __enter__(self) -> _TorchTracker:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    def watch(self, model: torch.nn.Module, optimizer: Any) -> None:
        # smp's DistributedOptimizer wraps a torch optimizer (its public .optimizer), which MemTracker can track.
        self.tracker.track_external(model, getattr(optimizer, "optimizer", optimizer))

    def step_done(self) -> None:
        self.tracker.reset_mod_stats()  # MemTracker refuses a second forward of a module without it

    def peak(self) -> int:
        return _peak(self.tracker.get_tracker_snapshot("peak"))


class _ShardkitTracker:
    """shardkit's ``MemoryTracker``, for pipelines: MemTracker refuses a module running twice in one step (once per
    micro-batch)."""

    def __init__(self) -> None:
        self.tracker = MemoryTracker()

    def __enter__(self) -> _ShardkitTracker:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    def watch(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.tracker.watch(model, getattr(optimizer, "optimizer", optimizer))

    def step_done(self) -> None:
        return None

    def peak(self) -> int:
        return int(self.tracker.peak.total)


def _buffer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the module's buffers, each storage once."""
    storages = {buf.untyped_storage().data_ptr(): buf.untyped_storage().nbytes() for buf in model.buffers()}
    return sum(storages.values())


def measure_rank(workload: Workload, strategy: str, topology: Optional[Topology] = None) -> RealRank:
    """This rank of a real run of ``workload`` under ``strategy`` (every rank calls it): its peak, its state after
    the reported step and its bytes sent (see the module docstring)."""
    torch.manual_seed(0)
    options, optim_options = dict(workload.strategy_options), dict(workload.optimizer_options)
    world_size = dist.get_world_size()
    tracker: Union[_ShardkitTracker, _TorchTracker] = _ShardkitTracker() if strategy == PIPELINE else _TorchTracker()
    with tracker:
        # Made while tracked: a real run holds its batch in device memory, as the planner counts it (for images a
        # visible share of a small model's peak).
        batch = workload.batch()
        if strategy == PIPELINE:  # smp first: smp.nn's tensor-parallel layers read the layout when built
            config = smp_config(options, world_size)
            model = initialised_build(config, workload.build)
            build = builder(config, workload.optimizer, optim_options)
            wrapped, optimizer, after_step = build(model, topology)
        else:
            model = workload.build()
            spec = OptimizerSpec(workload.optimizer, optim_options)
            wrapped, optimizer, after_step = get(strategy).build(model, spec, data_group(), options, topology)
        tracker.watch(wrapped, optimizer)
        state = 0
        warmup = warmup_steps(strategy)
        for step in range(warmup + 1):
            with count_comm_bytes() as meter, step_check.suspended():  # the algorithm's traffic alone
                if strategy == PIPELINE:
                    pipeline_forward_backward(wrapped, batch, workload.loss)
                else:
                    loss = workload.loss(call_model(wrapped, batch), batch)
                    loss.backward()
                    del loss
                optimizer.step()
                after_step()
            if step == warmup:
                # Counted on the real tensors themselves: MemTracker files gradients that a strategy assigns
                # (rather than autograd accumulating them) under temporaries.
                state = training_memory(wrapped, optimizer).total + _buffer_bytes(wrapped)
            optimizer.zero_grad()
            tracker.step_done()
        peak = tracker.peak()
    if strategy == PIPELINE:
        smp.reset()
    dist.barrier()
    return RealRank(peak, state, dict(meter.wire_bytes), dict(meter.inter_node_bytes))


def _worker(rank: int, world_size: int, workload: Workload, strategies: list[str]) -> dict[str, RealRank]:
    torch.set_num_threads(1)
    topology = None
    if workload.nprocs_per_node is not None:
        topology = Topology.from_env(nprocs_per_node=workload.nprocs_per_node)
        set_topology(topology)  # the meter's view of the nodes, as the planner sets it
    with tensor_parallel_state(workload.tensor_parallel):  # the planner's layout: tensor ranks consecutive
        return {name: measure_rank(workload, name, topology) for name in strategies}


def measure_real(workload: Workload, strategies: Sequence[str], world_size: int) -> dict[str, list[RealRank]]:
    """Train ``workload`` with each of ``strategies`` in turn on ``world_size`` gloo processes.

    Returns every rank's measurements per strategy, in rank order.
    """
    per_rank = run_distributed(_worker, world_size, workload, list(strategies))
    return {name: [ranks[name] for ranks in per_rank] for name in strategies}


__all__ = ["RealRank", "measure_rank", "measure_real"]
